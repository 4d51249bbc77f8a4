"""Our cpu ops (plugins/cpu) against slow truth and against the ONNX Runtime ops they replace.

qs.CausalAttention (attention.cpp):
Slow truth is a numpy transcription of what the op means (rotary at positions total − S + s, K/V written into the
static cache, causal softmax over the keys up to the query, optionally within a local window). The op must also
agree with com.microsoft.GroupQueryAttention on the same inputs, and be invariant in a way GroupQueryAttention is
not: a query row's output is bitwise the same whether it is decoded alone, beside other sequences, or computed
inside a prompt chunk. Over an fp16 cache (--kv-cache fp16) the same, against the truth reading the cache rounded
to float16 (values stored are numpy's float16 of the inputs, bit for bit). With bf16 products (--attention-products
bf16) against a truth that rounds what the op multiplies (queries, keys, each segment's probabilities, values) to
bfloat16 and sums exactly, and with the same invariance.

qs.RowQuantize (row_quantize.cpp): bit for bit what Abs → ReduceMax → ·1/127 → QuantizeLinear(zero point 128) give.

qs.Int8MatMul and qs.PackedGather (int8_matmul.cpp): bit for bit what RowQuantize → MatMulIntegerToFloat and the
Gather → Cast → Mul lookup give, on the weight the compiler packs for them (compile.quantize.int8.pack_panels),
whatever the number of rows; and the integer product is checked against numpy's exact one.

qs.Int4MatMul and qs.Int4Gather (int4_matmul.cpp): against float64 truth on the dequantized weight
(compile.quantize.int4.unpack_panels) and the row's int8 activations, and a row's bits alone = in any batch.

qs.SwiGLU (swiglu.cpp): silu(gate) · up against float64 truth, and a row's bits alone = in any batch.

qs.Int4MatMul's and qs.Int8MatMul's folds (prologues.cpp): with a bias, a skip RMS norm or SwiGLU taken in, bit for
bit the two or three ops they replace (ONNX Runtime's SkipSimplifiedLayerNormalization and Add, our SwiGLU),
residual output included.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from compile.quantize import int4, int8
from runtime import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="this install was built without the qs ops")

CAPACITY = 640      # past several of the op's 128-key softmax segments


def graph(op: str, heads: int, kv_heads: int, head_dim: int, window: int, cache: int = TensorProto.FLOAT,
          bf16: bool = False) -> bytes:
    width = (heads + 2 * kv_heads) * head_dim
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "S", width]),
              helper.make_tensor_value_info("past_key", cache, ["B", kv_heads, CAPACITY, head_dim]),
              helper.make_tensor_value_info("past_value", cache, ["B", kv_heads, CAPACITY, head_dim]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
              helper.make_tensor_value_info("cos_cache", TensorProto.FLOAT, [CAPACITY, head_dim // 2]),
              helper.make_tensor_value_info("sin_cache", TensorProto.FLOAT, [CAPACITY, head_dim // 2])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    outputs += [helper.make_tensor_value_info(n, cache, None) for n in ("present_key", "present_value")]
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=head_dim ** -0.5)
    names = [i.name for i in inputs]
    if op == "qs":
        node = helper.make_node("CausalAttention", names, [o.name for o in outputs], domain=cpu_ops.DOMAIN,
                                local_window_size=window, **attrs, **({"bf16_products": 1} if bf16 else {}))
    else:
        node = helper.make_node("GroupQueryAttention", names[:1] + ["", ""] + names[1:], [o.name for o in outputs],
                                domain="com.microsoft", do_rotary=1, rotary_interleaved=0, local_window_size=window,
                                **attrs)
    model = helper.make_model(helper.make_graph([node], "attention", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                             helper.make_opsetid(cpu_ops.DOMAIN, 1)])
    return model.SerializeToString()


_sessions: dict[tuple, ort.InferenceSession] = {}


def session(op: str, heads: int, kv_heads: int, head_dim: int, window: int = -1, threads: int = 2,
            cache: int = TensorProto.FLOAT, bf16: bool = False):
    key = (op, heads, kv_heads, head_dim, window, threads, cache, bf16)
    if key not in _sessions:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        cpu_ops.register(so)
        _sessions[key] = ort.InferenceSession(graph(op, heads, kv_heads, head_dim, window, cache, bf16), so,
                                              providers=["CPUExecutionProvider"])
    return _sessions[key]


def rotary(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(np.arange(CAPACITY), 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def run(op, qkv, keys, values, seqlens, heads, kv_heads, window=-1, threads=2, bf16=False):
    """One call with the cache bound as past ≡ present (as the runner binds it); returns (out, keys, values). The
    cache's dtype (float32 or float16) picks the op's cache type; `bf16` asks for bf16 products."""
    head_dim = keys.shape[-1]
    keys, values = keys.copy(), values.copy()
    cos, sin = rotary(head_dim)
    cache = TensorProto.FLOAT16 if keys.dtype == np.float16 else TensorProto.FLOAT
    sess = session(op, heads, kv_heads, head_dim, window, threads, cache, bf16)
    io = sess.io_binding()
    io.bind_cpu_input("qkv", qkv)
    io.bind_output("out")                       # first: copy_outputs_to_cpu() lists outputs in binding order
    for name, cache in (("key", keys), ("value", values)):
        io.bind_input(f"past_{name}", "cpu", 0, cache.dtype, cache.shape, cache.ctypes.data)
        io.bind_output(f"present_{name}", "cpu", 0, cache.dtype, cache.shape, cache.ctypes.data)
    io.bind_cpu_input("seqlens_k", np.asarray(seqlens, np.int32))
    io.bind_cpu_input("total_sequence_length", np.array(int(max(seqlens)) + 1, np.int32))
    io.bind_cpu_input("cos_cache", cos)
    io.bind_cpu_input("sin_cache", sin)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0], keys, values


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


SEGMENT = 128       # keys per softmax segment of the op (attention.cpp kSegment): bf16 rounds each one's numerators


def reference(qkv, keys, values, seqlens, heads, kv_heads, window=-1, bf16=False):
    """What the op means, in float64; over a float16 cache, attention reads the new K/V rounded to float16. With
    `bf16`, what bf16 products mean: the query (rotated and scaled in float32), keys and values rounded to bfloat16,
    and each 128-key segment's softmax numerators exp(score − the segment's max) too, every sum exact."""
    half = keys.dtype == np.float16
    batch, seq, _ = qkv.shape
    head_dim = keys.shape[-1]
    cos, sin = rotary(head_dim)
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    out = np.zeros((batch, seq, heads * head_dim))

    def rot(x, pos):
        half = head_dim // 2
        x1, x2 = x[:half], x[half:]
        return np.concatenate([x1 * cos[pos] - x2 * sin[pos], x2 * cos[pos] + x1 * sin[pos]])

    tokens = qkv.astype(np.float64).reshape(batch, seq, heads + 2 * kv_heads, head_dim)
    for b in range(batch):
        total = int(seqlens[b]) + 1
        past = max(0, total - seq)
        for s in range(min(seq, total - past)):
            for h in range(kv_heads):
                keys[b, h, past + s] = rot(tokens[b, s, heads + h], past + s)
                values[b, h, past + s] = tokens[b, s, heads + kv_heads + h]
                if half:
                    keys[b, h, past + s] = keys[b, h, past + s].astype(np.float16)
                    values[b, h, past + s] = values[b, h, past + s].astype(np.float16)
        for s in range(min(seq, total - past)):
            pos = past + s
            lo = max(0, pos - window + 1) if window > 0 else 0
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                q = rot(tokens[b, s, h], pos) * head_dim ** -0.5
                k, v = keys[b, kvh, lo:pos + 1], values[b, kvh, lo:pos + 1]
                if bf16:
                    q = to_bf16(rot(tokens[b, s, h].astype(np.float32), pos).astype(np.float32)
                                * np.float32(head_dim ** -0.5))
                    k, v = to_bf16(k), to_bf16(v)
                scores = k @ q
                if not bf16:
                    p = np.exp(scores - scores.max())
                    out[b, s, h * head_dim:(h + 1) * head_dim] = (p / p.sum()) @ v
                    continue
                segments = [slice(i, i + SEGMENT) for i in range(0, len(scores), SEGMENT)]
                tops = [scores[g].max() for g in segments]
                weights = np.exp(np.array(tops) - max(tops))
                numerators = [np.exp(scores[g] - t) for g, t in zip(segments, tops)]
                total = sum(w * e.sum() for w, e in zip(weights, numerators))
                out[b, s, h * head_dim:(h + 1) * head_dim] = sum(
                    w * (to_bf16(e) @ v[g]) for w, e, g in zip(weights, numerators, segments)) / total
    return out, keys, values


def inputs(rng, batch, seq, heads, kv_heads, head_dim, cache=np.float32):
    qkv = rng.standard_normal((batch, seq, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    keys = rng.standard_normal((batch, kv_heads, CAPACITY, head_dim)).astype(cache)
    values = rng.standard_normal((batch, kv_heads, CAPACITY, head_dim)).astype(cache)
    return qkv, keys, values


def assert_matches_reference(got, want, seqlens, bf16=False):
    out, keys, values = got
    ref_out, ref_keys, ref_values = want
    half = keys.dtype == np.float16
    # fp16: a key rotated in float32 may round to the neighbouring half of the float64 truth's (one ulp, 2^-10
    # relative); the output then differs by about that much through the softmax. bf16 products: the same one-ulp
    # difference (or the query's, rotated and scaled in float32) can move the value's bfloat16 by one of its ulps
    # (2^-8 relative), four times as far (a drawn case: 8 of 5,632 outputs 2.9e-3 off, head_dim 128)
    atol, rtol = (8e-3, 4e-3) if bf16 else (2e-3, 1e-3) if half else (2e-5, 1e-5)
    np.testing.assert_allclose(out, ref_out, atol=atol, rtol=rtol)
    for b, n in enumerate(np.asarray(seqlens) + 1):     # the cache up to each row's length (the rest is untouched)
        np.testing.assert_allclose(keys[b, :, :n], ref_keys[b, :, :n], atol=2e-5, rtol=1e-3 if half else 1e-5)
        np.testing.assert_allclose(values[b, :, :n], ref_values[b, :, :n], atol=0, rtol=0)


CASES = [  # (batch, seq, seqlens_k, heads, kv_heads, head_dim, window)
    (1, 1, [40], 9, 3, 64, -1),            # batch-1 decode (one task per head)
    (5, 1, [0, 17, 60, 33, 94], 8, 4, 64, -1),   # batched decode, ragged contexts, up to the cache's last row
    (1, 37, [36], 4, 2, 32, -1),           # a prompt from empty
    (1, 13, [62], 6, 2, 128, -1),          # a prompt chunk after 50 cached tokens
    (1, 5, [44], 4, 1, 16, -1),            # speculative verification, one KV head
    (1, 20, [49], 4, 2, 64, 16),           # a local window (Mistral's sliding window)
    (3, 1, [30, 9, 70], 4, 4, 96, 8),      # windowed decode, no GQA grouping
    (1, 1, [600], 9, 3, 64, -1),           # batch-1 decode over 5 key segments: split across threads by segment
    (2, 1, [129, 455], 4, 2, 32, -1),      # two sequences, 2 and 4 segments, split
    (1, 1, [520], 4, 2, 64, 200),          # a long window: split too, segments from the window's first key
    (1, 40, [560], 6, 2, 128, -1),         # a prompt chunk after 520 cached tokens: every segment in one task
    (1, 5, [600], 9, 3, 64, -1),           # batch-1 verification over 5 segments: split, the 5 tokens in each task
    (1, 3, [290], 4, 2, 128, -1),          # a warm prompt's last tokens after 287 cached ones: split
    (1, 1, [601], 14, 2, 64, -1),          # qwen2.5-0.5b's 7 heads a KV head, decode: keys and values together
    (4, 1, [600, 5, 300, 131], 8, 2, 64, -1),    # batched decode, 4 heads a KV head: every segment in one task
    (2, 1, [300, 77], 12, 2, 128, 203),    # qwen2.5-1.5b's 6, windowed, a partial block of 8 keys at the end
]


@pytest.mark.parametrize("batch,seq,seqlens,heads,kv_heads,head_dim,window", CASES)
def test_matches_reference_and_group_query_attention(batch, seq, seqlens, heads, kv_heads, head_dim, window):
    qkv, keys, values = inputs(np.random.default_rng(batch * 100 + seq), batch, seq, heads, kv_heads, head_dim)
    got = run("qs", qkv, keys, values, seqlens, heads, kv_heads, window)
    assert_matches_reference(got, reference(qkv, keys, values, seqlens, heads, kv_heads, window), seqlens)
    gqa = run("gqa", qkv, keys, values, seqlens, heads, kv_heads, window)
    np.testing.assert_allclose(got[0], gqa[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], gqa[1], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[2], gqa[2])


@pytest.mark.parametrize("batch,seq,seqlens,heads,kv_heads,head_dim,window", CASES)
def test_fp16_cache_matches_reference(batch, seq, seqlens, heads, kv_heads, head_dim, window):
    """--kv-cache fp16: the new values land as numpy's float16 of the inputs (bit for bit), the rotated keys within
    a half's rounding, and the output is the truth's over the rounded cache; the float32 op over the same rounded
    past agrees to float32 precision (only the storage differs)."""
    qkv, keys, values = inputs(np.random.default_rng(batch * 100 + seq), batch, seq, heads, kv_heads, head_dim, np.float16)
    got = run("qs", qkv, keys, values, seqlens, heads, kv_heads, window)
    assert got[1].dtype == np.float16 and got[2].dtype == np.float16
    assert_matches_reference(got, reference(qkv, keys, values, seqlens, heads, kv_heads, window), seqlens)
    wide = run("qs", qkv, keys.astype(np.float32), values.astype(np.float32), seqlens, heads, kv_heads, window)
    np.testing.assert_allclose(got[0], wide[0], atol=2e-3, rtol=1e-3)
    np.testing.assert_array_equal(got[2], wide[2].astype(np.float16))
    np.testing.assert_array_equal(got[1], wide[1].astype(np.float16))    # the op rounds its float32 rotation


@pytest.mark.parametrize("batch,seq,seqlens,heads,kv_heads,head_dim,window", CASES)
def test_bf16_products_match_a_truth_that_rounds_what_they_multiply(batch, seq, seqlens, heads, kv_heads, head_dim,
                                                                  window):
    """--attention-products bf16: the cache is written as with fp32 products (bit for bit), and the output is the
    float64 truth's over bf16-rounded queries, keys, values and numerators, within float32 summation and the rare
    numerator that float32 rounds to the neighbouring bf16 (2^-8 of one weight); the fp32 products' output lies
    much further from that truth, so the op did round."""
    qkv, keys, values = inputs(np.random.default_rng(batch * 100 + seq), batch, seq, heads, kv_heads, head_dim, np.float16)
    got = run("qs", qkv, keys, values, seqlens, heads, kv_heads, window, bf16=True)
    fp32 = run("qs", qkv, keys, values, seqlens, heads, kv_heads, window)
    np.testing.assert_array_equal(got[1], fp32[1])
    np.testing.assert_array_equal(got[2], fp32[2])
    truth = reference(qkv, keys, values, seqlens, heads, kv_heads, window, bf16=True)[0]
    rows = [(b, s) for b, n in enumerate(np.asarray(seqlens) + 1) for s in range(min(seq, n))]
    got_rows, fp32_rows, truth_rows = (np.array([o[b, s] for b, s in rows]) for o in (got[0], fp32[0], truth))
    np.testing.assert_allclose(got_rows, truth_rows, atol=1e-4, rtol=1e-4)
    assert np.abs(fp32_rows - truth_rows).max() > 4 * np.abs(got_rows - truth_rows).max()


def test_bf16_products_need_a_half_cache():
    qkv, keys, values = inputs(np.random.default_rng(0), 1, 1, 4, 2, 16)
    with pytest.raises(Exception, match="bf16_products needs a float16 cache"):
        run("qs", qkv, keys, values, [5], 4, 2, bf16=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), batch=st.integers(1, 4), seq=st.integers(1, 24),
       shape=st.sampled_from([(4, 2, 16), (3, 1, 32), (6, 3, 64), (2, 2, 128), (8, 2, 32)]),
       window=st.sampled_from([-1, 7]),
       threads=st.sampled_from([1, 2]), cache=st.sampled_from([np.float32, np.float16, "bf16"]))
def test_matches_reference_on_any_shape(data, batch, seq, shape, window, threads, cache):
    """Batches of several tokens per row are prompts with no past (GroupQueryAttention's only multi-row batch);
    one-token rows have any past. "bf16": bf16 products over a half cache, against the truth that rounds them."""
    bf16 = cache == "bf16"
    cache = np.float16 if bf16 else cache
    heads, kv_heads, head_dim = shape
    if batch > 1 and seq > 1:
        seqlens = [seq - 1] * batch
    else:
        seqlens = data.draw(st.lists(st.integers(seq - 1, CAPACITY - 1), min_size=batch, max_size=batch))
    qkv, keys, values = inputs(np.random.default_rng(data.draw(st.integers(0, 2**31))), batch, seq, heads, kv_heads,
                               head_dim, cache)
    got = run("qs", qkv, keys, values, seqlens, heads, kv_heads, window, threads, bf16)
    assert_matches_reference(got, reference(qkv, keys, values, seqlens, heads, kv_heads, window, bf16), seqlens, bf16)


@pytest.mark.parametrize("cache", [np.float32, np.float16, "bf16"])
@pytest.mark.parametrize("position", [50, 517])
@pytest.mark.parametrize("chunk_len", [10, 48])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 4, 2), (128, 8, 8), (64, 14, 2), (128, 12, 2)])
def test_a_row_is_bitwise_the_same_alone_batched_or_in_a_chunk(head_dim, heads, kv_heads, chunk_len, position, cache):
    """The token at `position` of a sequence: decoded alone (at 517, its keys split by segment across threads),
    decoded beside four other sequences (whose count changes how the op splits its work), as the last of a
    three-token step (a verification: at 517 split by segment, the three tokens in each task), and as the last of a
    prompt chunk (every segment in one task; 48 tokens make tiles of 16 rows, whose keys are scored 16 at a time
    from a transposed block): the same bits."""
    rng = np.random.default_rng(7)
    bf16 = cache == "bf16"                   # bf16 products over a half cache
    cache = np.float16 if bf16 else cache
    qkv, keys, values = inputs(rng, 1, chunk_len, heads, kv_heads, head_dim, cache)
    chunk, chunk_keys, chunk_values = run("qs", qkv, keys, values, [position], heads, kv_heads, bf16=bf16)
    last = qkv[:, chunk_len - 1:chunk_len]   # decoded over the cache the chunk left (its row rewritten, same bits)
    alone, _, _ = run("qs", last, chunk_keys, chunk_values, [position], heads, kv_heads, bf16=bf16)
    others_qkv, others_keys, others_values = inputs(rng, 5, 1, heads, kv_heads, head_dim, cache)
    others_qkv[2], others_keys[2], others_values[2] = last[0], chunk_keys[0], chunk_values[0]
    batched, _, _ = run("qs", others_qkv, others_keys, others_values, [5, 600, position, 11, 90], heads, kv_heads,
                        bf16=bf16)
    pair_qkv, pair_keys, pair_values = others_qkv[1:3], others_keys[1:3], others_values[1:3]
    pair, _, _ = run("qs", pair_qkv, pair_keys, pair_values, [600, position], heads, kv_heads, bf16=bf16)  # split
    three, _, _ = run("qs", qkv[:, -3:], chunk_keys, chunk_values, [position], heads, kv_heads, bf16=bf16)  # short
    assert np.array_equal(alone[0, 0], chunk[0, -1])
    assert np.array_equal(three[0], chunk[0, -3:])
    assert np.array_equal(batched[2, 0], chunk[0, -1])
    assert np.array_equal(pair[1, 0], chunk[0, -1])


@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_an_unsupported_head_dim_is_refused(cache):
    qkv, keys, values = inputs(np.random.default_rng(0), 1, 1, 2, 1, 48, cache)
    with pytest.raises(Exception, match="head_dim must be 16, 32, 64, 96 or 128"):
        run("qs", qkv, keys, values, [5], 2, 1)


def test_a_sequence_past_the_cache_is_refused():
    qkv, keys, values = inputs(np.random.default_rng(0), 1, 1, 4, 2, 16)
    with pytest.raises(Exception, match="longer than the KV cache"):
        run("qs", qkv, keys, values, [CAPACITY], 4, 2)


def row_quantize_sessions(k: int) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """(ours, the four ONNX Runtime ops the int8 linears used before) over x [B, S, k]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", k])
    outs = [helper.make_tensor_value_info("q", TensorProto.UINT8, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None)]
    ours = [helper.make_node("RowQuantize", ["x"], ["q", "s"], domain=cpu_ops.DOMAIN)]
    consts = [helper.make_tensor("axes", TensorProto.INT64, [1], [-1]),
              helper.make_tensor("inv127", TensorProto.FLOAT, [], [1 / 127]),
              helper.make_tensor("zp", TensorProto.UINT8, [], [128])]
    theirs = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("ReduceMax", ["a", "axes"], ["m"], keepdims=1),
              helper.make_node("Mul", ["m", "inv127"], ["s"]), helper.make_node("Shape", ["s"], ["shape"]),
              helper.make_node("Expand", ["zp", "shape"], ["zps"]),
              helper.make_node("QuantizeLinear", ["x", "s", "zps"], ["q"], axis=-1, block_size=k)]
    made = []
    for nodes, inits in ((ours, []), (theirs, consts)):
        model = helper.make_model(helper.make_graph(nodes, "q", [x], outs, inits),
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu_ops.DOMAIN, 1)])
        so = ort.SessionOptions()
        cpu_ops.register(so)
        made.append(ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]))
    return made[0], made[1]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), k=st.sampled_from([16, 64, 576, 1536, 33]), magnitude=st.sampled_from([1e-6, 1.0, 3e4]),
       seed=st.integers(0, 2**31))
