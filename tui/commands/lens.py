"""``mdb lens``: the logit lens of one batch — what each decoder layer already predicts.

Each decoder layer's output goes through the model's own final norm and LM head
(:func:`hooks.logit_lens`). Without ``--pos`` the table has one row per position (the input
token, the token that follows it in the batch) and one column per layer: the top-1 prediction
and its probability; the last column is the model's own prediction. With ``--pos N`` it has one
row per layer: the top ``--k`` tokens at that position. A table wider than the terminal (or
``$COLUMNS`` piped, else 160) is printed as several, one below the other, each with the columns
that fit and the row labels repeated: no cell is cut or squeezed (``--k 60`` at 80 columns).
"""

from __future__ import annotations

import argparse
import sys

from hooks.text import printable
from tui.commands.options import add_model_arguments, nonneg_int, positive_int
from tui.errors import MdbError, ModelError

HELP = "the logit lens: each decoder layer's prediction through the final norm and LM head"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tui.commands.step import add_threads_argument

    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--pos", type=nonneg_int, default=None, metavar="N",
                        help="one position: the top --k tokens of every layer there")
    parser.add_argument("--row", type=nonneg_int, default=0, metavar="B",
                        help="which sequence of the batch (default 0)")
    parser.add_argument("--k", type=positive_int, default=5, metavar="K",
                        help="tokens per layer with --pos (default 5)")


def compute_lens(workload, k: int = 5):
    """:func:`hooks.logit_lens` of a workload, its errors as one line.

    Raises:
        MdbError: the model has no layers, final norm or head the lens can find.
        ModelError: the model raised in its forward pass.
    """
    from hooks.errors import describe_error
    from hooks.whatif.lens import find_parts, logit_lens

    try:
        find_parts(workload.model)
    except ValueError as exc:
        raise MdbError(f"logit lens: {exc}") from None
    try:
        return logit_lens(workload.model, workload.batch, k=k, tokenizer=workload.tokenizer)
    except Exception as exc:  # the user's model may raise anything
        raise ModelError(describe_error(exc, workload.model, "the forward pass")) from None


def stdout_console():
    """A Rich console on stdout: the terminal's width, or piped ``$COLUMNS`` (else 160 cells)
    and no colour."""
    import os

    from rich.console import Console

    tty = sys.stdout.isatty()
    width = None
    if not tty:  # piped: $COLUMNS when set, else wide enough for a few layers
        cols = os.environ.get("COLUMNS", "")
        width = int(cols) if cols.isdigit() and int(cols) > 0 else 160
    return Console(file=sys.stdout, width=width, no_color=not tty or None, highlight=False)


def _short(name: str) -> str:
    return ".".join(name.split(".")[-2:])


def _check(lens, args) -> None:
    b, t = lens.shape
    if args.row >= b:
        raise MdbError(f"--row {args.row}: the batch has {b} sequences (0..{b - 1})")
    if args.pos is not None and args.pos >= t:
        raise MdbError(f"--pos {args.pos}: the batch has {t} positions (0..{t - 1})")


#: Cells between two columns of a printed table (`` │ ``: no edge, no outer padding).
GAP = 3


