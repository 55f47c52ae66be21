"""Outside text made safe to show on a terminal, in a table or in a one-line message.

Names mdb shows are chosen by others: a module's name (any ``nn.ModuleDict`` key), a metric
name (any keyword of ``run.log``), a run name written into the database by other code, a
config value, an exception's message, the names in a trace file. Written to a terminal as
they are, an ``ESC`` in one starts an escape sequence (``\\x1b]0;…\\x07`` retitles the window,
``\\x1b[2J`` clears it, ``\\x9b`` is a one-byte CSI), a ``\\r`` or ``\\n`` moves the cursor and
splits a table row in two, and a bidi override (``U+202E``) reorders what follows it.
:func:`printable` shows every such character as a visible escape instead, so what is shown is
what is there, on one line, and the terminal keeps its state.
"""

from __future__ import annotations

__all__ = ["printable"]

#: Escapes Python writes in a string's ``repr``, kept for the commonest controls.
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character that does not print shown as a visible escape.

    Escaped: the C0 controls (``\\x00``–``\\x1f``: ``ESC`` as ``\\x1b``, ``BEL`` as ``\\x07``,
    newline as ``\\n``, ``\\r``, ``\\t``), ``DEL`` (``\\x7f``), the C1 controls
    (``\\x80``–``\\x9f``: the one-byte CSI as ``\\x9b``), the format characters among them
    the bidi embeddings, overrides and isolates (``U+202A``–``U+202E``, ``U+2066``–``U+2069``,
    as ``\\u202e``), zero-width characters, separators other than the space, unassigned code
    points and lone surrogates — every character :meth:`str.isprintable` says does not print,
    written as Python writes it in a string's ``repr``. Everything else is kept as is: letters
    of any script (``人工智能``, ``é``), symbols, the space, the backslash.

    Args:
        text: any string.

    Returns:
        str: ``text`` itself when every character prints, else the escaped copy (one line,
        no control character).
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)