def test_row_quantize_is_the_four_ops_bit_for_bit(rows, k, magnitude, seed):
    """Any number of rows (several tasks from 17 on), any width (a tail past the 16 lanes), any magnitude; ties
    at .5 steps round to even as QuantizeLinear does."""
    ours, theirs = row_quantize_sessions(k)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, rows, k)) * magnitude).astype(np.float32)
    x[0, 0, :6] = np.array([127, -127, 63.5, -0.5, 1.5, 2.5], np.float32) * (magnitude / 127)   # exact halves
    (q, s), (q_ref, s_ref) = ours.run(None, {"x": x}), theirs.run(None, {"x": x})
    assert np.array_equal(s, s_ref) and np.array_equal(q, q_ref)


def test_row_quantize_of_a_zero_row():
    ours, _ = row_quantize_sessions(16)
    q, s = ours.run(None, {"x": np.zeros((1, 2, 16), np.float32)})
    assert (s == 0).all() and (q == 128).all()


def _session(nodes, inits, inputs, threads: int = 2) -> ort.InferenceSession:
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
                       helper.make_opsetid(cpu_ops.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    cpu_ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def int8_matmul_sessions(q: np.ndarray, scale: np.ndarray, threads: int = 2):
    """(qs.Int8MatMul on the packed weight, RowQuantize → MatMulIntegerToFloat on the plain one) over x [M, K]."""
    k, n = q.shape
    packed, zsum = int8.pack_panels(q)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    ours = _session([helper.make_node("Int8MatMul", ["x", "w", "s", "z"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n)],
                    [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scale, "s"),
                     numpy_helper.from_array(zsum, "z")], [x], threads)
    theirs = _session([helper.make_node("RowQuantize", ["x"], ["xq", "a"], domain=cpu_ops.DOMAIN),
                       helper.make_node("MatMulIntegerToFloat", ["xq", "w", "a", "s", "zp"], ["y"], domain="com.microsoft")],
                      [numpy_helper.from_array(q, "w"), numpy_helper.from_array(scale, "s"),
                       numpy_helper.from_array(np.array(128, np.uint8), "zp")], [x], threads)
    return ours, theirs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.sampled_from([1, 3, 4, 33, 64, 576, 1536]), n=st.sampled_from([1, 15, 16, 17, 100, 960]),
       rows=st.sampled_from([1, 2, 3, 4, 5, 9, 63, 64, 65, 130]), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31))
