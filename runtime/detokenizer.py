"""Incremental detokenization: text deltas that never split a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix yields
U+FFFD. We decode a small window of recent tokens and hold the delta back until it no longer ends in
U+FFFD, so streamed text concatenates to exactly the full decode.
"""

from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special: bool = True):
        self.tok, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = list(prompt_ids or [])
        # Decode from a few tokens back so leading-space handling matches a full decode.
        self.prefix_offset = max(0, len(self.ids) - 5)
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of generation (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopStringFilter:
    """Holds back streamed text that might be the start of a stop string, and cuts at the first match.

    Text is released only when no stop string can still match across it, so a stop string split over
    several tokens is never streamed, and the output ends right before it.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held = stops, ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return delta, False
        text = self.held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[:min(hits)], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text
