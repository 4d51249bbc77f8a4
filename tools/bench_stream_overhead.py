"""Per-token cost of serving: the same greedy generations in-process (Engine) and streamed over gRPC from a
real server on 127.0.0.1; reports the median extra milliseconds per token that transport adds.

    python tools/bench_stream_overhead.py engines/target --tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import numpy as np

from runtime.client import Client
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams
from runtime.server.app import Server

PROMPT = "def read_config(path):\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    econf = EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(enable_prefix_cache=False, kv_budget_bytes=1 << 30))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

    engine = Engine(args.engine, econf)
    local = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.generate([PROMPT], params)
        local.append(time.perf_counter() - t0)
    del engine

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result()  # noqa: E731

    async def make():
        return Server(args.engine, econf, ServerConfig(grpc_port=0, http_port=-1))

    server = run(make())
    run(server.start())
    remote = []
    with Client(f"127.0.0.1:{server.grpc_port}") as client:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = sum(len(m.token_ids) for m in client.generate(PROMPT, max_tokens=args.tokens, ignore_eos=True))
            remote.append(time.perf_counter() - t0)
            assert n == args.tokens
    run(server.stop())
    loc, rem = float(np.median(local)), float(np.median(remote))
    result = {"engine": str(args.engine), "tokens": args.tokens, "in_process_ms_per_token": round(1e3 * loc / args.tokens, 3),
              "grpc_ms_per_token": round(1e3 * rem / args.tokens, 3),
              "overhead_ms_per_token": round(1e3 * (rem - loc) / args.tokens, 3)}
    print(f"{args.tokens} tokens: in-process {result['in_process_ms_per_token']} ms/token, gRPC stream "
          f"{result['grpc_ms_per_token']} ms/token, overhead {result['overhead_ms_per_token']} ms/token")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