def test_int8_matmul_is_row_quantize_and_matmul_integer_to_float_bit_for_bit(k, n, rows, threads, seed):
    """Widths off the 4-k and 16-channel grid (zero padding), row counts across the 4-row micro-kernel and the
    64-row task blocks, one or two threads; the extreme weights ±63 and activations that quantize to 0 and 255."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-int8.WEIGHT_LEVELS, int8.WEIGHT_LEVELS + 1, (k, n), dtype=np.int8)
    q[0, :] = int8.WEIGHT_LEVELS
    scale = (rng.random(n) * 1e-2 + 1e-4).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * rng.random((rows, 1)) * 10).astype(np.float32)
    x[0, 0] = np.abs(x[0]).max() * 2                   # quantizes to 255 (and the row's others around 128)
    ours, theirs = int8_matmul_sessions(q, scale, threads)
    got, want = ours.run(None, {"x": x})[0], theirs.run(None, {"x": x})[0]
    assert got.shape == (rows, n)
    assert np.array_equal(got, want)
    # and what both compute: the exact integer product, scaled by the channel's scale then the row's
    a = np.abs(x).max(axis=1, keepdims=True) * np.float32(1 / 127)
    xq = np.clip(np.rint(x / a) + 128, 0, 255).astype(np.int64)
    exact = ((xq - 128) @ q.astype(np.int64)).astype(np.float32)
    assert np.array_equal(got, exact * scale * a.astype(np.float32))


def test_int8_matmul_rows_do_not_depend_on_their_neighbours():
    rng = np.random.default_rng(3)
    q = rng.integers(-63, 64, (576, 300), dtype=np.int8)
    ours, _ = int8_matmul_sessions(q, np.full(300, 1e-3, np.float32))
    x = rng.standard_normal((70, 576)).astype(np.float32)
    many = ours.run(None, {"x": x})[0]
    for i in (0, 3, 64, 69):
        assert np.array_equal(ours.run(None, {"x": x[i:i + 1]})[0][0], many[i])


def test_int8_matmul_refuses_a_weight_of_the_wrong_size():
    q = np.ones((8, 16), np.int8)
    packed, zsum = int8.pack_panels(q)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 8])
    bad = _session([helper.make_node("Int8MatMul", ["x", "w", "s", "z"], ["y"], domain=cpu_ops.DOMAIN, K=8, N=32)],
                   [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(np.ones(32, np.float32), "s"),
                    numpy_helper.from_array(np.zeros(32, np.int32), "z")], [x])
    with pytest.raises(Exception, match="packed weight"):
        bad.run(None, {"x": np.ones((1, 8), np.float32)})


@pytest.mark.parametrize("vocab,hidden", [(100, 576), (16, 4), (33, 7)])
def test_packed_gather_is_the_int8_lookup_bit_for_bit(vocab, hidden):
    rng = np.random.default_rng(vocab)
    q, scale = int8.quantize(rng.standard_normal((vocab, hidden)).astype(np.float32), axis=1, levels=63)
    packed, _ = int8.pack_panels(np.ascontiguousarray(q.T))
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])
    s = _session([helper.make_node("PackedGather", ["ids", "t", "s"], ["y"], domain=cpu_ops.DOMAIN, K=hidden)],
                 [numpy_helper.from_array(packed, "t"), numpy_helper.from_array(scale, "s")], [ids])
    tokens = rng.integers(0, vocab, (3, 5))
    tokens[0, :2] = [0, vocab - 1]
    got = s.run(None, {"ids": tokens})[0]
    assert np.array_equal(got, q[tokens].astype(np.float32) * scale[tokens][..., None])
    with pytest.raises(Exception, match="outside the vocabulary"):
        s.run(None, {"ids": np.array([[vocab]], np.int64)})


def test_pack_panels_layout():
    """Panel p, step s, channel c, lane j holds q[4s + j, 16p + c]; the padding is zero; zsum = 128·Σ_k q."""
    rng = np.random.default_rng(0)
    q = rng.integers(-63, 64, (9, 20), dtype=np.int8)
    packed, zsum = int8.pack_panels(q)
    assert packed.shape == (2, 12 * 16)
    cells = packed.reshape(2, 3, 16, 4)
    for p, s_, c, j in [(0, 0, 0, 0), (1, 2, 3, 0), (0, 1, 15, 3), (1, 0, 3, 2)]:
        assert cells[p, s_, c, j] == q[4 * s_ + j, 16 * p + c]
    assert not cells[1, :, 4:].any() and not cells[:, 2, :, 1:].any()
    assert np.array_equal(zsum, 128 * q.astype(np.int32).sum(axis=0))


def int4_session(k: int, n: int, packed: np.ndarray, threads: int = 2, int_scales: bool = False) -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    return _session([helper.make_node("Int4MatMul", ["x", "w"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n,
                                      **({"int_scales": 1} if int_scales else {}))],
                    [numpy_helper.from_array(packed, "w")], [x], threads)


def int4_pack(w: np.ndarray, int_scales: bool) -> tuple[np.ndarray, np.ndarray]:
    """(qs.Int4MatMul's packed weight, its dequantized values float32 [K, N]) in either packing."""
    k, n = w.shape
    if int_scales:
        packed = int4.pack_panels_int(w)
        return packed, int4.unpack_panels_int(packed, k, n)
    packed = int4.pack_panels(w)
    return packed, int4.unpack_panels(packed, k, n)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.sampled_from([32, 64, 576, 1536]), n=st.sampled_from([1, 15, 16, 17, 33, 300]),
       rows=st.sampled_from([1, 2, 3, 4, 5, 9, 127, 128, 129]), threads=st.sampled_from([1, 2]),
       int_scales=st.booleans(), seed=st.integers(0, 2**31))
