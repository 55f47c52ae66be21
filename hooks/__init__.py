"""hooks: the debugger's capture engine (shapes, statistics, gradients, routing, attention).

Everything the TUI shows comes from a :class:`Trace` recorded by :func:`capture`::

    import hooks
    with hooks.capture(model) as trace:
        out = model(ids, labels=ids)
        out.loss.backward()
    trace.forward        # one CallRecord per module call, in execution order
    trace.backward       # one GradRecord per output gradient, in autograd order
    trace.params         # ParamGradRecord by parameter name
    trace.routing        # one RoutingRecord per MoE layer call (ids/weights the experts got)
    trace.attention      # with capture(model, attention=True): probabilities the model computed
    trace.first_nonfinite()
    trace.save("step0.mdbtrace"); hooks.Trace.load("step0.mdbtrace")
    trace.diff(other_trace)

Record your own training loop in the run store (``mdb watch``, ``mdb runs``, ``mdb export``)::

    with hooks.run("exp1") as run:
        run.watch(model, every=50)
        for x, y in loader:
            ...
            run.log(loss=loss, lr=lr)

Works on any ``torch.nn.Module``; never imports textual, rich or tui.
"""

from hooks.batch import Batch, BatchError, LossChoice, from_factory, select_loss
from hooks.capture import Capture, Selector, capture, module_infos
from hooks.diff import TensorDiff, TraceDiff
from hooks.probes import (
    BlockRoutingProbe,
    EagerAttentionProbe,
    Probe,
    ProbeContext,
    TopKRouterProbe,
    probes_for,
    register_probe,
    unregister_probe,
)
from hooks.records import (
    AttentionRecord,
    CallRecord,
    GradRecord,
    ModuleInfo,
    NonFinite,
    Note,
    ParamGradRecord,
    ProbeRecord,
    RoutingRecord,
    TensorInfo,
)
from hooks.stats import NUM_BINS, StatsBatch, TensorStats, summarize_tensor
from hooks.trace import SCHEMA_VERSION, Trace, TraceFormatError

__all__ = [
    "NUM_BINS",
    "SCHEMA_VERSION",
    "AttentionRecord",
    "Batch",
    "BatchError",
    "BlockRoutingProbe",
    "CallRecord",
    "Capture",
    "EagerAttentionProbe",
    "GradRecord",
    "LossChoice",
    "ModuleInfo",
    "NonFinite",
    "Note",
    "ParamGradRecord",
    "Probe",
    "ProbeContext",
    "ProbeRecord",
    "RoutingRecord",
    "Run",
    "Selector",
    "StatsBatch",
    "TensorDiff",
    "TensorInfo",
    "TensorStats",
    "TopKRouterProbe",
    "Trace",
    "TraceDiff",
    "TraceFormatError",
    "capture",
    "from_factory",
    "module_infos",
    "probes_for",
    "register_probe",
    "run",
    "select_loss",
    "summarize_tensor",
    "unregister_probe",
]


def __getattr__(name: str):
    # ``hooks.run`` / ``hooks.Run`` (hooks.runs.run: the run store and its writer thread) load
    # on first use, so ``import hooks`` for the capture engine stays light. This package is the
    # facade on top of the engine and the runs: pyproject.toml's contracts let it (and the UI)
    # import hooks.runs, and no module below it import it.
    if name in ("run", "Run"):
        import hooks.runs.run as run_module

        value = getattr(run_module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hooks' has no attribute {name!r}")
