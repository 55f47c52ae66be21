"""The training-loop doctor's observer: ``run.watch(model, every=N, optimizer=opt,
scheduler=sched)`` watches the user's loop through hooks, not the user's cooperation.

:class:`LoopWatch` checks the configuration once (:meth:`LoopWatch.once`: weight decay,
the optimizer's parameters, Adam's ``eps``) and observes the loop only during a watched
step's window — from the ``log()`` before a watched step to that step's ``log()``, the same
window a capture covers — through:

* forward pre-/post-hooks on the root module: each forward's train/eval mode and
  ``torch.is_grad_enabled()``, the arguments and RNG state of each micro-batch (kept to
  replay it), the learning rate it ran with, a tensor hook on its logits (or loss) that fires
  when backward reaches it;
* ``Optimizer.register_step_pre_hook``/``register_step_post_hook``, and ``zero_grad``
  wrapped on the instance;
* ``scheduler.step`` wrapped on the instance;
* a :class:`hooks.doctor.loop.tape.LossTape` (a ``TorchFunctionMode``): the loop's calls on
  the outputs up to its loss function (replayed by the accumulation check when the model
  returns no loss), and memory kept across steps (a graph summed across steps, outputs kept).

Everything is removed (and the instance methods restored) at the window's end and by
:meth:`LoopWatch.close`, but for one forward pre-hook that stays until the next training
forward (an evaluation right after the step's ``log()`` is seen); unwatched steps run none of
it. In a DDP job it runs on every rank; the accumulation check all-reduces the micro-batch
gradients (:func:`ddp_reduce`).

At the window's first optimizer step (before the weights change) the accumulated gradient
is compared with the gradient of the same micro-batches as one batch
(:func:`hooks.doctor.loop.checks.accumulation_findings`): each micro-batch is replayed with the
RNG state it ran with (dropout draws the same masks) and differentiated with
``torch.autograd.grad`` (``.grad`` is not touched), while the run's capture is paused. The
accumulated gradient is the real ``.grad`` as the last backward left it (copied at the end of
each backward of the window, so clipping and unscaling after it do not count).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import math
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hooks.doctor.loop import checks as lc
from hooks.doctor.loop.components import component_accumulation_findings
from hooks.doctor.loop.tape import KeptOutputs, LossTape, foreign_graph_finding, user_site
from hooks.engine.compile import compiled_parts
from hooks.engine.recompute import in_backward
from hooks.engine.replay import held_state
from hooks.trace.ops import Replay

__all__ = ["LoopWatch", "check_watch_arguments", "ddp_reduce"]

#: No instance attribute of that name before :meth:`LoopWatch._wrap`.
_ABSENT = object()
#: Watched steps over which a parameter held by the optimizer must get a gradient.
NO_GRAD_WINDOWS = 3
#: Gradient-accumulation checks made on the first watched steps (later ones only when the
#: number of micro-batches changes, e.g. a last partial window).
ACCUM_CHECKS = 3


def check_watch_arguments(optimizer: Any, scheduler: Any, capture_options: dict) -> Any:
    """Check ``run.watch``'s keywords at once; return the optimizer to watch (the scheduler's
    own when only ``scheduler`` is given).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, ``scheduler`` has no
            ``step`` or no ``optimizer`` (a ``torch.optim.lr_scheduler`` scheduler), or a
            keyword that neither ``watch`` nor :func:`hooks.capture` takes, an
            ``attention_bytes`` or ``keep_bytes`` that is not an integer.
        ValueError: ``scheduler`` drives another optimizer than ``optimizer``; a negative
            ``attention_bytes`` or ``keep_bytes``.
    """
    import inspect

    from hooks.engine.capture import capture
    from hooks.store.values import checked_bytes

    known = [n for n, p in inspect.signature(capture).parameters.items()
             if p.kind == p.KEYWORD_ONLY and n not in ("step", "meta", "optimizer")]
    bad = [k for k in capture_options if k not in known]
    if bad:
        raise TypeError(f"watch() got an unexpected keyword argument {bad[0]!r} (it takes "
                        f"every, optimizer, scheduler and the capture options "
                        f"{', '.join(known)})")
    checked_bytes(capture_options)  # here, not at the first capture, steps later
    if optimizer is not None:
        optimizer = _inner(optimizer, "optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"watch(optimizer=...) expects a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
    if scheduler is not None:
        inner = _inner(scheduler, "scheduler")
        if not callable(getattr(inner, "step", None)) or not isinstance(
                getattr(inner, "optimizer", None), torch.optim.Optimizer):
            raise TypeError(f"watch(scheduler=...) expects a torch.optim.lr_scheduler "
                            f"scheduler (with .step and .optimizer), got "
                            f"{type(scheduler).__name__}")
        own = _inner(inner.optimizer, "optimizer")
        if optimizer is None:
            optimizer = own
        elif own is not optimizer:
            raise ValueError("watch(scheduler=...): the scheduler drives another optimizer "
                             "than watch(optimizer=...)")
    return optimizer


def _inner(obj: Any, attr: str) -> Any:
    """accelerate's ``AcceleratedOptimizer``/``AcceleratedScheduler`` wrap the real one."""
    inner = getattr(obj, attr, None)
    if type(obj).__name__.startswith("Accelerated") and inner is not None:
        return inner
    return obj