def test_int4_matmul_matches_float64_truth_and_is_row_invariant(k, n, rows, threads, int_scales, seed):
    """The op computes x_q @ dequantized(W) · a (x_q: the row's int8 activations; fp16 block scales: exact sums per
    block of 32, one fp32 multiply-add per block; integer scales: one exact sum over K, then the channel scale):
    within float32 rounding of float64 truth; and every row's bits are the same alone as among the others (row
    counts across the 4-row micro-kernel and the 128-row task blocks)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, 0] = 0                                           # an all-zero channel (scale 1, u = 8)
    if k > 32 and n > 1:
        w[:32, 1] *= 1e-3                                 # a block far below its channel's largest: multiplier 1
    packed, dequantized = int4_pack(w, int_scales)
    session = int4_session(k, n, packed, threads, int_scales)
    x = (rng.standard_normal((rows, k)) * rng.random((rows, 1)) * 10).astype(np.float32)
    got = session.run(None, {"x": x})[0]
    a = np.abs(x).max(axis=1, keepdims=True) * np.float32(1 / 127)
    xq = np.clip(np.rint(x / a), -127, 127).astype(np.float64)
    want = (xq @ dequantized.astype(np.float64)) * a
    scale = np.abs(xq).sum(axis=1, keepdims=True) @ np.abs(dequantized).max(axis=0, keepdims=True) * a
    assert got.shape == (rows, n)
    assert (np.abs(got - want) <= 1e-6 * scale + 1e-30).all()
    assert not got[:, 0].any()
    for i in {0, rows // 2, rows - 1}:
        assert np.array_equal(session.run(None, {"x": x[i:i + 1]})[0][0], got[i])


def test_int4_pack_panels_round_trip_and_error_bound():
    """Dequantized weights are within half a step (scale / 2) of the originals, and unpack inverts pack."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 20)).astype(np.float32)
    packed = int4.pack_panels(w)
    assert packed.shape == (2, 2 * int4.BLOCK_BYTES) and packed.dtype == np.uint8
    back = int4.unpack_panels(packed, 64, 20)
    step = np.abs(w.reshape(2, 32, 20)).max(axis=1) / 7                          # [blocks, N]
    assert (np.abs(back - w) <= np.repeat(step, 32, axis=0) * 0.5 * (1 + 1e-3)).all()
    assert np.array_equal(int4.pack_panels(back), packed)                     # exact values re-pack the same
    with pytest.raises(ValueError, match="divisible by 32"):
        int4.pack_panels(np.ones((40, 4), np.float32))


