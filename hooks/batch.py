"""How mdb runs a user's model on a user's batch, and which scalar it differentiates.

One set of conventions, shared by everything that runs a model the user brought: the captured
step (``mdb step``/``summary``/``capture``), the doctor's checks, and training runs
(``mdb overfit --model``, :func:`hooks.run`).

**The batch.** A factory (``--model module:function``) returns ``(model, batch)`` or
``(model, batch, loss_fn)``. ``batch`` is a tensor (the first positional argument), a tuple
of positional arguments, a dict of keyword arguments, or a :class:`Batch`, which can also carry
``targets`` that only the loss function sees and per-token text for the views. :class:`Batch`
binds the arguments to ``model.forward``'s signature and gives each a role by its name
(:data:`ROLE_NAMES`): the token ids, targets/labels, decoder inputs, masks.

**The loss** (:func:`select_loss`), in this order:

1. a ``loss_fn`` the user gave: ``loss_fn(output, batch)`` (an explicit choice wins);
2. the output's ``loss`` attribute or key (HF ``ModelOutput``, minillm, a dict);
3. the one 0-dim floating-point tensor in a returned tuple or list (nanoGPT's
   ``(logits, loss)``), or a 0-dim output itself;
4. only when nothing else exists, the mean of the output (the logits), which makes every
   gradient flow but is not a loss: :attr:`LossChoice.fallback` says so and every view shows it.

**Other batches of the same kind** (:meth:`Batch.resized`): the doctor runs a model on random
tokens of another length or batch size, or on edited ids. :meth:`Batch.target_layout` tells how
the targets relate to the ids (:class:`TargetLayout`: HF-aligned ``labels == input_ids``,
nanoGPT's next-token ``targets``, masked-LM labels, seq2seq labels, class labels), and
:meth:`Batch.resized` rewrites ids, targets, decoder inputs, masks and position ids so that they
stay consistent, or drops the targets when the forward does not need them.

Never imports textual, rich or tui.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: Roles of a forward argument, by the names models give them.
ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "ids": ("input_ids", "idx", "ids", "tokens", "token_ids", "src", "input", "inputs", "x"),
    "targets": ("labels", "targets", "target", "label", "y", "tgt"),
    "decoder_ids": ("decoder_input_ids",),
    "mask": ("attention_mask", "decoder_attention_mask", "src_key_padding_mask",
             "key_padding_mask", "padding_mask"),
    "positions": ("position_ids", "token_type_ids", "cache_position"),
}
_ROLE_OF = {n: role for role, names in ROLE_NAMES.items() for n in names}

LossFn = Callable[[Any, "Batch"], torch.Tensor]

#: Mask names whose "keep" value is 1/True (HF); other mask names mark padding with True.
_KEEP_MASKS = ("attention_mask", "decoder_attention_mask")


class BatchError(ValueError):
    """A factory's return value or batch that mdb cannot use; the message is one line that
    says what to return instead."""


def _is_ids(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point()
            and not t.is_complex() and t.dtype is not torch.bool)


@dataclass(frozen=True)
class Slot:
    """Where one forward argument sits.

    Attributes:
        where: the positional index (int) or keyword name (str) in :class:`Batch`.
        name: the forward parameter it binds to (the keyword itself, or the positional
            parameter's name from ``model.forward``'s signature; ``args[i]`` when unknown).
        role: ``ids``, ``targets``, ``decoder_ids``, ``mask``, ``positions`` or ``other``.
    """

    where: int | str
    name: str
    role: str


class Batch:
    """The arguments of one forward call, with what each of them is.

    Args:
        args: positional arguments of ``model(...)``.
        kwargs: keyword arguments of ``model(...)``.
        targets: what only the loss function sees (``loss_fn(output, batch)`` reads
            ``batch.targets``), e.g. class labels of a model whose forward takes none.
        token_text: one printable label per token of :attr:`ids`, row-major (B·T strings);
            the views show them instead of ids.
        tokenizer: an object with ``convert_ids_to_tokens`` (HF tokenizers) or ``decode``
            that labels :attr:`ids` when ``token_text`` is not given.
        meta: JSON-serialisable values about the batch (kept in the trace's meta).
    """

    def __init__(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                 targets: Any = None, token_text: Sequence[str] | None = None,
                 tokenizer: Any = None, meta: Mapping[str, Any] | None = None) -> None:
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.targets = targets
        self.token_text = list(token_text) if token_text is not None else None
        self.tokenizer = tokenizer
        self.meta = dict(meta or {})
        self._slots: list[Slot] | None = None
        self._model_forward: Any = None

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def of(cls, batch: Any) -> Batch:
        """A :class:`Batch` from what a factory returned: a tensor (the first positional
        argument), a tuple/list (positional arguments), a dict (keyword arguments) or a Batch.

        Raises:
            BatchError: any other type.
        """
        if isinstance(batch, Batch):
            return batch
        if isinstance(batch, torch.Tensor):
            return cls((batch,))
        if isinstance(batch, Mapping):
            return cls((), dict(batch))
        if isinstance(batch, (tuple, list)):
            return cls(tuple(batch))
        raise BatchError(
            "the batch must be a tensor, a tuple of positional arguments, a dict of keyword "
            f"arguments or a hooks.Batch, got {type(batch).__name__}")

    def replace(self, args: Sequence[Any] | None = None,
                kwargs: Mapping[str, Any] | None = None, **changes: Any) -> Batch:
        """A copy with other ``args``/``kwargs``/``targets``/``token_text``/``tokenizer``/
        ``meta`` (the rest kept)."""
        fields = dict(targets=self.targets, token_text=self.token_text,
                      tokenizer=self.tokenizer, meta=self.meta)
        fields.update(changes)
        out = Batch(self.args if args is None else args,
                    self.kwargs if kwargs is None else kwargs, **fields)
        return out

    # -- running --------------------------------------------------------------------------------
    def call(self, model: nn.Module) -> Any:
        """``model(*args, **kwargs)``."""
        return model(*self.args, **self.kwargs)

    # -- roles ----------------------------------------------------------------------------------
    def slots(self, model: nn.Module | None = None) -> list[Slot]:
        """Every tensor argument with its parameter name and role.

        Positional arguments are named by binding them to ``model.forward``'s signature
        (nanoGPT's ``forward(idx, targets)`` makes ``args[1]`` the targets). Without a model,
        or when binding fails, positionals are named ``args[i]`` and only the first 2-D integer
        tensor gets the ``ids`` role.
        """
        forward = getattr(model, "forward", None)
        if self._slots is not None and forward == self._model_forward:
            return self._slots
        names: list[str] = [f"args[{i}]" for i in range(len(self.args))]
        if forward is not None:
            try:
                params = [p for p in inspect.signature(forward).parameters.values()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
                for i in range(min(len(params), len(self.args))):
                    names[i] = params[i].name
            except (TypeError, ValueError):
                pass
        slots: list[Slot] = []
        for i, a in enumerate(self.args):
            if isinstance(a, torch.Tensor):
                slots.append(Slot(i, names[i], _ROLE_OF.get(names[i], "other")))
        for k, v in self.kwargs.items():
            if isinstance(v, torch.Tensor):
                slots.append(Slot(k, k, _ROLE_OF.get(k, "other")))
        # an ids role needs integer (B, T) ids; a float "x" is an input, not token ids
        slots = [dataclasses.replace(s, role="other")
                 if s.role == "ids" and not _is_ids(self.get(s.where)) else s for s in slots]
        if not any(s.role == "ids" for s in slots):
            for j, s in enumerate(slots):
                if s.role == "other" and _is_ids(self.get(s.where)):
                    slots[j] = dataclasses.replace(s, role="ids")
                    break
        self._slots, self._model_forward = slots, forward
        return slots

    def get(self, where: int | str) -> Any:
        """The argument at a positional index or keyword name."""
        return self.args[where] if isinstance(where, int) else self.kwargs[where]

    def slot(self, role: str, model: nn.Module | None = None) -> Slot | None:
        """The first argument with ``role``, or None."""
        return next((s for s in self.slots(model) if s.role == role), None)

    def ids(self, model: nn.Module | None = None) -> torch.Tensor | None:
        """The (B, T) integer token ids, or None (not a token model)."""
        s = self.slot("ids", model)
        return None if s is None else self.get(s.where)

    def token_labels(self, model: nn.Module | None = None) -> list[str]:
        """One printable label per token of :meth:`ids` (row-major): ``token_text`` if given,
        else the tokenizer's tokens, else the ids as decimal strings; [] without ids."""
        ids = self.ids(model)
        if ids is None:
            return []
        n = ids.numel()
        if self.token_text is not None and len(self.token_text) == n:
            return [str(s) for s in self.token_text]
        flat = [int(i) for i in ids.reshape(-1).tolist()]
        tok = self.tokenizer
        if tok is not None:
            try:
                if hasattr(tok, "convert_ids_to_tokens"):
                    out = tok.convert_ids_to_tokens(flat)
                else:
                    out = [tok.decode([i]) for i in flat]
                if len(out) == n:
                    return [str(s) for s in out]
            except Exception:  # a tokenizer that cannot label these ids: fall back to ids
                pass
        return [str(i) for i in flat]

    # -- other batches of the same kind --------------------------------------------------------
    def targets_tensor(self, model: nn.Module | None = None) -> tuple[Any, Slot | None]:
        """The targets and their slot: the argument with the ``targets`` role, else
        :attr:`targets` (what a ``loss_fn`` reads; slot None); ``(None, None)`` without any."""
        s = self.slot("targets", model)
        if s is not None:
            return self.get(s.where), s
        return self.targets, None

    def target_layout(self, model: nn.Module | None = None) -> TargetLayout:
        """How the targets relate to the token ids, measured on their values.

        ``aligned``: equal to the ids where not ignored (HF ``labels=input_ids``; the model
        shifts inside). ``shifted``: ``targets[:, t] == ids[:, t + 1]`` (nanoGPT's ``(idx,
        targets)``). ``masked``: an ignore value (e.g. -100) on most positions and the ids on
        the rest (masked LM). ``seq2seq``: labels of an encoder-decoder model (its decoder's
        targets, any length). ``class``: one target per row, (B,) or (B, C). ``tokens``: (B, T)
        targets with another relation (tagging). ``other``: anything else. ``none``: no targets.
        """
        tgt, slot = self.targets_tensor(model)
        ids = self.ids(model)
        where = None if slot is None else slot.where
        if not isinstance(tgt, torch.Tensor):
            return TargetLayout("none", where=where)
        if ids is not None and is_encoder_decoder(model):
            return TargetLayout("seq2seq", where=where)
        if ids is None or tgt.dim() == 0:
            return TargetLayout("class" if tgt.dim() <= 2 else "other", where=where)
        b, t = ids.shape
        if tgt.shape[0] == b and (tgt.dim() == 1 or (tgt.dim() == 2 and tgt.shape[1] != t)):
            return TargetLayout("class", where=where)
        if tuple(tgt.shape) != (b, t) or tgt.is_floating_point():
            return TargetLayout("tokens" if tuple(tgt.shape[:2]) == (b, t) else "other",
                                where=where)
        tgt = tgt.to(ids.device)
        negative = torch.unique(tgt[tgt < 0])
        ignore = int(negative[0]) if negative.numel() == 1 else None
        valid = tgt >= 0
        if negative.numel() > 1 or not bool(valid.any()):
            return TargetLayout("tokens", ignore, where)
        if bool((tgt == ids)[valid].all()):
            if bool(valid.all()):
                return TargetLayout("aligned", ignore, where)
            mask = self._keep_mask(model)
            if mask is not None and bool((valid == mask).all()):
                return TargetLayout("aligned", ignore, where)  # only padding is ignored
            return TargetLayout("masked", ignore, where)
        if t > 1 and bool((tgt[:, :-1] == ids[:, 1:])[valid[:, :-1]].all()):
            return TargetLayout("shifted", ignore, where)
        return TargetLayout("tokens", ignore, where)

    def _keep_mask(self, model: nn.Module | None) -> torch.Tensor | None:
        for s in self.slots(model):
            if s.role == "mask" and s.name == "attention_mask":
                return self.get(s.where).bool()
        return None

    def resized(self, model: nn.Module, *, ids: torch.Tensor | None = None,
                batch_size: int | None = None, seq_len: int | None = None,
                vocab_size: int | None = None, seed: int = 0, targets: str = "rewrite",
                decoder_ids: torch.Tensor | None = None) -> Batch:
        """The same kind of batch on other token ids, every argument rewritten to match.

        Args:
            model: the model whose ``forward`` the arguments bind to.
            ids: (B', T') integer ids to use; or None for uniformly random ids in
                [0, ``vocab_size``) of shape (``batch_size`` or B, ``seq_len`` or T).
            vocab_size: V, needed for random ids and random targets.
            seed: seed of a private generator (the global RNG is untouched).
            targets: ``"rewrite"`` keeps targets consistent with the new ids by their
                :meth:`target_layout` (aligned: the ids; shifted: the next ids, the last one
                drawn at random; masked: the ids at the same share of positions, the ignore
                value elsewhere; seq2seq: random labels; class and other: the old targets
                repeated to the new batch size); ``"drop"`` leaves them out where the forward
                has a default for them (rewritten where it does not).
            decoder_ids: (B', T_dec) decoder input ids of an encoder-decoder model
                (``decoder_input_ids``); without them an encoder-decoder batch whose labels are
                dropped gets decoder ids derived from rewritten labels.

        Returns:
            Batch: new arguments; :attr:`targets` (a ``loss_fn``'s) rewritten alike;
            ``token_text`` dropped (the views fall back to ids). Masks become "keep every
            position" (1/True for ``attention_mask``, False for padding masks); position ids
            that count 0..T-1 count 0..T'-1; other tensors whose leading dimensions are (B, T)
            or (B,) are repeated or cut to (B', T') / (B',).

        Raises:
            BatchError: the batch has no token ids, random ids without ``vocab_size``, or
                ``targets`` is neither ``"rewrite"`` nor ``"drop"``.
        """
        if targets not in ("rewrite", "drop"):
            raise BatchError(f"targets must be 'rewrite' or 'drop', got {targets!r}")
        old = self.ids(model)
        if old is None:
            raise BatchError("the batch has no (B, T) integer token ids; return them as the "
                             "first positional argument or as input_ids")
        r = _Resizer(model, old, self.target_layout(model), seed, vocab_size)
        if ids is None:
            ids = r.rand((batch_size or r.b0, seq_len or r.t0))
        r.set_ids(ids)
        enc_dec = is_encoder_decoder(model)
        args, kwargs, tgt_new, dec_len = self._resized_slots(model, r, targets, decoder_ids)
        if enc_dec:
            dec_len = self._resized_decoder(model, r, kwargs, tgt_new, dec_len, decoder_ids)
        if dec_len is None and tgt_new is not None and r.layout.kind == "seq2seq":
            dec_len = tgt_new.shape[1]
        for k, v in list(kwargs.items()):
            if k.startswith("decoder_") and k in _KEEP_MASKS and isinstance(v, torch.Tensor):
                kwargs[k] = _keep_all(k, v, r.b, dec_len or r.t)
        out = self.replace(args, kwargs, token_text=None)
        if self.targets is not None and r.layout.where is None:
            out.targets = r.new_targets(self.targets)
        return out

    def _resized_slots(self, model: nn.Module, r: _Resizer, targets: str,
                       decoder_ids: torch.Tensor | None
                       ) -> tuple[list[Any], dict[str, Any], Any, int | None]:
        """:meth:`resized`'s rewrite of each argument slot, in order. Returns the new
        ``(args, kwargs, new targets or None, decoder length or None)``; dropped trailing
        positional arguments are cut, inner ones become None."""
        args: list[Any] = list(self.args)
        kwargs: dict[str, Any] = dict(self.kwargs)
        drop_args: set[int] = set()
        tgt_new: Any = None
        dec_len = None
        for s in self.slots(model):
            v = self.get(s.where)
            if s.role == "targets" and targets == "drop" and r.optional(s.name):
                nv: Any = _DROP
            else:
                nv = r.new_value(s, v, decoder_ids)
            if nv is _DROP:
                if isinstance(s.where, int):
                    drop_args.add(s.where)
                else:
                    kwargs.pop(s.where)
                continue
            if s.role == "targets":
                tgt_new = nv
            elif s.role == "decoder_ids":
                dec_len = nv.shape[1]
            if isinstance(s.where, int):
                args[s.where] = nv
            else:
                kwargs[s.where] = nv
        # trailing positional arguments that were dropped: cut; inner ones: None
        for i in sorted(drop_args, reverse=True):
            if i == len(args) - 1:
                args.pop()
            else:
                args[i] = None
        return args, kwargs, tgt_new, dec_len

    def _resized_decoder(self, model: nn.Module, r: _Resizer, kwargs: dict[str, Any],
                         tgt_new: Any, dec_len: int | None,
                         decoder_ids: torch.Tensor | None) -> int | None:
        """:meth:`resized`'s decoder inputs of an encoder-decoder model: the given
        ``decoder_ids``, or ids derived from the rewritten labels when the batch has neither
        labels nor decoder ids. Updates ``kwargs``; returns the decoder length."""
        if decoder_ids is not None:
            if "decoder_input_ids" in r.params or r.optional("decoder_input_ids"):
                kwargs["decoder_input_ids"] = decoder_ids.to(r.old.device, r.old.dtype)
            dec_len = decoder_ids.shape[1]
        has_labels = tgt_new is not None and r.layout.where is not None
        has_dec = "decoder_input_ids" in kwargs or self.slot("decoder_ids", model) is not None
        if not has_labels and not has_dec:
            labels = r.new_targets(self.targets_tensor(model)[0])
            if not isinstance(labels, torch.Tensor):
                labels = r.rand((r.b, r.t))
            kwargs["decoder_input_ids"] = decoder_inputs_from_labels(model, labels)
            dec_len = labels.shape[1]
        return dec_len

    def describe(self, model: nn.Module | None = None) -> str:
        """``idx (2, 16) int64, targets (2, 16) int64`` — the tensor arguments by name."""
        parts = []
        for s in self.slots(model):
            t = self.get(s.where)
            parts.append(f"{s.name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        if isinstance(self.targets, torch.Tensor):
            parts.append(f"targets (loss_fn) {tuple(self.targets.shape)}")
        return ", ".join(parts) or "no tensor arguments"


@dataclass(frozen=True)
class TargetLayout:
    """How a batch's targets relate to its token ids (:meth:`Batch.target_layout`).

    Attributes:
        kind: ``aligned``, ``shifted``, ``masked``, ``seq2seq``, ``class``, ``tokens``,
            ``other`` or ``none``.
        ignore: the one negative value the targets hold (HF's -100, nanoGPT's -1), or None.
        where: the targets' positional index or keyword, None for :attr:`Batch.targets`.
    """

    kind: str
    ignore: int | None = None
    where: int | str | None = None

    def describe(self) -> str:
        """One phrase, e.g. ``targets are the input ids shifted by one (next-token targets)``."""
        return {
            "aligned": "labels equal the input ids (HF style, for a model that shifts them inside)",
            "shifted": "targets are the input ids shifted by one (next-token targets)",
            "masked": f"labels hold {self.ignore} except where they equal the ids (masked LM)",
            "seq2seq": "labels are the decoder's targets (encoder-decoder)",
            "class": "one target per sequence (classification)",
            "tokens": "one target per token, not the ids themselves",
            "other": "targets of another shape",
            "none": "no targets",
        }[self.kind]


def is_encoder_decoder(model: nn.Module | None) -> bool:
    """Whether ``model`` is an encoder-decoder: ``config.is_encoder_decoder`` (HF), or a
    forward that takes ``decoder_input_ids``."""
    if model is None:
        return False
    cfg = getattr(model, "config", None)
    flag = getattr(cfg, "is_encoder_decoder", None)
    if isinstance(flag, bool):
        return flag
    return "decoder_input_ids" in _forward_params(model)


def decoder_inputs_from_labels(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """(B, T_dec) decoder input ids from (B, T_dec) labels the way the model derives them: HF's
    ``prepare_decoder_input_ids_from_labels`` when present, else labels shifted right behind
    ``config.decoder_start_token_id`` (-100 replaced by ``pad_token_id``).

    Raises:
        BatchError: neither the method nor a decoder start token id exists.
    """
    prep = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prep):
        return prep(labels=labels)
    cfg = getattr(model, "config", None)
    start = getattr(cfg, "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise BatchError("cannot make decoder inputs for this encoder-decoder model; return a "
                         "dict batch with decoder_input_ids")
    pad = getattr(cfg, "pad_token_id", None)
    out = torch.full_like(labels, start)
    out[:, 1:] = labels[:, :-1]
    if isinstance(pad, int):
        out = out.masked_fill(out == -100, pad)
    return out


def _forward_params(model: nn.Module | None) -> dict[str, inspect.Parameter]:
    forward = getattr(model, "forward", None)
    if forward is None:
        return {}
    try:
        return dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return {}


def _fit(x: torch.Tensor, b: int, t: int | None = None) -> torch.Tensor:
    """``x`` repeated and cut along dim 0 to ``b`` rows (and along dim 1 to ``t``)."""
    reps = [1] * x.dim()
    reps[0] = -(-b // x.shape[0])
    if t is not None:
        reps[1] = -(-t // x.shape[1])
    out = x.repeat(*reps)[:b]
    return out[:, :t] if t is not None else out


def _keep_all(name: str, mask: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """A mask that keeps every position: ones (True) for HF masks, zeros (False) for padding
    masks; (B, T) only, other shapes are repeated/cut."""
    if mask.dim() != 2:
        return _fit(mask, b)
    keep = name in _KEEP_MASKS
    return torch.full((b, t), 1 if keep else 0, dtype=mask.dtype, device=mask.device)


def _positions(v: torch.Tensor, b0: int, t0: int, b: int, t: int) -> torch.Tensor | None:
    """Position ids 0..T'-1 when ``v`` counted 0..T-1 (per row or 1-D), the repeated pattern for
    token type ids and other (B, T) tensors, or None when ``v`` cannot be rewritten."""
    ar = torch.arange(t0, device=v.device)
    if v.dim() == 1 and v.shape[0] == t0 and bool((v == ar).all()):
        return torch.arange(t, device=v.device, dtype=v.dtype)
    if v.dim() == 2 and tuple(v.shape) == (b0, t0):
        if bool((v == ar).all()):
            return torch.arange(t, device=v.device, dtype=v.dtype).expand(b, t).contiguous()
        if bool((v == v[:, :1]).all()):  # constant per row: token type ids, segment ids
            return _fit(v, b, t)
    return None


_DROP = object()  # _Resizer.new_value: leave this argument out


class _Resizer:
    """The state of one :meth:`Batch.resized`: the old ids' shape (B, T), the new ids and
    their shape (B', T'), the target layout and a private generator for random ids."""

    def __init__(self, model: nn.Module, old: torch.Tensor, layout: TargetLayout, seed: int,
                 vocab_size: int | None) -> None:
        self.old = old
        self.b0, self.t0 = old.shape
        self.layout = layout
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.params = _forward_params(model)
        self.ids: torch.Tensor = old
        self.b, self.t = self.b0, self.t0

    def set_ids(self, ids: torch.Tensor) -> None:
        """Use ``ids`` (moved to the old ids' device and dtype) as the new token ids."""
        self.ids = ids.to(self.old.device, self.old.dtype)
        self.b, self.t = self.ids.shape

    def rand(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniformly random ids in [0, vocab_size) from the private generator."""
        if self.vocab_size is None:
            raise BatchError("random token ids need the vocabulary size")
        return torch.randint(0, self.vocab_size, shape,
                             generator=self.gen).to(self.old.device, self.old.dtype)

    def optional(self, name: str) -> bool:
        """Whether the forward has a default for ``name`` (or takes ``**kwargs``)."""
        p = self.params.get(name)
        if p is None:
            return any(q.kind is q.VAR_KEYWORD for q in self.params.values())
        return p.default is not inspect.Parameter.empty

    def new_targets(self, old_t: Any) -> Any:
        """Targets consistent with the new ids, by the batch's target layout."""
        if not isinstance(old_t, torch.Tensor):
            return old_t
        ids, b, t, b0, t0 = self.ids, self.b, self.t, self.b0, self.t0
        kind = self.layout.kind
        if kind == "aligned":
            return ids.clone().to(old_t.dtype)
        if kind == "shifted":
            nxt = torch.cat([ids[:, 1:], self.rand((b, 1))], dim=1)
            return nxt.to(old_t.device, old_t.dtype)
        if kind == "masked":
            keep = _fit(old_t != self.layout.ignore, b, t)
            return torch.where(keep, ids.to(old_t.dtype),
                               torch.full_like(keep, self.layout.ignore, dtype=old_t.dtype))
        if kind == "seq2seq":
            td = old_t.shape[1] if old_t.dim() == 2 and t == t0 else t
            return self.rand((b, td)).to(old_t.dtype)
        if kind == "class":
            return _fit(old_t, b)
        if old_t.dim() >= 2 and tuple(old_t.shape[:2]) == (b0, t0):
            return _fit(old_t, b, t)
        if old_t.dim() >= 1 and old_t.shape[0] == b0:
            return _fit(old_t, b)
        return old_t

    def new_value(self, s: Slot, v: Any, decoder_ids: torch.Tensor | None) -> Any:
        """The rewritten value of argument slot ``s`` (old value ``v``), or ``_DROP``."""
        b, t, b0, t0 = self.b, self.t, self.b0, self.t0
        if s.role == "ids":
            return self.ids
        if s.role == "targets":
            return self.new_targets(v)
        if s.role == "decoder_ids":
            if decoder_ids is not None:
                return decoder_ids.to(v.device, v.dtype)
            td = v.shape[1] if t == t0 else t
            return torch.cat([_fit(v[:, :1], b), self.rand((b, td - 1)).to(v.dtype)], dim=1)
        if s.role == "mask":
            # a decoder mask is filled in by Batch.resized, once the decoder length is known
            return v if s.name.startswith("decoder_") else _keep_all(s.name, v, b, t)
        if s.role == "positions":
            nv = _positions(v, b0, t0, b, t)
            if nv is None:
                return _fit(v, b, t) if not self.optional(s.name) else _DROP
            return nv
        if v.dim() >= 2 and tuple(v.shape[:2]) == (b0, t0):
            return _fit(v, b, t)
        if v.dim() >= 1 and v.shape[0] == b0 and v.dim() <= 2:
            return _fit(v, b)
        return v



@dataclass
class LossChoice:
    """The scalar that is differentiated, and where it came from.

    Attributes:
        loss: the 0-dim tensor.
        source: where it was found, as code: ``out.loss``, ``out['loss']``, ``out[1]``,
            ``out``, ``loss_fn(out, batch)``, or ``mean(out.logits)`` for the fallback.
        fallback: True when the model computed no loss and :attr:`loss` is the mean of its
            output (gradients flow, but they are not the gradients of any training loss).
    """

    loss: torch.Tensor
    source: str
    fallback: bool = False

    def describe(self) -> str:
        """``loss = out[1]``, or ``loss = mean(out) — the model returned no loss``."""
        if self.fallback:
            return f"loss = {self.source} — the model returned no loss"
        return f"loss = {self.source}"


def _scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()


def select_loss(output: Any, loss_fn: LossFn | None = None,
                batch: Batch | None = None) -> LossChoice:
    """The scalar to call ``backward()`` on, by the module's conventions (see the module
    docstring for the order).

    Args:
        output: what the model returned.
        loss_fn: ``loss_fn(output, batch) -> 0-dim tensor``, when the user gave one.
        batch: passed to ``loss_fn``.

    Returns:
        LossChoice: the loss and its source.

    Raises:
        BatchError: ``loss_fn`` returned no 0-dim floating tensor, the output holds several
            scalars and nothing says which is the loss, or the output has no floating-point
            tensor at all.
    """
    if loss_fn is not None:
        loss = loss_fn(output, batch)
        if not _scalar(loss):
            got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else type(loss).__name__)
            raise BatchError(f"loss_fn must return a 0-dim floating-point tensor, got {got}")
        return LossChoice(loss, "loss_fn(out, batch)")
    if _scalar(output):
        return LossChoice(output, "out")
    loss = getattr(output, "loss", None)
    if _scalar(loss):
        return LossChoice(loss, "out.loss")
    if isinstance(output, Mapping) and _scalar(output.get("loss")):
        return LossChoice(output["loss"], "out['loss']")
    if isinstance(output, (tuple, list)):
        found = [(i, x) for i, x in enumerate(output) if _scalar(x)]
        if len(found) > 1:
            with_graph = [(i, x) for i, x in found if x.grad_fn is not None]
            found = with_graph if len(with_graph) == 1 else found
        if len(found) == 1:
            i, x = found[0]
            return LossChoice(x, f"out[{i}]")
        if len(found) > 1:
            where = ", ".join(f"out[{i}]" for i, _ in found)
            raise BatchError(
                f"the output holds {len(found)} scalar tensors ({where}) and none is named "
                "loss; return (model, batch, loss_fn) to say which one to differentiate")
    tensor, where = _first_float(output)
    if tensor is None:
        raise BatchError("the model returned no loss and no floating-point tensor to "
                         "differentiate; return (model, batch, loss_fn)")
    return LossChoice(tensor.float().mean(), f"mean({where})", fallback=True)


def _first_float(output: Any) -> tuple[torch.Tensor | None, str]:
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor) and logits.is_floating_point():
        return logits, "out.logits" if not isinstance(output, Mapping) else "out['logits']"
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output, "out"
    if isinstance(output, (tuple, list)):
        for i, x in enumerate(output):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x, f"out[{i}]"
    if isinstance(output, Mapping):
        for k, x in output.items():
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x, f"out[{k!r}]"
    return None, ""


def from_factory(result: Any) -> tuple[nn.Module, Batch, LossFn | None]:
    """Check and normalise what a ``--model`` factory returned.

    Args:
        result: ``(model, batch)`` or ``(model, batch, loss_fn)``.

    Returns:
        ``(model, Batch, loss_fn or None)``.

    Raises:
        BatchError: anything else, with one line that says what was expected.
    """
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise BatchError("must return (model, batch) or (model, batch, loss_fn), got "
                         f"{type(result).__name__}"
                         + (f" of {len(result)}" if isinstance(result, tuple) else ""))
    model, batch = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, nn.Module):
        raise BatchError("the first value returned must be a torch.nn.Module, got "
                         f"{type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise BatchError(f"the third value returned (loss_fn) must be callable, got "
                         f"{type(loss_fn).__name__}")
    return model, Batch.of(batch), loss_fn
