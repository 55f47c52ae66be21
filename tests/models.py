"""The test scaffold for tiny models: the configs, models, batches, workloads and overfit
sessions that many tests share, built in one place.

- :func:`tiny` / :func:`batch_for`: the ``tiny`` preset (V=256, D=32, 2 layers, H=4, Hkv=2,
  4 experts top-2) and a seeded (B, T) batch;
- :func:`tiny_config` / :func:`tiny_setup`: a smaller MoE (V=11, D=16, 1 layer, 2 experts top-1)
  with its AdamW, for training-loop tests that must run thousands of steps;
- :data:`TINY_TOML`: that size as a config file, for ``mdb overfit --config``;
- :func:`tiny_workload`: what ``mdb step --preset tiny`` builds;
- :func:`tiny_session`: an ``mdb overfit`` session (2 layers, 4 experts top-2) in a fresh store.

The broken variants the doctor must catch are in :mod:`tests.zoo`, HF and nanoGPT models in
:mod:`tests.families`.
"""

from __future__ import annotations

import argparse

import torch

from minillm import MiniLLM, MiniLLMConfig, load_preset

#: Length of :func:`batch_for`'s batches.
SEQ = 64

#: A minimal MoE config for training tests that must run thousands of steps quickly.
TINY_TOML = """\
vocab_size = 256
hidden_size = 16
intermediate_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
num_local_experts = 2
num_experts_per_tok = 1
max_position_embeddings = 128
"""

#: The text of :func:`tiny_session`.
SESSION_TEXT = "人工智能正在改变世界。" * 3


def tiny(**changes) -> MiniLLM:
    """The ``tiny`` preset (seeded), with ``changes`` to its config."""
    torch.manual_seed(0)
    cfg = load_preset("tiny")
    if changes:
        cfg = cfg.replace(**changes)
    return MiniLLM(cfg)


def batch_for(model: MiniLLM, b: int = 2, t: int = SEQ) -> dict:
    """A seeded (b, t) batch of token ids for ``model``, its own labels."""
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, model.config.vocab_size, (b, t), generator=g)
    return {"input_ids": ids, "labels": ids}


def tiny_config(vocab: int = 11, **kw) -> MiniLLMConfig:
    """V=``vocab``, D=16, 1 layer, H=2, Hkv=1, 2 experts top-1, 64 positions (``kw`` changes)."""
    base = dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                num_experts_per_tok=1, max_position_embeddings=64)
    base.update(kw)
    return MiniLLMConfig(**base)


def tiny_setup(seed: int = 0, layers: int = 1):
    """(model, batch, AdamW lr 1e-2) of :func:`tiny_config` with ``layers`` layers; the batch
    is a seeded (2, 12)."""
    torch.manual_seed(seed)
    cfg = tiny_config(num_hidden_layers=layers)
    model = MiniLLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, batch, opt


def tiny_workload(seq_len: int = 16):
    """The workload of ``mdb step --preset tiny --seq-len SEQ_LEN``."""
    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return build_workload(parser.parse_args(["--preset", "tiny", "--seq-len", str(seq_len)]))


def tiny_session(tmp_path, steps: int = 20, name: str = "live", **kw):
    """An ``mdb overfit`` session named ``name`` of ``steps`` steps (V=16, D=32, 2 layers,
    4 experts top-2, lr 1e-2, a sample every 5 steps) in a new store ``tmp_path/mdb.sqlite``;
    ``kw`` are more :class:`hooks.train.overfit.OverfitOptions`."""
    from hooks.store.store import RunStore
    from hooks.train.overfit import OverfitOptions, OverfitSession

    cfg = MiniLLMConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    opts = OverfitOptions(text=SESSION_TEXT, model_config=cfg.to_dict(), steps=steps, lr=1e-2,
                          sample_every=5, every=0, **kw)
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    return OverfitSession.create(store, name, opts)