def test_int4_matmul_with_integer_scales_refuses_a_k_its_sums_could_overflow():
    k = 4097 * 32
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    with pytest.raises(Exception, match="at most 131072"):
        _session([helper.make_node("Int4MatMul", ["x", "w"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=16, int_scales=1)],
                 [numpy_helper.from_array(np.zeros(16, np.uint8), "w")], [x_info])


def test_int4_pack_panels_int_round_trip_and_error_bound():
    """Integer scales: each block's step is m · S with m the smallest multiplier in 1..16 that holds the block
    (S = the channel's max / (7 · 16)), values within half a step; unpack inverts pack."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 20)).astype(np.float32)
    w[32:64, 3] *= 1e-4                                                        # a tiny block: m = 1
    w[:, 5] = 0
    packed = int4.pack_panels_int(w)
    assert packed.shape == (2, 3 * int4.INT_BLOCK_BYTES + 64) and packed.dtype == np.uint8
    back = int4.unpack_panels_int(packed, 96, 20)
    absmax = np.abs(w.reshape(3, 32, 20)).max(axis=1)                         # [blocks, N]
    top = np.where(absmax.max(axis=0) > 0, absmax.max(axis=0), 112.0)
    m = np.clip(np.ceil(absmax / (top / 16) - 1e-6), 1, 16)
    assert m[1, 3] == 1 and (np.delete(m.max(axis=0), 5) == 16).all()
    step = m * top / 112
    assert (np.abs(back - w) <= np.repeat(step, 32, axis=0) * 0.5 * (1 + 1e-3)).all()
    assert not back[:, 5].any()


@pytest.mark.parametrize("int_scales", [False, True])
@pytest.mark.parametrize("vocab,hidden", [(100, 64), (16, 32), (33, 96)])
def test_int4_gather_reads_the_head_table_rows(vocab, hidden, int_scales):
    rng = np.random.default_rng(vocab)
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    packed, dequantized = int4_pack(np.ascontiguousarray(table.T), int_scales)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])
    s = _session([helper.make_node("Int4Gather", ["ids", "t"], ["y"], domain=cpu_ops.DOMAIN, K=hidden, N=vocab,
                                   **({"int_scales": 1} if int_scales else {}))],
                 [numpy_helper.from_array(packed, "t")], [ids])
    tokens = rng.integers(0, vocab, (2, 7))
    tokens[0, :2] = [0, vocab - 1]
    want = dequantized.T[tokens]
    assert np.array_equal(s.run(None, {"ids": tokens})[0], want)
    with pytest.raises(Exception, match="outside the vocabulary"):
        s.run(None, {"ids": np.array([[vocab]], np.int64)})


def swiglu_session() -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", "F2"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("SwiGLU", ["x"], ["y"], domain=cpu_ops.DOMAIN)
    model = helper.make_model(helper.make_graph([node], "swiglu", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(cpu_ops.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    cpu_ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), f=st.sampled_from([1, 7, 64, 300, 1536]), magnitude=st.sampled_from([0.1, 4.0, 60.0]),
       seed=st.integers(0, 2**31))
def test_swiglu_matches_float64_truth_and_is_row_invariant(rows, f, magnitude, seed):
    """Gate and up halves of every size (blocks of the op's 256-element pass and their tails), magnitudes where the
    sigmoid saturates; then each row alone gives the same bits as among all rows."""
    x = (np.random.default_rng(seed).standard_normal((1, rows, 2 * f)) * magnitude).astype(np.float32)
    x[0, 0, :2] = [0.0, -0.0]
    sess = swiglu_session()
    got = sess.run(None, {"x": x})[0]
    g, u = x[..., :f].astype(np.float64), x[..., f:].astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    for r in (0, rows // 2, rows - 1):
        assert np.array_equal(sess.run(None, {"x": x[:, r:r + 1]})[0][0, 0], got[0, r])


def test_swiglu_refuses_an_odd_width():
    with pytest.raises(Exception, match="must be even"):
        swiglu_session().run(None, {"x": np.zeros((1, 1, 5), np.float32)})


def _packed_linear(bits: int, w: np.ndarray) -> dict[str, np.ndarray]:
    """qs.Int{bits}MatMul's weight inputs for w [K, N] by input name: the packed int4 panels, or the int8 panels with
    their channel scales and zero sums."""
    if bits == 4:
        return {"w": int4.pack_panels(w)}
    q, scale = int8.quantize(w, levels=int8.WEIGHT_LEVELS)
    packed, zsum = int8.pack_panels(q)
    return {"w": packed, "ws": scale, "wz": zsum}


def _fold_sessions(bits: int, w: np.ndarray, bias: np.ndarray | None, gamma: np.ndarray, prologue: int, residual: bool,
                   threads: int) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """(qs.Int{bits}MatMul with the prologue and bias folded in, the ops it replaces in front of and behind a plain
    one) over the weight w [K, N]. prologue 2: x, skip [M, K] → y (+ r: x + skip); 1: x [M, 2K] → y; 0: x [M, K] → y.
    Without a bias, no Add behind it and no bias input."""
    eps, (k, n) = 1e-6, w.shape
    weights = _packed_linear(bits, w)
    inits = [numpy_helper.from_array(a, name) for name, a in weights.items()]
    if prologue == 2:
        inits.append(numpy_helper.from_array(gamma, "g"))
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "b"))
    op, mm, ws, b = f"Int{bits}MatMul", dict(domain=cpu_ops.DOMAIN, K=k, N=n), list(weights), "b" if bias is not None else ""
    behind = [helper.make_node(op, ["h", *ws], ["yb"], **mm), helper.make_node("Add", ["yb", "b"], ["y"])] \
        if b else [helper.make_node(op, ["h", *ws], ["y"], **mm)]
    if prologue == 2:
        ins = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", k]) for name in ("x", "skip")]
        fused = [helper.make_node(op, ["x", *ws, b, "skip", "g"], ["y", "r"] if residual else ["y"],
                                  prologue=2, epsilon=eps, **mm)]
        plain = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "g"], ["h", "", "", "r"],
                                  domain="com.microsoft", epsilon=eps)] + behind
    elif prologue == 1:
        ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 2 * k])]
        fused = [helper.make_node(op, ["x", *ws] + ([b] if b else []), ["y"], prologue=1, **mm)]
        plain = [helper.make_node("SwiGLU", ["x"], ["h"], domain=cpu_ops.DOMAIN)] + behind
    else:
        ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])]
        fused = [helper.make_node(op, ["x", *ws] + ([b] if b else []), ["y"], **mm)]
        plain = [helper.make_node("Identity", ["x"], ["h"])] + behind
    sessions = []
    for nodes in (fused, plain):
        outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
        if residual:
            outs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
        model = helper.make_model(helper.make_graph(nodes, "g", ins, outs, inits),
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
                                                 helper.make_opsetid(cpu_ops.DOMAIN, 1)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        cpu_ops.register(so)
        sessions.append(ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]))
    return sessions[0], sessions[1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from([4, 8]), k=st.sampled_from([32, 64, 896, 1536]), n=st.sampled_from([1, 17, 300]),
       rows=st.sampled_from([0, 1, 2, 5, 129]), prologue=st.sampled_from([0, 1, 2]), with_bias=st.booleans(),
       residual=st.booleans(), threads=st.sampled_from([1, 2]), magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 2**31))
def test_linear_folds_are_the_ops_they_replace_bit_for_bit(bits, k, n, rows, prologue, with_bias, residual, threads,
                                                           magnitude, seed):
    """The folded op gives the bits of SkipSimplifiedLayerNormalization (or SwiGLU, or nothing) → Int{4,8}MatMul
    (→ Add where there is a bias), the residual sum too, for every row count (none included) and thread count; each
    row's bits alone are those among the others."""
    residual = residual and prologue == 2
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    gamma = (1 + rng.standard_normal(k) / 4).astype(np.float32)
    fused, plain = _fold_sessions(bits, rng.standard_normal((k, n)).astype(np.float32), bias, gamma, prologue,
                                  residual, threads)
    width = 2 * k if prologue == 1 else k
    feed = {"x": (rng.standard_normal((rows, width)) * magnitude).astype(np.float32)}
    if prologue == 2:
        feed["skip"] = (rng.standard_normal((rows, k)) * magnitude).astype(np.float32)
    got, want = fused.run(None, feed), plain.run(None, feed)
    assert len(got) == len(want) == 1 + residual
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    assert got[0].shape == (rows, n)
    for r in ({0, rows - 1} if rows else ()):
        alone = fused.run(None, {name: v[r:r + 1] for name, v in feed.items()})
        assert all(np.array_equal(a[0], g[r]) for a, g in zip(alone, got))


def test_int8_linear_folds_refuse_misplaced_inputs():
    """qs.Int8MatMul's skip and gamma are inputs 5 and 6: a skip of the wrong shape, or skip and gamma without the
    skip RMS norm, or the residual output without it, are refused with what is wrong."""
    k, n = 64, 16
    q, scale = int8.quantize(np.ones((k, n), np.float32), levels=int8.WEIGHT_LEVELS)
    packed, zsum = int8.pack_panels(q)
    inits = [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scale, "ws"),
             numpy_helper.from_array(zsum, "wz"), numpy_helper.from_array(np.ones(k, np.float32), "g")]
    ins = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", None]) for name in ("x", "skip")]
    x, mm = np.ones((2, k), np.float32), dict(domain=cpu_ops.DOMAIN, K=k, N=n)
    normed = _session([helper.make_node("Int8MatMul", ["x", "w", "ws", "wz", "", "skip", "g"], ["y"], prologue=2,
                                        epsilon=1e-6, **mm)], inits, ins)
    assert normed.run(None, {"x": x, "skip": x})[0].shape == (2, n)
    with pytest.raises(Exception, match="skip shaped as x"):
        normed.run(None, {"x": x, "skip": np.ones((2, k + 1), np.float32)})
    plain = _session([helper.make_node("Int8MatMul", ["x", "w", "ws", "wz", "", "skip", "g"], ["y"], **mm)], inits, ins)
    with pytest.raises(Exception, match="skip and gamma are the skip RMS norm's inputs"):
        plain.run(None, {"x": x, "skip": x})
    outs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "r")]
    model = helper.make_model(helper.make_graph([helper.make_node("Int8MatMul", ["x", "w", "ws", "wz"], ["y", "r"], **mm)],
                                                "g", ins[:1], outs, inits[:3]),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu_ops.DOMAIN, 1)])
    so = ort.SessionOptions()
    cpu_ops.register(so)
    residual = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="residual output comes with the skip RMS norm"):
        residual.run(None, {"x": x})


