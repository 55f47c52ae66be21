"""The evidence of one doctor check, opened with Enter on its row of the doctor view.

A finding (``fail``, ``warn``, ``error``) that names a module jumps to it in the step view; any
other row (``pass``, ``n/a``, ``skip``) opens this screen: the check's evidence, its hint, the
module it measured and every number it measured (``CheckResult.data``, as ``mdb doctor
--json`` gives it), scrollable. Enter opens the module in the step view when the check names
one; ``Esc``, ``s`` or ``q`` return to the doctor view.
"""

from __future__ import annotations

import json
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from hooks.text import printable


def _short(value: Any) -> Any:
    """``value`` with every float to 6 significant digits (``5.56515``, not 16 of them)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_short(v) for v in value]
    return value


def data_lines(data: Any, indent: str = "") -> list[str]:
    """``data`` (a check's JSON-serialisable measurements) as ``key: value`` lines: a dict
    nests by two spaces, a list or a number stays on its key's line (compact JSON), a float
    has 6 significant digits."""
    data = _short(data)
    if not isinstance(data, dict):
        return [indent + json.dumps(data, ensure_ascii=False, default=str)]
    lines = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            lines += data_lines(value, indent + "  ")
        else:
            text = value if isinstance(value, str) else json.dumps(
                value, ensure_ascii=False, separators=(", ", ": "), default=str)
            lines.append(f"{indent}{key}: {text}")
    return lines


def result_head(row: dict[str, Any], styles: dict[str, str], sep: str = "\n") -> Text:
    """A check's title and status, evidence, hint and module, parts joined by ``sep`` (the
    doctor view's detail line uses one newline, the evidence screen a blank line)."""
    text = Text()
    text.append(printable(f"{row.get('id', '')} {row.get('name', row.get('key', ''))}") + " · ",
                style="bold")
    text.append(printable(str(row["status"])), style=styles.get(row["status"], ""))
    text.append(sep + printable(str(row.get('evidence', ''))))  # may name a module: escaped
    if row.get("hint"):
        text.append(f"{sep}hint: ", style="bold")
        text.append(printable(str(row["hint"])))
    module = row.get("module")
    if module is not None:
        text.append(f"{sep}module: ", style="bold")
        text.append(printable(module or "<root>"))
    return text


def evidence_text(row: dict[str, Any], styles: dict[str, str]) -> Text:
    """The whole of a check's result: title and status, evidence, hint, module, data."""
    text = result_head(row, styles, "\n\n")
    if row.get("module") is not None:
        text.append("  (Enter opens it in the step view)", style="dim")
    data = row.get("data") or {}
    if data:
        text.append("\n\nmeasured", style="bold")
        for line in data_lines(data):
            text.append("\n" + printable(line))
    seconds = row.get("seconds")
    if isinstance(seconds, (int, float)):
        text.append(f"\n\n{seconds:.2f} s", style="dim")
    return text


class EvidenceScreen(ModalScreen[str | None]):
    """One check's result in full; dismissed with the module to open (Enter), or None.

    Args:
        row: the check's result as a dict (``CheckResult.to_dict()``).
        styles: the status styles of the doctor view.
    """

    BINDINGS = [
        Binding("enter", "open", "open module", key_display="Enter", priority=True,
                id="evidence.open", tooltip="open the module this check measured"),
        Binding("escape,s,q", "back", "back", key_display="Esc", id="evidence.back",
                tooltip="back to the doctor view"),
    ]

    DEFAULT_CSS = """
    EvidenceScreen { background: $background; }
    EvidenceScreen #evidence-scroll { height: 1fr; padding: 0 1; }
    """

    def __init__(self, row: dict[str, Any], styles: dict[str, str]) -> None:
        super().__init__()
        self.row = row
        self.status_styles = styles

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="evidence-scroll"):
            yield Static(evidence_text(self.row, self.status_styles), id="evidence", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#evidence-scroll").focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "open" and self.row.get("module") is None:
            return None  # shown dimmed: nothing to open
        return True

    def action_open(self) -> None:
        self.dismiss(self.row.get("module"))

    def action_back(self) -> None:
        self.dismiss(None)
