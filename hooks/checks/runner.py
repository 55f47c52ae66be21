"""``run_checks``: run the selected checks, each isolated, and collect their results."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from hooks.checks.registry import CHECKS, DoctorOptions, resolve_only
from hooks.checks.result import CheckResult
from hooks.checks.target import SkipCheck, Target


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
        model: an ``nn.Module``, or a workload object with ``model``, ``args`` and ``kwargs``
            attributes (then ``batch`` is omitted).
        batch: the model's input: a (B, T) int64 tensor of token ids, a tuple of positional
            arguments or a dict of keyword arguments (``input_ids``, ``labels``...).
        overfit: also run the slow overfit check (otherwise it is reported as ``skip``).
        only: check ids or keys to run (e.g. ``[1, "gqa"]`` or ``"1,gqa"``); None runs all.
        options: :class:`DoctorOptions`.
        on_result: called with each result as soon as it is ready (progress display).

    Returns:
        list[CheckResult]: the selected checks in id order. A check that raises is reported
        with status ``error`` and the exception on one line; the others still run. The model's
        weights, ``.grad`` fields and train/eval flags are as before when this returns.

    Raises:
        ValueError: ``only`` names an unknown check.
        TypeError: ``model`` is not a module or ``batch`` is not a supported type.
    """
    import hooks.checks.all_checks  # noqa: F401  (registers the checks)

    opts = options or DoctorOptions()
    selected = resolve_only(only)
    target = Target.from_any(model, batch)
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
            except SkipCheck as exc:
                res = CheckResult(chk.id, chk.key, chk.name, "skip", str(exc))
            except Exception as exc:  # one crashing check must not stop the others
                msg = " ".join(f"{type(exc).__name__}: {exc}".split())
                if len(msg) > 300:
                    msg = msg[:297] + "..."
                res = CheckResult(chk.id, chk.key, chk.name, "error", msg,
                                  "the check itself crashed on this model; the message says where")
        res.seconds = time.perf_counter() - t0
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results


def worst_status(results: Iterable[CheckResult]) -> str:
    """The most severe status among ``results`` (order of :data:`STATUSES`)."""
    from hooks.checks.result import STATUSES

    worst = "pass"
    for r in results:
        if STATUSES.index(r.status) > STATUSES.index(worst):
            worst = r.status
    return worst
