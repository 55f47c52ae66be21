"""Checks 1, 2 and 8: initial loss, causality, tied weights.

Dimension legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hooks.checks.registry import DoctorOptions, check
from hooks.checks.result import Outcome
from hooks.checks.target import SkipCheck, Target, fmt


def _tolerance(t: torch.Tensor) -> float:
    """Absolute tolerance for "unchanged" outputs of dtype ``t.dtype`` at ``t``'s scale."""
    scale = float(t.detach().abs().max()) if t.numel() else 0.0
    eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
    return 64 * eps * max(scale, 1.0)


# ---------------------------------------------------------------------------------------------
@check(1, "init-loss", "Initial loss vs ln(V)")
def init_loss(t: Target, o: DoctorOptions) -> Outcome:
    """Cross-entropy of next-token prediction on uniformly random tokens, against ln V.

    Random tokens cannot be predicted, so a model whose logits start small predicts near
    uniformly and scores ln V; a much larger loss means logits that are too large (too wide an
    init, e.g. ``nn.Embedding``'s N(0, 1) with a tied head: logits std ≈ √D).
    """
    ids = t.need_ids()
    b, seq = ids.shape
    seq = max(seq, 32)
    if t.max_positions:
        seq = min(seq, t.max_positions)
    shape = (max(b, 4), seq)
    rnd = t.random_ids(shape, seed=o.seed + 1)
    with t.mode(False), torch.no_grad():
        out = t.call(rnd, labels=False)
    logits = t.need_logits(out).float()
    v = logits.shape[-1]
    ce = float(F.cross_entropy(logits[:, :-1].reshape(-1, v), rnd[:, 1:].reshape(-1)))
    ln_v = math.log(v)
    std = float(logits.std())
    data = dict(loss=ce, ln_v=ln_v, logits_std=std, tokens=shape[0] * (shape[1] - 1),
                vocab_size=v)
    if not math.isfinite(ce):
        raise SkipCheck(f"the loss on random tokens is {ce} (see the non-finite check)")
    ratio = ce / ln_v
    data["ratio"] = ratio
    emb, head = t.embeddings()
    module = head[0] if head else (emb[0] if emb else None)
    ev = (f"loss {ce:.3f} on {shape[0]}×{shape[1]} random tokens vs ln(V) = {ln_v:.3f} "
          f"(×{ratio:.2f}); logits std {fmt(std)}")
    hint = ("logits too large at init: embedding/LM head initialised too wide (nn.Embedding's "
            "default N(0,1) with a tied head gives logits std ≈ √D); use N(0, 0.02²)")
    if ratio > 1.5:
        return Outcome.fail(ev, hint, module, **data)
    if ratio > 1.1:
        return Outcome.warn(ev, hint + " (expected only for a freshly initialised model)",
                            module, **data)
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


@check(2, "causality", "Causality (no look-ahead)")
def causality(t: Target, o: DoctorOptions) -> Outcome:
    """Change every token after position c and compare the outputs at positions ≤ c.

    A causal model's outputs at positions ≤ c cannot change (up to float rounding); the first
    module (in finishing order) whose output at those positions changed is where the future
    leaked in. Also changes the tokens ≤ c to confirm later outputs do depend on the past.
    """
    ids = t.need_ids()[:2]
    b, seq = ids.shape
    if seq < 4:
        raise SkipCheck(f"the batch has only {seq} positions; need at least 4")
    cut = seq // 2  # positions [0, cut) keep their tokens
    v = t.vocab_size
    g = torch.Generator().manual_seed(o.seed + 2)
    shift = torch.randint(1, v, ids.shape, generator=g).to(ids.device)
    future = ids.clone()
    future[:, cut:] = (ids[:, cut:] + shift[:, cut:]) % v
    past = ids.clone()
    past[:, :cut] = (ids[:, :cut] + shift[:, :cut]) % v

    runs = []
    with t.mode(False), torch.no_grad():
        for x in (ids, future):
            rec = _Recorder(t.model, (b, seq), cut)
            try:
                logits = t.need_logits(t.call(x, labels=False))
            finally:
                rec.close()
            runs.append((logits, rec.calls))
        past_logits = t.need_logits(t.call(past, labels=False))
    (base, base_calls), (fut, fut_calls) = runs
    if not (torch.isfinite(base).all() and torch.isfinite(fut).all()):
        raise SkipCheck("the logits are not finite (see the non-finite check)")
    tol = _tolerance(base)
    diff_T = (fut[:, :cut] - base[:, :cut]).abs().amax(dim=(0, 2))  # (cut,)
    leak = float(diff_T.max())
    influence = float((past_logits[:, cut:] - base[:, cut:]).abs().max())
    data = dict(cut=cut, seq_len=seq, leak=leak, tolerance=tol, past_influence=influence)
    if leak > tol:
        first_pos = int((diff_T > tol).nonzero()[0, 0])
        culprit = None
        if len(base_calls) == len(fut_calls):
            for (name, a), (name2, c) in zip(base_calls, fut_calls, strict=True):
                if name != name2 or a.shape != c.shape:
                    break
                if float((a.float() - c.float()).abs().max()) > _tolerance(a):
                    culprit = name
                    break
        if culprit is not None:  # name the attention module, not its o_proj
            for a in t.attention_modules():
                if culprit.startswith(a.name + ".") or culprit == a.name:
                    culprit = a.name
                    break
        data.update(first_leaking_position=first_pos, first_changed_module=culprit)
        where = f"; first changed inside {culprit}" if culprit else ""
        return Outcome.fail(
            f"changing tokens ≥ {cut} changed logits at positions < {cut} by up to {fmt(leak)} "
            f"(tolerance {fmt(tol)}), already at position {first_pos}{where}",
            "attention sees future tokens: the causal mask is missing, inverted or not applied "
            "(is_causal / masked_fill on the wrong side of the diagonal)",
            culprit, **data)
    ev = (f"changing tokens ≥ {cut} of {seq} left logits < {cut} unchanged (max |Δ| "
          f"{fmt(leak)} ≤ {fmt(tol)}); changing tokens < {cut} moved later logits by "
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
        raise SkipCheck("no token embedding and LM head found "
                        f"(embedding: {emb[0] if emb else 'none'}, head: "
                        f"{head[0] if head else 'none'})")
    (ename, em), (hname, hm) = emb, head
    ew, hw = getattr(em, "weight", None), getattr(hm, "weight", None)
    if not (isinstance(ew, torch.Tensor) and isinstance(hw, torch.Tensor)):
        raise SkipCheck("the embedding or the LM head has no weight tensor")
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
