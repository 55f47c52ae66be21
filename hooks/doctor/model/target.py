"""``Target``: the model under examination, its batch and loss convention, what kind of model it
is, and what the checks need to find in it (attention, rotary, MoE and norm modules, the
embedding and the LM head) by structure, so that the same checks run on minillm, HF models of
many families and users' own models.

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
from hooks.modelroles.found import AttentionRole, Roles


class SkipCheck(Exception):
    """Raised inside a check that applies but cannot be measured on this model or batch; the
    message is the reason (and, where it helps, what to return instead)."""


class NotApplicable(Exception):
    """Raised inside a check that does not apply to this kind of model (e.g. causality on a
    bidirectional encoder); the message says why. Reported as ``n/a``."""


#: Child names of the query, key, value and output projections of an attention module.
Q_NAMES = ("q_proj", "query", "q", "wq", "to_q")
K_NAMES = ("k_proj", "key", "k", "wk", "to_k")
V_NAMES = ("v_proj", "value", "v", "wv", "to_v")
O_NAMES = ("o_proj", "out_proj", "o", "wo", "c_proj", "proj", "dense", "to_out")
#: Child names of fused q/k/v projections (GPT-2 ``c_attn``, Phi-3 ``qkv_proj``, ...).
FUSED_NAMES = ("qkv_proj", "c_attn", "qkv", "Wqkv", "query_key_value", "in_proj")


@dataclass
class AttentionInfo:
    """An attention module and how its keys and values map to heads.

    Attributes:
        name: qualified module name.
        module: the module.
        num_heads: H, query heads (0 when unknown).
        num_kv_heads: Hkv (0 when unknown).
        head_dim: Dh (0 when unknown).
        layout: ``separate`` (k_proj / v_proj of Hkv·Dh outputs each), ``fused`` (one q|k|v
            projection of (H + 2·Hkv)·Dh outputs, q first, as Phi-3's ``qkv_proj``), ``mha``
            (keys and values have as many heads as queries: no grouping), or ``unsupported``.
        k_site: (module, offset): where the keys of KV head g are the output columns
            ``offset + [g·Dh, (g+1)·Dh)`` (a ``k_norm`` when the keys are normalised, so that a
            perturbation is not spread over every head by a joint norm).
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


def _out_features(m: Any) -> int | None:
    """Output width of a linear-like module (``nn.Linear``, HF's ``Conv1D`` with ``nf``)."""
    if not isinstance(m, nn.Module):
        return None
    v = getattr(m, "out_features", None)
    if v is None:
        v = getattr(m, "nf", None)
    return v if isinstance(v, int) else None


def _in_features(m: Any) -> int | None:
    v = getattr(m, "in_features", None)
    if isinstance(v, int):
        return v
    w = getattr(m, "weight", None)
    if getattr(m, "nf", None) is not None and isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0])  # HF Conv1D stores (in, out)
    return None


def _linear_like(m: Any) -> bool:
    return _out_features(m) is not None and _in_features(m) is not None


