"""``hooks.patch_sweep`` and ``hooks.attribution_patch``: which layers, positions and heads carry
what a clean input has and a corrupted one lacks.

**Activation patching** (:func:`patch_sweep`; Meng et al. 2022, "Locating and editing factual
associations in GPT", causal tracing; Heimersheim & Nanda 2024, "How to use and interpret
activation patching"). The model runs on the *corrupted* batch, and one activation at a time is
taken from the *clean* run instead (TransformerLens's convention in ``patching.get_act_patch_*``:
"denoising"); each cell of the sweep is the metric of that patched run:

* ``over="layers×positions"``: decoder block l's output (the residual stream after it) at
  position t, for every row of the batch: values (L, T);
* ``over="heads"``: attention head h of block l's output (its slice of the output projection's
  input, TransformerLens's ``hook_z``) at every position: values (L, H);
* ``over="layers"``: block l's whole output: values (L,).

One clean run and one corrupted run are recorded; the patched runs of one layer go as one batch
of copies, each resumed at the patched block from the corrupted run's recorded block inputs
(:mod:`hooks.whatif.resume`), not from the embeddings. Where resuming does not reproduce the
model's own logits, whole patched forward passes are run instead (still batched) and
:attr:`Sweep.notes` says so.

**Attribution patching** (:func:`attribution_patch`; Nanda 2023, "Attribution patching:
activation patching at industrial scale"; Syed et al. 2023, "Attribution patching outperforms
automated circuit discovery"): the first-order estimate of the same sweep from one forward and
backward pass on the corrupted batch and one forward pass on the clean batch::

    value(a) ≈ metric(corrupt) + (a_clean − a_corrupt) · ∂metric/∂a |corrupt

summed over the patched activation's elements (and the batch rows). This is the direction of
TransformerLens's attribution patching demo (``corrupted_grad_cache * (clean_cache −
corrupted_cache)``): the gradient is taken on the run that receives the patches, so that the
estimate approximates :func:`patch_sweep` cell by cell. (Issue 36 wrote it as
``(a_corrupt − a_clean) · ∂metric/∂a`` at the clean run: the same formula with the two batches'
names exchanged, which estimates the opposite patch, "noising".) :attr:`Sweep.values` holds the
estimated metric, so that :meth:`Sweep.normalized` reads both kinds alike; the estimated change
is ``values − corrupt``.

Dimension legend: L decoder blocks, T positions, H query heads, Dh head dim, B batch, D hidden.

Never imports textual, rich or tui.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: The sweeps :func:`patch_sweep` makes (``over=``).
OVERS = ("layers×positions", "heads", "layers")
_OVER_ALIASES = {"layersxpositions": "layers×positions", "layers*positions": "layers×positions",
                 "layers×positions": "layers×positions", "heads": "heads", "layers": "layers"}
#: Logits (relative to their largest) by which resumed runs may differ from the model's own
#: before the sweep runs whole forward passes instead: batching and rounding stay far below it.
RESUME_RTOL = 1e-4


def parse_over(over: str) -> str:
    """The canonical name of ``over`` (``layersxpositions`` and ``layers*positions`` are
    ``layers×positions``).

    Raises:
        ValueError: not one of :data:`OVERS`.
    """
    key = str(over).strip().lower().replace(" ", "")
    if key not in _OVER_ALIASES:
        raise ValueError(f"over={over!r}: give one of {', '.join(OVERS)} (or layersxpositions)")
    return _OVER_ALIASES[key]


@dataclass
class Sweep:
    """A patching sweep (:func:`patch_sweep`) or its attribution estimate
    (:func:`attribution_patch`).

    Attributes:
        over: ``layers×positions``, ``heads`` or ``layers``.
        metric: the metric's spec (``loss``, ``logit_diff:A,B``).
        method: ``patch`` (exact) or ``attribution`` (first-order estimate).
        values: (L, T), (L, H) or (L,) float: the metric of each patched run (estimated, for
            ``attribution``).
        rows: the L decoder blocks' qualified names.
        clean: the metric of the clean run (everything patched).
        corrupt: the metric of the corrupted run (nothing patched).
        notes: what the sweep could not do as described, in words.
    """

    over: str
    metric: str
    method: str
    values: torch.Tensor
    rows: list[str]
    clean: float
    corrupt: float
    notes: list[str] = field(default_factory=list)

    def normalized(self) -> torch.Tensor:
        """``(values − corrupt) / (clean − corrupt)``: 0 where a patch changes nothing, 1 where
        it restores the clean metric (NaN everywhere when the two ends are equal)."""
        span = self.clean - self.corrupt
        if span == 0:
            return torch.full_like(self.values, float("nan"))
        return (self.values - self.corrupt) / span

    def correlation(self, other: Sweep) -> float:
        """Pearson's correlation of this sweep's values with ``other``'s (same shape); NaN when
        either is constant.

        Raises:
            ValueError: the shapes differ.
        """
        if self.values.shape != other.values.shape:
            raise ValueError(f"sweeps of shapes {tuple(self.values.shape)} and "
                             f"{tuple(other.values.shape)} cannot be correlated")
        a = self.values.double().flatten()
        b = other.values.double().flatten()
        a, b = a - a.mean(), b - b.mean()
        den = float(a.norm() * b.norm())
        return float((a * b).sum()) / den if den > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (values as nested lists; NaN and inf as text)."""
        def num(x: float) -> float | str:
            return x if math.isfinite(x) else str(x)

        def nested(v):
            return [nested(x) for x in v] if isinstance(v, list) else num(float(v))

        return {"over": self.over, "metric": self.metric, "method": self.method,
                "shape": list(self.values.shape), "rows": list(self.rows),
                "clean": num(self.clean), "corrupt": num(self.corrupt),
                "values": nested(self.values.tolist()), "notes": list(self.notes)}


