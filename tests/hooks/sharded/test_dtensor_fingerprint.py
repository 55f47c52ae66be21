"""The checksums ``hooks.sharded.stats`` uses to tell a replica (the same tensor on two ranks,
counted once) from a shard or another rank's data (counted on each): equal bits give equal
checksums; a reordering, or a structured difference that a position-weighted sum misses,
gives another one (hooks.sharded.replicas). The two-stage comparison across ranks is tested
in a real job: tests/hooks/sharded/test_dtensor_capture.py (scenarios ``fsdp_replicas``,
``fsdp_probes`` and ``fsdp_tp_replicas``)."""

from __future__ import annotations

import torch

from hooks.sharded.replicas import Fingerprint, _shape_key, fill_cheap, position_checksum
from hooks.tensors.stats import HIST_SAMPLE
from tests.checksum_reference import checksum as _by_definition


def _fp(x: torch.Tensor) -> tuple[int, int]:
    return int(position_checksum(x)), _shape_key(x)


def test_the_checksum_is_its_definition_for_every_layout():
    g = torch.Generator().manual_seed(2)
    for shape in [(5,), (3, 7), (40, 33), (17, 16), (2, 20, 30), (3, 70000 // 3)]:
        x = torch.randn(shape, generator=g)  # (the last: several blocks of rows)
        assert int(position_checksum(x)) == _by_definition(x), shape
    h = torch.randn(24, 32, generator=g).to(torch.bfloat16)
    assert int(position_checksum(h)) == _by_definition(h)
    b = torch.rand(9, 4, generator=g) > 0.5
    assert int(position_checksum(b)) == _by_definition(b)
    assert int(position_checksum(torch.tensor(2.5))) == _by_definition(torch.tensor(2.5))
    ids = torch.randint(-2**62, 2**62, (70, 1000), generator=g)  # int64: read, never written
    kept = ids.clone()
    assert int(position_checksum(ids)) == _by_definition(ids) and torch.equal(ids, kept)


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


def test_structured_differences_a_position_weighted_sum_misses_are_told_apart():
    # one-hot masks with the same load per column and one 1 per row: equal row and column sums
    rows = 16
    a, b = torch.zeros(rows, 8), torch.zeros(rows, 8)
    a[torch.arange(rows), torch.arange(rows) % 8] = 1.0
    b[torch.arange(rows), torch.tensor([(i + 1) % 8 if i < 8 else (i - 1) % 8
                                        for i in range(rows)])] = 1.0
    assert torch.equal(a.sum(0), b.sum(0)) and torch.equal(a.sum(1), b.sum(1))
    assert not torch.equal(a, b) and _fp(a) != _fp(b)
    assert _fp(torch.eye(2)) != _fp(torch.eye(2).flip(0))
    # 5·1 + 7·2 + 6·3 == 6·1 + 5·2 + 7·3: a sum weighted by position + 1 collides
    assert _fp(torch.tensor([[5.0, 7.0, 6.0]])) != _fp(torch.tensor([[6.0, 5.0, 7.0]]))


def test_sign_flips_of_eight_byte_values_do_not_cancel():
    # read as int64, a flipped sign bit adds 2**63 times an odd weight: two such cancel
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 64, generator=g, dtype=torch.float64)
    y = x.clone()
    y[3, 5], y[40, 7] = -y[3, 5], -y[40, 7]
    assert _fp(x) != _fp(y)
    small = torch.randn(2, 2, generator=g, dtype=torch.float64)
    assert _fp(small) != _fp(-small)
    ids = torch.randint(0, 2**40, (8, 8), generator=g)
    flipped = ids.clone()
    flipped[0, 0] |= -(2**63)
    flipped[5, 1] |= -(2**63)
    assert _fp(ids) != _fp(flipped)
    fps = [Fingerprint.of(t.reshape(-1), t.reshape(-1), finite=True, hold=False)
           for t in (small, -small)]
    fill_cheap(fps)
    assert fps[0].cheap != fps[1].cheap and fps[0].shape == fps[1].shape


def test_blocks_of_columns_and_weights_past_the_cache_are_the_definition(monkeypatch):
    import hooks.sharded.replicas as dr

    monkeypatch.setattr(dr, "_CHUNK", 64)
    monkeypatch.setattr(dr, "_CACHED", 100)
    monkeypatch.setattr(dr, "_WEIGHTS", {})
    g = torch.Generator().manual_seed(7)
    for shape in [(1000,), (3, 150), (70, 9), (5, 30)]:
        x = torch.randn(shape, generator=g)
        assert int(position_checksum(x)) == _by_definition(x), shape
    d = torch.randn(300, generator=g, dtype=torch.float64)  # 600 halves, past the cache
    assert int(position_checksum(d)) == _by_definition(d)


def test_one_changed_element_or_another_shape_changes_the_fingerprint():
    x = torch.zeros(4, 6)
    y = x.clone()
    y[3, 5] = 1e-30
    assert _fp(x) != _fp(y)
    assert _fp(x)[1] != _fp(x.reshape(6, 4))[1]
    assert _fp(x)[1] != _fp(x.double())[1]
    assert _fp(torch.tensor([True, False]))[0] != _fp(torch.tensor([False, True]))[0]
    assert _fp(torch.zeros(0))[0] == 0


def test_the_checksum_leaves_the_storage_resizable():
    # FSDP2 frees and re-allocates an unsharded parameter's storage with resize_: a checksum
    # through numpy would have marked it not resizable, and the next step would fail
    x = torch.randn(64, 32)
    position_checksum(x)
    x.untyped_storage().resize_(0)
    assert x.untyped_storage().nbytes() == 0


def test_sample_checksums_taken_all_at_once_equal_each_samples_own():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) for n in (1, 7, HIST_SAMPLE)]
    xs.append(torch.randn(50, generator=g, dtype=torch.float64))
    fps = [Fingerprint.of(x, x, finite=True, hold=True) for x in xs]
    fill_cheap(fps)
    assert [fp.cheap for fp in fps] == [_by_definition(x) for x in xs]
    # a piece no larger than its sample, of a dtype fp32 holds, is compared from it alone
    assert all(fp.exact for fp in fps)
    assert [fp.whole() for fp in fps] == [fp.cheap for fp in fps]


