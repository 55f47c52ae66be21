"""A fact to find with ``mdb sweep`` (docs/what-if.md): a tiny GPT-2 that learns to repeat, at the
last position, the token it saw at position 1 ("key ... ? → key").

    mdb sweep --model samples/sweep_fact.py:corrupted --source-batch samples/sweep_fact.py:clean

``corrupted()`` trains the model (a few seconds on a CPU, seeded: the same weights every time)
and returns it with the sequence whose key is 23; ``clean()`` is the same sequence with key 17.
Each batch holds the answer as its last token and scores it alone (``labels`` -100 elsewhere), so
the loss is the loss of the answer. Needs transformers (built from a config, no download).
"""

from __future__ import annotations

import torch

VOCAB, T = 32, 8
QUERY, BOS = 0, 1
#: The filler tokens of the one sequence shown (positions 2 … T-2).
FILLER = [9, 4, 12, 30, 6, 21]


def _sequences(n: int, g: torch.Generator) -> torch.Tensor:
    """(n, T + 1): BOS, a key, fillers, QUERY, the key again (the answer)."""
    key = torch.randint(2, VOCAB, (n, 1), generator=g)
    filler = torch.randint(2, VOCAB, (n, T - 3), generator=g)
    q = torch.full((n, 1), QUERY)
    return torch.cat([torch.full((n, 1), BOS), key, filler, q, key], 1)


def _train():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=16, bos_token_id=BOS, eos_token_id=BOS))
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name maps to no loss: say it
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        x = _sequences(64, g)
        labels = torch.full_like(x, -100)
        labels[:, -1] = x[:, -1]  # only the answer is scored
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _batch(key: int) -> dict:
    ids = torch.tensor([[BOS, key, *FILLER[:T - 3], QUERY, key]])
    labels = torch.full_like(ids, -100)
    labels[:, -1] = key
    return {"input_ids": ids, "labels": labels}


def corrupted():
    """The trained model and the batch whose key is 23 (the run that gets patched)."""
    return _train(), _batch(23)


def clean():
    """The batch whose key is 17 (the activations patched in)."""
    return _batch(17)
