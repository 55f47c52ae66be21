"""The overfit runs of ``mdb overfit``: seed 000's test C, "memorise one batch".

Two sessions share one run machinery (:class:`RunSession`: the run store, checkpoints, the end
of a run, faults):

* :class:`OverfitSession` — minillm memorises a short text: it builds the model, tokenizer,
  AdamW optimizer and batch from :class:`OverfitOptions`;
* :class:`ModelOverfitSession` — ``mdb overfit --model module:function``: the user's own model
  memorises the batch its factory returns (:class:`ModelOverfitOptions`), with the loss
  conventions of :mod:`hooks.batch` (a ``loss_fn``, the output's ``loss``, nanoGPT's
  ``(logits, loss)``). Passing this test proves that backward reaches every parameter that
  matters and that positions and masks let the model tell the tokens apart.

Both train with a :class:`hooks.train.trainer.Trainer`, write every step to a
:class:`hooks.store.store.RunStore`, checkpoint (:mod:`hooks.train.checkpoint`) at the end, on
interruption and every ``checkpoint_every`` steps, and resume from the last checkpoint
(:func:`resume_session` picks the session a stored run needs).

A run's checkpoints live in ``<db stem>-checkpoints/<run>/step-<N>/`` (N zero-padded to 8
digits), written when the run starts, every ``checkpoint_every`` steps and at its end; the
store's row names the current one and is the commit point (older directories are deleted after
it is updated), so a ``kill -9`` at any moment leaves a checkpoint that matches the database.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hooks.batch import Batch, BatchError, from_factory, select_loss
from hooks.errors import ModelRaisedError, describe_error
from hooks.store.reserve import DiskReserve, finish_run
from hooks.store.store import (
    DamagedRunError,
    RunStore,
    RunStoreError,
    RunWriter,
    checkpoint_folder,
)
from hooks.train.checkpoint import (
    checkpoint_mismatch,
    checkpoint_shapes,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
    shapes_mismatch,
)
from hooks.train.overfit_options import (
    DEFAULT_TEXT_PATH,
    SEED_SENTENCE,
    ModelOverfitOptions,
    OverfitOptions,
    default_overfit_text,
    nproc_resume_error,
    resume_model_refusal,
    schedule_lr,
    sign_model,
)
from hooks.train.overfit_options import resolve_model_spec as resolve_model_spec
from hooks.train.trainer import (
    StepReport,
    TrainControl,
    Trainer,
    TrainResult,
    router_logits,
    step_metric_names,
)

__all__ = [
    "DEFAULT_TEXT_PATH",
    "LOSS_METRICS",
    "MINILLM_METRICS",
    "SEED_SENTENCE",
    "ModelOverfitOptions",
    "ModelOverfitSession",
    "OverfitOptions",
    "OverfitSession",
    "RunSession",
    "default_overfit_text",
    "resume_session",
]

#: What a step of a minillm overfit run records, in this order (see
#: :func:`hooks.train.trainer.step_metric_names`).
MINILLM_METRICS = ("ce", "aux", "total", "grad_norm", "lr", "step_time", "tokens_per_s",
                   "steps_per_s")
#: The metrics of an overfit run that are losses (charted together by ``mdb watch``).
LOSS_METRICS = ("loss", "total", "ce", "aux")


def _step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def _one_line(exc: BaseException) -> str:
    text = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def _disk_full(exc: BaseException) -> bool:
    import errno

    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    return "disk is full" in str(exc) or "No space left" in str(exc)


class RunSession:
    """What both overfit sessions share: a run in a store, its checkpoints, and the loop's end.

    A subclass sets :attr:`options` (with ``steps``, ``seed``, ``every`` and
    ``checkpoint_every``), :attr:`model`, :attr:`optimizer` and :attr:`trainer`, and describes
    itself (:meth:`describe`, :attr:`metric_names`, :attr:`loss_metrics`). Build a session with
    its ``create`` (a new run) or ``resume`` (continue an ended one), then call :meth:`run` —
    from the main thread for a headless run, or from a worker thread under a UI (install signal
    handlers in the main thread with :func:`hooks.train.trainer.install_stop_signals` on
    :attr:`control`).

    Attributes:
        store: The :class:`RunStore`; ``writer``: the :class:`RunWriter` of this run.
        name: The run's name.
        control: The :class:`TrainControl` (pause / step / stop / capture).
        result: The :class:`TrainResult` once :meth:`run` returned.
        checkpoint_error: One line while the latest checkpoint could not be written.
        recorded_step: The last step whose row the store committed.
        restarted: A resumed run that had no checkpoint (its writer was killed before the
            first one was written): it starts again from step 0.
        on_warning: Called (in the training thread) with one line when something goes wrong
            that does not stop the run — a checkpoint that could not be written.
    """

    options: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: Trainer

    def __init__(self, store: RunStore, writer: RunWriter | None, *, start_step: int = 0,
                 checkpoint: str | os.PathLike[str] | None = None) -> None:
        self.store = store
        self.writer: RunWriter = writer  # type: ignore[assignment]  (set by create())
        self.name = writer.name if writer is not None else ""
        self.control = TrainControl()
        self.result: TrainResult | None = None
        self.checkpoint_error: str | None = None
        self.on_warning: Callable[[str], None] | None = None
        #: The checkpoint directory the store records for this run (``None``: none yet), and
        #: its step.
        self.last_checkpoint: Path | None = Path(checkpoint) if checkpoint is not None else None
        self.last_checkpoint_step: int | None = start_step if checkpoint is not None else None
        self.recorded_step = int(start_step)
        self.restarted = False
        self._finished = False
        self._reserve: DiskReserve | None = None

    # -- what the session is ---------------------------------------------------------------------

    def describe(self) -> str:
        """One line naming the model and its batch (the header of a run)."""
        raise NotImplementedError

    @property
    def metric_names(self) -> list[str]:
        """The metrics every step records, in the order they are logged."""
        raise NotImplementedError

    @property
    def loss_metrics(self) -> list[str]:
        """Those of :attr:`metric_names` that are losses (charted together)."""
        return [n for n in self.metric_names if n in LOSS_METRICS]

    @property
    def headline_metrics(self) -> list[str]:
        """The losses a one-line progress report shows (minillm: ``ce``, ``aux``)."""
        names = self.loss_metrics
        return [n for n in names if n != "total"] if "ce" in names else names

    @property
    def text(self) -> str:
        """The text being memorised (scores the greedy samples), ``""`` when there is none."""
        return ""

    def verdict(self) -> Any:
        """The run's :class:`hooks.train.verdict.Verdict` (memorised? its spikes), read from
        the store; call it before the store is closed."""
        from hooks.train.verdict import overfit_verdict

        metric = (self.headline_metrics or ["loss"])[0]
        return overfit_verdict(self.store, self.store.run(self.name), metric, self.text)

    @property
    def top_k(self) -> int:
        """Experts per token, k, of the model's MoE layers (1 without)."""
        return max(1, int(self.trainer.top_k or 1))

    @property
    def has_experts(self) -> bool:
        """Whether the model reports router logits (a MoE model)."""
        return False

    def _register(self, store: RunStore | Callable[[], RunStore],
                  name: str | Callable[[RunStore], str]) -> None:
        """Open the store if given as a function, and create this session's run in it."""
        if callable(store):
            store = store()
        self.store = store
        self.name = name(store) if callable(name) else name
        checkpoint_folder(store.path, self.name)  # a stray link there: refused before the run
        self.writer = store.create_run(self.name, self.run_config(),
                                       total_steps=self.options.steps)

    def _declared(self) -> dict[str, Any]:
        """What a reader needs to show the run, stored with its config."""
        return {"metrics": self.metric_names, "loss_metrics": self.loss_metrics,
                "moe": self.has_experts, "top_k": self.top_k}

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        """This run's directory of checkpoints (beside the database), checked each time it is
        used (:func:`hooks.store.store.checkpoint_folder`: a link leading elsewhere is refused
        with :class:`RunStoreError`)."""
        return checkpoint_folder(self.store.path, self.name)

    @property
    def checkpoint_path(self) -> Path:
        """The run's latest recorded checkpoint, or its checkpoint root if none was written."""
        return self.last_checkpoint if self.last_checkpoint is not None else self.checkpoint_root

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {"run": self.name, "seed": self.options.seed}

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step and record it in the store.

        Each checkpoint goes to its own ``step-<N>`` directory; the database row is the commit
        point. Older step directories are deleted only after the row names the new one, so a
        ``kill -9`` at any instant leaves the checkpoint the database names intact (a newer,
        unrecorded directory is ignored and removed by the next save).
        """
        step = self.trainer.step
        path = save_checkpoint(
            self.checkpoint_root / _step_dir_name(step),
            self.model,
            self.optimizer,
            step=step,
            extra=self._checkpoint_extra(),
        )
        self.writer.set_checkpoint(step, path)
        self.last_checkpoint, self.last_checkpoint_step = path, step
        self._prune_checkpoints(keep=path)
        return path

    def _prune_checkpoints(self, keep: Path) -> None:
        """Delete this run's checkpoint directories other than ``keep`` (best effort), only
        inside the run's own directory: a link there (to a folder elsewhere) is left alone."""
        root = self.checkpoint_root
        if not root.is_dir():
            return
        for child in root.iterdir():
            if (child.name.startswith("step-") and child != keep and not child.is_symlink()
                    and child.is_dir()):
                shutil.rmtree(child, ignore_errors=True)
        # the layout before step directories: files directly in the run's directory
        for name in ("model.safetensors", "optimizer.safetensors", "checkpoint.json"):
            with contextlib.suppress(OSError):
                (root / name).unlink()

    def _try_checkpoint(self) -> str | None:
        """Checkpoint; if it cannot be written (disk full, read-only directory...) return a
        one-line description instead of raising, and say so through :attr:`on_warning` (once
        per run of failures). The run's metrics are safe in the database;
        :attr:`checkpoint_error` keeps the failure until a later checkpoint succeeds."""
        try:
            self.save_checkpoint()
        except Exception as exc:  # OSError, safetensors' SafetensorError, sqlite3.Error ...
            first = self.checkpoint_error is None
            self.checkpoint_error = (f"checkpoint of step {self.trainer.step} failed: "
                                     + _one_line(exc))
            if first and self.on_warning is not None:
                saved = self.last_checkpoint_step
                where = (f"a resume would start from step {saved}" if saved is not None
                         else "the run cannot be resumed until one is written")
                self.on_warning(f"{self.checkpoint_error}; training goes on, {where}")
            return self.checkpoint_error
        if self.checkpoint_error is not None and self.on_warning is not None:
            self.on_warning(f"checkpoint of step {self.trainer.step} written: checkpoints work "
                            "again")
        self.checkpoint_error = None
        return None

    @property
    def checkpoint_current(self) -> bool:
        """Whether the recorded checkpoint is of the last step trained (nothing to lose)."""
        return self.last_checkpoint_step == self.trainer.step

    # -- room to end the run when the disk is full -----------------------------------------------

    def _make_reserve(self) -> None:
        """Set bytes aside beside the database (best effort, :mod:`hooks.store.reserve`)."""
        self._reserve = DiskReserve(self.checkpoint_root / ".mdb-reserve")
        self._reserve.make()

    def _drop_reserve(self) -> bool:
        """Give the reserved bytes back; whether there were any."""
        return self._reserve is not None and self._reserve.release()

    def _finish(self, status: str, **fields: Any) -> None:
        """Set the run's final status (:func:`hooks.store.reserve.finish_run`: a write refused
        for want of space is retried once after the reserve is given back)."""
        finish_run(self.writer, self._reserve, status, **fields)
        self._finished = True
        self._drop_reserve()

    # -- running ---------------------------------------------------------------------------------

    def run(
        self,
        on_step: Callable[[StepReport], None] | None = None,
        on_state: Callable[[str], None] | None = None,
        heartbeat_interval: float = 1.0,
    ) -> TrainResult:
        """Train to the end (or a stop / failure), writing every step to the store.

        Each step is committed (metrics, internals, sample) before ``on_step`` is called. At the
        end: a finished or interrupted run is checkpointed and its status set; a failed run
        records the failing step and module. An exception (a database write that failed, disk
        full, an error in the model) marks the run ``failed`` with one line saying which step
        was the last recorded — never "running" — checkpoints only a step the database
        recorded, and is re-raised.

        Args:
            on_step: Called after each step (in this thread) with the :class:`StepReport`.
            on_state: Called with ``"paused"`` / ``"running"`` transitions.
            heartbeat_interval: Seconds between heartbeats of the writer's background thread.

        Returns:
            The :class:`TrainResult` (also stored in :attr:`result`).
        """
        writer = self.writer
        every_ckpt = self.options.checkpoint_every

        def step_cb(report: StepReport) -> None:
            writer.log_step(report.metrics, internals=report.internals, sample=report.sample,
                            tensors=report.internals_tensors)
            self.recorded_step = report.step
            if every_ckpt and report.failure is None and report.step % every_ckpt == 0:
                self._try_checkpoint()
            if on_step is not None:
                on_step(report)

        def state_cb(state: str) -> None:
            writer.set_paused(state == "paused")
            if on_state is not None:
                on_state(state)

        self._make_reserve()
        try:
            writer.start_heartbeat(heartbeat_interval)
            if self.last_checkpoint is None:
                # a new run starts with a checkpoint of its initial state, so that a writer
                # killed before its first periodic checkpoint still leaves a resumable run
                self._try_checkpoint()
            result = self.trainer.run(self.control, on_step=step_cb, on_state=state_cb)
            if result.status == "failed":
                f = result.failure
                self._finish("failed", reason=result.reason[:500],
                             fail_step=f.step if f else result.last_step,
                             fail_module=f.module if f else None)
            else:
                reason = result.reason
                if result.last_step != self.last_checkpoint_step:
                    self._try_checkpoint()
                if self.checkpoint_error:
                    reason = f"{reason}; {self.checkpoint_error}"
                    result.reason = reason
                self._finish(result.status, reason=reason)
        except BaseException as exc:
            if not self._finished:
                self._abort(exc)
            raise
        finally:
            self._drop_reserve()
        self.result = result
        return result

    def _abort(self, exc: BaseException) -> None:
        """Mark the run ended after ``exc`` escaped the loop (best effort, never raises).

        The last step the database recorded is checkpointed first (a crash checkpoint), so a
        resume continues from it; a checkpoint that cannot be written is said in the run's
        reason (and :attr:`checkpoint_error`), with the step a resume would start from."""
        step, recorded = self.trainer.step, self.recorded_step
        if isinstance(exc, KeyboardInterrupt):
            status, reason = "interrupted", "KeyboardInterrupt"
        elif step > recorded:  # the step trained, its row not written
            status = "failed"
            reason = f"step {step} not recorded: {_one_line(exc)}"
        else:
            model = getattr(self.trainer, "model", None)
            status, reason = "failed", f"at step {step + 1}: {describe_error(exc, model)}"
        # only a step the database holds may be checkpointed (a resume continues after it)
        if step == recorded and step != self.last_checkpoint_step:
            if _disk_full(exc):
                self.checkpoint_error = (f"checkpoint of step {step} not written: the disk is "
                                         "full")
            else:
                try:
                    self.save_checkpoint()
                    self.checkpoint_error = None
                except Exception as ckpt_exc:  # recorded in the run, never hidden
                    self.checkpoint_error = (f"checkpoint of step {step} failed: "
                                             f"{_one_line(ckpt_exc)}")
            if self.checkpoint_error is not None:
                saved = self.last_checkpoint_step
                where = (f"a resume starts from step {saved}" if saved is not None
                         else "it cannot be resumed")
                reason = f"{reason}; {self.checkpoint_error}, {where}"
        with contextlib.suppress(Exception):  # the database itself may be what failed
            self._finish(status, reason=reason[:500])


