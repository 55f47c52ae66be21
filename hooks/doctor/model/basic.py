"""Checks 1, 2 and 8: initial loss, causality, tied weights.

Dimension legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from hooks.doctor.model.freshness import training_state
from hooks.doctor.model.kind import ModelKind
from hooks.doctor.model.labels import measure_label_alignment
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import NotApplicable, SkipCheck, Target, fmt


def _tolerance(t: torch.Tensor) -> float:
    """Absolute tolerance for "unchanged" outputs of dtype ``t.dtype`` at ``t``'s scale."""
    scale = float(t.detach().abs().max()) if t.numel() else 0.0
    eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
    return 64 * eps * max(scale, 1.0)


# ---------------------------------------------------------------------------------------------
def _aligned_ce(t: Target, logits: torch.Tensor, batch, ids: torch.Tensor) -> tuple[float, str]:
    """Cross-entropy of ``logits`` against the tokens they predict for this kind of model, and
    the alignment in words."""
    v = logits.shape[-1]
    kind = t.kind.kind
    if kind == "encoder-decoder":
        labels, _ = batch.targets_tensor(t.model)
        if not isinstance(labels, torch.Tensor) or labels.shape[:2] != logits.shape[:2]:
            raise SkipCheck("the decoder's targets are unknown: return a dict batch with labels")
        return (float(F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1))),
                "decoder logits vs their labels")
    if kind == "encoder":
        return (float(F.cross_entropy(logits.reshape(-1, v), ids.reshape(-1))),
                "each position vs its own token, as a masked LM predicts")
    what = "next-token targets" if kind == "decoder" else (
        "next-token targets assumed: nothing says what the model predicts")
    return (float(F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))),
            what)


#: Nats above ln V that warn. Logits of std σ on uniform targets score ≈ ln V + σ²/2, so an
#: excess (not a ratio, which grows as V shrinks) measures the logit scale: 1 nat is σ ≈ 1.4.
EXCESS_WARN = 1.0


def _random_token_loss(t: Target, shape: tuple[int, int],
                       seed: int) -> tuple[float, str, float, int]:
    """(loss, alignment in words, logits std, V) on uniformly random ids of ``shape``: the
    cross-entropy of the logits at every position (asked for with targets when the model
    returns them only then) against the tokens they predict; without such logits, the model's
    own loss on targets rewritten for those ids (logits std NaN).

    Raises:
        SkipCheck: neither logits at every position nor a loss of its own (says which).
    """
    enc_dec = t.kind.kind == "encoder-decoder"
    batch = t.batch_with(shape=shape, seed=seed, targets="rewrite" if enc_dec else "logits")
    with t.mode(False), torch.no_grad():
        logits = t.logits(t.run(batch, use_cache=False))
        if logits is not None and not enc_dec and logits.shape[1] != shape[1]:
            logits = None  # fewer positions than tokens: judged by its own loss below
        if logits is not None:
            logits = logits.float()
            ce, align = _aligned_ce(t, logits, batch, batch.ids(t.model))
            return ce, align, float(logits.std()), logits.shape[-1]
        batch = t.batch_with(shape=shape, seed=seed, targets="rewrite")
        choice = t.loss(t.run(batch, use_cache=False), batch)
    if choice.fallback:
        short = t.few_positions()
        raise SkipCheck(f"{short}, and no loss of its own: return logits at every position (or "
                        "a loss with targets in the batch)" if short else
                        "the model returns neither (B, T, V) logits nor a loss: return "
                        "logits (or a loss with targets in the batch)")
    return float(choice.loss), f"the model's own loss ({choice.source})", math.nan, t.vocab_size


