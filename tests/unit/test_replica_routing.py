"""The prefix-aware replica policy (runtime.cluster.routing) as a function: what it ranks first, and why."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cluster.routing import PrefixAffinity, prefix_keys
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
    assert ranks == [["b"], ["a", "c"]] and why == "prefix match (4 blocks)"
    ranks, why = policy.choose(keys, {"a": 0, "b": 3, "c": 1}, saturated_at=4)   # default imbalance 2: too busy
    assert ranks == [["a", "c", "b"]] and why == "prefix holders busier by 3: least loaded"
    longer = keys + [12345]                             # the same prefix with a new last block
    assert policy.choose(longer, {"a": 2, "b": 3}, 4)[0][0] == ["b"]
    ranks, why = policy.choose(keys, {"a": 2, "b": 4, "c": 1}, saturated_at=4)
    assert ranks == [["c", "a", "b"]] and why.startswith("prefix holders saturated")
    policy.forget("b")                                  # its replacement holds nothing
    assert policy.choose(keys, {"a": 2, "b": 0}, 4)[1] == "no prefix match: least cached"


def test_the_longest_held_prefix_wins_and_a_shared_one_goes_to_its_least_loaded_holder():
    policy = PrefixAffinity()
    first = prefix_keys(list(range(64)), 16)
    policy.record(first[:2], "a")                       # two blocks went to a
    policy.record(first, "c")                           # the whole prompt later went to c
    assert policy.choose(first, {"a": 0, "b": 0, "c": 0}, 8)[0] == [["c"], ["a", "b"]] or \
        policy.choose(first, {"a": 0, "b": 0, "c": 0}, 8)[0] == [["c"], ["b", "a"]]
    other = first[:2] + prefix_keys([7] * 64, 16)[2:]   # shares only the first two blocks: a and c hold them
    ranks, why = policy.choose(other, {"a": 1, "b": 0, "c": 0}, 8)
    assert ranks == [["c", "a"], ["b"]] and why == "prefix match (2 blocks)"
    assert policy.choose(other, {"a": 0, "b": 0, "c": 1}, 8)[0] == [["a", "c"], ["b"]]


def test_users_behind_one_system_prompt_spread_over_equally_loaded_replicas():
    policy = PrefixAffinity()
    system = list(range(1000, 1000 + 160))              # 10 blocks every user's prompt starts with
    policy.record(prefix_keys(system, 16), "a")         # both replicas hold the system prompt
    policy.record(prefix_keys(system, 16), "b")
    firsts = {"a": 0, "b": 0}
    for user in range(200):
        keys = prefix_keys(system + [user % 97, user // 97] * 24, 16)
        ranks, why = policy.choose(keys, {"a": 0, "b": 0}, saturated_at=8)
        assert why == "prefix match (10 blocks)" and sorted(ranks[0]) == ["a", "b"]
        firsts[ranks[0][0]] += 1
        assert policy.choose(keys, {"a": 0, "b": 0}, 8)[0][0][0] == ranks[0][0]     # the same prompt, the same one
    assert 70 <= firsts["a"] <= 130, firsts             # binomial(200, 1/2): outside this once in ~10^4


def test_new_users_behind_a_system_prompt_one_replica_took_spread_evenly_and_stay():
    """Only the replica that took the first user holds the system prompt: following it would send every new user
    there. A held prefix under half of the prompt is not followed; the new user goes to the replica given the least."""
    policy = PrefixAffinity()
    system = list(range(1000, 1000 + 160))              # 10 blocks every user's prompt starts with
    prompts = [system + [user, 7] * 88 for user in range(40)]     # and 11 of the user's own: a match under 1/2
    owner = {}
    for user, prompt in enumerate(prompts):
        ranks, why = policy.choose(prefix_keys(prompt, 16), {"a": 0, "b": 0}, saturated_at=8)
        assert why == ("no prefix match: least cached" if user == 0 else
                       "prefix match too short (10 of 21 blocks): least cached")
        owner[user] = ranks[0][0]
        policy.record(prefix_keys(prompt, 16), owner[user])
        assert abs(policy.sizes["a"] - policy.sizes["b"]) <= 21, policy.sizes   # at most one user's blocks
    assert sorted(owner.values()).count("a") == 20      # exactly half each
    for user, prompt in enumerate(prompts):             # each user's next turn goes where its history is
        keys = prefix_keys(prompt + [3] * 48, 16)
        ranks, why = policy.choose(keys, {"a": 0, "b": 0}, saturated_at=8)
        assert ranks[0] == [owner[user]] and why == "prefix match (21 blocks)"


def test_a_match_of_min_match_is_followed_and_a_shorter_one_is_not():
    policy = PrefixAffinity(min_match=0.75)
    keys = list(range(8))
    policy.record(keys[:6], "b")                        # b took 6 of the 8 blocks: 0.75
    policy.record(list(range(100, 120)), "a")           # a was given more
    assert policy.choose(keys, {"a": 0, "b": 0}, 8) == ([["b"], ["a"]], "prefix match (6 blocks)")
    policy.record(keys[:5] + [99], "b")                 # a sibling prompt: b still holds the first 5 and 6
    assert policy.choose(keys[:5] + [50, 51, 52], {"a": 0, "b": 0}, 8) == \
        ([["b", "a"]], "prefix match too short (5 of 8 blocks): least cached")
    assert policy.sizes == {"a": 20, "b": 7}
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


@settings(max_examples=400, deadline=None)
@given(history=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=4), st.sampled_from(REPLICAS)), max_size=12),
       keys=st.lists(st.integers(0, 5), max_size=5),
       loads=st.dictionaries(st.sampled_from(REPLICAS), st.one_of(st.none(), st.integers(0, 6)), min_size=1),
       saturated_at=st.integers(1, 6), max_imbalance=st.integers(1, 7), capacity=st.integers(1, 30))
def test_choice_properties(history, keys, loads, saturated_at, max_imbalance, capacity):
    policy = PrefixAffinity(capacity)
    for ks, replica in history:
        policy.record(ks, replica)
    # each replica's size is the number of keys the (bounded) map still has it hold
    assert policy.sizes == Counter(r for held in policy.holders.values() for r in held)
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
    if depth and depth >= policy.min_match * len(keys):
        if best < saturated_at and best - least < max_imbalance:
            # a least-loaded holder of the deepest prefix, when it has room and is not far busier than the least loaded
            assert first in deepest and load[first] == best and why.startswith("prefix match (")
            assert set(ranks[0]) == set(deepest)
        else:                                           # else a least-loaded replica
            assert load[first] == least
    else:                                               # a new prompt: the least cached of those with room
        near = [r for r in loads if load[r] < saturated_at and load[r] - least < max_imbalance]
        assert why.endswith("least cached")
        if near:
            assert first in near and policy.sizes[first] == min(policy.sizes[r] for r in near)
        else:
            assert load[first] == least
    policy.record(keys, first)
    if keys and load[first] < saturated_at and load[first] - least < max_imbalance:   # the same prompt again
        assert first in policy.choose(keys, loads, saturated_at, max_imbalance)[0][0]   # may go where this went
