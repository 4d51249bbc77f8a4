"""`runtime`: run Quicksilver engines."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import numpy as np

from . import __version__


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quicksilver runtime")
def main() -> None:
    """Run Quicksilver engine artifacts built by `compile build`."""


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True, help="Tokens to generate.")
@click.option("--threads", type=click.IntRange(1), default=None, help="ONNX Runtime intra-op threads [default: min(2, cores)].")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Print TTFT and decode speed to stderr.")
def generate(engine_dir: Path, prompt: str, max_tokens: int, threads: int | None, stats: bool) -> None:
    """Stream a greedy completion of PROMPT from a local engine."""
    from compile.errors import QuicksilverError
    from tokenizers import Tokenizer

    from .detokenizer import IncrementalDetokenizer
    from .kv.slots import SlotRange
    from .model_runner import ModelRunner

    try:
        t_load = time.perf_counter()
        runner = ModelRunner(engine_dir, threads=threads)
        load_s = time.perf_counter() - t_load
    except QuicksilverError as e:
        fail(str(e))
    tok = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    if not ids:
        fail("the prompt is empty after tokenization")
    if len(ids) + max_tokens > runner.max_seq_len:
        fail(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the engine's context "
             f"of {runner.max_seq_len} tokens")
    eos = set(runner.manifest["tokenizer"]["eos_token_ids"])
    pool, slot = runner.new_pool(1, capacity=len(ids) + max_tokens), SlotRange(0, 1)
    detok = IncrementalDetokenizer(tok, ids)
    click.echo(prompt, nl=False)
    t0 = time.perf_counter()
    logits = runner.execute(np.asarray([ids], np.int64), np.array([len(ids) - 1], np.int32),
                            np.array([len(ids) - 1]), pool, slot)
    token, n = int(logits[0].argmax()), 0
    ttft = time.perf_counter() - t0
    while True:
        n += 1
        if token in eos:
            break
        click.echo(detok.push(token), nl=False)
        if n >= max_tokens:
            break
        logits = runner.execute(np.array([[token]], np.int64), np.array([len(ids) + n - 1], np.int32),
                                np.zeros(1, np.int64), pool, slot)
        token = int(logits[0].argmax())
    click.echo(detok.flush())
    total = time.perf_counter() - t0
    if stats:
        tpot = (total - ttft) / max(1, n - 1)
        click.echo(f"[{len(ids)} prompt tokens, {n} generated; load {load_s * 1e3:.0f} ms, TTFT {ttft * 1e3:.1f} ms, "
                   f"TPOT {tpot * 1e3:.2f} ms ({1 / tpot if tpot else 0:.1f} tok/s)]", err=True)
