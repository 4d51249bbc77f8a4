"""`compile build --target cuda` on the CPU: the fp16 paged graph, run end to end through PagedModelRunner
with ORT's PagedAttention replaced by the float64 reference (onnxruntime-extensions Python op).

What this proves without a GPU: the graph's packing, rotary, slot writes, block tables, prefix sharing
and logits selection agree with the reference model; only the PagedAttention kernel itself is swapped.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from compile.build import build
from compile.config import CompileConfig
from artifact.errors import ArtifactError
from compile.hf_source import CheckpointReader, read_spec
from compile.reference import ReferenceModel
from runtime.backends.paged.kv import PagedKVManager
from runtime.backends.cpu.runner import ModelRunner
from runtime.backends.paged.runner import BackendUnavailable, PagedModelRunner
from runtime.request import Request, SamplingParams

from paged_reference import use_reference_op

pytest.importorskip("onnxruntime_extensions")
from onnxruntime_extensions import get_library_path  # noqa: E402


@pytest.fixture(scope="module")
def cuda_engine(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda") / "llama-cuda-fp16"
    build(CompileConfig(checkpoint("llama"), out, "fp16", target="cuda"), log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def cpu_runnable(cuda_engine, tmp_path_factory):
    """A copy of the engine whose PagedAttention nodes run the reference op."""
    copy = tmp_path_factory.mktemp("cuda-ref") / "engine"
    shutil.copytree(cuda_engine, copy)
    model = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    m = json.loads((copy / "manifest.json").read_text())["model"]
    assert use_reference_op(model, m["num_heads"], m["num_kv_heads"]) == m["num_layers"]
    onnx.save_model(model, str(copy / "model.onnx"))
    return copy


def test_cuda_graph_is_fp16_paged_attention_with_float_logits(cuda_engine):
    manifest = json.loads((cuda_engine / "manifest.json").read_text())
    assert manifest["target"] == "cuda" and manifest["precision"]["compute"] == "fp16"
    assert manifest["kv_cache"]["dtype"] == "float16" and "accuracy" not in manifest
    model = onnx.load(str(cuda_engine / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("PagedAttention") == 2 and "GroupQueryAttention" not in ops
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert inputs["key_cache.0"] == onnx.TensorProto.FLOAT16 and inputs["slot_mapping"] == onnx.TensorProto.INT32
    assert {o.name: o.type.tensor_type.elem_type for o in model.graph.output}["logits"] == onnx.TensorProto.FLOAT
    node = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["do_rotary"] == 1 and attrs["num_heads"] == 4 and attrs["kv_num_heads"] == 2
    assert list(node.input)[3:] == ["key_cache.0", "value_cache.0", "cumulative_sequence_length", "past_seqlens",
                                    "block_table", "cos_cache", "sin_cache", "slot_mapping", "", "", "", "", "",
                                    "attention_metadata"]
    assert inputs["attention_metadata"] == onnx.TensorProto.INT32


def test_backend_selection_says_what_is_missing(cuda_engine):
    import onnxruntime as ort
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    with pytest.raises(BackendUnavailable, match="install onnxruntime-gpu"):
        PagedModelRunner(cuda_engine, num_blocks=8)
    with pytest.raises(BackendUnavailable, match="--target cpu"):
        ModelRunner(cuda_engine)


@pytest.mark.parametrize("precision, message", [("int8", "supports --precision fp16, int4, fp8"),
                                                ("fp32", "supports --precision fp16, int4, fp8")])
def test_cuda_target_refuses_cpu_only_precisions(checkpoint, tmp_path, precision, message):
    with pytest.raises(ValueError, match=message):
        CompileConfig(checkpoint("llama"), tmp_path / "x", precision, target="cuda")


def test_paged_engine_matches_reference_across_chunks_decode_and_shared_prefix(cpu_runnable, checkpoint):
    runner = PagedModelRunner(cpu_runnable, num_blocks=16, block_size=4, providers=["CPUExecutionProvider"],
                              custom_ops_library=get_library_path(), verify=False)
    ckpt = checkpoint("llama")
    reference = lambda ids: ReferenceModel(read_spec(ckpt), CheckpointReader(ckpt)).forward(ids)  # noqa: E731
    mgr = PagedKVManager(runner.num_blocks, runner.block_size)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 512, 11).tolist()

    def run(reqs, counts):
        """One step over reqs computing counts[i] tokens each; logits at every new token."""
        for r, n in zip(reqs, counts):
            assert mgr.reserve(r, r.num_computed + n)
        batch = mgr.step_batch(reqs, counts)
        ids = np.concatenate([np.asarray(r.all_ids[r.num_computed:r.num_computed + n]) for r, n in zip(reqs, counts)])
        logits = runner.step(ids, batch, np.arange(len(ids))).copy()   # the runner reuses its buffer
        for r, n in zip(reqs, counts):
            r.num_computed += n
            mgr.cache_computed(r)
        return logits

    def close(ours, ref):
        scale = np.abs(ref).max()
        assert np.abs(ours - ref).max() <= 0.02 * scale, np.abs(ours - ref).max() / scale
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9

    a = Request(list(prompt), SamplingParams(max_tokens=8), request_id="a")
    mgr.allocate(a)
    logits = np.concatenate([run([a], [6]), run([a], [5])])      # chunked prefill
    close(logits, reference(prompt))
    for _ in range(3):                                             # greedy decode
        a.output_ids.append(int(logits[-1].argmax()))
        logits = run([a], [1])
        close(logits, reference(a.all_ids)[-1:])

    # b shares a's first two blocks (8 tokens): they are referenced, not recomputed, in a mixed step with a.
    b = Request(prompt[:8] + rng.integers(0, 512, 4).tolist(), SamplingParams(max_tokens=8), request_id="b")
    b.num_computed = mgr.allocate(b)
    assert b.num_computed == 8 and mgr.table(b)[:2] == mgr.table(a)[:2]
    a.output_ids.append(int(logits[-1].argmax()))
    mixed = run([a, b], [1, 4])
    close(mixed[:1], reference(a.all_ids)[-1:])
    close(mixed[1:], reference(b.all_ids)[8:])
    for r in (a, b):
        mgr.free(r)
    assert mgr.num_free_blocks == runner.num_blocks


def test_paged_runner_refuses_cpu_engines(engine):
    with pytest.raises(ArtifactError, match="runs --target cuda engines"):
        PagedModelRunner(engine("llama"), num_blocks=4)


def _engine(path, speculation=None, spec=None, draft=None, **sched):
    """An Engine on a reference-op engine copy, run on the CPU provider."""
    from runtime.config import CacheConfig, EngineConfig, OrtConfig, SchedulerConfig
    from runtime.engine import Engine
    from runtime.spec_decode.speculator import SpecConfig

    return Engine(path, EngineConfig(SchedulerConfig(**sched), CacheConfig(kv_budget_bytes=1 << 20, block_size=4),
                                     spec=spec or SpecConfig(), speculation=speculation, draft=draft,
                                     ort=OrtConfig(providers=("CPUExecutionProvider",),
                                                   custom_ops_library=get_library_path()), verify_artifact=False))


def _run(engine, prompts, params, join_steps):
    """Submit prompt k after join_steps[k] steps; return each request's tokens and logprobs."""
    out = {i: ([], []) for i in range(len(prompts))}
    ids, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_work():
        for i, p in [e for e in pending if join_steps[e[0]] <= step]:
            pending.remove((i, p))
            ids[engine.add_request(p, params).request_id] = i
        for o in engine.step():
            out[ids[o.request_id]][0].extend(o.token_ids)
            out[ids[o.request_id]][1].extend(o.logprobs or [])
        step += 1
    return [out[i] for i in range(len(prompts))]


