"""The options the commands share, and the argparse types and checks of their values.

``mdb step``, ``mdb summary``, ``mdb capture`` and ``mdb doctor`` take the same options for the
model and the batch (:func:`add_model_arguments`): ``--preset``/``--config`` (a minillm
config), ``--text`` (the batch's text), ``--seq-len``, ``--batch-size``, ``--seed``, or
``--model module:function`` for a user's own model. A bad value raises
``argparse.ArgumentTypeError`` (argparse's one line) or :class:`tui.errors.MdbError`.
"""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path

from tui.errors import MdbError


def add_model_arguments(
    parser: argparse.ArgumentParser, *, seq_len: int = 64, batch_size: int = 2
) -> None:
    """Add the options that choose the model and the batch."""
    g = parser.add_argument_group("model and batch")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        default=None,
        help="a named minillm config (default, seed-test-c, mha, mqa, dense, "
        "learned-pos, tiny); default: default",
    )
    src.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="a minillm config as TOML (see samples/presets/)",
    )
    src.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        default=None,
        help="debug your own model: FUNCTION() returns (model, batch); batch is a "
        "tensor of input ids, a tuple of positional args or a dict of kwargs",
    )
    g.add_argument(
        "--text",
        metavar="FILE",
        default=None,
        help="UTF-8 text the batch is cut from (default: samples/alice.txt)",
    )
    g.add_argument(
        "--seq-len",
        type=positive_int,
        default=seq_len,
        help=f"tokens per sequence (default {seq_len})",
    )
    g.add_argument(
        "--batch-size",
        type=positive_int,
        default=batch_size,
        help=f"sequences per batch (default {batch_size})",
    )
    g.add_argument("--seed", type=seed_int, default=0,
                   help="torch seed for weights (default 0)")


def _number(text: str, kind: type, ok, requirement: str):
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
    return value


#: Largest count any integer option takes (steps, sizes, intervals): 2**31 - 1.
MAX_COUNT = 2**31 - 1


def positive_int(text: str) -> int:
    """argparse type: an integer in [1, :data:`MAX_COUNT`]."""
    return _number(text, int, lambda v: 0 < v <= MAX_COUNT,
                   f"a positive integer up to {MAX_COUNT:,}")


def nonneg_int(text: str) -> int:
    """argparse type: an integer in [0, :data:`MAX_COUNT`]."""
    return _number(text, int, lambda v: 0 <= v <= MAX_COUNT,
                   f"0 or a positive integer up to {MAX_COUNT:,}")


def seed_int(text: str) -> int:
    """argparse type: a seed ``torch.manual_seed`` takes, in [0, 2**63)."""
    return _number(text, int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def cpu_count() -> int:
    """Logical CPUs of this machine (``os.cpu_count()``, 1 when unknown)."""
    return os.cpu_count() or 1


def check_threads(threads: int) -> None:
    """Refuse a ``--threads`` above the machine's CPUs (:func:`cpu_count`): more threads than
    CPUs only slow torch down, and thousands crash it (``--threads 10000`` ended in a
    segmentation fault). 0 (torch's default) and negative values are left to each command.

    Raises:
        MdbError: ``--threads 10000: more than this machine's 2 CPUs; give at most 2``.
    """
    cpus = cpu_count()
    if threads > cpus:
        raise MdbError(f"--threads {threads}: more than this machine's {cpus} CPUs; give at "
                       f"most {cpus}")


def check_path(option: str, value: str) -> None:
    """Refuse a path no file can have: a name longer than the file system allows
    (``ENAMETOOLONG``), a loop of symbolic links (``ELOOP``) or a NUL character. A path that
    does not exist, or any other problem, passes: the command says what it needs.

    Args:
        option: the option, e.g. ``"--db"`` (``""`` for a positional argument).
        value: the path given.

    Raises:
        MdbError: one line naming ``option`` and what is wrong with ``value``.
    """
    where = f"{option} {value}" if option else value
    try:
        os.stat(value)
    except ValueError:  # embedded NUL
        raise MdbError(f"{where}: a file name cannot contain a NUL character") from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            longest = max((len(os.fsencode(part)) for part in Path(value).parts), default=0)
            raise MdbError(
                f"{where}: file name too long ({len(os.fsencode(value)):,} bytes, the longest "
                f"part {longest:,}; file systems allow about 255 per part and 4,096 in all)"
            ) from None
        if exc.errno == errno.ELOOP:
            raise MdbError(f"{where}: a loop of symbolic links (a link that leads back to "
                           "itself); give a real file") from None
