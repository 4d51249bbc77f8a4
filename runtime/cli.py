"""`runtime`: run Quicksilver engines."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quicksilver runtime")
def main() -> None:
    """Run Quicksilver engine artifacts built by `compile build`."""


@main.command()
@click.argument("args", nargs=-1, required=True, metavar="[ENGINE_DIR] PROMPT")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Makes sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--threads", type=click.IntRange(1), default=None, help="ONNX Runtime intra-op threads [default: min(2, cores)].")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Print TTFT, TPOT and cached tokens to stderr.")
def generate(args: tuple[str, ...], max_tokens: int, temperature: float, top_k: int, top_p: float, min_p: float,
             repetition_penalty: float, seed: int | None, stop: tuple[str, ...], threads: int | None, stats: bool) -> None:
    """Stream a completion of PROMPT from a local engine (default: the bundled target model)."""
    from compile.errors import QuicksilverError

    from .config import EngineConfig, SchedulerConfig
    from .defaults import engine_dir
    from .engine import Engine
    from .request import InvalidRequest, SamplingParams

    if len(args) > 2:
        fail("expected [ENGINE_DIR] PROMPT (quote the prompt)")
    try:
        engine_path = Path(args[0]) if len(args) == 2 else engine_dir("target")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=repetition_penalty, seed=seed, stop=stop)
        engine = Engine(engine_path, EngineConfig(SchedulerConfig(max_num_seqs=1), threads=threads))
        req = engine.add_request(args[-1], params)
    except (QuicksilverError, InvalidRequest, FileNotFoundError, ValueError) as e:
        fail(str(e))
    click.echo(args[-1], nl=False)
    while True:
        for out in engine.step():
            click.echo(out.text, nl=False)
            if out.finished:
                click.echo()
                u = out.usage
                if stats:
                    tpot = f"{u.tpot_s * 1e3:.2f} ms ({1 / u.tpot_s:.0f} tok/s)" if u.tpot_s else "n/a"
                    click.echo(f"[{u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), {u.completion_tokens} "
                               f"generated, finish: {out.finish_reason}; TTFT {u.ttft_s * 1e3:.1f} ms, TPOT {tpot}]",
                               err=True)
                return
        assert engine.has_work(), req
