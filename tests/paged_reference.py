"""Slow truth for the paged path: float64 numpy paged attention, and the same as an ONNX Runtime custom op.

`paged_attention` is what every fast path is compared with — the CUDA kernels on a GPU, and on CPU the
block tables and slot mappings the host builds. `register_reference_op` + `use_reference_op` let a
`--target cuda` engine run on the CPU: PagedAttention nodes move to onnxruntime-extensions' Python op
domain, where this reference (with ORT's semantics: packed QKV, rotary, slot writes) implements them.
"""

from __future__ import annotations

import numpy as np


def write_kv(k_cache, v_cache, key, value, slot_mapping) -> None:
    """key/value [tokens, kv_heads, head_dim] → cache [blocks, block_size, kv_heads, head_dim] at slots (-1 skips)."""
    nb, bs = k_cache.shape[:2]
    for t, slot in enumerate(np.asarray(slot_mapping)):
        if slot >= 0:
            k_cache[slot // bs, slot % bs] = key[t]
            v_cache[slot // bs, slot % bs] = value[t]


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=None, window=0):
    """query [tokens, heads, head_dim] → out [tokens, heads, head_dim] (float64), causal over cached + new keys."""
    tokens, heads, dim = query.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group, scale = heads // kv_heads, scale if scale is not None else dim ** -0.5
    out = np.zeros((tokens, heads, dim))
    for b in range(len(seq_lens)):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(seq_lens[b])
        pos = np.arange(n)
        blocks = np.asarray(block_tables[b])[pos // bs]
        k = k_cache[blocks, pos % bs].astype(np.float64)             # [n, kv_heads, dim]
        v = v_cache[blocks, pos % bs].astype(np.float64)
        for r in range(q0, q1):
            ctx = n - (q1 - 1 - r)
            start = max(0, ctx - window) if window > 0 else 0
            for h in range(heads):
                s = k[start:ctx, h // group] @ query[r, h].astype(np.float64) * scale
                p = np.exp(s - s.max())
                out[r, h] = (p / p.sum()) @ v[start:ctx, h // group]
    return out


def rotate(x, positions, cos, sin):
    """Half-rotation rotary (as Llama) of x [tokens, heads, dim] at positions, tables [max_pos, dim/2]."""
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def ort_paged_attention(qkv, key_cache, value_cache, cu, past, block_table, cos, sin, slot_mapping,
                        num_heads, kv_heads, scale, window=0):
    """com.microsoft.PagedAttention with packed QKV and do_rotary=1; returns (out [T, H*D], caches)."""
    tokens = qkv.shape[0]
    dim = cos.shape[1] * 2
    q = qkv[:, :num_heads * dim].reshape(tokens, num_heads, dim).astype(np.float64)
    k = qkv[:, num_heads * dim:(num_heads + kv_heads) * dim].reshape(tokens, kv_heads, dim).astype(np.float64)
    v = qkv[:, (num_heads + kv_heads) * dim:].reshape(tokens, kv_heads, dim)
    lens = np.diff(cu)
    positions = np.concatenate([np.arange(p, p + n) for p, n in zip(past, lens)]).astype(np.int64) if tokens else np.zeros(0, np.int64)
    q, k = rotate(q, positions, cos.astype(np.float64), sin.astype(np.float64)), rotate(k, positions, cos.astype(np.float64), sin.astype(np.float64))
    key_cache, value_cache = key_cache.copy(), value_cache.copy()
    write_kv(key_cache, value_cache, k.astype(key_cache.dtype), v.astype(value_cache.dtype), slot_mapping)
    out = paged_attention(q, key_cache, value_cache, block_table, past + lens, cu, scale, window)
    return out.reshape(tokens, -1).astype(qkv.dtype), key_cache, value_cache


_REGISTERED: set[tuple] = set()


def register_reference_op(num_heads: int, kv_heads: int, metadata: bool) -> str:
    """Register the reference as op `QsRefPagedAttention_{H}_{KVH}[_meta]` (one per shape; with `metadata` it
    also takes attention_metadata and checks that the bounds hold, as the real op trusts them); returns the
    op type."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    op_type = f"QsRefPagedAttention_{num_heads}_{kv_heads}" + ("_meta" if metadata else "")
    if op_type in _REGISTERED:
        return op_type
    f32, i32 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32

    def run(qkv, key_cache, value_cache, cu, past, block_table, cos, sin, slot_mapping, *meta, **attrs):
        out, k, v = ort_paged_attention(qkv, key_cache, value_cache, cu, past, block_table, cos, sin, slot_mapping,
                                        num_heads, kv_heads, attrs["scale"])
        lens = np.diff(cu)
        if meta and (meta[0][0] < lens.max(initial=0) or meta[0][1] < (past + lens).max(initial=0)):
            out[:] = np.nan        # bounds the real op would trust are wrong: poison the result (raising aborts ORT)
        return out, k, v

    inputs = [f32, f32, f32, i32, i32, i32, f32, f32, i32] + ([i32] if metadata else [])
    onnx_op(op_type=op_type, inputs=inputs, outputs=[f32, f32, f32], attrs={"scale": PyCustomOpDef.dt_float})(run)
    _REGISTERED.add(op_type)
    return op_type


def use_reference_op(model, num_heads: int, kv_heads: int) -> int:
    """Point every PagedAttention (cuda graph) or QsPagedAttention (tensorrt graph) node of `model`
    (onnx.ModelProto) at the reference op; returns how many.

    Python ops take no float16, so the op's float16 inputs and outputs pass through Casts (fp16 → fp32 is
    exact, and the reference rounds its cache writes back to fp16 as the real cache would store them).
    """
    from onnx import TensorProto, helper

    nodes, count = [], 0
    for node in model.graph.node:
        if not ((node.op_type, node.domain) in (("PagedAttention", "com.microsoft"), ("QsPagedAttention", "trt.plugins"))):
            nodes.append(node)
            continue
        scale = next(a.f for a in node.attribute if a.name == "scale")
        inputs = [name for name in node.input if name]                      # drop absent optional inputs
        op_type = register_reference_op(num_heads, kv_heads, metadata=len(inputs) == 10)
        wide = {0, 1, 2, 6, 7}                                              # qkv, caches, cos, sin
        for i in wide:
            nodes.append(helper.make_node("Cast", [inputs[i]], [f"{node.name}/in{i}_f32"], to=TensorProto.FLOAT))
            inputs[i] = f"{node.name}/in{i}_f32"
        outputs = [f"{o}_f32" for o in node.output]
        nodes.append(helper.make_node(op_type, inputs, outputs, name=node.name, domain="ai.onnx.contrib", scale=scale))
        for wide_name, name in zip(outputs, node.output):
            nodes.append(helper.make_node("Cast", [wide_name], [name], to=TensorProto.FLOAT16))
        count += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid("ai.onnx.contrib", 1))
    return count
