"""PrefixTokenizer: a prompt that extends a recent one (a chat's next turn: the whole history plus a new message) is
tokenized from near the end of the earlier prompt instead of from its start.

Why: a byte-level BPE tokenizer spends its time in the pre-tokenizer's regex (the bundled tokenizer, 1,183 tokens
of code: 1.65 of its 1.8 ms), and a chat pays it again for the whole history at every turn, before the first token.

Exact, not approximate: BPE merges never cross a pre-token, and the ByteLevel regex splits left to right looking at
most two characters past a match (`\\s+(?!\\S)` reads the character after a whitespace run and gives one back), so
the pre-tokens of an earlier prompt that are followed in it by at least two more pre-tokens and MARGIN characters
are pre-tokens of any text that extends it, with the same ids. Those ids are kept and only the rest is tokenized.
Used only where that argument holds — no normalizer, no post-processor, a ByteLevel pre-tokenizer with its regex,
BPE without dropout, no added token in the text — and otherwise, or when no recent prompt begins the text, the
tokenizer's own encoding is returned.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer

MARGIN = 16       # characters an earlier prompt keeps after its cut (the regex reads at most two past a match)


def splits_exactly(tokenizer: Tokenizer) -> bool:
    """Whether tokens(a + b) = tokens(a)[:i] + tokens(a[cut:] + b) holds for this tokenizer (see the module doc)."""
    spec = json.loads(tokenizer.to_str())
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    return (spec.get("normalizer") is None and spec.get("post_processor") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and model.get("type") == "BPE" and not model.get("dropout"))


class PrefixTokenizer:
    """`encode(text)`: the tokenizer's ids for `text`, reusing a recent prompt's that `text` extends. Thread-safe
    (the servers tokenize in worker threads); remembers `capacity` recent prompts of at least `min_chars`."""

    def __init__(self, tokenizer: Tokenizer, capacity: int = 256, min_chars: int = 256):
        self.tokenizer, self.capacity, self.min_chars = tokenizer, capacity, min_chars
        self.exact = splits_exactly(tokenizer)
        self.added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        self._recent: OrderedDict[str, tuple[int, array]] = OrderedDict()   # prompt → (cut, its ids before cut)
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        if not self.exact or len(text) < self.min_chars or any(a in text for a in self.added):
            return self.tokenizer.encode_batch([text])[0].ids      # (encode_batch releases the GIL while it works)
        earlier, cut, head = self._longest_earlier(text)
        tail = self.tokenizer.encode_batch([text[cut:]])[0]
        ids = head.tolist() + tail.ids
        self._remember(text, earlier, cut, head, tail)
        return ids

    def _longest_earlier(self, text: str) -> tuple[str | None, int, array]:
        with self._lock:
            best = None
            for prompt in self._recent:
                if (best is None or len(prompt) > len(best)) and text.startswith(prompt):
                    best = prompt
            if best is None:
                return None, 0, array("i")
            cut, head = self._recent[best]
            return best, cut, head

    def _remember(self, text: str, earlier: str | None, cut: int, head: array, tail) -> None:
        """Store `text` with a cut before its last pre-tokens: the latest start of a pre-token (word_ids index them)
        followed by at least one more and MARGIN characters. A tail too short to move it keeps the earlier cut,
        which holds for `text` as it held for the prompt `text` extends."""
        words, offsets = tail.word_ids, tail.offsets          # offsets: characters of text[cut:]
        last = len(text) - MARGIN - cut                        # (no added token here: every word id is set)
        keep = next((i for i in range(len(words) - 1, 0, -1)
                     if words[i] != words[i - 1] and words[i] < words[-1] and offsets[i][0] <= last), 0)
        new_cut, new_head = (cut + offsets[keep][0], head + array("i", tail.ids[:keep])) if keep else (cut, head)
        with self._lock:
            if earlier is not None:
                self._recent.pop(earlier, None)     # superseded: what extends it most likely extends `text`
            self._recent[text] = (new_cut, new_head)
            self._recent.move_to_end(text)
            while len(self._recent) > self.capacity:
                self._recent.popitem(last=False)
