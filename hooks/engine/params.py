"""Per-parameter gradient records of a capture (``Trace.params``), from the numbers its hooks
took (:meth:`hooks.engine.capture.Capture._on_param`) and, for parameters those did not see, from
the parameters themselves; and the notes on statistics the capture's worker did not keep."""

from __future__ import annotations

import math
from typing import Any

import torch

from hooks.trace.records import Note, ParamGradRecord
from hooks.trace.trace import Trace


def param_records(
    named: list[tuple[str, torch.nn.Parameter]],
    touched: dict[str, tuple],
    sharded: dict[str, ParamGradRecord],
) -> dict[str, ParamGradRecord]:
    """One :class:`~hooks.trace.records.ParamGradRecord` per parameter of ``named`` (in its order).

    Args:
        named: ``(qualified name, parameter)`` pairs.
        touched: name -> ``(|g|^2, min g, max g, |w|^2)`` of each parameter whose gradient
            the capture saw accumulate, as Python floats or 0-d tensors (read back here, all
            at once).
        sharded: records already made for sharded (DTensor) parameters, used as they are.

    Returns:
        name -> record: status ``ok``/``zero`` for ``touched`` parameters, else ``frozen``
        (no ``requires_grad``), ``stale`` (a ``.grad`` this capture did not produce) or
        ``none``; norms are L2, ``ratio`` is grad_norm / weight_norm.
    """
    # floats from the worker; tensors otherwise, every parameter's four numbers read back
    # at once (stack promotes mixed dtypes)
    vals = {n: v for n, v in touched.items() if not isinstance(v[0], torch.Tensor)}
    names = [n for n in touched if n not in vals]
    flat = torch.stack([v for n in names for v in touched[n]]).tolist() if names else []
    vals.update({n: flat[4 * i : 4 * i + 4] for i, n in enumerate(names)})
    out: dict[str, ParamGradRecord] = {}
    with torch.no_grad():
        # parameters not seen by the hook (frozen, no grad, stale grad): one fused launch
        rest = [(n, p.detach()) for n, p in named if n not in vals and n not in sharded]
        rest_w = dict(zip([n for n, _ in rest], _norms([p for _, p in rest]), strict=True))
        for name, p in named:
            if name in sharded:
                out[name] = sharded[name]
                continue
            rec = ParamGradRecord(name, list(p.shape), "none")
            if name in vals:
                g2, lo, hi, w2 = vals[name]
                rec.grad_norm = math.sqrt(g2) if g2 >= 0 else math.nan
                rec.weight_norm = math.sqrt(w2) if w2 >= 0 else math.nan
                rec.grad_abs_max = math.nan if math.isnan(lo + hi) else max(-lo, hi)
                rec.status = "zero" if rec.grad_abs_max == 0.0 else "ok"
            else:
                rec.weight_norm = rest_w[name]
                if not p.requires_grad:
                    rec.status = "frozen"
                elif p.grad is not None:
                    g = _dense(p.grad)
                    rec.status = "stale"
                    rec.grad_norm = _norms([g])[0]
                    rec.grad_abs_max = _abs_maxes([g])[0]
            if rec.grad_norm is not None and not (
                math.isfinite(rec.grad_norm) and math.isfinite(rec.grad_abs_max)
            ):
                g = p.grad
                if g is not None:
                    g = _dense(g)
                    rec.nan_count = int(torch.isnan(g).sum())
                    rec.inf_count = int(torch.isinf(g).sum())
            if rec.grad_norm is not None and rec.weight_norm:
                rec.ratio = rec.grad_norm / rec.weight_norm
            out[name] = rec
    return out


class GradStatsBuffer:
    """The four numbers ``(|g|^2, min g, max g, |w|^2)`` of each parameter's gradient, written
    as its hook sees them into one preallocated table per device (fp64; fp32 on MPS, which has
    no fp64), never kept as small tensors of their own: hundreds of 0-d tensors that live from
    backward to the capture's end scatter glibc's heap between the activations' blocks, which
    cost a captured Llama step ~12 % more peak RSS than the plain step (issue 32, item 14).

    Args:
        names: the qualified names of the parameters that may report (one row each).
        devices: the devices those parameters are on (tables made now, before the forward);
            a parameter on another device gets its table when it first reports.
    """

    def __init__(self, names: list[str], devices: list[torch.device]) -> None:
        self._row = {n: i for i, n in enumerate(names)}
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._seen: dict[str, torch.device] = {}
        for d in dict.fromkeys(devices):
            self._table(d)

    def _table(self, device: torch.device) -> torch.Tensor:
        t = self._tables.get(device)
        if t is None:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            t = self._tables[device] = torch.empty((max(len(self._row), 1), 4), dtype=dtype,
                                                   device=device)
        return t

    def __len__(self) -> int:
        return len(self._seen)

    def __bool__(self) -> bool:
        return bool(self._seen)

    def put(self, name: str, grad: torch.Tensor, weight: torch.Tensor) -> None:
        """Write the numbers of ``grad`` (and ``weight``) into ``name``'s row (no sync, no
        tensor kept); a later call for the same name replaces them (accumulation)."""
        gf, wf = flat_grad_weight(grad, weight)
        lo, hi = torch.aminmax(gf)
        # dot(x, x) is the fastest sum of squares on CPU (BLAS); sqrt taken at exit; stacked,
        # then copied into the row (cast to the table's dtype): stack(out=) into another dtype
        # takes a slow path (~2x the two); the four-number tensor is freed at once
        device = gf.device
        row = self._table(device)[self._row[name]]
        row.copy_(torch.stack((torch.dot(gf, gf), lo, hi, torch.dot(wf, wf))))
        self._seen[name] = device

    def values(self) -> dict[str, tuple[float, float, float, float]]:
        """name -> the four numbers as Python floats, for every parameter that reported
        (each table read back once)."""
        read = {d: t.tolist() for d, t in self._tables.items()
                if d in self._seen.values()}
        return {n: tuple(read[d][self._row[n]]) for n, d in self._seen.items()}


