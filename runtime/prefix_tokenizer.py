"""PrefixTokenizer: a prompt that extends a recent one (a chat's next turn: the whole history plus a new message) is
tokenized from near the end of the earlier prompt instead of from its start.

Why: a byte-level BPE tokenizer spends its time in the pre-tokenizer's regex (the bundled tokenizer, 1,183 tokens
of code: 1.65 of its 1.8 ms), and a chat pays it again for the whole history at every turn, before the first token.

Exact, not approximate: BPE merges never cross a pre-token, and the split regexes below split left to right, each
match settled by at most two characters past it (`\\s+(?!\\S)` reads the character after a whitespace run and gives
one back) or, for `\\s*[\\r\\n]+`, by the end of the whitespace run it starts in — characters an earlier prompt
already has, unless the run reaches its end, and such a run is at most its last two pre-tokens. So the pre-tokens
of an earlier prompt that are followed in it by at least two more pre-tokens and MARGIN characters are pre-tokens
of any text that extends it, with the same ids. Those ids are kept and only the rest is tokenized.

A prompt that shares only a beginning with a recent one (one system prompt, or one document, then different
questions) is cut at a remembered pre-token start that lies in the shared beginning, MARGIN characters before its
end and at a printable ASCII character other than a space (every regex agrees it is not whitespace, so any
whitespace run before it ended there): each pre-token before the cut is settled by characters the two texts share.
Such cuts are remembered every CHECKPOINT_CHARS characters or so.

Used only where that argument holds, and otherwise (or when no recent prompt begins the text) the tokenizer's own
encoding is returned: BPE without dropout, no truncation or padding; a pre-tokenizer that is GPT-2's ByteLevel regex
(optionally after Digits), or a Split on Llama-3's or Qwen2's regex followed by ByteLevel's byte mapping, never
adding a prefix space; no normalizer, or NFC (a cut then lies before `margin` ASCII characters, which NFC never
composes or reorders across); no post-processor, or ones that leave ids and offsets alone (ByteLevel, untrimmed) or
only put special tokens before the text (Llama-3's <|begin_of_text|>: kept with the head). Added tokens (a chat
template's <|im_start|>) are matched before pre-tokenization and split the text into pieces tokenized on their own,
so one is a boundary like any pre-token's — as long as none strips the whitespace around it or needs a whole word
(lstrip, rstrip, single_word; else a text holding one, or under NFC whose normal form holds one, gets the
tokenizer's own encoding) and the cut keeps more characters after it than the longest added token has (a token that
begins before the earlier prompt's end and ends after it then begins after the cut).
"""

from __future__ import annotations

import json
import threading
import unicodedata
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from operator import itemgetter

from tokenizers import Tokenizer

