"""The overfit run of ``mdb overfit``: seed 000's "memorise a short text" sanity check.

:class:`OverfitSession` builds the model, tokenizer, AdamW optimizer and batch from
:class:`OverfitOptions`, trains them with a :class:`hooks.runs.trainer.Trainer`, writes every step
to a :class:`hooks.runs.store.RunStore`, checkpoints (:mod:`hooks.runs.checkpoint`) at the end, on
interruption and every ``checkpoint_every`` steps, and resumes from the last checkpoint.

A run's checkpoints live in ``<db stem>-checkpoints/<run>/step-<N>/`` (N zero-padded to 8
digits), written when the run starts, every ``checkpoint_every`` steps and at its end; the
store's row names the current one and is the commit point (older directories are deleted after
it is updated), so a ``kill -9`` at any moment leaves a checkpoint that matches the database.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hooks.runs.checkpoint import load_checkpoint, read_checkpoint_meta, save_checkpoint
from hooks.runs.store import RunStore, RunWriter, checkpoint_dir
from hooks.runs.trainer import Batch, StepReport, TrainControl, Trainer, TrainResult

__all__ = [
    "DEFAULT_TEXT_PATH",
    "SEED_SENTENCE",
    "OverfitOptions",
    "OverfitSession",
    "default_overfit_text",
]

#: The default overfit text: seed 000's test C sentence ×6, relative to the repository root.
DEFAULT_TEXT_PATH = Path(__file__).resolve().parents[2] / "samples" / "overfit_zh.txt"
#: Seed 000's test C sentence, used when ``samples/overfit_zh.txt`` is not available.
SEED_SENTENCE = "人工智能正在改变世界。"


def _step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


@dataclass
class OverfitOptions:
    """Everything that defines an overfit run (stored as the run's config, so it can resume).

    Attributes:
        text: The text to memorise.
        text_source: Where it came from (a path, for display).
        model_config: ``MiniLLMConfig.to_dict()`` of the model *before* ``vocab_size`` is set
            to the tokenizer's size.
        preset: Preset name the config came from, if any (for display).
        steps: Total steps.
        lr: AdamW learning rate (constant).
        weight_decay: AdamW weight decay.
        seq_len: Tokens per sequence; ``None`` (or ≥ the text's length) trains on the whole text.
            Shorter: each step takes ``batch_size`` windows at offsets drawn from a generator
            seeded with ``seed + step`` (so a resumed run sees the same batches).
        batch_size: B, sequences per step.
        seed: Seeds the model's initialisation and the window offsets.
        every: Record internals (hooks statistics) every N steps (0: only on request).
        sample_every: Greedy continuation every N steps (0: never).
        prompt_chars: Characters of the text's beginning used as the sample prompt.
        sample_tokens: Tokens generated per sample.
        checkpoint_every: Also checkpoint every N steps (0: only at the end and on interruption).
        grad_clip: Clip the global gradient norm (``None``: off).
        tokenizer: ``"char"`` (the text's characters, seed 000's) or ``"byte"``.
    """

    text: str
    text_source: str = "samples/overfit_zh.txt"
    model_config: dict[str, Any] = field(default_factory=dict)
    preset: str | None = "seed-test-c"
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.01
    seq_len: int | None = None
    batch_size: int = 1
    seed: int = 0
    every: int = 0
    sample_every: int = 25
    prompt_chars: int = 4
    sample_tokens: int = 32
    checkpoint_every: int = 0
    grad_clip: float | None = None
    tokenizer: str = "char"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (the run's stored config)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OverfitOptions:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (a later mdb may add some)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def validate(self) -> None:
        """Raise ``ValueError`` with one line naming the bad option."""
        if not self.text:
            raise ValueError("the text to memorise is empty")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2, got {self.seq_len}")
        for name in ("every", "sample_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.tokenizer not in ("char", "byte"):
            raise ValueError(f"tokenizer must be 'char' or 'byte', got {self.tokenizer!r}")


def default_overfit_text() -> tuple[str, str]:
    """``(text, source)`` of the default run: ``samples/overfit_zh.txt`` if present (one trailing
    newline dropped), else the seed sentence ×6."""
    if DEFAULT_TEXT_PATH.exists():
        text = DEFAULT_TEXT_PATH.read_text(encoding="utf-8")
        return text.removesuffix("\n").removesuffix("\r"), "samples/overfit_zh.txt"
    return SEED_SENTENCE * 6, "seed 000 test C sentence ×6"


class OverfitSession:
    """An overfit run bound to a run store: model, optimizer, trainer, writer and checkpoints.

    Build one with :meth:`create` (a new run) or :meth:`resume` (continue an interrupted one),
    then call :meth:`run` — from the main thread for a headless run, or from a worker thread
    under a UI (install signal handlers in the main thread with :func:`install_stop_signals` on
    :attr:`control`).

    Attributes:
        options: The run's :class:`OverfitOptions`.
        model: The :class:`minillm.MiniLLM` being trained.
        tokenizer: Its tokenizer.
        config: The model's ``MiniLLMConfig`` (``vocab_size`` = tokenizer size).
        optimizer: AdamW.
        trainer: The :class:`Trainer`.
        control: The :class:`TrainControl` (pause / step / stop / capture).
        store: The :class:`RunStore`; ``writer``: the :class:`RunWriter` of this run.
        result: The :class:`TrainResult` once :meth:`run` returned.
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

        self.options = options
        self.store = store
        self.writer: RunWriter = writer  # type: ignore[assignment]  (set by create())
        self.name = writer.name if writer is not None else ""
        self.control = TrainControl()
        self.result: TrainResult | None = None
        self.checkpoint_error: str | None = None
        #: The checkpoint directory the store records for this run (``None``: none yet), and
        #: its step.
        self.last_checkpoint: Path | None = Path(checkpoint) if checkpoint is not None else None
        self.last_checkpoint_step: int | None = start_step if checkpoint is not None else None
        torch.manual_seed(options.seed)
        if options.tokenizer == "char":
            self.tokenizer: Any = minillm.CharTokenizer.from_text(options.text)
        else:
            self.tokenizer = minillm.ByteTokenizer()
        base = minillm.MiniLLMConfig.from_dict(dict(options.model_config))
        self.config = base.replace(vocab_size=self.tokenizer.vocab_size)
        self.ids = torch.tensor([self.tokenizer.encode(options.text)], dtype=torch.long)
        n = self.ids.shape[1]
        if n < 2:
            raise ValueError("the text must be at least 2 tokens long")
        seq = n if options.seq_len is None else min(options.seq_len, n)
        if seq > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence of {seq} tokens exceeds the model's max_position_embeddings "
                f"({self.config.max_position_embeddings}); pass a smaller --seq-len"
            )
        self.seq_len = seq
        self.model = minillm.MiniLLM(self.config)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=options.lr, weight_decay=options.weight_decay
        )
        if checkpoint is not None:
            load_checkpoint(checkpoint, self.model, self.optimizer)
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
            capture_kwargs={"attention": True},
            capture_meta=self._capture_meta,
        )
        self._fixed_batch = None
        if seq == n:
            x = self.ids.expand(options.batch_size, n).contiguous()
            self._fixed_batch = {"input_ids": x, "labels": x}

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        store: RunStore,
        name: str,
        options: OverfitOptions,
    ) -> OverfitSession:
        """Register a new run ``name`` in ``store`` and build its session.

        Raises:
            ValueError: Invalid options (one line).
            hooks.runs.store.RunStoreError: Bad name or the name exists.
        """
        options.validate()
        session = cls(options, store, None)  # builds (and validates) everything first
        session.writer = store.create_run(
            name,
            {**options.to_dict(), "resolved_model_config": session.config.to_dict()},
            total_steps=options.steps,
        )
        session.name = name
        return session

    @classmethod
    def resume(cls, store: RunStore, name: str, steps: int | None = None) -> OverfitSession:
        """Continue run ``name`` from its last checkpoint (model, optimizer, RNG, step).

        Args:
            store: The store holding the run.
            name: The run.
            steps: A new total step count (default: the stored one).

        Raises:
            hooks.runs.store.RunStoreError: No such run, its writer is alive, no checkpoint, or
                it already reached its step target.
            ValueError: The checkpoint is missing or does not fit.
        """
        run = store.run(name)
        options = OverfitOptions.from_dict(run.config)
        if steps is not None:
            options.steps = int(steps)
        options.validate()
        if run.checkpoint_path is None:  # resume_run says why it cannot go on
            store.resume_run(name, total_steps=options.steps)
        ckpt = Path(run.checkpoint_path or "")
        if not ckpt.is_absolute():
            ckpt = store.path.parent / ckpt
        # the checkpoint is read and loaded before the store is changed: a missing or corrupt
        # one leaves the run as it was
        meta = read_checkpoint_meta(ckpt)
        if meta["step"] != run.checkpoint_step:
            raise ValueError(
                f"checkpoint at {ckpt} is of step {meta['step']}, the database says "
                f"{run.checkpoint_step}"
            )
        session = cls(options, store, None, start_step=meta["step"], checkpoint=ckpt)
        session.last_checkpoint_step = meta["step"]
        writer = store.resume_run(name, total_steps=options.steps)
        session.writer, session.name = writer, name
        writer.update_config(
            {**options.to_dict(), "resolved_model_config": session.config.to_dict()}
        )
        return session

    # -- pieces --------------------------------------------------------------------------------

    def _batch_for(self, step: int) -> dict[str, torch.Tensor]:
        if self._fixed_batch is not None:
            return self._fixed_batch
        n, seq, b = self.ids.shape[1], self.seq_len, self.options.batch_size
        g = torch.Generator().manual_seed(self.options.seed * 1_000_003 + step)
        starts = torch.randint(0, n - seq + 1, (b,), generator=g)
        x = torch.stack([self.ids[0, s : s + seq] for s in starts.tolist()])
        return {"input_ids": x, "labels": x}

    def _capture_meta(self, batch: Batch) -> dict[str, Any]:
        """``meta`` of a captured step, as ``mdb step`` records it (tokens, config, shape)."""
        ids = batch["input_ids"]
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

    @property
    def checkpoint_root(self) -> Path:
        """This run's directory of checkpoints (beside the database)."""
        return checkpoint_dir(self.store.path, self.name)

    @property
    def checkpoint_path(self) -> Path:
        """The run's latest recorded checkpoint, or its checkpoint root if none was written."""
        return self.last_checkpoint if self.last_checkpoint is not None else self.checkpoint_root

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
            extra={"run": self.name, "seed": self.options.seed},
        )
        self.writer.set_checkpoint(step, path)
        self.last_checkpoint, self.last_checkpoint_step = path, step
        self._prune_checkpoints(keep=path)
        return path

    def _prune_checkpoints(self, keep: Path) -> None:
        """Delete this run's checkpoint directories other than ``keep`` (best effort)."""
        root = self.checkpoint_root
        if not root.is_dir():
            return
        for child in root.iterdir():
            if child.is_dir() and child.name.startswith("step-") and child != keep:
                shutil.rmtree(child, ignore_errors=True)
        # the layout before step directories: files directly in the run's directory
        for name in ("model.safetensors", "optimizer.safetensors", "checkpoint.json"):
            with contextlib.suppress(OSError):
                (root / name).unlink()

    # -- running -------------------------------------------------------------------------------

    def run(
        self,
        on_step: Callable[[StepReport], None] | None = None,
        on_state: Callable[[str], None] | None = None,
        heartbeat_interval: float = 1.0,
    ) -> TrainResult:
        """Train to the end (or a stop / failure), writing every step to the store.

        Each step is committed (metrics, internals, sample) before ``on_step`` is called. At the
        end: a finished or interrupted run is checkpointed and its status set; a failed run
        records the failing step and module. An exception escaping the loop (including a
        second Ctrl-C) marks the run interrupted (with a checkpoint if possible) and re-raises.

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
            if every_ckpt and report.failure is None and report.step % every_ckpt == 0:
                self._try_checkpoint()
            if on_step is not None:
                on_step(report)

        def state_cb(state: str) -> None:
            writer.set_paused(state == "paused")
            if on_state is not None:
                on_state(state)

        writer.start_heartbeat(heartbeat_interval)
        if self.last_checkpoint is None:
            # a new run starts with a checkpoint of its initial state, so that a writer killed
            # before its first periodic checkpoint still leaves a run that can be resumed
            self._try_checkpoint()
        try:
            result = self.trainer.run(self.control, on_step=step_cb, on_state=state_cb)
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            reason = "KeyboardInterrupt" if interrupted else f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                if self.trainer.step != self.last_checkpoint_step:
                    self.save_checkpoint()
            with contextlib.suppress(Exception):
                writer.finish("interrupted" if interrupted else "failed", reason=reason[:500],
                              fail_step=None if interrupted else self.trainer.step + 1)
            raise
        if result.status == "failed":
            f = result.failure
            writer.finish(
                "failed",
                reason=result.reason[:500],
                fail_step=f.step if f else result.last_step,
                fail_module=f.module if f else None,
            )
        else:
            reason = result.reason
            if result.last_step != self.last_checkpoint_step:
                self._try_checkpoint()
            if self.checkpoint_error:
                reason = f"{reason}; {self.checkpoint_error}"
                result.reason = reason
            writer.finish(result.status, reason=reason)
        self.result = result
        return result

    def _try_checkpoint(self) -> str | None:
        """Checkpoint; if it cannot be written (disk full, read-only directory...) return a
        one-line description instead of raising. The run's metrics are safe in the database;
        :attr:`checkpoint_error` keeps the failure until a later checkpoint succeeds."""
        try:
            self.save_checkpoint()
        except Exception as exc:  # OSError, safetensors' SafetensorError, ...
            line = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)
            self.checkpoint_error = f"checkpoint of step {self.trainer.step} failed: " + (
                line.splitlines()[0][:200])
            return self.checkpoint_error
        self.checkpoint_error = None
        return None

    @property
    def checkpoint_current(self) -> bool:
        """Whether the recorded checkpoint is of the last step trained (nothing to lose)."""
        return self.last_checkpoint_step == self.trainer.step
