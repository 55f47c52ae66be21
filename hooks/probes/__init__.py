"""``hooks.probes``: what a capture records inside a module call, model by model.

* :mod:`hooks.probes.base` — the probe protocol and its registry (:class:`Probe`,
  :func:`register_probe`, :func:`probes_for`), the built-in probes;
* :mod:`hooks.probes.attention` — attention probabilities as the model computed them;
* :mod:`hooks.probes.routing` — which experts a mixture-of-experts router chose, and with
  which weights.

Built on :mod:`hooks.trace`; never imports textual, rich or tui.
"""

from hooks.probes.base import (
    BlockRoutingProbe,
    EagerAttentionProbe,
    Probe,
    ProbeContext,
    TopKRouterProbe,
    probes_for,
    register_probe,
    unregister_probe,
)

__all__ = [
    "BlockRoutingProbe",
    "EagerAttentionProbe",
    "Probe",
    "ProbeContext",
    "TopKRouterProbe",
    "probes_for",
    "register_probe",
    "unregister_probe",
]
