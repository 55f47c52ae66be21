"""Number, shape and bar formatting (tui.widgets.fmt) against hand-written expectations."""

from __future__ import annotations

import math

import pytest

from hooks.doctor.verdicts import param_verdict
from tui.widgets import fmt


@pytest.mark.parametrize(
    "x, want",
    [(0.0123456, "1.23e-2"), (-4500.0, "-4.50e3"), (1.0, "1.00e0"), (0.0, "0"), (None, "—"),
     (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), (9.999e-5, "1.00e-4")],
)
def test_sci(x, want):
    assert fmt.sci(x) == want
    if x is not None and math.isfinite(x) and x != 0:
        assert float(want) == pytest.approx(x, rel=5e-3)


def test_shape_like_python_tuples():
    for dims in ([2, 64, 256], [8], []):
        assert fmt.shape(dims) == str(tuple(dims))


def test_histogram_heights_and_nonzero_visibility():
    lines = fmt.histogram([0, 1, 24, 12], rows=3)
    assert len(lines) == 3 and all(len(line) == 4 for line in lines)
    column = ["".join(line[i] for line in lines) for i in range(4)]
    assert column[0] == "   "            # zero count: nothing
    assert column[1] == "  ▁"            # tiny but non-zero: at least 1/8 block
    assert column[2] == "███"            # the maximum fills every row
    assert column[3] == " ▄█"            # half of 24 levels = 12 eighths: 1½ rows


def test_bar_and_shade():
    assert fmt.bar(1.0, 4) == "████"
    assert fmt.bar(0.0, 4) == "    "
    assert fmt.bar(0.5, 3) == "█▌ "
    assert [fmt.shade(p) for p in (0.0, 0.01, 0.1, 0.3, 0.5, 0.9)] == list(" ·░▒▓█")


class _P:
    def __init__(self, status="ok", grad_norm=1e-2, ratio=1e-3, nan_count=0, inf_count=0):
        self.status, self.grad_norm, self.ratio = status, grad_norm, ratio
        self.nan_count, self.inf_count = nan_count, inf_count


@pytest.mark.parametrize(
    "p, want",
    [(_P(), "ok"), (_P(grad_norm=1e-9, ratio=1e-9), "vanishing"), (_P(ratio=1e-7), "vanishing"),
     (_P(grad_norm=500.0), "exploding"), (_P(ratio=50.0), "exploding"),
     (_P(nan_count=3), "nan"), (_P(grad_norm=math.inf), "nan"),
     (_P(status="none", grad_norm=None, ratio=None), "none"), (_P(status="frozen"), "frozen")],
)
def test_param_verdicts(p, want):
    assert param_verdict(p) == want
    assert fmt.FLAG_TEXT[want].split()[-1]  # every verdict has a word, not only a colour
