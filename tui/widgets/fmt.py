"""Number, shape and flag formatting shared by every view and by ``mdb summary``.

Statistics are shown in a compact scientific form (``1.23e-2``: three significant digits, no
``+`` and no leading zero in the exponent) so a column of them lines up and reads at a glance.
Every coloured verdict also carries a marker and a word (``✓ ok``, ``✗ NaN``), so it survives
``NO_COLOR`` and 16-colour terminals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.text import Text

#: Block characters, from empty to full, for one-row bars and histograms.
BLOCKS = " ▁▂▃▄▅▆▇█"
#: Shades for attention probabilities, from 0 to 1 (readable without colour).
SHADES = " ·░▒▓█"

#: Verdicts: marker+word, and the Rich style used beside them.
FLAG_STYLE = {
    "ok": "green",
    "vanishing": "yellow",
    "exploding": "bold red",
    "nan": "bold red",
    "none": "magenta",
    "frozen": "dim",
    "stale": "yellow",
    "zero": "yellow",
    "hot": "bold red",
    "dead": "bold red",
    "few": "cyan",
    "unused": "dim",
}
FLAG_TEXT = {
    "ok": "✓ ok",
    "vanishing": "▼ vanishing",
    "exploding": "▲ exploding",
    "nan": "✗ NaN/Inf",
    "none": "∅ None",
    "frozen": "- frozen",
    "stale": "∅ stale",
    "zero": "0 zero",
    "hot": "▲ hot",
    "dead": "✗ no tokens",
    "few": "◦ few tokens",
    "unused": "∅ not called",
}


def sci(x: float | int | None) -> str:
    """Compact scientific notation: ``1.23e-2``, ``-4.5e3`` → ``-4.50e3``; ``0``; ``—`` for None.

    Args:
        x: a number or None.

    Returns:
        str: at most 8 characters for finite values; ``nan``, ``inf``, ``-inf`` otherwise.
    """
    if x is None:
        return "—"
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant}e{int(exp)}"


def shape(dims: Sequence[int]) -> str:
    """A shape as Python prints a tuple: ``(2, 64, 256)``, ``(8,)``, ``()``."""
    dims = [int(d) for d in dims]
    if len(dims) == 1:
        return f"({dims[0]},)"
    return "(" + ", ".join(str(d) for d in dims) + ")"


def dims(d: Sequence[int]) -> str:
    """``2×64×256`` — a shape in the fewest characters (``()`` for a scalar)."""
    return "×".join(str(int(x)) for x in d) if len(d) else "()"


def middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` cells in the middle (``post_att…layernorm``): both ends of a
    name stay, where the end usually tells siblings apart (``…layernorm``, ``…[3]``)."""
    from rich.cells import cell_len, set_cell_size

    if cell_len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    tail = (width - 1) // 2
    head = width - 1 - tail
    start = set_cell_size(text, head)
    end = text[len(text) - tail:] if tail else ""
    while cell_len(end) > tail:
        end = end[1:]
    return start + "…" + end


def count(n: int) -> str:
    """A parameter count: ``19.8M``, ``113.1K``, ``512``."""
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f}B"
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1e3:.1f}K"
    return str(n)


def sequence(index: int, count: int) -> str:
    """``sequence 1/2``: batch row ``index`` (0-based, as ``--row`` and the code take it) of
    ``count``, counted from 1 as every view says it (the attention view, the lens)."""
    return f"sequence {index + 1}/{count}"


def pct(frac: float | None) -> str:
    """A fraction in [0, 1] as a percentage with one decimal (``12.5%``)."""
    return "—" if frac is None else f"{100 * frac:.1f}%"


def flag(kind: str) -> Text:
    """A verdict as styled text with its marker and word (see :data:`FLAG_TEXT`)."""
    return Text(FLAG_TEXT[kind], style=FLAG_STYLE[kind])


def bar(frac: float, width: int) -> str:
    """A horizontal bar of ``width`` cells filled to ``frac`` in [0, 1], eighth-cell steps."""
    frac = min(max(frac, 0.0), 1.0)
    eighths = round(frac * width * 8)
    full, rest = divmod(eighths, 8)
    partial = "" if rest == 0 else " ▏▎▍▌▋▊▉"[rest]
    return ("█" * full + partial).ljust(width)


def histogram(counts: Sequence[int], rows: int = 3) -> list[str]:
    """A vertical-bar histogram of ``counts`` as ``rows`` lines of block characters.

    Each count becomes one column; the tallest column fills all ``rows`` lines. A non-zero
    count always shows at least a one-eighth block, so an isolated value is never invisible.

    Returns:
        list[str]: ``rows`` strings of ``len(counts)`` characters, top line first.
    """
    top = max(counts) if counts else 0
    levels = rows * 8
    heights = [
        0 if c == 0 or top == 0 else max(1, round(c / top * levels)) for c in counts
    ]
    lines = []
    for r in range(rows - 1, -1, -1):
        lo = r * 8
        lines.append("".join(BLOCKS[min(max(h - lo, 0), 8)] for h in heights))
    return lines


def shade(p: float) -> str:
    """One cell shade for a probability ``p`` in [0, 1] (`` `` for 0, ``█`` for ≥ 0.8)."""
    if p <= 0.0:
        return SHADES[0]
    if p < 0.05:
        return SHADES[1]
    return SHADES[min(2 + int(p / 0.2), len(SHADES) - 1)]


def loss_line(meta: dict) -> str:
    """What was differentiated and its value, from a trace's meta: ``loss = out.loss = 6.94
    (ce 6.90 + aux 0.0459)``, ``loss = out[1] = 4.82``, or ``no loss: mean(out.logits) =
    -0.0087`` when the model computed none; ``""`` without a loss."""
    loss = meta.get("loss")
    if loss is None:
        return ""

    def num(v) -> str:
        return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)

    source = meta.get("loss_source")
    if meta.get("loss_fallback"):
        return f"no loss: {source} = {num(loss)}"
    text = f"loss = {source} = {num(loss)}" if source else f"loss {num(loss)}"
    if "ce_loss" in meta and "aux_loss" in meta:
        text += f" (ce {num(meta['ce_loss'])} + aux {num(meta['aux_loss'])})"
    return text