def _output_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _first_tensor(obj, lambda t: out.append(t) and False)
    return out


def _first_tensor(obj: Any, pred: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj if pred(obj) else None
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "__dataclass_fields__"):
        obj = [getattr(obj, f) for f in obj.__dataclass_fields__]
    elif hasattr(obj, "to_tuple"):  # HF ModelOutput
        obj = list(obj.to_tuple())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = _first_tensor(item, pred)
            if t is not None:
                return t
    return None


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned: ``output.loss``, ``output["loss"]``, a scalar
    output, or the first scalar floating-point tensor of a tuple (nanoGPT's ``(logits,
    loss)``); ``None`` without one."""
    for cand in (getattr(output, "loss", None),
                 output.get("loss") if isinstance(output, dict) else None):
        if isinstance(cand, torch.Tensor) and cand.numel() == 1:
            return cand
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 and output.is_floating_point() else None
    if isinstance(output, (tuple, list)):
        return _first_tensor(output, lambda t: t.numel() == 1 and t.is_floating_point())
    return None


def _ids_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids
    return _first_tensor(list(args), lambda t: t.ndim == 2 and not t.is_floating_point())


class _MicroBatch:
    __slots__ = ("replay", "lr", "training", "tokens", "backward", "ids", "mask", "hooked",
                 "tape", "site")

    def __init__(self, replay: Replay, lr: tuple, training: bool) -> None:
        self.replay, self.lr, self.training = replay, lr, training
        self.tokens: int | None = None
        self.backward = False
        self.ids = self.mask = None
        self.hooked = False
        self.tape: int | None = None  # its index in the window's LossTape
        self.site: tuple[str, int, str] = ("", 0, "")  # the loop's line that called the model


class LoopWatch:
    """Observes a training loop during watched steps and checks it (see the module docstring).

    Args:
        model: The root module.
        optimizer: The loop's optimizer, or ``None`` (then only the train/eval checks run).
        scheduler: Its LR scheduler, or ``None``.
        capture: Returns the run's active ``hooks.Capture`` (paused while replaying), or None.
        busy: Returns True while another part of mdb re-runs the forward (its calls are not
            the user's).

    Attributes:
        findings: Findings not yet taken (:meth:`take`).
        external_step: Set by a trainer whose ``optimizer.step(closure)`` runs the last
            micro-batch's forward and backward inside the step (Lightning): the checks of the
            optimizer step then run when it calls :meth:`before_step` (after the closure),
            not at the optimizer's step pre-hook.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 scheduler: Any, *, capture: Callable[[], Any] = lambda: None,
                 busy: Callable[[], bool] = lambda: False,
                 reduce: Callable[..., Any] | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.scheduler = _inner(scheduler, "scheduler") if scheduler is not None else None
        self._capture, self._busy, self._reduce = capture, busy, reduce
        self.findings: list[dict[str, Any]] = []
        self._said: set[tuple[str, str]] = set()
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []
        self._step: int | None = None
        self._inside = False
        self._names = lc.param_names(model)
        self._dropout = lc.dropout_modules(model)
        self._mode_dependent = bool(self._dropout) or any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        self._accum_checks = 0
        self._usual: int | None = None
        self._no_grad: set[int] | None = None
        self._no_grad_windows = 0
        self.external_step = False
        self._tape: LossTape | None = None
        self._kept = KeptOutputs()
        self._tail: Any = None
        self._tail_step: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._mbs: list[_MicroBatch] = []
        self._opt_steps = self._sched_steps = self._zero_grads = 0
        self._backward_seen = False
        self._snapshot: list[torch.Tensor | None] | None = None
        self._before: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._label_done = False
        self._stale = False
        self._refs: list[tuple[Any, tuple[int, ...], tuple[str, int, str]]] = []

    # -- findings ----------------------------------------------------------------------------------
    def _add(self, found: list[dict[str, Any]]) -> None:
        for f in found:
            key = (f["kind"], f["subject"])
            if key not in self._said:
                self._said.add(key)
                self.findings.append(f)

    def take(self) -> list[dict[str, Any]]:
        """The findings since the last call, each reported once per run (kind and subject)."""
        out, self.findings = self.findings, []
        return out

    def once(self, step: int) -> None:
        """The checks that need no observation: weight decay, the optimizer's parameters,
        Adam's ``eps`` (reported with ``step``, the first step watched)."""
        opt = self.optimizer
        if opt is None:
            return
        for check in (lambda: lc.weight_decay_findings(self.model, opt, step),
                      lambda: lc.optimizer_param_findings(self.model, opt, step),
                      lambda: lc.adam_eps_findings(opt, step)):
            with contextlib.suppress(Exception):  # a check never breaks the user's loop
                self._add(check())

    # -- the window --------------------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        """Whether a watched step's window is open."""
        return self._step is not None

    def arm(self, step: int) -> None:
        """Open the window of watched step ``step``: attach the hooks."""
        if self._step is not None:
            self.disarm(tail=False)
        self._close_tail()
        self._reset()
        self._step = step
        m = self.model
        self._handles = [m.register_forward_pre_hook(self._pre, with_kwargs=True),
                         m.register_forward_hook(self._post, with_kwargs=True)]
        if not compiled_parts(list(m.named_modules())):  # a mode would change dynamo's code
            tape = LossTape()
            self._handles += [m.register_forward_pre_hook(self._depth_in, prepend=True),
                              m.register_forward_hook(self._depth_out, always_call=True)]
            tape.__enter__()  # left in disarm: the loop's calls of this window only
            self._tape = tape
        opt = self.optimizer
        if opt is not None:
            self._handles += [opt.register_step_pre_hook(self._before_step),
                              opt.register_step_post_hook(self._after_step)]
            self._wrap(opt, "zero_grad", self._on_zero_grad)
        if self.scheduler is not None:
            self._wrap(self.scheduler, "step", self._on_sched_step)

    def _wrap(self, obj: Any, name: str, note: Callable[[], None]) -> None:
        """Wrap ``obj.name`` on the instance (restored by :meth:`_detach`: the instance's own
        attribute if it had one, else the class's method again)."""
        original = getattr(obj, name)
        own = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else _ABSENT

        def wrapped(_self: Any, *args: Any, **kwargs: Any) -> Any:
            note()
            return original(*args, **kwargs)

        setattr(obj, name, types.MethodType(wrapped, obj))
        self._patched.append((obj, name, own))

    def disarm(self, *, tail: bool = True) -> None:
        """Close the window: the end-of-step checks, then detach everything; with ``tail``,
        a forward pre-hook stays until the next training forward, so that an evaluation
        right after the step's ``log()`` is seen (:meth:`_tail_pre`)."""
        step = self._step
        try:
            if step is not None and self.scheduler is not None:
                self._add(lc.scheduler_findings(step, self._sched_steps, self._opt_steps, [],
                                                self.scheduler))
        except Exception:
            pass
        finally:
            self._leave_tape(step)
            self._detach()
            self._mbs = []
            self._snapshot = None
            self._before = []
            self._refs = []
            self._step = None
        if tail and step is not None and self._dropout:
            with contextlib.suppress(Exception):
                self._tail_step = step
                self._tail = self.model.register_forward_pre_hook(self._tail_pre)

    def _leave_tape(self, step: int | None) -> None:
        """Leave the window's :class:`LossTape`; the memory it saw grow."""
        tape, self._tape = self._tape, None
        if tape is None:
            return
        try:
            n = torch._C._len_torch_function_stack()
            if n and torch._C._get_function_stack_at(n - 1) is tape:
                tape.__exit__(None, None, None)
            else:  # a mode the loop entered since is above it: leave it passing through
                tape.paused = True
            if step is not None:
                if tape.foreign is not None:
                    self._add([foreign_graph_finding(step, tape.foreign)])
                kept = self._kept.end_window(step, self._refs + tape.losses)
                if kept is not None:
                    self._add([kept])
        except Exception:
            pass
        finally:
            tape.reset()

    def _depth_in(self, module: nn.Module, args: tuple) -> None:
        if self._tape is not None:
            self._tape.depth += 1

    def _depth_out(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._tape is not None:
            self._tape.depth = max(0, self._tape.depth - 1)

    def _tail_pre(self, module: nn.Module, args: tuple) -> None:
        """After a watched step's ``log()``, until the next training forward: an evaluation
        (a forward under ``torch.no_grad``) in train mode with dropout on."""
        if self._others() or in_backward():
            return
        if torch.is_grad_enabled():
            if module.training:
                self._close_tail()
            return
        if module.training:
            self._eval_in_train(self._tail_step)
            self._close_tail()

    def _close_tail(self) -> None:
        tail, self._tail = self._tail, None
        if tail is not None:
            with contextlib.suppress(Exception):
                tail.remove()

    def _eval_in_train(self, step: int | None) -> None:
        self._add([lc.finding(
            "train_eval", step, "model.train()",
            f"a forward under torch.no_grad at step {step} ran in train mode with dropout "
            f"active in {len(self._dropout)} module(s) ({', '.join(self._dropout[:3])}): call "
            "model.eval() before evaluating (and model.train() after)",
            f"torch.is_grad_enabled()=False, model.training=True; dropout in "
            f"{', '.join(self._dropout)}", modules=self._dropout)])

    def _detach(self) -> None:
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._handles = []
        for obj, name, own in reversed(self._patched):
            with contextlib.suppress(Exception):
                if own is _ABSENT:
                    delattr(obj, name)  # the class's method again
                else:
                    setattr(obj, name, own)
        self._patched = []

    def close(self) -> None:
        """Detach everything (the run finished)."""
        self.disarm(tail=False)
        self._close_tail()

    def _on_zero_grad(self) -> None:
        self._zero_grads += 1

    def _on_sched_step(self) -> None:
        self._sched_steps += 1

    # -- forward and backward ----------------------------------------------------------------------
    def _others(self) -> bool:
        """Whether a call of the model now is mdb's, not the user's: another part of mdb
        re-runs the forward, or the capture replays a compiled model's call eagerly."""
        return self._busy() or getattr(self._capture(), "replaying", False)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._inside or self._others() or in_backward():
            return
        try:
            if not torch.is_grad_enabled():
                if module.training and self._dropout:
                    self._eval_in_train(self._step)
                return
            opt = self.optimizer
            lr = tuple(float(g["lr"]) for g in opt.param_groups) if opt is not None else ()
            mb = _MicroBatch(Replay.at(module, args, kwargs), lr, module.training)
            mb.site = user_site()
            self._mbs.append(mb)
        except Exception:
            pass

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._inside or self._others() or in_backward() or not torch.is_grad_enabled():
            return
        if not self._mbs or self._mbs[-1].hooked:
            return
        try:
            mb = self._mbs[-1]
            mb.hooked = True
            if self._tape is not None:
                mb.tape = self._tape.outputs(output)
            self._refs += [(weakref.ref(t), tuple(t.shape), mb.site)
                           for t in _output_tensors(output) if t.requires_grad]
            mb.ids = _ids_of(args, kwargs)
            mask = kwargs.get("attention_mask")
            mb.mask = mask if isinstance(mask, torch.Tensor) else None
            ids = mb.ids
            logits = _logits_of(output, ids)
            target = logits if logits is not None else _first_tensor(
                output, lambda t: t.requires_grad and t.is_floating_point())
            if target is not None:
                target.register_hook(lambda g, mb=mb, lg=logits is not None: self._on_grad(
                    mb, g, lg))
            if len(self._mbs) == 1 and mb.mask is not None:
                self._add(aux_padding_findings(self._step, output, mb.mask))
        except Exception:
            pass

    def _on_grad(self, mb: _MicroBatch, grad: torch.Tensor, logits: bool) -> None:
        try:
            mb.backward = True
            if logits:
                mb.tokens = int((grad.detach().abs().amax(-1) > 0).sum())
            if not self._backward_seen and self._opt_steps == 0:
                self._backward_seen = True
                self._first_backward(mb)
            if logits and not self._label_done and mb.ids is not None:
                self._label_done = True
                self._add(lc.label_findings(self._step, grad, mb.ids, mb.mask))
            if self._plan_accum():
                torch.autograd.Variable._execution_engine.queue_callback(self._queue_snapshot)
        except Exception:
            pass

    def _first_backward(self, mb: _MicroBatch) -> None:
        """The window's first backward: stale gradients (zero_grad missing), and a backward
        through an eval-mode forward."""
        if not mb.training and self._mode_dependent:
            self._add([lc.finding(
                "train_eval", self._step, "model.eval()",
                f"backward at step {self._step} ran through a forward in eval mode (dropout "
                "off, batch-norm statistics frozen): call model.train() before training",
                "the forward whose output received the gradient ran with model.training=False",
            )])
        opt = self.optimizer
        if opt is None or (self._step or 0) <= 1:
            return
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        norms = torch._foreach_norm([p.grad.detach() for p in params])
        stale = [self._names.get(id(p), "?")
                 for p, n in zip(params, norms, strict=True) if float(n) > 0]
        if stale:
            self._stale = True
            self._add([lc.finding(
                "zero_grad", self._step, "optimizer.zero_grad",
                f"{len(stale)} parameter(s) already held a gradient when the first backward "
                f"of step {self._step} began, so gradients accumulate across optimizer steps: "
                "call optimizer.zero_grad() after each optimizer.step()",
                f"non-zero .grad before the first backward after an optimizer step "
                f"({self._zero_grads} zero_grad call(s) in the step): {', '.join(stale[:8])}",
                params=stale)])

    def _queue_snapshot(self) -> None:
        """Queued when backward reaches the outputs; queues :meth:`_end_backward` behind the
        callbacks queued since (DDP's ``finalize_backward``, which writes the all-reduced
        gradients into ``.grad`` once the last bucket is ready)."""
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        opt = self.optimizer
        if opt is None:
            return
        self._snapshot = [None if p.grad is None else p.grad.detach().clone()
                          for g in opt.param_groups for p in g["params"]]

    def _plan_accum(self) -> bool:
        return self.optimizer is not None and self._opt_steps == 0 and not self._stale

    # -- the optimizer step ------------------------------------------------------------------------
    def before_step(self) -> None:
        """The optimizer is about to apply the gradients (see :attr:`external_step`)."""
        if self._step is not None and self.optimizer is not None:
            self._before_step(self.optimizer, (), {}, external=True)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any, *,
                     external: bool = False) -> None:
        if self.external_step != external:
            return
        self._opt_steps += 1
        if self._opt_steps > 1 or self._step is None:
            return
        step = self._step
        mbs = [mb for mb in self._mbs if mb.training]
        if len(mbs) > 1:
            lrs = [mb.lr[:1] for mb in mbs]
            with contextlib.suppress(Exception):
                self._add(lc.scheduler_findings(step, 0, 0, lrs, self.scheduler))
        with contextlib.suppress(Exception):
            self._check_accumulation(mbs)
        with contextlib.suppress(Exception):
            self._check_held_no_grad()
        with contextlib.suppress(Exception):
            self._add(lc.adam_eps_findings(optimizer, step))
        with contextlib.suppress(Exception):
            self._keep_low_precision()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._opt_steps != 1 or not self._before:
            return
        try:
            params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
            named = [(n, b, params[pid].detach(), gr) for n, b, pid, gr in self._before]
            lr = float(optimizer.param_groups[0]["lr"])
            self._add(lc.lost_update_findings(self._step, named, lr))
        except Exception:
            pass
        self._before = []

    def _keep_low_precision(self) -> None:
        low = (torch.bfloat16, torch.float16)
        self._before = [(self._names.get(id(p), "?"), p.detach().clone(), id(p),
                         p.grad.detach().clone())
                        for g in self.optimizer.param_groups for p in g["params"]
                        if p.dtype in low and p.grad is not None]

    def _check_held_no_grad(self) -> None:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        with_grad = [p for p in params if p.grad is not None]
        norms = torch._foreach_norm([p.grad.detach() for p in with_grad]) if with_grad else []
        live = {id(p) for p, n in zip(with_grad, norms, strict=True) if float(n) > 0}
        none = {id(p) for p in params if id(p) not in live}
        self._no_grad = none if self._no_grad is None else self._no_grad & none
        self._no_grad_windows += 1
        if self._no_grad_windows >= NO_GRAD_WINDOWS and self._no_grad:
            names = [self._names.get(id(p), "<not in the model>") for p in params
                     if id(p) in self._no_grad]
            self._add([lc.finding(
                "optimizer_params", self._step, "no gradient",
                f"{len(names)} parameter(s) held by the optimizer got no gradient in "
                f"{self._no_grad_windows} watched steps: {lc.names_listed(names)} (unused in the "
                "forward, frozen, or cut from the graph by .detach())",
                f"grad None or zero at the optimizer step of each of "
                f"{self._no_grad_windows} watched steps: {', '.join(names)}", params=names)])
            self._no_grad = set()

    def _check_accumulation(self, mbs: list[_MicroBatch]) -> None:
        """Compare the real accumulated ``.grad`` with the one-batch gradient (see
        :func:`hooks.doctor.loop.checks.accumulation_findings`). In a DDP job every rank
        calls the collectives of :func:`ddp_reduce` once here, whatever it found (a rank
        with nothing to check passes ``None``, and no rank checks)."""
        k = len(mbs)
        want = not self._stale and k > 0 and not (
            self._accum_checks >= ACCUM_CHECKS and self._usual is not None and k == self._usual)
        local = None
        if want:
            try:
                local = self._local_accumulation(mbs)
            except Exception:
                local = None
        per, tokens = (local[2], local[3]) if local is not None else (None, [])
        if self._reduce is not None:  # every rank's micro-batches (DDP)
            device = local[0].device if local is not None else self._device()
            got = self._reduce(per, tokens, device)
            if got is None:
                return
            per, tokens = got
        if local is None or per is None:
            return
        acc, low = local[0], local[1]
        self._accum_checks += 1
        usual = self._usual
        self._usual = k if usual is None else max(usual, k)
        self._add(lc.accumulation_findings(self._step, acc, per, tokens, usual))
        if self._reduce is None:  # per component: this process's aux gradients (not DDP's)
            self._add(component_accumulation_findings(self._step, acc, per, local[4], tokens))
        if low is not None:
            self._add(lc.low_precision_accumulation(self._step, acc, per, low))

    def _device(self) -> torch.device:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return params[0].device if params else torch.device("cpu")

    def _local_accumulation(self, mbs: list[_MicroBatch]) -> tuple | None:
        """``(acc, grad dtype, per, tokens, aux)``: the accumulated ``.grad`` (P,) fp32, its
        dtype, each micro-batch's replayed gradient (P,) and token count, and the aux term's
        gradients the replay found (:meth:`_replay_grad`); ``None`` when a micro-batch's loss
        could not be replayed."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        snap = self._snapshot or [p.grad for p in params]
        acc = torch.cat([(snap[i].detach().reshape(-1).float() if snap[i] is not None
                          else params[i].new_zeros(params[i].numel(), dtype=torch.float32))
                         for i in trainable])
        per, tokens, aux = [], [], []
        for mb in mbs:
            g = self._replay_grad(mb, [params[i] for i in trainable], aux)
            if g is None:
                return None
            per.append(g)
            tokens.append(mb.tokens if mb.tokens else self._count(mb))
        low = [snap[i].dtype for i in trainable if snap[i] is not None]
        return acc, (low[0] if low else None), per, tokens, aux

    @staticmethod
    def _count(mb: _MicroBatch) -> int:
        labels = mb.replay.kwargs.get("labels")
        if isinstance(labels, torch.Tensor):
            lab = labels[:, 1:] if labels.ndim == 2 else labels
            return int((lab != -100).sum())
        ids = mb.ids
        return int(ids.numel()) if ids is not None else 1

    def _replay_grad(self, mb: _MicroBatch, params: list[torch.Tensor],
                     aux_out: list | None = None) -> torch.Tensor | None:
        """The gradient (flat, fp32) of micro-batch ``mb``'s own loss, replayed with its RNG
        state and train flag, the run's capture paused; ``None`` when the forward returns no
        scalar loss. When the output carries an ``aux_loss`` in the graph, ``(its gradient,
        flat, fp32; the factor the returned gradient was divided by)`` is appended to
        ``aux_out`` (:func:`hooks.doctor.loop.components.component_accumulation_findings`)."""
        r = mb.replay
        cap = self._capture()
        self._inside = True
        try:
            # on clones of the buffers (BatchNorm statistics), RNG and modes restored after:
            # the replay leaves the training state as the step left it
            with (cap.paused() if cap is not None else contextlib.nullcontext()), \
                    held_state(self.model, r.rng_cpu, r.rng_cuda), torch.enable_grad():
                self.model.train(r.training)
                out = self.model(*r.args, **r.kwargs)
                tape = self._tape
                loss = tape.replay(mb.tape, out) if tape is not None and mb.tape is not None \
                    else None  # the loss function the loop called on the outputs, if seen
                if loss is None:
                    loss = loss_of(out)
                if loss is None or not loss.requires_grad:
                    return None
                logits = _logits_of(out, mb.ids)
                wrt = params + ([logits] if logits is not None else [])
                aux = _flat_aux_grad(self.model, out, params) if aux_out is not None else None
                grads = torch.autograd.grad(loss.reshape(()), wrt, allow_unused=True)
        finally:
            self._inside = False
        scale = 1.0
        flat = torch.cat([(g.reshape(-1).float() if g is not None else
                           p.new_zeros(p.numel(), dtype=torch.float32))
                          for g, p in zip(grads[: len(params)], params, strict=True)])
        if logits is not None and grads[-1] is not None:
            # the model's own loss may not be a mean over this micro-batch's tokens (HF's
            # num_items_in_batch divides by the window's count): rescale it to one
            per_token = token_weight(logits.detach(), grads[-1])
            if per_token is not None:
                scale = per_token[0] * per_token[1]
                flat = flat / scale
        if aux is not None:
            aux_out.append((aux, scale))
        return flat


def _flat_aux_grad(model: nn.Module, output: Any,
                   params: list[torch.Tensor]) -> torch.Tensor | None:
    """The gradient (flat, fp32) of the aux term as the output's loss holds it, with respect to
    ``params``, the graph kept for the loss's own backward; None without an ``aux_loss`` in the
    graph. An HF model's ``aux_loss`` is unscaled and its loss adds
    ``router_aux_loss_coef · aux_loss``; minillm's ``aux_loss`` holds its coefficient."""
    aux = getattr(output, "aux_loss", None)
    if aux is None and isinstance(output, dict):
        aux = output.get("aux_loss")
    if not (isinstance(aux, torch.Tensor) and aux.numel() == 1 and aux.requires_grad):
        return None
    coef = 1.0
    if type(output).__module__.startswith("transformers."):
        c = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
        coef = float(c) if isinstance(c, (int, float)) else 1.0
    grads = torch.autograd.grad(aux.reshape(()) * coef, params, retain_graph=True,
                                allow_unused=True)
    return torch.cat([(g.reshape(-1).float() if g is not None else
                       p.new_zeros(p.numel(), dtype=torch.float32))
                      for g, p in zip(grads, params, strict=True)])


def ddp_reduce(per: list[torch.Tensor] | None, tokens: list[int],
               device: torch.device) -> tuple[list[torch.Tensor], list[int]] | None:
    """Under DDP, every rank's micro-batch gradients, for the accumulation check: DDP's
    ``.grad`` is the mean over the W ranks of each rank's accumulated gradient,
    ``(1/W) Σ_r Σ_i a_i · g_i^r``, so it is fitted against ``G_i = (1/W) Σ_r g_i^r`` (the same
    weight ``a_i`` for micro-batch ``i`` of every rank, as the same loop runs on each) with
    ``n_i = Σ_r n_i^r`` tokens. Collectives of the default process group: every rank calls
    it at the same optimizer step, ``per=None`` where its replay found no loss.

    Args:
        per: k tensors (P,) fp32, this rank's ``g_i``; ``None`` when not replayed.
        tokens: k token counts of this rank.
        device: Where the collectives' tensors live (the gradients' device: CUDA for NCCL).

    Returns:
        ``(G, n)``: k tensors (P,) and k counts; ``None`` when a rank has no gradients or the
        ranks' micro-batch counts differ.
    """
    import torch.distributed as dist

    k = len(per) if per is not None else 0
    flag = torch.tensor([1 if per else 0, k, -k], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag[0]) != 1 or int(flag[1]) != -int(flag[2]) or not per:
        return None
    stack = torch.stack(per)  # (k, P)
    dist.all_reduce(stack)
    n = torch.tensor(tokens, dtype=torch.int64, device=device)
    dist.all_reduce(n)
    return list(stack / dist.get_world_size()), [int(x) for x in n.tolist()]


def aux_padding_findings(step: int | None, output: Any,
                         mask: torch.Tensor) -> list[dict[str, Any]]:
    """Pad positions counted in an MoE auxiliary (load-balancing) loss: the gradient of the
    output's ``aux_loss`` with respect to its ``router_logits`` (one (N, E) tensor per MoE
    layer, N = B·T) is non-zero at positions whose ``attention_mask`` (B, T) is 0
    (transformers #28505). Computed on the forward's own graph, kept for the user's backward
    (``retain_graph``); ``[]`` when the output has no aux loss or router logits."""
    aux = getattr(output, "aux_loss", None)
    routers = getattr(output, "router_logits", None)
    if not (isinstance(aux, torch.Tensor) and aux.requires_grad and routers):
        return []
    routers = [r for r in routers if isinstance(r, torch.Tensor) and r.requires_grad
               and r.ndim == 2 and r.shape[0] == mask.numel()]
    pads = mask.reshape(-1) == 0
    if not routers or not bool(pads.any()):
        return []
    grads = torch.autograd.grad(aux.reshape(()), routers, retain_graph=True,
                                allow_unused=True)
    counted = max((int((g[pads].abs().amax(-1) > 0).sum()) for g in grads if g is not None),
                  default=0)
    if not counted:
        return []
    return [lc.finding(
        "padding", step, "aux loss",
        f"{counted} of {int(pads.sum())} pad positions (attention_mask 0) count in the MoE "
        f"aux loss at step {step}: compute the router statistics over real tokens only",
        f"pad rows of router_logits with a non-zero gradient of aux_loss: {counted} of "
        f"{int(pads.sum())} ({len(routers)} MoE layer(s))", counted=counted,
        pads=int(pads.sum()))]


def _logits_of(output: Any, ids: torch.Tensor | None) -> torch.Tensor | None:
    """The (B, T, V) logits of a forward's output for (B, T) ``ids``, if there are."""
    if ids is None:
        return None
    return _first_tensor(output, lambda t: t.ndim == 3 and t.requires_grad
                         and t.is_floating_point() and tuple(t.shape[:2]) == tuple(ids.shape))


def token_weight(logits: torch.Tensor, grad: torch.Tensor) -> tuple[float, int] | None:
    """``(c, n)``: the weight ``c`` a cross-entropy loss gives each of its ``n`` scored
    positions, read from the gradient of the logits (a row is ``c · (softmax − onehot)``,
    so at the target ``c = g_t / (p_t − 1)``; the median over the positions); ``None`` when
    no position is scored or the rows are not of that form."""
    g = grad.detach().float()
    live = g.abs().amax(-1) > 0
    n = int(live.sum())
    if n == 0:
        return None
    rows, lg = g[live], logits.float()[live]
    t = rows.argmin(-1, keepdim=True)
    p = torch.softmax(lg, -1).gather(-1, t).squeeze(-1)
    ok = p < 1 - 1e-6
    if not bool(ok.any()):
        return None
    c = float((rows.gather(-1, t).squeeze(-1)[ok] / (p[ok] - 1)).median())
    return (c, n) if c > 0 and math.isfinite(c) else None