def test_engine_serves_a_cuda_engine_batched_chunked_and_prefix_cached_like_alone(cpu_runnable, checkpoint):
    """The continuous-batching engine on a --target cuda engine: mixed packed steps (decodes + prefill chunks),
    a prompt that hits another's cached blocks, equal to each prompt served alone and to the reference model."""
    from runtime.request import SamplingParams

    rng = np.random.default_rng(3)
    base = rng.integers(3, 500, 30).tolist()
    prompts = [base, base[:24] + rng.integers(3, 500, 6).tolist(), rng.integers(3, 500, 10).tolist()]
    params = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)
    eng = _engine(cpu_runnable, max_num_seqs=4, token_budget=64, prefill_chunk=16)
    together = _run(eng, prompts, params, join_steps=[0, 3, 1])
    assert eng.kv.stats.hits >= 24 - 4                 # the second prompt reused the first's full blocks
    assert not eng.has_work() and eng.kv.num_free_slots == eng.kv.num_slots and all(r == 0 for r in eng.kv.blocks.ref)

    ckpt = checkpoint("llama")
    for prompt, (tokens, logprobs) in zip(prompts, together):
        alone = _run(_engine(cpu_runnable, max_num_seqs=1), [prompt], params, [0])[0][0]
        assert tokens == alone
        ref = ReferenceModel(read_spec(ckpt), CheckpointReader(ckpt))
        logits, ids = ref.forward(prompt), list(prompt)
        for i, token in enumerate(tokens):                 # greedy vs float64, up to an fp16-sized near-tie
            best = int(logits[-1].argmax())
            if best != token:
                top = logprobs[i]["top"]
                assert abs(top[0][1] - top[1][1]) < 0.05, f"token {i} differs from the reference without a near-tie"
                break
            ids.append(token)
            logits = ref.forward([token])


