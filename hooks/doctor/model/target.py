"""``Target``: the model under examination, its batch and loss convention, what kind of model it
is, and what the checks need to find in it (attention, rotary, MoE and norm modules, the
embedding and the LM head), so that the same checks run on minillm, HF models of many families
and users' own models. Attention (heads, q/k/v columns, k norm, o projection), MoE routers,
norms and the LM head are the roles of :mod:`hooks.modelroles`: declared, read from what the
model computes in one traced forward, or named (HF's names, a shortcut kept there alone).

Every check runs the model through one batch adapter (:meth:`hooks.Batch.resized`): random
batches of another size and edited token ids keep targets, decoder inputs, masks and position
ids consistent, and the loss is chosen by :func:`hooks.select_loss` (a given ``loss_fn``,
``out.loss``, the scalar of a ``(logits, loss)`` tuple).

Dimension legend: B batch, T sequence, V vocabulary, D hidden size, H query heads,
Hkv key/value heads, Dh head dim, E experts.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks.batch import ROLE_NAMES, Batch, BatchError, LossChoice, LossFn, select_loss
from hooks.doctor.model.kind import ModelKind, detect_kind
from hooks.modelroles.found import AttentionRole, Columns, Roles, Rotary
from hooks.modelroles.named import (  # noqa: F401 (this module's public names, as before)
    FUSED_NAMES,
    K_NAMES,
    OUT_PROJ_NAMES,
    Q_NAMES,
    V_NAMES,
    looks_like_attention,
)
from hooks.modelroles.traced import in_width, is_projection, out_width


class SkipCheck(Exception):
    """Raised inside a check that applies but cannot be measured on this model or batch; the
    message is the reason (and, where it helps, what to return instead)."""


class NotApplicable(Exception):
    """Raised inside a check that does not apply to this kind of model (e.g. causality on a
    bidirectional encoder); the message says why. Reported as ``n/a``."""


# The names of the q/k/v/o projections are hooks.modelroles.named's (kept here as aliases for
# callers of this module); the doctor reads every role through hooks.modelroles.
O_NAMES = OUT_PROJ_NAMES


@dataclass
class AttentionInfo:
    """An attention module and how its keys and values map to heads.

    Attributes:
        name: qualified module name.
        module: the module.
        num_heads: H, query heads (0 when unknown).
        num_kv_heads: Hkv (0 when unknown).
        head_dim: Dh (0 when unknown).
        layout: ``separate`` (keys and values in projections other than the queries': k_proj /
            v_proj of Hkv·Dh outputs each, or one k|v projection), ``fused`` (one q|k|v
            projection of (H + 2·Hkv)·Dh outputs, q first, as Phi-3's ``qkv_proj``), ``mha``
            (keys and values have as many heads as queries: no grouping), or ``unsupported``.
        k_site: (module, offset): where the keys of KV head g are the output columns
            ``offset + [g·Dh, (g+1)·Dh)`` (the role's k norm when the keys are normalised, so
            that a perturbation is not spread over every head by a joint norm).
        v_site: the same for the values.
        out_site: the module whose input is the per-head attention output (B, T, H·Dh).
        why: for ``mha`` and ``unsupported``: what was found, in words.
    """

    name: str
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layout: str
    k_site: tuple[nn.Module, int] | None = None
    v_site: tuple[nn.Module, int] | None = None
    out_site: nn.Module | None = None
    why: str = ""

    @property
    def n_rep(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads if self.num_kv_heads else 0


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


def _leaf(module: str) -> str:
    return module.rpartition(".")[2]


def _mha_why(cls: str, role: AttentionRole) -> str:
    q, k, v = role.q, role.k, role.v
    same = "(as many key/value heads as query heads)"
    if q is not None and k is not None and v is not None:
        if q.module == k.module == v.module:
            return f"{cls}: one fused {_leaf(q.module)} of 3×{q.width} outputs {same}"
        return (f"{cls}: {_leaf(q.module)}, {_leaf(k.module)} and {_leaf(v.module)} are all "
                f"{q.width} wide {same}")
    return f"{cls}: H = Hkv = {role.num_heads} ({role.how})"


def _site(modules: dict[str, nn.Module], cols: Columns) -> tuple[nn.Module, int]:
    return modules[cols.module], cols.start


def _info_from_role(name: str, m: nn.Module, role: AttentionRole,
                    modules: dict[str, nn.Module]) -> AttentionInfo:
    """The :class:`AttentionInfo` of an attention role (declared, traced or named: its heads,
    its q/k/v columns, its k norm and its o projection); ``unsupported`` with the reason and
    the line that declares it where the role does not tell its heads or its KV heads' columns.
    """
    from hooks.modelroles.lookup import attention_hint

    cls = type(m).__name__
    h, hkv, dh = role.num_heads, role.num_kv_heads, role.head_dim
    if not (h and dh):
        return AttentionInfo(name, m, h or 0, hkv or 0, dh or 0, "unsupported",
                             why=f"{cls}: its heads are not known ({role.how}); declare them: "
                                 f"{attention_hint(name)}")
    kids = ", ".join(n for n, _ in m.named_children()) or "none"
    if not hkv or h % hkv:
        cols = ", ".join(f"{p} {c.describe()}" for p, c in (("k", role.k), ("v", role.v)) if c)
        return AttentionInfo(name, m, h, 0, dh, "unsupported",
                             why=f"{cls}: its keys and values do not split into KV heads of the "
                                 f"queries' Dh = {dh} ({cols or 'k/v not found'}; children: "
                                 f"{kids})")
    if hkv == h:
        return AttentionInfo(name, m, h, h, dh, "mha", why=_mha_why(cls, role))
    k, v = role.k, role.v
    if k is None or v is None:
        return AttentionInfo(name, m, h, hkv, dh, "unsupported",
                             why=f"{cls}: H={h}, Hkv={hkv} ({role.how}), but the projections of "
                                 f"its keys and values were not found: they are read from one "
                                 f"traced forward (the projections whose outputs feed the "
                                 f"softmax over q·kᵀ or F.scaled_dot_product_attention), or "
                                 f"from children named k_proj/v_proj… (children: {kids})")
    if role.o not in modules:
        hint = attention_hint(name, h)[:-1] + ", o='CHILD')"
        return AttentionInfo(name, m, h, hkv, dh, "unsupported",
                             why=f"{cls}: H={h}, Hkv={hkv} ({role.how}), but its o projection "
                                 f"was not found (children: {kids}); declare it: {hint}")
    fused = role.q is not None and role.q.module == k.module == v.module
    k_site = (modules[role.k_norm], 0) if role.k_norm in modules else _site(modules, k)
    return AttentionInfo(name, m, h, hkv, dh, "fused" if fused else "separate", k_site,
                         _site(modules, v), modules[role.o])


def _within(name: str, roots: list[str]) -> bool:
    """Whether module ``name`` is one of ``roots``, inside one or around one."""
    return any(name == r or r == "" or name == "" or name.startswith(r + ".")
               or r.startswith(name + ".") for r in roots)


class Target:
    """A model, the batch it runs on and its loss convention, with helpers to run it on other
    batches of the same kind.

    Args:
        model: any ``nn.Module``.
        batch: a :class:`hooks.Batch`, or what a factory may return as a batch (a tensor of
            ids, a tuple of positional arguments, a dict of keyword arguments); None for none.
        loss_fn: ``loss_fn(output, batch) -> 0-dim tensor`` when the user gave one.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``batch`` is of an unsupported type.
    """

    def __init__(self, model: nn.Module, batch: Any = None, loss_fn: LossFn | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
        try:
            self.batch = Batch.of(batch) if batch is not None else Batch()
        except BatchError as exc:
            raise TypeError(str(exc)) from None
        self.model = model
        self.loss_fn = loss_fn
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # pragma: no cover - exotic forwards
            params = {}
        self._params = params
        self._var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self._vocab: int | None = None
        self._kind: ModelKind | None = None
        self._attn: list[AttentionInfo] | None = None
        self._positions: tuple[bool, str] | None = None
        self._roles: Roles | None = None

    @classmethod
    def from_any(cls, model: Any, batch: Any = None) -> Target:
        """A Target from ``(model, batch)``, a Target, or a workload with ``model``, ``batch``
        (a :class:`hooks.Batch`) and ``loss_fn`` attributes (then ``batch`` is omitted)."""
        if isinstance(model, Target):
            return model
        if batch is None and not isinstance(model, nn.Module) and hasattr(model, "model"):
            b = getattr(model, "batch", None)
            if b is None:
                b = Batch(tuple(getattr(model, "args", ())), dict(getattr(model, "kwargs", {})))
            return cls(model.model, b, getattr(model, "loss_fn", None))
        return cls(model, batch)

    # -- facts ----------------------------------------------------------------------------------
    @property
    def args(self) -> tuple:
        """Positional arguments of the batch."""
        return self.batch.args

    @property
    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the batch."""
        return self.batch.kwargs

    @property
    def input_ids(self) -> torch.Tensor | None:
        """The batch's (B, T) integer token ids, or None."""
        return self.batch.ids(self.model)

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
    def kind(self) -> ModelKind:
        """What kind of model this is and why (:func:`hooks.doctor.model.kind.detect_kind`)."""
        if self._kind is None:
            self._kind = detect_kind(self.model, self.batch)
        return self._kind

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def forward_params(self) -> Mapping[str, inspect.Parameter]:
        """The parameters of ``model.forward`` by name (:func:`inspect.signature`; empty when
        it has none that can be read)."""
        return self._params

    def accepts(self, name: str) -> bool:
        """Whether ``model.forward`` takes a keyword ``name``: by name, or through
        ``**kwargs`` of an HF model (whose forwards pass them on to what understands them; a
        user's ``**kwargs`` may not)."""
        return name in self._params or (
            self._var_kw and type(self.model).__module__.startswith("transformers."))

    def need_ids(self) -> torch.Tensor:
        """The batch's (B, T) ids; :class:`NotApplicable` for a model without token ids."""
        ids = self.input_ids
        if ids is None:
            raise NotApplicable(f"not a sequence model: {self.kind.reason}")
        return ids

    @property
    def vocab_size(self) -> int:
        """V: ``config.vocab_size``, else the last dimension of the logits of a short call,
        else the rows of the token embedding."""
        if self._vocab is None:
            v = self.cfg("vocab_size")
            if not isinstance(v, int):
                ids = self.need_ids()
                emb, _ = self.embeddings()
                rows = getattr(emb[1], "num_embeddings", None) if emb else None
                try:  # a short call; a random target it may need is drawn below the ids' max
                    short = self.batch.resized(self.model, ids=ids[:1, : min(ids.shape[1], 4)],
                                               vocab_size=int(ids.max()) + 1, targets="drop")
                except BatchError as exc:
                    raise SkipCheck(str(exc)) from None
                with self.mode(False), torch.no_grad():
                    logits = self.logits(self.run(short))
                v = int(logits.shape[-1]) if logits is not None else rows
                if not isinstance(v, int):
                    raise SkipCheck("cannot tell the vocabulary size: the output has no "
                                    "(B, T, V) logits and there is no token embedding")
            self._vocab = v
        return self._vocab

    @property
    def max_positions(self) -> int | None:
        """``config.max_position_embeddings`` (``n_positions``) when known."""
        v = self.cfg("max_position_embeddings", self.cfg("n_positions"))
        return int(v) if isinstance(v, int) else None

    # -- running --------------------------------------------------------------------------------
    def batch_with(self, *, ids: torch.Tensor | None = None, shape: tuple[int, int] | None = None,
                   seed: int = 0, targets: str = "rewrite",
                   decoder_ids: torch.Tensor | None = None) -> Batch:
        """The batch on other ids (``ids``, or uniformly random ids of ``shape``), every
        argument kept consistent (:meth:`hooks.Batch.resized`).

        ``targets`` is ``"rewrite"`` or ``"drop"`` (:meth:`hooks.Batch.resized`), or
        ``"logits"``: what makes the model return logits at every position, ``"drop"`` for
        most models, ``"rewrite"`` for one that returns them only with its targets
        (:meth:`logits_need_targets`); such a batch without targets then gets next-token
        targets (the ids rolled by one) for the forward's targets parameter.

        Raises:
            SkipCheck: the adapter cannot build it (the message says what the batch needs).
            NotApplicable: the batch has no token ids.
        """
        self.need_ids()
        add = targets == "logits" and self.logits_need_targets()
        if targets == "logits":
            targets = "rewrite" if add else "drop"
        b, t = shape if shape is not None else (None, None)
        try:
            vocab = self.vocab_size if ids is None or self.batch.target_layout(
                self.model).kind in ("shifted", "seq2seq") else self._vocab
            out = self.batch.resized(self.model, ids=ids, batch_size=b, seq_len=t,
                                     vocab_size=vocab, seed=seed, targets=targets,
                                     decoder_ids=decoder_ids)
        except BatchError as exc:
            raise SkipCheck(str(exc)) from None
        return self._with_targets(out) if add else out

    def _targets_param(self) -> str | None:
        """The forward's parameter that takes targets (``targets``, ``labels``...), or None."""
        return next((n for n in self._params if n in ROLE_NAMES["targets"]), None)

    def _with_targets(self, batch: Batch) -> Batch:
        """``batch``, or, when it has no targets argument, ``batch`` with next-token targets
        (its ids rolled left by one) passed as the forward's targets keyword."""
        name = self._targets_param()
        if name is None or batch.slot("targets", self.model) is not None:
            return batch
        ids = batch.ids(self.model)
        return batch.replace(kwargs={**batch.kwargs, name: torch.roll(ids, -1, dims=1)})

    def logits_need_targets(self) -> bool:
        """Whether the model returns logits at every position only when it is given targets.

        karpathy's nanoGPT returns ``lm_head(x[:, [-1], :])``, the last position's logits, when
        ``targets`` is None (a shortcut for generation), and every position's with targets.
        Measured once, in eval mode without gradients, on the first row of the batch: the
        number of logit positions without targets, and, when that is fewer than the row's T,
        with them. False for an encoder-decoder and for a model without logits.
        """
        return self._measure_positions()[0]

    def few_positions(self) -> str:
        """Why the logits cover fewer positions than the batch, in words ("" when they cover
        every position, with or without targets)."""
        return self._measure_positions()[1]

    def _measure_positions(self) -> tuple[bool, str]:
        if self._positions is not None:
            return self._positions
        self._positions = (False, "")
        ids = self.input_ids
        if ids is None or ids.shape[1] < 2 or self.kind.kind == "encoder-decoder":
            return self._positions
        row, n_ids = ids[:1], ids.shape[1]
        try:
            plain = self.batch.resized(self.model, ids=row, vocab_size=int(ids.max()) + 1,
                                       targets="drop")
            n = self._logit_positions(plain)
            if n is None or n == n_ids:
                return self._positions
            with_t = self._with_targets(self.batch.resized(
                self.model, ids=row, vocab_size=int(ids.max()) + 1, targets="rewrite"))
            m = self._logit_positions(with_t) if with_t.slot("targets", self.model) else None
        except Exception:  # the checks' own calls raise it again, where it is reported
            return self._positions
        if m == n_ids:
            self._positions = (True, "")
        else:
            also = (f"and {m} with its targets" if m is not None else
                    "and its forward takes no targets to ask for all of them")
            self._positions = (False, f"the model returns logits for {n} of {n_ids} positions "
                                      f"without targets {also}")
        return self._positions

    def _logit_positions(self, batch: Batch) -> int | None:
        with self.mode(False), torch.no_grad():
            lg = self.logits(self.run(batch, use_cache=False))
        return None if lg is None else int(lg.shape[1])

    def run(self, batch: Batch | None = None, **extra: Any) -> Any:
        """``model(*batch.args, **batch.kwargs, **extra)``; ``extra`` keywords only where the
        forward takes them (``use_cache=False``, ``output_router_logits=True``)."""
        b = self.batch if batch is None else batch
        kwargs = dict(b.kwargs)
        for k, v in extra.items():
            if self.accepts(k):
                kwargs[k] = v
        return self.model(*b.args, **kwargs)

    def loss(self, output: Any, batch: Batch | None = None) -> LossChoice:
        """The loss of ``output`` by :func:`hooks.select_loss` with the user's ``loss_fn``.

        Raises:
            SkipCheck: no loss can be chosen (the message says what to return).
        """
        try:
            return select_loss(output, self.loss_fn, self.batch if batch is None else batch)
        except BatchError as exc:
            raise SkipCheck(str(exc)) from None

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

    def need_logits(self, output: Any, positions: int | None = None) -> torch.Tensor:
        """The (B, T, V) logits of ``output``, covering ``positions`` positions when given.

        Raises:
            SkipCheck: no logits, or fewer (or more) positions than ``positions`` (the message
                says how many and what to return).
        """
        lg = self.logits(output)
        if lg is None:
            raise SkipCheck("the model's output has no (B, T, V) logits: return them "
                            "(out.logits, out['logits'] or the first element of a tuple)")
        if positions is not None and lg.shape[1] != positions:
            why = self.few_positions() or (f"the model returned logits for {lg.shape[1]} of "
                                           f"{positions} positions")
            raise SkipCheck(f"{why}; this check compares every position: return (B, T, V) "
                            "logits (for all positions) when mdb passes targets or none")
        return lg

    @staticmethod
    def ce_loss(output: Any) -> torch.Tensor | None:
        """Cross-entropy alone when the output separates it (minillm's ``ce_loss``), else
        None."""
        ce = getattr(output, "ce_loss", None)
        return ce if isinstance(ce, torch.Tensor) and ce.dim() == 0 else None

    def decoder_ids(self) -> torch.Tensor:
        """(B, T_dec) decoder input ids of an encoder-decoder batch: the batch's own, else
        derived from its labels the way the model does (HF's
        ``prepare_decoder_input_ids_from_labels``)."""
        s = self.batch.slot("decoder_ids", self.model)
        if s is not None:
            return self.batch.get(s.where)
        labels, _ = self.batch.targets_tensor(self.model)
        if not isinstance(labels, torch.Tensor):
            raise SkipCheck("an encoder-decoder batch needs labels or decoder_input_ids: "
                            "return a dict batch with labels")
        from hooks.batch import decoder_inputs_from_labels

        try:
            return decoder_inputs_from_labels(self.model, labels)
        except BatchError as exc:
            raise SkipCheck(str(exc)) from None

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
    def attention_layers(self) -> list[AttentionInfo]:
        """Every attention module with its head layout (:class:`AttentionInfo`): the attention
        roles of :meth:`roles` (declared, traced from what the model computes, or named: the
        smallest module holding the softmax or SDPA call, its q/k/v projections and its o
        projection), each ``nn.MultiheadAttention``, and the modules that look like attention
        by name (``hooks.modelroles.named.looks_like_attention``) but have no role (their layout
        ``unsupported``, saying why and how to declare it); where there are none, the modules
        in which :func:`hooks.capture` records attention probabilities on the batch
        (:meth:`_recorded_attention`). In module order."""
        if self._attn is not None:
            return self._attn
        modules = dict(self.model.named_modules())
        found: dict[str, AttentionInfo] = {}
        for a in self.roles().attention:
            if a.name in modules:
                found[a.name] = _info_from_role(a.name, modules[a.name], a, modules)
        for name, m in modules.items():
            if isinstance(m, nn.MultiheadAttention) and not _within(name, list(found)):
                found[name] = AttentionInfo(
                    name, m, m.num_heads, m.num_heads, m.head_dim, "mha",
                    why=f"nn.MultiheadAttention: {m.num_heads} heads for queries, keys and "
                        "values alike")
        rest = [(n, m) for n, m in modules.items()
                if looks_like_attention(m) and not _within(n, list(found))]
        if not found and not rest:
            rest = self._recorded_attention()
        names = [n for n, _ in rest]
        for name, m in rest:
            if not any(o.startswith(name + ".") or (not name and o) for o in names):
                found[name] = self._unplaced(name, m)  # innermost: a wrapper is left out
        self._attn = [found[n] for n in modules if n in found]
        return self._attn

    def _unplaced(self, name: str, m: nn.Module) -> AttentionInfo:
        """An attention module that has no role: ``unsupported``, with what
        :func:`hooks.modelroles.attention_role` looked for and the line that declares it."""
        from hooks.modelroles import attention_role

        try:
            got = attention_role(self.model, name, self.batch)
        except ValueError as exc:  # a declaration that does not fit
            got = str(exc)
        if not isinstance(got, str):
            return _info_from_role(name, m, got, dict(self.model.named_modules()))
        return AttentionInfo(name, m, 0, 0, 0, "unsupported", why=got)

    def _recorded_attention(self) -> list[tuple[str, nn.Module]]:
        """The modules whose forward made the attention calls :func:`hooks.capture` records
        (an SDPA call, a softmax over the keys of a 4-D score tensor: what the step view's
        attention view shows), in the order they ran, on the batch in eval mode without
        gradients; [] when the forward raises (the checks that run it say why)."""
        from hooks.engine.capture import capture

        try:
            with self.mode(False), torch.no_grad(), capture(
                    self.model, include=[], inputs=False, grads=False, params=False,
                    attention=True) as trace:
                self.run(self.batch, use_cache=False)
        except Exception:
            return []
        modules = dict(self.model.named_modules())
        seen = dict.fromkeys(a.module for a in trace.attention)
        return [(n, modules[n]) for n in seen if n in modules]

    def roles(self) -> Roles:
        """Every role of the model (:func:`hooks.modelroles.find_roles` on the batch: declared,
        traced, named), found once; where the declaration does not fit the model, the traced
        and named roles, with the declaration's error first in the notes."""
        if self._roles is None:
            from hooks.modelroles import find_roles

            try:
                self._roles = find_roles(self.model, self.batch)
            except ValueError as exc:  # a declaration that does not fit: said, not raised
                self._roles = find_roles(self.model, self.batch, declared=False)
                self._roles.notes.insert(0, str(exc))
        return self._roles

    def attention_of(self, module: str | None) -> str | None:
        """The attention module that ``module`` is or sits inside, or None."""
        if module is None:
            return None
        for a in self.attention_layers():
            if module == a.name or module.startswith(a.name + "."):
                return a.name
        return None

    def rotary(self) -> Rotary | None:
        """The model's RoPE table (:attr:`hooks.modelroles.Roles.rotary` of :meth:`roles`): a
        declared one (``hooks.roles(model, rotary=...)``), else the first in module order: a
        module named ``*rotary_emb`` or of a class named like ``Rotary`` (named), or the module
        that makes the cos/sin (or complex) table the traced forward saw rotate an attention's
        queries or keys (traced: it returns the table, holds it, or computes it in its
        forward, the attention module itself when RoPE is a function called there)."""
        modules = dict(self.model.named_modules())
        found = [r for r in self.roles().rotary if r.module in modules]
        return next((r for r in found if r.how == "declared"), found[0] if found else None)

    def rotary_module(self) -> tuple[str, nn.Module] | None:
        """``(name, module)`` of :meth:`rotary`, or None."""
        r = self.rotary()
        return None if r is None else (r.module, dict(self.model.named_modules())[r.module])

    def moe_blocks(self) -> list[MoEInfo]:
        """The MoE blocks of :meth:`roles` that have a router (declared, traced: a ``topk``
        over a projection's scores beside a list of E experts, or named: an ``experts`` child
        and a ``gate``/``router`` child), in module order; E from the role, else the config's
        ``num_local_experts``/``num_experts``."""
        modules = dict(self.model.named_modules())
        blocks = {b.name: b for b in self.roles().moe if b.router in modules}
        e_cfg = self.cfg("num_local_experts", self.cfg("num_experts"))
        out = []
        for name in modules:
            b = blocks.get(name)
            if b is not None:
                e = b.num_experts or (e_cfg if isinstance(e_cfg, int) else 0)
                out.append(MoEInfo(b.name, b.router, modules[b.router], int(e)))
        return out

    def norm_modules(self) -> list[tuple[str, nn.Module]]:
        """Normalisation modules (:attr:`hooks.modelroles.Roles.norms`: those whose forward
        normalises, classes named like a norm, the declared final norm), in module order."""
        modules = dict(self.model.named_modules())
        return [(n.module, modules[n.module]) for n in self.roles().norms
                if n.module in modules]

    def embeddings(self) -> tuple[tuple[str, nn.Module] | None, tuple[str, nn.Module] | None]:
        """The token embedding and the LM head as ``(name, module)`` pairs (None if absent).

        The embedding: HF's ``get_input_embeddings`` when present, else the first
        ``nn.Embedding`` with V rows (any, without a config). The head: the LM head role of
        :meth:`roles` (declared; ``get_output_embeddings()`` or ``lm_head``; the projection
        whose output is the logits, traced), else the last projection with as many outputs as
        the embedding has rows and as many inputs as it has columns.
        """
        names = {id(m): n for n, m in self.model.named_modules()}
        emb = head = None
        with contextlib.suppress(Exception):
            e = self.model.get_input_embeddings()
            if isinstance(e, nn.Module) and id(e) in names:
                emb = (names[id(e)], e)
        r = self.roles().lm_head  # declared, named or traced (hooks.modelroles)
        if r is not None and r.module in names.values():
            head = (r.module, dict(self.model.named_modules())[r.module])
        v = self.cfg("vocab_size")
        if emb is None:
            for n, m in self.model.named_modules():
                if isinstance(m, nn.Embedding) and (v is None or m.num_embeddings == v):
                    emb = (n, m)
                    break
        if head is None:
            rows = v if isinstance(v, int) else (emb[1].num_embeddings if emb else None)
            width = emb[1].embedding_dim if emb and isinstance(emb[1], nn.Embedding) else None
            if isinstance(rows, int):
                for n, m in self.model.named_modules():
                    if is_projection(m) and out_width(m) == rows and (
                            width is None or in_width(m) == width):
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

    def module_names(self) -> dict[int, str]:
        """``id(module)`` -> qualified name."""
        return {id(m): n for n, m in self.model.named_modules()}


def fmt(x: float, digits: int = 3) -> str:
    """A number for evidence text: ``nan``/``inf`` spelled out, else ``digits`` significant."""
    if x is None:
        return "n/a"
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"