def fitted_tables(lead: list[tuple[str, str]], heads: list[str], rows: list[tuple[list[str],
                  list[str]]], width: int | None) -> list:
    """Rich tables of ``rows`` that each fit ``width`` cells (``None``: one table): every
    table has the ``lead`` columns (header, justify) and as many of the other columns
    (``heads``, each row's second list) as fit at their full width, the rest going to the
    next table below, the lead columns repeated. A cell is never cut and never read as Rich
    markup; its text is :func:`hooks.text.printable` (a token may be any string)."""
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    def col_width(head: str, cells: list[str]) -> int:
        return max([cell_len(head), *(cell_len(c) for c in cells)])

    rows = [([printable(c) for c in a], [printable(c) for c in b]) for a, b in rows]
    heads = [printable(h) for h in heads]
    lead_w = sum(col_width(h, [r[0][i] for r in rows]) + GAP for i, (h, _) in enumerate(lead))
    groups: list[list[int]] = [[]]
    used = lead_w
    for j, head in enumerate(heads):
        w = col_width(head, [r[1][j] for r in rows])
        if width is not None and groups[-1] and used + w > width:
            groups.append([])
            used = lead_w
        groups[-1].append(j)
        used += w + GAP
    tables = []
    for group in groups:
        table = Table(show_edge=False, pad_edge=False)
        for head, justify in lead:
            table.add_column(Text(head), justify=justify, no_wrap=True)
        for j in group:
            table.add_column(Text(heads[j]), no_wrap=True)  # a token's text: never markup
        for a, b in rows:
            table.add_row(*(Text(c) for c in [*a, *(b[j] for j in group)]))
        tables.append(table)
    return tables


def _print_tables(console, tables: list) -> None:
    for i, table in enumerate(tables):
        if i:
            console.print()
        console.print(table)


def print_grid(lens, row: int = 0) -> None:
    """Positions × layers: each cell the top-1 token and its probability; the layers that do
    not fit the width in further tables below (:func:`fitted_tables`)."""
    from tui.widgets import fmt

    texts, probs = lens.table(row)
    ids = lens.ids[row].tolist() if lens.ids is not None else None
    console = stdout_console()
    console.print("top-1 per position (rows) and decoder layer (columns), "
                  f"{fmt.sequence(row, lens.shape[0])} (--row {row})",
                  markup=False)
    lead = [("pos", "right")] + ([("input", "left"), ("next", "left")] if ids is not None
                                 else [])
    t = len(texts[0]) if texts else 0
    rows = []
    for p in range(t):
        cells = [str(p)]
        if ids is not None:
            cells += [lens.text_of(ids[p]), lens.text_of(ids[p + 1]) if p + 1 < t else ""]
        rows.append((cells, [f"{texts[layer][p]} {probs[layer, p]:.3f}"
                             for layer in range(len(texts))]))
    _print_tables(console, fitted_tables(lead, [_short(n) for n in lens.layers], rows,
                                         console.width))


def print_position(lens, pos: int, k: int, row: int = 0) -> None:
    """Layers × top-k at one position; the ranks that do not fit the width in further tables
    below (:func:`fitted_tables`): ``--k 60`` at 80 columns prints every token, never a table
    squeezed to its borders."""
    from tui.widgets import fmt

    ids = lens.ids[row].tolist() if lens.ids is not None else None
    at = f" (input {lens.text_of(ids[pos])!r})" if ids is not None else ""
    console = stdout_console()
    console.print(printable(f"top {k} at position {pos}{at}, {fmt.sequence(row, lens.shape[0])} "
                            f"(--row {row})"), markup=False)
    rows = []
    for layer, name in enumerate(lens.layers):
        top = lens.top(layer, pos, k, row=row)
        rows.append(([_short(name)], [f"{t.text} {t.prob:.3f}" for t in top]))
    _print_tables(console, fitted_tables([("layer", "left")], [f"#{i + 1}" for i in range(k)],
                                         rows, console.width))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb lens``."""
    from tui.commands.step import set_threads
    from tui.commands.workload import build_workload

    set_threads(args)
    workload = build_workload(args)
    lens = compute_lens(workload, k=max(args.k, 1))
    _check(lens, args)
    console = stdout_console()
    console.print(printable(workload.description or "the model"), markup=False)
    console.print(printable(f"logit lens: each layer's output → {lens.norm} → {lens.head}"
                            + ("" if lens.post == "none" else f" → {lens.post}")), markup=False)
    if args.pos is None:
        print_grid(lens, args.row)
    else:
        print_position(lens, args.pos, args.k, args.row)
    for note in lens.notes:
        console.print(printable(f"note: {note}"), markup=False)
    return 0
