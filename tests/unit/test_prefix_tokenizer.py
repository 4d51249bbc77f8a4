"""PrefixTokenizer against the tokenizer's own encoding of the whole text: equal ids for every prompt, whether it
extends a remembered one or not (Hypothesis: texts rich in what the ByteLevel regex splits on — whitespace runs,
newlines, digits, contractions, punctuation, non-ASCII letters — cut anywhere, over several turns)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers

from runtime.prefix_tokenizer import PrefixTokenizer, splits_exactly

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "target" / "tokenizer.json"
CODE = (ROOT / "runtime" / "scheduler.py").read_text()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED))


def test_the_bundled_tokenizer_splits_exactly(tokenizer):
    assert splits_exactly(tokenizer)


PIECES = st.sampled_from([" ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "a", "ab", "Hello", " world", "'s",
                          "'t", "'ll", "don't", "1", "12", "123456", " 42", ".", ",", "!?", "()", "->", "==", "#",
                          '"""', "é", "ünïcode", "日本語", "🙂", "_x", "x_1", "    return"])
TEXT = st.lists(PIECES, min_size=1, max_size=60).map("".join)


@settings(max_examples=300, deadline=None)
@given(turns=st.lists(TEXT, min_size=1, max_size=5))
def test_every_turn_equals_the_whole_texts_encoding(tokenizer, turns):
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    history = ""
    for turn in turns:
        history += turn
        assert pt.encode(history) == tokenizer.encode(history).ids


@settings(max_examples=100, deadline=None)
@given(start=st.integers(0, len(CODE) - 3000), cuts=st.lists(st.integers(1, 400), min_size=2, max_size=6))
def test_a_chat_over_code_equals_the_whole_texts_encoding(tokenizer, start, cuts):
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    end = start
    for n in cuts:
        end += n
        text = CODE[start:end]
        assert pt.encode(text) == tokenizer.encode(text).ids


def test_a_follow_up_tokenizes_only_its_tail(tokenizer):
    pt = PrefixTokenizer(tokenizer)
    history = CODE[:4000]
    assert pt.encode(history) == tokenizer.encode(history).ids
    (prompt, (cut, head)), = pt._recent.items()
    assert prompt == history and len(history) - 64 < cut <= len(history) - 16 and len(head) > 900
    follow_up = history + "\n# user 3, question 1: what does this do?\n" + CODE[5000:5090]
    assert pt.encode(follow_up) == tokenizer.encode(follow_up).ids
    assert list(pt._recent) == [follow_up]           # the prompt it extended is superseded


def test_distinct_users_behind_one_system_prompt_keep_their_own_histories(tokenizer):
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    system = CODE[:1600]
    users = {u: system + f"\n# user {u}\n" + CODE[2000 + 300 * u:2300 + 300 * u] for u in range(5)}
    for turn in range(3):
        for u in users:
            users[u] += f"\n# turn {turn} of user {u}: why?\n" + CODE[4000 + 50 * u + 10 * turn:4040 + 50 * u]
            assert pt.encode(users[u]) == tokenizer.encode(users[u]).ids
    assert set(pt._recent) == set(users.values())


def test_an_added_token_in_the_text_takes_the_whole_encoding(tokenizer):
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    first = CODE[:600]
    pt.encode(first)
    text = first + "<|endoftext|>" + CODE[600:700]
    assert pt.encode(text) == tokenizer.encode(text).ids


def test_a_tokenizer_the_argument_does_not_cover_is_not_split(tokenizer):
    other = Tokenizer.from_str(tokenizer.to_str())
    other.normalizer = normalizers.Lowercase()
    pt = PrefixTokenizer(other, min_chars=0)
    assert not pt.exact
    for text in (CODE[:500], CODE[:900]):
        assert pt.encode(text) == other.encode(text).ids
    assert not pt._recent


def test_memory_is_bounded(tokenizer):
    pt = PrefixTokenizer(tokenizer, capacity=3, min_chars=0)
    for u in range(6):
        pt.encode(f"user {u}: " + CODE[100 * u:100 * u + 400])
    assert len(pt._recent) == 3
