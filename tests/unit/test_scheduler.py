"""Scheduler decisions on a bookkeeping-only KV manager (no model): whole prompts or time-bounded slices."""

import pytest
from hypothesis import given, settings, strategies as st

from runtime.config import SchedulerConfig
from runtime.backends.paged.kv import PagedKVManager
from runtime.outputs import SchedulePlan
from runtime.request import Request, SamplingParams
from runtime.scheduler import Scheduler, prompt_chunk


def _decoding(sched, n):
    """`n` requests that have prefilled and now decode."""
    for i in range(n):
        req = Request(list(range(8)), SamplingParams(max_tokens=64), request_id=f"dec{i}")
        sched.add(req)
        sched.schedule()
        req.num_computed = req.num_tokens - 1
    return sched


def _setup(ratio=4.0):
    """A long prompt arriving while three streams decode (fewer than half as many prompts: slices)."""
    sched = _decoding(Scheduler(SchedulerConfig(max_num_seqs=8, prefill_chunk=128, mixed_step_ratio=ratio),
                                PagedKVManager(num_blocks=512, block_size=16, num_slots=8, max_model_len=4096)), 3)
    long = Request(list(range(2000)), SamplingParams(max_tokens=4), request_id="long")
    sched.add(long)
    return sched, long


def test_the_slice_beside_decodes_shrinks_to_the_step_time_target_and_grows_back():
    sched, long = _setup()
    sched.observe(SchedulePlan(decodes=[None]), 0.010)          # decode-only steps take 10 ms
    plan = sched.schedule()                                     # one decoding, one prompt: not outnumbered
    assert plan.chunks == [(long, Scheduler.MIN_CHUNK)] and len(plan.decodes) == 3 and plan.sliced
    sched.observe(plan, 0.005)                                  # far under the 4 × 10 ms target: at most doubles
    assert sched.schedule().chunks == [(long, 2 * Scheduler.MIN_CHUNK)]
    sched.mixed_tokens = 128
    sched.observe(SchedulePlan(decodes=[None], chunks=[(long, 128)], sliced=True), 0.160)   # 4× over
    assert sched.schedule().chunks == [(long, 32)]
    sched.observe(SchedulePlan(decodes=[None], chunks=[(long, 32)], sliced=True), 0.005)
    assert sched.mixed_tokens == 64
    for _ in range(4):
        sched.observe(SchedulePlan(decodes=[None], chunks=[(long, sched.mixed_tokens)], sliced=True), 0.001)
    assert sched.mixed_tokens == 128                            # never above prefill_chunk
    sched.observe(SchedulePlan(decodes=[None], chunks=[(long, 16)]), 10.0)      # a prompt's last slice: not cut
    assert sched.mixed_tokens == 128
    for _ in range(8):
        sched.observe(SchedulePlan(decodes=[None], chunks=[(long, sched.mixed_tokens)], sliced=True), 10.0)
    assert sched.mixed_tokens == Scheduler.MIN_CHUNK


