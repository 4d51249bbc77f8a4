"""Batch invariance, bitwise: a request's tokens and the logits behind every one of them do not depend on what
else is in its steps — other requests joining at random steps, batch sizes 1 to 16, decode rows beside prefill
chunks, speculative verification, prefix-cache hits — at every precision the CPU path builds.

The bundled target checkpoint is compiled at each precision once per module. Every emitted token is sampled
from one logits row (plain decoding or verification); `LogitTap` keeps a copy of each row so the comparison
covers the logits, not only their argmax. No tolerance, no near-tie escape: equal or the test fails.
"""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from compile.build import build
from compile.config import CompileConfig, QuantConfig
from compile.graph.layers import MIN_ROWS
from runtime import cpu_ops
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.backends.cpu.runner import ModelRunner
from runtime.request import SamplingParams
from runtime.spec_decode.speculator import SpecConfig

MODELS = Path(__file__).resolve().parents[2] / "models"
PRECISIONS = ["fp32", "int8", "int4", "fp8"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
CACHE = CacheConfig(kv_budget_bytes=96 << 20)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """engines(name, precision) → engine folder of the bundled `target` or `draft` (built once per module)."""
    built: dict[tuple[str, str], Path] = {}

    def get(name: str, precision: str, batch_invariant: bool = True, kernels: str = "auto",
            attention_products: str = "fp32") -> Path:
        key = (name, precision, batch_invariant, kernels, attention_products)
        if key not in built:
            out = tmp_path_factory.mktemp("engines") / f"{name}-{precision}"
            quant = QuantConfig(batch_invariant=batch_invariant)
            build(CompileConfig(MODELS / name, out, precision, quant=quant, report=False, kernels=kernels,
                                attention_products=attention_products), log=lambda _: None)
            built[key] = out
        return built[key]

    return get


class LogitTap:
    """Records, per request, a copy of the logits row each of its tokens was chosen from (observes the sampler)."""

    def __init__(self, engine: Engine):
        self.rows: dict[str, list[np.ndarray]] = {}
        result = engine.sampler.result

        def tapped(token, logits, req):
            self.rows.setdefault(req.request_id, []).append(np.array(logits, np.float32, copy=True))
            return result(token, logits, req)

        engine.sampler.result = tapped


def run(engine: Engine, prompts: list[list[int]], join_steps: list[int] | None = None,
        params: SamplingParams = GREEDY) -> list[tuple[list[int], np.ndarray]]:
    """Submit prompt k after join_steps[k] steps; returns per prompt (token ids, logits rows [n, vocab])."""
    tap = LogitTap(engine)
    join_steps = join_steps or [0] * len(prompts)
    pending, ids, tokens, step = sorted(zip(join_steps, range(len(prompts)))), {}, {}, 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            k = pending.pop(0)[1]
            ids[k] = engine.add_request(prompts[k], params).request_id
            tokens[ids[k]] = []
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        step += 1
    assert not engine.requests and engine.kv.num_free_slots == engine.kv.slots.num_slots   # nothing leaked
    return [(tokens[ids[k]], np.stack(tap.rows[ids[k]][:len(tokens[ids[k]])])) for k in range(len(prompts))]


def assert_identical(got, want, label: str) -> None:
    """Every request: the same token ids and bit-identical logits rows, all of them compared."""
    for k, ((tok_a, log_a), (tok_b, log_b)) in enumerate(zip(got, want)):
        assert tok_a == tok_b, f"{label}: request {k} tokens differ from position " \
                               f"{next(i for i, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y)}"
        differ = [i for i in range(len(tok_a)) if not np.array_equal(log_a[i], log_b[i])]
        assert not differ, f"{label}: request {k} logits differ at positions {differ}"


def prompts(n: int, seed: int, lo: int = 4, hi: int = 300) -> list[list[int]]:
    """Token-id prompts of mixed lengths: long ones prefill in several chunks beside other requests' decodes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8000, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def engine_for(path: Path, draft: Path | None = None, speculation: str | None = None, **kw) -> Engine:
    """Speculating engines schedule by fixed chunks: the learned slice size and burst rule follow measured step
    times, and on a loaded machine a batch's prompts could go in slices so long that some prompt always waited
    for its first token, which holds guesses back — a run that never speculated (CI: once, beside another job)."""
    if speculation is not None:
        kw = {"mixed_step_ratio": float("inf"), "max_burst_stall_s": float("inf"), **kw}
    cache = kw.pop("cache", CACHE)
    sched = SchedulerConfig(max_num_seqs=16, token_budget=96, prefill_chunk=64, **kw)
    return Engine(path, EngineConfig(sched, cache, SpecConfig(max_gamma=4, adaptive=False), draft=draft, speculation=speculation))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_alone_equals_batched_with_random_joins(engines, precision):
    """Twelve requests joining at random steps (up to 12 rows per decode step, chunks of long prompts beside
    them, chunk boundaries moved by the token budget) give each request exactly what it gets alone."""
    eng = engine_for(engines("target", precision))
    ps = prompts(12, seed=1)
    alone = [run(eng, [p])[0] for p in ps]
    joins = sorted(np.random.default_rng(2).integers(0, 30, len(ps)).tolist())
    assert_identical(run(eng, ps, joins), alone, f"{precision} batched")


# The one op that is not invariant, where an engine uses it (--kernels ort): ONNX Runtime's GroupQueryAttention computes a single query row (decode) with
# MLAS's M=1 SGEMM kernel (AVX multiply + add) and several rows (prompt chunks, speculative verification) with its
# FMA kernel, so a token's attention output differs in the last bits between the two. Prompt chunks are kept at
# two or more tokens (scheduler.prompt_chunk), so prompts never meet it; verification rows always do. Measured on
# the bundled target: logits within 1e-5 at fp32/fp8; int8/int4 re-quantize activations per row, which turns
# that last-bit difference into quantization noise (up to 0.22 here). Our qs.CausalAttention (the default) computes
# a query row the same way in every pass, so with it speculation equals plain decoding bitwise.
ONE_ROW_ATTENTION_BOUND = {"fp32": 3e-5, "fp8": 3e-5, "int8": 0.5, "int4": 0.5}


def attention_of(engine: Path) -> str:
    return json.loads((engine / "manifest.json").read_text())["precision"].get("attention", "")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_speculation(engines, precision, batch):
    """Speculation is batch-invariant bitwise (each request gets at batch 4 and 16 exactly what it gets alone),
    and equals plain greedy decoding token for token. With our attention op its logits equal plain decoding's
    bitwise; with GroupQueryAttention they differ by the one-row kernel above, and where a quantized engine's
    tokens part, it must be a proven near-tie: plain decoding's top two logits there are closer than the bound."""
    target = engines("target", precision)
    ps = prompts(batch, seed=10 + batch, hi=120)
    plain = run(engine_for(target), ps)
    bound = ONE_ROW_ATTENTION_BOUND[precision]
    exact = attention_of(target) == "qs.CausalAttention"
    for method, draft in (("draft", engines("draft", "int8")), ("ngram", None)):
        eng = engine_for(target, draft, method)
        spec = run(eng, ps)
        assert eng.speculator.stats.proposed > 0
        if batch > 1:
            assert_identical(spec, [run(eng, [p])[0] for p in ps], f"{precision} {method} speculation at batch {batch}")
        if exact:       # verification rows are computed as decode rows are: tokens and logits bitwise equal
            assert_identical(spec, plain, f"{precision} {method} speculation vs plain decoding")
            continue
        for k, ((tok_s, log_s), (tok_p, log_p)) in enumerate(zip(spec, plain)):
            n = next((i for i, (x, y) in enumerate(zip(tok_s, tok_p)) if x != y), len(tok_p))
            assert float(np.abs(log_s[:n + 1] - log_p[:n + 1]).max()) <= bound, f"request {k}: logits beyond the bound"
            if n < len(tok_p):
                assert precision in ("int8", "int4"), f"{precision} {method}: request {k} tokens differ at {n}"
                top2 = np.sort(log_p[n])[-2:]
                assert top2[1] - top2[0] < bound, f"request {k}: tokens differ at {n} without a near-tie"


@pytest.mark.skipif(not cpu_ops.available(), reason="bf16 products are our attention op's")
def test_bf16_attention_products_keep_every_invariance(engines):
    """--attention-products bf16 (int4 weights, fp16 cache): requests joining at random steps get what they get
    alone, draft and n-gram speculation equal plain greedy decoding (tokens and logits), and a prefix-cache hit
    equals a miss, all bitwise; and its logits are not the fp32 products' (the option took effect)."""
    target = engines("target", "int4", attention_products="bf16")
    assert json.loads((target / "manifest.json").read_text())["precision"]["attention_products"] == "bf16"
    eng = engine_for(target)
    ps = prompts(6, seed=40, hi=150)
    alone = [run(eng, [p])[0] for p in ps]
    assert_identical(run(eng, ps, [0, 3, 3, 7, 11, 20]), alone, "bf16 batched")
    for method, draft in (("draft", engines("draft", "int8")), ("ngram", None)):
        spec = engine_for(target, draft, method)
        assert_identical(run(spec, ps), alone, f"bf16 {method} speculation vs plain decoding")
        assert spec.speculator.stats.proposed > 0
    shared = ps[0][:120]
    warm = engine_for(target)
    run(warm, [shared + [5, 6, 7]])
    tails = [shared + tail for tail in prompts(3, seed=41, lo=3, hi=30)]
    hit = run(warm, tails, [0, 1, 2])
    assert warm.kv.stats.hits >= 3
    cold = engine_for(target, cache=CacheConfig(kv_budget_bytes=96 << 20, enable_prefix_cache=False))
    assert_identical(hit, run(cold, tails, [0, 1, 2]), "bf16 prefix hit vs miss")
    fp32 = run(engine_for(engines("target", "int4")), ps[:1])[0]
    assert not np.array_equal(fp32[1][0], alone[0][1][0])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_prefix_hit_equals_miss_inside_a_batch(engines, precision):
    """Requests that share a 160-token prefix, beside unrelated ones: served from the prefix cache (blocks
    copied in, only the rest computed) they match an engine without a prefix cache."""
    shared = prompts(1, seed=30, lo=160, hi=161)[0]
    ps = [shared + tail for tail in prompts(4, seed=31, lo=3, hi=40)] + prompts(4, seed=32, hi=200)
    joins = [0, 2, 4, 6, 0, 1, 3, 5]
    warm = engine_for(engines("target", precision))
    run(warm, [shared + [5, 6, 7]])
    hit = run(warm, ps, joins)
    assert warm.kv.stats.hits >= 4
    cold = engine_for(engines("target", precision), cache=CacheConfig(kv_budget_bytes=96 << 20, enable_prefix_cache=False))
    assert_identical(hit, run(cold, ps, joins), f"{precision} prefix hit vs miss")


def test_no_batch_invariant_build_depends_on_the_batch(engines):
    """`--no-batch-invariant` keeps the faster ops this suite exists to avoid: int8's DynamicQuantizeMatMul takes
    one activation scale for the whole step, so the same requests alone and batched get different logits."""
    eng = engine_for(engines("target", "int8", batch_invariant=False))
    ps = prompts(6, seed=40, hi=60)
    alone, batched = [run(eng, [p])[0] for p in ps], run(eng, ps)
    assert any(not np.array_equal(a[1][i], b[1][i]) for a, b in zip(alone, batched) for i in range(len(a[0]))
               if a[0][:i + 1] == b[0][:i + 1])


def test_no_batch_invariant_int4_build_drops_the_one_row_pad(engines):
    """int4: whether MLAS computes a one-row MatMulNBits with a kernel that rounds differently depends on the CPU
    and ONNX Runtime version (ORT 1.31 on an AVX2 machine: yes; 1.32 on AVX-512 EPYC and VNNI Xeons: no), so the
    batch-invariant build pads one-row steps to MIN_ROWS = 2 rows, an initializer the runtime sets to 1 where its
    probe of this CPU finds one row computed like many; `--no-batch-invariant` leaves the pad out. (MatMulNBits is
    the int4 linear of engines without our kernels: qs.Int4MatMul has no one-row special case to pad around.)"""
    def graph(precision_dir):
        return onnx.load(str(precision_dir / "model.onnx"), load_external_data=False).graph
    padded = graph(engines("target", "int4", kernels="ort"))
    assert sum(n.op_type == "Pad" for n in padded.node) > 0
    assert [list(onnx.numpy_helper.to_array(t)) for t in padded.initializer if t.name == MIN_ROWS] == [[2]]
    unpadded = graph(engines("target", "int4", batch_invariant=False, kernels="ort"))
    assert sum(n.op_type == "Pad" for n in unpadded.node) == 0


def test_int4_pads_one_row_steps_exactly_where_this_cpu_needs_it(engines):
    """Whether or not the runner kept the pad (its probe of this CPU decides), a sequence decoded alone gives bitwise
    the logits it gets beside a neighbour: the probe's decision is checked by its consequence, not recomputed."""
    runner = ModelRunner(engines("target", "int4", kernels="ort"))
    pool = runner.new_pool(2, 64)
    prompts = [[5, 17, 99, 3, 250, 7], [8, 40, 41, 42, 43, 44]]
    for slot, prompt in enumerate(prompts):
        runner.prefill(pool, slot, prompt, 0)
    alone = runner.decode(pool, [(0, 11, 6)], set())
    both = runner.decode(pool, [(0, 11, 6), (1, 12, 6)], set())        # row 0 rewritten with the same token
    assert np.array_equal(alone[0], both[0])


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_batched_verification_equals_one_call_per_sequence(engines, precision):
    """ModelRunner.verify puts several sequences' guesses in one call, each row padded to the longest: every row's
    logits and the KV it leaves over its own tokens equal a call for that sequence alone, bitwise, whatever the
    rows' lengths, the slots between them (unused: a dummy row; fenced: a separate call) and their contexts."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    runner = ModelRunner(engines("target", precision))
    assert runner.batches_verifications
    capacity, num_slots = 96, 8

    rows_strategy = st.lists(st.tuples(st.integers(0, num_slots - 1), st.integers(1, 60), st.integers(1, 6)),
                             min_size=2, max_size=6, unique_by=lambda r: r[0])

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(rows_strategy, st.sets(st.integers(0, num_slots - 1)), st.integers(0, 2**31))
    def check(rows, fenced, seed):
        rng = np.random.default_rng(seed)
        pools = [runner.new_pool(num_slots, capacity) for _ in range(2)]
        calls = []
        for slot, context, n in rows:
            prompt = rng.integers(3, 8000, context).tolist()
            for pool in pools:
                runner.prefill(pool, slot, prompt, 0)
            calls.append((slot, rng.integers(3, 8000, n).tolist(), context))
        own = {slot for slot, _, _ in calls}
        batched = runner.verify(pools[0], calls, fenced - own)
        for (slot, tokens, start), got in zip(calls, batched):
            want = runner.prefill(pools[1], slot, tokens, start, all_logits=True)
            assert got.shape == want.shape and np.array_equal(got, want), f"slot {slot}: logits differ"
            end = start + len(tokens)
            for a, b in zip(pools[0].keys + pools[0].values, pools[1].keys + pools[1].values):
                assert np.array_equal(a[slot, :, :end], b[slot, :, :end]), f"slot {slot}: KV differs"

    check()


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_batched_decode_spans_retained_slots_without_touching_them(engines, precision):
    """ModelRunner.decode spans retained slots (KVCacheManager.decode_fence) with a dummy row just past what each
    keeps: every decoding row's logits and KV equal a decode of that sequence alone, bitwise, every retained slot
    keeps its rows bitwise, and the batch is one call per group that slot_groups gives (one, unless another
    sequence's slot or the dummies' key budget splits it)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from runtime.backends.cpu import runner as runner_module

    runner = ModelRunner(engines("target", precision))
    capacity, num_slots = 96, 8
    roles = st.lists(st.sampled_from(["decode", "retained", "busy", "free"]), min_size=num_slots, max_size=num_slots)

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(roles, st.lists(st.integers(1, 80), min_size=num_slots, max_size=num_slots), st.integers(0, 2**31),
           st.sampled_from([4096, 100]))
    def check(role, lengths, seed, span_keys):
        if "decode" not in role:
            return
        rng = np.random.default_rng(seed)
        pools = [runner.new_pool(num_slots, capacity) for _ in range(2)]
        for slot in range(num_slots):
            if role[slot] != "free":
                prompt = rng.integers(3, 8000, lengths[slot]).tolist()
                for pool in pools:
                    runner.prefill(pool, slot, prompt, 0)
        rows = [(slot, int(rng.integers(3, 8000)), lengths[slot]) for slot in range(num_slots) if role[slot] == "decode"]
        fenced = {slot for slot in range(num_slots) if role[slot] == "busy"}
        dummies = {slot: lengths[slot] for slot in range(num_slots) if role[slot] == "retained"}
        before = [[a[slot].copy() for a in pools[0].keys + pools[0].values] for slot in range(num_slots)]
        calls, execute = [], runner.execute
        runner.execute = lambda *a: calls.append(a[4]) or execute(*a)
        old_span, runner_module.SPAN_KEYS = runner_module.SPAN_KEYS, span_keys
        try:
            batched = runner.decode(pools[0], rows, fenced, dummies)
            groups = runner_module.slot_groups([r[0] for r in rows], fenced, dummies)
        finally:
            runner.execute, runner_module.SPAN_KEYS = execute, old_span
        assert len(calls) == len(groups)
        for (slot, token, pos), got in zip(rows, batched):
            want = runner.decode(pools[1], [(slot, token, pos)], set())[0]
            assert np.array_equal(got, want), f"slot {slot}: logits differ"
            for a, b in zip(pools[0].keys + pools[0].values, pools[1].keys + pools[1].values):
                assert np.array_equal(a[slot, :, :pos + 1], b[slot, :, :pos + 1]), f"slot {slot}: KV differs"
        for slot, kept in dummies.items():
            for a, old in zip(pools[0].keys + pools[0].values, before[slot]):
                assert np.array_equal(a[slot, :, :kept], old[:, :kept]), f"retained slot {slot}: rows changed"

    check()


def test_batched_verification_of_a_sequence_at_the_end_of_its_slot(engines):
    """A sequence near the end of its context guesses less than another with tokens to go, and padded to that
    one's longer row its KV would pass its slot's end: it is verified in a call of its own, and both requests
    still get plain decoding's tokens."""
    target = engines("target", "int8")
    cache = CacheConfig(kv_budget_bytes=96 << 20, max_model_len=64)
    ps = [prompts(1, seed=50, lo=50, hi=51)[0], prompts(1, seed=51, lo=10, hi=11)[0]]
    params = [SamplingParams(max_tokens=14, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)]
    plain = [o["token_ids"] for o in engine_for(target, cache=cache).generate(ps, params)]
    eng = engine_for(target, target, "draft", cache=cache)          # the target as its own draft: all accepted
    assert [o["token_ids"] for o in eng.generate(ps, params)] == plain
    assert eng.stats.failed_steps == 0 and eng.speculator.stats.accepted > 0


@pytest.mark.parametrize("precision,products", [(p, "fp32") for p in PRECISIONS] + [("int4", "bf16")])
def test_packed_step_equals_each_sequence_alone(engines, precision, products):
    """ModelRunner.step packs decodes, prompt slices (continuing a prompt or starting one) and any logits rows of
    several sequences into one call: each sequence's logits and KV equal what a call of its own gives, bitwise, and
    the slots between them that the call spans (other sequences', retained ones, free ones) keep every row."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    runner = ModelRunner(engines("target", precision, attention_products=products))
    assert runner.packs_steps
    capacity, num_slots = 128, 8
    roles = st.lists(st.sampled_from(["decode", "slice", "prompt", "other", "free"]), min_size=num_slots,
                     max_size=num_slots)

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(roles, st.lists(st.integers(1, 60), min_size=num_slots, max_size=num_slots),
           st.lists(st.integers(2, 40), min_size=num_slots, max_size=num_slots), st.integers(0, 2**31))
    def check(role, lengths, news, seed):
        if sum(r in ("decode", "slice", "prompt") for r in role) < 2:
            return
        rng = np.random.default_rng(seed)
        pools = [runner.new_pool(num_slots, capacity) for _ in range(2)]
        for slot in range(num_slots):
            if role[slot] in ("decode", "slice", "other"):
                prompt = rng.integers(3, 8000, lengths[slot]).tolist()
                for pool in pools:
                    runner.prefill(pool, slot, prompt, 0)
        seqs = []
        for slot in range(num_slots):
            start = 0 if role[slot] == "prompt" else lengths[slot]
            n = {"decode": 1, "slice": news[slot], "prompt": news[slot]}.get(role[slot])
            if n is not None:
                wanted = int(rng.integers(0, n + 1)) if role[slot] != "decode" else 1
                seqs.append((slot, rng.integers(3, 8000, n).tolist(), start, wanted))
        rng.shuffle(seqs)
        before = [a.copy() for a in pools[0].keys + pools[0].values]
        packed = runner.step(pools[0], seqs)
        for (slot, tokens, start, wanted), got in zip(seqs, packed):
            if len(tokens) == 1:
                alone = runner.decode(pools[1], [(slot, tokens[0], start)], set())
            else:
                alone = runner.prefill(pools[1], slot, tokens, start, all_logits=True)[len(tokens) - wanted:]
            if wanted:
                assert np.array_equal(got, alone), f"slot {slot}: logits differ"
            else:
                assert got is None
        for a, b, old in zip(pools[0].keys + pools[0].values, pools[1].keys + pools[1].values, before):
            for slot, tokens, start, _ in seqs:
                assert np.array_equal(a[slot, :, :start + len(tokens)], b[slot, :, :start + len(tokens)]), \
                    f"slot {slot}: KV differs"
            touched = {slot for slot, *_ in seqs}
            for slot in set(range(num_slots)) - touched:
                assert np.array_equal(a[slot], old[slot]), f"slot {slot}: spanned, and its rows changed"

    check()


def test_one_token_path_equals_execute_in_any_interleaving(engines):
    """ModelRunner.decode_one writes only the token, position and total into the binding of the call before it
    where that call was one token of the same slot, and takes execute()'s path otherwise: any interleaving of it
    with prompts, batched decodes, packed steps and other slots or pools gives the logits and KV that execute()
    gives, bitwise, and a pool that is gone is never run on."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    runner = ModelRunner(engines("target", "int4"))
    assert runner.packs_steps
    capacity, num_slots = 96, 3
    op = st.one_of(st.tuples(st.just("one"), st.integers(0, 1), st.integers(0, num_slots - 1)),
                   st.tuples(st.just("prompt"), st.integers(0, 1), st.integers(0, num_slots - 1)),
                   st.tuples(st.just("batch"), st.integers(0, 1), st.just(0)),
                   st.tuples(st.just("step"), st.integers(0, 1), st.integers(0, num_slots - 1)))

    def play(ops, seed, lean):
        """Run `ops` on fresh pools; decode_one where `lean`, else execute() with the arrays spelled out."""
        rng = np.random.default_rng(seed)
        pools = [runner.new_pool(num_slots, capacity) for _ in range(2)]
        lengths = [[0] * num_slots for _ in pools]
        got = []
        for kind, p, slot in ops:
            pool, length = pools[p], lengths[p]
            if kind == "prompt" or length[slot] == 0:
                tokens = rng.integers(3, 8000, int(rng.integers(1, 12))).tolist()
                got.append(runner.prefill(pool, slot, tokens, length[slot]))
                length[slot] += len(tokens)
            elif kind == "one":
                token, pos = int(rng.integers(3, 8000)), length[slot]
                if lean:
                    got.append(runner.decode_one(pool, slot, token, pos).copy())
                else:
                    got.append(runner.execute(np.array([[token]], np.int64), np.array([pos], np.int32),
                                              np.array([0], np.int64), pool, runner_slots(slot, 1)).copy())
                length[slot] += 1
            elif kind == "batch":
                rows = [(s, int(rng.integers(3, 8000)), length[s]) for s in range(num_slots) if length[s]]
                got.append(runner.decode(pool, rows, set()))
                for s, *_ in rows:
                    length[s] += 1
            else:                       # a packed step: one token of `slot`, maybe beside one of another slot
                seqs = [(slot, [int(rng.integers(3, 8000))], length[slot], 1)]
                other = next((s for s in range(num_slots) if s != slot and length[s]), None)
                if other is not None and rng.integers(2):
                    seqs.append((other, [int(rng.integers(3, 8000))], length[other], 1))
                got.extend(runner.step(pool, seqs))
                for s, *_ in seqs:
                    length[s] += 1
            for s in range(num_slots):  # a full slot starts over with a prompt
                if length[s] > capacity - 16:
                    length[s] = 0
        return got, [a.copy() for pool in pools for a in pool.keys + pool.values]

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(op, min_size=1, max_size=24), st.integers(0, 2**31))
    @example(ops=[("prompt", 0, 0), ("one", 0, 0), ("one", 0, 0), ("one", 1, 0), ("one", 0, 0), ("step", 0, 0),
                  ("one", 0, 0), ("one", 0, 1), ("batch", 0, 0), ("one", 0, 1), ("one", 0, 1)], seed=0)
    def check(ops, seed):
        lean, lean_kv = play(ops, seed, lean=True)
        plain, plain_kv = play(ops, seed, lean=False)
        assert len(lean) == len(plain)
        for i, (a, b) in enumerate(zip(lean, plain)):
            assert np.array_equal(a, b), f"op {i} {ops[i]}: logits differ"
        for a, b in zip(lean_kv, plain_kv):
            assert np.array_equal(a, b), "KV differs"

    check()
    for gone in (False, True):             # another pool's one-token binding, live or gone, is not reused
        first, second = runner.new_pool(1, 16), runner.new_pool(1, 16)
        runner.prefill(first, 0, [5, 6, 7], 0)
        runner.prefill(second, 0, [9, 10, 11], 0)
        runner.decode_one(first, 0, 8, 3)
        if gone:
            del first
        got = runner.decode_one(second, 0, 8, 3).copy()
        want = runner.execute(np.array([[8]], np.int64), np.array([3], np.int32), np.array([0], np.int64), second,
                              runner_slots(0, 1))
        assert np.array_equal(got, want), "the one-token path ran on another pool's binding"