MARGIN = 16       # characters an earlier prompt keeps after its cut at least (the regexes read two past a match)
CHECKPOINT_CHARS = 256   # a prompt sharing a beginning with a recent one tokenizes about this much of it again, at most
SPLIT_REGEXES = {  # Split patterns the argument above was checked for (and the tests exercise)
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _byte_level(step: dict, regex: bool) -> bool:
    return (step.get("type") == "ByteLevel" and step.get("use_regex", True) == regex
            and not step.get("add_prefix_space", False))


def _pre_tokenizer_splits_exactly(pre: dict) -> bool:
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1:                                              # GPT-2's
        return _byte_level(steps[0], regex=True)
    if len(steps) == 2 and steps[0].get("type") == "Digits":         # SmolLM's, StarCoder's
        return _byte_level(steps[1], regex=True)
    if len(steps) == 2 and steps[0].get("type") == "Split":          # Llama-3's, Qwen2's
        split = steps[0]
        return (split.get("pattern", {}).get("Regex") in SPLIT_REGEXES.values()
                and split.get("behavior") == "Isolated" and not split.get("invert")
                and _byte_level(steps[1], regex=False))
    return False


def _post_processor_keeps_ids(post: dict | None) -> bool:
    """None, ByteLevel without trimming (a trimmed token's offsets start after its space: no place to cut), or a
    template that puts special tokens before the text and nothing after."""
    if post is None:
        return True
    if post.get("type") == "ByteLevel":
        return not post.get("trim_offsets", True)
    if post.get("type") == "Sequence":
        return all(_post_processor_keeps_ids(p) for p in post.get("processors", []))
    if post.get("type") == "TemplateProcessing":
        single = post.get("single", [])
        return bool(single) and "Sequence" in single[-1] and all("SpecialToken" in piece for piece in single[:-1])
    return False


def splits_exactly(tokenizer: Tokenizer) -> bool:
    """Whether the ids of a + b are those of a before a cut followed by those of a[cut:] + b (without a template's
    special tokens, which the ids before the cut have) for this tokenizer (see the module doc)."""
    return _spec_splits_exactly(json.loads(tokenizer.to_str()))


def _spec_splits_exactly(spec: dict) -> bool:
    model = spec.get("model") or {}
    return spec.get("truncation") is None and spec.get("padding") is None \
        and (spec.get("normalizer") is None or spec["normalizer"].get("type") == "NFC") \
        and _pre_tokenizer_splits_exactly(spec.get("pre_tokenizer") or {}) \
        and _post_processor_keeps_ids(spec.get("post_processor")) \
        and model.get("type") == "BPE" and not model.get("dropout")


class PrefixTokenizer:
    """`encode(text)`: the tokenizer's ids for `text`, reusing a recent prompt's that `text` extends or shares a
    beginning with. Thread-safe (the servers tokenize in worker threads); remembers `capacity` recent prompts of
    at least `min_chars`, each as (cut, its ids before the cut, marks about every `checkpoint_chars` characters, the
    number of those ids before each mark): the cut holds for a text that extends the prompt, a mark for one that
    shares the prompt up to `margin` characters past it."""

    def __init__(self, tokenizer: Tokenizer, capacity: int = 256, min_chars: int = 256,
                 checkpoint_chars: int = CHECKPOINT_CHARS):
        self.tokenizer, self.capacity, self.min_chars = tokenizer, capacity, min_chars
        self.checkpoint_chars = checkpoint_chars
        spec = json.loads(tokenizer.to_str())        # (a 150K-token vocabulary's is megabytes: read once)
        self.exact, self.ascii_cuts = _spec_splits_exactly(spec), spec.get("normalizer") is not None
        added = list(tokenizer.get_added_tokens_decoder().values())
        # added tokens a text we split may hold: all, unless one strips whitespace or needs a whole word
        strips = any(t.lstrip or t.rstrip or t.single_word for t in added)
        self.unsplittable = [t.content for t in added] if strips else []
        self.margin = max([MARGIN] + [len(t.content) + 2 for t in added])
        self._recent: OrderedDict[str, tuple[int, array, array, array]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str, max_chars: int | None = None) -> list[int] | None:
        """The ids of `text`; with `max_chars`, None instead when more than that many characters would be
        tokenized (a server tokenizes a chat's next turn on its event loop and anything longer in a thread)."""
        whole = not self.exact or len(text) < self.min_chars or self._holds_unsplittable(text)
        earlier, cut, head, marks = (None, 0, array("i"), ([], [])) if whole else self._longest_earlier(text)
        if max_chars is not None and len(text) - cut > max_chars:
            return None
        if whole:
            return self.tokenizer.encode_batch([text])[0].ids      # (encode_batch releases the GIL while it works)
        # a template's special tokens (all before the text) are in the head once there is one
        tail = self.tokenizer.encode_batch([text[cut:]], add_special_tokens=not head)[0]
        ids = head.tolist() + tail.ids
        self._remember(text, earlier, cut, head, marks, tail)
        return ids

    def _holds_unsplittable(self, text: str) -> bool:
        """An added token that strips whitespace (or needs a whole word) in the text — or in its NFC form, where
        such a token may appear (U+212B ANGSTROM SIGN becomes Å)."""
        if not self.unsplittable:
            return False
        forms = (text, unicodedata.normalize("NFC", text)) if self.ascii_cuts else (text,)
        return any(a in form for form in forms for a in self.unsplittable)

    def _longest_earlier(self, text: str) -> tuple[str | None, int, array, tuple[list, list]]:
        """(the prompt `text` extends, or None where it only shares a beginning), the latest cut that holds for
        `text`, the ids before it, and the marks before it with their counts (which hold for `text` too)."""
        with self._lock:
            found = None, 0, array("i"), ([], [])
            for prompt in reversed(self._recent):          # the latest first: what a server most likely sees next
                best = found[1]
                if len(prompt) <= best or not text.startswith(prompt[:best + 1]):
                    continue                               # it cannot give a later cut
                shared = _shared_length(text, prompt, best + 1)
                cut, head, marks, counts = self._recent[prompt]
                if shared == len(prompt) and cut > best:   # `text` extends it
                    found = prompt, cut, head, (marks, counts)
                    continue
                i = bisect_right(marks, shared - self.margin) - 1
                if i >= 0 and marks[i] > best:
                    found = None, marks[i], head[:counts[i]], (marks[:i + 1], counts[:i + 1])
            return found

    def _remember(self, text: str, earlier: str | None, cut: int, head: array, marks: tuple[list, list],
                  tail) -> None:
        """Store `text` with a cut before its last pre-tokens: the latest start of a pre-token (word_ids index them;
        a template's special tokens have none) followed by at least one more and `margin` characters (ASCII ones
        under NFC). A tail too short to move it keeps the earlier cut, which holds for `text` as it held for the
        prompt `text` extends. Marks: the earlier ones, and one every `checkpoint_chars` characters of the tail."""
        words, offsets = tail.word_ids, tail.offsets          # offsets: characters of text[cut:]
        last = len(text) - self.margin - cut

        def starts_a_cut(i: int) -> bool:
            at = offsets[i][0]
            return (words[i] is not None and words[i] != words[i - 1] and words[i] < words[-1] and at <= last
                    and self._ascii_after(text, cut + at))

        ends_in_text = bool(words) and words[-1] is not None     # (a template's specials all come first)
        keep = next((i for i in range(len(words) - 1, 0, -1) if starts_a_cut(i)), 0) if ends_in_text else 0
        new_cut, new_head = (cut + offsets[keep][0], head + array("i", tail.ids[:keep])) if keep else (cut, head)
        marks = self._marks(text, cut, len(head), words, offsets, keep, marks)
        with self._lock:
            if earlier is not None:
                self._recent.pop(earlier, None)     # superseded: what extends it most likely extends `text`
            self._recent[text] = (new_cut, new_head, *marks)
            self._recent.move_to_end(text)
            while len(self._recent) > self.capacity:
                self._recent.popitem(last=False)

    def _marks(self, text: str, cut: int, before: int, words, offsets, keep: int,
               marks: tuple[list, list]) -> tuple[array, array]:
        """`marks` and, every `checkpoint_chars` characters of text[cut:] up to token `keep`, the first pre-token
        start after that point at a printable ASCII character other than a space (with `margin` ASCII characters
        under NFC), with the number of ids before it (`before` of them are before `cut`)."""
        chars, counts = array("i", marks[0]), array("i", marks[1])

        def is_mark(i: int) -> bool:
            at = cut + offsets[i][0]
            return words[i] is not None and words[i] != words[i - 1] and "!" <= text[at] <= "~" \
                and self._ascii_after(text, at)

        i, step = 0, self.checkpoint_chars
        for point in range(step, offsets[keep][0] if keep else 0, step):
            i = bisect_left(offsets, point, lo=i, hi=keep, key=itemgetter(0))
            while i < keep and not is_mark(i):
                i += 1
            if i < keep and (not chars or cut + offsets[i][0] > chars[-1]):
                chars.append(cut + offsets[i][0])
                counts.append(before + i)
        return chars, counts

    def _ascii_after(self, text: str, at: int) -> bool:
        """Under NFC, a cut at `at` needs `margin` ASCII characters after it (see the module doc)."""
        return not self.ascii_cuts or text[at:at + self.margin].isascii()


def _shared_length(text: str, prompt: str, known: int) -> int:
    """How many first characters `text` and `prompt` share, given that they share `known`."""
    lo, hi = known, min(len(text), len(prompt))
    if text.startswith(prompt[:hi]):
        return hi
    hi -= 1                                   # they share lo characters and not hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(prompt[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo
