"""What ``mdb compare`` shows about each run, and its table, without Textual.

The compare screen and the printed table (``mdb compare --table``, ``mdb ablate --headless``)
share this module, so both show the same numbers:

* :class:`RunView` — one run on the screen: its stored row, a :class:`RunSeries` fed from the
  run store, a colour and a marker that stay with it while it is shown, and its architecture
  numbers (:func:`minillm.arch.arch_numbers`) when its config is a minillm config — else
  ``None`` and the reason, never a guess.
* :func:`compare_rows` — the table: the config fields in which the runs differ, then per run
  parameters, attention parameters per layer, KV-cache bytes per token, the last and the best
  value of its loss (:func:`hooks.store.numbers.loss_metric`: ``total`` for minillm, as in
  ``mdb runs`` and ``mdb watch``), the last ``ce`` when a run's loss is another metric (a MoE
  model's ``total`` adds the load-balancing loss), held-out ``ce@N``, steps/s
  (:class:`hooks.store.rates.StepRate`), step and status.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hooks.store.numbers import HELD_OUT, loss_metric
from hooks.text import printable
from tui.screens.live_data import RunSeries

#: (Rich style, marker) of the runs, by slot; a run keeps its slot while it is shown.
RUN_STYLES: tuple[tuple[str, str], ...] = (
    ("cyan", "●"), ("yellow", "▲"), ("magenta", "■"), ("green", "◆"),
    ("red", "▼"), ("blue", "✚"), ("bright_white", "★"), ("bright_red", "○"),
)  # fmt: skip
#: Most runs one screen compares (one slot each).
MAX_RUNS = len(RUN_STYLES)
#: Config keys that are not settings to compare (the run's own bookkeeping, long text).
_SKIP_KEYS = {"text", "metrics", "loss_metrics", "moe", "top_k", "workload", "model_config",
              "resolved_model_config", "model_state", "batch", "loss_source", "model_path",
              "model_sha256", "model_files", "model_mac"}


def minillm_config_of(run: Any) -> tuple[Any, str]:
    """``(MiniLLMConfig, "")`` of a stored run whose model is minillm, else ``(None, why)``.

    Only ``mdb overfit`` / ``mdb ablate`` runs of minillm store the config their model was built
    from (``resolved_model_config``); a ``--model`` run trains the user's module and a
    ``hooks.run`` loop stores the user's own config, so nothing is read from those.
    """
    from minillm import MiniLLMConfig

    cfg = run.config if isinstance(run.config, Mapping) else {}
    if getattr(run, "kind", "overfit") != "overfit":
        return None, "a hooks.run loop: its config is the user's, not a minillm config"
    if cfg.get("workload") == "model" or "model_path" in cfg:
        return None, f"--model {cfg.get('model', '?')}: not a minillm model"
    resolved = cfg.get("resolved_model_config")
    if not isinstance(resolved, Mapping) or not resolved:
        return None, "no minillm config stored with the run"
    try:
        return MiniLLMConfig.from_dict(dict(resolved)), ""
    except (ValueError, TypeError) as exc:
        return None, f"its stored minillm config is not valid: {str(exc).splitlines()[0]}"


def _flat(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        if prefix == "rope_scaling":
            kind = value.get("rope_type", value.get("type", "?"))
            out[prefix] = f"{kind}×{value.get('factor', '?'):g}" if isinstance(
                value.get("factor"), (int, float)) else str(kind)
            return
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
        return
    if isinstance(value, float):
        out[prefix] = f"{value:g}"
    elif value is None:
        out[prefix] = "none" if prefix == "rope_scaling" else "—"
    else:
        out[prefix] = str(value)


def config_fields(run: Any) -> dict[str, str]:
    """A run's settings as ``{name: text}``: a minillm run's model config fields and training
    options (``steps``, ``lr``, ``seq_len`` …), another run's config flattened (``a.b``)."""
    cfg = run.config if isinstance(run.config, Mapping) else {}
    out: dict[str, str] = {}
    resolved = cfg.get("resolved_model_config")
    if getattr(run, "kind", "overfit") == "overfit" and isinstance(resolved, Mapping):
        _flat("", {k: v for k, v in resolved.items()}, out)
    for k, v in cfg.items():
        if k in _SKIP_KEYS or (getattr(run, "kind", "overfit") == "overfit" and k in out):
            continue
        _flat(k, v, out)
    return out


def run_loss_metric(names: Sequence[str]) -> str | None:
    """The loss a run is compared by: :func:`hooks.store.numbers.loss_metric`, the run's loss
    in every view (``total``, ``loss``, a name with ``loss``, ``ce``, another loss-like name,
    never a held-out ``ce@N``); ``None`` when the run logs none."""
    return loss_metric(names)


