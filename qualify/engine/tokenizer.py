"""Byte-level tokenizer: ids 0-255 are bytes, then a few specials; no vocabulary file, no download."""

from __future__ import annotations

BOS, EOS, PAD, RESERVED = 256, 257, 258, 259
VOCAB_SIZE = 260


class ByteTokenizer:
    bos_id, eos_id, pad_id = BOS, EOS, PAD
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; specials are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
