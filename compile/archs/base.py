"""The Llama decoder graph; other architectures subclass it and override only what differs.

Graph interface (the contract with the runtime, recorded in the manifest):

    input_ids              int64   [batch, sequence]
    seqlens_k              int32   [batch]              tokens in each row's KV after this step, minus 1
    total_sequence_length  int32   []                   max over rows of (seqlens_k + 1)
    logits_indices         int64   [num_logits]         rows of the flattened batch×sequence to project
    past_key_values.{i}.key/value  float32 [batch, kv_heads, kv_capacity, head_dim]   (float16 / int8: --kv-cache)
    → logits               float32 [num_logits, vocab]
    → present.{i}.key/value         same shape; bound to the same buffer as past (updated in place)

Engines on our attention op (qs.CausalAttention) also take packed steps, where sequences of different lengths
share one call (a step's decodes and prompt slices: one pass over the weights):

    query_starts           int32   [sequences + 1]      offsets of each sequence's tokens in the flattened ids
    kv_rows                int32   [sequences]          each sequence's row of the bound caches (distinct)

and seqlens_k then holds one entry per sequence; a padded step feeds them as 0, S, 2S, … and 0, 1, 2, ….

The GPU target (--target cuda) computes in fp16 on packed tokens over a paged cache:

    input_ids                    int64   [num_tokens]        this step's tokens of all sequences, packed
    cumulative_sequence_length   int32   [batch + 1]         packed offsets of each sequence's tokens
    past_seqlens                 int32   [batch]             tokens already in each sequence's blocks
    block_table                  int32   [batch, max_blocks] physical block of each logical block
    slot_mapping                 int32   [num_tokens]        cache slot of each new token (-1: do not write)
    attention_metadata           int32   [2]                 (cuda) bounds: max query length, max KV length
    logits_indices               int64   [num_logits]        rows of the packed tokens to project
    key_cache.{i}/value_cache.{i} float16 [num_blocks, block_size, kv_heads, head_dim]
    → logits                     float32 [num_logits, vocab]
    → key_cache_out.{i}/value_cache_out.{i}  same buffers as the caches (updated in place)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto, helper

from ..config import KV_CACHE_NUMPY
from ..graph import layers
from ..graph.builder import GraphBuilder
from ..hf_source import CheckpointReader, ModelSpec
from ..rope import cos_sin_cache

def kv_names(layer: int) -> dict[str, str]:
    return {"past_key": f"past_key_values.{layer}.key", "past_value": f"past_key_values.{layer}.value",
            "present_key": f"present.{layer}.key", "present_value": f"present.{layer}.value",
            "key_cache": f"key_cache.{layer}", "value_cache": f"value_cache.{layer}",
            "key_cache_out": f"key_cache_out.{layer}", "value_cache_out": f"value_cache_out.{layer}"}


class LlamaArch:
    """LlamaForCausalLM: RMSNorm, GQA with rotary, SwiGLU MLP, optional tied embeddings."""

    attn_keys = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
    bias_keys = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
    mlp_keys = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")

    def __init__(self, spec: ModelSpec, reader: CheckpointReader):
        self.spec, self.reader = spec, reader

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the graph reads, with the shape config.json implies (checked before building)."""
        s = self.spec
        h, q, kv, ffn = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn)}
        if s.attention_bias:
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
        shapes = {"model.embed_tokens.weight": (s.vocab_size, h), "model.norm.weight": (h,)}
        if not s.tie_word_embeddings and "lm_head.weight" in self.reader:
            shapes["lm_head.weight"] = (s.vocab_size, h)
        for i in range(s.num_layers):
            shapes.update({f"model.layers.{i}.{k}": shape for k, shape in layer.items()})
        return shapes

    def layer_weights(self, i: int, prefix: str, keys) -> dict[str, np.ndarray]:
        return {k: self.reader.get(f"model.layers.{i}.{prefix}.{k}") for k in keys}

    def declare_io(self, b: GraphBuilder, target: str, kv_dtype: str = "fp32", packed: bool = False) -> None:
        """The graph interface of the module docstring: step inputs, then the per-layer KV caches."""
        s, I64, I32 = self.spec, TensorProto.INT64, TensorProto.INT32
        if target == "cpu":
            rows = "sequences" if packed else "batch"       # packed: seqlens_k per sequence, the caches apart
            steps = [("input_ids", I64, ["batch", "sequence"]), ("seqlens_k", I32, [rows]),
                     ("total_sequence_length", I32, [])]
            steps += [("query_starts", I32, ["sequences_plus_1"]), ("kv_rows", I32, [rows])] if packed else []
            caches = ("past_key", "past_value"), ("present_key", "present_value")
            kv_type = helper.np_dtype_to_tensor_dtype(np.dtype(KV_CACHE_NUMPY[kv_dtype]))
            kv_shape = ["kv_batch" if packed else "batch", s.num_kv_heads, "kv_capacity", s.head_dim]
        else:
            steps = [("input_ids", I64, ["num_tokens"]), ("cumulative_sequence_length", I32, ["batch_plus_1"]),
                     ("past_seqlens", I32, ["batch"]), ("block_table", I32, ["batch", "max_blocks"]),
                     ("slot_mapping", I32, ["num_tokens"])]
            steps += [("attention_metadata", I32, [2])] if target == "cuda" else []
            caches = ("key_cache", "value_cache"), ("key_cache_out", "value_cache_out")
            kv_type, kv_shape = TensorProto.FLOAT16, ["num_blocks", "block_size", s.num_kv_heads, s.head_dim]
        for name, dtype, shape in steps + [("logits_indices", I64, ["num_logits"])]:
            b.input(name, dtype, shape)
        for i in range(s.num_layers):
            for key in caches[0]:
                b.input(kv_names(i)[key], kv_type, kv_shape)
        b.output("logits", TensorProto.FLOAT, ["num_logits", s.vocab_size])
        for i in range(s.num_layers):
            for key in caches[1]:
                b.output(kv_names(i)[key], kv_type, kv_shape)

    def emit(self, ctx: layers.Ctx, max_seq_len: int, progress: Callable[[], None] = lambda: None) -> None:
        s, b, r = self.spec, ctx.b, self.reader
        self.declare_io(b, ctx.target, ctx.kv_cache, packed=ctx.target == "cpu" and ctx.attention == "qs")
        cos, sin = cos_sin_cache(s.head_dim, s.rope_theta, s.rope_scaling, max_seq_len)
        b.weight("cos_cache", cos.astype(ctx.act))
        b.weight("sin_cache", sin.astype(ctx.act))

        embeddings = layers.Embeddings(ctx, r.get("model.embed_tokens.weight"))
        x = embeddings.lookup("input_ids")
        residual, h = x, None
        for i in range(s.num_layers):
            norm_w = r.get(f"model.layers.{i}.input_layernorm.weight")
            if h is None:
                h = layers.rms_norm(ctx, x, norm_w, f"/model/layers.{i}/input_layernorm")
            else:
                h, residual = layers.skip_rms_norm(ctx, h, residual, norm_w, f"/model/layers.{i}/input_layernorm")
            keys = self.attn_keys + (self.bias_keys if s.attention_bias else ())
            h = layers.attention(ctx, h, self.layer_weights(i, "self_attn", keys), i, kv_names(i))
            h, residual = layers.skip_rms_norm(ctx, h, residual, r.get(f"model.layers.{i}.post_attention_layernorm.weight"),
                                               f"/model/layers.{i}/post_attention_layernorm")
            h = layers.mlp(ctx, h, self.layer_weights(i, "mlp", self.mlp_keys), i)
            progress()
        h, _ = layers.skip_rms_norm(ctx, h, residual, r.get("model.norm.weight"), "/model/norm")
        untied = not s.tie_word_embeddings and "lm_head.weight" in r
        layers.lm_head(ctx, h, embeddings, r.get("lm_head.weight") if untied else None)
