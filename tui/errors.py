"""The exceptions the CLI turns into a single line on stderr, never a traceback;
:func:`clip`, which keeps that line short whatever input it repeats; and :func:`error_line` /
:func:`print_error`, the ``mdb: error: ...`` line of every command (printable, clipped)."""

from __future__ import annotations

import argparse
import re
import sys

from hooks.text import printable

#: Characters of a quoted value (or of an unbroken run of non-space characters, a path) that an
#: error line repeats; the rest is cut and counted.
MAX_QUOTED = 200
#: Longest error line: above this the middle of the line is cut (a long value that is neither
#: quoted nor a single word, e.g. a list).
MAX_LINE = 2000

# A Python repr of a string (an opening quote not preceded by a word character, so the
# apostrophe of "model's" opens nothing; escaped characters; the same quote closing it), else
# an unbroken run of non-space characters longer than MAX_QUOTED.
_QUOTED = r"""(?<![\w\\])(?:'([^'\\]*(?:\\.[^'\\]*)*)'|"([^"\\]*(?:\\.[^"\\]*)*)")"""
_LONG = re.compile(_QUOTED + r"|\S{" + str(MAX_QUOTED + 1) + ",}", re.DOTALL)


def _cut(text: str, keep: int) -> str:
    return f"{text[:keep]}…[{len(text):,} characters]"


def _shorten(m: re.Match) -> str:
    if m.group(1) is None and m.group(2) is None:  # a word: a path, maybe with a colon after
        word = m.group(0).rstrip(":,;.)")
        return _cut(word, MAX_QUOTED) + m.group(0)[len(word):]
    quote, inner = ("'", m.group(1)) if m.group(1) is not None else ('"', m.group(2))
    return m.group(0) if len(inner) <= MAX_QUOTED else f"{quote}{_cut(inner, MAX_QUOTED)}{quote}"


def clip(message: str) -> str:
    """``message`` with every quoted value longer than :data:`MAX_QUOTED` characters cut to
    its first :data:`MAX_QUOTED` (``'aaaa…[10,000,000 characters]'``), likewise every other
    run of non-space characters (a path), and the line cut in the middle to at most about
    :data:`MAX_LINE` characters. Short messages are returned unchanged."""
    if len(message) <= MAX_QUOTED:
        return message
    message = _LONG.sub(_shorten, message)
    if len(message) > MAX_LINE:
        half = MAX_LINE // 2
        message = (f"{message[:half]} …[{len(message) - 2 * half:,} characters cut]… "
                   f"{message[-half:]}")
    return message


def error_line(message: object, kind: str = "error") -> str:
    """The one line mdb writes on stderr about ``message``: ``mdb: <kind>: <message>``.

    The message may repeat outside text (a run's name or failure reason read from a database,
    a module name, an exception's message): it is made :func:`hooks.text.printable` (an
    ``ESC`` shown as ``\\x1b``, a newline as ``\\n``: one line that cannot drive the
    terminal) and :func:`clip`'d. An :class:`MdbError` is used as it is (its message already
    is both).

    Args:
        message: what to say (any object; its ``str``).
        kind: the word after ``mdb:`` (``error``, ``warning``, ``note``, ``finding``).
    """
    text = str(message) if isinstance(message, MdbError) else clip(printable(str(message)))
    return f"mdb: {kind}: {text}"


def print_error(message: object, kind: str = "error") -> None:
    """Print :func:`error_line` of ``message`` on stderr (flushed)."""
    print(error_line(message, kind), file=sys.stderr, flush=True)


class MdbError(Exception):
    """Bad input or an unusable environment: shown as ``mdb: error: <message>``, exit code 2.

    Raise it with a message that names what is wrong and how to fix it; the CLI prints no
    traceback for it. The message is :func:`clip`'d: a value it repeats is cut to
    :data:`MAX_QUOTED` characters; and, as it may repeat outside text (a run or module name,
    an exception's message), made :func:`hooks.text.printable` (control characters shown as
    ``\\x1b``, ``\\n``): one line that cannot drive the terminal.
    """

    exit_code = 2

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(clip(printable(str(message))), *args)


class ModelError(MdbError):
    """The user's model (or its factory) raised: one line naming the exception, the module
    being called and the user's ``file:line`` (:func:`hooks.errors.describe_error`), exit
    code 1."""

    exit_code = 1


class OneLineParser(argparse.ArgumentParser):
    """argparse whose bad-argument report is one line on stderr (exit code 2), not the usage
    block: ``mdb step: error: argument --seq-len: 'abc' is not an integer (see mdb step -h)``.
    The ``mdb`` parser and its subcommands' parsers are of this class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {clip(message)} (see {self.prog} -h)\n")
