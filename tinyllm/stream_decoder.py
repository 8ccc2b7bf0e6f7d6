"""Decoding a stream of token ids into text, never emitting half a UTF-8 character."""
from __future__ import annotations


class StreamDecoder:
    """Decodes ids one at a time, never emitting half a UTF-8 character.

    One token can end inside a character: an emoji is 4 bytes and often spread over 2-3 tokens. Decoding each
    token alone would print '�' garbage, so `feed` keeps the unfinished bytes at the end and emits them once the
    character is complete. Joining every `feed` result and the final `flush` gives exactly `decode(ids)`;
    invalid bytes become '�' as in `decode`, never an exception.
    """

    def __init__(self, tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._pending = b""   # bytes of a character that is not complete yet (0-3 bytes)

    def feed(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (may be "")."""
        if token_id in self._skip:
            return ""
        data = self._pending + self._tokenizer.id_to_bytes(token_id)
        cut = len(data) - _unfinished_utf8_tail(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """End of stream: return what is left (an unfinished character becomes '�')."""
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text


def _unfinished_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character whose remaining bytes have not arrived (0-3).

    A character is a lead byte (0xxxxxxx: 1 byte, 110xxxxx: 2, 1110xxxx: 3, 11110xxx: 4) followed by
    continuation bytes (10xxxxxx). Holding back from a lead byte is always safe: the UTF-8 decoder restarts at
    any byte that is not a continuation byte, so the split cannot change how the text decodes.
    """
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0b1100_0000 != 0b1000_0000:   # not a continuation byte: a character starts here
            length = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 1
            return back if back < length else 0
    return 0   # only continuation bytes: invalid whatever comes next, so nothing to wait for