def test_where_even_the_smallest_slice_is_over_the_target_the_step_time_of_the_first_ones_is_held():
    """A long prompt among streams whose MIN_CHUNK slices already cost more than the ratio allows: the least of
    the first FLOOR_STEPS such steps' costs becomes the target, and as the prompt's growing context makes slices
    slower, they shrink below MIN_CHUNK (to the KV manager's fewest) to hold it; decode-only steps end the hold."""
    sched, long = _setup(ratio=2.0)                             # paged KV manager: min_chunk 1
    sched.observe(SchedulePlan(decodes=[None]), 0.010)          # target 2 × 10 ms
    floor = SchedulePlan(decodes=[None], chunks=[(long, Scheduler.MIN_CHUNK)], sliced=True)
    for seconds in (0.060, 0.036, 0.032):                       # a cold first slice, then the prompt's usual cost
        assert sched.mixed_tokens == Scheduler.MIN_CHUNK
        sched.observe(floor, seconds)
    assert sched.mixed_tokens == Scheduler.MIN_CHUNK          # held at the least, 32 ms: the last step's
    sched.observe(floor, 0.064)                                 # the context doubled a slice's cost: half the slice
    assert sched.mixed_tokens == Scheduler.MIN_CHUNK // 2
    assert sched.schedule().chunks == [(long, Scheduler.MIN_CHUNK // 2)]
    for _ in range(8):                                          # ever slower: down to the fewest tokens, not 0
        sched.observe(SchedulePlan(decodes=[None], chunks=[(long, sched.mixed_tokens)], sliced=True), 1.0)
    assert sched.mixed_tokens == sched.kv.min_chunk == 1
    sched.observe(SchedulePlan(decodes=[None], chunks=[(long, 1)], sliced=True), 0.008)   # at most doubles back
    assert sched.mixed_tokens == 2
    sched.observe(SchedulePlan(decodes=[None]), 0.010)          # the prompt is done: MIN_CHUNK is the floor again
    assert sched.mixed_tokens == Scheduler.MIN_CHUNK
    sched.observe(SchedulePlan(decodes=[None], chunks=[(long, 16)], sliced=True), 1.0)
    assert sched.mixed_tokens == Scheduler.MIN_CHUNK


@pytest.mark.parametrize("pending", [3, 4, 5, 6, 7])
def test_a_held_slice_always_makes_progress_where_chunks_keep_two_tokens(pending):
    """The cpu backend's chunks never hold or leave a single token (min_chunk 2): held slices stop at 3 tokens,
    which always make a chunk, so a prompt's last few tokens do not wait for the streams beside it to end."""
    sched, long = _setup(ratio=2.0)
    sched.kv.min_chunk = 2
    sched.observe(SchedulePlan(decodes=[None]), 0.010)
    for _ in range(Scheduler.FLOOR_STEPS):
        sched.observe(SchedulePlan(decodes=[None], chunks=[(long, Scheduler.MIN_CHUNK)], sliced=True), 0.030)
    for _ in range(8):                                          # far over the held 30 ms: as small as allowed
        sched.observe(SchedulePlan(decodes=[None], chunks=[(long, sched.mixed_tokens)], sliced=True), 1.0)
    assert sched.mixed_tokens == 3
    sched.schedule()                                            # admits the long prompt
    long.num_computed = long.num_tokens - pending
    plan = sched.schedule()
    assert len(plan.decodes) == 3 and len(plan.chunks) == 1 and 2 <= plan.chunks[0][1] <= 3
    assert pending - plan.chunks[0][1] != 1


def test_slices_beside_decodes_share_one_bound():
    """Two prompts beside five decoding streams: together they get one step's slice, not one each."""
    sched = _decoding(Scheduler(SchedulerConfig(max_num_seqs=8, prefill_chunk=128),
                                PagedKVManager(num_blocks=512, block_size=16, num_slots=8, max_model_len=4096)), 5)
    sched.observe(SchedulePlan(decodes=[None] * 5), 0.010)
    a, b = (Request(list(range(300 + i)), SamplingParams(max_tokens=4), request_id=f"p{i}") for i in range(2))
    sched.add(a), sched.add(b)
    sched.mixed_tokens = 128
    plan = sched.schedule()
    assert len(plan.decodes) == 5 and plan.chunks == [(a, 128)] and plan.sliced
    sched.observe(plan, 0.040)                                  # 2 × 10 ms target: twice over
    assert sched.schedule().chunks == [(a, 64)]


def test_the_slice_target_follows_the_decodes_it_rides_with():
    """The target is mixed_step_ratio × what the step's decodes cost alone (their call, as the backend timed or
    priced it, plus the rest of a decode-only step), not the decode-only steps of an earlier, smaller batch: one
    stream's 4 ms steps came before, seven decodes take 9 ms alone, so a 15 ms step with a slice is under its
    2 × 10 ms target and the slice grows."""
    sched, long = _setup(ratio=2.0)
    sched.observe(SchedulePlan(decodes=[None]), 0.004, decode_s=0.003)      # the rest of a step: 1 ms
    plan = sched.schedule()
    assert plan.chunks == [(long, Scheduler.MIN_CHUNK)] and plan.sliced
    sched.observe(plan, 0.015, decode_s=0.009)                  # target 2 × (9 + 1) ms
    assert sched.mixed_tokens == round(Scheduler.MIN_CHUNK * 0.020 / 0.015)
    sched.mixed_tokens = 60
    sched.observe(plan, 0.030, decode_s=0.009)                  # over it: 2/3 of the slice
    assert sched.mixed_tokens == 40
    # a backend that times no decode call apart: the average of decode-only steps (4 ms) is the reference
    plain, long2 = _setup(ratio=2.0)
    plain.observe(SchedulePlan(decodes=[None]), 0.004)
    plain.mixed_tokens = 32
    plain.observe(SchedulePlan(decodes=[None], chunks=[(long2, 32)], sliced=True), 0.016)
    assert plain.mixed_tokens == 16


def test_prompts_that_outnumber_the_decoding_streams_are_computed_whole():
    """A burst: three prompts beside one decoding stream go in one step, whole (it stalls once), within the
    token budget; one prompt beside four decoding streams gets a slice; with nobody decoding, a lone prompt
    takes the whole budget."""
    kv = PagedKVManager(num_blocks=512, block_size=16, num_slots=8, max_model_len=4096)
    sched = _decoding(Scheduler(SchedulerConfig(max_num_seqs=8, token_budget=1000, prefill_chunk=128), kv), 1)
    burst = [Request(list(range(300 + i)), SamplingParams(max_tokens=4), request_id=f"b{i}") for i in range(4)]
    for req in burst[:3]:
        sched.add(req)
    plan = sched.schedule()
    assert len(plan.decodes) == 1 and plan.chunks == [(burst[0], 300), (burst[1], 301), (burst[2], 302)]
    assert not plan.sliced
    for req in burst[:3]:
        req.num_computed = req.num_tokens - 1                   # their first tokens: now they decode
    sched.add(burst[3])                                         # one prompt beside four decoding streams: a slice
    assert sched.schedule().chunks == [(burst[3], Scheduler.MIN_CHUNK)]
    sched, long = _setup()
    for req in [r for r in sched.running if r.request_id.startswith("dec")]:
        sched.remove(req)
    assert sched.schedule().chunks == [(long, 2000)]            # (the default budget is 4096)


@pytest.mark.parametrize("stall_s, prompt, whole", [(1.0, 200, True), (1.0, 1000, False), (float("inf"), 1000, True)])
def test_a_burst_is_whole_only_while_its_stall_stays_within_the_bound(stall_s, prompt, whole):
    """One stream decoding and a prompt arriving is a burst (prompts ≥ half the streams). Prompt tokens measured
    at 2 ms each 300 tokens in: 200 more cost 0.4 s, whole; 1,000 cost 2 s × (1,000 / 300) for attending further,
    past 1 s: slices, and a prompt begun in slices ends in them, though its tail would fit (inf: whole, as before:
    one stream + a 3,000-token prompt was one 3.8 s gap)."""
    kv = PagedKVManager(num_blocks=512, block_size=16, num_slots=8, max_model_len=4096)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, prefill_chunk=128, max_burst_stall_s=stall_s), kv)
    first = Request(list(range(300)), SamplingParams(max_tokens=64), request_id="first")
    sched.add(first)
    plan = sched.schedule()
    assert plan.chunks == [(first, 300)] and not plan.decodes          # nobody decoding: whole
    first.num_computed = first.num_tokens - 1                           # (its first token pending: it decodes)
    sched.observe(plan, 0.6)                                            # 2 ms a prompt token, 300 tokens in
    sched.observe(SchedulePlan(decodes=[first]), 0.010)
    late = Request(list(range(prompt)), SamplingParams(max_tokens=4), request_id="late")
    sched.add(late)
    plan = sched.schedule()
    assert plan.decodes == [first]
    if whole:
        assert plan.chunks == [(late, prompt)] and not plan.sliced
        return
    assert plan.chunks == [(late, Scheduler.MIN_CHUNK)] and plan.sliced
    late.num_computed = prompt - 100                                    # 100 left: 0.2 s whole, but in slices
    plan = sched.schedule()
    assert plan.sliced and plan.chunks[0][1] < 100


