"""Read a Hugging Face checkpoint folder without PyTorch: config → ModelSpec, safetensors → numpy.

safetensors' own numpy loader cannot return bfloat16 (numpy has no such dtype), and bf16 is what most
checkpoints ship, so tensors are read here from the documented file layout (8-byte little-endian header
length, JSON header, raw data) through a read-only memory map: nothing is loaded until it is used,
and bf16 is widened to fp32 exactly by a 16-bit shift.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from artifact import SUPPORTED_ARCHITECTURES

from .errors import CheckpointError

SUPPORTED_ROPE_SCALING = ("llama3", "linear")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")   # what a weight may be stored as (widened to fp32 when read)
MAX_HEADER_BYTES = 100_000_000                   # the safetensors library's own limit on a header


@dataclass(frozen=True)
class ModelSpec:
    """Everything the graph builder needs to know about a decoder, validated and normalised."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(cfg: dict, key: str, path: Path, default: int | None = None) -> int:
    """A size or count field: an integer ≥ 1 (`default` where it is absent or null; required without one). A zero
    head count or a negative size would build an engine that divides by zero or cannot load, so none gets that far."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"{path}: config.json has no '{key}'")
        return default
    if not _is_int(value) or value < 1:
        raise CheckpointError(f"{path}: '{key}' must be an integer of at least 1, not {value!r}")
    return value


def _finite(value) -> bool:
    """A JSON number finite as a float (not a bool, NaN, ±Infinity, nor an integer past a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _real(cfg: dict, key: str, path: Path, default: float, positive: bool) -> float:
    """A finite number, > 0 (`positive`) or ≥ 0: rope_theta ≤ 0 gave NaN rotary tables, a negative epsilon a graph
    ONNX Runtime refuses to load."""
    value = cfg.get(key)
    value = default if value is None else value
    if not _finite(value) or (value <= 0 if positive else value < 0):
        raise CheckpointError(f"{path}: '{key}' must be a finite number {'above' if positive else 'of at least'} 0, "
                              f"not {value!r}")
    return float(value)


def token_ids(value, key: str, path: Path) -> list[int]:
    """An id or a list of ids (eos_token_id): non-negative integers."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise CheckpointError(f"{path}: '{key}' must be a token id or a list of them, not {value!r}")
    return ids


def json_object(path: Path) -> dict:
    """A JSON file that must hold an object (a config), or a CheckpointError naming it."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


# The fields each rope scaling needs (read by compile/rope.py).
ROPE_SCALING_FIELDS = {"linear": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def read_spec(model_dir: Path) -> ModelSpec:
    """Parse and validate config.json; unsupported architectures or rope scalings are clear errors."""
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json: is it a Hugging Face checkpoint folder?")
    cfg = json_object(path)
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else archs if isinstance(archs, str) else None
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture {arch!r} in {path}; supported: "
                              + ", ".join(SUPPORTED_ARCHITECTURES))
    hidden = _count(cfg, "hidden_size", path)
    heads = _count(cfg, "num_attention_heads", path)
    kv_heads = _count(cfg, "num_key_value_heads", path, default=heads)
    head_dim = _count(cfg, "head_dim", path, default=max(1, hidden // heads))
    if heads % kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise CheckpointError(f"{path}: 'rope_scaling' must be an object, not {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in SUPPORTED_ROPE_SCALING:
            raise CheckpointError(f"unsupported rope_scaling type {kind!r} in {path}; supported: "
                                  + ", ".join(SUPPORTED_ROPE_SCALING) + " (or none)")
        for key in ROPE_SCALING_FIELDS[kind]:
            value = scaling.get(key)
            if not (_finite(value) and value > 0):
                raise CheckpointError(f"{path}: rope_scaling ({kind}) needs '{key}' above 0, not {value!r}")
        if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise CheckpointError(f"{path}: rope_scaling (llama3) needs high_freq_factor above low_freq_factor")
        scaling = {**scaling, "rope_type": kind}
    eos_ids = token_ids(cfg.get("eos_token_id"), "eos_token_id", path)
    bos = cfg.get("bos_token_id")
    if bos is not None and not (_is_int(bos) and bos >= 0):
        raise CheckpointError(f"{path}: 'bos_token_id' must be a token id, not {bos!r}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    window = _count(cfg, "sliding_window", path) if window else None
    max_pos = _count(cfg, "max_position_embeddings", path, default=2048)
    return ModelSpec(
        architecture=arch, hidden_size=hidden, num_layers=_count(cfg, "num_hidden_layers", path),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_count(cfg, "intermediate_size", path),
        vocab_size=_count(cfg, "vocab_size", path), max_position_embeddings=max_pos,
        rms_norm_eps=_real(cfg, "rms_norm_eps", path, 1e-6, positive=False),
        rope_theta=_real(cfg, "rope_theta", path, 10000.0, positive=True),
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        sliding_window=window if window and window < max_pos else None,
        bos_token_id=bos, eos_token_ids=eos_ids,
    )


class SafetensorsFile:
    """One .safetensors file, memory-mapped; tensors come back as numpy (bf16 widened to fp32)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                # A header length past the file's end is not a safetensors file (reading it: MemoryError); one
                # past safetensors' own limit is a corrupt one (a sparse 1 GiB file took 2.1 GB to refuse).
                if n > size - 8:
                    raise CheckpointError(f"{path} is not a safetensors file (header length {n} exceeds the "
                                          f"file's {size} bytes)")
                if n > MAX_HEADER_BYTES:
                    raise CheckpointError(f"{path} is not a safetensors file (header length {n} exceeds "
                                          f"safetensors' limit of {MAX_HEADER_BYTES} bytes)")
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        self.header, self.offset = header, 8 + n
        for name, info in header.items():
            self._check_entry(name, info, size - self.offset)
        self._map = np.memmap(path, dtype=np.uint8, mode="r")

    def _check_entry(self, name: str, info, data_size: int) -> None:
        """The header's claims fit the file: a shape of counts, and offsets that span exactly its bytes."""
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{self.path} is not a safetensors file (bad header entry for {name!r})")
        if end > data_size:
            raise CheckpointError(f"{self.path} is truncated (tensor {name} ends past the file)")
        if dtype in _DTYPES and end - start != int(np.prod(shape)) * np.dtype(_DTYPES[dtype]).itemsize:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {shape} but {end - start} bytes of {dtype}")

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = (self.offset + o for o in info["data_offsets"])
        raw = self._map[start:end].view(dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw


class CheckpointReader:
    """All tensors of a checkpoint folder (single file or sharded with model.safetensors.index.json).

    Each tensor comes from exactly one file: the shard the index names for it, or (without an index) the one file
    that holds it. A name in two files is refused rather than taken from either — a stale copy beside the weights
    (model_old.safetensors, a second shard's leftover) silently built an engine from the wrong tensors."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        weight_map = None
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise ValueError("weight_map must map tensor names to shard files")
                files = sorted(set(weight_map.values()))
                if not all(isinstance(f, str) and Path(f).name == f for f in files):
                    raise ValueError("shard names must be file names in the checkpoint folder")
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir} has no *.safetensors weights")
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) listed in the index are missing: {', '.join(missing)}")
        self.files = [SafetensorsFile(model_dir / f) for f in files]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.names():
                if name in self._where:
                    raise CheckpointError(f"{model_dir}: tensor {name!r} is in both {self._where[name].path.name} and "
                                          f"{f.path.name}; remove the stale file (or fix the index)")
                self._where[name] = f
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in self._where:
                    raise CheckpointError(f"{index} puts tensor {name!r} in {shard}, which does not hold it")
                if self._where[name].path.name != shard:
                    raise CheckpointError(f"{index} puts tensor {name!r} in {shard}, but it is in "
                                          f"{self._where[name].path.name}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        return self._where[name].get(name)

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every tensor the graph reads exists with the shape config.json implies and a float dtype: a mismatched
        checkpoint fails here, in one line naming the tensor, instead of building an engine that fails at load."""
        for name, want in shapes.items():
            if name not in self._where:
                raise CheckpointError(f"checkpoint has no tensor {name!r} (config.json implies it)")
            f = self._where[name]
            info = f.header[name]
            if tuple(info["shape"]) != want:
                raise CheckpointError(f"{f.path.name}: tensor {name} has shape {list(info['shape'])}, config.json "
                                      f"implies {list(want)}")
            if info["dtype"] not in FLOAT_DTYPES:
                raise CheckpointError(f"{f.path.name}: tensor {name} has dtype {info['dtype']}, expected one of "
                                      f"{', '.join(FLOAT_DTYPES)}")

    def dtypes(self) -> set[str]:
        return {f.header[n]["dtype"] for f in self.files for n in f.names()}

    def num_parameters(self) -> int:
        return sum(int(np.prod(f.header[n]["shape"])) for f in self.files for n in f.names())


def tokenizer_files(model_dir: Path) -> list[Path]:
    """tokenizer.json is required; the config files travel with it when present. Each is checked here, before the
    build: a file the tokenizers library cannot read, or a config that is not a JSON object, built an engine that
    crashed at `runtime serve`."""
    from tokenizers import Tokenizer

    tok = model_dir / "tokenizer.json"
    if not tok.is_file():
        raise CheckpointError(f"{model_dir} has no tokenizer.json (a fast-tokenizer file is required)")
    try:
        Tokenizer.from_file(str(tok))
    except Exception as e:   # tokenizers raises its own bare Exception for a malformed file
        raise CheckpointError(f"{tok} is not a tokenizer the tokenizers library can read: {e}") from None
    extra = [model_dir / n for n in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
             if (model_dir / n).is_file()]
    for path in extra:
        json_object(path)
    return [tok] + extra


def fingerprint(model_dir: Path) -> str:
    """sha256 over config, tokenizer and weight files, each as its name's and its content's lengths and bytes:
    identifies the source exactly (names and contents run together let a.json "A" + b.json "B" equal a.json
    "Ab.jsonB")."""
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and (p.suffix in (".json", ".safetensors")):
            name = p.name.encode()
            h.update(struct.pack("<Q", len(name)) + name + struct.pack("<Q", p.stat().st_size))
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()