def _setup(model: nn.Module, clean: Any, over: str, metric: Any, tokenizer: Any):
    """(parts, over, metric bound to the clean batch's targets) or one-line ValueError."""
    from hooks.batch import Batch
    from hooks.whatif.metric import Metric, parse_metric
    from hooks.whatif.stream import stream_parts

    over = parse_over(over)
    parts = stream_parts(model)
    if over == "heads":
        bad = next((b for b in parts.blocks if b.out_proj is None), None)
        if bad is not None:
            raise ValueError(f"over=heads: {bad.name} has no attention heads mdb can patch "
                             f"({bad.why})")
    b = Batch.of(clean)
    if b.tokenizer is not None and tokenizer is None:
        tokenizer = b.tokenizer
    head = dict(model.named_modules())[parts.head]
    vocab = getattr(head, "out_features", None)
    m = metric if isinstance(metric, Metric) else parse_metric(metric, tokenizer, vocab)
    targets, _slot = b.targets_tensor(model)
    if not isinstance(targets, torch.Tensor) or targets.dim() != 2:
        targets = b.ids(model)
    return parts, over, m.bind(targets)


def _check_pair(c, r) -> None:
    if c.h_in[0].shape != r.h_in[0].shape:
        raise ValueError(f"the clean batch's residual stream is {tuple(c.h_in[0].shape)}, the "
                         f"corrupted one's {tuple(r.h_in[0].shape)}: patching needs the same "
                         "(B, T)")


def _reads_note(m, over: str, t: int) -> list[str]:
    if over == "heads" or over == "layers":
        return []
    read = set(m.reads(t))
    unread = [p for p in range(t) if p > max(read, default=-1)]
    if not unread:
        return []
    where = f"position {unread[0]}" if len(unread) == 1 else f"positions {unread[0]}…{unread[-1]}"
    return [f"{where}: the metric {m.spec} reads no logits there or after (a causal model's "
            "later positions cannot reach it), so patching there cannot change it"]


