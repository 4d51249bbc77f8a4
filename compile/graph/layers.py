"""Composite emitters for a Llama-family decoder, each built from ONNX Runtime's fastest CPU ops.

Every emitter takes the shared `Ctx` (builder, model spec, weight storage) and returns the names of its
outputs. Weights arrive in Hugging Face layout ([out, in] for linears) and are stored as the graph needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ..hf_source import ModelSpec
from .builder import MS_DOMAIN, GraphBuilder

STORAGE_DTYPES = {"fp32": np.float32, "fp16": np.float16}


@dataclass
class Ctx:
    b: GraphBuilder
    spec: ModelSpec
    precision: str  # weight storage: "fp32" | "fp16"; compute is fp32 on the CPU EP

    def stored(self, name: str, array: np.ndarray) -> str:
        """A float weight kept at storage precision; fp16 is widened by a Cast that ORT folds at load."""
        dtype = STORAGE_DTYPES[self.precision]
        w = self.b.weight(name, np.asarray(array, dtype=dtype))
        if dtype == np.float32:
            return w
        return self.b.op("Cast", [w], f"{name}/Cast", to=TensorProto.FLOAT)


def linear(ctx: Ctx, x: str, weight: np.ndarray, bias: np.ndarray | None, name: str) -> str:
    """x @ weight.T (+ bias).   x: [..., in]   weight: [out, in] (HF layout)   → [..., out]"""
    w = ctx.stored(f"{name}.weight", weight.T)
    y = ctx.b.op("MatMul", [x, w], f"{name}/MatMul")
    if bias is not None:
        y = ctx.b.op("Add", [y, ctx.b.weight(f"{name}.bias", bias.astype(np.float32))], f"{name}/Add")
    return y


def rms_norm(ctx: Ctx, x: str, gamma: np.ndarray, name: str) -> str:
    """x / rms(x) * gamma   (SimplifiedLayerNormalization)"""
    g = ctx.b.weight(f"{name}.weight", gamma.astype(np.float32))
    return ctx.b.node("SimplifiedLayerNormalization", [x, g], f"{name}/SimplifiedLayerNorm",
                      num_outputs=1, axis=-1, epsilon=ctx.spec.rms_norm_eps, stash_type=1)[0]


def skip_rms_norm(ctx: Ctx, x: str, skip: str, gamma: np.ndarray, name: str) -> tuple[str, str]:
    """Residual add fused with the next norm:

        x ──┐
            Add ──▶ residual (output 3)
        skip┘  └──▶ RMSNorm(gamma) ──▶ normed (output 0)
    """
    g = ctx.b.weight(f"{name}.weight", gamma.astype(np.float32))
    outs = ctx.b.node("SkipSimplifiedLayerNormalization", [x, skip, g], f"{name}/SkipLayerNorm",
                      num_outputs=4, domain=MS_DOMAIN, epsilon=ctx.spec.rms_norm_eps)
    return outs[0], outs[3]


def attention(ctx: Ctx, x: str, w: dict[str, np.ndarray], layer: int, kv: dict[str, str]) -> str:
    """Self-attention over the shared static KV buffers:

        x ─▶ MatMul(Wq|Wk|Wv) (+bias) ─▶ GroupQueryAttention(rotary inside, past ≡ present) ─▶ MatMul(Wo)

    One fused QKV projection feeds GQA packed; GQA rotates q/k with the cos/sin tables, writes the new
    K/V at each row's `seqlens_k` position of its buffer and attends causally.
    """
    s, name = ctx.spec, f"/model/layers.{layer}/attn"
    qkv_w = np.concatenate([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]], axis=0)
    qkv_b = None
    if s.attention_bias:
        qkv_b = np.concatenate([w["q_proj.bias"], w["k_proj.bias"], w["v_proj.bias"]])
    qkv = linear(ctx, x, qkv_w, qkv_b, f"{name}/qkv_proj")
    attrs = dict(num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, do_rotary=1, rotary_interleaved=0,
                 scale=float(s.head_dim ** -0.5))
    if s.sliding_window:
        attrs["local_window_size"] = int(s.sliding_window)
    inputs = [qkv, "", "", kv["past_key"], kv["past_value"], "seqlens_k", "total_sequence_length",
              "cos_cache", "sin_cache"]
    out = ctx.b.node("GroupQueryAttention", inputs, f"{name}/GroupQueryAttention", domain=MS_DOMAIN,
                     outputs=[f"{name}/output", kv["present_key"], kv["present_value"]], **attrs)[0]
    return linear(ctx, out, w["o_proj.weight"], None, f"{name}/o_proj")


def mlp(ctx: Ctx, x: str, w: dict[str, np.ndarray], layer: int) -> str:
    """SwiGLU:  x ─▶ MatMul(Wgate|Wup) ─▶ Split ─▶ gate·sigmoid(gate) · up ─▶ MatMul(Wdown)"""
    name, ffn = f"/model/layers.{layer}/mlp", ctx.spec.intermediate_size
    gate_up = linear(ctx, x, np.concatenate([w["gate_proj.weight"], w["up_proj.weight"]], axis=0), None,
                     f"{name}/gate_up_proj")
    gate, up = ctx.b.node("Split", [gate_up, ctx.b.const([ffn, ffn])], f"{name}/Split", num_outputs=2, axis=-1)
    sig = ctx.b.op("Sigmoid", [gate], f"{name}/act/Sigmoid")
    act = ctx.b.op("Mul", [gate, sig], f"{name}/act/Mul")
    prod = ctx.b.op("Mul", [act, up], f"{name}/Mul")
    return linear(ctx, prod, w["down_proj.weight"], None, f"{name}/down_proj")


def lm_head(ctx: Ctx, hidden: str, weight: str) -> str:
    """Logits only where the runtime asks (`logits_indices` into the flattened batch×sequence tokens):

        hidden [B,S,H] ─▶ Reshape [B·S,H] ─▶ Gather(logits_indices) ─▶ Gemm(W, transB) ─▶ logits [N,V]

    Prefill asks for one row per sequence, decode for every row, verification for γ+1 per sequence,
    so the vocabulary projection is never computed for tokens nobody reads.
    """
    flat = ctx.b.op("Reshape", [hidden, ctx.b.const([-1, ctx.spec.hidden_size])], "/lm_head/Reshape")
    rows = ctx.b.op("Gather", [flat, "logits_indices"], "/lm_head/Gather", axis=0)
    return ctx.b.node("Gemm", [rows, weight], "/lm_head/Gemm", outputs=["logits"], transB=1)[0]
