"""Engine logits vs transformers + PyTorch (the slow truth) on random tiny Llama, Qwen2 and Mistral checkpoints.

fp32: max |Δlogit| ≤ 1e-3 over a 64-token prompt and 16 single-token steps through the KV cache, and the
greedy continuation is identical. fp16 weights (computed in fp32): max |Δlogit| ≤ 5e-3 on these models,
greedy continuation identical.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from compile.reference import ReferenceModel  # noqa: E402
from compile.hf_source import CheckpointReader, read_spec  # noqa: E402
from runtime.backends.cpu.slots import SlotRange  # noqa: E402
from runtime.backends.cpu.runner import ModelRunner  # noqa: E402

PROMPT_LEN, STEPS = 64, 16
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-3}
CASES = [
    ("llama", "fp32"), ("llama-llama3-rope", "fp32"), ("llama-linear-rope-bf16", "fp32"),
    ("qwen2", "fp32"), ("qwen2-bf16-sharded", "fp32"), ("mistral", "fp32"),
    ("llama", "fp16"), ("qwen2", "fp16"), ("mistral-fp16", "fp16"),
]


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def engine_greedy(runner, prompt, steps):
    """Prefill + `steps` decode steps; returns (logits [PROMPT_LEN + steps, vocab] of fed tokens, new tokens)."""
    n = len(prompt)
    pool, slot = runner.new_pool(1, capacity=n + steps + 1), SlotRange(0, 1)
    logits = [runner.execute(np.asarray([prompt], np.int64), np.array([n - 1], np.int32), np.arange(n), pool, slot).copy()]
    tokens = [int(logits[0][-1].argmax())]
    for i in range(steps):
        out = runner.execute(np.array([[tokens[-1]]], np.int64), np.array([n + i], np.int32), np.arange(1), pool, slot)
        logits.append(out.copy())
        tokens.append(int(out[0].argmax()))
    return np.concatenate(logits), tokens


@pytest.mark.parametrize("name,precision", CASES)
def test_engine_matches_transformers(name, precision, checkpoint, engine):
    path = checkpoint(name)
    runner = ModelRunner(engine(name, precision))
    prompt = np.random.default_rng(7).integers(0, runner.vocab_size, PROMPT_LEN).tolist()
    got, tokens = engine_greedy(runner, prompt, STEPS)

    model = hf_model(path)
    with torch.no_grad():
        want = model(torch.tensor([prompt + tokens[:-1]])).logits[0].numpy()
        hf_tokens = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS + 1, do_sample=False,
                                   pad_token_id=0)[0, PROMPT_LEN:].tolist()
    diff = np.abs(got - want).max()
    assert diff <= TOLERANCE[precision], f"max |Δlogit| {diff:.3g}"
    assert tokens == hf_tokens


@pytest.mark.parametrize("name", ["llama-llama3-rope", "qwen2", "mistral"])
def test_numpy_reference_matches_transformers(name, checkpoint):
    """`compile verify`'s float64 reference is itself checked against transformers."""
    path = checkpoint(name)
    ref = ReferenceModel(read_spec(path), CheckpointReader(path))
    prompt = np.random.default_rng(8).integers(0, 500, 80).tolist()
    got = np.concatenate([ref.forward(prompt[:70]), ref.forward(prompt[70:75]), ref.forward(prompt[75:])])
    with torch.no_grad():
        want = hf_model(path)(torch.tensor([prompt])).logits[0].double().numpy()
    assert np.abs(got - want).max() < 1e-4


def test_sliding_window_is_exercised(checkpoint):
    spec = read_spec(checkpoint("mistral"))
    assert spec.sliding_window is not None and spec.sliding_window < PROMPT_LEN + STEPS
