"""A plain numpy (float64) forward pass of a Llama-family checkpoint: the slow truth `compile verify` checks
engines against. It reads the same checkpoint tensors, so it is independent of the graph builder."""

from __future__ import annotations

import numpy as np

from .hf_source import CheckpointReader, ModelSpec
from .rope import inv_frequencies


class ReferenceModel:
    def __init__(self, spec: ModelSpec, reader: CheckpointReader, capture: dict | None = None,
                 kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None, kv_half: bool = False):
        """`capture`, when given, receives the inputs of every linear group: (layer, "qkv" | "gate_up" | "down").
        `kv_scales`, (k, v) per layer, models an int8 KV cache: attention reads clip(round(x / s), -128, 127) · s.
        `kv_half` models an fp16 one: attention reads K/V rounded to float16."""
        self.spec, self.r, self.capture, self.kv_scales, self.kv_half = spec, reader, capture, kv_scales, kv_half
        self.inv_freq = inv_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.k: list[np.ndarray] = [np.zeros((spec.num_kv_heads, 0, spec.head_dim))] * spec.num_layers
        self.v: list[np.ndarray] = list(self.k)

    def w(self, name: str) -> np.ndarray:
        return self.r.get(name).astype(np.float64)

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.spec.rms_norm_eps) * self.w(name)

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: [heads, S, D] rotated by half (non-interleaved) at positions pos [S]."""
        f = np.outer(pos, self.inv_freq)
        cos, sin = np.concatenate([np.cos(f)] * 2, -1), np.concatenate([np.sin(f)] * 2, -1)
        h = x.shape[-1] // 2
        return x * cos + np.concatenate([-x[..., h:], x[..., :h]], -1) * sin

    def _attention(self, i: int, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
        s, p = self.spec, f"model.layers.{i}.self_attn."
        S = h.shape[0]

        if self.capture is not None:
            self.capture[(i, "qkv")] = h

        def proj(n, heads):
            y = h @ self.w(p + n + "_proj.weight").T
            if s.attention_bias:
                y = y + self.w(p + n + "_proj.bias")
            return y.reshape(S, heads, s.head_dim).transpose(1, 0, 2)

        q = self._rope(proj("q", s.num_heads), pos)
        self.k[i] = np.concatenate([self.k[i], self._rope(proj("k", s.num_kv_heads), pos)], 1)
        self.v[i] = np.concatenate([self.v[i], proj("v", s.num_kv_heads)], 1)
        rep = s.num_heads // s.num_kv_heads
        k, v = self.k[i], self.v[i]
        if self.kv_scales is not None:
            k, v = (np.clip(np.round(x / sc[0]), -128, 127) * sc[0] for x, sc in zip((k, v), self.kv_scales[i]))
        if self.kv_half:
            k, v = (x.astype(np.float16).astype(np.float64) for x in (k, v))
        k, v = np.repeat(k, rep, 0), np.repeat(v, rep, 0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(s.head_dim)
        key_pos = np.arange(k.shape[1])
        masked = key_pos[None, :] > pos[:, None]
        if s.sliding_window:
            masked |= key_pos[None, :] <= pos[:, None] - s.sliding_window
        scores[:, masked] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = (probs @ v).transpose(1, 0, 2).reshape(S, -1)
        return out @ self.w(p + "o_proj.weight").T

    def forward(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), vocab] for new tokens `ids`, continuing from the cached ones."""
        s = self.spec
        start = self.k[0].shape[1]
        pos = np.arange(start, start + len(ids))
        x = self.w("model.embed_tokens.weight")[np.asarray(ids)]
        for i in range(s.num_layers):
            x = x + self._attention(i, self._norm(x, f"model.layers.{i}.input_layernorm.weight"), pos)
            h = self._norm(x, f"model.layers.{i}.post_attention_layernorm.weight")
            m = f"model.layers.{i}.mlp."
            gate, up = h @ self.w(m + "gate_proj.weight").T, h @ self.w(m + "up_proj.weight").T
            act = gate / (1 + np.exp(-gate)) * up
            if self.capture is not None:
                self.capture[(i, "gate_up")], self.capture[(i, "down")] = h, act
            x = x + act @ self.w(m + "down_proj.weight").T
        x = self._norm(x, "model.norm.weight")
        head = "lm_head.weight" if not s.tie_word_embeddings and "lm_head.weight" in self.r else "model.embed_tokens.weight"
        return x @ self.w(head).T
