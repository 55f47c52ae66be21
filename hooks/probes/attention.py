"""Attention probabilities the model actually computed, read from its own calls.

Dimension legend: B batch, H query heads, Hkv key/value heads, T query positions (L in PyTorch's
docs), S key positions, E head dim.

While a capture with attention requested runs, two kinds of calls are intercepted and attributed
to the innermost module of the model being run (a module stack kept by forward pre-hooks and
``always_call`` forward hooks):

* ``torch.nn.functional.scaled_dot_product_attention``: the probabilities are recomputed from
  that call's own ``query``, ``key``, ``attn_mask``, ``is_causal``, ``scale`` and
  ``enable_gqa`` (PyTorch's reference: ``softmax(q kᵀ · scale + mask)``, causal top-left
  aligned, rows whose keys are all ``-inf`` give 0 like SDPA's safe softmax). Whatever the model
  did to q and k before the call (q/k norms, RoPE, fused projections, MLA, sliding windows,
  float masks, padding) is in those tensors, so it is right by construction.
* a softmax over the last dimension of a 4-D tensor (``Tensor.softmax``, hence
  ``F.softmax``, and ``torch.softmax``): HF's eager attention, minillm's eager path, nanoGPT's
  hand-written ``softmax(q·kᵀ)``. Those values *are* the model's probabilities; they are copied.
  A 3-D softmax is taken inside ``nn.MultiheadAttention`` (its ``need_weights`` path) and
  inside a module that looks like attention and declares ``num_heads`` dividing its first
  dimension: BART-style eager attention (XGLM, TrOCR, MVP) folds the heads into the batch,
  ``bmm`` to (B·H, T, S), then the softmax; it is shown as (B, H, T, S).

Mechanism, chosen by measurement (``benchmarks/bench_attention_capture.py --mechanism``): the
functions are swapped on ``torch.nn.functional`` / ``torch`` / ``torch.Tensor`` (and on the
module globals of the model's classes that imported them by name) for the capture only, and
restored on exit, also when the body raises. A ``TorchFunctionMode`` would see every torch call
of the step, the capture's own statistics included (about 11,000 per captured step of the
default minillm config at 4×128); on its forward alone a no-op mode measured 1.06× and the
no-op swap 0.98× (noise) on a busy 2-core CPU. The swap sees only the intercepted functions.

Not seen: attention computed by other kernels (flash-attn, flex attention, fused CUDA kernels)
or other ops, SDPA bound under another name outside the model's own modules, and calls from
other threads while the capture runs.
"""

from __future__ import annotations

import math
import re
import sys
import threading
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# the name rule is hooks.modelroles's, which every view reads (kept here under its old name)
from hooks.modelroles.named import looks_like_attention  # noqa: F401
from hooks.trace.records import AttentionRecord, Note, layer_of

#: Default byte budget for attention probabilities (and masks) kept by one capture.
DEFAULT_ATTENTION_BYTES = 64 << 20

# the builtins, for mdb's own computation (the capture swaps the public names while it runs)
_ORIG_SDPA = torch._C._nn.scaled_dot_product_attention
_ORIG_TORCH_SOFTMAX = torch._C._VariableFunctions.softmax


class AttentionHost(Protocol):
    """What attention capture needs of the running capture (a
    :class:`hooks.probes.base.ProbeContext`)."""

    @property
    def recording(self) -> bool: ...

    def wants_attention(self, name: str) -> bool: ...

    def add_attention(self, rec: AttentionRecord) -> None: ...

    def add_note(self, note: Note) -> None: ...


# -- the reference computation ------------------------------------------------------------------
def _masked_below(m: torch.Tensor) -> torch.Tensor:
    """True where an additive float mask excludes the key (-inf, or at most half the dtype's
    most negative value: HF writes ``finfo.min``)."""
    return m <= torch.finfo(m.dtype).min / 2