def test_linear_folds_refuse_what_they_cannot_compute():
    k, n = 64, 16
    packed = int4.pack_panels(np.ones((k, n), np.float32))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    w = numpy_helper.from_array(packed, "w")
    swiglu = _session([helper.make_node("Int4MatMul", ["x", "w"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n,
                                        prologue=1)], [w], [x])
    with pytest.raises(Exception, match="2K = 128"):      # SwiGLU reads gate | up: twice K
        swiglu.run(None, {"x": np.ones((1, k), np.float32)})
    no_skip = _session([helper.make_node("Int4MatMul", ["x", "w"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n,
                                         prologue=2, epsilon=1e-6)], [w], [x])
    with pytest.raises(Exception, match="skip shaped as x and gamma"):
        no_skip.run(None, {"x": np.ones((1, k), np.float32)})
    bias = numpy_helper.from_array(np.ones(n + 1, np.float32), "b")
    wrong_bias = _session([helper.make_node("Int4MatMul", ["x", "w", "b"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n)],
                          [w, bias], [x])
    with pytest.raises(Exception, match="bias must hold N = 16"):
        wrong_bias.run(None, {"x": np.ones((1, k), np.float32)})
    with pytest.raises(Exception, match="prologue must be"):
        _session([helper.make_node("Int4MatMul", ["x", "w"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n, prologue=3)],
                 [w], [x])
    with pytest.raises(Exception, match="prologue attribute must be an integer"):
        _session([helper.make_node("Int4MatMul", ["x", "w"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n, prologue=2.0)],
                 [w], [x])


@pytest.mark.parametrize("bits", [4, 8])
def test_linear_constants_fed_at_run_time_give_the_same_bits(bits):
    """A linear's weight, bias and gamma given as initializers are taken once, when the kernel is made
    (qs_constant_input); the same tensors fed as graph inputs are read and checked on every call. Both give the same
    bits, and a tensor of the wrong size is refused either way."""
    k, n, rows = 896, 300, 3
    rng = np.random.default_rng(7)
    consts = _packed_linear(bits, rng.standard_normal((k, n)).astype(np.float32))
    weights = list(consts)
    consts["b"] = rng.standard_normal(n).astype(np.float32)
    consts["g"] = (1 + rng.standard_normal(k) / 4).astype(np.float32)
    node = helper.make_node(f"Int{bits}MatMul", ["x", *weights, "b", "skip", "g"], ["y"], domain=cpu_ops.DOMAIN, K=k,
                            N=n, prologue=2, epsilon=1e-6)
    acts = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", k]) for name in ("x", "skip")]
    fed_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), None)
                  for name, a in consts.items()]
    constant = _session([node], [numpy_helper.from_array(a, name) for name, a in consts.items()], acts)
    fed = _session([node], [], acts + fed_inputs)
    feed = {name: rng.standard_normal((rows, k)).astype(np.float32) for name in ("x", "skip")}
    want = constant.run(None, feed)[0]
    assert want.shape == (rows, n) and np.isfinite(want).all()
    assert np.array_equal(fed.run(None, {**feed, **consts})[0], want)
    for name, error in (("w", "packed weight"), ("b", "bias must hold"), ("g", "gamma of K values")):
        wrong = {**consts, name: consts[name][:-1]}
        with pytest.raises(Exception, match=error):
            fed.run(None, {**feed, **wrong})
        with pytest.raises(Exception, match=error):
            _session([node], [numpy_helper.from_array(a, key) for key, a in wrong.items()], acts).run(None, feed)