def test_prompt_lookup_speculation_verifies_in_the_packed_step_and_changes_nothing(cpu_runnable):
    """Speculation on a cuda engine: guesses of several sequences are verified inside the one packed step
    (what the CPU path cannot batch); greedy output must equal plain greedy output token for token."""
    from runtime.request import SamplingParams
    from runtime.spec_decode.speculator import SpecConfig

    rng = np.random.default_rng(5)
    motif = rng.integers(3, 500, 7).tolist()
    prompts = [motif * 4, rng.integers(3, 500, 9).tolist() + motif * 3, motif * 2 + motif[:3]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = _run(_engine(cpu_runnable, max_num_seqs=4, token_budget=64, prefill_chunk=16), prompts, params, [0, 0, 1])
    for spec in (SpecConfig(max_gamma=4, adaptive=False), SpecConfig(max_gamma=4)):
        eng = _engine(cpu_runnable, speculation="ngram", spec=spec, max_num_seqs=4, token_budget=64, prefill_chunk=16)
        fast = _run(eng, prompts, params, [0, 0, 1])
        assert [t for t, _ in fast] == [t for t, _ in plain]
        assert all(r == 0 for r in eng.kv.blocks.ref) and eng.kv.num_free_slots == eng.kv.num_slots
        if not spec.adaptive:
            assert eng.speculator.stats.accepted > 0 and eng.speculator.stats.rounds > 0


def test_draft_model_speculation_on_cuda_engines_matches_plain_greedy(cpu_runnable, checkpoint, tmp_path_factory):
    """A cuda draft keeps its KV under the target's block tables: guesses are packed steps over all speculating
    sequences, verification rides in the target's packed step, a prefix hit serves both models' KV."""
    from runtime.request import SamplingParams
    from runtime.spec_decode.speculator import SpecConfig

    draft_dir = tmp_path_factory.mktemp("draft") / "engine"
    build(CompileConfig(checkpoint("llama"), draft_dir, "fp16", target="cuda"), log=lambda _: None)
    model = onnx.load(str(draft_dir / "model.onnx"), load_external_data=False)
    use_reference_op(model, 4, 2)
    onnx.save_model(model, str(draft_dir / "model.onnx"))

    rng = np.random.default_rng(9)
    base = rng.integers(3, 500, 22).tolist()
    prompts = [base, base[:16] + rng.integers(3, 500, 5).tolist(), rng.integers(3, 500, 7).tolist()]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = _run(_engine(cpu_runnable, max_num_seqs=4, token_budget=64, prefill_chunk=16), prompts, params, [0, 4, 1])
    eng = _engine(cpu_runnable, speculation="draft", spec=SpecConfig(max_gamma=3, adaptive=False), draft=draft_dir,
                  max_num_seqs=4, token_budget=64, prefill_chunk=16)
    fast = _run(eng, prompts, params, [0, 4, 1])
    assert [t for t, _ in fast] == [t for t, _ in plain]
    s = eng.speculator.stats
    assert s.rounds > 0 and s.accepted / s.proposed > 0.9       # the draft is the target itself: guesses hold
    assert eng.kv.stats.hits >= 12
    assert all(r == 0 for r in eng.kv.blocks.ref) and eng.kv.num_free_slots == eng.kv.num_slots


def test_cuda_engine_refuses_a_cpu_draft(cpu_runnable, engine):
    with pytest.raises(ValueError, match="a cuda engine needs a cuda draft"):
        _engine(cpu_runnable, speculation="draft", draft=engine("llama"))


@pytest.mark.parametrize("precision, tolerance", [("fp16", 0.02), ("int8", 0.05), ("fp8", 0.08)])
def test_tensorrt_graph_is_standard_ops_plus_plugin_and_matches_reference(checkpoint, tmp_path, precision, tolerance):
    """--target tensorrt: everything TensorRT's ONNX parser must read is a standard op, attention is the
    QsPagedAttention plugin node; run on the CPU with the plugin swapped for the reference it must match."""
    out, logs = tmp_path / f"trt-{precision}", []
    build(CompileConfig(checkpoint("llama"), out, precision, target="tensorrt"), log=logs.append)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tensorrt"]["plan"] is None and any("TensorRT is not installed" in m for m in logs)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    domains = {n.domain for n in model.graph.node}
    assert domains <= {"", "trt.plugins"}, domains                     # no com.microsoft op left
    plugin = [n for n in model.graph.node if n.domain == "trt.plugins"]
    assert len(plugin) == 2 and {n.op_type for n in plugin} == {"QsPagedAttention"}
    with pytest.raises(BackendUnavailable, match="does not drive TensorRT plans"):
        ModelRunner(out)

    assert use_reference_op(model, 4, 2) == 2
    onnx.save_model(model, str(out / "model.onnx"))
    runner = PagedModelRunner(out, num_blocks=8, block_size=4, providers=["CPUExecutionProvider"],
                              custom_ops_library=get_library_path(), verify=False)
    prompt = np.random.default_rng(1).integers(0, 512, 13)
    mgr = PagedKVManager(runner.num_blocks, runner.block_size)
    req = Request(prompt.tolist(), SamplingParams(max_tokens=1), request_id="t")
    mgr.allocate(req)
    logits = runner.step(prompt, mgr.step_batch([req], [13]), np.arange(13))
    ckpt = checkpoint("llama")
    ref = ReferenceModel(read_spec(ckpt), CheckpointReader(ckpt)).forward(prompt.tolist())
    assert np.abs(logits - ref).max() <= tolerance * np.abs(ref).max()
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


def test_paged_request_that_can_never_fit_is_refused_at_admission(cpu_runnable):
    """A request whose reservation exceeds the whole block pool used to wait at the head of the queue forever
    (blocking everyone behind it); now it is refused at once, and a fitting one behind it runs."""
    from runtime.config import CacheConfig, EngineConfig, OrtConfig
    from runtime.engine import Engine
    from runtime.request import InvalidRequest, SamplingParams

    eng = Engine(cpu_runnable, EngineConfig(cache=CacheConfig(kv_budget_bytes=1 << 16, block_size=4),
                                            ort=OrtConfig(providers=("CPUExecutionProvider",),
                                                          custom_ops_library=get_library_path()),
                                            verify_artifact=False))
    capacity = eng.kv.blocks.num_blocks * eng.kv.block_size
    assert capacity + 1 < eng.max_model_len - 20
    with pytest.raises(InvalidRequest, match="needs more KV memory than the cache has"):
        eng.add_request(list(range(5, 25)), SamplingParams(max_tokens=capacity))
    assert not eng.has_work()
    out = eng.generate([list(range(5, 25))], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 4
