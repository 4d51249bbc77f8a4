"""One engine, three backends: the same engine suite against the CPU backend (the bundled int8 pair, GroupQueryAttention
over KV slots), the paged backend (a `--target cuda` engine whose PagedAttention runs the float64 reference op
on the CPU provider) and the cuda backend (the same `--target cuda` engines on our PyTorch forward, `--device cpu`:
reference attention on CPU tensors, the code the GPU runs with plugins/cuda swapped in). Each test is written
once; only the engines differ."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest

from compile.build import build
from compile.config import CompileConfig
from paged_reference import use_reference_op
from runtime.backends import Backend, KVManager
from runtime.config import CacheConfig, CudaConfig, EngineConfig, OrtConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams
from runtime.spec_decode.proposer import Proposer
from runtime.spec_decode.speculator import SpecConfig

from test_engine import assert_no_leaks, assert_same_greedy, assert_same_greedy_across_attention_kernels, run_all

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)


def _paged_engine_dir(checkpoint, out: Path, reference_op: bool = True) -> Path:
    build(CompileConfig(checkpoint("llama"), out, "fp16", target="cuda"), log=lambda _: None)
    if not reference_op:
        return out
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    use_reference_op(model, 4, 2)
    onnx.save_model(model, str(out / "model.onnx"))
    return out


@pytest.fixture(scope="module", params=["cpu", "paged", "cuda-on-cpu"])
def backend(request, checkpoint, tmp_path_factory):
    """(make(speculation=None, spec=None, **scheduler) → Engine, prompts(n, seed) → token id lists,
    same(a, b, across_kernels) asserting two runs' outputs agree as far as the backend promises).

    CPU: batch-invariant — bit-identical however requests are batched or chunked; between one-row and multi-row
    attention (verification, recompute) the int8 per-row activation quantization turns the kernels' last-bit
    differences into up to ~0.01, so there the same tokens unless a proven near-tie (see test_batch_invariance).
    Paged (fp16 graph, reference op): fp16 GEMMs round by batch shape, so the same tokens and log-probabilities
    within 2e-3 in every case."""
    if request.param == "cpu":
        if not (ROOT / "models" / "target" / "config.json").is_file():
            pytest.skip("bundled models not present")
        out = tmp_path_factory.mktemp("cpu-backend")
        dirs = {}
        for role in ("target", "draft"):
            dirs[role] = out / role
            build(CompileConfig(ROOT / "models" / role, dirs[role], "int8"), log=lambda _: None)
        target, draft, vocab = dirs["target"], dirs["draft"], 8192
        extra = {}
        cache = CacheConfig(kv_budget_bytes=64 << 20, max_model_len=512)

        def same(a, b, across_kernels=False):
            if across_kernels:
                assert_same_greedy_across_attention_kernels(a, b, bound=0.5)
            else:
                assert_same_greedy(a, b)
    elif request.param == "cuda-on-cpu":
        target = _paged_engine_dir(checkpoint, tmp_path_factory.mktemp("cuda") / "target", reference_op=False)
        draft = _paged_engine_dir(checkpoint, tmp_path_factory.mktemp("cuda") / "draft", reference_op=False)
        vocab = 512
        extra = dict(cuda=CudaConfig(device="cpu"))
        cache = CacheConfig(kv_budget_bytes=1 << 20, block_size=4)

        def same(a, b, across_kernels=False):          # float32 on the CPU: batch shapes round differently
            assert_same_greedy_across_attention_kernels(a, b, bound=1e-4)
    else:
        pytest.importorskip("onnxruntime_extensions")
        from onnxruntime_extensions import get_library_path

        target = _paged_engine_dir(checkpoint, tmp_path_factory.mktemp("paged") / "target")
        draft = _paged_engine_dir(checkpoint, tmp_path_factory.mktemp("paged") / "draft")
        vocab = 512
        extra = dict(ort=OrtConfig(providers=("CPUExecutionProvider",), custom_ops_library=get_library_path()),
                     verify_artifact=False)
        cache = CacheConfig(kv_budget_bytes=1 << 20, block_size=4)

        def same(a, b, across_kernels=False):
            assert_same_greedy_across_attention_kernels(a, b, bound=2e-3)

    def make(speculation=None, spec=None, **sched):
        return Engine(target, EngineConfig(SchedulerConfig(**sched), cache, spec or SpecConfig(max_gamma=3, adaptive=False),
                                           draft=draft if speculation == "draft" else None, speculation=speculation,
                                           **extra))

    def prompts(n, seed=0):
        rng = np.random.default_rng(seed)
        return [rng.integers(3, vocab - 1, int(rng.integers(6, 40))).tolist() for _ in range(n)]

    return make, prompts, same


def test_backends_implement_the_declared_protocols(backend):
    make, _, _ = backend
    eng = make(speculation="draft", max_num_seqs=2)
    assert isinstance(eng.backend, Backend) and isinstance(eng.kv, KVManager)
    assert isinstance(eng.backend.proposer, Proposer)
    assert eng.scheduler.kv is eng.kv


def test_the_engine_loop_knows_no_backend():
    """runtime/engine.py reaches backends only through runtime.backends.load_backend and the protocols."""
    tree = ast.parse((ROOT / "runtime" / "engine.py").read_text())
    imported = {(n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "backends" in imported
    assert not any(m.startswith(("backends.cpu", "backends.paged", "backends.cuda")) for m in imported)
    assert not imported & {"backends.onnx_session", "kv.layout", "spec_decode.ngram"}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"paged", "slots", "pools", "PagedKVManager", "KVCacheManager"}


def test_requests_joining_a_running_batch_get_their_alone_output(backend):
    make, prompts, same = backend
    items = [(p, GREEDY) for p in prompts(5, seed=1)]
    alone = [run_all(make(max_num_seqs=1), [item])[0] for item in items]
    batched = run_all(make(max_num_seqs=4, token_budget=24, prefill_chunk=8), items, join_steps=[0, 0, 3, 5, 9])
    for a, b in zip(alone, batched):
        same(a, b)


@pytest.mark.parametrize("speculation", ["draft", "ngram"])
def test_speculation_reproduces_plain_greedy_inside_the_token_budget(backend, speculation):
    """Guesses are scheduled tokens: no step computes more than the token budget, guesses included."""
    make, prompts, same = backend
    items = [(p + p[:6], GREEDY) for p in prompts(4, seed=2)]      # a repeat gives prompt lookup something to find
    plain = run_all(make(max_num_seqs=4, token_budget=14, prefill_chunk=8), items)
    eng = make(speculation=speculation, max_num_seqs=4, token_budget=14, prefill_chunk=8)
    sizes, schedule = [], eng.scheduler.schedule

    def recording():
        plan = schedule()
        sizes.append((plan.num_tokens, sum(plan.gammas.values())))
        return plan

    eng.scheduler.schedule = recording
    fast = run_all(eng, items)
    for a, b in zip(plain, fast):
        same(a, b, across_kernels=True)
    assert max(n for n, _ in sizes) <= 14
    if speculation == "draft":
        assert eng.speculator.stats.proposed > 0 and any(g for _, g in sizes)
    assert_no_leaks(eng)


def test_a_prefix_hit_gives_the_output_of_a_miss(backend):
    make, prompts, same = backend
    base = prompts(1, seed=3)[0] * 2
    items = [(base + tail, GREEDY) for tail in ([7, 8, 9], [10, 11, 12, 13])]
    cold = [run_all(make(max_num_seqs=1), [item])[0] for item in items]
    eng = make(max_num_seqs=2)
    warm = [run_all(eng, [item])[0] for item in items]
    assert eng.kv.stats.hits >= 16
    for a, b in zip(cold, warm):
        same(a, b)
    assert_no_leaks(eng)


def test_priority_preemption_and_abort_free_everything(backend):
    make, prompts, same = backend
    low, high, gone = prompts(3, seed=4)
    eng = make(max_num_seqs=1)
    lo = eng.add_request(low, GREEDY, priority=5)
    for _ in range(3):
        eng.step()
    hi = eng.add_request(high, GREEDY, priority=-5)
    ab = eng.add_request(gone, GREEDY, priority=9)
    eng.step()
    assert lo.slot is None and hi.slot is not None           # the urgent one took the only sequence
    assert eng.abort(ab.request_id).finish_reason == "abort"
    while eng.has_work():
        eng.step()
    assert eng.stats.preemptions >= 1
    assert_no_leaks(eng)