@check(1, "init-loss", "Initial loss vs ln(V)")
def init_loss(t: Target, o: DoctorOptions) -> Outcome:
    """Cross-entropy on uniformly random tokens, against ln V.

    Random tokens cannot be predicted, so a model whose logits start small predicts near
    uniformly and scores ln V; a much larger loss means logits that are too large (too wide an
    init, e.g. ``nn.Embedding``'s N(0, 1) with a tied head: logits std ≈ √D). The logits are
    compared with the tokens they predict for the model's kind (next token for a decoder, the
    same position for a masked LM, the labels for an encoder-decoder); a model that returns no
    logits is judged by its own loss on targets rewritten for the random tokens. Fails above
    1.5·ln V; warns more than :data:`EXCESS_WARN` nats above ln V or below 0.9·ln V. Only a
    freshly initialised model is judged so: on a trained one
    (:func:`hooks.doctor.model.freshness.training_state`: norms moved from their constant init,
    or a loss on its own batch far below ln V) it is ``n/a`` with the signs found.

    Also fails when the batch's targets train the model on another task than the next token,
    whatever the loss's value (:func:`hooks.doctor.model.labels.measure_label_alignment`): targets
    equal to the inputs on a model that does not shift them (it learns to copy its input), or
    shifted targets on a model that shifts them again (the token two ahead).
    """
    ids = t.need_ids()
    b, seq = ids.shape
    if t.max_positions:  # without a known limit only the batch's own length is known to fit
        seq = min(max(seq, 32), t.max_positions)
    shape = (max(b, 4), seq)
    ce, align, std, v = _random_token_loss(t, shape, o.seed + 1)
    ln_v = math.log(v)
    data = dict(loss=ce, ln_v=ln_v, logits_std=std, tokens=shape[0] * shape[1], vocab_size=v,
                alignment=align, kind=t.kind.kind)
    if not math.isfinite(ce):
        raise SkipCheck(f"the loss on random tokens is {ce} (see the non-finite check)")
    ratio = ce / ln_v
    data["ratio"] = ratio
    emb, head = t.embeddings()
    module = head[0] if head else (emb[0] if emb else None)
    std_txt = f"; logits std {fmt(std)}" if math.isfinite(std) else ""
    ev = (f"loss {ce:.3f} on {shape[0]}×{shape[1]} random tokens ({align}) vs ln(V) = "
          f"{ln_v:.3f} (×{ratio:.2f}){std_txt}")
    hint = ("logits too large at init: embedding/LM head initialised too wide (nn.Embedding's "
            "default N(0,1) with a tied head gives logits std ≈ √D); use N(0, 0.02²)")
    labels = measure_label_alignment(t, shape, o.seed + 1)
    if labels is not None:
        data["labels"] = labels.to_dict()
        if (found := labels.finding()) is not None:
            return Outcome.fail(f"{found[0]}; {ev}", found[1], None, **data)
    if ratio > 1.5 or ce - ln_v > EXCESS_WARN or ratio < 0.9:
        state = training_state(t)
        data["training"] = state.to_dict()
        if state.trained:
            raise NotApplicable(f"the model is trained, not freshly initialised ("
                                f"{'; '.join(state.reasons)}): its loss on random tokens "
                                f"({ev}) says nothing about its init")
    if ratio > 1.5:
        return Outcome.fail(ev, hint, module, **data)
    if ce - ln_v > EXCESS_WARN:
        return Outcome.warn(ev, "logits larger than a small init gives: fine if the model is "
                            "meant to start there (or is trained already), else initialise the "
                            "embedding/LM head narrower, N(0, 0.02²)", module, **data)
    if ratio < 0.9:
        return Outcome.warn(ev, "loss below ln(V) on unpredictable tokens: the model may see "
                            "the targets (check causality and label shifting)", module, **data)
    return Outcome.ok(ev, module, **data)


# ---------------------------------------------------------------------------------------------
class _Recorder:
    """Forward hooks keeping, per module call (in finishing order), the first output tensor of
    shape (B, T, ...) restricted to positions ``[:cut]``."""

    def __init__(self, model: torch.nn.Module, shape: tuple[int, int], cut: int) -> None:
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.handles = []
        for name, m in model.named_modules():
            if name == "":
                continue
            self.handles.append(m.register_forward_hook(self._hook(name, shape, cut)))

    def _hook(self, name, shape, cut):
        def hook(mod, args, output):
            x = output[0] if isinstance(output, (tuple, list)) and output else output
            if (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2
                    and tuple(x.shape[:2]) == shape):
                self.calls.append((name, x[:, :cut].detach().clone()))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _causality_runs(t: Target, enc_dec: bool, enc_ids: torch.Tensor, seqs: list[torch.Tensor],
                    cut: int) -> tuple[list[tuple[torch.Tensor, list]], torch.Tensor]:
    """Run the model on the original, the future-changed and the past-changed sequences (the
    decoder's for an encoder-decoder). Returns ``[(logits, module outputs at positions <
    cut)]`` of the first two, recorded by a :class:`_Recorder`, and the third's logits."""
    seq_ids, future, past = seqs
    b, seq = seq_ids.shape

    def batch_of(x):
        if enc_dec:
            return t.batch_with(ids=enc_ids, targets="drop", decoder_ids=x)
        return t.batch_with(ids=x, targets="logits")

    runs = []
    with t.mode(False), torch.no_grad():
        for x in (seq_ids, future):
            bx = batch_of(x)
            rec = _Recorder(t.model, (b, seq), cut)
            try:
                logits = t.need_logits(t.run(bx, use_cache=False), seq)
            finally:
                rec.close()
            runs.append((logits, rec.calls))
        past_logits = t.need_logits(t.run(batch_of(past), use_cache=False), seq)
    return runs, past_logits