@settings(max_examples=150, deadline=None)
@given(decoding=st.integers(0, 6), lengths=st.lists(st.integers(2, 700), max_size=6),
       budget=st.sampled_from([64, 300, 1000, 4096]))
def test_a_plan_takes_whole_prompts_in_a_burst_and_one_bounded_slice_otherwise(decoding, lengths, budget):
    """Any mix of decoding streams and new prompts: the step stays within the token budget, every decode runs, no
    chunk is one token or leaves one behind; prompts at least half as many as the decodes are taken whole,
    shortest first, until the budget runs out (short ones first if any: long prompts sit out a step); fewer
    share one slice of at most `mixed_tokens`."""
    chunk = min(128, budget)
    kv = PagedKVManager(num_blocks=4096, block_size=16, num_slots=16, max_model_len=4096)
    kv.min_chunk = 2            # the cpu backend's capability (no one-token chunk), which this property checks
    sched = _decoding(Scheduler(SchedulerConfig(max_num_seqs=16, token_budget=budget, prefill_chunk=chunk), kv),
                      decoding)
    prompts = [Request(list(range(n)), SamplingParams(max_tokens=4), request_id=f"p{i}") for i, n in enumerate(lengths)]
    for req in prompts:
        sched.add(req)
    plan = sched.schedule()
    assert len(plan.decodes) == decoding and plan.num_tokens <= budget
    for req, n in plan.chunks:
        assert n >= 2 and (n == req.num_pending or req.num_pending - n >= 2)
    taken = [n for _, n in plan.chunks]
    if 2 * len(prompts) >= decoding:
        short = sorted(n for n in lengths if n <= chunk)
        eligible = short or sorted(lengths)       # long prompts sit out while a short one prefills
        left, expect = budget - decoding, []
        for n in eligible:
            if left < 2:
                break
            take = n if n <= left else (left if n - left >= 2 else left - 1)
            if take < 2:
                break
            expect.append(take)
            left -= take
        assert taken == expect and not plan.sliced
    else:
        assert sum(taken) <= sched.mixed_tokens


