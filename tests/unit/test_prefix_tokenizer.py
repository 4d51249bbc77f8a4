"""PrefixTokenizer against the tokenizer's own encoding of the whole text: equal ids for every prompt, whether it
extends a remembered one or not (Hypothesis: texts rich in what the split regexes split on — whitespace runs,
newlines, digits, contractions, punctuation, non-ASCII letters, combining marks NFC composes and reorders — cut
anywhere, over several turns), for the bundled tokenizer and for tokenizers built here the way Llama-3's, Qwen2's
and SmolLM's are (their pre-tokenizer, normalizer and post-processor; BPE trained on our code)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from runtime.prefix_tokenizer import CHECKPOINT_CHARS, SPLIT_REGEXES, PrefixTokenizer, splits_exactly

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "target" / "tokenizer.json"
CODE = (ROOT / "runtime" / "scheduler.py").read_text()


BOS = "<|begin_of_text|>"


def trained(pre_tokenizer, normalizer=None, post_processor=None) -> Tokenizer:
    """A byte-level BPE tokenizer with these parts, trained on our code (and the unicode the tests use)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False, special_tokens=["<|endoftext|>", BOS, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CODE, "ünïcode 日本語 é 🙂 " * 20], trainer)
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


def split_then_bytes(name: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT_REGEXES[name]), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build(kind: str) -> Tokenizer:
    if kind == "bundled":
        return Tokenizer.from_file(str(BUNDLED))
    if kind == "llama3":        # Split on its regex, bytes, <|begin_of_text|> put before every text
        return trained(split_then_bytes("llama3"), post_processor=processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])]))
    if kind == "qwen2":         # NFC, Split on its regex (single digits), bytes
        return trained(split_then_bytes("qwen2"), normalizers.NFC(), processors.ByteLevel(trim_offsets=False))
    if kind == "smollm":        # each digit its own pre-token, then GPT-2's regex
        return trained(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)]))
    raise ValueError(kind)


@pytest.fixture(scope="module", params=["bundled", "llama3", "qwen2", "smollm"])
def tokenizer(request) -> Tokenizer:
    return build(request.param)


def test_these_tokenizers_split_exactly(tokenizer):
    assert splits_exactly(tokenizer)


def test_a_template_s_special_tokens_come_once(tokenizer):
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    first = CODE[:700]
    second = first + "\n# and then?\n" + CODE[900:1000]
    assert pt.encode(first) == tokenizer.encode(first).ids
    assert pt._recent[first][0] > 0                            # the follow-up is tokenized from a cut
    assert pt.encode(second) == tokenizer.encode(second).ids


PIECES = st.sampled_from([" ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "a", "ab", "Hello", " world", "'s",
                          "'t", "'ll", "don't", "1", "12", "123456", " 42", ".", ",", "!?", "()", "->", "==", "#",
                          '"""', "é", "ünïcode", "日本語", "🙂", "_x", "x_1", "    return",
                          "e\u0301", "\u0301", "\u0316", "\u0316\u0301", "=\u0338", "\u1100\u1161", "\u212b",
                          "<|endoftext|>", "<|endof", "text|>", "<|im_start|>", "<|im_end|>", "<|im_", "user\n",
                          "<|begin_of", "_text|>", "<|begin_of_text", "|>"])
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


def test_max_chars_declines_what_would_tokenize_more(tokenizer):
    """A server tokenizes on its event loop only what encode(text, max_chars) takes: a chat's next turn past its cut,
    a short prompt; longer work is declined (None), and what is taken equals the tokenizer's own ids."""
    pt = PrefixTokenizer(tokenizer)
    history = CODE[:3000]
    assert pt.encode(history, max_chars=512) is None and pt._recent == {}          # nothing done, nothing kept
    assert pt.encode(history) == tokenizer.encode(history).ids
    turn = history + "\n# and then?\n" + CODE[3100:3300]
    assert len(turn) - pt._recent[history][0] < 512
    assert pt.encode(turn, max_chars=512) == tokenizer.encode(turn).ids
    long_turn = turn + CODE[4000:4600]
    assert pt.encode(long_turn, max_chars=512) is None
    assert pt.encode(long_turn) == tokenizer.encode(long_turn).ids
    short = CODE[:100]
    assert pt.encode(short, max_chars=512) == tokenizer.encode(short).ids and pt.encode(short, max_chars=50) is None


def test_a_follow_up_tokenizes_only_its_tail(tokenizer):
    pt = PrefixTokenizer(tokenizer)
    history = CODE[:4000]
    assert pt.encode(history) == tokenizer.encode(history).ids
    (prompt, (cut, head, _, _)), = pt._recent.items()
    whole = tokenizer.encode(history).ids
    assert prompt == history and len(history) - 64 < cut <= len(history) - pt.margin and len(head) > 0.95 * len(whole)
    follow_up = history + "\n# user 3, question 1: what does this do?\n" + CODE[5000:5090]
    assert pt.encode(follow_up) == tokenizer.encode(follow_up).ids
    assert list(pt._recent) == [follow_up]           # the prompt it extended is superseded


@settings(max_examples=300, deadline=None)
@given(start=st.lists(PIECES, min_size=20, max_size=120).map("".join), ends=st.lists(TEXT, min_size=2, max_size=4),
       step=st.sampled_from([1, 5, 40]))
def test_texts_that_share_a_beginning_equal_the_whole_texts_encoding(tokenizer, start, ends, step):
    """One beginning, different ends (cut anywhere, at whitespace runs, inside an added token's spelling): each
    cut at a mark of an earlier one, marks every `step` characters."""
    pt = PrefixTokenizer(tokenizer, min_chars=0, checkpoint_chars=step)
    for end in ends:
        assert pt.encode(start + end) == tokenizer.encode(start + end).ids


