"""``mdb memory``: where every byte of a training step goes, and whether a bigger one fits.

The step (a minillm preset or config, ``--model module:function``, a saved ``--trace`` or a
run's ``--run NAME@STEP``) is captured with memory accounting (:mod:`hooks.engine.memory`):
the module tree with each module's bytes by kind (parameters, gradients, optimizer state,
activations autograd saved during its calls), siblings largest first, each row naming the kind
that dominates; the totals; the peak of the step's live bytes and what autograd held there.
``--at batch=B,seq=T`` measures two small steps and extrapolates each term by its scaling
(:mod:`hooks.whatif.memory_fit`), printing the figure and how it was reached.

In a terminal the tables are Rich tables; piped they are plain text (``$COLUMNS`` wide when
set); ``--json`` prints one JSON document instead (every figure in bytes).
"""

from __future__ import annotations

import argparse
import json
import sys

from hooks.text import printable
from tui.commands.options import add_model_arguments, nonneg_int
from tui.commands.step import add_run_arguments, add_threads_argument
from tui.errors import MdbError

HELP = ("where every byte of a training step goes (parameters, gradients, optimizer state, "
        "saved activations per module); --at batch=B,seq=T: will it fit")

#: ``--optimizer`` choices: the optimizer whose state the captured step counts.
OPTIMIZERS = ("adamw", "sgd", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="a saved trace instead of capturing a step")
    add_run_arguments(parser)
    parser.add_argument("--at", metavar="batch=B,seq=T", default=None,
                        help="will it fit: the step's bytes at batch size B and sequence "
                             "length T, extrapolated from two small measured steps")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="the optimizer whose state a captured step counts (default "
                             "adamw: two fp32 tensors per parameter; none: not counted)")
    parser.add_argument("--depth", type=nonneg_int, default=None, metavar="N",
                        help="only modules at most N levels deep (the root is 0)")
    parser.add_argument("--json", action="store_true", help="one JSON document, in bytes")


def parse_at(text: str) -> tuple[int, int]:
    """``batch=B,seq=T`` (either order, spaces allowed) as ``(B, T)``.

    Raises:
        MdbError: anything else, in one line with an example.
    """
    bad = MdbError(f"--at {text!r}: expected batch=B,seq=T with positive integers, e.g. "
                   "--at batch=8,seq=1024")
    values: dict[str, int] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in ("batch", "seq") or key in values or not value.isdigit():
            raise bad
        values[key] = int(value)
    if set(values) != {"batch", "seq"} or min(values.values()) < 1 or max(values.values()) > 2**40:
        raise bad
    return values["batch"], values["seq"]


def _optimizer(name: str, model):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def capture_with_memory(args: argparse.Namespace, batch: int | None = None,
                        seq: int | None = None):
    """Build the workload the options describe (at ``batch`` × ``seq`` when given) and capture
    one forward and backward with memory accounting and ``--optimizer``'s state."""
    from tui.commands.capturing import capture_step
    from tui.commands.workload import build_workload

    if batch is not None:
        args = argparse.Namespace(**{**vars(args), "batch_size": batch, "seq_len": seq})
    workload = build_workload(args)
    opt = _optimizer(args.optimizer, workload.model)
    return capture_step(workload, attention=False, optimizer=opt)


def _source_trace(args: argparse.Namespace):
    from tui.commands.step import check_run_options, load_run_trace, load_trace, set_threads

    check_run_options(args)
    if args.run:
        return load_run_trace(args.run, args.db)
    if args.trace:
        return load_trace(args.trace)
    set_threads(args)
    return capture_with_memory(args)


def estimate(args: argparse.Namespace):
    """The :class:`hooks.whatif.memory_fit.Estimate` at ``--at``, from two small steps.

    Raises:
        MdbError: ``--at`` malformed, or with a step mdb cannot rebuild at other sizes.
    """
    from hooks.whatif.memory_fit import Measured, extrapolate, small_sizes
    from tui.commands.step import set_threads

    batch, seq = parse_at(args.at)
    given = [o for o in ("run", "trace", "model") if getattr(args, o, None)]
    if given:
        raise MdbError(f"--at measures the model at two small sizes, so it needs a model mdb "
                       f"builds (--preset or --config), not --{given[0]}")
    set_threads(args)
    runs = []
    for b, t in small_sizes(batch, seq):
        trace = capture_with_memory(args, b, t)
        if trace.memory is None:
            raise MdbError("the step was captured without memory accounting")
        limit = ((trace.meta or {}).get("config") or {}).get("max_position_embeddings")
        if isinstance(limit, int) and seq > limit:
            raise MdbError(f"--at seq={seq} is longer than the model allows "
                           f"(max_position_embeddings = {limit})")
        runs.append(Measured(b, t, trace.memory))
    return extrapolate(runs[0], runs[1], batch, seq)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb memory``."""
    from hooks.trace.memory_view import NoMemoryError, module_bytes, peak_report
    from tui.commands.memory_print import document, print_estimate, print_memory

    if args.at is not None:
        parse_at(args.at)  # a malformed --at is said before anything runs
        est = estimate(args)
        if args.json:
            print(json.dumps({"at": est.to_dict()}, indent=1))
        else:
            print_estimate(est, args.optimizer)
        return 0
    trace = _source_trace(args)
    try:
        tree, peak = module_bytes(trace), peak_report(trace)
    except NoMemoryError as exc:
        where = (f"--run {args.run}" if args.run else f"--trace {args.trace}" if args.trace
                 else "the step")
        raise MdbError(f"{where}: {exc}") from None
    if args.json:
        json.dump(document(trace, tree, peak, args.depth), sys.stdout, indent=1)
        print()
        return 0
    print_memory(printable(trace.meta.get("description") or trace.model_type), trace, tree,
                 peak, args.depth)
    return 0
