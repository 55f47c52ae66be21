"""The checksum ``hooks.dtensor_stats`` uses to tell a replica (the same tensor on two ranks,
counted once) from a shard or another rank's data (counted on each): equal bits give equal
checksums; a reordering of the same elements gives another one."""

from __future__ import annotations

import torch

from hooks.dtensor_stats import MeshStats


def _fp(x: torch.Tensor) -> tuple[int, int]:
    bits, shape = MeshStats._fingerprint(x)
    return int(bits), shape


def test_equal_tensors_have_equal_fingerprints_and_a_copy_is_one():
    x = torch.randn(2, 33, 16, generator=torch.Generator().manual_seed(0))
    assert _fp(x) == _fp(x.clone()) == _fp(x.transpose(0, 1).contiguous().transpose(0, 1))


def test_the_embeddings_of_a_cyclic_shift_of_the_same_tokens_differ():
    # the windows of a periodic text: the same characters, shifted; their embeddings hold the
    # same multiset of rows, so the plain sum of their bit patterns is the same
    table = torch.randn(11, 8, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(33) % 11
    a, b = table[ids], table[torch.roll(ids, 3)]
    assert not torch.equal(a, b)
    assert a.view(torch.int32).sum(dtype=torch.int64) == b.view(torch.int32).sum(
        dtype=torch.int64)
    assert _fp(a) != _fp(b)


def test_one_changed_element_or_another_shape_changes_the_fingerprint():
    x = torch.zeros(4, 6)
    y = x.clone()
    y[3, 5] = 1e-30
    assert _fp(x) != _fp(y)
    assert _fp(x)[1] != _fp(x.reshape(6, 4))[1]
    assert _fp(torch.tensor([True, False]))[0] != _fp(torch.tensor([False, True]))[0]
    assert _fp(torch.zeros(0))[0] == 0
