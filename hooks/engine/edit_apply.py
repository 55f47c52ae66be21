"""Applying edits (:mod:`hooks.engine.edits`) while a model runs: forward hooks and forward
pre-hooks, put first (``prepend=True``) so that the capture's own hooks record the edited values.

Dimension legend: B batch, T positions, D hidden size, H query heads, Dh head dim, N tokens,
E experts, k experts per token.

* ``output`` edits replace the module's output (its first floating-point tensor when it returns
  a tuple or a dict): zeros, ``F·out``, the mean over every dimension but the last, or the
  output the same call had on the ``patch`` source batch (recorded by a forward of the model on
  that batch, under ``no_grad``, before the step; the patched values are constants).
* ``head`` zeroes the slice ``[h·Dh, (h+1)·Dh)`` of the output projection's input (..., H·Dh):
  head h's output before o_proj / c_proj mixes the heads.
* ``expert_list`` replaces expert E's output by zeros (each expert a module called on its
  tokens); ``expert_fused`` sets to 0 the weights of E in the (N, k) weights handed to fused
  experts ``experts(hidden, ids, weights)``. Neither renormalises the other weights.
* ``router`` sets column E of the router's (N, E) logits to -inf. A router that also returns
  its choice (transformers 5's ``TopKRouter``: logits, weights, ids) has its choice made again
  from the edited logits by the rule :func:`hooks.probes.routing.infer_rule` verified on its own
  output (softmax or sigmoid, bias, renormalisation, scale), so top-k is taken over the rest.

Every edited tensor that requires grad gets a tensor hook counting the gradients that reach
it: an edit whose output never reached the loss is said in a note, as is one whose module was
never called or whose values did not change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hooks.engine.edit_pattern import pattern_hooks, record_pattern
from hooks.engine.edit_roles import check_vector_width
from hooks.engine.edits import AppliedEdit, Edit, Target, parse_positions, resolve_edits
from hooks.trace.records import Note


def first_float(output: Any) -> tuple[torch.Tensor | None, Any]:
    """``(tensor, put)``: the first floating-point tensor of ``output`` (itself, a tuple/list
    element, a dict or ModelOutput value) and ``put(new)`` that returns ``output`` with it
    replaced; ``(None, None)`` when there is none."""
    if isinstance(output, torch.Tensor):
        return (output, lambda new: new) if output.is_floating_point() else (None, None)
    if isinstance(output, (tuple, list)):
        for i, x in enumerate(output):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                def put(new, i=i):
                    items = list(output)
                    items[i] = new
                    if hasattr(output, "_fields"):  # a namedtuple keeps its type
                        return type(output)(*items)
                    return type(output)(items) if isinstance(output, list) else tuple(items)
                return x, put
        return None, None
    if isinstance(output, Mapping):
        for k, x in output.items():
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                def put(new, k=k):
                    output[k] = new
                    return output
                return x, put
    return None, None


def _leaf_like(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` as a new tensor that requires grad when ``like`` does (so that whether the
    edit reaches the loss can be seen; the gradient stops there)."""
    out = values.detach().to(dtype=like.dtype, device=like.device).contiguous()
    if out.data_ptr() == like.data_ptr():
        out = out.clone()
    return out.requires_grad_(like.requires_grad)


