"""The weights of a `--target cuda` engine, read from its graph's initializers as float arrays.

The cuda backend executes the model with its own forward (forward.py) instead of the graph, so it reads the
tensors the compiler wrote, by the names the graph builder gave them, and widens the quantized ones once at
load (fp8 per channel, int4 blocks: weight-only quantization, computed as fp16 GEMMs). Every byte comes from
a file the manifest lists and hashes; nothing is read from outside the engine folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

import artifact
from artifact.errors import ArtifactError

_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 10: np.float16,
           16: ml_dtypes.bfloat16, 17: ml_dtypes.float8_e4m3fn}


class Initializers:
    """Name → numpy array over the graph's initializers; external data is memory-mapped, never copied twice."""

    def __init__(self, engine_dir: Path, manifest: dict):
        self.engine_dir = Path(engine_dir).resolve()
        self._graph = artifact.graph_path(self.engine_dir, manifest)     # listed, inside, its external data too
        model = onnx.load(str(self._graph), load_external_data=False)
        self._tensors = {t.name: t for t in model.graph.initializer}
        self._manifest = manifest
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> np.ndarray:
        t = self._tensors.get(name)
        if t is None:
            raise ArtifactError(f"{self.engine_dir}: the graph has no initializer {name!r}; rebuild the engine")
        if t.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        dtype = _DTYPES.get(t.data_type)
        if dtype is None:
            raise ArtifactError(f"{self.engine_dir}: initializer {name} has ONNX type {t.data_type}, which the cuda "
                                "backend does not read")
        location = info["location"]
        if location not in self._maps:
            file = artifact.data_path(self.engine_dir, self._manifest, self._graph, location)
            self._maps[location] = np.memmap(file, np.uint8, "r")
        offset, length = int(info.get("offset", 0)), int(info["length"])
        raw = self._maps[location][offset:offset + length]
        return raw.view(dtype).reshape(tuple(t.dims))


def linear(init: Initializers, name: str) -> np.ndarray:
    """The float weight [K, N] of the linear `name` (x @ W), widened from fp8 or int4 storage."""
    if f"{name}.weight" in init:
        return init.get(f"{name}.weight")
    if f"{name}.weight_fp8" in init:
        return init.get(f"{name}.weight_fp8").astype(np.float32) * init.get(f"{name}.weight_scale")[None, :]
    if f"{name}.weight_q4" in init:
        return _int4(init.get(f"{name}.weight_q4"), init.get(f"{name}.weight_scales")).T
    raise ArtifactError(f"{init.engine_dir}: no weight for {name} in a form the cuda backend reads (float, fp8, int4)")


def table(init: Initializers, name: str) -> np.ndarray:
    """An embedding table [V, H] (the lookup, and the tied LM head), widened from fp8 or int4 storage."""
    if f"{name}.weight" in init:
        return init.get(f"{name}.weight")
    if f"{name}.weight_fp8" in init:
        return init.get(f"{name}.weight_fp8").astype(np.float32) * init.get(f"{name}.weight_scale")[:, None]
    if f"{name}.weight_q4" in init:
        return _int4(init.get(f"{name}.weight_q4"), init.get(f"{name}.weight_scales"))
    raise ArtifactError(f"{init.engine_dir}: no table for {name} in a form the cuda backend reads (float, fp8, int4)")


def _int4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MatMulNBits layout [N, K/bs, bs/2] (element 2i in the low nibble, zero point 8) → float32 [N, K]."""
    n, nb, half = packed.shape
    q = np.empty((n, nb, 2 * half), np.int8)
    q[..., 0::2], q[..., 1::2] = packed & 0x0F, packed >> 4
    return ((q - 8).astype(np.float32) * scales.reshape(n, nb, 1)).reshape(n, nb * 2 * half)


@dataclass
class LayerWeights:
    input_norm: np.ndarray
    qkv: np.ndarray               # [H, (heads + 2 kv_heads) * head_dim]
    qkv_bias: np.ndarray | None
    o_proj: np.ndarray            # [heads * head_dim, H]
    post_norm: np.ndarray
    gate_up: np.ndarray           # [H, 2 F]
    down: np.ndarray              # [F, H]


@dataclass
class ModelWeights:
    embed: np.ndarray             # [V, H]
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: np.ndarray           # [V, H] (the embedding table when tied)
    cos: np.ndarray               # [max_seq_len, head_dim / 2]
    sin: np.ndarray


def load_weights(engine_dir: Path, manifest: dict | None = None) -> ModelWeights:
    """Every tensor the forward needs, as numpy arrays (memory-mapped where stored as float)."""
    manifest = manifest or artifact.load(Path(engine_dir), verify=False)
    init = Initializers(Path(engine_dir), manifest)
    layers = []
    for i in range(manifest["model"]["num_layers"]):
        p = f"/model/layers.{i}"
        bias = f"{p}/attn/qkv_proj.bias"
        layers.append(LayerWeights(
            init.get(f"{p}/input_layernorm.weight"), linear(init, f"{p}/attn/qkv_proj"),
            init.get(bias) if bias in init else None, linear(init, f"{p}/attn/o_proj"),
            init.get(f"{p}/post_attention_layernorm.weight"), linear(init, f"{p}/mlp/gate_up_proj"),
            linear(init, f"{p}/mlp/down_proj")))
    embed = table(init, "model.embed_tokens")
    head = table(init, "lm_head") if any(n.startswith("lm_head.weight") for n in init._tensors) else embed
    return ModelWeights(embed, layers, init.get("/model/norm.weight"), head, init.get("cos_cache"), init.get("sin_cache"))
