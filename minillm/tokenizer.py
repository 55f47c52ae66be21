"""Two tokenizers: characters of a given text (seed 000's), and UTF-8 bytes (any file)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class CharTokenizer:
    """One id per distinct character of a reference text, ids in sorted character order.

    Args:
        chars: the vocabulary, in id order.

    Raises:
        ValueError: on an empty vocabulary, or (``encode``) a character not in it.
    """

    def __init__(self, chars: Sequence[str]) -> None:
        if not chars:
            raise ValueError("a character tokenizer needs at least one character")
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        if len(self.stoi) != len(self.chars):
            raise ValueError("character vocabulary has duplicates")

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary ``sorted(set(text))`` (seed 000's construction)."""
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        """Number of ids."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``'s characters."""
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; ``decode(encode(s)) == s``."""
        return "".join(self.chars[int(i)] for i in ids)

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """A printable label per id (for tables): the character, escaped if invisible."""
        return [_printable(self.chars[int(i)]) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: any text round-trips, no vocabulary to build."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; invalid sequences (e.g. a cut multi-byte char) become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """A printable label per id: the ASCII character, or ``<0xNN>`` for other bytes."""
        out = []
        for i in ids:
            i = int(i)
            ascii_text = 32 <= i < 127 or i in (9, 10)
            out.append(_printable(chr(i)) if ascii_text else f"<0x{i:02X}>")
        return out


def _printable(c: str) -> str:
    return {"\n": "\\n", "\t": "\\t", " ": "␠"}.get(c, c if c.isprintable() else repr(c)[1:-1])
