"""int8 KV cache: the per-channel scales GroupQueryAttention quantizes its cache with, calibrated on text.

GroupQueryAttention stores K (after rotary) and V as int8 with one fixed scale per (KV head, channel) and
widens them back on every read, so the cache holds 4× the tokens of an fp32 one. The scales are fixed
at compile time: the float64 reference model runs over calibration tokens, and each channel's scale is
its largest |K| or |V| with headroom over 127, since a later token beyond it is clipped. K channels differ
by orders of magnitude (rotary pairs, outlier channels), which a single per-tensor scale would waste.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..hf_source import CheckpointReader, ModelSpec
from ..reference import ReferenceModel

HEADROOM = 1.25          # scale = 1.25 · calibration absmax / 127: unseen tokens up to 25 % larger stay exact
MIN_SCALE = 1e-6         # a channel that stayed zero in calibration still gets a usable scale


def scale_names(layer: int) -> tuple[str, str]:
    """The graph initializers holding layer `layer`'s (k, v) scales."""
    return f"/model/layers.{layer}/attn/k_scale", f"/model/layers.{layer}/attn/v_scale"


def engine_scales(graph: Path, num_layers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (k, v) scales an int8-KV engine's graph carries, per layer (reads only those from the data file)."""
    import onnx
    from onnx import external_data_helper, numpy_helper

    model = onnx.load(str(graph), load_external_data=False)
    wanted = {n for i in range(num_layers) for n in scale_names(i)}
    arrays = {}
    for t in model.graph.initializer:
        if t.name in wanted:
            external_data_helper.load_external_data_for_tensor(t, str(graph.parent))
            arrays[t.name] = numpy_helper.to_array(t)
    return [tuple(arrays[n] for n in scale_names(i)) for i in range(num_layers)]


def calibrate(spec: ModelSpec, reader: CheckpointReader, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(k_scale, v_scale) per layer, each float32 [1, kv_heads, 1, head_dim] (GroupQueryAttention's PER_CHANNEL)."""
    if len(ids) < 2:
        raise ValueError("int8 KV calibration needs a text of at least 2 tokens")
    ref = ReferenceModel(spec, reader)
    ref.forward(ids)
    scales = []
    for k, v in zip(ref.k, ref.v):          # [kv_heads, tokens, head_dim] each
        pair = tuple(np.maximum(np.abs(x).max(axis=1) * HEADROOM / 127.0, MIN_SCALE)
                     .astype(np.float32).reshape(1, spec.num_kv_heads, 1, spec.head_dim) for x in (k, v))
        scales.append(pair)
    return scales
