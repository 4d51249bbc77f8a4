"""Cycles a key of decode attention, one thread: where qs.CausalAttention's time goes against its arithmetic floor.

Compiles a small driver around plugins/cpu/attention.cpp (g++, -march=native, as the op library is built) that
runs one KV group's decode rows (a batch-1 step's query heads of one KV head, fp16 cache) over N keys, either over
one cache that stays in L2 or over copies enough to stream from memory, and prints ns and cycles a key beside the
floor its products set: every key costs rows x head_dim multiply-adds for its score and as many for its value, and
one 512-bit FMA (or vdpbf16ps, two products a lane) retires a cycle on AMD Zen 4, so a key needs at least
2 x rows x head_dim / 16 cycles (/ 32 with bf16 products). The clock is measured here (a chain of dependent multiplies).
The driver also prints a hash of the outputs' bits, so two source trees can be checked for equal results.

    python tools/bench_attention_cycles.py --json tools/results/attention_cycles.json
    python tools/bench_attention_cycles.py --source /tmp/variant/plugins/cpu --shapes 7x64
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = r"""
#include "attention.cpp"
#include <chrono>
#include <cstdio>
#include <random>
#include <sys/mman.h>
template <class F> double median_seconds(int reps, F f) {
  std::vector<double> ts;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}
