"""Read a Hugging Face checkpoint folder without PyTorch: config → ModelSpec, safetensors → numpy.

safetensors' own numpy loader cannot return bfloat16 (numpy has no such dtype), and bf16 is what most
checkpoints ship, so tensors are read here from the documented file layout (8-byte little-endian header
length, JSON header, raw data) through a read-only memory map: nothing is loaded until it is used,
and bf16 is widened to fp32 exactly by a 16-bit shift.
"""

from __future__ import annotations

import hashlib
import json
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


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{path}: config.json has no '{key}'")
    return cfg[key]


def read_spec(model_dir: Path) -> ModelSpec:
    """Parse and validate config.json; unsupported architectures or rope scalings are clear errors."""
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json: is it a Hugging Face checkpoint folder?")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture {arch!r} in {path}; supported: "
                              + ", ".join(SUPPORTED_ARCHITECTURES))
    hidden = int(_need(cfg, "hidden_size", path))
    heads = int(_need(cfg, "num_attention_heads", path))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in SUPPORTED_ROPE_SCALING:
            raise CheckpointError(f"unsupported rope_scaling type {kind!r} in {path}; supported: "
                                  + ", ".join(SUPPORTED_ROPE_SCALING) + " (or none)")
        scaling = {**scaling, "rope_type": kind}
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    return ModelSpec(
        architecture=arch, hidden_size=hidden, num_layers=int(_need(cfg, "num_hidden_layers", path)),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(_need(cfg, "intermediate_size", path)),
        vocab_size=int(_need(cfg, "vocab_size", path)), max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        sliding_window=int(window) if window and int(window) < max_pos else None,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
    )


class SafetensorsFile:
    """One .safetensors file, memory-mapped; tensors come back as numpy (bf16 widened to fp32)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                # A header length past the file's end is not a safetensors file (reading it: MemoryError).
                if n > size - 8:
                    raise CheckpointError(f"{path} is not a safetensors file (header length {n} exceeds the "
                                          f"file's {size} bytes)")
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
    """All tensors of a checkpoint folder (single file or sharded with model.safetensors.index.json)."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
                if not all(isinstance(f, str) and Path(f).name == f for f in files):
                    raise ValueError("shard names must be file names in the checkpoint folder")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir} has no *.safetensors weights")
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) listed in the index are missing: {', '.join(missing)}")
        self.files = [SafetensorsFile(model_dir / f) for f in files]
        self._where = {name: f for f in self.files for name in f.names()}

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
    """tokenizer.json is required; the config files travel with it when present."""
    tok = model_dir / "tokenizer.json"
    if not tok.is_file():
        raise CheckpointError(f"{model_dir} has no tokenizer.json (a fast-tokenizer file is required)")
    extra = ["tokenizer_config.json", "generation_config.json", "special_tokens_map.json"]
    return [tok] + [model_dir / n for n in extra if (model_dir / n).is_file()]


def fingerprint(model_dir: Path) -> str:
    """sha256 over config, tokenizer and weight files (name + content): identifies the source exactly."""
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and (p.suffix in (".json", ".safetensors")):
            h.update(p.name.encode())
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()
