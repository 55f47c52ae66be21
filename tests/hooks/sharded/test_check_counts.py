"""How many tensors a cross-rank check compares: only those two ranks or more hold under one
name (``hooks.sharded.checksums.shared_names``); a shard one rank alone holds is not."""

from __future__ import annotations

from hooks.sharded.checksums import compare_checksums, shared_names


def test_a_tensor_parallel_check_counts_only_the_replicated_tensors():
    # 7 parameters: 4 replicated (one name on both ranks), 3 split (one shard per rank)
    replicated = ["embed.weight", "norm.weight", "router.weight", "lm_head.weight"]
    split = ["q_proj.weight", "o_proj.weight", "up_proj.weight"]
    by_rank = {r: {**{n: 7 for n in replicated},
                   **{f"{n} [shard {r}]": 100 + r for n in split}} for r in (0, 1)}
    held = {n for n in set(by_rank[0]) | set(by_rank[1])
            if n in by_rank[0] and n in by_rank[1]}
    assert shared_names(by_rank) == replicated and set(replicated) == held
    assert compare_checksums(by_rank) == []  # the shards' different sums are not compared


def test_fsdp2_shards_leave_nothing_to_compare_and_hsdp_replicas_everything():
    names = ["w1.weight", "w1.bias"]
    fsdp = {r: {f"{n} [shard {r}]": r for n in names} for r in (0, 1)}
    assert shared_names(fsdp) == []
    hsdp = {r: {f"{n} [shard 0]": 5 for n in names} for r in (0, 1)}
    hsdp[1]["w1.bias [shard 0]"] = 6
    assert shared_names(hsdp) == ["w1.weight [shard 0]", "w1.bias [shard 0]"]
    assert [d[0] for d in compare_checksums(hsdp)] == ["w1.bias [shard 0]"]
    # a third rank holding one more replica: still each name once
    hsdp[2] = {"w1.weight [shard 0]": 5}
    assert shared_names(hsdp) == ["w1.weight [shard 0]", "w1.bias [shard 0]"]


def test_a_gradient_missing_on_every_rank_is_not_counted_as_compared():
    # a frozen parameter the optimizer holds: no gradient on any rank; nothing was compared
    by_rank = {r: {"frozen.weight": None, "w": 9} for r in (0, 1)}
    assert shared_names(by_rank) == ["w"]
    only = {r: {"frozen.weight": None} for r in (0, 1)}
    assert shared_names(only) == [] and compare_checksums(only) == []
    # missing on one rank only: compared, and a difference
    odd = {0: {"g": None}, 1: {"g": 4}}
    assert shared_names(odd) == ["g"] and [d[0] for d in compare_checksums(odd)] == ["g"]


class _Mesh:
    def __init__(self, coord):
        self.coord = coord

    def get_coordinate(self):
        return self.coord


class _Shard:
    def is_replicate(self):
        return False


class _FakeDTensor:
    """What replica_key reads of a DTensor parameter: its mesh coordinate and placements."""

    def __init__(self, coord):
        self._local_tensor, self.grad = None, None
        self.device_mesh, self.placements = _Mesh([coord]), [_Shard()]


def test_a_missing_gradient_of_a_sharded_parameter_is_named_as_its_shard():
    from hooks.sharded.checksums import grads_by_key

    keyed = {r: dict(grads_by_key([("w", _FakeDTensor(r))])) for r in (0, 1)}
    assert keyed == {0: {"w [shard 0]": None}, 1: {"w [shard 1]": None}}
    assert shared_names(keyed) == []  # FSDP2: one shard per rank, nothing compared
