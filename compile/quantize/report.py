"""Accuracy report: what an engine's precision costs, measured on an evaluation text.

Both the engine and the fp32 build of the same checkpoint score the same tokens (non-overlapping
windows, every position predicted): perplexity of each, its relative increase, and top-1 next-token
agreement between the two.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

DEFAULT_EVAL = Path(__file__).resolve().parents[1] / "data" / "heldout_code.txt"
WINDOW, MAX_TOKENS = 256, 1024


def eval_tokens(engine_dir: Path, text_file: Path | None, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    path = Path(text_file or DEFAULT_EVAL)
    tok = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    return tok.encode(path.read_text(encoding="utf-8", errors="replace")).ids[:max_tokens], path.name


def score(engine_dir: Path, ids: list[int], window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """(negative log-likelihood [n], argmax prediction [n]) for every predicted token of `ids`."""
    from ..verify import open_stepper

    steps = open_stepper(engine_dir, window, verify=False)
    window = min(window, steps.max_seq_len)
    nll, top = [], []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        x, y = chunk[:-1], np.asarray(chunk[1:])
        logits = steps.prefill(x).astype(np.float64)
        m = logits.max(-1, keepdims=True)
        logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        nll.append(logz - logits[np.arange(len(y)), y])
        top.append(logits.argmax(-1))
    return np.concatenate(nll), np.concatenate(top)


def measure(engine_dir: Path, baseline_dir: Path | None, text_file: Path | None) -> dict:
    """The manifest's `accuracy` section; baseline None means the engine is its own fp32 baseline."""
    ids, name = eval_tokens(engine_dir, text_file)
    if len(ids) < 2:
        raise ValueError(f"evaluation text {name} is too short (needs at least 2 tokens)")
    nll, top = score(engine_dir, ids)
    base_nll, base_top = (nll, top) if baseline_dir is None else score(baseline_dir, ids)
    ppl, base_ppl = math.exp(nll.mean()), math.exp(base_nll.mean())
    return {
        "eval_text": name, "tokens": int(len(nll)), "window": WINDOW,
        "perplexity": round(ppl, 4), "baseline": "fp32 build of the same checkpoint",
        "baseline_perplexity": round(base_ppl, 4),
        "perplexity_increase_pct": round(100 * (ppl / base_ppl - 1), 3),
        "top1_agreement": round(float((top == base_top).mean()), 4),
    }


def describe(acc: dict) -> str:
    return (f"accuracy on {acc['tokens']} tokens of {acc['eval_text']}: perplexity {acc['perplexity']:.3f} vs "
            f"fp32 {acc['baseline_perplexity']:.3f} ({acc['perplexity_increase_pct']:+.2f} %), "
            f"top-1 agreement {100 * acc['top1_agreement']:.1f} %")