def test_fixed_slices_when_the_ratio_is_infinite():
    sched, long = _setup(ratio=float("inf"))
    sched.observe(SchedulePlan(decodes=[None]), 0.010)
    plan = sched.schedule()
    assert plan.chunks == [(long, 128)]
    sched.observe(plan, 5.0)
    assert sched.schedule().chunks == [(long, 128)]


def test_a_steady_stream_of_short_prompts_cannot_starve_a_long_one():
    sched, long = _setup()
    sched.observe(SchedulePlan(decodes=[None]), 0.010)
    served = []
    for step in range(20):
        sched.add(Request(list(range(40)), SamplingParams(max_tokens=4), request_id=f"s{step}"))
        plan = sched.schedule()
        served.append(any(r is long for r, _ in plan.chunks))
        if served[-1]:                                      # aged: a small chunk after the short prompt's
            assert plan.chunks[-1] == (long, Scheduler.MIN_CHUNK) and len(plan.chunks) == 2
        for req, n in plan.chunks:
            req.num_computed += n
            if req is not long:                             # a short one finishes at its first token
                sched.remove(req)
    runs = "".join("x" if s else "." for s in served)
    assert "." * (Scheduler.MAX_SAT_OUT + 1) not in runs, runs  # never more than MAX_SAT_OUT steps in a row
    assert runs.count("x") >= 20 // (Scheduler.MAX_SAT_OUT + 1)
    assert long.num_computed > 0


def test_prompt_chunks_are_never_a_single_token():
    """No prompt token is computed in a one-token step (GroupQueryAttention's one-row kernel rounds differently),
    and no chunk leaves a single token behind; a cap that allows neither schedules nothing."""
    assert [prompt_chunk(p, c) for p, c in [(5, 8), (5, 5), (5, 4), (5, 3), (5, 2), (5, 1), (2, 1), (3, 2)]] == \
        [5, 5, 3, 3, 2, 0, 0, 0]
    for pending in range(2, 40):
        for cap in range(1, 40):
            n = prompt_chunk(pending, cap)
            assert n <= cap and (n == 0 or (n >= 2 and pending - n != 1)), (pending, cap, n)
            assert n > 0 or cap < 2 or (cap == 2 and pending == 3)


def test_backends_without_the_one_row_kernel_take_any_chunk():
    """min_chunk 1 (the paged and cuda backends' KV manager): the chunk is what the cap allows, one token too."""
    assert PagedKVManager.min_chunk == 1
    for pending in range(1, 30):
        for cap in range(1, 30):
            assert prompt_chunk(pending, cap, 1) == min(pending, cap)


def test_prefix_cache_leaves_at_least_two_prompt_tokens_to_compute():
    """A prompt fully covered by cached blocks still computes its last two tokens (not one)."""
    kv = PagedKVManager(num_blocks=64, block_size=16, num_slots=2, max_model_len=256)
    first = Request(list(range(33)), SamplingParams(max_tokens=1), request_id="first")
    assert kv.allocate(first) == 0
    first.num_computed = 33
    kv.cache_computed(first)
    kv.free(first)
    again = Request(list(range(33)), SamplingParams(max_tokens=1), request_id="again")
    assert kv.allocate(again) == 16                                  # (33 - 2) // 16 blocks: one, not two


def test_a_token_budget_below_the_chunk_caps_the_chunk():
    """`--token-budget 128` with the default 256-token chunk: chunks follow the budget instead of refusing."""
    assert SchedulerConfig(token_budget=128).prefill_chunk == 128
    assert SchedulerConfig(token_budget=1024).prefill_chunk == SchedulerConfig().prefill_chunk == 256
    with pytest.raises(ValueError, match="prefill_chunk"):
        SchedulerConfig(prefill_chunk=0)


def test_no_guesses_are_planned_while_a_prompt_waits_for_its_first_token():
    asked = []

    def planner(decodes, budget):
        asked.append([r.request_id for r in decodes])
        return {r.request_id: 3 for r in decodes}

    sched, long = _setup()
    sched.plan_speculation = planner
    sched.observe(SchedulePlan(decodes=[None]), 0.010)
    plan = sched.schedule()                                     # "long" prefills beside three decodes
    assert plan.chunks and plan.decodes and not plan.gammas and asked == []
    sched.running.remove(long)                                  # nobody prefilling: the planner is asked
    plan = sched.schedule()
    assert plan.gammas == {"dec0": 3, "dec1": 3, "dec2": 3} and asked == [["dec0", "dec1", "dec2"]]
