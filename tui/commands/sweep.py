"""``mdb sweep``: activation patching over every layer × position (or head, or layer), to find
where a model carries what one input has and another lacks.

The model's batch is the *corrupted* run; the source (``--source-batch``, ``--source-text`` or
``--source-ids``) is the *clean* one, whose activations are patched in one at a time, as
``patch MODULE from=source`` does (:func:`hooks.patch_sweep`). ``--attribution`` adds the
first-order estimate from one forward and backward pass (:func:`hooks.attribution_patch`) beside
it, with their correlation. In a terminal each sweep is a heatmap (each cell coloured by how much
of the way from the corrupted metric to the clean one the patch goes); piped, a plain table;
``--json`` prints the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from hooks.text import printable
from tui.commands.options import add_model_arguments
from tui.errors import MdbError, ModelError

HELP = ("activation patching over layers × positions, heads or layers: which of them carry "
        "what the source (clean) batch has and the model's batch lacks")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tui.commands.step import add_threads_argument

    add_model_arguments(parser)
    add_threads_argument(parser)
    src = parser.add_argument_group("the clean batch, patched into the model's (corrupted) one")
    one = src.add_mutually_exclusive_group()
    one.add_argument("--source-batch", metavar="MODULE:FUNCTION", default=None,
                     help="FUNCTION() returns the clean batch (a tensor of ids, a tuple, a dict "
                          "of keyword arguments or a hooks.Batch), of the model batch's shape")
    one.add_argument("--source-text", metavar="TEXT", default=None,
                     help="the clean batch: this text, tokenised and cut to the batch's shape")
    one.add_argument("--source-ids", metavar="IDS", default=None,
                     help="the clean batch: token ids, '1,2,3' (every row) or '1,2;3,4'")
    parser.add_argument("--over", default="layers×positions", metavar="OVER",
                        help="layers×positions (or layersxpositions), heads or layers "
                             "(default layers×positions)")
    parser.add_argument("--metric", default="loss", metavar="METRIC",
                        help="loss (next-token loss against the clean batch's labels) or "
                             "logit_diff:A,B (logit of A minus B at the last position; ids or "
                             "token texts) (default loss)")
    parser.add_argument("--attribution", action="store_true",
                        help="also attribution patching (first-order estimate), with its "
                             "correlation to the exact sweep")
    parser.add_argument("--json", action="store_true", help="print the sweep(s) as JSON")


def compute(workload, clean, over: str, metric: str, attribution: bool):
    """``(exact, estimate or None)`` of a workload (its batch corrupted, ``clean`` patched in).

    Raises:
        MdbError: a bad --over / --metric, a model whose blocks, norm or head are not found,
            batches of different shapes (one line).
        ModelError: the model raised in a forward or backward pass.
    """
    from hooks.errors import describe_error
    from hooks.whatif.metric import parse_metric
    from hooks.whatif.stream import stream_parts
    from hooks.whatif.sweep import attribution_patch, parse_over, patch_sweep

    try:
        over = parse_over(over)
        parts = stream_parts(workload.model)
        head = dict(workload.model.named_modules())[parts.head]
        parsed = parse_metric(metric, workload.tokenizer, getattr(head, "out_features", None))
    except ValueError as exc:
        raise MdbError(f"sweep: {exc}") from None
    out = []
    for fn in (patch_sweep, attribution_patch) if attribution else (patch_sweep,):
        try:
            out.append(fn(workload.model, clean, workload.batch, over=over, metric=parsed,
                          tokenizer=workload.tokenizer))
        except ValueError as exc:
            raise MdbError(f"sweep: {exc}") from None
        except Exception as exc:  # the user's model may raise anything
            raise ModelError(describe_error(exc, workload.model, "the patched runs")) from None
    return out[0], (out[1] if attribution else None)


def _columns(sweep, workload) -> list[str]:
    n = int(sweep.values.shape[-1]) if sweep.values.dim() > 1 else 1
    if sweep.over == "heads":
        return [f"h{i}" for i in range(n)]
    if sweep.over == "layers":
        return ["value"]
    labels = workload.batch.token_labels(workload.model) if workload.batch is not None else []
    return [f"{p} {labels[p]}" if p < len(labels) else str(p) for p in range(n)]


def _color(x: float) -> str:
    """A background from dark blue (≤ 0: nothing restored) to red (≥ 1: all of it)."""
    if not math.isfinite(x):
        return ""
    x = min(max(x, 0.0), 1.0)
    r, g, b = int(30 + 200 * x), int(40 + 60 * (1 - abs(2 * x - 1))), int(120 * (1 - x) + 20)
    return f"on rgb({r},{g},{b})"


def print_sweep(console, sweep, columns: list[str], heat: bool) -> None:
    """The sweep as a table (a heatmap with ``heat``), rows = blocks, columns split to fit."""
    from rich.table import Table
    from rich.text import Text

    from tui.commands.lens import GAP

    values = sweep.values.reshape(len(sweep.rows), -1).tolist()
    norm = sweep.normalized().reshape(len(sweep.rows), -1).tolist()
    rows = [".".join(r.split(".")[-2:]) for r in sweep.rows]
    lead = max(len("layer"), *(len(r) for r in rows)) + GAP
    cells = [[f"{v:.4f}" for v in row] for row in values]
    widths = [max(len(printable(c)), *(len(r[j]) for r in cells)) for j, c in enumerate(columns)]
    groups, used = [[]], lead
    for j, w in enumerate(widths):
        if console.width and groups[-1] and used + w + GAP > console.width:
            groups.append([])
            used = lead
        groups[-1].append(j)
        used += w + GAP
    for k, group in enumerate(groups):
        table = Table(show_edge=False, pad_edge=False)
        table.add_column(Text("layer"), no_wrap=True)
        for j in group:
            table.add_column(Text(printable(columns[j])), justify="right", no_wrap=True)
        for i, name in enumerate(rows):
            table.add_row(Text(printable(name)), *(
                Text(cells[i][j], style=_color(norm[i][j]) if heat else "") for j in group))
        if k:
            console.print()
        console.print(table)


def _doc(exact, estimate) -> dict:
    doc = {"exact": exact.to_dict()}
    if estimate is not None:
        r = estimate.correlation(exact)
        doc["attribution"] = estimate.to_dict()
        doc["correlation"] = r if math.isfinite(r) else str(r)
    return doc


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb sweep``."""
    from tui.commands.editing import source_batch
    from tui.commands.lens import stdout_console
    from tui.commands.step import set_threads
    from tui.commands.workload import build_workload

    if not (args.source_batch or args.source_text or args.source_ids):
        raise MdbError("sweep: give the clean batch to patch in: --source-batch MODULE:FUNCTION, "
                       "--source-text TEXT or --source-ids IDS")
    set_threads(args)
    workload = build_workload(args)
    clean = source_batch(args, workload)
    exact, estimate = compute(workload, clean, args.over, args.metric, args.attribution)
    if args.json:
        print(json.dumps(_doc(exact, estimate), allow_nan=False))
        return 0
    console = stdout_console()
    heat = sys.stdout.isatty()
    console.print(printable(workload.description or "the model"), markup=False)
    columns = _columns(exact, workload)
    for s in (exact, estimate):
        if s is None:
            continue
        what = "patching sweep" if s.method == "patch" else "attribution patching (estimate)"
        console.print(printable(f"{what} over {s.over}, metric {s.metric}: clean "
                                f"{s.clean:.4g}, corrupted {s.corrupt:.4g} (the model's batch, "
                                "each activation taken from the source batch)"), markup=False)
        print_sweep(console, s, columns, heat)
        for note in s.notes:
            console.print(printable(f"note: {note}"), markup=False)
    if estimate is not None:
        console.print(f"correlation of the estimate with the exact sweep: "
                      f"{estimate.correlation(exact):.3f}", markup=False)
    return 0
