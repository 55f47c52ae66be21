"""``hooks.logit_lens``: what each decoder layer already predicts.

The logit lens (nostalgebraist, "interpreting GPT: the logit lens", 2020) reads the residual
stream after every decoder layer through the model's *own* final norm and LM head::

    logits_l = post(head(final_norm(h_l)))        h_l: the output of decoder layer l

``post`` is what the model does to its logits after the head, when it declares it: Gemma 2/3's
``final_logit_softcapping`` (``c · tanh(x / c)``), Cohere's ``logit_scale`` (``x · s``),
Granite's ``logits_scaling`` (``x / s``). At the last layer this is the model's own computation,
so ``lens.logits(-1)`` equals the logits the model returned; the lens checks that on every call
(:attr:`Lens.last_layer_error`) and says so in :attr:`Lens.notes` when it does not hold.

HF models return a last hidden state that already went through the final norm; the lens never
reads it. It hooks the decoder layers themselves, whose outputs are pre-norm, and applies the
norm once.

Dimension legend: L decoder layers, B batch, T positions, D hidden size, V vocabulary, k top-k.

Never imports textual, rich or tui.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# The parts the lens reads, found in one place for every what-if experiment (re-exported here:
# ``hooks.whatif.lens.find_parts`` is what the lens command calls).
from hooks.whatif.stream import (  # noqa: F401
    FINAL_NORM_NAMES,
    LAYER_LIST_NAMES,
    LensParts,
    find_parts,
    output_logits,
)

#: The last layer's lens may differ from the model's logits by this much (relative to their
#: largest magnitude) before :attr:`Lens.notes` says so: the same ops in the same order agree
#: exactly; a different kernel for the same matmul within a few ulps.
LAST_LAYER_RTOL = 1e-5


@dataclass(frozen=True, slots=True)
class LensToken:
    """One of a position's most likely next tokens at one layer.

    Attributes:
        id: the token id.
        text: its text from the tokenizer (printable), or ``#id`` without one.
        prob: its probability, softmax of that layer's lens logits (fp32).
    """

    id: int
    text: str
    prob: float


@dataclass
class Lens:
    """The result of :func:`logit_lens`.

    Attributes:
        layers: the decoder layers' qualified names, in order (L of them).
        norm: the final norm's qualified name.
        head: the LM head's qualified name.
        post: what is applied after the head (``"none"``, ``"soft-cap 30 · tanh(x / 30)"``,
            ``"× logit_scale 0.0625"``, ``"÷ logits_scaling 8"``).
        ids: (B, T) int64 input ids, or None when the batch has none.
        top_ids: (L, B, T, k) int64, each position's k most likely tokens per layer.
        top_probs: (L, B, T, k) float32, their probabilities.
        last_layer_error: max |lens.logits(-1) - model logits| (None when the model's output
            holds no (B, T, V) logits to compare with).
        notes: what the lens could not do or check, in words.
    """

    layers: list[str]
    norm: str
    head: str
    post: str
    ids: torch.Tensor | None
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    last_layer_error: float | None = None
    notes: list[str] = field(default_factory=list)
    _hidden: torch.Tensor | None = field(default=None, repr=False)
    _mid: torch.Tensor | None = field(default=None, repr=False)
    _mid_why: str = field(default="", repr=False)
    _apply: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def num_layers(self) -> int:
        """L, the number of decoder layers read."""
        return len(self.layers)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T) of the batch."""
        return int(self.top_ids.shape[1]), int(self.top_ids.shape[2])

    def _layer(self, layer: int) -> int:
        n = self.num_layers
        if not -n <= layer < n:
            raise ValueError(f"layer {layer} out of range: the model has {n} decoder layers "
                             f"(0..{n - 1}, or -1 for the last)")
        return layer % n

    def logits(self, layer: int, where: str = "out") -> torch.Tensor:
        """(B, T, V) float32 lens logits of decoder layer ``layer`` (negative counts from the
        end): ``post(head(final_norm(h)))``, computed again from the kept (B, T, D) residual
        stream ``h``: the layer's output (``where="out"``), or the residual in the middle of the
        block, after attention and before the MLP (``where="mid"``: the block's input plus its
        attention's output, TransformerLens's ``resid_mid``).

        Raises:
            ValueError: ``layer`` out of range, ``where`` not ``out``/``mid``, or ``mid`` on a
                model whose blocks have no attention the lens recognises (the reason said).
        """
        i = self._layer(layer)
        assert self._hidden is not None and self._apply is not None
        if where not in ("out", "mid"):
            raise ValueError(f"where={where!r}: give 'out' (the block's output) or 'mid' (after "
                             "attention, before the MLP)")
        if where == "mid" and self._mid is None:
            raise ValueError(f"the lens at mid-block is not available: {self._mid_why}")
        with torch.no_grad():
            return self._apply((self._mid if where == "mid" else self._hidden)[i]).float()

    def top(self, layer: int, position: int, k: int | None = None,
            row: int = 0, where: str = "out") -> list[LensToken]:
        """The ``k`` most likely next tokens at ``position`` of batch row ``row`` after decoder
        layer ``layer`` (``where="mid"``: in its middle, see :meth:`logits`), most likely first
        (``k`` defaults to the k of :func:`logit_lens`).

        Raises:
            ValueError: ``layer``, ``position`` or ``row`` out of range, ``k`` < 1, or ``mid``
                where it is not available.
        """
        i = self._layer(layer)
        b, t = self.shape
        if not -t <= position < t:
            raise ValueError(f"position {position} out of range: the batch has {t} positions")
        if not 0 <= row < b:
            raise ValueError(f"row {row} out of range: the batch has {b} rows")
        kept = int(self.top_ids.shape[-1])
        k = kept if k is None else k
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if k <= kept and where == "out":
            ids = self.top_ids[i, row, position, :k].tolist()
            probs = self.top_probs[i, row, position, :k].tolist()
        else:
            p = torch.softmax(self.logits(i, where)[row, position], dim=-1)
            vals, idx = p.topk(min(k, p.shape[-1]))
            ids, probs = idx.tolist(), vals.tolist()
        return [LensToken(int(j), self.text_of(int(j)), float(q))
                for j, q in zip(ids, probs, strict=True)]

    def text_of(self, token_id: int) -> str:
        """A printable label of ``token_id``: the tokenizer's token (``token_strings``,
        ``convert_ids_to_tokens`` or ``decode``), or ``#id`` without a tokenizer or when the
        tokenizer does not know the id."""
        return token_text(self._tokenizer, token_id)

    def table(self, row: int = 0, where: str = "out") -> tuple[list[list[str]], torch.Tensor]:
        """The top-1 grid of batch row ``row``: (L rows of T token texts, (L, T) probabilities)
        of the blocks' outputs, or (``where="mid"``) of their middles, computed then from
        :meth:`logits`.

        Raises:
            ValueError: ``row`` out of range, or ``mid`` where it is not available.
        """
        b, _ = self.shape
        if not 0 <= row < b:
            raise ValueError(f"row {row} out of range: the batch has {b} rows")
        if where == "out":
            ids, probs = self.top_ids[:, row, :, 0], self.top_probs[:, row, :, 0].clone()
        else:
            tops = [torch.softmax(self.logits(i, where)[row], -1).max(-1)
                    for i in range(self.num_layers)]
            ids = torch.stack([t.indices for t in tops])
            probs = torch.stack([t.values for t in tops])
        cache: dict[int, str] = {}
        texts = [[cache.setdefault(j, self.text_of(j)) for j in r] for r in ids.tolist()]
        return texts, probs


