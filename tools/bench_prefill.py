"""A prompt's prefill on AMX tiles against the vector kernels, interleaved in one process, beside the tiles' peak.

    python tools/bench_prefill.py /tmp/q15-int4-fold --tokens 445 --rounds 5 --json tools/results/prefill_tiles.json

Each round prefills the same `--tokens`-token prompt from empty once per tile mode (off: the vector kernels; amx:
the int8/int4 products on tiles, where the CPU has them and Linux grants their state), alternating the order, and
checks that both give the same logits bit for bit. Prints per mode the median time with its spread, tokens/s, and
the linear layers' int8 multiply-accumulates per second per core against the tiles' peak (1024 a cycle a core:
TDPBUSD's 16 × 16 × 64 in 16 cycles) at the clock given (`--ghz`, default the kernel's current reading). The time
is the whole prefill's (attention, norms and the rest included), so the fraction is a floor on the products' own.
Where tiles are not granted it says why and measures the vector kernels alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime import _native, cpu_ops  # noqa: E402
from runtime.backends.cpu.runner import ModelRunner  # noqa: E402

TILE_MACS_PER_CYCLE = 1024


def linear_macs_per_token(model: dict) -> int:
    """Multiply-accumulates of a token's linear layers (attention projections and the MLP; not the LM head, which a
    prefill runs for its last token only)."""
    h, i, layers = model["hidden_size"], model["intermediate_size"], model["num_layers"]
    q = model["num_heads"] * model["head_dim"]
    kv = model["num_kv_heads"] * model["head_dim"]
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * i)


def current_ghz() -> float:
    mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("cpu MHz")]
    return max(mhz) / 1000 if mhz else 2.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--tokens", type=int, default=445, help="prompt tokens prefilled from empty")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ghz", type=float, default=None, help="core clock for the peak (default: /proc/cpuinfo)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not cpu_ops.available():
        sys.exit("this install was built without the qs ops: nothing runs on tiles")

    status = _native.amx_status()
    modes = ["off"] + (["amx"] if status == "granted" else [])
    print(f"AMX tiles: {status}" + ("" if status == "granted" else " — measuring the vector kernels alone"))
    runner = ModelRunner(args.engine, threads=args.threads)
    model = runner.manifest["model"]
    pool = runner.new_pool(1, capacity=args.tokens + 16)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, model["vocab_size"], args.tokens)]
    ghz = args.ghz or current_ghz()
    macs = linear_macs_per_token(model) * args.tokens

    before = _native.cpu_tiles()
    times: dict[str, list[float]] = {m: [] for m in modes}
    logits: dict[str, np.ndarray] = {}
    tile_products = _native.cpu_tile_products()
    try:
        for rnd in range(args.rounds + 1):                  # round 0 warms both up and is not counted
            for mode in modes if rnd % 2 else modes[::-1]:
                _native.cpu_tiles(mode)
                t = time.perf_counter()
                out = runner.prefill(pool, 0, ids, 0)
                if rnd:
                    times[mode].append(time.perf_counter() - t)
                logits.setdefault(mode, out)
    finally:
        _native.cpu_tiles(before)
    bitwise = all(np.array_equal(logits[m].view(np.uint32), logits["off"].view(np.uint32)) for m in modes)
    tile_products = _native.cpu_tile_products() - tile_products

    result = {"engine": str(args.engine), "tokens": args.tokens, "threads": args.threads, "ghz": ghz,
              "amx": status, "linear_macs": macs, "bitwise_equal": bitwise, "tile_products": tile_products, "modes": {}}
    print(f"{args.engine.name}: {args.tokens}-token prefill, {args.threads} threads, {macs / 1e9:.2f} G linear MACs, "
          f"clock {ghz:.2f} GHz")
    for mode in modes:
        t = np.array(times[mode])
        med = float(np.median(t))
        per_core_cycle = macs / med / args.threads / (ghz * 1e9)
        result["modes"][mode] = {"median_ms": med * 1e3, "min_ms": float(t.min()) * 1e3, "max_ms": float(t.max()) * 1e3,
                                 "tokens_per_s": args.tokens / med, "macs_per_cycle_per_core": per_core_cycle,
                                 "fraction_of_tile_peak": per_core_cycle / TILE_MACS_PER_CYCLE}
        print(f"  {mode:>4}: {med * 1e3:8.1f} ms [{t.min() * 1e3:.1f}–{t.max() * 1e3:.1f}]  {args.tokens / med:8.0f} tok/s"
              f"  {per_core_cycle:6.1f} MACs/cycle/core = {per_core_cycle / TILE_MACS_PER_CYCLE:.1%} of the tiles' peak")
    if "amx" in modes:
        ratio = np.array(times["amx"]) / np.array(times["off"])
        result["amx_over_off"] = {"median": float(np.median(ratio)), "min": float(ratio.min()), "max": float(ratio.max())}
        print(f"  amx / off: {np.median(ratio):.3f}× [{ratio.min():.3f}–{ratio.max():.3f}] (time); "
              f"{tile_products} products on tiles")
    print(f"  logits bitwise equal across modes: {bitwise}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not bitwise:
        sys.exit("the tile path changed the logits")


if __name__ == "__main__":
    main()
