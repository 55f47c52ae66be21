"""``run_checks``: run the selected checks, each isolated, and collect their results.

A check that raises is told apart by where the exception was raised
(:func:`hooks.doctor.model.blame.raised_by_model`): inside the user's model or PyTorch it is
``skip`` with the exception and the module it came from; in mdb's own code it is ``error``.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from hooks.doctor.model.blame import one_line, raised_by_model
from hooks.doctor.model.registry import CHECKS, DoctorOptions, resolve_only
from hooks.doctor.model.result import STATUSES, CheckResult
from hooks.doctor.model.target import NotApplicable, SkipCheck, Target


def run_checks(
    model: Any,
    batch: Any = None,
    *,
    overfit: bool = False,
    only: Iterable[str | int] | str | None = None,
    options: DoctorOptions | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run the doctor's checks on ``model`` and return one result per check, in id order.

    Args:
        model: an ``nn.Module``; a :class:`Target`; or a workload object with ``model``,
            ``batch`` (a :class:`hooks.Batch`) and ``loss_fn`` attributes (then ``batch`` is
            omitted).
        batch: the model's input: a (B, T) int64 tensor of token ids, a tuple of positional
            arguments, a dict of keyword arguments (``input_ids``, ``labels``...) or a
            :class:`hooks.Batch`.
        overfit: also run the slow overfit check (otherwise it is reported as ``skip``).
        only: check ids or keys to run (e.g. ``[1, "gqa"]`` or ``"1,gqa"``); None runs all.
        options: :class:`DoctorOptions`.
        on_result: called with each result as soon as it is ready (progress display).

    Returns:
        list[CheckResult]: the selected checks in id order. A check that does not apply to the
        model's kind is ``n/a`` with the reason. A check that raises inside the model or
        PyTorch is ``skip`` with the exception and where it was raised; one that raises in
        mdb's own code is ``error``; the others still run. The model's weights, ``.grad``
        fields and train/eval flags are as before when this returns.

    Raises:
        ValueError: ``only`` names an unknown check.
        TypeError: ``model`` is not a module or ``batch`` is not a supported type.
    """
    import hooks.doctor.model.all_checks  # noqa: F401  (registers the checks)

    opts = options or DoctorOptions()
    selected = resolve_only(only)
    target = Target.from_any(model, batch)
    names = target.module_names()
    results: list[CheckResult] = []
    for chk in CHECKS:
        if selected is not None and chk.id not in selected:
            continue
        t0 = time.perf_counter()
        if chk.slow and not overfit:
            res = CheckResult(chk.id, chk.key, chk.name, "skip",
                              "not run (slow): pass --overfit to run it")
        else:
            try:
                with target.saved_grads(), target.mode(target.model.training):
                    out = chk.func(target, opts)
                res = CheckResult(chk.id, chk.key, chk.name, out.status, out.evidence, out.hint,
                                  out.module, out.data)
            except NotApplicable as exc:
                res = CheckResult(chk.id, chk.key, chk.name, "n/a", str(exc))
            except SkipCheck as exc:
                res = CheckResult(chk.id, chk.key, chk.name, "skip", str(exc))
            except Exception as exc:  # one crashing check must not stop the others
                try:
                    check_file = os.path.abspath(inspect.getfile(chk.func))
                except TypeError:  # pragma: no cover - a builtin as a check
                    check_file = None
                where = raised_by_model(exc, check_file, names)
                if where is not None:
                    res = CheckResult(chk.id, chk.key, chk.name, "skip",
                                      f"the model raised {one_line(exc, 220)} ({where}); "
                                      "this check cannot run on it",
                                      data={"exception": one_line(exc), "where": where})
                else:
                    res = CheckResult(chk.id, chk.key, chk.name, "error", one_line(exc),
                                      "mdb's check itself crashed on this model (a bug in "
                                      "mdb: please report it with this message)")
        res.seconds = time.perf_counter() - t0
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results


def worst_status(results: Iterable[CheckResult]) -> str:
    """The most severe status among ``results`` (order of :data:`STATUSES`)."""
    worst = "pass"
    for r in results:
        if STATUSES.index(r.status) > STATUSES.index(worst):
            worst = r.status
    return worst
