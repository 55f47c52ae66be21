"""The keys of a viewer of a running run (``mdb watch``, and ``mdb overfit``'s live screen,
which is a viewer of the trainer process it started).

* ``d`` detaches: the screen exits, training goes on; the closing line is the command that
  re-attaches.
* ``p`` pauses or resumes the run, ``x`` stops it (after asking) with a checkpoint: both are
  requests through the run store (:mod:`hooks.store.control`), acted on by the process that
  trains, whichever terminal started it.
* ``q`` asks whether to detach (the default) or to stop; Ctrl-C detaches, and says so.
* When the run's state changes while it is viewed (paused, resumed, stopped, ended), by this
  viewer's request or another's (``mdb stop``, a second ``mdb watch``), the hint line says the
  state it is now in (:meth:`ViewerControls.say_state`): never a request that is stale.

Of a run that is not running (finished, failed, gone), ``q`` and Ctrl-C just close the viewer.
"""

from __future__ import annotations

from tui.screens.choice import ChoiceScreen

#: :attr:`ViewerControls.outcome` values, read by the command once the app has exited.
DETACHED, STOPPED, CLOSED = "detached", "stopped", "closed"


class ViewerControls:
    """Mixed into :class:`tui.screens.live_watch.WatchScreen`.

    Uses the screen's ``run`` (the :class:`hooks.store.store.RunInfo` of the latest poll),
    ``store``, ``state``, ``hint`` and ``app``; sets :attr:`outcome`.
    """

    outcome: str | None = None

    def viewing_live_run(self) -> bool:
        """Whether this viewer follows a run whose trainer is alive (running or paused) and
        obeys requests: not a ``torchrun`` job, whose ranks only rank 0 would hear (``q``
        closes the viewer; ``mdb overfit --nproc`` then stops its job, as before)."""
        return (self.watch and self.run is not None and self.state in ("running", "paused")
                and (getattr(self.run, "world_size", None) or 1) <= 1)

    def say_state(self, before: str, state: str) -> None:
        """Put the run's new ``state`` in the hint line (it was ``before``), in place of what
        a request of this viewer said (``asked the run to pause``) or of an older state. Not
        at the first read (``before`` is ``reading``): the screen's opening hint stays."""
        if before == "reading" or state == before:
            return
        live = self.viewing_live_run()
        if state == "paused":
            self.hint("the run is paused · p resumes" if live else "the run is paused")
        elif state == "running":
            self.hint("the run is training · p pauses · x stops" if live
                      else "the run is training")
        else:
            self.hint(f"the run has ended: {self.run.status_line()} · q closes")

    def _leave(self, outcome: str) -> None:
        if not (outcome == CLOSED and self.outcome == STOPPED):  # x, then q once it ended
            self.outcome = outcome
        self.app.exit(return_code=0)

    def action_detach(self) -> None:
        """``d``: close the viewer, training goes on."""
        if not self.viewing_live_run():
            self._leave(CLOSED)
            return
        self._leave(DETACHED)

    def watch_interrupt(self) -> None:
        """Ctrl-C in a viewer: detach (a running run goes on), else close."""
        self.action_detach()

    def watch_quit(self) -> None:
        """``q``: of a running run, ask whether to detach (default) or stop."""
        if not self.viewing_live_run():
            self._leave(CLOSED)
            return

        def answered(value: str | None) -> None:
            if value == DETACHED:
                self._leave(DETACHED)
            elif value == STOPPED:
                self._request("stop", then_leave=True)

        self.app.push_screen(ChoiceScreen(
            f"run {self.run.name} is still training. Leave it training, or stop it?",
            [("d", "detach: it goes on", DETACHED),
             ("x", "stop it with a checkpoint", STOPPED)], DETACHED), answered)

    def watch_pause(self) -> None:
        """``p``: ask the trainer to pause, or to resume a paused run."""
        if not self.viewing_live_run():
            self.hint(f"the run is not training ({self.state}): nothing to pause")
            return
        self._request("resume" if self.state == "paused" else "pause")

    def watch_stop(self) -> None:
        """``x``: after asking, ask the trainer to stop after its step with a checkpoint."""
        if not self.viewing_live_run():
            self.hint(f"the run is not training ({self.state}): nothing to stop")
            return

        def answered(value: str | None) -> None:
            if value == STOPPED:
                self._request("stop")

        self.app.push_screen(ChoiceScreen(
            f"stop run {self.run.name} after its current step, with a checkpoint?",
            [("y", "stop it", STOPPED), ("n", "keep training", "")], STOPPED), answered)

    def _request(self, command: str, then_leave: bool = False) -> None:
        from hooks.store.control import request

        try:
            request(self.store.path, self.run.id, command)
        except Exception as exc:  # a read-only or locked database: say it, keep the view
            self.hint(f"could not ask the run to {command}: {exc}")
            return
        said = {"stop": "asked the run to stop after its step (it writes a checkpoint)…",
                "pause": "asked the run to pause after its step · p resumes",
                "resume": "asked the run to resume · p pauses"}
        self.hint(said[command])
        if then_leave:
            self._leave(STOPPED)
        elif command == "stop":
            self.outcome = STOPPED
