"""``Target``: the model under examination and its batch, plus what the checks need to find in
it (token ids, logits, loss, attention/rotary/MoE/norm modules) by duck typing, so the same
checks run on minillm, HF ``LlamaForCausalLM``/``MixtralForCausalLM`` and users' models.

Dimension legend: B batch, T sequence, V vocabulary, D hidden size, H query heads,
Hkv key/value heads, Dh head dim, E experts.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class SkipCheck(Exception):
    """Raised inside a check when it cannot apply to this model; the message is the reason."""


@dataclass
class AttentionInfo:
    """An attention module with HF-style projections.

    Attributes:
        name: qualified module name.
        module: the module (has ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``).
        num_heads: H, query heads (``q_proj.out_features // head_dim``).
        num_kv_heads: Hkv (``k_proj.out_features // head_dim``).
        head_dim: Dh.
    """

    name: str
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def n_rep(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


@dataclass
class MoEInfo:
    """A sparse MoE block: ``experts`` plus a router child (``gate`` or ``router``).

    Attributes:
        name: qualified name of the block.
        router_name: qualified name of the router module.
        router: the router module.
        num_experts: E.
    """

    name: str
    router_name: str
    router: nn.Module
    num_experts: int


def _linear_like(m: Any) -> bool:
    return isinstance(m, nn.Module) and hasattr(m, "out_features") and hasattr(m, "in_features")


class Target:
    """A model, the batch it runs on, and helpers to run it on other token ids.

    Args:
        model: any ``nn.Module``.
        args: positional forward arguments of the batch.
        kwargs: keyword forward arguments of the batch.

    The token ids (B, T) int64 are ``kwargs["input_ids"]`` or the first positional argument.
    :meth:`call` substitutes other ids: ``labels`` are set to the new ids when the batch had
    labels or when asked; a (B, T) ``attention_mask`` becomes all ones; other (B, T) tensors in
    ``kwargs`` (e.g. ``position_ids``) are dropped so the model uses its defaults.
    """

    def __init__(self, model: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.ids_slot: tuple[str, Any] | None = None
        ids = self.kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            self.ids_slot = ("kwarg", "input_ids")
        elif self.args and isinstance(self.args[0], torch.Tensor):
            ids = self.args[0]
            self.ids_slot = ("arg", 0)
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2
                and ids.dtype in (torch.int64, torch.int32)):
            ids, self.ids_slot = None, None
        self.input_ids: torch.Tensor | None = ids
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # pragma: no cover - exotic forwards
            params = {}
        self._params = params
        self._var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self._vocab: int | None = None

    @classmethod
    def from_any(cls, model: Any, batch: Any = None) -> Target:
        """Build from ``(model, batch)`` or from a workload with ``model``/``args``/``kwargs``.

        ``batch`` is a tensor of ids, a tuple/list of positional arguments or a dict of keyword
        arguments.
        """
        if batch is None and not isinstance(model, nn.Module) and hasattr(model, "model"):
            return cls(model.model, tuple(getattr(model, "args", ())),
                       dict(getattr(model, "kwargs", {})))
        if batch is None:
            return cls(model)
        if isinstance(batch, torch.Tensor):
            return cls(model, (batch,))
        if isinstance(batch, dict):
            return cls(model, (), batch)
        if isinstance(batch, (tuple, list)):
            return cls(model, tuple(batch))
        raise TypeError(
            f"batch must be a tensor, a tuple of arguments or a dict, got {type(batch).__name__}"
        )

    # -- facts ----------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        """``model.config`` (minillm or HF), or None."""
        return getattr(self.model, "config", None)

    def cfg(self, name: str, default: Any = None) -> Any:
        """A config attribute, or ``default`` when there is no config or no such field."""
        c = self.config
        if c is None:
            return default
        if isinstance(c, dict):
            return c.get(name, default)
        return getattr(c, name, default)

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def accepts(self, name: str) -> bool:
        """Whether ``model.forward`` takes a keyword ``name`` (explicitly)."""
        return name in self._params

    def need_ids(self) -> torch.Tensor:
        """The batch's (B, T) ids, or :class:`SkipCheck`."""
        if self.input_ids is None:
            raise SkipCheck("the batch has no (B, T) integer input_ids")
        return self.input_ids

    @property
    def vocab_size(self) -> int:
        """V: ``config.vocab_size``, else the last dimension of the logits of one short call."""
        if self._vocab is None:
            v = self.cfg("vocab_size")
            if not isinstance(v, int):
                ids = self.need_ids()[:1, :2]
                with torch.no_grad():
                    logits = self.logits(self.call(ids))
                if logits is None:
                    raise SkipCheck("the model's output has no (B, T, V) logits")
                v = int(logits.shape[-1])
            self._vocab = v
        return self._vocab

    @property
    def max_positions(self) -> int | None:
        """``config.max_position_embeddings`` when known."""
        v = self.cfg("max_position_embeddings")
        return int(v) if isinstance(v, int) else None

    # -- running --------------------------------------------------------------------------------
    def call(self, ids: torch.Tensor | None = None, *, labels: bool | None = None,
             **extra: Any) -> Any:
        """Run the model on ``ids`` (default: the batch's) with the batch's other arguments.

        Args:
            ids: (B', T') int64 ids to substitute for the batch's.
            labels: True to pass ``labels=ids`` (only if the model accepts ``labels``), False to
                drop labels, None to keep the batch's own choice.
            extra: more keyword arguments (only those the forward accepts are passed).

        Returns:
            The model's output.
        """
        args, kwargs = list(self.args), dict(self.kwargs)
        if ids is not None:
            if self.ids_slot is None:
                raise SkipCheck("the batch has no (B, T) integer input_ids")
            old = self.input_ids
            ids = ids.to(old.device)
            kind, where = self.ids_slot
            if kind == "arg":
                args[where] = ids
            else:
                kwargs[where] = ids
            for k, v in list(kwargs.items()):
                if k == "input_ids" or not isinstance(v, torch.Tensor):
                    continue
                if v.dim() >= 2 and tuple(v.shape[:2]) == tuple(old.shape):
                    if k == "attention_mask":
                        kwargs[k] = torch.ones(ids.shape[:2], dtype=v.dtype, device=v.device)
                    elif k == "labels":
                        kwargs[k] = ids
                    else:
                        del kwargs[k]
        if labels is False:
            kwargs.pop("labels", None)
        elif labels:
            if not (self.accepts("labels") or self._var_kw):
                raise SkipCheck("the model's forward takes no labels")
            if ids is not None:
                kwargs["labels"] = ids
            else:
                kwargs.setdefault("labels", self.input_ids)
        for k, v in extra.items():
            if self.accepts(k) or self._var_kw:
                kwargs[k] = v
        return self.model(*args, **kwargs)

    @staticmethod
    def logits(output: Any) -> torch.Tensor | None:
        """(B, T, V) logits from ``output.logits``, ``output["logits"]``, a bare 3-D tensor or
        the first element of a tuple; None if there are none."""
        lg = getattr(output, "logits", None)
        if lg is None and isinstance(output, dict):
            lg = output.get("logits")
        if lg is None and isinstance(output, (tuple, list)) and output:
            lg = output[0]
        if lg is None and isinstance(output, torch.Tensor):
            lg = output
        if isinstance(lg, torch.Tensor) and lg.dim() == 3 and lg.is_floating_point():
            return lg
        return None

    def need_logits(self, output: Any) -> torch.Tensor:
        lg = self.logits(output)
        if lg is None:
            raise SkipCheck("the model's output has no (B, T, V) logits")
        return lg

    @staticmethod
    def loss(output: Any) -> tuple[torch.Tensor | None, str]:
        """The scalar loss of ``output`` (``.loss`` / ``["loss"]``), or the mean of the logits
        (so a backward still reaches every parameter), and where it came from."""
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return loss, "loss"
        t = Target.logits(output)
        if t is None:
            t = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return (t if t.dim() == 0 else t.float().mean()), "mean of the output"
        return None, "none"

    @staticmethod
    def ce_loss(output: Any) -> torch.Tensor | None:
        """Cross-entropy alone when the output separates it (``ce_loss``), else ``loss``."""
        ce = getattr(output, "ce_loss", None)
        if isinstance(ce, torch.Tensor):
            return ce
        loss, src = Target.loss(output)
        return loss if src == "loss" else None

    def random_ids(self, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
        """Uniform random (B, T) ids in [0, V) from a private generator (global RNG untouched)."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab_size, shape, generator=g).to(self.device)

    @contextlib.contextmanager
    def mode(self, training: bool) -> Iterator[None]:
        """Put the model in train/eval mode for the block, then restore every module's flag."""
        flags = [(m, m.training) for m in self.model.modules()]
        self.model.train(training)
        try:
            yield
        finally:
            for m, f in flags:
                m.training = f

    @contextlib.contextmanager
    def saved_grads(self) -> Iterator[None]:
        """Set every ``.grad`` to None for the block and restore the previous ones after."""
        saved = [(p, p.grad) for p in self.model.parameters()]
        for p, _ in saved:
            p.grad = None
        try:
            yield
        finally:
            for p, g in saved:
                p.grad = g

    # -- structure ------------------------------------------------------------------------------
    def attention_modules(self) -> list[AttentionInfo]:
        """Modules with ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` linear children."""
        out = []
        for name, m in self.model.named_modules():
            projs = [getattr(m, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            if not all(_linear_like(p) for p in projs):
                continue
            q, k, _, o = projs
            hd = getattr(m, "head_dim", None)
            if not isinstance(hd, int):
                h = getattr(m, "num_heads", None) or self.cfg("num_attention_heads")
                if not isinstance(h, int) or h <= 0:
                    continue
                hd = q.out_features // h
            if hd <= 0 or q.out_features % hd or k.out_features % hd:
                continue
            out.append(AttentionInfo(name, m, q.out_features // hd, k.out_features // hd, hd))
        return out

    def rotary_module(self) -> tuple[str, nn.Module] | None:
        """The first module named ``*rotary_emb`` or whose class name contains ``Rotary``."""
        for name, m in self.model.named_modules():
            if name.endswith("rotary_emb") or "Rotary" in type(m).__name__:
                return name, m
        return None

    def moe_blocks(self) -> list[MoEInfo]:
        """Modules with an ``experts`` child and a ``gate`` or ``router`` child."""
        out = []
        for name, m in self.model.named_modules():
            experts = getattr(m, "experts", None)
            if not isinstance(experts, nn.Module):
                continue
            for rname in ("gate", "router"):
                r = getattr(m, rname, None)
                if isinstance(r, nn.Module):
                    break
            else:
                continue
            e = getattr(m, "num_experts", None)
            if not isinstance(e, int):
                e = len(experts) if isinstance(experts, nn.ModuleList) else None
            if not isinstance(e, int):
                e = getattr(experts, "num_experts", None) or self.cfg("num_local_experts")
            full = f"{name}.{rname}" if name else rname
            out.append(MoEInfo(name, full, r, int(e) if isinstance(e, int) else 0))
        return out

    def norm_modules(self) -> list[tuple[str, nn.Module]]:
        """Normalisation modules: class name ending in ``RMSNorm``/``LayerNorm`` or
        ``nn.LayerNorm``/``nn.RMSNorm`` instances."""
        out = []
        for name, m in self.model.named_modules():
            cls = type(m).__name__
            if cls.endswith(("RMSNorm", "LayerNorm", "RmsNorm")) or isinstance(m, nn.LayerNorm):
                out.append((name, m))
        return out

    def embeddings(self) -> tuple[tuple[str, nn.Module] | None, tuple[str, nn.Module] | None]:
        """The token embedding and the LM head as ``(name, module)`` pairs (None if absent).

        Uses HF's ``get_input_embeddings``/``get_output_embeddings`` when present, else the
        first ``nn.Embedding`` with V rows and a module named ``lm_head`` (or the last linear
        layer with V outputs).
        """
        names = {id(m): n for n, m in self.model.named_modules()}
        emb = head = None
        with contextlib.suppress(Exception):
            e = self.model.get_input_embeddings()
            if isinstance(e, nn.Module) and id(e) in names:
                emb = (names[id(e)], e)
        with contextlib.suppress(Exception):
            h = self.model.get_output_embeddings()
            if isinstance(h, nn.Module) and id(h) in names:
                head = (names[id(h)], h)
        v = self.cfg("vocab_size")
        if emb is None:
            for n, m in self.model.named_modules():
                if isinstance(m, nn.Embedding) and (v is None or m.num_embeddings == v):
                    emb = (n, m)
                    break
        if head is None:
            for n, m in self.model.named_modules():
                if n.endswith("lm_head") and _linear_like(m):
                    head = (n, m)
            if head is None and isinstance(v, int):
                for n, m in self.model.named_modules():
                    if _linear_like(m) and m.out_features == v:
                        head = (n, m)
        return emb, head

    def param_owners(self) -> dict[int, list[str]]:
        """``id(parameter)`` -> every qualified module name that registers it (ties: several)."""
        owners: dict[int, list[str]] = {}
        for mname, m in self.model.named_modules(remove_duplicate=False):
            for _, p in m.named_parameters(recurse=False):
                owners.setdefault(id(p), [])
                if mname not in owners[id(p)]:
                    owners[id(p)].append(mname)
        return owners


def fmt(x: float, digits: int = 3) -> str:
    """A number for evidence text: ``nan``/``inf`` spelled out, else ``digits`` significant."""
    if x is None:
        return "n/a"
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"
