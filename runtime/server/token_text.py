"""Token ids → the text and UTF-8 bytes that OpenAI's logprobs show for a token (its text, not its id)."""

from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Tokenizer, decoders


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte inside a token's string."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


_ALPHABET = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")      # SentencePiece byte fallback


class TokenText:
    """Per-token bytes, exact even for a token that holds part of a multi-byte character (whose text then shows
    U+FFFD, while `bytes` lets a client rebuild the character, as OpenAI's `bytes` field intends)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_token(token_id)
        if piece is None:                      # an id the model has but the tokenizer does not: no text
            return b""
        if self.byte_level:
            return b"".join(bytes([_ALPHABET[c]]) if c in _ALPHABET else c.encode() for c in piece)
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()     # SentencePiece marks a leading space with ▁

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")