@dataclass
class RunView:
    """One run on the compare screen.

    Attributes:
        name: The run's name.
        slot: Index into :data:`RUN_STYLES` (its colour and marker).
        info: The stored :class:`hooks.store.store.RunInfo` (``None`` until the run exists:
            an ablation's queued variant).
        series: The run's metrics (:class:`tui.screens.live_data.RunSeries`).
        cursor: The last step read from the store.
        arch: Its :class:`minillm.arch.ArchNumbers`, or ``None``; ``arch_why`` says why.
        external: A status from outside the store (``mdb ablate``'s ``queued``, a worker that
            failed before or without recording it), shown instead of the stored one.
    """

    name: str
    slot: int
    info: Any = None
    series: RunSeries = field(default_factory=RunSeries)
    cursor: int = 0
    arch: Any = None
    arch_why: str = "not recorded yet"
    external: str | None = None
    _configured: bool = False
    _last_read: Any = None

    @property
    def style(self) -> str:
        return RUN_STYLES[self.slot % MAX_RUNS][0]

    @property
    def marker(self) -> str:
        return RUN_STYLES[self.slot % MAX_RUNS][1]

    def set_info(self, info: Any) -> None:
        """Take the run's latest row (its config is read once)."""
        self.info = info
        if self._configured or info is None:
            return
        self._configured = True
        self.series.total_steps = info.total_steps
        config, why = minillm_config_of(info)
        if config is None:
            self.arch, self.arch_why = None, why
        else:
            from minillm.arch import arch_numbers

            self.arch, self.arch_why = arch_numbers(config), ""

    def add_update(self, update: Any, history: Any = None) -> bool:
        """Feed a :class:`hooks.store.store.RunUpdate`; whether anything new arrived. With
        ``history`` (a first read of a long run, :func:`tui.screens.live_data.first_read`),
        the series starts from the run's bucketed history instead of its rows."""
        if update.restarted:  # resumed from an earlier checkpoint: read it again
            self.series.reset()
            self.cursor = 0
            self.set_info(update.run)
            return True
        self.set_info(update.run)
        if history is not None:
            self.series.load_history(history, update.metrics)
            self.cursor = history.last
            return True
        for row in update.metrics:
            self.series.add(row)
        if update.metrics:
            self.cursor = update.last_step
        return bool(update.metrics)

    @property
    def needs_last_row(self) -> bool:
        """Whether the run ended and its last row was not read again since: a writer may add
        scalars to a step already read (``mdb ablate`` logs the held-out ``ce@N`` into the
        last step, after the step itself), which reading on from the cursor never sees."""
        return (self.info is not None and self.info.status != "running"
                and self._last_read != (self.info.status, self.info.last_step))

    def add_last_row(self, row: Any) -> bool:
        """Take what a re-read of the last step adds (scalars not seen at that step); whether
        anything was new."""
        self._last_read = (self.info.status, self.info.last_step) if self.info else None
        if row is None or row.step != self.series.step:
            return False
        new = False
        for name, value in row.values.items():
            st = self.series.stats.get(name)
            if st is None or st.last_step != row.step:  # stats only: the step is drawn already
                if st is None:
                    from tui.screens.live_data import MetricStats

                    st = self.series.stats[name] = MetricStats()
                    self.series.names.append(name)
                st.add(row.step, value)
                new = True
        return new

    @property
    def loss_name(self) -> str | None:
        return run_loss_metric(self.series.names)

    def status(self) -> str:
        """The status cell: the stored status once the writer set a final one (finished,
        interrupted, failed), else the external one when there is one (queued, a worker that
        died without saying so), else the stored one."""
        final = self.info is not None and self.info.status in ("finished", "interrupted",
                                                                "failed")
        if self.external and not final:
            return self.external
        if self.info is None:
            return "starting"
        return self.info.status_line()

    def best(self, name: str | None) -> float | None:
        st = self.series.stats.get(name) if name else None
        return st.min if st is not None else None


def short_labels(names: Sequence[str]) -> list[str]:
    """The names without their common prefix up to a separator: ``abl-attention=mha`` and
    ``abl-attention=gqa`` → ``mha``, ``gqa`` (one varied field: its name goes too);
    ``abl-a=1+b=2`` and ``abl-a=1+b=3`` → ``b=2``, ``b=3``. Unchanged when that would leave
    a label empty or the same twice, or for a single name. Each label is
    :func:`hooks.text.printable`."""
    return [printable(label) for label in _short_labels(names)]


def _short_labels(names: Sequence[str]) -> list[str]:
    if len(names) < 2:
        return list(names)
    prefix = names[0]
    for n in names[1:]:
        while not n.startswith(prefix):
            prefix = prefix[:-1]
    cut = max((i + 1 for i, c in enumerate(prefix) if c in "-+_."), default=0)
    labels = [n[cut:] for n in names]
    if cut and prefix[cut - 1] != "+" and "=" in prefix[cut:]:
        field = prefix[cut:].split("=", 1)[0] + "="
        if all(lb.startswith(field) and "+" not in lb for lb in labels):
            labels = [lb[len(field):] for lb in labels]
    ok = all(labels) and len(set(labels)) == len(labels)
    return labels if ok else list(names)