def _child(m: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for n in names:
        c = getattr(m, n, None)
        if isinstance(c, nn.Module) and _linear_like(c):
            return n, c
    return None


def _is_norm(m: Any) -> bool:
    cls = type(m).__name__
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or cls.endswith(
        ("RMSNorm", "LayerNorm", "RmsNorm"))


def _attention_named(m: nn.Module) -> bool:
    cls = type(m).__name__
    return isinstance(m, nn.MultiheadAttention) or "Attention" in cls or "Attn" in cls


def _fused_by_shape(m: nn.Module, heads: int | None,
                    kv: int | None) -> tuple[str, nn.Module] | None:
    """The one linear child of ``m`` whose outputs are a q|k|v split of its inputs:
    (H + 2·Hkv)·Dh outputs for D = H·Dh inputs when the heads are known, else 3·D."""
    hits = []
    for n, c in m.named_children():
        fo, fi = _out_features(c), _in_features(c)
        if not (_linear_like(c) and fo and fi):
            continue
        want = (heads + 2 * kv) * (fi // heads) if heads and kv and fi % heads == 0 else 3 * fi
        if fo == want:
            hits.append((n, c))
    return hits[0] if len(hits) == 1 else None


def _int_attr(objs: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    for o in objs:
        if o is None:
            continue
        for n in names:
            v = o.get(n) if isinstance(o, dict) else getattr(o, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _info_from_role(name: str, m: nn.Module, role: AttentionRole,
                    model: nn.Module) -> AttentionInfo | None:
    """The :class:`AttentionInfo` of a declared or traced attention role (its heads from the
    shapes of q and k, its k/v columns, its o projection); None when its heads are unknown."""
    h, hkv, dh = role.num_heads, role.num_kv_heads, role.head_dim
    if not (h and dh and hkv and role.o) or h % hkv:
        return None  # heads unknown, or keys/values of another width (MLA), or no o projection
    cls = type(m).__name__
    if hkv == h:
        return AttentionInfo(name, m, h, h, dh, "mha",
                             why=f"{cls}: H = Hkv = {h} ({role.how})")
    modules = dict(model.named_modules())
    if role.k is None or role.v is None or role.o is None or role.o not in modules:
        return None
    layout = "fused" if role.k.module == role.v.module == getattr(role.q, "module", None) \
        else "separate"
    return AttentionInfo(name, m, h, hkv, dh, layout, (modules[role.k.module], role.k.start),
                         (modules[role.v.module], role.v.start), modules[role.o])


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
        #: (H, Hkv) of the attention calls recorded in a module (:meth:`_recorded_attention`)
        self._recorded_heads: dict[str, tuple[int | None, int | None]] = {}
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
        """Every attention module, innermost (a wrapper like HF's ``BertAttention`` around
        ``BertSelfAttention`` is left out), with its head layout (:class:`AttentionInfo`): the
        modules named like attention or with q/k/v children, else those in which
        :func:`hooks.capture` records attention probabilities on the batch
        (:meth:`_recorded_attention`), else the traced ones (:meth:`roles`); declared
        attention modules (``hooks.roles(model, attention=...)``) always."""
        if self._attn is not None:
            return self._attn
        found: list[tuple[str, nn.Module]] = []
        for name, m in self.model.named_modules():
            q, k, v = _child(m, Q_NAMES), _child(m, K_NAMES), _child(m, V_NAMES)
            fused = _child(m, FUSED_NAMES)
            if (q and k and v) or (fused and _attention_named(m)) or _attention_named(m):
                found.append((name, m))
        if not found:
            found = self._recorded_attention()
        from hooks.modelroles import declared_roles

        known = {n for n, _ in found}
        try:  # a declared module is attention; where names found none, the traced ones are
            extra = declared_roles(self.model).attention
        except ValueError:
            extra = []
        extra = extra + (self.roles().attention if not known else [])
        modules = dict(self.model.named_modules())
        for a in extra:
            if a.name not in known and a.name in modules:
                known.add(a.name)
                found.append((a.name, modules[a.name]))
        names = [n for n, _ in found]
        out = []
        for name, m in found:
            inner = any(o.startswith(name + ".") for o in names) if name else len(names) > 1
            if inner and not isinstance(m, nn.MultiheadAttention) and not (
                    _child(m, Q_NAMES) and _child(m, K_NAMES)):
                continue  # a wrapper around the attention proper
            out.append(self._attention_info(name, m))
        self._attn = out
        return out

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
        for a in trace.attention:
            self._recorded_heads.setdefault(a.module, (a.num_heads, a.num_kv_heads))
        return [(n, modules[n]) for n in self._recorded_heads if n in modules]

    def roles(self) -> Roles:
        """Every role of the model (:func:`hooks.modelroles.find_roles` on the batch: declared,
        traced, named), found once; only names and the declaration when the declaration does
        not fit the model or the forward cannot be traced (the notes say why)."""
        if self._roles is None:
            from hooks.modelroles import find_roles

            try:
                self._roles = find_roles(self.model, self.batch)
            except ValueError as exc:  # a declaration that does not fit: said, not raised
                self._roles = Roles(notes=[str(exc)])
        return self._roles

    def _attention_info(self, name: str, m: nn.Module) -> AttentionInfo:
        """The layout of attention module ``m``: a declared role first; then by names; where
        names cannot tell its heads or layout, the traced role (:meth:`roles`)."""
        from hooks.modelroles import declared_roles

        try:
            declared = declared_roles(self.model).attention_of(name)
        except ValueError:
            declared = None
        if declared is not None:
            role = self.roles().attention_of(name)
            got = _info_from_role(name, m, role, self.model) if role is not None else None
            if got is not None:
                return got
        info = self._named_info(name, m)
        if info.layout == "unsupported" or not info.num_heads:
            role = self.roles().attention_of(name)
            got = _info_from_role(name, m, role, self.model) if role is not None else None
            if got is not None:
                return got
        return info

    def _named_info(self, name: str, m: nn.Module) -> AttentionInfo:
        cls = type(m).__name__
        rec_heads, rec_kv = self._recorded_heads.get(name, (None, None))
        heads = _int_attr((m, self.config), ("num_heads", "num_attention_heads", "n_head",
                                            "n_heads")) or rec_heads
        kv_cfg = _int_attr((m, self.config), ("num_key_value_heads", "num_kv_heads",
                                             "n_kv_heads")) or rec_kv
        if isinstance(m, nn.MultiheadAttention):
            return AttentionInfo(name, m, m.num_heads, m.num_heads, m.head_dim, "mha",
                                 why=f"nn.MultiheadAttention: {m.num_heads} heads for queries, "
                                     "keys and values alike")
        q, k, v = _child(m, Q_NAMES), _child(m, K_NAMES), _child(m, V_NAMES)
        o = _child(m, O_NAMES)
        if q and k and v:
            qo, ko, vo = (_out_features(x[1]) for x in (q, k, v))
            if ko == qo and vo == qo:
                hd = getattr(m, "head_dim", None)
                h = heads or (qo // hd if isinstance(hd, int) and hd else 0)
                return AttentionInfo(name, m, h, h, qo // h if h else 0, "mha",
                                     why=f"{cls}: {q[0]}, {k[0]} and {v[0]} are all {qo} wide "
                                         "(as many key/value heads as query heads)")
            hd = getattr(m, "head_dim", None)
            if not isinstance(hd, int) or hd <= 0:
                hd = qo // heads if heads else 0
            if hd <= 0 or qo % hd or ko % hd or vo != ko or (qo // hd) % (ko // hd):
                return AttentionInfo(name, m, 0, 0, 0, "unsupported",
                                     why=f"{cls}: cannot tell the head size from {q[0]} "
                                         f"({qo}), {k[0]} ({ko}) and {v[0]} ({vo})")
            if o is None:
                return AttentionInfo(name, m, qo // hd, ko // hd, hd, "unsupported",
                                     why=f"{cls} has no output projection "
                                         f"({'/'.join(O_NAMES)}) to read per-head outputs from")
            k_site: tuple[nn.Module, int] = (k[1], 0)
            norm = getattr(m, "k_norm", None)
            if _is_norm(norm):
                k_site = (norm, 0)  # perturb after the norm (OLMoE's k_norm spans every head)
            return AttentionInfo(name, m, qo // hd, ko // hd, hd, "separate", k_site,
                                 (v[1], 0), o[1])
        fused = _child(m, FUSED_NAMES) or _fused_by_shape(m, heads, kv_cfg)
        if fused is not None:
            fo, fi = _out_features(fused[1]), _in_features(fused[1])
            hd = getattr(m, "head_dim", None)
            if heads and not (isinstance(hd, int) and hd > 0):
                hd = fi // heads if fi else None
            kv = kv_cfg
            if fo == 3 * (fi or 0) and (kv is None or kv == heads):
                return AttentionInfo(name, m, heads or 0, heads or 0,
                                     (fi // heads) if heads and fi else 0, "mha",
                                     why=f"{cls}: one fused {fused[0]} of 3×{fi} outputs "
                                         "(as many key/value heads as query heads)")
            if heads and kv and isinstance(hd, int) and fo == (heads + 2 * kv) * hd and o:
                if kv == heads:
                    return AttentionInfo(name, m, heads, kv, hd, "mha",
                                         why=f"{cls}: H = Hkv = {heads}")
                return AttentionInfo(name, m, heads, kv, hd, "fused", (fused[1], heads * hd),
                                     (fused[1], (heads + kv) * hd), o[1])
            return AttentionInfo(name, m, heads or 0, kv or 0, hd or 0, "unsupported",
                                 why=f"{cls}: fused {fused[0]} of {fo} outputs does not split "
                                     f"into q|k|v with H={heads}, Hkv={kv}")
        kids = ", ".join(n for n, _ in m.named_children()) or "none"
        return AttentionInfo(name, m, heads or 0, kv_cfg or 0, 0, "unsupported",
                             why=f"{cls} has no separate or fused q/k/v projections mdb "
                                 f"recognises (children: {kids})")

    def attention_of(self, module: str | None) -> str | None:
        """The attention module that ``module`` is or sits inside, or None."""
        if module is None:
            return None
        for a in self.attention_layers():
            if module == a.name or module.startswith(a.name + "."):
                return a.name
        return None

    def rotary_module(self) -> tuple[str, nn.Module] | None:
        """The first module named ``*rotary_emb`` or whose class name contains ``Rotary``."""
        for name, m in self.model.named_modules():
            if name.endswith("rotary_emb") or "Rotary" in type(m).__name__:
                return name, m
        return None

    def moe_blocks(self) -> list[MoEInfo]:
        """Modules with an ``experts`` child and a ``gate`` or ``router`` child; where there is
        none, the declared or traced MoE blocks (:mod:`hooks.modelroles`)."""
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
        return out or self._moe_by_role()

    def _moe_by_role(self) -> list[MoEInfo]:
        """Where no block is named like one: the declared or traced MoE blocks
        (:meth:`roles`) with a router."""
        modules = dict(self.model.named_modules())
        return [MoEInfo(b.name, b.router, modules[b.router], b.num_experts or 0)
                for b in self.roles().moe if b.router in modules]

    def norm_modules(self) -> list[tuple[str, nn.Module]]:
        """Normalisation modules: class name ending in ``RMSNorm``/``LayerNorm`` or
        ``nn.LayerNorm``/``nn.RMSNorm`` instances."""
        return [(n, m) for n, m in self.model.named_modules() if _is_norm(m)]

    def embeddings(self) -> tuple[tuple[str, nn.Module] | None, tuple[str, nn.Module] | None]:
        """The token embedding and the LM head as ``(name, module)`` pairs (None if absent).

        Uses HF's ``get_input_embeddings``/``get_output_embeddings`` when present, else the
        first ``nn.Embedding`` with V rows (any, without a config) and a module named
        ``lm_head``, else the last linear layer with as many outputs as the embedding has rows
        and as many inputs as it has columns.
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
        with contextlib.suppress(ValueError):  # a declared head wins (hooks.modelroles)
            from hooks.modelroles import declared_roles

            d = declared_roles(self.model).lm_head
            if d is not None:
                head = (d.module, dict(self.model.named_modules())[d.module])
        if head is None:  # the projection whose output is the logits, traced
            r = self.roles().lm_head if not any(
                n.endswith("lm_head") for n, _ in self.model.named_modules()) else None
            if r is not None:
                head = (r.module, dict(self.model.named_modules())[r.module])
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
            rows = v if isinstance(v, int) else (emb[1].num_embeddings if emb else None)
            width = emb[1].embedding_dim if emb and isinstance(emb[1], nn.Embedding) else None
            if head is None and isinstance(rows, int):
                for n, m in self.model.named_modules():
                    if _linear_like(m) and _out_features(m) == rows and (
                            width is None or _in_features(m) == width):
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