def token_text(tokenizer: Any, token_id: int) -> str:
    """A printable label of one id (see :meth:`Lens.text_of`)."""
    if tokenizer is None:
        return f"#{token_id}"
    size = getattr(tokenizer, "vocab_size", None)
    if isinstance(size, int) and not 0 <= token_id < size:
        return f"#{token_id}"
    try:
        for name in ("token_strings", "convert_ids_to_tokens"):
            fn = getattr(tokenizer, name, None)
            if callable(fn):
                out = fn([token_id])
                if out and isinstance(out[0], str):
                    return out[0]
        decoded = tokenizer.decode([token_id])
        if isinstance(decoded, str):
            return decoded.replace("\n", "\\n") or f"#{token_id}"
    except Exception:  # a tokenizer that cannot label this id
        pass
    return f"#{token_id}"


def _mid_hooks(model: nn.Module, modules: dict[str, nn.Module], parts: LensParts,
               mid: dict[int, Any]) -> list:
    """Hooks that keep each block's input (``mid[i] = [input]``) and add its attention's output
    to it (the residual after the attention add); ``mid["why"]`` when a block has none."""
    from hooks.whatif.stream import block_parts

    blocks = [block_parts(model, n, modules[n]) for n in parts.layers]
    bad = next((b for b in blocks if b.attention is None), None)
    if bad is not None:
        mid["why"] = f"{bad.name}: {bad.why}"
        return []

    def pre(i: int):
        def hook(_module, args, kwargs):
            h = args[0] if args else kwargs.get("hidden_states")
            if i not in mid and isinstance(h, torch.Tensor):
                mid[i] = [h.detach()]
        return hook

    def attn(i: int):
        def hook(_module, _args, out):
            a = out[0] if isinstance(out, (tuple, list)) else out
            if i in mid and len(mid[i]) == 1 and isinstance(a, torch.Tensor):
                mid[i].append(a.detach())
        return hook

    return [h for i, b in enumerate(blocks) for h in (
        modules[b.name].register_forward_pre_hook(pre(i), with_kwargs=True),
        modules[b.attention].register_forward_hook(attn(i)))]