def _first_changed(base_calls: list, fut_calls: list) -> str | None:
    """The first module (in finishing order) whose output at the kept positions changed
    beyond rounding between the two runs, or None (also when the runs' calls differ)."""
    if len(base_calls) == len(fut_calls):
        for (name, a), (name2, c) in zip(base_calls, fut_calls, strict=True):
            if name != name2 or a.shape != c.shape:
                break
            if float((a.float() - c.float()).abs().max()) > _tolerance(a):
                return name
    return None


def _leak_outcome(t: Target, kind: ModelKind, what: str, cut: int, tol: float, leak: float,
                  diff_T: torch.Tensor, base_calls: list, fut_calls: list,
                  data: dict[str, Any]) -> Outcome:
    """The outcome when outputs at positions < ``cut`` changed with later tokens: a warning
    for a model that declares no kind (measured bidirectional), else a failure; both name the
    first leaking position and the first changed (attention) module."""
    first_pos = int((diff_T > tol).nonzero()[0, 0])
    culprit = _first_changed(base_calls, fut_calls)
    culprit = t.attention_of(culprit) or culprit  # the attention module, not its o_proj
    data.update(first_leaking_position=first_pos, first_changed_module=culprit)
    where = f"; first changed inside {culprit}" if culprit else ""
    ev = (f"changing {what} ≥ {cut} changed logits at positions < {cut} by up to "
          f"{fmt(leak)} (tolerance {fmt(tol)}), already at position {first_pos}{where}")
    if kind.kind == "unknown":
        return Outcome.warn(
            f"{ev}: the model is bidirectional (measured); nothing declares it causal "
            f"({kind.reason})",
            "fine for an encoder; if it predicts the next token, its causal mask is "
            "missing (pass next-token targets or labels = input_ids so mdb knows)",
            culprit, **data)
    return Outcome.fail(
        f"{ev}; a {kind.label} model must not see later tokens ({kind.reason})",
        "attention sees future tokens: the causal mask is missing, inverted or not applied "
        "(is_causal / masked_fill on the wrong side of the diagonal)",
        culprit, **data)


@check(2, "causality", "Causality (no look-ahead)")
def causality(t: Target, o: DoctorOptions) -> Outcome:
    """Change every token after position c and compare the outputs at positions ≤ c.

    A causal model's outputs at positions ≤ c cannot change (up to float rounding); the first
    module (in finishing order) whose output at those positions changed is where the future
    leaked in. Also changes the tokens ≤ c to confirm later outputs do depend on the past.
    Applies to decoders and to an encoder-decoder's decoder (its encoder is bidirectional by
    design); n/a for a bidirectional encoder. A model that declares no kind is measured: if its
    outputs see later tokens, it is reported as bidirectional (warn), not as broken.
    """
    ids = t.need_ids()
    kind = t.kind
    if kind.kind == "encoder":
        raise NotApplicable(f"a bidirectional encoder by design ({kind.reason}): every position "
                            "attends to every other, there is no causal mask to test")
    enc_dec = kind.kind == "encoder-decoder"
    enc_ids = ids[:2]
    seq_ids = t.decoder_ids()[:2] if enc_dec else enc_ids
    b, seq = seq_ids.shape
    if seq < 4:
        raise SkipCheck(f"the batch has only {seq} positions; need at least 4")
    cut = seq // 2  # positions [0, cut) keep their tokens
    v = t.vocab_size
    g = torch.Generator().manual_seed(o.seed + 2)
    shift = torch.randint(1, v, seq_ids.shape, generator=g).to(seq_ids.device)
    future = seq_ids.clone()
    future[:, cut:] = (seq_ids[:, cut:] + shift[:, cut:]) % v
    past = seq_ids.clone()
    past[:, :cut] = (seq_ids[:, :cut] + shift[:, :cut]) % v

    runs, past_logits = _causality_runs(t, enc_dec, enc_ids, [seq_ids, future, past], cut)
    (base, base_calls), (fut, fut_calls) = runs
    if not (torch.isfinite(base).all() and torch.isfinite(fut).all()):
        raise SkipCheck("the logits are not finite (see the non-finite check)")
    tol = _tolerance(base)
    diff_T = (fut[:, :cut] - base[:, :cut]).abs().amax(dim=(0, 2))  # (cut,)
    leak = float(diff_T.max())
    influence = float((past_logits[:, cut:] - base[:, cut:]).abs().max())
    what = "decoder tokens" if enc_dec else "tokens"
    data = dict(cut=cut, seq_len=seq, leak=leak, tolerance=tol, past_influence=influence,
                kind=kind.kind, kind_reason=kind.reason)
    if leak > tol:
        return _leak_outcome(t, kind, what, cut, tol, leak, diff_T, base_calls, fut_calls, data)
    label = "the decoder of an encoder-decoder" if enc_dec else kind.label
    measured = " (measured)" if kind.kind == "unknown" else ""
    ev = (f"{label}{measured}: changing {what} ≥ {cut} of {seq} left logits < {cut} unchanged "
          f"(max |Δ| {fmt(leak)} ≤ {fmt(tol)}); changing {what} < {cut} moved later logits by "
          f"{fmt(influence)}")
    if influence <= tol:
        return Outcome.warn(ev, "outputs do not depend on earlier tokens at all: attention "
                            "may be masking everything but the current position", None, **data)
    return Outcome.ok(ev, **data)


