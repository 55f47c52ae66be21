"""The exact two-pass route of ``hooks.tensors.stats`` (taken where ``Σx²`` and ``Σx`` would cancel,
``|mean| >> std``, or overflow fp32): its std against ``torch.std`` (Bessel's correction, as
:class:`hooks.tensors.stats.TensorStats` documents) of the same values in fp64, tightly, on tensors
small enough that ``n`` for ``n − 1`` is visible (the existing test's 4,096 elements and 1e-3
tolerance could not see it)."""

from __future__ import annotations

import pytest
import torch

import hooks


@pytest.mark.parametrize("n", [2, 7, 50])
def test_a_mean_that_dwarfs_the_spread_gives_torch_s_std(n):
    g = torch.Generator().manual_seed(n)
    x = 1000.0 + 1e-3 * torch.randn(n, generator=g)
    st = hooks.summarize_tensor(x)
    xd = x.double()
    assert st.std == pytest.approx(float(xd.std(correction=1)), rel=1e-9)
    assert st.mean == pytest.approx(float(xd.mean()), rel=1e-12)


def test_values_whose_squares_overflow_fp32_give_torch_s_std():
    g = torch.Generator().manual_seed(5)
    x = 3e19 * torch.randn(20, generator=g)  # finite, but x² > fp32's max
    assert not torch.isfinite(torch.dot(x, x))
    st = hooks.summarize_tensor(x)
    xd = x.double()
    assert st.std == pytest.approx(float(xd.std(correction=1)), rel=1e-9)
    assert st.l2 == pytest.approx(float(xd.norm()), rel=1e-9)