def _run(model: nn.Module, batch: Any, parts: LensParts
         ) -> tuple[list[torch.Tensor], Any, dict[int, Any]]:
    """One forward (no grad) with hooks that keep each decoder layer's first output, and its
    input and attention output (:func:`_mid_hooks`)."""
    from hooks.batch import Batch

    modules = dict(model.named_modules())
    kept: dict[int, torch.Tensor] = {}
    mid: dict[int, Any] = {}

    def keep(i: int):
        def hook(_module, _args, out):
            h = out[0] if isinstance(out, (tuple, list)) else out
            if i not in kept and isinstance(h, torch.Tensor):
                kept[i] = h.detach()
        return hook

    handles = [modules[n].register_forward_hook(keep(i)) for i, n in enumerate(parts.layers)]
    handles += _mid_hooks(model, modules, parts, mid)
    try:
        with torch.no_grad():
            output = Batch.of(batch).call(model)
    finally:
        for h in handles:
            h.remove()
    missing = [parts.layers[i] for i in range(len(parts.layers)) if i not in kept]
    if missing:
        raise ValueError(f"decoder layer {missing[0]} did not run in the forward pass (or "
                         "returned no tensor): the logit lens has nothing to read there")
    return [kept[i] for i in range(len(parts.layers))], output, mid


def _mid_stack(mid: dict[int, Any], n: int) -> tuple[torch.Tensor | None, str]:
    """(L, B, T, D) block input + attention output, or (None, why not)."""
    if "why" in mid:
        return None, str(mid["why"])
    pairs = [mid.get(i) for i in range(n)]
    if any(p is None or len(p) != 2 or p[0].shape != p[1].shape for p in pairs):
        return None, "a block's attention gave no output of the residual stream's shape"
    return torch.stack([h + a for h, a in pairs]), ""


def logit_lens(model: nn.Module, batch: Any, k: int = 5, *, tokenizer: Any = None) -> Lens:
    """Read every decoder layer's output through the model's own final norm and LM head.

    One forward pass without gradients; each decoder layer's output (the residual stream,
    (B, T, D)) is kept, normalised by the final norm, projected by the head and post-processed
    as the model declares (see the module docstring). The k most likely tokens per layer and
    position are computed at once; :meth:`Lens.logits` recomputes a layer's (B, T, V) logits
    on demand (the kept state is L·B·T·D, not L·B·T·V).

    Args:
        model: a minillm or an HF-style decoder-only model (``get_output_embeddings()`` /
            ``lm_head``, a final norm ``model.norm`` / ``transformer.ln_f`` /
            ``model.model.norm``, the blocks as an ``nn.ModuleList``).
        batch: what the model is called with (a tensor of ids, a tuple, a dict or a
            :class:`hooks.Batch`).
        k: how many tokens :meth:`Lens.top` keeps per layer and position (>= 1).
        tokenizer: labels the tokens (default: the batch's, when it is a :class:`hooks.Batch`
            with one).

    Returns:
        A :class:`Lens`. ``lens.logits(-1)`` equals the model's own logits;
        :attr:`Lens.last_layer_error` is the measured difference.

    Raises:
        ValueError: one line, when the model has no decoder layers, final norm or head the lens
            can find (see :func:`find_parts`), ``k`` < 1, or a layer that did not run.
    """
    from hooks.batch import Batch

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    parts = find_parts(model)
    hidden, output, mid = _run(model, batch, parts)
    mids, why = _mid_stack(mid, len(parts.layers))
    modules = dict(model.named_modules())
    norm, head = modules[parts.norm], modules[parts.head]

    def apply(h: torch.Tensor) -> torch.Tensor:
        x = head(norm(h))
        return parts.post(x) if parts.post is not None else x

    tops, probs = [], []
    with torch.no_grad():
        last = None
        for h in hidden:
            z = apply(h)
            last = z
            p = torch.softmax(z.float(), dim=-1)
            v, i = p.topk(min(k, p.shape[-1]), dim=-1)
            tops.append(i)
            probs.append(v)
    b = Batch.of(batch)
    lens = Lens(parts.layers, parts.norm, parts.head, parts.post_text, b.ids(model),
                torch.stack(tops), torch.stack(probs), _hidden=torch.stack(hidden),
                _mid=mids, _mid_why=why, _apply=apply,
                _tokenizer=tokenizer if tokenizer is not None else b.tokenizer)
    _check_last(lens, last, output_logits(output))
    return lens


def _check_last(lens: Lens, last: torch.Tensor | None, ref: torch.Tensor | None) -> None:
    """Set :attr:`Lens.last_layer_error` and say in the notes when the last layer's lens is not
    the model's logits."""
    if ref is None or last is None:
        lens.notes.append("the model's output holds no (B, T, V) logits: the last layer's lens "
                          "could not be compared with them")
        return
    if ref.shape != last.shape:
        lens.notes.append(f"the model returned logits of shape {tuple(ref.shape)}, the lens "
                          f"{tuple(last.shape)}: not compared")
        return
    err = float((last.float() - ref.float()).abs().max())
    lens.last_layer_error = err
    scale = float(ref.float().abs().max())
    if not math.isfinite(err) or err > LAST_LAYER_RTOL * max(scale, 1.0):
        lens.notes.append(
            f"the last layer's lens differs from the model's logits by {err:.3g} (logits up to "
            f"{scale:.3g}): the model does something between its last layer and its logits "
            f"that {lens.norm} → {lens.head} → {lens.post} does not")

