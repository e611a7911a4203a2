"""The raw bytes behind each token id, for logprobs (OpenAI reports every token as text plus its UTF-8
bytes)."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """Token id -> bytes for a Hugging Face tokenizer (byte-level BPE, SentencePiece byte fallback, or
    other)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        """The bytes token_id stands for (special tokens: their text)."""
        found = self.cache.get(token_id)
        if found is None:
            found = self.cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        table = byte_decoder()
        if self.byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        hex_byte = HEX_BYTE.match(piece)
        if hex_byte:
            return bytes([int(hex_byte.group(1), 16)])
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id]).encode()

    def many(self, token_ids: Any) -> dict[int, bytes]:
        """Bytes of each distinct id in token_ids."""
        return {int(t): self(int(t)) for t in set(token_ids)}