def flat_grad_weight(grad: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, w)``: a gradient and its weight as 1-D tensors that record no graph (views when
    contiguous; detached while grad mode is on, as under create_graph, so no no_grad() is
    needed; a post-accumulate-grad hook otherwise runs in no-grad mode, where reading them
    records nothing and the two detaches are saved) in one float dtype (fp32 for half, bf16
    and integer gradients); a sparse gradient's stored values; ``([0.], [0.])`` in fp64 for
    an empty gradient."""
    detach = torch.is_grad_enabled()
    g = grad.detach() if detach else grad
    if g.is_sparse:
        g = g.coalesce().values()
    if g.numel() == 0:  # |g|^2 = min = max = 0; |w|^2 = 0 too (as before)
        return g.new_zeros(1, dtype=torch.float64), g.new_zeros(1, dtype=torch.float64)
    if g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    if detach:
        w = w.detach()
    if w.dtype is not g.dtype:
        w = w.to(g.dtype)
    return (g.view(-1) if g.is_contiguous() else g.reshape(-1),
            w.view(-1) if w.is_contiguous() else w.reshape(-1))


def unread_notes(
    trace: Trace, pending: list[tuple[Any, int]], modified: set[int], errors: dict[int, str]
) -> list[Note]:
    """Notes for statistics the worker did not keep (``hooks.tensors.stats.StatsBatch``): tensors
    written in place after their hook, before the worker read them (``modified`` slots), and
    failures (``errors``: slot -> message). ``pending`` pairs each TensorInfo / GradRecord of
    ``trace`` with its slot."""
    notes = []
    unread = {id(obj) for obj, slot in pending if slot in modified}
    where = []
    for r in trace.forward:
        lost = [t.path for t in (*r.inputs, *r.outputs) if id(t) in unread]
        if lost:  # said on the call too: the details pane shows its notes
            r.notes.append(f"statistics of {', '.join(lost)} not recorded: written in place "
                           "after the hook, before the statistics worker read them")
            where += [f"{r.module or '<root>'}#{r.call_index} {p}" for p in lost]
    where += [f"{g.module or '<root>'}#{g.call_index} grad {g.path}" for g in trace.backward
              if id(g) in unread]
    if where:
        notes.append(Note(
            "modified_in_place",
            f"{len(where)} tensor(s) were written in place after their hook, before the "
            "statistics worker read them: statistics not recorded (never numbers of "
            f"values the module did not return); first: {', '.join(where[:3])}"))
        if trace.first_nonfinite("forward") or trace.first_nonfinite("backward"):
            notes.append(Note(
                "nonfinite_origin", "a NaN/Inf was recorded while some tensors were not: the "
                "first non-finite value may be in one of those, earlier than the module named; "
                "capture with Capture.background = False for an exact origin"))
    if errors:
        notes.append(Note("hook_error", f"statistics of {len(errors)} tensor(s) failed on "
                          f"the worker thread: {next(iter(errors.values()))}"))
    return notes


# -- helpers ------------------------------------------------------
def _dense(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.coalesce().values() if t.is_sparse else t


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    """L2 norms of many tensors (``torch._foreach_norm``: one fused launch per dtype/device)."""
    if not tensors:
        return []
    try:
        norms = torch._foreach_norm(tensors, 2)
    except Exception:  # pragma: no cover - combos _foreach_norm refuses
        norms = [torch.linalg.vector_norm(t.float()) for t in tensors]
    return torch.stack([n.float().cpu() for n in norms]).tolist()


def _abs_maxes(tensors: list[torch.Tensor]) -> list[float]:
    """max |x| per tensor, NaN when the tensor has a NaN (aminmax propagates it).

    ``_foreach_norm(ord=inf)`` would do it in one call but runs ~10x slower on CPU.
    """
    if not tensors:
        return []
    mm = [torch.aminmax(t.reshape(-1)) if t.numel() else (t.new_zeros(()),) * 2 for t in tensors]
    flat = torch.stack([torch.stack([a.float().cpu(), b.float().cpu()]) for a, b in mm]).tolist()
    out = []
    for lo, hi in flat:
        out.append(math.nan if (math.isnan(lo) or math.isnan(hi)) else max(-lo, hi))
    return out
