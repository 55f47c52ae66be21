"""``hooks.doctor.model``: the doctor's battery of measured checks for Llama/Mixtral-style models.

Each check measures the model through its public behaviour (forward outputs, module
boundaries, gradients) rather than reading its source, so it works on minillm, on HF models of
many families and on users' models. What applies depends on the kind of model
(:class:`ModelKind`: decoder-only, bidirectional encoder, encoder-decoder, not a sequence
model), read from its config, class, attention modules or targets: a check that does not apply
reports ``n/a`` with the reason; one that applies but cannot be measured (the model or PyTorch
raised, the batch lacks something) reports ``skip`` with the reason; ``error`` is kept for
mdb's own faults. Every check runs the model through one batch adapter
(:meth:`hooks.Batch.resized`) and one loss convention (:func:`hooks.select_loss`).
UI-free: never imports textual, rich or tui.

====  ==========  =============================================================================
 id   key         what is measured
====  ==========  =============================================================================
 1    init-loss   CE on uniformly random tokens vs ln V (too-wide init / logit scale); the
                  targets train the next token (not a copy of the input, not two ahead)
 2    causality   outputs at ≤ c unchanged when tokens > c change (decoders; the decoder of
                  an encoder-decoder; n/a for bidirectional encoders)
 3    rope        layer-0 scores depend on i-j only over every position up to
                  max_position_embeddings (the table covers them); RoPE named, declared
                  or traced (a cos/sin table rotating q/k, whatever its module is called)
 4    gqa         perturbing K/V of KV head g changes exactly query heads h // n_rep == g
                  (after a k_norm; fused q|k|v too; n/a for MHA)
 5    grad-flow   every trainable tensor gets a finite non-zero gradient; routers get one
                  from the aux loss alone; exploding gradients warn, vanishing ones are
                  listed (the gradients view's rules, :mod:`hooks.doctor.verdicts`)
 6    routing     per-expert load, largest share, dead experts, router entropy (own batch
                  and random batches)
 7    nonfinite   NaN/Inf in weights, activations, loss, gradients; where they start
 8    tied        embedding and LM head share one Parameter as configured; no storage twice
 9    numerics    norm statistics in fp32 for bf16 activations; attention softmax under autocast
 10   overfit     (slow) CE on one batch falls by 90 % within N AdamW steps
 11   init        std per parameter role vs initializer_range and the 1/√(2L) residual
                  convention (fresh models); residual stream std by depth
 12   shapes      per-head RMS after a per-head q/k norm; router rows sum to 1; aux ≥ 0;
                  channels RoPE rotates vs partial_rotary_factor
 13   loss-terms  parameters each loss term (LM, aux, z) reaches; a router ~0 from LM
 14   hooks       user gradient hooks fired more than once per backward; forward hooks a
                  compiled model ignores
 21   padding     a row alone vs left/right-padded with its attention_mask (invariance.py)
 22   batch       a row alone vs in a batch with other rows
 23   cache       use_cache=False vs True vs incremental decoding
 24   attn-impl   eager vs SDPA attention
 25   packing     a document alone vs packed after another (position_ids restarting)
====  ==========  =============================================================================

Example::

    from hooks.doctor.model import run_checks
    results = run_checks(model, input_ids)          # or run_checks(model, {"input_ids": ...})
    results = run_checks(workload)                  # .model, .batch (hooks.Batch), .loss_fn
    [r.to_dict() for r in results]
"""

from hooks.doctor.model import all_checks as _all_checks  # noqa: F401  (registers the checks)
from hooks.doctor.model.kind import ModelKind, detect_kind
from hooks.doctor.model.registry import CHECKS, Check, DoctorOptions, resolve_only
from hooks.doctor.model.result import FAILING, STATUSES, CheckResult, Outcome
from hooks.doctor.model.runner import run_checks, worst_status
from hooks.doctor.model.target import NotApplicable, SkipCheck, Target

__all__ = [
    "CHECKS",
    "FAILING",
    "STATUSES",
    "Check",
    "CheckResult",
    "DoctorOptions",
    "ModelKind",
    "NotApplicable",
    "Outcome",
    "SkipCheck",
    "Target",
    "detect_kind",
    "resolve_only",
    "run_checks",
    "worst_status",
]
