"""The Llama-family forward over packed tokens and a paged KV cache, in PyTorch.

GEMMs go through PyTorch (cuBLAS on the GPU); attention with its rotary and KV append, and RMSNorm + residual,
go through `ops`: plugins/cuda's kernels on the GPU (`KernelOps`), or the same semantics written in PyTorch
(`ReferenceOps`) for the CPU, where CI runs this exact forward. The semantics are those of the `--target cuda`
graph (com.microsoft.PagedAttention): q/k rotated at past + index, K/V written at `slot_mapping` (-1 skips),
causal attention over cached + new keys, logits only for the rows asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .weights import ModelWeights


@dataclass
class StepMeta:
    """One step's packed-batch description, on the device (int32 unless noted), plus host copies the reference
    path reads. `max_seq_len` bounds every sequence's KV length after the step (it sizes the kernels' grids)."""

    positions: torch.Tensor      # [tokens]
    slot_mapping: torch.Tensor   # [tokens]  block * block_size + offset, -1: do not write
    cu_seqlens_q: torch.Tensor   # [seqs + 1]
    past_lens: torch.Tensor      # [seqs]
    block_tables: torch.Tensor   # [seqs, max_blocks]
    max_seq_len: int
    host: object = None          # the PagedBatch (reference ops only)


class ReferenceOps:
    """PyTorch on any device: the kernels' semantics, one sequence at a time for attention."""

    name = "reference"

    def __init__(self, eps: float, heads: int, kv_heads: int, head_dim: int, window: int, cos: torch.Tensor,
                 sin: torch.Tensor):
        self.eps, self.heads, self.kv_heads, self.head_dim, self.window = eps, heads, kv_heads, head_dim, window
        self.cos, self.sin = cos.float(), sin.float()

    def rmsnorm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """residual += x (unless None); → rmsnorm(residual) * weight (computed in fp32, like the fused op)."""
        if x is not None:
            residual += x
        r = residual.float()
        return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps)).to(residual.dtype) * weight

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c, s = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        half = x.shape[-1] // 2
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat([a * c - b * s, b * c + a * s], -1).to(x.dtype)

    def attention(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        T = qkv.shape[0]
        pos = meta.positions.long()
        q = self._rotate(qkv[:, :H * D].view(T, H, D), pos)
        k = self._rotate(qkv[:, H * D:(H + KV) * D].view(T, KV, D), pos)
        v = qkv[:, (H + KV) * D:].view(T, KV, D)
        slots = meta.slot_mapping.long()
        keep = slots >= 0
        k_cache.view(-1, KV, D)[slots[keep]] = k[keep]
        v_cache.view(-1, KV, D)[slots[keep]] = v[keep]
        batch, bs = meta.host, k_cache.shape[1]
        out = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
        cu, past = batch.cu_seqlens_q, batch.past_lens
        for b in range(len(past)):
            start, end = int(cu[b]), int(cu[b + 1])
            if start == end:
                continue
            n = int(past[b]) + end - start
            blocks = meta.block_tables[b, :-(-n // bs)].long()
            keys = k_cache[blocks].reshape(-1, KV, D)[:n].float()
            values = v_cache[blocks].reshape(-1, KV, D)[:n].float()
            rows = q[start:end].float().view(end - start, KV, H // KV, D)
            scores = torch.einsum("qkgd,nkd->kgqn", rows, keys) / math.sqrt(D)
            at = torch.arange(int(past[b]), n, device=qkv.device)[:, None]
            j = torch.arange(n, device=qkv.device)[None, :]
            visible = (j <= at) & ((j > at - self.window) if self.window > 0 else True)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
            out[start:end] = torch.einsum("kgqn,nkd->qkgd", probs, values).reshape(end - start, H, D).to(qkv.dtype)
        return out.view(T, H * D)


class KernelOps:
    """plugins/cuda through runtime.cuda_kernels: fused RMSNorm + residual, and packed paged attention (rotary,
    KV append and split-K attention in one call) — the op the `--target cuda` graph names.

    The calls go straight to the C functions with the tensors' addresses: the binding's Python-side shape checks
    cost ~30 µs a call, 90 calls a step on a 30-layer model, which was most of an eager step's time. The shapes
    are fixed by this module (checked once in __init__); the library still checks every argument's value before
    it launches anything."""

    name = "plugins/cuda"

    def __init__(self, kernels, eps: float, heads: int, kv_heads: int, head_dim: int, window: int,
                 cos: torch.Tensor, sin: torch.Tensor):
        from ...cuda_kernels import DTYPES

        self.k, self.eps, self.heads, self.kv_heads, self.head_dim, self.window = kernels, eps, heads, kv_heads, head_dim, window
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dtype_code = DTYPES["f16" if cos.dtype == torch.float16 else "bf16" if cos.dtype == torch.bfloat16 else "f32"]
        self._workspace = torch.empty(0, dtype=torch.uint8, device=cos.device)
        self._outgrown: list[torch.Tensor] = []      # CUDA graphs captured earlier still write into these

    def workspace(self, tokens: int, seqs: int, max_seq_len: int) -> torch.Tensor:
        need = self.k.packed_workspace_size(tokens, seqs, self.heads, self.head_dim, max_seq_len)
        if self._workspace.numel() < need:
            self._outgrown.append(self._workspace)
            self._workspace = torch.empty(need, dtype=torch.uint8, device=self.cos.device)
        return self._workspace

    def rmsnorm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(residual)
        rows, hidden = residual.shape
        status = self.k.lib.qs_rmsnorm_residual(out.data_ptr(), residual.data_ptr(), None if x is None else x.data_ptr(),
                                                weight.data_ptr(), rows, hidden, self.eps, self.dtype_code,
                                                torch.cuda.current_stream().cuda_stream)
        if status:
            self.k._check(status, "rmsnorm")
        return out

    def attention(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        T = qkv.shape[0]
        seqs, max_blocks = meta.block_tables.shape
        out = torch.empty(T, self.heads * self.head_dim, dtype=qkv.dtype, device=qkv.device)
        ws = self.workspace(T, seqs, meta.max_seq_len)
        status = self.k.lib.qs_packed_paged_attention(
            out.data_ptr(), qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.cu_seqlens_q.data_ptr(),
            meta.past_lens.data_ptr(), meta.block_tables.data_ptr(), meta.slot_mapping.data_ptr(), self.cos.data_ptr(),
            self.sin.data_ptr(), T, seqs, self.heads, self.kv_heads, self.head_dim, k_cache.shape[1], max_blocks,
            meta.max_seq_len, self.window, self.scale, self.dtype_code, ws.data_ptr(), ws.numel(),
            torch.cuda.current_stream().cuda_stream)
        if status:
            self.k._check(status, "packed paged attention")
        return out


class LlamaForward:
    """Weights on `device` in `dtype`, and the forward of one packed step."""

    def __init__(self, weights: ModelWeights, model: dict, device: torch.device, dtype: torch.dtype, kernels=None):
        def put(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(np.asarray(a, np.float32)).to(device=device, dtype=dtype)

        self.heads, self.kv_heads, self.head_dim = model["num_heads"], model["num_kv_heads"], model["head_dim"]
        self.vocab_size, self.device, self.dtype = model["vocab_size"], device, dtype
        self.embed = put(weights.embed)
        self.lm_head = self.embed if weights.lm_head is weights.embed else put(weights.lm_head)
        self.norm = put(weights.norm)
        self.layers = [(put(w.input_norm), put(w.qkv), put(w.qkv_bias), put(w.o_proj), put(w.post_norm),
                        put(w.gate_up), put(w.down)) for w in weights.layers]
        eps, window = float(model.get("rms_norm_eps") or 1e-6), int(model.get("sliding_window") or 0)
        args = (eps, self.heads, self.kv_heads, self.head_dim, window)
        if kernels is not None:
            cos, sin = (put(a) for a in (weights.cos, weights.sin))          # the graph's own tables, in dtype
            self.ops = KernelOps(kernels, *args, cos, sin)
        else:
            cos, sin = (torch.from_numpy(np.asarray(a, np.float32)).to(device) for a in (weights.cos, weights.sin))
            self.ops = ReferenceOps(*args, cos.to(dtype), sin.to(dtype))

    def __call__(self, input_ids: torch.Tensor, meta: StepMeta, rows: torch.Tensor,
                 caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids [tokens] → logits float32 [len(rows), vocab] of the packed rows `rows`."""
        ops = self.ops
        residual = self.embed[input_ids]
        h = None
        for (norm1, qkv_w, qkv_b, o_w, norm2, gate_up_w, down_w), (kc, vc) in zip(self.layers, caches):
            h = ops.rmsnorm(h, residual, norm1)
            qkv = h @ qkv_w if qkv_b is None else torch.addmm(qkv_b, h, qkv_w)
            h = ops.attention(qkv, kc, vc, meta) @ o_w
            h = ops.rmsnorm(h, residual, norm2)
            gate, up = (h @ gate_up_w).chunk(2, -1)
            h = (F.silu(gate) * up) @ down_w
        h = ops.rmsnorm(h, residual, self.norm)
        return F.linear(h[rows], self.lm_head).float()
