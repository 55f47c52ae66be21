"""``StepScreen``: walk through one captured forward and backward pass, call by call.

The step view is a screen, not an app, so any mdb app can show a trace::

    from tui.screens.step import StepScreen
    app.push_screen(StepScreen(trace, embedded=True))   # q / Esc come back to your screen

``mdb step`` uses the same screen as the main screen of :class:`tui.app.MdbApp` (there ``q``
quits). The router, attention and gradients views are pushed on top of it (``r``, ``a``, ``g``),
``d`` shows doctor results when the caller gave some, ``m`` where the step's bytes go
(:mod:`tui.screens.memory`), ``?`` lists every key.
"""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Static, Tree

from hooks.text import printable
from tui import messages
from tui.screens.base import MdbScreen
from tui.screens.stepper import Stepper
from tui.widgets.call_details import CallDetails
from tui.widgets.fmt import loss_line
from tui.widgets.footer import MdbFooter
from tui.widgets.module_tree import ModuleTree


class StepScreen(MdbScreen):
    """The step-through view: module tree, details of the current call, status line.

    Args:
        trace: the :class:`hooks.Trace` to walk.
        doctor_results: check results for ``d`` (a list, see ``tui.screens.doctor``), or None
        doctor_runner: when there are no results, ``runner(on_result)`` runs the checks on
            the live model the first time ``d`` is pressed (see ``DoctorScreen``), or None
            when none were computed (``d`` then says how to get them).
        embedded: False when this is the app's main screen (``q`` quits the app); True when
            pushed on top of another app's screen (``q`` and Esc pop back to it).
        start_at_nonfinite: open at the first NaN/Inf when the trace has any (default True).
    """

    # every key a priority binding: a key the focused tree saw first would wait in its queue
    # while later priority keys ran, so `t n n` typed at once ended at call 1 (and Home
    # scrolled the tree instead of going to the first call)
    BINDINGS = [
        Binding("n,j,right", "next", "next", key_display="n", id="step.next", priority=True,
                tooltip="next call (next gradient in the backward pass)"),
        Binding("p,k,left", "prev", "prev", key_display="p", id="step.prev", priority=True,
                tooltip="previous call (previous gradient in the backward pass)"),
        Binding("N,right_square_bracket,pagedown", "next_layer", "next layer",
                key_display="N", show=False, id="step.next_layer", priority=True,
                tooltip="first record of the next decoder layer"),
        Binding("P,left_square_bracket,pageup", "prev_layer", "prev layer",
                key_display="P", show=False, id="step.prev_layer", priority=True,
                tooltip="start of this layer, or of the previous one"),
        Binding("b", "toggle_pass", "bwd", id="step.toggle_pass", priority=True,
                tooltip="backward start (autograd order); again: back to the forward call"),
        Binding("t,home", "first", "first call of this pass", show=False, id="step.first",
                priority=True, tooltip="first record of this pass"),
        Binding("J,shift+down", "scroll_details(3)", "details down", show=False,
                id="step.details_down", priority=True,
                tooltip="scroll the details pane down (parameters)"),
        Binding("K,shift+up", "scroll_details(-3)", "details up", show=False,
                id="step.details_up", priority=True, tooltip="scroll the details pane up"),
        Binding("f", "first_nonfinite", "NaN", id="step.first_nonfinite", priority=True,
                tooltip="first NaN/Inf (forward, else backward)"),
        Binding("i", "step_into", "into", id="step.into", priority=True,
                tooltip="step into the current call: its torch ops (backward: the forward op "
                "that made the gradient non-finite)"),
        Binding("e", "edit", "edit", show=False, id="step.edit", priority=True,
                tooltip="what if: edit the selected call (zero, a head, an expert, drop, scale, "
                "mean, patch), re-run the step, and see what changed"),
        Binding("slash", "search", "find", key_display="/", id="step.search", priority=True,
                tooltip="find a module by name"),
        Binding("r", "view('router')", "router", id="view.router", priority=True,
                tooltip="router view: experts per token, load per expert, aux loss"),
        Binding("a", "view('attention')", "attn", id="view.attention", priority=True,
                tooltip="attention view: T×T probabilities per layer and head"),
        Binding("g", "view('gradients')", "grads", id="view.gradients", priority=True,
                tooltip="gradients view: every parameter's grad norm and verdict"),
        Binding("L", "lens", "lens", show=False, id="view.lens", priority=True,
                tooltip="logit lens: what each decoder layer already predicts (layers × "
                "positions; Enter: a cell's top k)"),
        Binding("d", "view('doctor')", "doctor", show=False, id="view.doctor", priority=True,
                tooltip="doctor results (from mdb doctor)"),
        Binding("m", "memory", "memory", show=False, id="view.memory", priority=True,
                tooltip="memory: bytes per module (parameters, gradients, optimizer state, "
                "saved for backward), the step's peak and what is alive at it"),
        Binding("question_mark", "help", "keys", key_display="?", id="app.help", priority=True,
                tooltip="this list of keys"),
        Binding("q", "quit_view", "quit", id="app.quit", priority=True,
                tooltip="quit (embedded: back to the calling screen)"),
        Binding("escape", "escape", "back", show=False, id="step.escape", priority=True,
                tooltip="embedded: back to the calling screen"),
    ]

    def __init__(self, trace, *, doctor_results=None, doctor_runner=None,
                 embedded: bool = False, start_at_nonfinite: bool = True,
                 name: str | None = None) -> None:
        super().__init__(name=name)
        self.trace = trace
        self.doctor_results = doctor_results
        self.doctor_runner = doctor_runner
        self.embedded = embedded
        self.stepper = Stepper(trace)
        self._installed: list[str] = []
        self.nonfinite = None
        if start_at_nonfinite:
            self.nonfinite = self.stepper.first_nonfinite()

    # -- layout ---------------------------------------------------------------------------------
    def compose(self):
        meta = self.trace.meta or {}
        step = f"step {meta['step']}" if meta.get("step") is not None else None  # a run's step
        title = " · ".join(x for x in (step, meta.get("description") or self.trace.model_type)
                           if x)
        with Horizontal(id="title-bar"):
            # the description may be cut; what was differentiated never is
            yield Static(printable(title), id="title", markup=False)
            yield Static(printable(loss_line(meta)), id="title-loss", markup=False)
        yield Static("", id="status", markup=False)
        with Horizontal(id="step-main"):
            yield ModuleTree(self.trace, id="tree")
            yield CallDetails(id="details")
        yield Static("", id="hint", markup=False)
        yield MdbFooter()

    def on_resize(self, event) -> None:
        self._fit_title(event.size.width)

    def _fit_title(self, width: int) -> None:
        """The description and the loss side by side when both fit ``width`` columns whole,
        else the loss on a line of its own under the description (neither is cut)."""
        from rich.cells import cell_len

        bar = self.query_one("#title-bar")
        parts = [str(w.render()) for w in bar.query(Static)]
        need = sum(cell_len(p) + 2 for p in parts)  # each has one column of padding a side
        bar.set_class(need > width, "-stacked")

    def on_mount(self) -> None:
        self._fit_title(self.app.size.width)
        self.refresh_view()
        self.query_one("#tree", ModuleTree).focus()
        if self.nonfinite is not None:
            self.hint(f"opened at the first non-finite value: {self.nonfinite.describe()}"
                      f"{self._origin_text(self.nonfinite)}")
        elif isinstance(((self.trace.meta or {}).get("spike") or {}).get("line"), str):
            self.hint(printable("captured before its update: "
                                + self.trace.meta["spike"]["line"]))
        elif not self.trace.backward:
            self.hint("no gradients recorded: this trace has a forward pass only")
        if hasattr(self.app, "step_painted"):
            self.call_after_refresh(self.app.step_painted)
        if getattr(self.app, "exit_after_paint", False):
            self.call_after_refresh(self.app.exit)

    def refresh_view(self) -> None:
        """Redraw the status line, the tree cursor and the details for the current record."""
        st = self.stepper
        # one row high (app.tcss): repainted without a layout
        self.query_one("#status", Static).update(st.status(), layout=False)
        if st.module is not None:
            self.query_one("#tree", ModuleTree).show_module(st.module)
        details = self.query_one("#details", CallDetails)
        details.show(st)
        if details.scroll_y:
            details.scroll_home(animate=False)
        if st.current is not None:
            self.post_message(messages.Moved(st.direction, st.index, st.module))

    def _moved(self, ok: bool, why: str, hint: str = "") -> None:
        """After a move: ``hint`` (``why`` when it did not move), the view redrawn, and every
        widget's repaint handed to the screen at once (one frame per key)."""
        self.hint(hint if ok else why)
        if ok:
            self.refresh_view()
        self.flush_repaints()

    # -- actions --------------------------------------------------------------------------------
    def action_next(self) -> None:
        self._moved(self.stepper.step(+1), f"already at the last {self._unit()}")

    def action_prev(self) -> None:
        self._moved(self.stepper.step(-1), f"already at the first {self._unit()}")

    def action_next_layer(self) -> None:
        self._moved(self.stepper.next_layer(), "no later layer in this pass")

    def action_prev_layer(self) -> None:
        self._moved(self.stepper.prev_layer(), "no earlier layer in this pass")

    def action_first(self) -> None:
        self._moved(self.stepper.go(self.stepper.direction, 0), "empty pass")

    def action_toggle_pass(self) -> None:
        ok = self.stepper.toggle_pass()
        self._moved(ok, "no backward pass recorded in this trace",
                    "backward: gradients in the order autograd produced them · b returns"
                    if self.stepper.direction == "backward" else "")

    def action_first_nonfinite(self) -> None:
        hit = self.stepper.first_nonfinite()
        if hit is None:
            self.hint("✓ every recorded value and gradient is finite")
            return
        self.refresh_view()
        self.hint(f"✗ first non-finite: {hit.describe()}{self._origin_text(hit)}")
        self.flush_repaints()

    def _origin_text(self, hit) -> str:
        """`` · made by SqrtBackward0 (forward sqrt at m.py:9: ...) · i steps in`` for a
        backward hit whose origin was located; `` · l2.weight: its weight holds 1 NaN of 528
        values, in rank 1's shard`` for a forward hit in a module whose own (sharded) weight
        the capture saw non-finite; else ``""``."""
        if hit is not None and hit.direction == "forward":
            from hooks.nonfinite.origin import nonfinite_weight_notes

            return "".join(f" · {n}" for n in nonfinite_weight_notes(self.trace, hit.module))
        origin = getattr(self.trace, "backward_origin", None)
        if hit is None or hit.direction != "backward" or origin is None:
            return ""
        return f" · made by {origin.describe()} · i steps in"

    def action_search(self) -> None:
        from tui.screens.search import SearchScreen

        names = [m.name for m in self.trace.modules if m.name] or sorted(
            {r.module for r in self.trace.forward if r.module}
        )
        self.app.push_screen(SearchScreen(names), self._search_done)

    def _search_done(self, module: str | None) -> None:
        if module is not None:
            self.jump(module)

    def action_view(self, view: str) -> None:
        self.open_view(view)

    #: Views kept installed after their first opening (re-opening one skips building it; the
    #: doctor view keeps the results its checks produced).
    CACHED_VIEWS = ("router", "attention", "gradients", "doctor")

    def open_view(self, view: str, *, replace: bool = False) -> None:
        """Show ``view`` on top of this screen (``replace``: instead of the current view).

        The router, attention and gradients views are built once per step screen and kept
        installed, so opening one again costs only a repaint; they follow the step view's
        layer when shown again (see ``ViewScreen.on_screen_resume``).
        """
        show = self.app.switch_screen if replace else self.app.push_screen
        if view not in self.CACHED_VIEWS:
            show(self.make_view(view))
            return
        name = f"mdb-{view}-{id(self)}"
        if not self.app.is_screen_installed(name):
            self.app.install_screen(self.make_view(view), name)
            self._installed.append(name)
        show(name)

    def on_unmount(self) -> None:
        from textual.app import ScreenStackError

        for name in self._installed:  # an embedding app keeps running: free the views
            try:
                if self.app.is_screen_installed(name):
                    self.app.uninstall_screen(name)
            except ScreenStackError:  # still on the stack while the app shuts down
                pass

    @staticmethod
    def help_text() -> str:
        """Every key of the step view and of the views it opens (their own ``BINDINGS``)."""
        from tui.screens.help import help_text

        return help_text(StepScreen.help_sections())

    @staticmethod
    def help_sections() -> list[tuple[str, list]]:
        """``(title, bindings)`` of the step view and of each view it opens."""
        from textual.binding import Binding

        from tui.screens.attention import AttentionScreen
        from tui.screens.doctor import DoctorScreen
        from tui.screens.edit_diff import EditDiffScreen
        from tui.screens.gradients import GradientsScreen
        from tui.screens.lens import LensScreen
        from tui.screens.memory import MemoryScreen
        from tui.screens.ops import OpsScreen
        from tui.screens.router import RouterScreen
        from tui.screens.search import SearchScreen
        from tui.screens.view import VIEW_BINDINGS

        own = {id(b) for b in VIEW_BINDINGS}
        return [
            ("step view", StepScreen.BINDINGS
             + [Binding("enter", "", "jump to the tree node's first call")]),
            ("router view", [b for b in RouterScreen.BINDINGS if id(b) not in own]),
            ("attention view", [b for b in AttentionScreen.BINDINGS if id(b) not in own]),
            ("gradients view", [b for b in GradientsScreen.BINDINGS if id(b) not in own]
             + [Binding("enter", "", "open the parameter's module in the step view")]),
            ("ops view (i: step into a call)",
             [b for b in OpsScreen.BINDINGS if id(b) not in own]),
            ("doctor view (d)", DoctorScreen.HELP_BINDINGS),
            ("logit lens (L)", [b for b in LensScreen.BINDINGS if id(b) not in own]),
            ("memory (m)", [b for b in MemoryScreen.BINDINGS if id(b) not in own]),
            ("what if (e: the edit form, then A as is | B edited)", EditDiffScreen.BINDINGS
             + [Binding("enter", "", "edit form: copy a choice below / run the spec")]),
            ("every view", VIEW_BINDINGS),
            ("find (/)", SearchScreen.BINDINGS + [Binding("enter", "", "jump to the match")]),
        ]

    def action_help(self) -> None:
        from tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen(self.help_text()))

    def action_quit_view(self) -> None:
        """Quit the app, or, when embedded in another app, go back to its screen."""
        if self.embedded:
            self.dismiss()
        else:
            self.app.exit()

    def action_escape(self) -> None:
        if self.embedded:
            self.dismiss()
        else:
            self.hint("q quits · ? lists the keys")

    def _unit(self) -> str:
        return "call" if self.stepper.direction == "forward" else "gradient"

    def action_scroll_details(self, lines: int) -> None:
        self.query_one("#details", CallDetails).scroll_relative(y=lines, animate=False)

    def action_step_into(self) -> None:
        """Open the ops of the current forward call (in the backward pass: of the call whose
        output this gradient belongs to, or of the module where the backward's first
        non-finite gradient was created, with its op selected)."""
        from tui.screens.ops import OpsScreen

        st = self.stepper
        call = st.call
        if call is None:
            self.hint("nothing to step into: the trace is empty")
            return
        select = None
        origin = getattr(self.trace, "backward_origin", None)
        if st.direction == "backward" and origin is not None and origin.module is not None:
            bad = st.current.stats is not None and not st.current.stats.finite
            if bad:
                try:
                    call = self.trace.call(origin.module, 0)
                    select = (origin.file, origin.line, origin.op)
                except KeyError:
                    pass
        self.app.push_screen(OpsScreen(self, call.module, call.call_index, select=select))

    def action_edit(self) -> None:
        """Open the edit form for the selected call's module (:mod:`tui.screens.edit_form`)."""
        from tui.screens.edit_diff import open_edit_form

        open_edit_form(self, self.trace, self.stepper.module)

    # -- other views ----------------------------------------------------------------------------
    def action_memory(self) -> None:
        """Open the memory view of this step (:mod:`tui.screens.memory`)."""
        from tui.screens.memory import MemoryScreen

        self.app.push_screen(MemoryScreen(self))

    def action_lens(self) -> None:
        """Open the logit lens of this step's batch (:mod:`tui.screens.lens`)."""
        from tui.screens.lens import LensScreen

        self.app.push_screen(LensScreen(self))

    def make_view(self, view: str):
        """The screen for ``view`` (``router``, ``attention``, ``gradients``, ``doctor``)."""
        if view == "router":
            from tui.screens.router import RouterScreen

            return RouterScreen(self)
        if view == "attention":
            from tui.screens.attention import AttentionScreen

            return AttentionScreen(self)
        if view == "gradients":
            from tui.screens.gradients import GradientsScreen

            return GradientsScreen(self)
        if view == "doctor":
            from tui.screens.doctor_slot import doctor_screen

            return doctor_screen(self)
        raise ValueError(f"unknown view {view!r}")

    # -- messages -------------------------------------------------------------------------------
    def jump(self, module: str, call_index: int = 0) -> bool:
        """Select ``module``'s call (its first gradient when in the backward pass)."""
        ok = self.stepper.jump_module(module, call_index)
        self._moved(ok, f"{module or '<root>'} was not called in this pass")
        return ok

    @on(Tree.NodeSelected, "#tree")
    def on_tree_selected(self, event: Tree.NodeSelected) -> None:
        event.stop()
        self.jump(event.node.data or "")

    def on_jump_to_module(self, message: messages.JumpToModule) -> None:
        message.stop()
        while self.app.screen is not self:
            self.app.pop_screen()
        self.jump(message.module, message.call_index)