def test_a_sample_is_not_the_piece_where_fp32_rounds_it_or_it_skips_non_finite_values():
    ids = torch.tensor([2**24 + 1, 3, 4])  # int64 past 2**24: its fp32 sample rounds
    fp = Fingerprint.of(ids, ids.float(), finite=True, hold=False)
    assert not fp.exact and fp.full == _by_definition(ids)
    z = torch.tensor([1.0, float("nan"), 2.0])
    fp = Fingerprint.of(z, z[~z.isnan()], finite=False, hold=False)
    assert not fp.exact and fp.full == _by_definition(z)


def test_a_larger_piece_is_held_and_its_whole_checksum_is_lost_once_changed():
    x = torch.randn(3 * HIST_SAMPLE, generator=torch.Generator().manual_seed(4))
    fp = Fingerprint.of(x, x[::5].clone(), finite=True, hold=True)
    assert fp.held is x and not fp.exact
    assert fp.whole() == _by_definition(x)
    y = x.clone()
    fq = Fingerprint.of(y, y[::5].clone(), finite=True, hold=True)
    y.mul_(2)  # written in place: its version moves
    assert fq.whole() is None
    w = x.clone()
    fw = Fingerprint.of(w, w[::5].clone(), finite=True, hold=True)
    w.untyped_storage().resize_(0)  # freed as FSDP2 frees a parameter: no version bump
    assert fw.whole() is None
    # a piece that may not be held (a host copy, past the budget) or an inference tensor
    z = x.clone()
    assert Fingerprint.of(z, z[::5].clone(), finite=True, hold=False).full == _by_definition(z)
    with torch.inference_mode():
        i = x.clone()
    fi = Fingerprint.of(i, i[::5].clone(), finite=True, hold=True)
    assert fi.held is None and fi.full == _by_definition(i)


def test_held_storages_are_counted_once_and_whole_within_the_budget(monkeypatch):
    import hooks.sharded.stats as ds

    storage = 16 * HIST_SAMPLE * 4  # bytes of the big tensor's storage
    monkeypatch.setattr(ds, "MAX_HELD_BYTES", storage + 4 * HIST_SAMPLE * 4)
    ms = ds.MeshStats(None)
    head = [0.0] * 7  # finite (no NaN, no Inf)
    big = torch.randn(16 * HIST_SAMPLE, generator=torch.Generator().manual_seed(5))
    view = big[:2 * HIST_SAMPLE]  # a small view keeps its whole storage alive
    for _ in range(2):  # the same storage twice: counted once, whole
        assert ms._fingerprint(view, head, view[::5].clone(), True).held is view
        assert ms._held == storage
    own = torch.randn(4 * HIST_SAMPLE)  # fits: one more storage of 4·HIST_SAMPLE
    assert ms._fingerprint(own, head, own[::5].clone(), True).held is own
    late = torch.randn(2 * HIST_SAMPLE)  # past the budget: checksummed whole at once
    fp = ms._fingerprint(late, head, late[::5].clone(), True)
    assert fp.held is None and fp.full == _by_definition(late)


def test_a_held_piece_refilled_at_the_same_address_is_lost():
    # FSDP2 frees an unsharded parameter's storage and gathers it again: the same size,
    # often the same address, no version bump; the sample, taken again, tells
    from hooks.tensors.stats import hist_sample

    x = torch.randn(3 * HIST_SAMPLE, generator=torch.Generator().manual_seed(8))
    sample, k = hist_sample(x, x.shape[-1])
    fp = Fingerprint.of(x, sample[:k], finite=True, hold=True)
    with torch.no_grad():
        x.data.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(9)))
    assert x._version == fp.version  # (a write through .data moves no version)
    assert fp.whole() is None
    y = torch.randn(3 * HIST_SAMPLE, generator=torch.Generator().manual_seed(10))
    sample, k = hist_sample(y, y.shape[-1])
    assert Fingerprint.of(y, sample[:k], finite=True, hold=True).whole() == _by_definition(y)