def _top_k(t: Target) -> int | None:
    """k of the MoE block whose router ``t`` edits (its ``top_k`` or its config's
    ``num_experts_per_tok``), None when not declared."""
    for owner in (t.router_owner, t.module, getattr(t.router_owner, "config", None)):
        for attr in ("top_k", "num_experts_per_tok"):
            v = getattr(owner, attr, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def _rows(pos: str | None, n: int) -> torch.Tensor | slice | None:
    """The query positions ``pos=`` names among ``n`` (all: ``slice(None)``), or None when one
    lies outside."""
    if pos is None:
        return slice(None)
    got = parse_positions(pos)
    try:
        idx = torch.arange(n)[got] if isinstance(got, slice) else torch.tensor(
            [p + n if p < 0 else p for p in got])
    except IndexError:
        return None
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        return None
    return idx


class _State:
    """Counters of one target while the step runs."""

    __slots__ = ("calls", "changed", "grads", "watched", "why", "index")

    def __init__(self) -> None:
        self.calls = 0
        self.changed = 0
        self.grads = 0
        self.watched = False
        self.why: str | None = None
        self.index = 0


class Editor:
    """The edits of one step: checked on construction, applied between :meth:`start` and
    :meth:`stop`.

    Args:
        model: the model.
        edits: spec strings or :class:`hooks.engine.edits.Edit` objects.
        sources: batches by name for ``patch ... from=NAME``: a tensor of input ids, a tuple
            of positional arguments, a dict of keyword arguments or a :class:`hooks.Batch`.

    Raises:
        ValueError: see :func:`hooks.engine.edits.resolve_edits` (nothing has run).
    """

    def __init__(self, model: nn.Module, edits: list[str | Edit],
                 sources: Mapping[str, Any] | None = None) -> None:
        from hooks.batch import Batch, BatchError

        self.model = model
        if isinstance(edits, (str, Edit)):
            edits = [edits]
        try:
            self.sources = {k: Batch.of(v) for k, v in (sources or {}).items()}
        except BatchError as exc:
            raise ValueError(f"patch source: {exc}") from None
        self.targets = resolve_edits(model, list(edits), self.sources)
        self._states = [_State() for _ in self.targets]
        self._patched: list[list[torch.Tensor] | None] = [None] * len(self.targets)
        self._handles: list[Any] = []

    @property
    def edits(self) -> list[Edit]:
        """The distinct edits, in the order given."""
        return list(dict.fromkeys(t.edit for t in self.targets))

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the ``patch`` sources (each once, ``no_grad``, random state restored) and put
        the hooks in place."""
        self._record_sources()
        # each hook is prepended (before the capture's own), so the last registered runs
        # first: register in reverse, and edits of one module run in the order given
        for i, t in reversed(list(enumerate(self.targets))):
            if t.kind in ("head", "expert_fused"):
                self._handles.append(t.module.register_forward_pre_hook(
                    self._pre_hook(i), with_kwargs=True, prepend=True))
            elif t.kind == "pattern":
                self._handles += pattern_hooks(t.module, t.size, self._pattern_edit(i),
                                               self._states[i])
            else:
                self._handles.append(t.module.register_forward_hook(
                    self._post_hook(i), prepend=True))

    def stop(self, backward_ran: bool) -> tuple[list[AppliedEdit], list[Note]]:
        """Remove the hooks; return what each target did and a note for each that changed
        nothing (never called, values unchanged, output not reaching the loss)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        records, notes = [], []
        for t, st in zip(self.targets, self._states, strict=True):
            rec = AppliedEdit(t.edit.spec, t.name, t.hooked, st.calls, st.changed)
            if st.watched and backward_ran:
                rec.reached_loss = st.grads > 0
            rec.note = self._why(t, st, rec)
            records.append(rec)
            if rec.note and (not rec.applied or rec.reached_loss is False):
                notes.append(Note("edit", f"{t.edit.spec}: {rec.note}", module=t.hooked))
        return records, notes

    @staticmethod
    def _why(t: Target, st: _State, rec: AppliedEdit) -> str | None:
        if st.calls == 0:
            what = (f"expert {t.edit.expert} got no tokens" if t.kind == "expert_list"
                    else f"{t.hooked} was never called")
            return f"{what}: the edit changed nothing"
        if st.changed == 0:
            return st.why or "the edited values equal the model's own: the edit changed nothing"
        if rec.reached_loss is False:
            return ("the edited output did not reach the loss (no gradient came back to it): "
                    "the edit changed nothing the loss sees")
        return st.why

    # -- patch sources --------------------------------------------------------------------------
    def _record_sources(self) -> None:
        by_source: dict[str, list[int]] = {}
        for i, t in enumerate(self.targets):
            if t.edit.needs_source:
                by_source.setdefault(t.edit.source, []).append(i)
        for name, idx in by_source.items():
            seen: dict[int, list[Any]] = {i: [] for i in idx}
            handles = []
            for i in idx:
                handles += self._recorder(self.targets[i], seen[i])
            try:
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    self.sources[name].call(self.model)
            except Exception as exc:  # the model refused the source batch: one line
                text = " ".join(f"{type(exc).__name__}: {exc}".split())
                raise ValueError(f"patch source {name!r}: the model raised {text[:300]}") \
                    from None
            finally:
                for h in handles:
                    h.remove()
            for i in idx:
                self._patched[i] = seen[i]

    @staticmethod
    def _recorder(t: Target, seen: list[Any]) -> list[Any]:
        """Hooks that append what ``t`` reads from the source run to ``seen``, one entry per
        call: the output (``output``, ``columns``), the o projection's input (``head``), the
        list of probabilities (``pattern``)."""
        if t.kind == "head":
            def keep_in(mod, args, kwargs):
                x = args[0] if args else kwargs.get("input", kwargs.get("x"))
                seen.append(x.detach().clone() if isinstance(x, torch.Tensor) else None)
            return [t.module.register_forward_pre_hook(keep_in, with_kwargs=True)]
        if t.kind == "pattern":
            return record_pattern(t.module, t.size, seen)

        def keep(mod, args, output):
            x, _ = first_float(output)
            seen.append(None if x is None else x.detach().clone())
        return [t.module.register_forward_hook(keep)]

    # -- hooks ----------------------------------------------------------------------------------
    def _watch(self, st: _State, t: torch.Tensor) -> None:
        if t.requires_grad:
            st.watched = True

            def count(grad):
                st.grads += 1

            t.register_hook(count)

    def _post_hook(self, i: int):
        t, st = self.targets[i], self._states[i]

        def hook(mod, args, output):
            from hooks.engine.recompute import in_backward

            if not in_backward():
                st.index += 1
            st.calls += 1
            if t.kind == "router":
                return self._route(i, output)
            x, put = first_float(output)
            if x is None:
                st.why = "its output holds no floating-point tensor: nothing to edit"
                return None
            if t.kind == "columns":  # counts and watches its own columns
                new = self._edit_columns(i, x, st.index - 1)
                return None if new is None else put(new)
            new = self._new_output(i, x, st.index - 1)
            if new is None:
                return None
            if not torch.equal(new, x):
                st.changed += 1
            self._watch(st, new)
            return put(new)

        return hook

    def _new_output(self, i: int, x: torch.Tensor, call: int) -> torch.Tensor | None:
        t, st = self.targets[i], self._states[i]
        e = t.edit
        if e.op == "zero":
            return _leaf_like(torch.zeros_like(x), x)
        if e.op == "scale":
            return x * e.by
        if e.op == "mean":
            dims = tuple(range(x.dim() - 1)) if x.dim() > 1 else tuple(range(x.dim()))
            return x.mean(dim=dims, keepdim=True).expand_as(x).contiguous()
        if e.op == "clamp":
            return x.clamp(min=e.min, max=e.max)
        if e.op == "add" and t.vector is not None:
            check_vector_width(e.spec, t.vector, x, t.hooked)
            return x + t.vector.to(dtype=x.dtype, device=x.device) * (
                1.0 if e.scale is None else e.scale)
        src = self._source(i, call)
        if src is None:
            return None
        if e.op == "add":
            if src.shape != x.shape:
                st.why = (f"the source output has shape {tuple(src.shape)}, this call "
                          f"{tuple(x.shape)}: not added")
                return None
            return x + src.to(dtype=x.dtype, device=x.device) * (
                1.0 if e.scale is None else e.scale)
        return self._patch(st, x, src, e)

    def _source(self, i: int, call: int) -> Any:
        """What the source run recorded for call ``call`` of target ``i``, or None (said in
        the target's note)."""
        t, st = self.targets[i], self._states[i]
        srcs = self._patched[i] or []
        if call >= len(srcs) or srcs[call] is None:
            st.why = (f"the source batch ran {len(srcs)} call(s) of {t.hooked}, not call "
                      f"{call}: not {'added' if t.edit.op == 'add' else 'patched'}")
            return None
        return srcs[call]

    @staticmethod
    def _patch(st: _State, x: torch.Tensor, src: torch.Tensor, e: Edit) -> torch.Tensor | None:
        if e.pos is None:
            if src.shape != x.shape:
                st.why = (f"the source output has shape {tuple(src.shape)}, this call "
                          f"{tuple(x.shape)}: not patched (give pos= to patch positions)")
                return None
            return _leaf_like(src, x)
        pos = parse_positions(e.pos)
        if x.dim() < 3 or src.shape != x.shape:
            st.why = (f"pos= patches the positions T of (B, T, ...) outputs of the source's "
                      f"shape; source {tuple(src.shape)} vs {tuple(x.shape)}: not patched")
            return None
        n = x.shape[1]
        try:
            idx = torch.arange(n)[pos] if isinstance(pos, slice) else torch.tensor(
                [p + n if p < 0 else p for p in pos])
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise IndexError
        except IndexError:
            st.why = f"pos={e.pos} is outside the {n} positions: not patched"
            return None
        out = x.clone()
        out[:, idx] = src[:, idx].to(dtype=x.dtype, device=x.device)
        return out

    def _pre_hook(self, i: int):
        t, st = self.targets[i], self._states[i]

        def hook(mod, args, kwargs):
            from hooks.engine.recompute import in_backward

            if not in_backward():
                st.index += 1
            st.calls += 1
            if t.kind == "head":
                return self._edit_head(i, args, kwargs)
            return self._zero_expert_weights(t, st, args, kwargs)

        return hook

    def _edit_head(self, i: int, args: tuple, kwargs: dict):
        """``zero``/``scale``/``patch`` of columns ``[start, stop)`` of the o projection's
        input (..., H·Dh): one head's output before the projection mixes the heads."""
        t, st = self.targets[i], self._states[i]
        x = args[0] if args else kwargs.get("input", kwargs.get("x"))
        if not isinstance(x, torch.Tensor) or x.shape[-1] != t.width:
            st.why = f"{t.hooked} was called without its (..., H·Dh) input: head not edited"
            return None
        new = self._edit_columns(i, x, st.index - 1)
        if new is None:
            return None
        if args:
            return (new, *args[1:]), kwargs
        key = "input" if "input" in kwargs else "x"
        return args, {**kwargs, key: new}

    def _edit_columns(self, i: int, x: torch.Tensor, call: int) -> torch.Tensor | None:
        """``x`` (..., W) with columns ``[start, stop)`` zeroed, scaled or taken from the
        source run (at positions ``pos`` of dimension 1 when given); counts a change."""
        t, st = self.targets[i], self._states[i]
        a, b, e = t.start, t.stop, t.edit
        if x.shape[-1] != t.width:
            st.why = f"{t.hooked}'s output is {tuple(x.shape)}, not (..., {t.width}): not edited"
            return None
        cols = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
        cols[a:b] = True
        if e.op == "zero":
            new = x.masked_fill(cols, 0)
        elif e.op == "scale":
            new = torch.where(cols, x * e.by, x)
        else:
            src = self._source(i, call)
            if src is None:
                return None
            whole = self._patch(st, x, src, e)
            if whole is None:
                return None
            new = torch.where(cols, whole.to(x.dtype), x)
        if not torch.equal(new[..., a:b], x[..., a:b]):
            st.changed += 1
        self._watch(st, new)
        return new

    def _pattern_edit(self, i: int):
        """``edit(P, j)`` for :func:`pattern_hooks`: head ``h``'s (or every head's)
        probabilities (B, H, T, S) zeroed, scaled or taken from the source run's same call."""
        t, st = self.targets[i], self._states[i]
        e = t.edit
        heads = slice(None) if e.head is None else slice(e.head, e.head + 1)

        def edit(p: torch.Tensor, j: int, count: bool = True) -> torch.Tensor:
            new = p.clone()
            if e.op == "zero":
                new[:, heads] = 0
            elif e.op == "scale":
                new[:, heads] = p[:, heads] * e.by
            else:
                got = self._source(i, st.index - 1)
                if got is None or j >= len(got) or got[j].shape != p.shape:
                    shape = None if got is None or j >= len(got) else tuple(got[j].shape)
                    st.why = (f"the source run's pattern {j} of this call is {shape}, this "
                              f"one {tuple(p.shape)}: not patched")
                    return p
                rows = _rows(e.pos, p.shape[2])
                if rows is None:
                    st.why = f"pos={e.pos} is outside the {p.shape[2]} positions: not patched"
                    return p
                new[:, heads, rows] = got[j][:, heads, rows].to(p.dtype)
            if count and not torch.equal(new[:, heads], p[:, heads]):
                st.changed += 1
            if count:
                self._watch(st, new)
            return new

        return edit

    def _zero_expert_weights(self, t: Target, st: _State, args: tuple, kwargs: dict):
        from hooks.probes.routing import routing_args

        got = routing_args(args, kwargs)
        if isinstance(got, str):
            st.why = f"{got}: expert not zeroed"
            return None
        _, ids, w = got
        hit = ids == t.edit.expert
        new_w = w.masked_fill(hit, 0)
        if bool((w[hit] != 0).any()):
            st.changed += 1
        self._watch(st, new_w)
        if len(args) >= 3:
            return (*args[:2], new_w, *args[3:]), kwargs
        keys = [k for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
        key = keys[2 - len(args)] if len(keys) > 2 - len(args) else "top_k_weights"
        return args, {**kwargs, key: new_w}

    def _route(self, i: int, output: Any):
        t, st = self.targets[i], self._states[i]
        e = t.edit.expert
        parts = list(output) if isinstance(output, (tuple, list)) else [output]
        li = next((j for j, p in enumerate(parts) if isinstance(p, torch.Tensor)
                   and p.is_floating_point() and p.dim() >= 1 and p.shape[-1] == t.size), None)
        if li is None:
            st.why = f"{t.hooked} returned no (N, {t.size}) logits: expert not dropped"
            return None
        logits = parts[li]
        col = torch.arange(t.size, device=logits.device) == e
        masked = logits.masked_fill(col, -math.inf)
        parts[li] = masked
        ii = next((j for j, p in enumerate(parts) if isinstance(p, torch.Tensor)
                   and not p.is_floating_point() and p.dim() == 2), None)
        wi = next((j for j, p in enumerate(parts) if j != li and isinstance(p, torch.Tensor)
                   and ii is not None and p.is_floating_point()
                   and p.shape == parts[ii].shape), None)
        if ii is not None and wi is not None:  # the router chose already: choose again
            ids, w = self._choose_again(t, st, logits, masked, parts[ii], parts[wi])
            if ids is None:
                return None
            parts[ii], parts[wi] = ids, w
            picked = bool((output[ii] == e).any())
        else:  # the block chooses from these logits: did E make its top k?
            k = _top_k(t)
            picked = True if k is None else bool(
                (logits.detach().topk(min(k, t.size), dim=-1).indices == e).any())
            w = masked
        if picked:
            st.changed += 1
        else:
            st.why = (f"expert {e} was in no token's top k: dropping it changed no choice, "
                      "the edit changed nothing")
        self._watch(st, w)
        if not isinstance(output, (tuple, list)):
            return parts[0]
        return type(output)(parts) if isinstance(output, list) else tuple(parts)

    @staticmethod
    def _choose_again(t: Target, st: _State, logits, masked, ids, w):
        from hooks.probes.routing import BIAS_ATTRS, first_attr, infer_rule

        router = t.module
        rule, _ = infer_rule(logits.reshape(-1, logits.shape[-1]), ids, w, router)
        if rule.scoring == "unknown" or rule.groups is not None:
            why = "unknown" if rule.scoring == "unknown" else "group-limited (not supported)"
            st.why = f"{t.hooked}'s routing rule is {why}: expert not dropped"
            return None, None
        m = masked.reshape(-1, masked.shape[-1]).float()
        scores = torch.softmax(m, dim=-1) if rule.scoring == "softmax" else torch.sigmoid(m)
        choice = scores
        if rule.bias:
            choice = scores + first_attr(router, BIAS_ATTRS).detach().float()
        _, new_ids = torch.topk(choice, ids.shape[-1], dim=-1)
        picked = scores.gather(1, new_ids)
        if rule.normalized:
            picked = picked / picked.sum(dim=-1, keepdim=True)
        if rule.scale is not None:
            picked = picked * rule.scale
        return new_ids.to(ids.dtype), picked.to(w.dtype)


__all__ = ["Editor", "first_float"]
