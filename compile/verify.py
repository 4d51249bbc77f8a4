"""`compile verify`: an engine's logits against the float64 numpy reference on the same checkpoint.

The engine runs the prompt as one prefill step and then `decode_steps` single-token steps through its
KV cache (greedy on the engine's own logits), exactly as the runtime will; the reference sees the same
tokens (and, for an int8 KV cache, reads the same quantized K/V). Reported: max |Δlogit| over all compared
positions and whether the greedy tokens agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .hf_source import CheckpointReader, read_spec
from .quantize import kv_int8
from .reference import ReferenceModel


@dataclass
class VerifyResult:
    max_abs_diff: float
    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    greedy_match: bool
    tokens: int


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, size=length).tolist()


def verify(engine_dir: Path, model_dir: Path, prompt: list[int], decode_steps: int = 16) -> VerifyResult:
    from runtime.model_runner import ModelRunner

    runner = ModelRunner(engine_dir)
    spec = read_spec(model_dir)
    # An int8 KV cache is part of the engine's arithmetic: the reference reads the same quantized K/V.
    scales = (kv_int8.engine_scales(engine_dir / runner.manifest["graph"]["file"], spec.num_layers)
              if runner.kv_layout.dtype == "int8" else None)
    ref = ReferenceModel(spec, CheckpointReader(model_dir), kv_scales=scales)
    pool = runner.new_pool(1, capacity=len(prompt) + decode_steps + 1)
    n = len(prompt)
    got = runner.prefill(pool, 0, prompt, 0, all_logits=True)
    want = ref.forward(prompt)
    prefill = float(np.abs(got - want).max())
    decode, match = 0.0, bool((got.argmax(-1) == want.argmax(-1)).all())
    token = int(got[-1].argmax())
    for step in range(decode_steps):
        got = runner.decode(pool, [(0, token, n + step)], set())
        want = ref.forward([token])
        decode = max(decode, float(np.abs(got - want).max()))
        match &= int(got[0].argmax()) == int(want[0].argmax())
        token = int(got[0].argmax())
    return VerifyResult(max(prefill, decode), prefill, decode, match, n + decode_steps)