def patch_sweep(model: nn.Module, clean: Any, corrupt: Any, over: str = "layers×positions",
                metric: Any = "loss", *, tokenizer: Any = None, chunk: int | None = None
                ) -> Sweep:
    """Activation patching over every layer × position, head or layer (module docstring).

    Args:
        model: a decoder-only model (HF ``*ForCausalLM``, minillm, one with an ``nn.ModuleList``
            of blocks, a final norm and an LM head: :func:`hooks.whatif.stream.stream_parts`).
        clean: the batch whose activations are patched in (anything :meth:`hooks.Batch.of`
            takes).
        corrupt: the batch the model runs on, of the same (B, T).
        over: ``layers×positions`` (also ``layersxpositions``, ``layers*positions``), ``heads``
            or ``layers``.
        metric: ``loss`` or ``logit_diff:A,B`` (:mod:`hooks.whatif.metric`), or a
            :class:`hooks.whatif.metric.Metric`.
        tokenizer: encodes A and B of ``logit_diff`` given as text (default: the batch's).
        chunk: most copies per batched run (default: all of one layer).

    Returns:
        A :class:`Sweep`; ``values`` (L, T), (L, H) or (L,), float32 (float64 for a float64
        model). The model is run in eval mode (its flags restored after), without gradients.

    Raises:
        ValueError: one line: a model whose blocks, norm or head are not found, ``heads`` on a
            block without recognised heads, batches of different shapes, a bad metric or over,
            a loss that counts no token, ``chunk`` < 1.
    """
    from hooks.whatif.resume import Resumer, eval_mode, record

    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1 copies, got {chunk}")
    parts, over, m = _setup(model, clean, over, metric, tokenizer)
    with eval_mode(model), torch.no_grad():
        c = record(model, clean, parts, heads=over == "heads")
        r = record(model, corrupt, parts, heads=over == "heads")
        _check_pair(c, r)
        resumer = Resumer(model, parts, r)
        scale = max(float(r.logits.float().abs().max()), 1.0)
        resume = resumer.check() <= RESUME_RTOL * scale
        notes = [] if resume else ["resuming at the patched block did not reproduce the "
                                   "model's logits: whole forward passes were run instead"]
        runner = _Runner(model, corrupt, parts, c, r, resumer if resume else None, m, chunk)
        values = runner.sweep(over)
        ends = m(c.logits), m(r.logits)
    t = int(r.h_in[0].shape[1])
    return Sweep(over, m.spec, "patch", values, parts.layers, float(ends[0][0]),
                 float(ends[1][0]), notes + _reads_note(m, over, t))


