"""The prefix-aware replica policy (runtime.cluster.routing) as a function: what it ranks first, and why."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cluster.routing import BRANCH, PrefixAffinity, prefix_keys
from runtime.kv.hashing import hash_blocks

REPLICAS = ["a", "b", "c", "d"]


def test_prefix_keys_are_the_kv_caches_own_block_keys():
    ids = list(range(100, 190))                         # 90 tokens: 5 full blocks of 16 and a partial one
    assert prefix_keys(ids, 16) == hash_blocks(ids[:80], 16)
    assert len(prefix_keys(ids, 16)) == 5
    assert prefix_keys(ids, 16, max_blocks=2) == hash_blocks(ids[:32], 16)
    assert prefix_keys(ids[:15], 16) == []             # no full block: nothing to match on
    shared = prefix_keys(ids[:48] + [1] * 40, 16)       # the same first 3 blocks, then different ones
    assert shared[:3] == prefix_keys(ids, 16)[:3] and shared[3:] != prefix_keys(ids, 16)[3:5]


def test_a_recorded_prefix_goes_back_to_its_replica_until_that_replica_is_saturated():
    policy = PrefixAffinity()
    keys = prefix_keys(list(range(64)), 16)
    policy.record(keys, "b")
    ranks, why = policy.choose(keys, {"a": 0, "b": 3, "c": 1}, saturated_at=4, max_imbalance=4)
    assert ranks == [["b"], ["a", "c"]] and why == "continues a prompt (4 blocks)"
    ranks, why = policy.choose(keys, {"a": 0, "b": 3, "c": 1}, saturated_at=4)   # default imbalance 2: too busy
    assert ranks == [["a", "c", "b"]] and why == "prefix holders busier by 3: least loaded"
    longer = keys + [12345]                             # the same prefix with a new last block
    assert policy.choose(longer, {"a": 2, "b": 3}, 4)[0][0] == ["b"]
    ranks, why = policy.choose(keys, {"a": 2, "b": 4, "c": 1}, saturated_at=4)
    assert ranks == [["c", "a", "b"]] and why.startswith("prefix holders saturated")
    policy.forget("b")                                  # its replacement holds nothing
    assert policy.choose(keys, {"a": 2, "b": 0}, 4)[1] == "no prefix match: least cached"


def test_the_longest_held_prefix_wins_and_a_branch_off_a_shared_one_goes_to_the_least_cached():
    policy = PrefixAffinity()
    first = prefix_keys(list(range(64)), 16)
    policy.record(first[:2], "a")                       # two blocks went to a
    policy.record(first, "c")                           # the whole prompt later went to c
    ranks, why = policy.choose(first, {"a": 0, "b": 0, "c": 0}, 8)
    assert ranks[0] == ["c"] and sorted(ranks[1]) == ["a", "b"] and why == "continues a prompt (4 blocks)"
    other = first[:2] + prefix_keys([7] * 64, 16)[2:]   # shares only the first two blocks, which c's prompt went on from
    ranks, why = policy.choose(other, {"a": 1, "b": 0, "c": 0}, 8)
    assert ranks == [["b", "a", "c"]] and why == "branches off a shared prefix (2 blocks): least cached"
    assert policy.sizes == {"a": 2, "c": 4}             # b was given nothing, then a, then c


def test_users_behind_one_system_prompt_spread_over_equally_loaded_replicas():
    policy = PrefixAffinity()
    system = list(range(1000, 1000 + 160))              # 10 blocks every user's prompt starts with
    policy.record(prefix_keys(system, 16), "a")         # both replicas hold the system prompt
    policy.record(prefix_keys(system, 16), "b")
    firsts = {"a": 0, "b": 0}
    for user in range(200):
        keys = prefix_keys(system + [user % 97, user // 97] * 24, 16)
        ranks, why = policy.choose(keys, {"a": 0, "b": 0}, saturated_at=8)
        assert why == "continues a prompt (10 blocks)" and sorted(ranks[0]) == ["a", "b"]
        firsts[ranks[0][0]] += 1
        assert policy.choose(keys, {"a": 0, "b": 0}, 8)[0][0][0] == ranks[0][0]     # the same prompt, the same one
    assert 70 <= firsts["a"] <= 130, firsts             # binomial(200, 1/2): outside this once in ~10^4


def test_new_users_behind_a_system_prompt_one_replica_took_spread_evenly_and_stay():
    """Only the replica that took the first user holds the system prompt: following it would send every new user
    there. A prompt that branches off a prefix earlier prompts went on from goes to the replica given the least."""
    policy = PrefixAffinity()
    system = list(range(1000, 1000 + 160))              # 10 blocks every user's prompt starts with
    prompts = [system + [user, 7] * 88 for user in range(40)]     # and 11 of the user's own
    owner = {}
    for user, prompt in enumerate(prompts):
        ranks, why = policy.choose(prefix_keys(prompt, 16), {"a": 0, "b": 0}, saturated_at=8)
        assert why == ("no prefix match: least cached" if user == 0 else
                       "branches off a shared prefix (10 blocks): least cached")
        owner[user] = ranks[0][0]
        policy.record(prefix_keys(prompt, 16), owner[user])
        assert abs(policy.sizes["a"] - policy.sizes["b"]) <= 21, policy.sizes   # at most one user's blocks
    assert sorted(owner.values()).count("a") == 20      # exactly half each
    for user, prompt in enumerate(prompts):
        # each user's next turn goes where its history is, however long the answer before the new question
        for answer in ([3] * 40, [user, 5] * 320):
            ranks, why = policy.choose(prefix_keys(prompt + answer + [9] * 40, 16), {"a": 0, "b": 0}, 8)
            assert ranks[0] == [owner[user]] and why == "continues a prompt (21 blocks)"


def test_what_continues_an_earlier_prompt():
    policy = PrefixAffinity()
    p = list(range(10))                                 # an earlier prompt's keys (10 blocks), to b
    policy.record(p, "b")
    policy.record(list(range(100, 130)), "a")           # a was given more
    follows = {"a": 0, "b": 0}
    assert policy.choose(p + [50, 51], follows, 8) == ([["b"], ["a"]], "continues a prompt (10 blocks)")
    assert policy.choose(p, follows, 8)[0] == [["b"], ["a"]]         # the same prompt again
    # its last block re-tokenized in the next turn's text: it continues p all the same
    assert policy.choose(p[:9] + [60, 61], follows, 8) == ([["b"], ["a"]], "continues a prompt (9 blocks)")
    # two blocks short of p's end: p went on from there by more than its last block, so this branches off
    assert policy.choose(p[:8] + [70, 71], follows, 8) == ([["b", "a"]], "branches off a shared prefix (8 blocks): "
                                                                           "least cached")
    policy.record(p[:9] + [60], "b")                    # a second prompt went on from p[8] another way
    assert policy.after[p[8]] == BRANCH and not policy.continues(p[8])
    assert policy.choose(p[:9] + [80], follows, 8)[1] == "branches off a shared prefix (9 blocks): least cached"
    assert policy.choose([], {"a": 0, "b": 1}, 8) == ([["a", "b"]], "no full block: least loaded")
    # a new prompt: to b, given less, unless b holds max_imbalance more requests than the least loaded
    assert policy.choose(list(range(200, 204)), {"a": 1, "b": 1}, 8, max_imbalance=2)[0] == [["b", "a"]]
    assert policy.choose(list(range(200, 204)), {"a": 0, "b": 2}, 8, max_imbalance=2)[0] == [["a", "b"]]


def test_the_owner_map_is_bounded_and_forgets_the_least_recent():
    policy = PrefixAffinity(capacity=10)
    for i in range(8):
        policy.record([i, 100 + i], "a")                # 16 keys through a map of 10
    assert len(policy.holders) == 10
    assert list(policy.holders)[:2] == [3, 103]         # the 3 oldest requests' keys are gone
    assert policy.choose([0, 100], {"a": 0, "b": 0}, 4)[1] == "no prefix match: least cached"
    assert policy.choose([7, 107], {"a": 1, "b": 0}, 4)[0][0] == ["a"]
    assert policy.sizes == {"a": 10}                    # what a holds is what the map still has
    assert policy.after == {3: 103, 4: 104, 5: 105, 6: 106, 7: 107}   # what came after the keys it still has


@settings(max_examples=600, deadline=None)
@given(history=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=4), st.sampled_from(REPLICAS)), max_size=12),
       keys=st.lists(st.integers(0, 5), max_size=5),
       loads=st.dictionaries(st.sampled_from(REPLICAS), st.one_of(st.none(), st.integers(0, 6)), min_size=1),
       saturated_at=st.integers(1, 6), max_imbalance=st.integers(1, 7), capacity=st.integers(1, 30),
       gone=st.one_of(st.none(), st.sampled_from(REPLICAS)))
def test_choice_properties(history, keys, loads, saturated_at, max_imbalance, capacity, gone):
    policy = PrefixAffinity(capacity)
    for ks, replica in history:
        policy.record(ks, replica)
    if gone is not None:
        policy.forget(gone)
    # each replica's size is the number of keys the (bounded) map still has it hold; `after` only for those keys
    assert policy.sizes == Counter(r for held in policy.holders.values() for r in held)
    assert set(policy.after) <= set(policy.holders)
    if gone is None and len({k for ks, _ in history for k in ks}) <= capacity:     # nothing evicted or forgotten
        succ = {}
        for ks, _ in history:
            for k, nxt in zip(ks, ks[1:]):
                succ.setdefault(k, set()).add(nxt)
        for k in policy.holders:                        # nothing went on past k, or one block nothing went past
            expected = not succ.get(k) or (len(succ[k]) == 1 and not succ.get(next(iter(succ[k]))))
            assert policy.continues(k) == expected
    ranks, why = policy.choose(keys, loads, saturated_at, max_imbalance)
    ranked = [r for rank in ranks for r in rank]
    assert sorted(ranked) == sorted(loads)              # every candidate once, nothing else
    first = ranked[0]
    load = {r: v or 0 for r, v in loads.items()}
    room = [r for r in loads if load[r] < saturated_at]
    assert load[first] < saturated_at or not room       # never a saturated replica while one has room
    holders = [[r for r in policy.holders.get(k, ()) if r in loads] for k in reversed(keys)]
    depth = next((len(keys) - i for i, h in enumerate(holders) if h), 0)
    deepest = holders[len(keys) - depth] if depth else []   # who holds the longest held prefix
    least = min(load.values())
    best = min((load[r] for r in deepest), default=None)
    if not keys:
        assert load[first] == least and why == "no full block: least loaded"
    elif depth and policy.continues(keys[depth - 1]):
        if best < saturated_at and best - least < max_imbalance:
            # a least-loaded holder of the deepest prefix, when it has room and is not far busier than the least loaded
            assert first in deepest and load[first] == best and why.startswith("continues a prompt (")
            assert set(ranks[0]) == set(deepest)
        else:                                           # else a least-loaded replica
            assert load[first] == least
    else:                                               # a new prompt, or a branch: the least cached of those near
        near = [r for r in loads if load[r] < saturated_at and load[r] - least < max_imbalance]
        assert why.endswith("least cached")
        if near:
            assert first in near and policy.sizes[first] == min(policy.sizes[r] for r in near)
        else:
            assert load[first] == least
    policy.record(keys, first)
    if keys and policy.continues(keys[-1]) and load[first] < saturated_at and load[first] - least < max_imbalance:
        assert first in policy.choose(keys, loads, saturated_at, max_imbalance)[0][0]   # the same prompt again
