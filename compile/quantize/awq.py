"""Activation-aware weight scaling for int4 (AWQ, Lin et al. 2023), folded into the checkpoint's weights.

Input channels that carry large activations matter most, so before quantizing W we scale its input
channels up by s = mean|x|^α (finer quantization where it counts) and fold 1/s into the operation that
produces x, which leaves the float model unchanged. α ∈ [0, 1] is searched per linear group to minimise
‖xW − x·deq(q(W·s))/s‖² on calibration activations; α = 0 is plain rounding, so the search never does
worse than it on the calibration text. Folding targets: q/k/v ← input_layernorm, gate/up ←
post_attention_layernorm, down ← up_proj rows. (o_proj is left alone: with grouped-query attention its
input channels map onto shared V heads.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..hf_source import CheckpointReader, ModelSpec
from ..reference import ReferenceModel
from . import int4

ALPHAS = np.linspace(0.0, 1.0, 11)


class OverlayReader:
    """A checkpoint reader whose tensors can be replaced (the AWQ-scaled ones)."""

    def __init__(self, base: CheckpointReader, overrides: dict[str, np.ndarray]):
        self.base, self.overrides = base, overrides

    def __contains__(self, name: str) -> bool:
        return name in self.overrides or name in self.base

    def get(self, name: str) -> np.ndarray:
        return self.overrides[name] if name in self.overrides else self.base.get(name)

    def dtypes(self) -> set[str]:
        return self.base.dtypes()

    def num_parameters(self) -> int:
        return self.base.num_parameters()


def search_scale(x: np.ndarray, w: np.ndarray, block_size: int, int_scales: bool = False) -> tuple[np.ndarray, float]:
    """Best per-input-channel scale s [K] for x [T, K] @ w [K, N]; returns (s, alpha). The error is measured on the
    packing the engine will hold: with `int_scales` (qs.Int4MatMul's integer block scales) a larger input channel
    coarsens every block of the output channels it reaches, which fp16 block scales would not show."""
    x, w = x.astype(np.float32), w.astype(np.float32)
    mean_abs = np.abs(x).mean(0) + 1e-6
    y = x @ w
    best = (np.inf, np.ones(w.shape[0], np.float32), 0.0)
    for alpha in ALPHAS:
        s = mean_abs ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        scaled = w * s[:, None]
        if int_scales:
            wq = int4.unpack_panels_int(int4.pack_panels_int(scaled), *w.shape) / s[:, None]
        else:
            wq = int4.dequantize(*int4.quantize(scaled, block_size), w.shape[0]) / s[:, None]
        err = float(((x @ wq - y) ** 2).mean())
        if err < best[0]:
            best = (err, s, float(alpha))
    return best[1], best[2]


def awq_reader(spec: ModelSpec, reader: CheckpointReader, calib_ids: list[int], block_size: int,
               log: Callable[[str], None] = print, int_scales: bool = False) -> OverlayReader:
    """Run the calibration tokens through the reference model, search scales (measured on the engine's packing:
    `int_scales` for qs.Int4MatMul's integer block scales), return the scaled weights."""
    capture: dict = {}
    ReferenceModel(spec, reader, capture).forward(calib_ids)
    out: dict[str, np.ndarray] = {}
    get = lambda name: out[name] if name in out else reader.get(name).astype(np.float32)  # noqa: E731
    alphas = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        # down_proj first: its 1/s folds into up_proj rows, which the gate/up search then sees.
        down, up = get(p + "mlp.down_proj.weight"), get(p + "mlp.up_proj.weight")
        s, a = search_scale(capture[(i, "down")], down.T, block_size, int_scales)
        out[p + "mlp.down_proj.weight"], out[p + "mlp.up_proj.weight"] = down * s[None, :], up / s[:, None]
        alphas.append(a)
        for group, norm, names in (("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                   ("gate_up", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            weights = [get(p + n + ".weight") for n in names]
            s, a = search_scale(capture[(i, group)], np.concatenate(weights, 0).T, block_size, int_scales)
            out[p + norm + ".weight"] = get(p + norm + ".weight") / s
            for n, w in zip(names, weights):
                out[p + n + ".weight"] = w * s[None, :]
            alphas.append(a)
    log(f"AWQ: searched {len(alphas)} linear groups on {len(calib_ids)} calibration tokens, "
        f"mean alpha {np.mean(alphas):.2f}")
    return OverlayReader(reader, out)