def test_questions_behind_one_long_document_tokenize_from_where_they_part(tokenizer):
    """A RAG server's traffic: one long document, then a different question each time. The second question is
    tokenized from a mark within CHECKPOINT_CHARS (+ a pre-token) of where it parts from the first."""
    pt = PrefixTokenizer(tokenizer)
    document = "<|im_start|>system\n" + CODE[:6000] + "\n# question: "
    first, second = document + "what does admit do?\n", document + "why a budget?\n"
    assert pt.encode(first) == tokenizer.encode(first).ids
    cut, head, marks, counts = pt._recent[first]
    assert len(marks) > 6000 / CHECKPOINT_CHARS / 2 and list(marks) == sorted(set(marks))
    whole = tokenizer.encode(first).ids
    for at, n in zip(marks, counts):          # each mark is a cut of the first text: its ids before it are those
        assert list(head[:n]) + tokenizer.encode(first[at:], add_special_tokens=False).ids == whole
    near = len(second) - len(document) + CHECKPOINT_CHARS + 64      # characters it may tokenize, at most
    assert pt.encode(second, max_chars=near) == tokenizer.encode(second).ids
    assert set(pt._recent) == {first, second}          # both kept: the next question may share either


def test_distinct_users_behind_one_system_prompt_keep_their_own_histories(tokenizer):
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    system = CODE[:1600]
    users = {u: system + f"\n# user {u}\n" + CODE[2000 + 300 * u:2300 + 300 * u] for u in range(5)}
    for turn in range(3):
        for u in users:
            users[u] += f"\n# turn {turn} of user {u}: why?\n" + CODE[4000 + 50 * u + 10 * turn:4040 + 50 * u]
            assert pt.encode(users[u]) == tokenizer.encode(users[u]).ids
    assert set(pt._recent) == set(users.values())


def test_a_chat_template_s_added_tokens_are_boundaries(tokenizer):
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    history = "<|im_start|>system\n" + CODE[:1200] + "<|im_end|>\n"
    for turn in range(4):
        history += f"<|im_start|>user\nturn {turn}: " + CODE[2000 + 97 * turn:2090 + 97 * turn] + "<|im_end|>\n"
        prompt = history + "<|im_start|>assistant\n"
        assert pt.encode(prompt) == tokenizer.encode(prompt).ids
        assert pt._recent[prompt][0] > len(prompt) - 120              # tokenized from near its end next turn
        history = prompt + CODE[3000 + 50 * turn:3060 + 50 * turn] + "<|im_end|>\n"


def test_a_stripping_token_that_only_nfc_spells_takes_the_whole_encoding():
    """U+212B (ANGSTROM SIGN) is Å after NFC, where an added token that eats the whitespace before it matches."""
    tok = build("qwen2")
    tok.add_tokens([AddedToken("\u00c5", lstrip=True, normalized=True)])
    pt = PrefixTokenizer(tok, min_chars=0)
    first = "x.\n\n" + " " * 19 + "\n "
    assert pt.encode(first) == tok.encode(first).ids
    second = first + "\u212b"
    assert pt.encode(second) == tok.encode(second).ids


def test_an_added_token_completed_by_the_next_turn(tokenizer):
    """A turn ends in the first 15 characters of <|begin_of_text|> (an added token of the tokenizers trained here)
    and the next completes it: the spaces before it, split from it as text, are one pre-token before it as a
    token — so the cut keeps more characters after it than the token has."""
    pt = PrefixTokenizer(tokenizer, min_chars=0)
    first = CODE[:300] + "x  <|begin_of_text"
    second = first + "|>" + CODE[300:400]
    assert pt.encode(first) == tokenizer.encode(first).ids
    assert pt.encode(second) == tokenizer.encode(second).ids


def test_an_added_token_that_strips_whitespace_takes_the_whole_encoding(tokenizer):
    stripping = Tokenizer.from_str(tokenizer.to_str())
    stripping.add_special_tokens([AddedToken("<|sep|>", lstrip=True, rstrip=True)])
    pt = PrefixTokenizer(stripping, min_chars=0)
    first = CODE[:600]
    assert pt.encode(first) == stripping.encode(first).ids
    text = first + "  <|sep|>  " + CODE[600:700]
    assert pt.encode(text) == stripping.encode(text).ids
    assert list(pt._recent) == [first]                                 # not tokenized in pieces, not remembered


def outside_the_argument() -> dict[str, Tokenizer]:
    bundled = build("bundled")
    lowercase = Tokenizer.from_str(bundled.to_str())
    lowercase.normalizer = normalizers.Lowercase()
    prefix_space = Tokenizer.from_str(bundled.to_str())
    prefix_space.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    other_regex = Tokenizer.from_str(bundled.to_str())
    other_regex.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s*\S+"), "isolated"),
                                                         pre_tokenizers.ByteLevel(use_regex=False)])
    suffix = Tokenizer.from_str(bundled.to_str())
    suffix.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                          special_tokens=[("<|endoftext|>", 0)])
    trimmed = Tokenizer.from_str(bundled.to_str())
    trimmed.post_processor = processors.ByteLevel(trim_offsets=True)
    truncating = Tokenizer.from_str(bundled.to_str())
    truncating.enable_truncation(max_length=100)
    return {"lowercase": lowercase, "prefix space": prefix_space, "another regex": other_regex,
            "a special token after the text": suffix, "offsets trimmed": trimmed, "truncation": truncating}


@pytest.mark.parametrize("why", list(outside_the_argument()))
def test_a_tokenizer_the_argument_does_not_cover_is_not_split(why):
    other = outside_the_argument()[why]
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
