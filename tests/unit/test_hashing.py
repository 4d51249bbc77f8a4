"""The native chained block hash matches its pure-Python specification."""

import numpy as np
import pytest

from runtime import _native
from runtime.kv import hashing


@pytest.mark.parametrize("n,block", [(0, 4), (3, 4), (4, 4), (67, 16), (1000, 32)])
def test_native_matches_python(n, block):
    tokens = np.random.default_rng(n).integers(0, 200_000, size=n)
    want = hashing.hash_blocks_py(tokens.tolist(), block)
    assert _native.hash_blocks(tokens, block, 0).tolist() == want
    assert hashing.hash_blocks(tokens, block) == want
    assert len(want) == n // block


def test_chain_depends_on_whole_prefix():
    a = hashing.hash_blocks(list(range(32)), 8)
    b = hashing.hash_blocks([99] + list(range(1, 32)), 8)
    assert all(x != y for x, y in zip(a, b)), "changing the first token must change every later key"
    c = hashing.hash_blocks(list(range(32)) + [7, 7, 7], 8)
    assert c == a, "a trailing partial block has no key and does not change earlier keys"


def test_parent_and_single_block():
    key = hashing.hash_blocks(list(range(16)), 8)
    assert _native.hash_block(key[0], np.arange(8, 16)) == key[1]
    assert hashing.hash_block_py(key[0], list(range(8, 16))) == key[1]


def test_native_rejects_bad_arguments():
    with pytest.raises(ValueError):
        _native.hash_blocks(np.zeros((2, 2), np.int64), 4, 0)
    with pytest.raises(ValueError):
        _native.hash_blocks(np.zeros(8, np.int64), 0, 0)