int main(int argc, char** argv) {
  if (argc == 1) {      // the clock: 4 dependent multiplies an iteration, three cycles each (Golden Cove folds
    long x = 1, y = 3, n = 100000000;      // chained immediate adds at rename, so an add chain reads 5x the clock)
    double s = median_seconds(3, [&] { for (long k = 0; k < n; ++k) asm volatile("imul %1,%0\n\timul %1,%0\n\timul %1,%0\n\timul %1,%0" : "+r"(x) : "r"(y)); });
    printf("%.4f\n", 12.0 * n / s / 1e9);
    return 0;
  }
  const int H = atoi(argv[1]), D = atoi(argv[2]), N = atoi(argv[3]), copies = atoi(argv[4]), reps = atoi(argv[5]);
  const bool bf = atoi(argv[6]), huge = argc > 7 && atoi(argv[7]);
  std::mt19937 g(1);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> qkv((H + 2) * D), cos_(static_cast<size_t>(N) * D / 2), sin_(cos_.size());
  for (auto& x : qkv) x = nd(g);
  for (int p = 0; p < N; ++p)
    for (int i = 0; i < D / 2; ++i) {
      double a = p * std::pow(10000.0, -2.0 * i / D);
      cos_[static_cast<size_t>(p) * D / 2 + i] = std::cos(a), sin_[static_cast<size_t>(p) * D / 2 + i] = std::sin(a);
    }
  // the copies in one arena, 2 MiB-aligned, on 4 KiB pages (as the runtime's KV slots) or on transparent huge pages
  const size_t per = static_cast<size_t>(N) * D, bytes = 2 * copies * per * sizeof(half_t) + (2 << 20);
  void* arena = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(arena, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  half_t* base = reinterpret_cast<half_t*>((reinterpret_cast<uintptr_t>(arena) + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
  std::vector<half_t*> ks(copies), vs(copies);
  for (int c = 0; c < copies; ++c) {
    ks[c] = base + 2 * c * per, vs[c] = ks[c] + per;
    for (size_t i = 0; i < per; ++i) ks[c][i] = to_half(nd(g) * 0.5f);
    for (size_t i = 0; i < per; ++i) vs[c][i] = to_half(nd(g));
  }
  int32_t seqlen = N - 1;
  Step<half_t> st{};
  st.qkv = qkv.data(), st.seqlens_k = &seqlen, st.cos = cos_.data(), st.sin = sin_.data();
  st.batch = 1, st.seq = 1, st.heads = H, st.kv_heads = 1, st.head_dim = D, st.capacity = N, st.max_pos = N;
  st.window = -1, st.tile = 1, st.heads_per_task = H, st.scale = 1.0f / std::sqrt(static_cast<float>(D)), st.bf16 = bf;
  Partials p;
  const int segs = segments_of(N);
  p.reset(H, segs, D);
  auto pass = [&] {
    for (int c = 0; c < copies; ++c) {
      st.keys = ks[c], st.values = vs[c];
      if (D == 64) attend_rows<64>(st, 0, 0, 1, 0, H, 0, segs, p);
      else attend_rows<128>(st, 0, 0, 1, 0, H, 0, segs, p);
    }
  };
  pass();
  const double s = median_seconds(reps, pass);
  std::vector<float> out(static_cast<size_t>(H) * D);
  for (int r = 0; r < H; ++r) {
    const size_t at = static_cast<size_t>(r) * segs;
    if (D == 64) combine<64>(&p.max[at], &p.sum[at], &p.acc[at * D], segs, &out[r * D]);
    else combine<128>(&p.max[at], &p.sum[at], &p.acc[at * D], segs, &out[r * D]);
  }
  uint64_t h = 1469598103934665603ull;
  for (float x : out) { uint32_t u; std::memcpy(&u, &x, 4); h = (h ^ u) * 1099511628211ull; }
  printf("%.6f %016llx\n", s / copies / N * 1e9, static_cast<unsigned long long>(h));
}
"""


def build(source: Path, out: Path) -> Path:
    driver = out / "driver.cpp"
    driver.write_text(DRIVER)
    binary = out / "attention_cycles"
    subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-DQS_CPU_OPS=1", f"-I{source}",
                    f"-I{ROOT / 'plugins/native'}", "-isystem", str(ROOT / "plugins/cpu/onnxruntime"), str(driver),
                    "-o", str(binary)], check=True)
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=ROOT / "plugins/cpu", help="the folder holding attention.cpp")
    ap.add_argument("--shapes", default="7x64,6x128,3x64",
                    help="ROWSxHEAD_DIM, comma-separated: query heads a KV head has, and the head size "
                         "[default: qwen2.5-0.5b's, qwen2.5-1.5b's, smollm2's]")
    ap.add_argument("--keys", type=int, default=8192, help="keys (context tokens) a pass attends to")
    ap.add_argument("--stream-mib", type=int, default=256, help="cache copies cycled through when streaming")
    ap.add_argument("--huge-pages", action="store_true",
                    help="the cache on transparent huge pages (runtime serve --kv-huge-pages); default 4 KiB pages")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    if any(dim not in (64, 128) for _, dim in shapes):
        ap.error("head sizes: the op is compiled for 64 and 128")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(args.source, Path(tmp))
        ghz = float(subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout)
        print(f"{platform.processor() or platform.machine()}, clock {ghz:.2f} GHz (dependent multiplies), one thread, "
              f"the cache on {'huge' if args.huge_pages else '4 KiB'} pages")
        print(f"{'rows x D':>9} {'products':>8} {'where':>8} {'ns/key':>7} {'cyc/key':>8} {'floor':>6} {'GB/s':>6}  bits")
        for rows, dim in shapes:
            key_bytes = 2 * dim * 2                       # its fp16 key and value
            in_l2 = max(1, min(args.keys, (512 << 10) // key_bytes))
            for bf16 in (False, True):
                for where, keys, copies, reps in (("L2", in_l2, 1, 2000),
                                                  ("memory", args.keys, max(2, (args.stream_mib << 20) // (args.keys * key_bytes)), 6)):
                    run = subprocess.run([str(binary), str(rows), str(dim), str(keys), str(copies), str(reps),
                                          str(int(bf16)), str(int(args.huge_pages))], capture_output=True, text=True,
                                         check=True).stdout.split()
                    ns, bits = float(run[0]), run[1]
                    floor = 2 * rows * dim / (32 if bf16 else 16)
                    row = {"rows": rows, "head_dim": dim, "bf16_products": bf16, "where": where, "keys": keys,
                           "ns_per_key": ns, "cycles_per_key": ns * ghz, "floor_cycles": floor,
                           "gb_per_s": key_bytes / ns, "bits": bits}
                    results.append(row)
                    print(f"{rows:>4} x {dim:<3} {'bf16' if bf16 else 'fp32':>8} {where:>8} {ns:7.2f} "
                          f"{ns * ghz:8.1f} {floor:6.0f} {key_bytes / ns:6.2f}  {bits}")
    if args.json:
        args.json.write_text(json.dumps({"clock_ghz": ghz, "source": str(args.source), "huge_pages": args.huge_pages,
                                         "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
