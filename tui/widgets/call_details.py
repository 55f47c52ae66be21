"""``CallDetails``: everything known about the current call, as one scrollable pane.

Sections, top to bottom: the call (module, class, call number); its input and output tensors
(shape, dtype); the statistics of every output (in the backward pass, of the output beside its
gradient); the module's own parameters with their gradient norms, ``‖g‖/‖w‖`` ratios and
verdicts (when it has any); a histogram of the values; the statistics of every input; notes on
what could not be captured. A statistics table holds as many tensors side by side as the pane's
width does, then goes on below. ``J``/``K`` in the step view scroll the pane.
"""

from __future__ import annotations

import math

from rich.cells import cell_len
from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.selection import Selection
from textual.strip import Strip
from textual.visual import Visual, visualize

from hooks.text import printable
from tui.widgets import fmt
from tui.widgets.module_tree import main_output

#: Rows of the statistics table: label, TensorStats attribute.
STAT_ROWS = (
    ("mean", "mean"),
    ("std", "std"),
    ("min", "min"),
    ("max", "max"),
    ("|x| max", "abs_max"),
    ("l2", "l2"),
)
#: Tensors side by side in one statistics table when the pane's width is not known.
MAX_STAT_COLUMNS = 3
#: Width of a statistics table's label column and of each tensor's column.
LABEL_WIDTH, STAT_WIDTH = 9, 12


def _pad(text: str, width: int, right: bool = False) -> str:
    if cell_len(text) > width:
        text = text[: max(width - 1, 0)] + "…"
    gap = " " * max(width - cell_len(text), 0)
    return gap + text if right else text + gap


def _stat_values(stats) -> list[tuple[str, str]]:
    """(text, style) per row of :data:`STAT_ROWS` plus zeros and nan/inf."""
    if stats is None:
        return [("—", "")] * (len(STAT_ROWS) + 2)
    cells = [(fmt.sci(getattr(stats, attr)), "") for _, attr in STAT_ROWS]
    # a large tensor whose sample held no zero was not counted
    # (hooks.tensors.stats.ZERO_EXACT_NUMEL)
    cells.append((fmt.pct(stats.zero_frac) if stats.zero_exact else "≈0%", ""))
    bad = stats.nan_count + stats.inf_count
    cells.append((f"✗ {stats.nan_count}/{stats.inf_count}", "bold red") if bad
                 else ("✓ 0/0", "green"))
    return cells


def stats_table(columns: list[tuple[str, object]], col_width: int = STAT_WIDTH) -> Text:
    """A transposed statistics table: one row per statistic, one column per tensor.

    Plain text with fixed-width columns (rendering a Rich ``Table`` on every key press costs
    several times more): ``LABEL_WIDTH + len(columns) * col_width`` cells a line.

    Args:
        columns: ``(heading, TensorStats | None)`` pairs (``None``: shown as ``—``).
        col_width: width of each value column.
    """
    out = Text()
    out.append(_pad("stat", LABEL_WIDTH), style="dim")
    for heading, _ in columns:  # one cell apart, a long path cut in the middle
        out.append(" " + _pad(fmt.middle(heading, col_width - 1), col_width - 1, right=True),
                   style="bold")
    labels = [label for label, _ in STAT_ROWS] + ["zeros", "nan/inf"]
    cols = [_stat_values(stats) for _, stats in columns]
    for i, label in enumerate(labels):
        out.append("\n")
        out.append(_pad(label, LABEL_WIDTH), style="dim")
        for c in cols:
            text, style = c[i]
            out.append(_pad(text, col_width, right=True), style=style)
    return out