def test_a_step_with_prompt_slices_is_one_call(engines):
    """The engine runs a step whose prompt chunks share it with decodes (or with each other) as one packed call,
    and each request still gets what it gets alone."""
    eng = engine_for(engines("target", "int4"))
    runner, schedule = eng.backend.runner, eng.scheduler.schedule
    ps = prompts(4, seed=7, lo=100, hi=200)
    alone = [run(eng, [p])[0] for p in ps]
    calls, plans = [], []
    runner.execute = lambda *a, execute=runner.execute, **k: calls.append(len(plans)) or execute(*a, **k)
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    batched = run(eng, ps, [0, 0, 3, 6])
    assert_identical(batched, alone, "packed steps")
    mixed = [i for i, p in enumerate(plans, 1) if p.decodes and p.chunks]
    assert mixed, "no step carried prompt chunks beside decodes"
    for step in mixed:
        assert calls.count(step) == 1, f"step {step}: {calls.count(step)} calls"


def test_packed_inputs_that_break_the_contract_are_refused(engines):
    """qs.CausalAttention checks a packed step's offsets and rows before it writes anything: two sequences on one
    KV row, offsets that do not cover the step's tokens, or a sequence with no tokens get a clear error."""
    runner = ModelRunner(engines("target", "int4"))
    pool = runner.new_pool(4, 64)
    ids = np.array([[5, 6, 7]], np.int64)
    cases = {"kv_rows must be distinct": ([0, 1, 3], [1, 1], [4, 5]),
             "query_starts must run from 0": ([0, 1, 2], [0, 1], [4, 5]),
             "a packed sequence has no tokens": ([0, 0, 3], [0, 1], [4, 5])}
    for message, (starts, rows, seqlens) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            runner.execute(ids, np.array(seqlens, np.int32), np.array([2], np.int64), pool,
                           runner_slots(0, 4), np.array(starts, np.int32), np.array(rows, np.int32))


def runner_slots(start: int, count: int):
    from runtime.backends.cpu.slots import SlotRange

    return SlotRange(start, count)


def test_a_speculating_step_is_one_call(engines):
    """At batch > 1 a speculating step's plain decodes and every verification go to the target in one packed call
    (they took a call for the decodes and one for the verifications, two passes over the weights), and greedy
    speculation still equals plain greedy decoding, tokens and logits."""
    target = engines("target", "int4")
    ps = prompts(4, seed=12, hi=80)
    alone = [run(engine_for(target), [p])[0] for p in ps]
    spec = engine_for(target, engines("draft", "int8"), "draft")
    runner, schedule = spec.backend.runner, spec.scheduler.schedule
    calls, plans = [], []
    runner.execute = lambda *a, execute=runner.execute, **k: calls.append(len(plans)) or execute(*a, **k)
    spec.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    assert_identical(run(spec, ps, [0, 0, 1, 1]), alone, "speculation in packed steps")
    speculating = [i for i, p in enumerate(plans, 1) if p.gammas and len(p.decodes) > 1]
    assert speculating, "no step speculated at batch > 1"
    for step in speculating:
        assert calls.count(step) == 1, f"step {step}: {calls.count(step)} target calls"
