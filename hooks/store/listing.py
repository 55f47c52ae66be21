"""Lists of run names in one-line messages: a few of them, and how many there are in all.

Never imports textual, rich or tui.
"""

from __future__ import annotations

from collections.abc import Sequence


def latest_names(names: Sequence[str], shown: int = 5, noun: str = "runs") -> str:
    """The last ``shown`` of ``names`` (oldest first, so the latest ones), joined by ", ":
    ``"runs: a, b, c"`` when that is all of them, else ``"the latest 5 of 6 runs: b, c, d, e,
    f, …"``; ``"the database has no runs"`` when there are none."""
    if not names:
        return f"the database has no {noun}"
    if len(names) <= shown:
        return f"{noun}: {', '.join(names)}"
    return f"the latest {shown} of {len(names)} {noun}: {', '.join(names[-shown:])}, …"