def stats_tables(columns: list[tuple[str, object]], width: int | None = None) -> Text:
    """Every one of ``columns`` (``(heading, TensorStats | None)``) in :func:`stats_table`
    blocks, one below the other, each holding as many tensors side by side as ``width`` cells
    do (at least one; :data:`MAX_STAT_COLUMNS` when ``width`` is None): none is left out.
    Within ``width`` the columns are as wide as the longest heading needs (at least
    :data:`STAT_WIDTH`), so that two tensors' headings are not cut to the same text (layer 0's
    and layer 10's ``past_key_values[..][0]``)."""
    if width is None:
        per, col = MAX_STAT_COLUMNS, STAT_WIDTH
    else:
        longest = max((len(heading) for heading, _ in columns), default=0)
        col = max(STAT_WIDTH, min(longest + 1, width - LABEL_WIDTH))
        per = max((width - LABEL_WIDTH) // col, 1)
    return Text("\n").join(stats_table(columns[i:i + per], col)
                           for i in range(0, len(columns), per))


def histogram_block(title: str, stats) -> Text:
    """Three rows of block characters over ``stats.hist`` with its value range underneath."""
    if stats is None or not stats.hist or sum(stats.hist) == 0:
        return Text(f"{title}: no histogram", style="dim")
    lines = fmt.histogram(stats.hist, rows=3)
    width = len(lines[0])
    lo, hi = fmt.sci(stats.hist_min), fmt.sci(stats.hist_max)
    axis = lo + " " * max(1, width - len(lo) - len(hi)) + hi
    out = Text(title, style="bold")
    out.append("\n" + "\n".join(lines), style="cyan")
    out.append("\n" + axis, style="dim")
    return out


def params_table(params, rows: int | None = None, batch_rows: int | None = None,
                 width: int | None = None) -> Text:
    """The module's own parameters: name, shape, gradient norm, ‖g‖/‖w‖, verdict
    (:func:`hooks.doctor.verdicts.param_verdict`, knowing the ``rows`` of ``batch_rows`` that
    reached the module). Within ``width`` cells (a pane of the A|B view at 80 columns) the
    shape column goes first, then the verdict keeps its marker only (``✓``, ``▼``): a line
    never wraps, the numbers are never cut."""
    from hooks.doctor.verdicts import param_verdict

    verdicts = [fmt.flag(param_verdict(p, rows, batch_rows)) for p in params]
    flag_w = 1 + max((v.cell_len for v in verdicts), default=0)
    name_w, shape_w, short = 10, 12, False
    if width is not None and name_w + shape_w + 18 + flag_w > width:
        shape_w = 0
        if name_w + 18 + flag_w > width:
            short = True
            name_w = max(6, min(name_w, width - 18 - 2))
    out = Text()
    out.append(_pad("param", name_w) + (_pad("shape", shape_w) if shape_w else "")
               + _pad("‖g‖", 9, True) + _pad("‖g‖/‖w‖", 9, True), style="dim")
    for p, verdict in zip(params, verdicts, strict=True):
        name = printable(p.name.rsplit(".", 1)[-1])
        out.append("\n" + _pad(name, name_w)
                   + (_pad(fmt.shape(p.shape), shape_w) if shape_w else "")
                   + _pad(fmt.sci(p.grad_norm), 9, True) + _pad(fmt.sci(p.ratio), 9, True) + " ")
        out.append_text(verdict[:1] if short else verdict)
    return out


def io_table(call, width: int | None = None) -> Text:
    """``in``/``out`` rows: tensor path (``kwargs.`` dropped: the keyword is the name), shape,
    dtype. The path column is as wide as the longest path, up to 26 cells, and within
    ``width`` (the pane's) leaves room for the shape and dtype; a longer path is cut in the
    middle (``past_ke…ers[0].keys``), a shape or dtype never."""
    out = Text()
    rows = [("in", t) for t in call.inputs] + [("out", t) for t in call.outputs]
    if not rows:
        return Text("no tensors", style="dim")
    paths = [printable(t.path.removeprefix("kwargs.")) for _, t in rows]
    shapes = [fmt.dims(t.shape) for _, t in rows]
    shape_w = max(max(cell_len(x) for x in shapes), 5)
    dtypes = [printable(t.dtype) for _, t in rows]
    dtype_w = max(cell_len(d) for d in dtypes)
    path_w = min(max(cell_len(p) for p in paths), 26)
    if width is not None:
        path_w = max(min(path_w, width - 4 - 1 - shape_w - 1 - dtype_w), 8)
    for i, ((kind, _), path, shape, dtype) in enumerate(zip(rows, paths, shapes, dtypes,
                                                             strict=True)):
        if i:
            out.append("\n")
        out.append(_pad(kind, 4), style="dim")
        out.append(_pad(fmt.middle(path, path_w), path_w) + " " + _pad(shape, shape_w) + " ")
        out.append(dtype, style="dim")
    return out


def _rows_by_module(trace):
    from hooks.doctor.verdicts import rows_by_module

    return rows_by_module(trace)


def job_wide_line(tensors: list[tuple[str, list[int], object]]) -> Text | None:
    """A line for statistics taken over more values than the shape shown holds: in a sharded
    job (FSDP2, tensor parallel) an activation's statistics are those of the whole job's tensor
    (every rank's batch), while its shape is this rank's. ``tensors``: (label, shape,
    TensorStats | None); ``None`` when every count matches its shape."""
    wide = []
    for label, shape, st in tensors:
        n = math.prod(shape)
        if st is not None and st.numel != n:
            wide.append(f"{label} {st.numel:,} values (this rank's "
                        f"{fmt.dims(shape)}: {n:,})")
    if not wide:
        return None
    return Text("statistics of the whole job's tensor, every rank's piece: " + "; ".join(wide),
                style="dim")


def _hist_title(label: str, shape: list[int], st) -> str:
    """A histogram's title: ``label`` and the shape; in a sharded job, where the statistics
    cover the whole job's tensor and the shape is this rank's, the number of values too."""
    n = math.prod(shape)
    if st is not None and st.numel != n:
        return f"{label} · whole job, {st.numel:,} values (this rank's {fmt.dims(shape)})"
    return f"{label} {fmt.shape(shape)}"


def tensor_stats(tensors, prefix: str, notes, width: int | None = None) -> list[Text]:
    """The statistics of every one of ``tensors`` (a call's outputs or inputs, each headed by
    its path without ``prefix``) in :func:`stats_tables` within ``width``, and the job-wide
    line where it applies; a tensor without statistics shows ``—``; one dim line when none of
    them has any (``notes``: the call's, pointed to) or there are no tensors."""
    what = "outputs" if prefix == "out." else "inputs"
    if not any(t.stats is not None for t in tensors):
        why = " (see the notes below)" if notes else ""
        return [Text(f"statistics not recorded{why}" if tensors else f"no tensor {what}",
                     style="dim")]
    labels = [printable(t.path.removeprefix(prefix)) for t in tensors]
    parts = [stats_tables([(label, t.stats) for label, t in zip(labels, tensors, strict=True)],
                          width)]
    wide = job_wide_line([(label, t.shape, t.stats)
                          for label, t in zip(labels, tensors, strict=True)])
    if wide is not None:
        parts.append(wide)
    return parts


def section(title: str) -> Text:
    return Text(f"── {title} ", style="bold")


class CallDetails(ScrollView, can_focus=True):
    """The details pane of the step view; :meth:`show` redraws it for the stepper's position.

    A Line API widget (:class:`textual.scroll_view.ScrollView`): it renders its own lines and
    keeps its size whatever their number, so a key press repaints the pane without a layout
    pass (a pane sized by its content took a second layout, and a second frame, whenever the
    new record had another number of lines). Its vertical scroll bar is always shown (empty
    when everything fits; ``overflow-y: scroll`` in ``app.tcss``): a bar appearing or going
    would cost a reflow.
    """

    #: Rendered records kept per pane (a key press back to one of them skips rendering it).
    CACHE_SIZE = 256

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stepper = None
        self._shown: tuple | None = None
        self._rendered: dict[tuple, Text] = {}  # of _rendered_trace's records
        self._rendered_trace = None
        self._strips: list[Strip] | None = None  # self.text rendered at self._strips_width
        self._strips_width = 0
        #: what the pane shows (a Rich ``Text``; tests read it)
        self.text: Text = Text()

    def show(self, stepper) -> None:
        """Render the details of ``stepper``'s current record (a call, or a gradient).

        What is on show already is not drawn again, and a record drawn before at this width is
        taken from a per-pane cache (a trace does not change once captured)."""
        self._stepper = stepper
        width = self.scrollable_content_region.width
        width = width if width > 0 else None
        if stepper.trace is not self._rendered_trace:  # another trace: nothing cached holds
            self._rendered_trace, self._shown = stepper.trace, None
            self._rendered.clear()
        key = (stepper.direction, stepper.index, width)
        if key == self._shown:
            return
        text = self._rendered.get(key)
        if text is None:
            if len(self._rendered) >= self.CACHE_SIZE:
                self._rendered.clear()
            text = self._rendered[key] = self.render_details(stepper, width)
        self._shown = key
        self.update(text)

    def update(self, text: Text) -> None:
        """Show ``text`` (wrapped to the pane's width); repaints the pane, and lays it out
        again only when its vertical scroll bar appears or goes."""
        self.text = text
        self._strips = None
        if self.scrollable_content_region.width <= 0:  # not laid out yet: drawn on resize
            return
        lines = self._render_strips()
        size = Size(self._strips_width, len(lines))
        if size != self.virtual_size:
            scroll_update = getattr(self, "_scroll_update", None)  # Textual 8.x
            if scroll_update is None:
                self.virtual_size = size  # a layout pass, as Textual does it
            else:
                # set without Textual's layout pass (the pane's own size does not change):
                # only the scroll bar follows the new height
                self.set_reactive(CallDetails.virtual_size, size)
                scroll_update(size)
        self.refresh()

    def _render_strips(self) -> list[Strip]:
        width = max(self.scrollable_content_region.width, 1)
        if self._strips is None or self._strips_width != width:
            self._strips_width = width
            self._strips = Visual.to_strips(self, visualize(self, self.text), width, None,
                                            self.visual_style, apply_selection=False)
        return self._strips

    def render_line(self, y: int) -> Strip:
        """Line ``y`` of the pane (scrolled), as a Line API widget draws it."""
        lines = self._render_strips()
        y += self.scroll_offset.y
        width = self._strips_width
        if y >= len(lines):
            return Strip.blank(width, self.visual_style.rich_style)
        if self.text_selection is not None:  # drawn with the selection, not cached
            lines = Visual.to_strips(self, visualize(self, self.text), width, None,
                                     self.visual_style)
        return lines[y].crop_extend(0, width, self.visual_style.rich_style).apply_offsets(0, y)

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        """The selected part of the pane's text (mouse selection and copy)."""
        return selection.extract(self.text.plain), "\n"

    def selection_updated(self, selection: Selection | None) -> None:
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._strips = None  # drawn in the old style (focus tint)

    def on_resize(self) -> None:
        if self._stepper is not None:  # redrawn only when the width changed (see show)
            self.show(self._stepper)

    @staticmethod
    def render_details(stepper, width: int | None = None) -> Text:
        """Build the renderable (kept separate so tests can inspect it); ``width``: the cells
        the pane has for a line (the input/output paths fit it)."""
        call = stepper.call
        if call is None:
            return Text("nothing recorded", style="dim")
        parts: list = []
        title = Text(printable(call.module or "<root>"), style="bold")
        title.append(f"  {printable(call.module_type)} #{call.call_index}", style="dim")
        parts.append(title)

        parts.append(io_table(call, width))

        grads = stepper.grads_of(call)
        hist = None
        if stepper.direction == "backward":
            g = stepper.current
            out = call.output(g.output)
            output = printable(g.output)
            parts.append(section(f"statistics · {output} and its gradient"))
            parts.append(stats_table([("value", out.stats if out else None), ("∇ grad", g.stats)]))
            wide = job_wide_line(([("value", out.shape, out.stats)] if out else [])
                                 + [("∇ grad", g.shape, g.stats)])
            if wide is not None:
                parts.append(wide)
            hist = histogram_block(_hist_title(f"∇ gradient of {output}", g.shape, g.stats),
                                   g.stats)
        else:
            parts.append(section("statistics of the outputs"))
            # under "statistics of the outputs" the common "out." goes: loss, logits
            parts.extend(tensor_stats(call.outputs, "out.", call.notes, width))
            recorded = [t for t in call.outputs if t.stats is not None]
            if recorded:
                main = main_output(recorded)
                hist = histogram_block(_hist_title(f"values of {printable(main.path)}", main.shape,
                                                   main.stats), main.stats)
            if grads:
                parts.append(Text(f"{len(grads)} gradient(s) recorded · b shows backward",
                                  style="dim"))
            else:
                parts.append(Text("no gradient recorded for this call", style="dim"))

        # the parameters before the histogram: a 24-line terminal shows them without scrolling
        params = stepper.params_of(call.module)
        if params:
            rows, batch_rows = (stepper.rows_by_module() if hasattr(stepper, "rows_by_module")
                                else _rows_by_module(stepper.trace))
            parts.append(section("parameters"))
            parts.append(params_table(params, rows.get(call.module), batch_rows, width))
        if hist is not None:
            parts.append(hist)
        if call.inputs and stepper.direction != "backward":
            parts.append(section("statistics of the inputs"))
            parts.extend(tensor_stats(call.inputs, "kwargs.", call.notes, width))
        # the capture's notes about this module's parameters (a sharded weight's NaN: which
        # rank's shard holds it)
        shard = [n.message for n in getattr(stepper.trace, "notes", ())
                 if n.kind == "nonfinite_shard" and n.module == call.module]
        if call.notes or shard:
            parts.append(section("notes"))
            parts.extend(Text(printable(f"• {n}"), style="yellow") for n in [*call.notes, *shard])
        return Text("\n").join(parts)
