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

Which module is attention (its heads, q/k/v/o), the LM head, the final norm, the router and
the experts, found from one traced forward; declare what tracing cannot tell::

    hooks.roles(model)                                   # what was found, and how
    hooks.roles(model, attention="blocks.*.attn", heads=4, lm_head="head", final_norm="ln_f")

Record your own training loop in the run store (``mdb watch``, ``mdb runs``, ``mdb export``)::

    with hooks.run("exp1") as run:
        run.watch(model, every=50)
        for x, y in loader:
            ...
            run.log(loss=loss, lr=lr)

Works on any ``torch.nn.Module``; never imports textual, rich or tui.
"""

from __future__ import annotations

import sys
import types

# ``import hooks`` loads nothing else: every public name below comes from the module that
# defines it on first use (PEP 562's module ``__getattr__``), so a user who only calls
# ``hooks.run`` or a store command (``mdb runs``) does not pay ``import torch``. Each module is
# loaded by a plain ``import`` statement in :func:`_load` (no importlib), so the import-linter
# contracts of pyproject.toml see every edge. No package under ``hooks`` is named after a
# public name (the function ``hooks.capture`` lives in the module ``hooks.engine.capture``), so
# importing a submodule never hides one. To export a new name: add it to ``_LAZY`` (name → the
# module under ``hooks`` that defines it), to ``__all__``, and, for a new module, a branch to
# :func:`_load`.
_LAZY: dict[str, str] = {
    **dict.fromkeys(("Batch", "BatchError", "LossChoice", "from_factory", "select_loss"), "batch"),
    **dict.fromkeys(("Capture", "Selector", "capture"), "engine.capture"),
    "module_infos": "trace.modules",
    **dict.fromkeys(
        (
            "BlockRoutingProbe",
            "EagerAttentionProbe",
            "Probe",
            "ProbeContext",
            "TopKRouterProbe",
            "probes_for",
            "register_probe",
            "unregister_probe",
        ),
        "probes.base",
    ),
    **dict.fromkeys(("Roles", "find_roles", "roles"), "modelroles.find"),
    **dict.fromkeys(("Run", "run"), "recorder.run"),
    **dict.fromkeys(
        (
            "NUM_BINS",
            "StatsBatch",
    "Sweep",
            "TensorStats",
            "summarize_tensor",
        ),
        "tensors.stats",
    ),
    **dict.fromkeys(("TensorDiff", "TraceDiff"), "trace.diff"),
    **dict.fromkeys(
        (
            "AttentionRecord",
            "CallRecord",
            "GradRecord",
            "ModuleInfo",
            "NonFinite",
            "Note",
            "ParamGradRecord",
            "ProbeRecord",
            "RoutingRecord",
            "TensorInfo",
        ),
        "trace.records",
    ),
    **dict.fromkeys(("SCHEMA_VERSION", "Trace", "TraceFormatError"), "trace.trace"),
    **dict.fromkeys(("Lens", "LensToken", "logit_lens"), "whatif.lens"),
    **dict.fromkeys(("Divergence", "PrecisionDiff", "precision_diff"), "whatif.precision"),
    **dict.fromkeys(("Sweep", "attribution_patch", "patch_sweep"), "whatif.sweep"),
    **dict.fromkeys(("LogitAttribution", "logit_attribution"), "whatif.dla"),
}


__all__ = [
    "NUM_BINS",
    "SCHEMA_VERSION",
    "AttentionRecord",
    "Batch",
    "BatchError",
    "BlockRoutingProbe",
    "CallRecord",
    "Capture",
    "Divergence",
    "EagerAttentionProbe",
    "GradRecord",
    "Lens",
    "LensToken",
    "LogitAttribution",
    "LossChoice",
    "ModuleInfo",
    "NonFinite",
    "Note",
    "ParamGradRecord",
    "PrecisionDiff",
    "Probe",
    "ProbeContext",
    "ProbeRecord",
    "Roles",
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
    "attribution_patch",
    "capture",
    "find_roles",
    "from_factory",
    "logit_attribution",
    "logit_lens",
    "module_infos",
    "patch_sweep",
    "precision_diff",
    "probes_for",
    "register_probe",
    "roles",
    "run",
    "select_loss",
    "summarize_tensor",
    "unregister_probe",
]


def _load(module: str) -> types.ModuleType:
    """The module ``hooks.<module>`` of :data:`_LAZY`, imported by a plain statement."""
    if module == "batch":
        import hooks.batch  # noqa: F401 (read from sys.modules)
    elif module == "engine.capture":
        import hooks.engine.capture  # noqa: F401 (read from sys.modules)
    elif module == "probes.base":
        import hooks.probes.base  # noqa: F401 (read from sys.modules)
    elif module == "modelroles.find":
        import hooks.modelroles.find  # noqa: F401 (read from sys.modules)
    elif module == "recorder.run":
        import hooks.recorder.run  # noqa: F401 (read from sys.modules)
    elif module == "tensors.stats":
        import hooks.tensors.stats  # noqa: F401 (read from sys.modules)
    elif module == "trace.diff":
        import hooks.trace.diff  # noqa: F401 (read from sys.modules)
    elif module == "trace.modules":
        import hooks.trace.modules  # noqa: F401 (read from sys.modules)
    elif module == "trace.records":
        import hooks.trace.records  # noqa: F401 (read from sys.modules)
    elif module == "trace.trace":
        import hooks.trace.trace  # noqa: F401 (read from sys.modules)
    elif module == "whatif.lens":
        import hooks.whatif.lens  # noqa: F401 (read from sys.modules)
    elif module == "whatif.precision":
        import hooks.whatif.precision  # noqa: F401 (read from sys.modules)
    elif module == "whatif.sweep":
        import hooks.whatif.sweep  # noqa: F401 (read from sys.modules)
    elif module == "whatif.dla":
        import hooks.whatif.dla  # noqa: F401 (read from sys.modules)
    else:  # pragma: no cover - _LAZY names a module _load does not know
        raise AssertionError(f"hooks: no loader for {module!r}")
    return sys.modules[f"{__name__}.{module}"]


def __getattr__(name: str):
    """The public name ``name`` of :data:`_LAZY`, loaded from its module on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hooks' has no attribute {name!r}")
    value = getattr(_load(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
