"""Will it fit: the bytes extrapolated from two small steps against a real step at the target
size, counted independently (the test's own saved-tensor hooks, the gradients and Adam's state
after a real ``step()``): within 10%."""

from __future__ import annotations

import pytest
import torch

import hooks
from hooks.whatif.memory_fit import Measured, extrapolate
from minillm import MiniLLM, MiniLLMConfig


def _model(attn: str) -> MiniLLM:
    """``moe``: SDPA attention and 8 experts (top-2), as the default preset."""
    torch.manual_seed(0)
    cfg = MiniLLMConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=8 if attn == "moe" else 0, num_experts_per_tok=2,
                        max_position_embeddings=512,
                        attn_implementation="sdpa" if attn == "moe" else attn)
    return MiniLLM(cfg).train()


def _ids(b: int, t: int) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(b * 1000 + t))


def _measure(attn: str, b: int, t: int) -> Measured:
    model = _model(attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids(b, t)
    with hooks.capture(model, optimizer=opt) as tr:
        model(ids, labels=ids).loss.backward()
    return Measured(b, t, tr.memory)


def _real(attn: str, b: int, t: int) -> int:
    """Saved storages (each once, counted here) + parameters + buffers + gradients + AdamW's
    state after a real step, at b × t."""
    model = _model(attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids(b, t)
    seen: set[int] = set()
    keep = []
    saved = 0

    def pack(x):
        nonlocal saved
        keep.append(x.detach())
        st = x.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            saved += st.nbytes()
        return x.detach()

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {x.untyped_storage().data_ptr() for x in model.buffers()}
    seen |= weights  # parameters and buffers are counted below, once
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(x.untyped_storage().nbytes() for x in model.buffers())
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values())
    return saved + params + buffers + grads + state


@pytest.mark.parametrize("attn", ["eager", "sdpa", "moe"])
def test_extrapolated_bytes_within_ten_percent_of_a_real_step(attn):
    est = extrapolate(_measure(attn, 1, 24), _measure(attn, 2, 48), 4, 256)
    real = _real(attn, 4, 256)
    assert abs(est.total - real) <= 0.10 * real, (est.total, real, est.steps)
    if attn == "eager":  # the quadratic term carries the probabilities: B·H·T² fp32 per layer
        assert est.terms["attention"] == pytest.approx(2 * 4 * 4 * 256 * 256 * 4, rel=1e-9)
    else:
        assert est.terms["attention"] == 0


def test_bad_sizes_and_missing_records():
    m = _measure("sdpa", 1, 8)
    with pytest.raises(ValueError, match="positive"):
        extrapolate(m, m, 0, 8)
    with pytest.raises(ValueError, match="no memory record"):
        extrapolate(Measured(1, 8, None), m, 2, 8)