def _fmt(x: float | None, spec: str = ".4f") -> str:
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and abs(x) < 1e-3:
        return f"{x:.2e}"
    return format(x, spec)


def _int(x: int | None) -> str:
    return "—" if x is None else f"{x:,}"


@dataclass
class CompareRow:
    """One row of the table: a label and one cell per run (``kind``: ``config`` for a
    differing setting, ``number`` for a measured or computed quantity)."""

    label: str
    cells: list[str]
    kind: str = "number"


def compare_rows(views: Sequence[RunView]) -> list[CompareRow]:
    """The table of ``views`` (see the module docstring), in display order."""
    rows: list[CompareRow] = []
    fields = [config_fields(v.info) if v.info is not None else {} for v in views]
    keys: list[str] = []
    for f in fields:
        keys += [k for k in f if k not in keys]
    for k in keys:
        # a setting differs when the runs that have it disagree (one a run lacks is unknown
        # there, not different: a hooks.run loop has none of minillm's fields)
        values = [f[k] for f in fields if k in f]
        if len(values) > 1 and len(set(values)) > 1:
            rows.append(CompareRow(k, [f.get(k, "—") if v.info is not None else ""
                                       for v, f in zip(views, fields, strict=True)], "config"))
    arch = [v.arch for v in views]
    rows.append(CompareRow("params", [_int(a.parameters if a else None) for a in arch]))
    if any(a is not None and a.active_parameters != a.parameters for a in arch):
        rows.append(CompareRow("active/token", [_int(a.active_parameters if a else None)
                                                for a in arch]))
    rows.append(CompareRow("attn params/layer",
                           [_int(a.attention_parameters_per_layer if a else None) for a in arch]))
    dtype = next((a.kv_dtype for a in arch if a is not None), "float32")
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    rows.append(CompareRow(f"KV bytes/token {short}",
                           [_int(a.kv_cache_bytes_per_token if a else None) for a in arch]))
    losses = [v.loss_name for v in views]
    named = {n for n in losses if n}
    label = next(iter(named)) if len(named) == 1 else "loss"
    if len(named) > 1:
        rows.append(CompareRow("loss metric", [n or "—" for n in losses]))
    rows.append(CompareRow(f"last {label}", [_fmt(v.series.value(n)) if n else "—"
                                              for v, n in zip(views, losses, strict=True)]))
    rows.append(CompareRow(f"best {label}", [_fmt(v.best(n)) if n else "—"
                                              for v, n in zip(views, losses, strict=True)]))
    if any(n != "ce" and "ce" in v.series.stats for v, n in zip(views, losses, strict=True)):
        # the cross-entropy apart from what the loss adds to it (a MoE model's aux loss)
        rows.append(CompareRow("last ce", [_fmt(v.series.value("ce")) if "ce" in v.series.stats
                                           else "—" for v in views]))
    evals: list[str] = []
    for v in views:
        evals += [n for n in v.series.names if HELD_OUT.match(n) and n not in evals]
    for n in sorted(evals, key=lambda s: int(HELD_OUT.match(s).group(1))):
        rows.append(CompareRow(f"held-out {n}", [_fmt(v.series.value(n)) if n in v.series.stats
                                                 else "—" for v in views]))
    rows.append(CompareRow("steps/s", [_fmt(v.series.steps_per_s(), ".1f") for v in views]))
    rows.append(CompareRow("step", [
        (f"{v.series.step}/{v.info.total_steps}" if v.info is not None and v.info.total_steps
         else str(v.series.step)) if v.info is not None else "—" for v in views]))
    rows.append(CompareRow("status", [v.status() for v in views]))
    # a config key or value, a metric name, a status's reason: shown escaped, one line each
    return [CompareRow(printable(r.label), [printable(c) for c in r.cells], r.kind)
            for r in rows]


def why_lines(views: Sequence[RunView], labels: Sequence[str]) -> list[str]:
    """One line per run whose architecture numbers are "—": why."""
    out = []
    for v, label in zip(views, labels, strict=True):
        if v.arch is None and v.info is not None:
            out.append(printable(f"{v.marker} {label}: — {v.arch_why}"))
    return out


def assign_slot(taken: Sequence[int]) -> int:
    """The first free slot (colour and marker) not in ``taken``."""
    return next(i for i in range(MAX_RUNS * 2) if i not in set(taken))


def feed_rows(view: RunView, rows: Sequence[Any]) -> None:
    """Add stored metric rows to a view directly (tests, and the printed table)."""
    for row in rows:
        view.series.add(row)
        view.cursor = row.step


__all__ = [
    "MAX_RUNS",
    "RUN_STYLES",
    "CompareRow",
    "RunView",
    "assign_slot",
    "compare_rows",
    "config_fields",
    "feed_rows",
    "minillm_config_of",
    "run_loss_metric",
    "short_labels",
    "why_lines",
]