class _Runner:
    """The patched runs of one sweep, by layer, in batches of copies."""

    def __init__(self, model, corrupt, parts, c, r, resumer, m, chunk) -> None:
        modules = dict(model.named_modules())
        self.model, self.corrupt, self.parts, self.c, self.r = model, corrupt, parts, c, r
        self.resumer, self.m, self.chunk = resumer, m, chunk
        self.blocks = [modules[b.name] for b in parts.blocks]
        self.projs = [modules[b.out_proj] if b.out_proj else None for b in parts.blocks]
        self.rows = r.rows

    def sweep(self, over: str) -> torch.Tensor:
        n_layers = len(self.blocks)
        if over == "layers":
            return torch.stack([self._outputs(i, [None])[0] for i in range(n_layers)])
        if over == "heads":
            return torch.stack([self._heads(i) for i in range(n_layers)])
        t = int(self.r.h_in[0].shape[1])
        return torch.stack([self._outputs(i, list(range(t))) for i in range(n_layers)])

    def _chunks(self, items: list) -> list[list]:
        size = self.chunk or len(items)
        return [items[i:i + size] for i in range(0, len(items), size)]

    def _outputs(self, layer: int, positions: list) -> torch.Tensor:
        """Block ``layer``'s output patched at each of ``positions`` (None: all), one copy each."""
        b, src = self.rows, self.c.h_out[layer]
        out = []
        for ps in self._chunks(positions):
            def patch(h, n, ps=ps):
                h = h.clone()
                for j, p in enumerate(ps):
                    if p is None:
                        h[j * b:(j + 1) * b] = src
                    else:
                        h[j * b:(j + 1) * b, p] = src[:, p]
                return h

            n = len(ps)
            if self.resumer is not None:
                base = self.r.h_out[layer].repeat(n, *([1] * (src.dim() - 1)))
                logits = self.resumer.logits(layer + 1, patch(base, n), n)
            else:
                from hooks.whatif.resume import full_patched

                logits = full_patched(self.model, self.corrupt, n, self.blocks[layer], patch)
            out.append(self.m(logits, n))
        return torch.cat(out)

    def _heads(self, layer: int) -> torch.Tensor:
        """Head h of block ``layer`` patched at every position, one copy per head."""
        bp = self.parts.blocks[layer]
        b, dh, src = self.rows, bp.head_dim, self.c.z[layer]
        out = []
        for hs in self._chunks(list(range(bp.heads))):
            def patch(z, n, hs=hs):
                z = z.clone()
                for j, h in enumerate(hs):
                    z[j * b:(j + 1) * b, ..., h * dh:(h + 1) * dh] = src[..., h * dh:(h + 1) * dh]
                return z

            n = len(hs)
            if self.resumer is not None:
                h_in = self.r.h_in[layer]
                base = h_in.repeat(n, *([1] * (h_in.dim() - 1)))
                logits = self.resumer.logits(layer, base, n, z_patch=patch)
            else:
                from hooks.whatif.resume import full_patched

                logits = full_patched(self.model, self.corrupt, n, self.projs[layer], patch,
                                      on_input=True)
            out.append(self.m(logits, n))
        return torch.cat(out)


def attribution_patch(model: nn.Module, clean: Any, corrupt: Any,
                      over: str = "layers×positions", metric: Any = "loss", *,
                      tokenizer: Any = None) -> Sweep:
    """Attribution patching: the first-order estimate of :func:`patch_sweep` (module docstring)
    from one forward and backward pass on ``corrupt`` and one forward pass on ``clean``.

    Arguments as :func:`patch_sweep`. The model's ``.grad`` are not touched (the gradients are
    taken with ``torch.autograd.grad`` with respect to the activations only).

    Returns:
        A :class:`Sweep` with ``method="attribution"``: ``values`` = ``corrupt`` + the estimated
        change, (L, T), (L, H) or (L,).

    Raises:
        ValueError: as :func:`patch_sweep`.
    """
    from hooks.whatif.resume import eval_mode, record

    parts, over, m = _setup(model, clean, over, metric, tokenizer)
    heads = over == "heads"
    with eval_mode(model):
        r = record(model, corrupt, parts, heads=heads, grad=True)
        with torch.no_grad():
            c = record(model, clean, parts, heads=heads)
        _check_pair(c, r)
        value = m(r.logits)[0]
        acts = r.z if heads else r.h_out
        grads = torch.autograd.grad(value, acts, allow_unused=True)
    rows = []
    for i, (a, g) in enumerate(zip(acts, grads, strict=True)):
        src = c.z[i] if heads else c.h_out[i]
        g = torch.zeros_like(a) if g is None else g
        d = (src - a.detach()) * g  # (B, T, D) or (B, T, H·Dh)
        if over == "layers":
            rows.append(d.sum())
        elif heads:
            bp = parts.blocks[i]
            rows.append(d.reshape(*d.shape[:2], bp.heads, bp.head_dim).sum((0, 1, 3)))
        else:
            rows.append(d.sum((0, 2)))
    corrupt_end = float(value.detach())
    values = torch.stack(rows).detach() + corrupt_end
    clean_end = float(m(c.logits)[0])
    t = int(r.h_in[0].shape[1])
    return Sweep(over, m.spec, "attribution", values, parts.layers, clean_end, corrupt_end,
                 _reads_note(m, over, t))


__all__ = ["OVERS", "RESUME_RTOL", "Sweep", "attribution_patch", "parse_over", "patch_sweep"]
