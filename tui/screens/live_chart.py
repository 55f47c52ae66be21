"""``LineChart``: a small braille line chart whose redraw costs about a millisecond.

Why not plotext (``textual-plotext``, no longer a dependency): one plotext build of the loss
chart at 80×24 takes ~8-20 ms of pure Python, and the live screen has six charts. A trainer
in a thread of the same process loses every millisecond the UI holds the GIL; measured
with ``benchmarks/bench_overfit_ui.py``, plotext charts at 2 redraws/s cost ~40 % of the
training throughput on a 2-core machine. This widget draws only what the live screen needs:

* each terminal cell is a 2×4 grid of braille dots (U+2800 + dot bits), so a W×H chart has
  2W×4H points of resolution; consecutive points are joined with Bresenham's line algorithm;
* several series, one Rich style each (a cell shows the style of the last series drawn in it),
  and optionally one marker character each, drawn on the line every few columns and at its
  end and repeated in the legend, so the lines stay apart without colour (``NO_COLOR``, a
  monochrome terminal, a text capture);
* flagged points (a loss spike): a bold ``!`` at the top of the line in the flagged step's
  column, and ``! spike`` in the legend;
* linear or log10 y axis, three y labels (top, middle, bottom), first and last x values below;
* a title row carrying the legend (series names in their colours).

Rendering is O(points + cells); the live screen feeds at most a few hundred points per series
(:class:`tui.screens.live_data.Downsampler`), so the cost stays flat over a long run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

_BRAILLE = 0x2800
# Dot bit of (row 0-3, column 0-1) inside one braille cell (Unicode braille patterns).
_DOT = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))


@lru_cache(maxsize=64)
def _style(name: str) -> Style:
    return Style.parse(name)


@dataclass
class Series:
    """One line of a chart.

    Attributes:
        name: Legend label.
        xs: X values (steps), increasing.
        ys: Y values, same length as ``xs``.
        style: Rich style of the line and its legend label.
        marker: One character drawn on the line (every ``mark_every`` columns and at its last
            point) and before its legend label; ``""``: none.
        flags: X values (steps) to flag with :data:`FLAG` at the top of the line in their
            column (a loss spike's peak).
        lows: The smallest value behind each point (a bucket of steps), same length as
            ``xs``, or empty; with ``highs``, each point is drawn as the vertical range
            ``lows[i]``..``highs[i]`` in its column, so a spike inside a bucket stays as tall
            as it was (:meth:`tui.screens.live_data.Downsampler.ranges`).
        highs: The largest value behind each point, or empty.
    """

    name: str
    xs: Sequence[float]
    ys: Sequence[float]
    style: str = ""
    marker: str = ""
    flags: Sequence[float] = ()
    lows: Sequence[float] = ()
    highs: Sequence[float] = ()


#: The character and style of a flagged point, and its legend entry.
FLAG = "!"
FLAG_STYLE = "bold red"
FLAG_LEGEND = "! spike"


def _label(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e")
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def _line(x0: int, y0: int, x1: int, y1: int):
    """Integer points of the segment (x0, y0)-(x1, y1), Bresenham's algorithm."""
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx = 1 if x0 < x1 else -1
    sy = 1 if y0 < y1 else -1
    err = dx + dy
    while True:
        yield x0, y0
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


Run = tuple[str, str]  # (text, Rich style)


def _legend_row(series: Sequence[Series], title: str) -> list[Run]:
    """The first row: the title, then each series' marker and name in its style, then the
    flag legend when any series has flags."""
    head: list[Run] = [(title, "bold")]
    for s in series:
        head.append(("  ", ""))
        label = f"{s.marker} {s.name}" if s.marker and s.name and s.marker != s.name else (
            s.name or s.marker)
        head.append((label, s.style))
    if any(s.flags for s in series):
        head += [("  ", ""), (FLAG_LEGEND, FLAG_STYLE)]
    return head


def _plot_points(series: Sequence[Series], log: bool
                 ) -> list[list[tuple[float, float, float, float]]]:
    """Each series' drawable points ``(x, y, y_low, y_high)``, y on the axis' scale (log10 if
    ``log``; ``y_low``/``y_high`` the range behind the point, ``y`` itself without one);
    non-finite y, and y ≤ 0 on a log axis, are skipped."""
    def ok(v) -> bool:
        return v is not None and math.isfinite(v) and (v > 0 or not log)

    def ty(v: float) -> float:
        return math.log10(v) if log else v

    pts = []
    for s in series:
        ranged = len(s.lows) == len(s.xs) == len(s.highs)
        clean = []
        for i, (x, y) in enumerate(zip(s.xs, s.ys, strict=False)):
            if not ok(y):
                continue
            t = ty(y)
            lo, hi = (s.lows[i], s.highs[i]) if ranged else (y, y)
            clean.append((x, t, ty(lo) if ok(lo) else t, ty(hi) if ok(hi) else t))
        pts.append(clean)
    return pts


def _draw_series(series: Sequence[Series], pts: list[list[tuple[float, float, float, float]]],
                 x0: float, y1: float, sx: float, sy: float, pw: int, ph: int,
                 mark_every: int) -> tuple[list[list[int]], list[list[str]],
                                           dict[tuple[int, int], tuple[str, str]]]:
    """Draw each series' line into a ``pw`` × ``ph`` braille grid (2 × 4 dots a cell).
    Returns the dot bits and style of each cell, and the markers and flags by (row, column)
    (flags drawn over the markers)."""
    bits = [[0] * pw for _ in range(ph)]
    styles: list[list[str]] = [[""] * pw for _ in range(ph)]
    marks: dict[tuple[int, int], tuple[str, str]] = {}
    flagged: dict[tuple[int, int], tuple[str, str]] = {}  # drawn over the markers
    n_marked = sum(1 for s in series if s.marker)
    k_marked = 0
    for s, ps in zip(series, pts, strict=True):
        prev = None
        cells: dict[int, int] = {}  # column -> row of this line's last dot there
        tops: dict[int, int] = {}  # column -> the highest row of this line there
        for x, y, ylo, yhi in ps:
            cx = int(round((x - x0) * sx))
            cy = int(round((y1 - y) * sy))
            seg: list[tuple[int, int]] = []
            if ylo != y or yhi != y:  # the bucket's min-max range, in its column
                seg += _line(cx, int(round((y1 - yhi) * sy)), cx, int(round((y1 - ylo) * sy)))
            seg += _line(prev[0], prev[1], cx, cy) if prev is not None else [(cx, cy)]
            for px, py in seg:
                r, c = py >> 2, px >> 1
                bits[r][c] |= _DOT[py & 3][px & 1]
                styles[r][c] = s.style
                cells[c] = r
                if r < tops.get(c, ph):
                    tops[c] = r
            prev = (cx, cy)
        for fx in s.flags:
            c = int(round((fx - x0) * sx)) >> 1
            if c in tops:
                flagged[(tops[c], c)] = (FLAG, FLAG_STYLE)
        if s.marker and cells:
            first, last = min(cells), max(cells)
            cols = {last}
            if mark_every > 0:
                offset = k_marked * max(1, mark_every // max(1, n_marked))
                cols.update(range(first + offset, last - 1, mark_every))
            k_marked += 1
            for c in cols:
                if c in cells:
                    marks[(cells[c], c)] = (s.marker, s.style)
    marks.update(flagged)
    return bits, styles, marks


def _grid_rows(bits: list[list[int]], styles: list[list[str]],
               marks: dict[tuple[int, int], tuple[str, str]], labels: list[str],
               gutter: int, pw: int, ph: int) -> list[list[Run]]:
    """The plot rows: the y-axis gutter (top, middle and bottom labels), then the braille
    cells and markers, merged into runs of one style."""
    rows: list[list[Run]] = []
    label_rows = {0: labels[0], ph - 1: labels[2]}
    if ph >= 3:
        label_rows[(ph - 1) // 2] = labels[1]
    for r in range(ph):
        row: list[Run] = [(label_rows.get(r, "").rjust(gutter - 1) + "┤", "dim")]
        run_style, run = None, []
        brow, srow = bits[r], styles[r]
        for c in range(pw):
            b = brow[c]
            mark = marks.get((r, c)) if marks else None
            st = mark[1] if mark else (srow[c] if b else "")
            if st != run_style and run:
                row.append(("".join(run), run_style or ""))
                run = []
            run_style = st
            run.append(mark[0] if mark else (chr(_BRAILLE + b) if b else " "))
        if run:
            row.append(("".join(run), run_style or ""))
        rows.append(row)
    return rows


def _x_axis_row(x0: float, x1: float, gutter: int, pw: int) -> list[Run]:
    """The x-axis row: the first and last x values with "step" centred between them."""
    left, right = _label(x0), _label(x1)
    mid = "step"
    space = pw - len(left) - len(right)
    if space >= len(mid) + 2:
        pad_l = (space - len(mid)) // 2
        axis = left + " " * pad_l + mid + " " * (space - len(mid) - pad_l) + right
    else:
        axis = left + " " * max(1, space) + right
    return [(" " * gutter + axis[:pw], "dim")]


def chart_rows(series: Sequence[Series], width: int, height: int, *, title: str = "",
               log: bool = False, x_axis: bool = True, empty: str = "no data yet",
               mark_every: int = 0) -> list[list[Run]]:
    """Draw ``series`` into a ``width`` × ``height`` cell block, as rows of styled runs.

    Args:
        series: The lines; points with non-finite y (or y ≤ 0 on a log axis) are skipped.
        width: Columns (cells).
        height: Rows (cells): one title row, the plot, and one x-axis row if ``x_axis``.
        title: Text before the legend in the first row.
        log: log10 y axis.
        x_axis: Draw the row with the first and last x values.
        empty: What the plot area says when no series has a point.
        mark_every: Columns between a series' markers (staggered between series so they do
            not cover each other); 0: a marker only at each line's last point.

    Returns:
        ``height`` rows, each a list of ``(text, style)`` runs (at most ``width`` cells wide).
    """
    width, height = max(1, width), max(1, height)
    rows: list[list[Run]] = [_legend_row(series, title)]
    rows_avail = height - 1 - (1 if x_axis else 0)
    if rows_avail < 1:
        return rows[:height]
    pts = _plot_points(series, log)
    allx = [p[0] for ps in pts for p in ps]
    ally = [v for ps in pts for p in ps for v in p[1:]]  # the ranges' ends: the extremes
    if not allx:
        for i in range(rows_avail):
            rows.append([(empty, "dim")] if i == rows_avail // 2 else [])
        if x_axis:
            rows.append([])
        return rows
    x0, x1 = min(allx), max(allx)
    y0, y1 = min(ally), max(ally)
    if y1 - y0 < 1e-12:
        pad = abs(y0) * 0.05 or (0.5 if log else 1.0)
        y0, y1 = y0 - pad, y1 + pad
    if x1 == x0:
        x1 = x0 + 1

    def untransform(v: float) -> float:
        return 10 ** v if log else v

    labels = [_label(untransform(y1)), _label(untransform((y0 + y1) / 2)), _label(untransform(y0))]
    gutter = max(len(s) for s in labels) + 1
    pw = max(1, width - gutter)
    ph = rows_avail
    dw, dh = 2 * pw, 4 * ph
    sx = (dw - 1) / (x1 - x0)
    sy = (dh - 1) / (y1 - y0)
    bits, styles, marks = _draw_series(series, pts, x0, y1, sx, sy, pw, ph, mark_every)
    rows += _grid_rows(bits, styles, marks, labels, gutter, pw, ph)
    if x_axis:
        rows.append(_x_axis_row(x0, x1, gutter, pw))
    return rows


class LineChart(Widget):
    """A widget drawing :func:`chart_rows` of the series last given to :meth:`plot`.

    Args:
        title: Chart title (first row, before the legend).
        x_axis: Show the x-axis row.
        log: Start with a log10 y axis.
        mark_every: Columns between the markers of a series (see :func:`chart_rows`).
    """

    DEFAULT_CSS = """
    LineChart {
        width: 1fr;
        height: 1fr;
    }
    """

    def __init__(self, title: str = "", *, x_axis: bool = True, log: bool = False,
                 mark_every: int = 0, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.chart_title = title
        self.x_axis = x_axis
        self.log_scale = log
        self.mark_every = mark_every
        self.series: list[Series] = []
        self.renders = 0  # chart computations (tests, benchmark)
        self._rows: list[list[Run]] | None = None
        self._rows_key: tuple[int, int] = (0, 0)
        self._base = Style()
        self._strips: dict[int, Strip] = {}

    @property
    def resolution(self) -> int:
        """Horizontal dots of the plot area (2 per column): more points than this are wasted."""
        return max(8, 2 * (self.size.width or 40))

    def plot(self, series: Sequence[Series], *, title: str | None = None,
             log: bool | None = None) -> None:
        """Replace the series (and optionally the title and scale) and repaint."""
        self.series = list(series)
        self._rows = None  # recomputed on the next paint
        if title is not None:
            self.chart_title = title
        if log is not None:
            self.log_scale = log
        self.refresh()

    def render_line(self, y: int) -> Strip:
        """One row of the chart (Textual's line API: no Rich layout pass)."""
        width, height = self.size
        if self._rows is None or self._rows_key != (width, height):
            self.renders += 1
            self._rows = chart_rows(self.series, width, height, title=self.chart_title,
                                    log=self.log_scale, x_axis=self.x_axis,
                                    mark_every=self.mark_every)
            self._rows_key = (width, height)
            self._base = self.rich_style  # costly (walks the ancestors): once per chart
            self._strips = {}
        strip = self._strips.get(y)
        if strip is None:
            base = self._base
            if y >= len(self._rows):
                strip = Strip.blank(width, base)
            else:
                segments = [Segment(text, base + _style(style) if style else base)
                            for text, style in self._rows[y] if text]
                strip = Strip(segments).adjust_cell_length(width, base)
            self._strips[y] = strip
        return strip