class OverfitSession(RunSession):
    """minillm memorises a short text (seed 000's test C), bound to a run store.

    Attributes:
        options: The run's :class:`OverfitOptions`.
        model: The :class:`minillm.MiniLLM` being trained.
        tokenizer: Its tokenizer.
        config: The model's ``MiniLLMConfig`` (``vocab_size`` = tokenizer size).
        ids: (1, N) token ids of the whole text.
        optimizer: AdamW.
        trainer: The :class:`Trainer`.
    """

    def __init__(
        self,
        options: OverfitOptions,
        store: RunStore,
        writer: RunWriter | None,
        *,
        start_step: int = 0,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        import minillm

        super().__init__(store, writer, start_step=start_step, checkpoint=checkpoint)
        self.options = options
        torch.manual_seed(options.seed)
        if options.tokenizer == "char":
            self.tokenizer: Any = minillm.CharTokenizer.from_text(options.text)
        else:
            self.tokenizer = minillm.ByteTokenizer()
        base = minillm.MiniLLMConfig.from_dict(dict(options.model_config))
        self.config = base.replace(vocab_size=self.tokenizer.vocab_size)
        self.ids = torch.tensor([self.tokenizer.encode(options.text)], dtype=torch.long)
        held = int(round(self.ids.shape[1] * options.held_out))
        #: (1, N_train) the tokens trained on, (1, N_held) those held out (the text's end)
        self.train_ids = self.ids[:, : self.ids.shape[1] - held]
        self.held_ids = self.ids[:, self.ids.shape[1] - held :]
        n = self.train_ids.shape[1]
        if n < 2:
            raise ValueError("the text must be at least 2 tokens long")
        seq = n if options.seq_len is None else min(options.seq_len, n)
        if seq > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence of {seq} tokens exceeds the model's max_position_embeddings "
                f"({self.config.max_position_embeddings}); pass a smaller --seq-len"
            )
        self.seq_len = seq
        for length in options.eval_lengths:
            if length > self.config.max_position_embeddings:
                raise ValueError(
                    f"an evaluation window of {length} tokens exceeds the model's "
                    f"max_position_embeddings ({self.config.max_position_embeddings})")
            if length > self.held_ids.shape[1]:
                raise ValueError(
                    f"the held-out text has {self.held_ids.shape[1]} tokens, fewer than one "
                    f"evaluation window of {length}; use a longer text or a larger --held-out")
        #: ``{"ce@N": value}`` logged after the last step (empty until then)
        self.eval_results: dict[str, float] = {}
        if checkpoint is not None:  # a stored config is data: it fits the file, or no model
            _config_fits_checkpoint(self.config, checkpoint)
        self.model = minillm.MiniLLM(self.config)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=options.lr, weight_decay=options.weight_decay
        )
        if checkpoint is not None:
            load_checkpoint(checkpoint, self.model, self.optimizer)
        self._fixed_batch = None
        if seq == n:
            x = self.train_ids.expand(options.batch_size, n).contiguous()
            self._fixed_batch = {"input_ids": x, "labels": x}
        self.trainer = Trainer(
            self.model,
            self._batch_for,
            self.optimizer,
            total_steps=options.steps,
            start_step=start_step,
            grad_clip=options.grad_clip,
            capture_every=options.every,
            sample_every=options.sample_every,
            sample_fn=self.greedy_sample,
            top_k=self.config.num_experts_per_tok,
            tokens_per_step=options.batch_size * seq,
            capture_kwargs={"attention": True},
            capture_meta=self._capture_meta,
            lr_at=schedule_lr(options.schedule, options.lr, options.steps),
        )

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        store: RunStore | Callable[[], RunStore],
        name: str | Callable[[RunStore], str],
        options: OverfitOptions,
    ) -> OverfitSession:
        """Build the session, then register a new run ``name`` in ``store``.

        Args:
            store: The run store, or a function opening it: called only once the model is built
                and the options checked, so that a rejected run creates no database.
            name: The run's name, or a function of the opened store giving it.
            options: What the run trains.

        Raises:
            ValueError: Invalid options (one line).
            hooks.store.store.RunStoreError: Bad name or the name exists.
        """
        options.validate()
        session = cls(options, None, None)  # type: ignore[arg-type]  (builds everything first)
        session._register(store, name)
        return session

    def run_config(self) -> dict[str, Any]:
        """The run's stored config (``runs.config``): the options, the workload and what
        was resolved from them."""
        return {**self.options.to_dict(), "workload": "minillm",
                "resolved_model_config": self.config.to_dict(), **self._declared()}

    @classmethod
    def resume(cls, store: RunStore, name: str, steps: int | None = None) -> OverfitSession:
        """Continue run ``name`` from its last checkpoint (model, optimizer, RNG, step); a run
        that has none starts again from step 0 with its stored settings (:attr:`restarted`).

        Args:
            store: The store holding the run.
            name: The run.
            steps: A new total step count (default: the stored one).

        Raises:
            hooks.store.store.RunStoreError: No such run, its writer is alive, no checkpoint,
                it already reached its step target, or it was a job of ``mdb overfit --nproc``
                (:func:`hooks.train.overfit_options.nproc_resume_error`).
            ValueError: The checkpoint is missing or does not fit.
        """
        return _resume(store, name, OverfitOptions, steps, lambda options, step, ckpt: cls(
            options, store, None, start_step=step, checkpoint=ckpt))

    # -- what it is ----------------------------------------------------------------------------

    def describe(self) -> str:
        held = self.held_ids.shape[1]
        return (f"{self.model.num_parameters():,} params · {self.ids.shape[1]} tokens of "
                f"{self.options.text_source}" + (f" ({held} held out)" if held else ""))

    @property
    def metric_names(self) -> list[str]:
        return list(MINILLM_METRICS)

    @property
    def text(self) -> str:
        return self.options.text

    @property
    def has_experts(self) -> bool:
        return bool(self.config.is_moe)

    # -- held-out evaluation -------------------------------------------------------------------

    def evaluate(self, lengths: list[int] | tuple[int, ...]) -> dict[int, float]:
        """Mean cross-entropy (nats per token) of the current weights on held-out text.

        For each length N, up to ``eval_windows`` non-overlapping windows of N held-out tokens
        (from the start of the held-out part) are run in eval mode without gradients; the CE
        averages every next-token prediction inside them (N - 1 per window).

        Returns:
            ``{N: ce}`` per length.
        """
        held = self.held_ids[0]
        out: dict[int, float] = {}
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for n in lengths:
                    count = min(self.options.eval_windows, held.shape[0] // int(n))
                    x = held[: count * int(n)].view(count, int(n))
                    out[int(n)] = float(self.model(x, labels=x).ce_loss)
        finally:
            self.model.train(was_training)
        return out

    def run(self, on_step=None, on_state=None, heartbeat_interval: float = 1.0) -> TrainResult:
        """:meth:`RunSession.run`; with ``eval_lengths``, after the last step (not after a
        stop or a failure) the held-out CE per length is logged at that step as ``ce@N`` and
        kept in :attr:`eval_results`."""
        lengths = list(self.options.eval_lengths)
        if not lengths:
            return super().run(on_step=on_step, on_state=on_state,
                               heartbeat_interval=heartbeat_interval)

        def step(report: StepReport) -> None:
            if report.failure is None and report.step == self.trainer.total_steps:
                values = {f"ce@{n}": v for n, v in self.evaluate(lengths).items()}
                self.writer.log_step({"step": report.step, **values})
                self.eval_results = values
            if on_step is not None:
                on_step(report)

        return super().run(on_step=step, on_state=on_state, heartbeat_interval=heartbeat_interval)

    # -- pieces --------------------------------------------------------------------------------

    def _batch_for(self, step: int) -> dict[str, torch.Tensor]:
        if self._fixed_batch is not None:
            return self._fixed_batch
        n, seq, b = self.train_ids.shape[1], self.seq_len, self.options.batch_size
        g = torch.Generator().manual_seed(self.options.seed * 1_000_003 + step)
        starts = torch.randint(0, n - seq + 1, (b,), generator=g)
        x = torch.stack([self.train_ids[0, s : s + seq] for s in starts.tolist()])
        return {"input_ids": x, "labels": x}

    def _capture_meta(self, batch: Batch) -> dict[str, Any]:
        """``meta`` of a captured step, as ``mdb step`` records it (tokens, config, shape)."""
        ids = batch.kwargs["input_ids"]
        return {
            "description": (
                f"overfit run {self.name} · minillm {self.options.preset or 'custom config'} · "
                f"{self.model.num_parameters():,} params · batch {ids.shape[0]}×{ids.shape[1]} "
                f"of {self.options.text_source}"
            ),
            "tokens": self.tokenizer.token_strings(ids.reshape(-1).tolist()),
            "config": self.config.to_dict(),
            "input_shape": list(ids.shape),
            "run": self.name,
        }

    @property
    def prompt(self) -> str:
        """The sample prompt: the text's first ``prompt_chars`` characters."""
        return self.options.text[: max(1, self.options.prompt_chars)]

    def greedy_sample(self, model: nn.Module | None = None) -> tuple[str, str]:
        """``(prompt, greedy continuation)`` of the text's beginning with the current weights."""
        model = self.model if model is None else model
        prompt_ids = self.tokenizer.encode(self.prompt)
        room = self.config.max_position_embeddings - len(prompt_ids)
        new = max(0, min(self.options.sample_tokens, room))
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = model.generate(ids, max_new_tokens=new) if new else ids
        return self.prompt, self.tokenizer.decode(out[0, len(prompt_ids) :].tolist())


def _resume(store: RunStore, name: str, options_cls: Any, steps: int | None,
            make: Callable[[Any, int, Path], Any],
            prepare: Callable[[Any], None] | None = None) -> Any:
    """What both sessions' ``resume`` do: options from the stored config (a new ``steps``;
    then ``prepare(options)``, which may refuse them), the checkpoint checked, the session
    built by ``make(options, step, checkpoint)`` (which raises when it does not fit;
    ``(options, 0, None)`` for a run without a checkpoint, which starts again), then the
    store's run taken over and its config updated."""
    run = store.run(name)
    if run.damaged:
        raise DamagedRunError(f"cannot resume: {run.damaged}")
    refused = nproc_resume_error(name, run.kind, run.world_size, run.config)
    if refused:  # before anything is changed: the job's per-rank rows stay
        raise RunStoreError(refused)
    checkpoint_folder(store.path, run.name)  # the name read back, as on input; no link out
    options = options_cls.from_dict(run.config)
    if steps is not None:
        options.steps = int(steps)
    options.validate()
    if prepare is not None:
        prepare(options)
    ckpt, step = _resumable_checkpoint(store, run)
    try:
        session = make(options, step, ckpt)
    except (TypeError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as exc:
        # a stored config that passed the checks above but does not rebuild the model
        raise ValueError(f"its stored config does not rebuild the run: {type(exc).__name__}: "
                         f"{_one_line(exc)}") from None
    writer = store.resume_run(name, total_steps=options.steps, restart=ckpt is None)
    session.writer, session.name, session.restarted = writer, name, ckpt is None
    writer.update_config(session.run_config())
    return session


def _config_fits_checkpoint(config: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Refuse a stored minillm ``config`` whose model would not be the checkpoint's, before
    that model is built (a database could ask for 100,000 layers): its layer count against the
    checkpoint's ``layers.N`` names, then every tensor's name and shape against the file's
    header, on a model built on the ``meta`` device (no memory).

    Raises:
        ValueError: One line naming the first difference.
    """
    import minillm

    stored = checkpoint_shapes(checkpoint)
    layers = {m.group(1) for k in stored if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))}
    if config.num_hidden_layers != len(layers):
        raise ValueError(f"its stored config has num_hidden_layers = "
                         f"{config.num_hidden_layers}, its checkpoint {len(layers)} layers")
    with torch.device("meta"):
        mismatch = shapes_mismatch(stored, minillm.MiniLLM(config))
    if mismatch is not None:
        raise ValueError(f"its stored config does not build its checkpoint's model: {mismatch}")


def _resumable_checkpoint(store: RunStore, run: Any) -> tuple[Path | None, int]:
    """The checkpoint a resume of ``run`` loads, checked before the store is changed (a missing
    or corrupt one leaves the run as it was); ``(None, 0)`` when the run has none: its writer
    was killed before the first one was written (the step-0 checkpoint a run starts with), and
    the run starts again from step 0, as seeded as the first time."""
    if run.checkpoint_path is None:
        if run.kind != "overfit":  # hooks.run's runs: nothing of them to rebuild here
            raise RunStoreError(f"run {run.name!r} has no checkpoint to resume from")
        return None, 0
    ckpt = checkpoint_folder(store.path, run.name, run.checkpoint_path)
    meta = read_checkpoint_meta(ckpt)
    checkpoint_folder(store.path, run.name, meta["_dir"])  # its <step>.old, when read instead
    if meta["step"] != run.checkpoint_step:
        raise ValueError(
            f"checkpoint at {ckpt} is of step {meta['step']}, the database says "
            f"{run.checkpoint_step}"
        )
    return ckpt, int(meta["step"])


# ---------------------------------------------------------------------------------------------
# mdb overfit --model module:function
# ---------------------------------------------------------------------------------------------

#: ``build(spec)``: import ``module:function`` and return what the function returned
#: (``(model, batch)``, ``(model, batch, loss_fn)``, or an object with ``model``, ``batch`` and
#: ``loss_fn`` attributes). The CLI passes its own loader; the session seeds torch first.
WorkloadBuilder = Callable[[str], Any]


def _model_state_signature(model: nn.Module) -> dict[str, Any]:
    sd = model.state_dict()
    return {"tensors": len(sd), "parameters": sum(p.numel() for p in model.parameters()),
            "class": type(model).__name__}


class ModelOverfitSession(RunSession):
    """The user's own model memorises the batch its factory returns (``mdb overfit --model``).

    The factory runs after ``torch.manual_seed(options.seed)``; one forward pass in eval mode
    (RNG state kept) tells which loss the model gives (:func:`hooks.select_loss`) and which
    metrics a step records (:func:`hooks.train.trainer.step_metric_names`). A model that returns
    no loss and was given no ``loss_fn`` is refused: training on the mean of its output would
    memorise nothing.

    Attributes:
        options: The run's :class:`ModelOverfitOptions`.
        model, batch, loss_fn: What the factory returned (``batch`` as a :class:`hooks.Batch`).
        loss_source: Where the loss comes from, as code (``out[1]``, ``out.loss``,
            ``loss_fn(out, batch)``).
        optimizer: AdamW over the model's parameters.
        trainer: The :class:`Trainer`.
    """

    def __init__(
        self,
        options: ModelOverfitOptions,
        store: RunStore,
        writer: RunWriter | None,
        build: WorkloadBuilder,
        *,
        start_step: int = 0,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(store, writer, start_step=start_step, checkpoint=checkpoint)
        self.options = options
        torch.manual_seed(options.seed)
        built = build(options.model_path)
        if isinstance(built, tuple):
            model, batch, loss_fn = from_factory(built)
        else:
            model, batch, loss_fn = built.model, Batch.of(built.batch), built.loss_fn
        self.model, self.batch, self.loss_fn = model, batch, loss_fn
        self._probe()
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
        if checkpoint is not None:
            mismatch = checkpoint_mismatch(checkpoint, model)
            if mismatch is not None:
                raise ValueError(f"the model from {options.model} no longer matches its "
                                 f"checkpoint of step {start_step}: {mismatch}")
            load_checkpoint(checkpoint, model, self.optimizer)
        self.trainer = Trainer(
            model, batch, self.optimizer, loss_fn=loss_fn, total_steps=options.steps,
            start_step=start_step, grad_clip=options.grad_clip, capture_every=options.every,
            top_k=self._top_k, capture_kwargs={"attention": True},
            capture_meta=self._capture_meta)

    def _probe(self) -> None:
        """One forward pass (eval mode, no grad, RNG kept): the loss and the metrics."""
        model, batch = self.model, self.batch
        was_training = model.training
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                model.eval()
                out = batch.call(model)
                choice = select_loss(out, self.loss_fn, batch)
        except BatchError as exc:
            raise ValueError(f"--model {self.options.model}: {exc}") from None
        except Exception as exc:  # the user's forward: their error, on one line, located
            raise ModelRaisedError(f"--model {self.options.model}: "
                                   + describe_error(exc, model, "the forward pass")) from None
        finally:
            model.train(was_training)
        if choice.fallback:
            raise ValueError(
                f"--model {self.options.model}: the model returned no loss (only "
                f"{choice.source.removeprefix('mean(')[:-1]}), so there is nothing to memorise;"
                " return (model, batch, loss_fn) with a loss_fn(output, batch)")
        self.loss_source = choice.source
        ids = batch.ids(model)
        self._metric_names = step_metric_names(out, choice, tokens=ids is not None)
        self._moe = bool(router_logits(out))
        cfg = getattr(model, "config", None)
        self._top_k = int(getattr(cfg, "num_experts_per_tok", None) or 1)

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def create(cls, store: RunStore | Callable[[], RunStore],
               name: str | Callable[[RunStore], str], options: ModelOverfitOptions,
               build: WorkloadBuilder) -> ModelOverfitSession:
        """Build the user's model, then register a new run ``name`` in ``store`` (``store`` and
        ``name`` as for :meth:`OverfitSession.create`: the store is opened only once the model
        gave a loss).

        Raises:
            ValueError: Invalid options, or a factory whose model gives no loss (one line).
            hooks.store.store.RunStoreError: Bad name or the name exists.
        """
        options.validate()
        sign_model(options)  # before it is imported
        session = cls(options, None, None, build)  # type: ignore[arg-type]
        session._register(store, name)
        return session

    @classmethod
    def resume(cls, store: RunStore, name: str, build: WorkloadBuilder,
               steps: int | None = None, model: str | None = None) -> ModelOverfitSession:
        """Continue run ``name``: rebuild the model from its factory, check it still matches
        the checkpoint, load it (model, optimizer, RNG); a run without a checkpoint starts
        again from step 0 (:attr:`restarted`).

        The factory imported is ``model`` when given (the user named it again: it is signed
        anew), else the stored ``model_path``, only if its stored reference carries this
        user's signature and every file importing it runs still has its stored sha256
        (:func:`hooks.train.overfit_options.resume_model_refusal`): importing a file runs its
        code, and the database may come from elsewhere.

        Raises:
            hooks.store.store.RunStoreError: No such run, its writer is alive, no checkpoint,
                it already reached its step target, or it was a job of ``mdb overfit --nproc``
                (:func:`hooks.train.overfit_options.nproc_resume_error`).
            ValueError: The stored model file is not to be imported (not signed by this user,
                changed or gone: one line saying to pass ``--model``), this user's key cannot
                be kept, the checkpoint is missing, or
                the factory's model no longer matches it (one line naming the first tensor
                that differs).
        """
        def prepare(options: ModelOverfitOptions) -> None:
            if model is not None:
                options.model, options.model_path = model, resolve_model_spec(model)
            else:
                refused = resume_model_refusal(name, options)
                if refused is not None:
                    raise ValueError(refused)
            sign_model(options)

        return _resume(store, name, ModelOverfitOptions, steps, lambda options, step, ckpt: cls(
            options, store, None, build, start_step=step, checkpoint=ckpt), prepare)

    def run_config(self) -> dict[str, Any]:
        """The run's stored config (``runs.config``): the options, the workload and what
        was resolved from them."""
        return {**self.options.to_dict(), "workload": "model", "loss_source": self.loss_source,
                "batch": self.batch.describe(self.model),
                "model_state": _model_state_signature(self.model), **self._declared()}

    # -- what it is ------------------------------------------------------------------------------

    def describe(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return (f"{type(self.model).__name__} from {self.options.model} · {n:,} params · "
                f"loss = {self.loss_source}")

    @property
    def metric_names(self) -> list[str]:
        return list(self._metric_names)

    @property
    def has_experts(self) -> bool:
        return self._moe

    def _capture_meta(self, batch: Batch) -> dict[str, Any]:
        ids = batch.ids(self.model)
        return {
            "description": (f"overfit run {self.name} · {type(self.model).__name__} from "
                            f"{self.options.model} · {batch.describe(self.model)}"),
            "tokens": batch.token_labels(self.model),
            "config": None,
            "input_shape": list(ids.shape) if ids is not None else None,
            "run": self.name,
        }


def resume_session(store: RunStore, name: str, *, steps: int | None = None,
                   build: WorkloadBuilder | None = None,
                   model: str | None = None) -> RunSession:
    """Resume run ``name`` with the session its stored config needs: a
    :class:`ModelOverfitSession` for a ``--model`` run (``build`` imports its factory: ``model``
    when the user named one again, else the stored one if its file is unchanged), else an
    :class:`OverfitSession`.

    Raises:
        hooks.store.store.RunStoreError, ValueError: As the sessions' ``resume``; ``model``
            given for a run of minillm.
    """
    run = store.run(name)
    if run.damaged:
        raise DamagedRunError(f"cannot resume: {run.damaged}")
    if run.config.get("workload") == "model" or "model_path" in run.config:
        if build is None:
            raise ValueError(f"run {name!r} trains a --model; resuming it needs its factory")
        return ModelOverfitSession.resume(store, name, build, steps=steps, model=model)
    if model is not None:
        raise ValueError(f"--model applies only to a run made with --model; run {name!r} "
                         "trains minillm")
    return OverfitSession.resume(store, name, steps=steps)
