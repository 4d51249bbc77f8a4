"""Decode paged attention on a GPU: effective bandwidth of our kernel vs PyTorch SDPA on contiguous KV.

Bytes moved per call = K and V of every sequence's context (the floor any decode attention must read);
GB/s = bytes / median time (CUDA events, after warm-up). SDPA runs on the same K/V laid out contiguously
[batch, heads, ctx, head_dim] (GQA via enable_gqa), i.e. without paging overhead.

    python tools/bench_paged_attention.py --lib build/libqs_cuda.so --out paged_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime.cuda_kernels import CudaKernels  # noqa: E402


def time_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def case(k: CudaKernels, batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
         dtype, kv_fp8: bool, iters: int) -> dict:
    blocks_per = -(-ctx // block_size)
    num_blocks = batch * blocks_per
    kv_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype).to(kv_dtype)
    v_cache = torch.randn_like(k_cache, dtype=dtype).to(kv_dtype)
    tables = torch.randperm(num_blocks, device="cuda").int().reshape(batch, blocks_per)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    ws = torch.empty(max(1, k.workspace_size(batch, heads, head_dim, ctx)), dtype=torch.uint8, device="cuda")
    scales = dict(k_scale=torch.ones(1, device="cuda"), v_scale=torch.ones(1, device="cuda")) if kv_fp8 else {}
    ours = time_ms(lambda: k.paged_attention(out, q, k_cache, v_cache, tables, lens, max_seq_len=ctx, workspace=ws,
                                             stream=torch.cuda.current_stream().cuda_stream, **scales), iters)
    nbytes = 2 * batch * ctx * kv_heads * head_dim * k_cache.element_size()
    row = dict(batch=batch, ctx=ctx, heads=heads, kv_heads=kv_heads, head_dim=head_dim, kv="fp8" if kv_fp8 else str(dtype)[6:],
               ours_ms=round(ours, 4), ours_gbs=round(nbytes / ours / 1e6, 1))
    if not kv_fp8:
        kc = torch.randn(batch, kv_heads, ctx, head_dim, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        qs = q[:, :, None, :]
        sdpa = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True), iters)
        row.update(sdpa_ms=round(sdpa, 4), sdpa_gbs=round(nbytes / sdpa / 1e6, 1), speedup=round(sdpa / ours, 2))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", type=Path, default=None, help="libqs_cuda.so (default: installed next to runtime/)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--peak-gbs", type=float, default=3350.0, help="HBM peak for the %% column (H100 SXM: 3350)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    k = CudaKernels(args.lib)
    rows = []
    print(f"{torch.cuda.get_device_name()}  heads {args.heads}/{args.kv_heads}  head_dim {args.head_dim}  block {args.block_size}")
    print(f"{'batch':>5} {'ctx':>6} {'kv':>5} {'ours ms':>8} {'GB/s':>7} {'%peak':>6} {'sdpa ms':>8} {'GB/s':>7} {'speedup':>7}")
    for kv_fp8 in (False, True):
        for batch in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                r = case(k, batch, ctx, args.heads, args.kv_heads, args.head_dim, args.block_size, torch.float16, kv_fp8, args.iters)
                r["pct_peak"] = round(100 * r["ours_gbs"] / args.peak_gbs, 1)
                rows.append(r)
                print(f"{batch:>5} {ctx:>6} {r['kv']:>5} {r['ours_ms']:>8.3f} {r['ours_gbs']:>7.0f} {r['pct_peak']:>6.1f} "
                      f"{r.get('sdpa_ms', float('nan')):>8.3f} {r.get('sdpa_gbs', float('nan')):>7.0f} {r.get('speedup', float('nan')):>7.2f}")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