# ---------------------------------------------------------------------------------------------
@check(8, "tied", "Tied embedding / LM head")
def tied_weights(t: Target, o: DoctorOptions) -> Outcome:
    """Whether the LM head and the token embedding share one Parameter (as the config says),
    and whether an optimizer over ``model.parameters()`` would see any storage twice."""
    emb, head = t.embeddings()
    model = t.model
    # distinct Parameter objects sharing memory: an optimizer would update it twice
    by_ptr: dict[tuple[int, tuple], list[str]] = {}
    for name, p in model.named_parameters():  # de-duplicated by identity
        by_ptr.setdefault((p.data_ptr(), tuple(p.shape)), []).append(name)
    shared = [names for names in by_ptr.values() if len(names) > 1]
    n_unique = sum(1 for _ in model.parameters())
    n_named = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    data = dict(unique_parameters=n_unique, registrations=n_named,
                shared_storage=[list(s) for s in shared])
    if shared:
        names = shared[0]
        return Outcome.fail(
            f"{len(names)} distinct Parameters share one storage ({', '.join(names)}): an "
            f"optimizer over model.parameters() updates that memory {len(names)} times a step",
            "tie by assigning the same Parameter (lm_head.weight = embed_tokens.weight), not "
            "by sharing .data", names[0].rpartition(".")[0] or None, **data)
    if emb is None or head is None:
        raise NotApplicable("no token embedding and LM head pair to tie "
                            f"(embedding: {emb[0] if emb else 'none'}, head: "
                            f"{head[0] if head else 'none'})")
    (ename, em), (hname, hm) = emb, head
    ew, hw = getattr(em, "weight", None), getattr(hm, "weight", None)
    if not (isinstance(ew, torch.Tensor) and isinstance(hw, torch.Tensor)):
        raise NotApplicable("the embedding or the LM head has no weight tensor")
    if ew.shape != hw.shape:
        raise NotApplicable(f"{hname}.weight {tuple(hw.shape)} and {ename}.weight "
                            f"{tuple(ew.shape)} differ in shape: they cannot be tied")
    same = ew is hw
    same_storage = ew.data_ptr() == hw.data_ptr()
    equal = ew.shape == hw.shape and bool(torch.equal(ew.detach(), hw.detach()))
    want = t.cfg("tie_word_embeddings")
    data.update(embedding=ename, head=hname, same_parameter=same, equal_values=equal,
                tie_word_embeddings=want)
    pair = f"{hname}.weight and {ename}.weight"
    counts = f"optimizer sees {n_unique} parameter tensors, each once"
    if want is True and not same:
        return Outcome.fail(
            f"tie_word_embeddings=True but {pair} are separate tensors (values "
            f"{'still equal' if equal else 'differ'}); {n_unique} parameter tensors",
            "the tie was broken, e.g. by load_state_dict(assign=True) or replacing one "
            "Parameter after construction; re-tie after loading (model.tie_weights())",
            hname, **data)
    if want is False and (same or same_storage):
        return Outcome.warn(f"tie_word_embeddings=False but {pair} share storage; {counts}",
                            "the config and the module disagree", hname, **data)
    if same:
        return Outcome.ok(f"{pair} are one Parameter (shared storage); {counts}", hname, **data)
    how = "untied as the config says" if want is False else "untied (no config says which)"
    return Outcome.ok(f"{pair} are separate ({how}); {counts}", hname, **data)
