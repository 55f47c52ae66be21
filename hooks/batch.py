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

    def describe(self, model: nn.Module | None = None) -> str:
        """``idx (2, 16) int64, targets (2, 16) int64`` — the tensor arguments by name."""
        parts = []
        for s in self.slots(model):
            t = self.get(s.where)
            parts.append(f"{s.name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        if isinstance(self.targets, torch.Tensor):
            parts.append(f"targets (loss_fn) {tuple(self.targets.shape)}")
        return ", ".join(parts) or "no tensor arguments"


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
