"""The checksums ``hooks.dtensor_stats`` uses to tell a replica (the same tensor on two ranks,
counted once) from a shard or another rank's data (counted on each): equal bits give equal
checksums; a reordering of the same elements gives another one (hooks.dtensor_replicas).
The two-stage comparison across ranks is tested in a real job: tests/hooks/test_dtensor_capture.py
(scenario ``fsdp_replicas``)."""

from __future__ import annotations

import torch

from hooks.dtensor_replicas import Fingerprint, _shape_key, fill_cheap, position_checksum
from hooks.stats import HIST_SAMPLE


def _fp(x: torch.Tensor) -> tuple[int, int]:
    return int(position_checksum(x)), _shape_key(x)


def _by_definition(x: torch.Tensor) -> int:
    """sum of bits(x_i) * (i + 1), wrapped to int64, with Python integers."""
    ints = {4: torch.int32, 8: torch.int64, 2: torch.int16}[x.element_size()]
    v = sum(b * (i + 1) for i, b in enumerate(x.reshape(-1).view(ints).tolist()))
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


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


def test_the_checksum_is_its_definition_for_every_layout_the_fast_paths_take():
    g = torch.Generator().manual_seed(2)
    for shape in [(5,), (3, 7), (40, 33), (17, 16), (16, 17), (2, 20, 30)]:
        x = torch.randn(shape, generator=g)
        assert int(position_checksum(x)) == _by_definition(x), shape
    h = torch.randn(24, 32, generator=g).to(torch.bfloat16)
    assert int(position_checksum(h)) == _by_definition(h)


def test_sample_checksums_taken_all_at_once_equal_each_samples_own():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) for n in (1, 7, HIST_SAMPLE)]
    xs.append(torch.randn(50, generator=g, dtype=torch.float64))
    fps = [Fingerprint.of(x, x, hold=True) for x in xs]
    fill_cheap(fps)
    assert [fp.cheap for fp in fps] == [_by_definition(x) for x in xs]
    # a piece no larger than its sample is compared whole from the sample alone
    assert [fp.whole() for fp in fps] == [fp.cheap for fp in fps]


def test_a_larger_piece_is_held_and_its_whole_checksum_is_lost_once_written_in_place():
    x = torch.randn(3 * HIST_SAMPLE, generator=torch.Generator().manual_seed(4))
    fp = Fingerprint.of(x, x[::5].clone(), hold=True)
    assert fp.held is x
    assert fp.whole() == _by_definition(x)
    y = x.clone()
    fq = Fingerprint.of(y, y[::5].clone(), hold=True)
    y.mul_(2)
    assert fq.whole() is None
    # a piece that may not be held (a host copy of a device tensor) or holds NaN: whole now
    z = x.clone()
    assert Fingerprint.of(z, z[::5].clone(), hold=False).full == _by_definition(z)
    z[0] = float("nan")
    assert Fingerprint.of(z, None, hold=True).full == _by_definition(z)