def sdpa_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The probabilities ``scaled_dot_product_attention`` applies to the values.

    Follows PyTorch's documented reference implementation in fp32: ``scale`` defaults to
    ``1/sqrt(E)``; ``is_causal`` keeps ``j <= i`` (top-left); a bool mask keeps True entries, a
    float mask is added; with ``enable_gqa`` the key heads are ``repeat_interleave``-d to H.
    Rows whose scores are all ``-inf`` are 0 (SDPA's safe softmax), never NaN.

    Args:
        query: (..., H, T, E).
        key: (..., Hkv, S, E).
        attn_mask, is_causal, scale, enable_gqa: as passed to the call.

    Returns:
        (probs, keep): probs (..., H, T, S) fp32; keep the bool mask of keys that took part,
        in its own shape, broadcastable to probs (None when every key took part).
    """
    q = query.detach().float()
    k = key.detach().float()
    t, s = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = torch.matmul(q * scale, k.transpose(-2, -1))  # ours: changed in place below
    keep = None  # keys that took part
    neg_inf = None  # keys whose score is -inf for sure (SDPA's all -inf rows give 0)
    if is_causal:
        keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        neg_inf = ~keep
        scores.masked_fill_(neg_inf, float("-inf"))
    if attn_mask is not None:
        m = attn_mask.detach()
        fits = torch.broadcast_shapes(scores.shape, m.shape) == scores.shape
        if m.dtype == torch.bool:
            scores = scores.masked_fill_(~m, float("-inf")) if fits else \
                scores.masked_fill(~m, float("-inf"))
            excl, ninf = m, ~m
        else:
            scores = scores.add_(m) if fits else scores + m.float()
            excl, ninf = ~_masked_below(m), torch.isneginf(m)
        keep = excl if keep is None else keep & excl
        neg_inf = ninf if neg_inf is None else neg_inf | ninf
    probs = _ORIG_TORCH_SOFTMAX(scores, dim=-1)
    if neg_inf is not None:
        dead = neg_inf.all(dim=-1, keepdim=True)
        if bool(dead.any()):
            probs.masked_fill_(dead, 0.0)
    if keep is not None and bool(keep.all()):
        keep = None
    return probs, keep


def _as_bhts(t: torch.Tensor) -> torch.Tensor:
    """(..., T, S) -> (B, H, T, S): a 3-D (N, T, S) becomes (N, 1, T, S), more than 4-D folds
    the leading dimensions into B."""
    if t.dim() == 4:
        return t
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() == 2:
        return t[None, None]
    return t.reshape(-1, *t.shape[-3:])


def _small_mask(keep: torch.Tensor, ndim: int = 4) -> torch.Tensor:
    """``keep`` (broadcastable to probabilities of ``ndim`` dimensions) as (B, H, T, S) bool,
    with the head and batch dimensions collapsed to 1 where they are constant (it broadcasts
    back to the probabilities)."""
    if keep.dim() < ndim:
        keep = keep.reshape((1,) * (ndim - keep.dim()) + tuple(keep.shape))
    keep = _as_bhts(keep)
    if keep.shape[1] > 1 and bool((keep == keep[:, :1]).all()):
        keep = keep[:, :1]
    if keep.shape[0] > 1 and bool((keep == keep[:1]).all()):
        keep = keep[:1]
    return keep.contiguous()


def kv_heads(query: torch.Tensor, key: torch.Tensor, enable_gqa: bool) -> tuple[int, int, str]:
    """(H, distinct KV heads, how) of one call, from its shapes and, when K has H heads, from
    which consecutive heads of K are identical (``repeat_kv`` before the call)."""
    h = query.shape[-3] if query.dim() >= 3 else 1
    hk = key.shape[-3] if key.dim() >= 3 else 1
    if hk != h:
        return h, hk, "enable_gqa" if enable_gqa else "broadcast"
    if h < 2 or key.dim() < 4:
        return h, hk, "heads"
    k = key.detach()
    if not torch.equal(k[:, 0], k[:, 1]):
        return h, h, "heads"
    for r in range(h, 1, -1):
        if h % r:
            continue
        g = k.reshape(k.shape[0], h // r, r, *k.shape[2:])
        if torch.equal(g, g[:, :, :1].expand_as(g)):
            return h, h // r, "repeated"
    return h, h, "heads"


def kv_groups(num_heads: int, num_kv_heads: int | None) -> list[int] | None:
    """The KV head each query head reads at a call with H query heads and H_kv distinct KV
    heads (:func:`kv_heads`): ``h // (H / H_kv)``, the grouping of SDPA's ``enable_gqa`` and of
    HF's ``repeat_kv`` (``repeat_interleave`` over heads), which :func:`kv_heads` recognises.

    Returns:
        list[int]: (H,) KV head of each query head; None when H_kv is unknown or does not
        divide H.
    """
    if not num_kv_heads or num_heads % num_kv_heads:
        return None
    group = num_heads // num_kv_heads
    return [h // group for h in range(num_heads)]


_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


def _bind_sdpa(args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_PARAMS, args, strict=False))
    bound.update(kwargs)
    return bound


# -- interception -------------------------------------------------------------------------------
_LOCK = threading.Lock()
_ACTIVE: list[AttentionCapture] = []
_PATCHED: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, wrapper)


def _dispatch(kind: str, payload: tuple) -> None:
    for cap in reversed(_ACTIVE):
        if cap.on_call(kind, payload):
            return


def _sdpa_wrapper(orig):
    """``orig`` (an SDPA) that also hands each call to the active captures."""

    def scaled_dot_product_attention(*args, **kwargs):
        out = orig(*args, **kwargs)
        if _ACTIVE:
            _dispatch("sdpa", (args, kwargs))
        return out

    scaled_dot_product_attention.__wrapped__ = orig
    return scaled_dot_product_attention


def _softmax_wrapper(orig):
    """``orig`` (``torch.softmax`` or ``Tensor.softmax``: input first) that hands 3-D and 4-D
    results to the active captures."""

    def softmax(input, *args, **kwargs):  # noqa: A002 - torch's parameter name
        out = orig(input, *args, **kwargs)
        if _ACTIVE and isinstance(out, torch.Tensor) and 3 <= out.dim() <= 4:
            _dispatch("softmax", (input, out, args[0] if args else kwargs.get("dim")))
        return out

    softmax.__wrapped__ = orig
    return softmax


def observe_softmax(scores: torch.Tensor, probs: torch.Tensor, dim: int) -> None:
    """Hand probabilities the model uses but that no intercepted function returned (an edit of
    the attention pattern, :mod:`hooks.engine.edit_pattern`, computes them under another
    name) to the active captures, as the softmax of ``scores`` over ``dim`` would be; nothing
    when no capture records attention.

    Args:
        scores: (B, H, T, S) scores (``-inf`` where masked).
        probs: (B, H, T, S) the probabilities the model goes on with.
        dim: the softmax's dimension (the last).
    """
    if _ACTIVE:
        _dispatch("softmax", (scores, probs, dim))


def in_own_computation() -> bool:
    """Whether this thread is inside an active capture's own computation of a record (its
    softmax over a call's q·kᵀ, not the model's)."""
    return any(getattr(cap._local, "busy", False) for cap in _ACTIVE)


_MISSING = object()


def _patch(owner: Any, name: str, make) -> None:
    """Replace ``owner.name`` by ``make(current)`` (each site keeps calling what it called)."""
    if any(o is owner and n == name for o, n, _, _ in _PATCHED):
        return
    if isinstance(owner, type):
        original = owner.__dict__.get(name, _MISSING)
        current = getattr(owner, name)
    else:
        original = current = getattr(owner, name)
    wrapper = make(current)
    setattr(owner, name, wrapper)
    _PATCHED.append((owner, name, original, wrapper))


def _install(module_names: set[str]) -> None:
    """Swap SDPA and softmax on ``torch.nn.functional``, ``torch`` and ``torch.Tensor``, and
    the names bound to the builtins in the modules ``module_names`` (the model's classes')."""
    _patch(F, "scaled_dot_product_attention", _sdpa_wrapper)
    _patch(torch, "softmax", _softmax_wrapper)
    _patch(torch.Tensor, "softmax", _softmax_wrapper)
    for modname in sorted(module_names):
        mod = sys.modules.get(modname)
        if mod is None or mod is F or mod is torch:
            continue
        for name, value in list(vars(mod).items()):
            if value is _ORIG_SDPA:
                _patch(mod, name, _sdpa_wrapper)
            elif value is _ORIG_TORCH_SOFTMAX:
                _patch(mod, name, _softmax_wrapper)


def _uninstall() -> None:
    while _PATCHED:
        owner, name, original, wrapper = _PATCHED.pop()
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name,
                                                                                  None)
        if current is not wrapper:
            continue  # someone patched over us: leave theirs in place
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def installed() -> bool:
    """Whether the interceptors are in place (only while a capture with attention runs)."""
    return bool(_PATCHED)


# -- one capture --------------------------------------------------------------------------------
#: Layers that mix positions without a softmax over keys, by words in their modules' class or
#: attribute names (lower case): Mamba/SSM mixers, RWKV blocks, linear attention (MiniMax's
#: lightning attention, Gated DeltaNet, retention).
NO_SOFTMAX_KINDS = (
    ("state-space", ("mamba", "ssm", "statespace")),
    ("RWKV", ("rwkv",)),
    ("linear attention", ("linearattention", "linear_attn", "lightning", "deltanet",
                          "retention")),
)
_DECODER_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer|decoder_layers)\.\d+$")


def no_softmax_kind(name: str, m: nn.Module) -> str | None:
    """``"state-space"``, ``"RWKV"`` or ``"linear attention"`` when module ``m`` (named
    ``name``) is such a mixer by its class or attribute name (:data:`NO_SOFTMAX_KINDS`), else
    None."""
    words = (type(m).__name__ + " " + name.rpartition(".")[2]).lower()
    return next((kind for kind, keys in NO_SOFTMAX_KINDS if any(k in words for k in keys)),
                None)


class AttentionCapture:
    """Attention probabilities of one capture, within a byte budget.

    Args:
        host: the capture's probe context (recording flag, ``wants_attention``, sinks).
        budget: bytes of probabilities and masks to keep; calls past it are not recomputed and
            are named in a note.
    """

    def __init__(self, host: AttentionHost, budget: int = DEFAULT_ATTENTION_BYTES) -> None:
        if budget < 0:
            raise ValueError(f"attention_bytes must be >= 0, got {budget}")
        self.host = host
        self.budget = int(budget)
        self.kept = 0
        self._local = threading.local()
        self._counts: dict[str, int] = {}
        self._recorded: dict[tuple[str, int], list[AttentionRecord]] = {}
        self._cut: list[str] = []
        self._errors: dict[str, str] = {}
        self._ran: dict[str, tuple[nn.Module, int]] = {}
        self._module_names: set[str] = set()
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------------
    def attach(self, modules: list[tuple[str, nn.Module]]) -> list[Any]:
        """Hook every module of ``modules`` to keep the module stack; return the handles."""
        handles = []
        for name, m in modules:
            self._module_names.add(type(m).__module__)
            handles.append(m.register_forward_pre_hook(self._pre_hook(name)))
            handles.append(m.register_forward_hook(self._post_hook(name), always_call=True))
        return handles

    def start(self) -> None:
        """Put the interceptors in place (shared by nested captures)."""
        with _LOCK:
            try:
                _install(self._module_names)  # a nested capture adds its model's modules
            except BaseException:
                if not _ACTIVE:
                    _uninstall()
                raise
            _ACTIVE.append(self)
        self._started = True

    def stop(self) -> None:
        """Remove the interceptors (when no other capture needs them) and write the notes."""
        if not self._started:
            return
        self._started = False
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if not _ACTIVE:
                _uninstall()
        try:
            self._notes()
        except Exception as exc:  # a note must never stop the capture from finishing
            self.host.add_note(Note("attention", f"attention notes failed: {exc!r}"))

    # -- module stack ---------------------------------------------------------------------------
    def _stack(self) -> list:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    def _pre_hook(self, name: str):
        def pre(mod, args):
            if self.host.recording:
                ci = self._counts.get(name, 0)
                self._counts[name] = ci + 1
                self._stack().append([name, mod, ci, None])
            return None

        return pre

    def _post_hook(self, name: str):
        def post(mod, args, output):
            st = getattr(self._local, "stack", None)
            if not st:
                return None
            for i in range(len(st) - 1, -1, -1):
                if st[i][1] is mod:
                    frame = st[i]
                    del st[i:]  # children that raised are closed with it
                    self._ran[name] = (mod, self._ran.get(name, (mod, 0))[1] + 1)
                    if frame[3]:
                        self._adopt_returned(frame, output)
                    break
            return None

        return post

    # -- calls ----------------------------------------------------------------------------------
    def on_call(self, kind: str, payload: tuple) -> bool:
        """Handle one intercepted call; True when it was attributed to this capture's model."""
        st = getattr(self._local, "stack", None)
        if not st or not self.host.recording:
            return False
        if getattr(self._local, "busy", False):
            return True  # our own computation, not the model's
        frame = st[-1]
        name, mod, ci = frame[0], frame[1], frame[2]
        if not self.host.wants_attention(name):
            return True
        self._local.busy = True
        try:
            with torch.no_grad():
                if kind == "sdpa":
                    rec = self._from_sdpa(name, ci, _bind_sdpa(*payload))
                else:
                    rec = self._from_softmax(name, mod, ci, *payload, frame=frame)
            if rec is not None:
                self._keep(rec)
        except Exception as exc:  # never break the model's forward
            self._errors.setdefault(name, f"{type(exc).__name__}: {exc}")
        finally:
            self._local.busy = False
        return True

    def _fits(self, name: str, nbytes: int) -> bool:
        if self.kept + nbytes > self.budget:
            self._cut.append(name)
            return False
        return True

    def _keep(self, rec: AttentionRecord) -> None:
        if not self._fits(rec.module, rec.nbytes()):
            return
        self.kept += rec.nbytes()
        self._recorded.setdefault((rec.module, rec.call_index), []).append(rec)
        self.host.add_attention(rec)

    def _from_sdpa(self, name: str, ci: int, a: dict[str, Any]) -> AttentionRecord | None:
        q, k = a["query"], a["key"]
        if not self._fits(name, math.prod(q.shape[:-1]) * k.shape[-2] * 4):
            return None
        probs, keep = sdpa_probs(q, k, a["attn_mask"], bool(a["is_causal"]), a["scale"],
                                 bool(a["enable_gqa"]))
        if keep is not None and probs.dim() > 4:
            keep = keep.expand(probs.shape)
        h, hkv, how = kv_heads(q, k, bool(a["enable_gqa"]))
        note = "" if q.dim() == 4 else f"{q.dim()}-D call: shown as (B, H, T, S) = " \
            f"{tuple(_as_bhts(probs).shape)}"
        return AttentionRecord(
            name, ci, layer_of(name), "sdpa", _as_bhts(probs).cpu(),
            mask=None if keep is None else _small_mask(keep, probs.dim()).cpu(),
            num_heads=h, num_kv_heads=hkv, kv_detail=how,
            dropout=float(a["dropout_p"] or 0.0), note=note)

    def _from_softmax(self, name: str, mod: nn.Module, ci: int, inp: torch.Tensor,
                      out: torch.Tensor, dim: Any, frame: list) -> AttentionRecord | None:
        if not isinstance(dim, int) or dim % out.dim() != out.dim() - 1:
            return None
        if not out.is_floating_point():
            return None
        note = ""
        if out.dim() == 3:  # heads folded into the batch: (B·H, T, S)
            heads = getattr(mod, "num_heads", None)
            if not isinstance(heads, int) or heads < 1 or out.shape[0] % heads:
                return None
            mha = isinstance(mod, nn.MultiheadAttention)
            if not (mha or looks_like_attention(mod)):
                return None
            probs = out.reshape(-1, heads, *out.shape[1:])
            x = inp.reshape(probs.shape)
            if not mha:  # BART-style eager attention (XGLM, TrOCR, MVP): bmm then softmax
                note = (f"a (B·H, T, S) = {tuple(out.shape)} softmax of {type(mod).__name__} "
                        f"({heads} heads): shown as (B, H, T, S) = {tuple(probs.shape)}")
        else:
            probs, x = out, inp
        if not self._fits(name, probs.numel() * 4 + probs.numel()):
            return None
        xd = x.detach()
        keep = ~(_masked_below(xd) if xd.is_floating_point() else torch.zeros_like(xd, dtype=bool))
        rec = AttentionRecord(
            name, ci, layer_of(name), "softmax",
            probs.detach().to("cpu", torch.float32, copy=True),
            mask=None if bool(keep.all()) else _small_mask(keep).cpu(),
            num_heads=int(probs.shape[1]), note=note)
        # the module may return a slice of these probabilities (attention sinks): see post hook
        frame[3] = (frame[3] or []) + [(rec, out)]
        return rec

    def _adopt_returned(self, frame: list, output: Any) -> None:
        """When the module returns a column slice of a softmax it ran (GPT-OSS drops its sink
        column), keep what the model keeps: the record becomes that slice."""
        parts = output if isinstance(output, (tuple, list)) else (output,)
        for rec, out in frame[3]:
            if out.dim() != 4:
                continue
            base = out.untyped_storage().data_ptr()
            for t in parts:
                if not (isinstance(t, torch.Tensor) and t.dim() == 4 and t is not out
                        and t.untyped_storage().data_ptr() == base
                        and t.shape[:-1] == out.shape[:-1] and t.shape[-1] < out.shape[-1]
                        and t.stride() == out.stride()):
                    continue
                c0 = t.storage_offset() - out.storage_offset()
                if not 0 <= c0 <= out.shape[-1] - t.shape[-1]:
                    continue
                extra = out.shape[-1] - t.shape[-1]
                sl = slice(c0, c0 + t.shape[-1])
                rec.probs = rec.probs[..., sl].contiguous()
                if rec.mask is not None:
                    rec.mask = rec.mask[..., sl].contiguous()
                    if bool(rec.mask.all()):
                        rec.mask = None
                rec.note = (f"the softmax covered {out.shape[-1]} columns; the module keeps "
                            f"{t.shape[-1]} (the other {extra}: attention sink), so rows sum "
                            "to less than 1")
                break

    # -- notes ----------------------------------------------------------------------------------
    def _notes(self) -> None:
        add = self.host.add_note
        if self._cut:
            uniq = list(dict.fromkeys(self._cut))
            shown = ", ".join(uniq[:3]) + (" …" if len(uniq) > 3 else "")
            add(Note("attention", f"attention_bytes={self.budget:,} reached: probabilities of "
                     f"{len(self._cut)} call(s) not kept ({shown}); pass a larger "
                     "attention_bytes or fewer modules (attention=[patterns])"))
        for name, msg in self._errors.items():
            add(Note("attention", f"attention not recorded: {msg}", module=name))
        names = {r[0] for r in self._recorded}
        said = self._no_softmax_notes(names)
        missing = []
        for name, (mod, calls) in self._ran.items():
            if not calls or not looks_like_attention(mod) or not self.host.wants_attention(name):
                continue
            if no_softmax_kind(name, mod) is not None:
                continue  # said by layer in _no_softmax_notes
            if any(n == name or n.startswith(name + ".") for n in names) or name in self._errors:
                continue
            if any(c == name for c in self._cut):
                continue
            missing.append(f"{name} ({type(mod).__name__})")
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more"
                                              if len(missing) > 3 else "")
            add(Note("attention", f"{shown} ran but called neither "
                     "scaled_dot_product_attention nor a softmax over the keys of a 4-D tensor "
                     "(flash-attn, flex attention or a fused kernel?): no probabilities "
                     "recorded"))
        elif not self._recorded and not self._cut and not self._errors and not said:
            add(Note("attention", "attention requested, but no scaled_dot_product_attention "
                     "call and no softmax over the last dimension of a 4-D tensor ran inside "
                     "the model: nothing to record"))

    def _no_softmax_notes(self, names: set[str]) -> int:
        """One note per decoder layer that ran, recorded no probabilities and mixes positions
        with a state-space, RWKV or linear-attention layer (the attention view lists it); how
        many were written."""
        said = 0
        for layer, (mod, calls) in self._ran.items():
            if not calls or not _DECODER_LAYER.search(layer) or not self.host.wants_attention(
                    layer) or any(n == layer or n.startswith(layer + ".") for n in names):
                continue
            inside = [(n, m) for n, (m, _) in self._ran.items() if n.startswith(layer + ".")]
            found = next(((n, m, k) for n, m in [(layer, mod), *inside]
                          if (k := no_softmax_kind(n, m)) is not None), None)
            if found is None:
                continue
            n, m, kind = found
            self.host.add_note(Note(
                "attention", f"no attention probabilities: a {kind} layer ({type(m).__name__} "
                f"{n}) mixes positions without a softmax over keys", module=layer))
            said += 1
        return said

    def recorded(self, name: str, call_index: int) -> bool:
        """Whether a record exists for that module call (eager-weights probes defer to it)."""
        return (name, call_index) in self._recorded
