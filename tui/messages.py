"""Messages between mdb's screens, widgets and workers: small dataclasses.

Handlers follow Textual's naming: ``JumpToModule`` is handled by ``on_jump_to_module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message


@dataclass
class JumpToModule(Message):
    """Ask the step view to select a module's call (posted by the doctor and search screens).

    Attributes:
        module: qualified module name (``model.layers.1.mlp.gate``; ``""`` for the root).
        call_index: which call of the module (0 = its first).
    """

    module: str
    call_index: int = 0


@dataclass
class Moved(Message):
    """The step view moved to another record (tests and embedding apps can watch this).

    Attributes:
        direction: ``"forward"`` or ``"backward"``.
        index: index into ``Trace.forward`` or ``Trace.backward``.
        module: qualified module name of the record.
    """

    direction: str
    index: int
    module: str


@dataclass
class TraceReady(Message):
    """A loading worker finished capturing or loading a trace."""

    trace: Any


@dataclass
class LoadFailed(Message):
    """A loading worker failed.

    Attributes:
        error: one line for a person (printed as ``mdb: error: ...`` after the app exits).
        exit_code: process exit code (2 for bad input).
    """

    error: str
    exit_code: int = 2


# ---------------------------------------------------------------------------------------------
# Live screen (``mdb overfit`` / ``mdb watch``): posted by its training and polling workers.
# Owned by the live-screen code (tui/screens/live.py); additions only below this line.
# ---------------------------------------------------------------------------------------------


@dataclass
class StepsPending(Message):
    """The training worker queued new steps for the live screen to read.

    The steps themselves wait in the screen's buffer, so no step is lost when the screen is
    busy; this message only says "look", and a newer one replaces an unhandled older one
    (``can_replace``) so a fast trainer cannot flood the queue.

    Attributes:
        step: The latest queued step.
    """

    step: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StepsPending)


@dataclass
class TrainingState(Message):
    """The training loop started waiting (``"paused"``) or continued (``"running"``)."""

    state: str


@dataclass
class StepCaptured(Message):
    """The step the user asked to capture (``c``) is done: open its trace in the step view.

    Attributes:
        step: The captured step.
        trace: Its :class:`hooks.Trace` (forward, backward, parameter gradients, routing).
    """

    step: int
    trace: Any


@dataclass
class TrainingEnded(Message):
    """The training worker returned.

    Attributes:
        status: ``finished``, ``interrupted`` or ``failed``.
        last_step: Last completed step.
        reason: ``"finished"``, the stop reason, or the failure's one-line description.
        fail_step: For ``failed``: the step with the first non-finite value.
        fail_module: For ``failed``: the module it first appeared in (``None`` if not located).
        verdict: The run's verdict in lines (:meth:`hooks.train.verdict.Verdict.lines`): the
            first says whether it memorised the batch, one more per loss spike.
        memorised: That verdict (``None`` without one).
    """

    status: str
    last_step: int
    reason: str
    fail_step: int | None = None
    fail_module: str | None = None
    verdict: tuple[str, ...] = ()
    memorised: bool | None = None


@dataclass
class RunPolled(Message):
    """A watch poll read the database: everything new about the run since the last poll.

    Attributes:
        update: The :class:`hooks.store.store.RunUpdate` (run row, new metric rows and samples).
        history: On a first read of a long run, its metrics bucketed by step range
            (:class:`hooks.store.summary.History`); ``update.metrics`` are then only its last
            steps, which the buckets hold already. ``None`` otherwise.
    """

    update: Any
    history: Any = None


@dataclass
class HistoryDetail(Message):
    """A worker read the detail a watch's first frame left out (from the store's bucketed
    history): the expert load of every step before the last ones.

    Attributes:
        experts: Per MoE layer, per expert, a :class:`tui.screens.live_data.Downsampler` of
            those steps, shape (L_moe, E).
    """

    experts: Any


@dataclass
class Hint(Message):
    """A one-line status for the screen's hint bar, from a worker.

    Attributes:
        text: The line.
    """

    text: str


@dataclass
class TrainingCrashed(Message):
    """The training thread ended with an exception (the user's model raised, a database write
    failed); the run is already marked failed in the store.

    Attributes:
        error: One line: the exception's type and message.
    """

    error: str
