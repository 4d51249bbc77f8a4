"""The CUDA kernels against PyTorch on a GPU: paged attention (decode and multi-token, GQA, f16/bf16, fp8 KV)
vs scaled_dot_product_attention over each sequence's contiguous K/V, and the small kernels vs torch.

Skipped (with the reason) wherever there is no CUDA GPU — which includes CI.

A read of memory no kernel wrote must fail here every time, not only after some other case left NaN behind
(issue #47: the split-K reduce read partials of partitions past a sequence's end, and one test failed only
when run after others). So:
  * every workspace and every output is filled with 0xFF bytes before each kernel call (NaN as f32, f16 and
    bf16; -1 as int32): a partial or an output the kernels should have written but did not reads as NaN and
    fails the comparison (QS_TEST_POISON=0 turns this off, e.g. for compute-sanitizer's initcheck, which
    counts the poison as a write);
  * the cases run in a random order (QS_TEST_SEED=N repeats one; the seed is printed before and after the
    run), each with its own torch seed, so no case depends on what ran before it.
"""

from __future__ import annotations

import os
import random
import sys
import types
import zlib
from pathlib import Path

import pytest

from conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch")
F = torch.nn.functional

# ---- random order ----------------------------------------------------------------------------------------------
# pytest takes hooks from plugins only, not from test modules; this module names a small plugin of its own
# in pytest_plugins, which shuffles this module's cases among their own places (others keep theirs).
ORDER_SEED = int(os.environ.get("QS_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
_THIS = Path(__file__).resolve()
_shuffled: list[int] = []


def _mine(item) -> bool:
    return Path(str(item.path)).resolve() == _THIS


def _shuffle_cases(items) -> None:
    places = [i for i, item in enumerate(items) if _mine(item)]
    cases = [items[i] for i in places]
    random.Random(ORDER_SEED).shuffle(cases)
    for i, item in zip(places, cases):
        items[i] = item
    _shuffled.append(len(cases))


def _order_line() -> str:
    return f"{_THIS.name}: {sum(_shuffled)} cases in random order, seed {ORDER_SEED} (QS_TEST_SEED={ORDER_SEED} repeats it)"


def _report_order(items):
    return _order_line() if any(_mine(item) for item in items) else None


def _summarize_order(terminalreporter) -> None:
    if sum(_shuffled):
        terminalreporter.write_line(_order_line())


_order_plugin = types.ModuleType("qs_test_cuda_gpu_order", "Random order of test_cuda_gpu.py's cases. PYTEST_DONT_REWRITE")
_order_plugin.pytest_collection_modifyitems = _shuffle_cases
_order_plugin.pytest_report_collectionfinish = _report_order
_order_plugin.pytest_terminal_summary = _summarize_order
sys.modules.setdefault(_order_plugin.__name__, _order_plugin)
pytest_plugins = [_order_plugin.__name__]


@pytest.fixture(autouse=True)
def _own_torch_seed(request):
    """Each case's random data depends on its name only, not on which cases ran before it."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


# ---- poison ----------------------------------------------------------------------------------------------------
POISON = os.environ.get("QS_TEST_POISON", "1") != "0"


def poison(*tensors) -> None:
    """Fill with 0xFF bytes: NaN in every float dtype the kernels write (f32, f16, bf16), -1 as int32."""
    for t in tensors:
        if POISON and t is not None and t.numel():
            t.view(torch.uint8).fill_(0xFF)


def workspace(nbytes: int):
    """A workspace of `nbytes` (None for 0), poisoned from the start."""
    if nbytes == 0:
        return None
    ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    poison(ws)
    return ws


class PoisonedKernels:
    """The kernels with each call's workspace and outputs poisoned just before it, on the current stream (the
    stream the tests pass, so inside a CUDA graph the poison is captured and every replay repeats it)."""

    def __init__(self, kernels):
        self._kernels = kernels

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def paged_attention(self, out, *args, workspace=None, **kwargs):
        poison(out, workspace)
        self._kernels.paged_attention(out, *args, workspace=workspace, **kwargs)

    def packed_paged_attention(self, out, *args, workspace=None, **kwargs):
        poison(out, workspace)
        self._kernels.packed_paged_attention(out, *args, workspace=workspace, **kwargs)

    def rmsnorm_residual(self, out, *args, **kwargs):
        poison(out)
        self._kernels.rmsnorm_residual(out, *args, **kwargs)


@pytest.fixture
def cuda_kernels(cuda_kernels):
    return PoisonedKernels(cuda_kernels)


def make_paged(seq_lens, kv_heads, head_dim, block_size, dtype, seed):
    """Random K/V per sequence, scattered over a shuffled block pool; returns (caches, tables, dense K/V)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=g, device="cuda")
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    width = max(blocks_per)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
    dense, used = [], 0
    for b, n in enumerate(seq_lens):
        ids = perm[used:used + blocks_per[b]]
        used += blocks_per[b]
        tables[b, :len(ids)] = ids.int()
        k = torch.randn(n, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
        pos = torch.arange(n, device="cuda")
        k_cache[ids[pos // block_size], pos % block_size] = k
        v_cache[ids[pos // block_size], pos % block_size] = v
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


def sdpa(q, k, v, window=0):
    """q [n, H, D] (float32), k/v [L, KVH, D]: attention of the n queries at positions L-n .. L-1 (causal;
    with window > 0 each sees its last `window` keys only)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    n, L = q.shape[0], k.shape[1]
    keys, rows = torch.arange(L, device="cuda")[None, :], torch.arange(L - n, L, device="cuda")[:, None]
    mask = keys <= rows
    if window > 0:
        mask &= keys > rows - window
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 8, 64), (32, 8, 128), (14, 2, 64), (16, 1, 128), (9, 3, 64)])
def test_decode_matches_sdpa(cuda_kernels, dtype, heads, kv_heads, head_dim):
    seq_lens = [1, 17, 255, 256, 257, 1000, 4096, 8192]
    k_cache, v_cache, tables, dense = make_paged(seq_lens, kv_heads, head_dim, 16, dtype, seed=heads + head_dim)
    q = torch.randn(len(seq_lens), heads, head_dim, device="cuda").to(dtype)
    out = torch.empty_like(q)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ws = workspace(cuda_kernels.workspace_size(len(seq_lens), heads, head_dim, max(seq_lens)))
    cuda_kernels.paged_attention(out, q, k_cache, v_cache, tables, lens, max_seq_len=max(seq_lens), workspace=ws)
    torch.cuda.synchronize()
    for b, (k, v) in enumerate(dense):
        ref = sdpa(q[b:b + 1], k, v)
        torch.testing.assert_close(out[b:b + 1].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_with_fp8_kv_matches_sdpa_on_dequantized_cache(cuda_kernels):
    seq_lens = [33, 700, 3000]
    k_cache, v_cache, tables, dense = make_paged(seq_lens, 4, 128, 16, torch.float16, seed=7)
    k_scale = (k_cache.float().abs().max() / 448).reshape(1)
    v_scale = (v_cache.float().abs().max() / 448).reshape(1)
    k8 = (k_cache.float() / k_scale).to(torch.float8_e4m3fn)
    v8 = (v_cache.float() / v_scale).to(torch.float8_e4m3fn)
    q = torch.randn(3, 16, 128, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    ws = workspace(cuda_kernels.workspace_size(3, 16, 128, 3000))
    cuda_kernels.paged_attention(out, q, k8, v8, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                                 max_seq_len=3000, k_scale=k_scale, v_scale=v_scale, workspace=ws)
    torch.cuda.synchronize()
    kd, vd = k8.float() * k_scale, v8.float() * v_scale
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device="cuda")
        blk = tables[b].long()[pos // 16]
        ref = sdpa(q[b:b + 1], kd[blk, pos % 16], vd[blk, pos % 16])
        torch.testing.assert_close(out[b:b + 1].float(), ref, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_multi_token_attention_is_causal_over_cached_and_new(cuda_kernels, dtype, window):
    seq_lens, q_lens = [12, 300, 1030, 5], [12, 5, 130, 1]     # prefill, verification, chunked prefill, decode
    k_cache, v_cache, tables, dense = make_paged(seq_lens, 2, 64, 16, dtype, seed=3)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), 8, 64, device="cuda").to(dtype)
    out = torch.empty_like(q)
    ws = workspace(cuda_kernels.workspace_size(q.shape[0], 8, 64, max(seq_lens)))
    cuda_kernels.paged_attention(out, q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                                 cu_seqlens_q=cu, max_seq_len=max(seq_lens), window=window, workspace=ws)
    torch.cuda.synchronize()
    for b, (k, v) in enumerate(dense):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        torch.testing.assert_close(out[rows].float(), sdpa(q[rows], k, v, window), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("seq_lens, window", [([600], 100), ([600, 40, 1300, 1], 300), ([1300, 257, 9], 256)])
def test_sliding_window_sees_only_the_last_keys(cuda_kernels, seq_lens, window):
    """Partitions count from the window's first key: a row's partitions past its end exist for no one."""
    k_cache, v_cache, tables, dense = make_paged(seq_lens, 2, 64, 16, torch.float16, seed=5)
    q = torch.randn(len(seq_lens), 4, 64, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    ws = workspace(cuda_kernels.workspace_size(len(seq_lens), 4, 64, max(seq_lens)))
    cuda_kernels.paged_attention(out, q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                                 max_seq_len=max(seq_lens), window=window, workspace=ws)
    torch.cuda.synchronize()
    for b, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[b:b + 1].float(), sdpa(q[b:b + 1], k[-window:], v[-window:]), atol=4e-3, rtol=4e-3)


def test_decode_graph_replays_for_any_lengths_under_the_bound(cuda_kernels):
    """One launch captured in a CUDA graph with its grid sized from the max_seq_len bound, replayed for lengths
    far under it (and a padding sequence of length 0, whose output is zero): each sequence's partition count
    comes from seq_lens on the device, and the poisoned workspace is refilled by every replay."""
    full, bound = [3000, 700, 40, 300], 4096
    k_cache, v_cache, tables, dense = make_paged(full, 2, 64, 16, torch.float16, seed=13)
    tables = F.pad(tables, (0, bound // 16 - tables.shape[1])).contiguous()
    q = torch.randn(len(full), 8, 64, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    lens = torch.tensor(full, dtype=torch.int32, device="cuda")
    ws = workspace(cuda_kernels.workspace_size(len(full), 8, 64, bound))

    def step():
        cuda_kernels.paged_attention(out, q, k_cache, v_cache, tables, lens, max_seq_len=bound, workspace=ws,
                                     stream=torch.cuda.current_stream().cuda_stream)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                          # outside the capture first (loads the kernels)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.synchronize()
    for new in ([1, 700, 40, 0], [3000, 256, 1, 257], [513, 0, 40, 299]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for b, n in enumerate(new):
            k, v = dense[b]
            expect = sdpa(q[b:b + 1], k[:n], v[:n]) if n else torch.zeros_like(q[b:b + 1], dtype=torch.float32)
            torch.testing.assert_close(out[b:b + 1].float(), expect, atol=4e-3, rtol=4e-3,
                                       msg=lambda m: f"lens {new}, sequence {b}: {m}")


def test_kv_append_writes_slots_and_skips_minus_one(cuda_kernels):
    k_cache = torch.zeros(8, 16, 2, 64, device="cuda", dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 64, device="cuda", dtype=torch.float16)
    value = torch.randn_like(key)
    slots = torch.tensor([5 * 16 + 3, -1, 0], dtype=torch.int64, device="cuda")
    cuda_kernels.kv_append(key, value, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache[5, 3], key[0]) and torch.equal(v_cache[0, 0], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def test_rmsnorm_residual_and_rotary_match_torch(cuda_kernels):
    x = torch.randn(5, 576, device="cuda", dtype=torch.float16)
    residual = torch.randn_like(x)
    weight = torch.randn(576, device="cuda", dtype=torch.float16)
    expect_res = (residual.float() + x.float())
    expect = expect_res * torch.rsqrt(expect_res.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    out = torch.empty_like(x)
    cuda_kernels.rmsnorm_residual(out, residual, x, weight, 1e-5)
    torch.cuda.synchronize()
    torch.testing.assert_close(residual.float(), expect_res, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.float(), expect, atol=1e-2, rtol=1e-2)

    q = torch.randn(4, 8, 64, device="cuda", dtype=torch.float32)
    k = torch.randn(4, 2, 64, device="cuda", dtype=torch.float32)
    pos = torch.tensor([0, 5, 9, 1000], dtype=torch.int32, device="cuda")
    inv = 1.0 / 10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64)
    ang = torch.arange(2048, device="cuda").float()[:, None] * inv[None]
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()

    def rope(t):
        c, s = cos[pos.long()][:, None], sin[pos.long()][:, None]
        a, b = t[..., :32], t[..., 32:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    eq, ek = rope(q), rope(k)
    cuda_kernels.rotary(q, k, pos, cos, sin)
    torch.cuda.synchronize()
    torch.testing.assert_close(q, eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, ek, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs, max_seq_len, window", [
    (((0, 20), (33, 1), (100, 7)), 107, 0),                     # one pass: no split-K workspace
    (((0, 20), (33, 1), (600, 40), (100, 7)), 1000, 0),         # split-K, the grid sized for a bound past every sequence
    (((0, 20), (33, 1), (600, 40), (100, 7)), 1000, 300),       # ... and a sliding window
])
def test_packed_attention_matches_the_ort_paged_attention_reference(cuda_kernels, seqs, max_seq_len, window):
    """The TensorRT plugin's entry point vs the numpy model of com.microsoft.PagedAttention the CPU tests use."""
    import numpy as np

    from paged_reference import ort_paged_attention
    from runtime.backends.paged.kv import build_paged_batch

    heads, kv_heads, dim, bs, num_blocks = 8, 2, 64, 16, 64
    rng = np.random.default_rng(11)
    perm = rng.permutation(num_blocks).tolist()
    seqs = [([perm.pop() for _ in range(-(-(p + n) // bs))], p, n) for p, n in seqs]
    batch = build_paged_batch(seqs, bs, max_blocks=-(-max_seq_len // bs))
    tokens = int(batch.cu_seqlens_q[-1])
    qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * dim)).astype(np.float16)
    k_cache = rng.standard_normal((num_blocks, bs, kv_heads, dim)).astype(np.float16)   # "cached" history
    v_cache = rng.standard_normal((num_blocks, bs, kv_heads, dim)).astype(np.float16)
    ang = np.arange(1024)[:, None] / 10000 ** (np.arange(0, dim, 2) / dim)
    cos, sin = np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)
    slots = batch.slot_mapping.astype(np.int32)
    expect, k_expect, _ = ort_paged_attention(qkv, k_cache, v_cache, batch.cu_seqlens_q, batch.past_lens,
                                              batch.block_tables, cos, sin, slots, heads, kv_heads, dim ** -0.5,
                                              window)
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    kc, vc = dev(k_cache), dev(v_cache)
    out = torch.empty(tokens, heads * dim, dtype=torch.float16, device="cuda")
    ws = workspace(cuda_kernels.packed_workspace_size(tokens, len(seqs), heads, dim, max_seq_len))
    cuda_kernels.packed_paged_attention(out, dev(qkv), kc, vc, dev(batch.cu_seqlens_q), dev(batch.past_lens),
                                        dev(batch.block_tables), dev(slots), dev(cos), dev(sin), num_heads=heads,
                                        max_seq_len=max_seq_len, window=window, workspace=ws)
    torch.cuda.synchronize()
    np.testing.assert_allclose(out.cpu().float().numpy(), expect.astype(np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(kc.cpu().float().numpy(), k_expect.astype(np.float32), atol=2e-3, rtol=2e-3)
