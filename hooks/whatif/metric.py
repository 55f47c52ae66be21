"""The scalar a patching sweep measures: ``loss`` or ``logit_diff:A,B``.

* ``loss``: HF's shifted next-token cross-entropy (``ForCausalLMLoss``): the logits at
  positions 0…T-2 against the targets at 1…T-1, tokens labelled -100 ignored, the mean over every
  counted token of the B rows, in fp32. The targets are the *clean* batch's (its ``labels``, else
  its input ids): the one thing the patched runs are measured against, so that the clean end is
  the clean run's own loss.
* ``logit_diff:A,B``: the logit of token A minus the logit of token B at the last position,
  averaged over the B rows (Wang et al. 2022, "Interpretability in the wild", the IOI logit
  difference). A and B are token ids, or token texts the tokenizer encodes to one id each.

:meth:`Metric.reads` says which positions' logits the metric reads: a change to the residual
stream at a position after the last of them cannot reach it in a causal model (``loss`` never
reads the last position's logits; HF shifts them away).

Dimension legend: n patched copies, B batch, T positions, V vocabulary.

Never imports textual, rich or tui.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: The metric names :func:`parse_metric` takes.
METRICS = ("loss", "logit_diff:A,B")


@dataclass(frozen=True)
class Metric:
    """A parsed metric (see the module docstring).

    Attributes:
        spec: the text it was parsed from.
        kind: ``"loss"`` or ``"logit_diff"``.
        a: token A's id (``logit_diff``).
        b: token B's id (``logit_diff``).
        targets: (B, T) int64 targets of ``loss`` (set by :meth:`bind`).
    """

    spec: str
    kind: str
    a: int | None = None
    b: int | None = None
    targets: torch.Tensor | None = None

    def bind(self, targets: torch.Tensor | None) -> Metric:
        """This metric with the (B, T) ``targets`` a ``loss`` reads.

        Raises:
            ValueError: ``loss`` without targets.
        """
        if self.kind != "loss":
            return self
        if targets is None or targets.dim() != 2:
            raise ValueError("metric loss: the clean batch has no (B, T) labels or input ids to "
                             "read the next-token loss against; use --metric logit_diff:A,B")
        if not bool((targets[:, 1:] != -100).any()):
            raise ValueError("metric loss: every label of the clean batch after the first "
                             "position is -100: the loss counts no token")
        return Metric(self.spec, self.kind, targets=targets.long())

    def reads(self, t: int) -> list[int]:
        """The positions (0…T-1) whose logits the metric reads."""
        if self.kind == "loss":
            assert self.targets is not None
            keep = (self.targets[:, 1:] != -100).any(0)
            return [p for p in range(t - 1) if bool(keep[p])]
        return [t - 1]

    def __call__(self, logits: torch.Tensor, n: int = 1) -> torch.Tensor:
        """The metric of each of ``n`` copies: ``logits`` is (n·B, T, V), copy-major; returns
        (n,) float32 (float64 for float64 logits)."""
        x = logits.reshape(n, -1, *logits.shape[1:])
        x = x.float() if x.dtype != torch.float64 else x
        if self.kind == "logit_diff":
            last = x[:, :, -1]
            return (last[..., self.a] - last[..., self.b]).mean(1)
        assert self.targets is not None
        tgt = self.targets[:, 1:].to(x.device)
        pred = x[:, :, :-1]
        ce = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tgt.repeat(n, 1).reshape(-1),
                             ignore_index=-100, reduction="none").view(n, -1)
        counted = (tgt != -100).sum()
        return ce.sum(1) / counted


def _token(text: str, spec: str, tokenizer: Any) -> int:
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    if tokenizer is None:
        raise ValueError(f"metric {spec!r}: {text!r} is not a token id, and there is no "
                         "tokenizer to encode it")
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    except Exception as exc:  # a tokenizer that cannot encode this text
        raise ValueError(f"metric {spec!r}: the tokenizer cannot encode {text!r} ({exc})") from None
    if len(ids) != 1:
        raise ValueError(f"metric {spec!r}: {text!r} is {len(ids)} tokens, not one")
    return int(ids[0])


def parse_metric(spec: str, tokenizer: Any = None, vocab: int | None = None) -> Metric:
    """Parse ``loss`` or ``logit_diff:A,B`` (see the module docstring).

    Raises:
        ValueError: one line: an unknown metric, A or B not one token, an id outside 0…V-1.
    """
    text = str(spec).strip()
    if text == "loss":
        return Metric(text, "loss")
    name, sep, rest = text.partition(":")
    if name != "logit_diff" or not sep:
        raise ValueError(f"metric {spec!r}: give one of {', '.join(METRICS)}")
    pair = rest.split(",")
    if len(pair) != 2 or not all(p.strip() for p in pair):
        raise ValueError(f"metric {spec!r}: logit_diff takes two tokens, logit_diff:A,B")
    a, b = (_token(p, text, tokenizer) for p in pair)
    for t in (a, b):
        if t < 0 or (vocab is not None and t >= vocab):
            raise ValueError(f"metric {spec!r}: token id {t} is outside the vocabulary "
                             f"(0…{vocab - 1 if vocab else '?'})")
    return Metric(text, "logit_diff", a, b)


__all__ = ["METRICS", "Metric", "parse_metric"]
