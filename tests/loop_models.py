"""Tiny models and a loop runner for the training-loop doctor's tests
(tests/hooks/doctor/loop/test_loop_doctor*.py, tests/hooks/integrations/, tests/tui/).

:class:`TinyLM` is a causal LM small enough to train on a CPU in milliseconds: an embedding,
dropout, a LayerNorm, a per-position MLP and an LM head (each position sees only its own
token, so it is causal). Like HF causal LMs, ``model(input_ids, labels=..., attention_mask=...)``
shifts the labels itself and returns ``(logits, loss)`` with the loss the mean cross-entropy
over the labels that are not -100.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.store.store import RunStore

V, D, T = 32, 16, 12


class TinyLM(nn.Module):
    """(B, T) int64 ids → ``(logits (B, T, V), loss or None)``."""

    def __init__(self, p: float = 0.1, shift: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.drop = nn.Dropout(p)
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.shift = shift  # 1: HF's next-token; 0: not shifted; 2: shifted twice

    def forward(self, input_ids, labels=None, attention_mask=None):
        h = self.drop(self.embed(input_ids))
        h = h + torch.relu(self.mlp(self.norm(h)))
        logits = self.head(h)
        loss = None
        if labels is not None:
            s = self.shift
            lg = logits[:, : logits.shape[1] - s] if s else logits
            loss = F.cross_entropy(lg.reshape(-1, V), labels[:, s:].reshape(-1),
                                   ignore_index=-100)
        return logits, loss


def batches(n: int, b: int = 2, t: int = T, seed: int = 0,
            masked: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of random ids with ``labels = ids``; ``masked[i]`` labels of batch i
    (counted from the end of each row) set to -100, so token counts differ."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, V, (b, t), generator=g)
        labels = ids.clone()
        if masked and masked[i % len(masked)]:
            labels[:, t - masked[i % len(masked)]:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def no_decay_groups(model: nn.Module, wd: float = 0.1) -> list[dict[str, Any]]:
    """AdamW groups as recipes write them: matrices decayed, ndim < 2 and embeddings not."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in emb]
    rest = [p for p in model.parameters() if p.ndim < 2 or id(p) in emb]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def run_loop(db: Path, loop: Callable[[Any], None], name: str = "loop") -> list[Any]:
    """Run ``loop(run)`` inside ``hooks.run(name, db=db)``; the run's findings as stored."""
    with hooks.run(name, db=db) as run:
        loop(run)
    with RunStore(db) as store:
        return store.findings(store.run(run.name).id)


class LogitsLM(TinyLM):
    """:class:`TinyLM` that returns only its (B, T, V) logits: the loop computes the loss
    (``F.cross_entropy(model(x).view(-1, V), y.view(-1))``), as most loops of one's own do."""

    def forward(self, input_ids):
        return super().forward(input_ids)[0]
