"""hooks.tensors.stats: every statistic against torch's own reductions on known tensors."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import hooks
from hooks.tensors.stats import (
    BACKGROUND_MIN_NUMEL,
    HIST_SAMPLE,
    NUM_BINS,
    ZERO_EXACT_NUMEL,
    StatsBatch,
    TensorStats,
)


def reference(x: torch.Tensor) -> dict[str, float]:
    """Each statistic computed the obvious way, one torch reduction each, in fp64."""
    x = x.detach().double().reshape(-1)
    return {
        "mean": x.mean().item(),
        "std": x.std().item() if x.numel() > 1 else 0.0,
        "min": x.min().item(),
        "max": x.max().item(),
        "abs_max": x.abs().max().item(),
        "l2": torch.linalg.vector_norm(x).item(),
        "zero_frac": (x == 0).double().mean().item(),
    }


def assert_matches(st: TensorStats, x: torch.Tensor, rtol: float = 1e-5) -> None:
    ref = reference(x)
    for k, v in ref.items():
        assert getattr(st, k) == pytest.approx(v, rel=rtol, abs=1e-6), k


@pytest.mark.parametrize("sync_free", [False, True])
def test_known_tensor_matches_torch_reductions(sync_free):
    torch.manual_seed(0)
    x = torch.randn(23, 41) * 2.5 + 0.7  # at most HIST_SAMPLE elements: exact histogram
    x[0, :5] = 0.0
    x[3, 7] = -0.0  # negative zero is a zero too
    assert x.numel() <= HIST_SAMPLE
    batch = StatsBatch(sync_free=sync_free)
    slot = batch.add(x)
    st = batch.finalize()[slot]
    assert st.numel == x.numel()
    assert_matches(st, x)
    assert st.zero_frac == pytest.approx(6 / x.numel())
    assert st.nan_count == 0 and st.inf_count == 0 and st.finite
    # the histogram is torch.histc over [min, max] with the default 32 bins
    ref_hist = torch.histc(x, bins=NUM_BINS, min=x.min().item(), max=x.max().item())
    assert st.hist == ref_hist.long().tolist()
    assert sum(st.hist) == st.hist_count == x.numel()
    assert (st.hist_min, st.hist_max) == (x.min().item(), x.max().item())


def test_hand_computed_values():
    st = hooks.summarize_tensor(torch.tensor([[3.0, -4.0], [0.0, 1.0]]))
    assert st.mean == pytest.approx(0.0)
    assert st.min == -4.0 and st.max == 3.0 and st.abs_max == 4.0
    assert st.l2 == pytest.approx(math.sqrt(26.0))
    assert st.std == pytest.approx(math.sqrt(26.0 / 3.0))
    assert st.zero_frac == 0.25


@pytest.mark.parametrize("sync_free", [False, True])
def test_nan_and_inf_counted_and_excluded(sync_free):
    x = torch.arange(12, dtype=torch.float32)
    x[2] = float("nan")
    x[5] = float("inf")
    x[7] = float("-inf")
    x[9] = float("nan")
    batch = StatsBatch(sync_free=sync_free)
    slot = batch.add(x)
    st = batch.finalize()[slot]
    assert st.nan_count == 2 and st.inf_count == 2 and not st.finite
    finite = x[torch.isfinite(x)]
    assert_matches(st, finite)
    assert sum(st.hist) == finite.numel()


def test_all_nonfinite_and_empty():
    st = hooks.summarize_tensor(torch.full((4,), float("nan")))
    assert st.nan_count == 4 and st.mean is None and st.hist == []
    st = hooks.summarize_tensor(torch.empty(0, 3))
    assert st.numel == 0 and st.mean is None and st.finite


def test_integer_bool_half_and_double_tensors():
    ids = torch.tensor([[1, 5, 0], [2, 2, 9]])
    assert_matches(hooks.summarize_tensor(ids), ids)
    mask = torch.tensor([True, False, True, True])
    assert hooks.summarize_tensor(mask).zero_frac == 0.25
    h = torch.randn(64, dtype=torch.bfloat16)
    assert_matches(hooks.summarize_tensor(h), h.float())
    d = torch.randn(50, dtype=torch.float64)
    assert_matches(hooks.summarize_tensor(d), d, rtol=1e-9)


def test_mean_much_larger_than_std_keeps_precision():
    # sum/sum-of-squares would cancel catastrophically here; the exact fallback must kick in.
    torch.manual_seed(1)
    x = 1000.0 + torch.randn(4096) * 1e-3
    st = hooks.summarize_tensor(x)
    assert st.std == pytest.approx(x.double().std().item(), rel=1e-3)
    assert st.mean == pytest.approx(x.double().mean().item(), rel=1e-7)


def test_constant_tensor_histogram_range_widened_like_histc():
    x = torch.full((10,), 2.0)
    st = hooks.summarize_tensor(x)
    assert st.std == 0.0 and (st.hist_min, st.hist_max) == (1.0, 3.0)
    assert st.hist == torch.histc(x, bins=NUM_BINS, min=2.0, max=2.0).long().tolist()


def test_large_tensor_exact_scalars_sampled_histogram():
    torch.manual_seed(2)
    x = torch.randn(64, 1000)  # > HIST_SAMPLE elements
    st = hooks.summarize_tensor(x)
    assert_matches(st, x)
    assert st.hist_count == sum(st.hist) <= HIST_SAMPLE + 1
    # The sample's histogram has the shape of the full one (within sampling noise).
    full = torch.histc(x, bins=NUM_BINS, min=st.hist_min, max=st.hist_max)
    frac_full = full / full.sum()
    frac_sample = torch.tensor(st.hist, dtype=torch.float32) / st.hist_count
    assert (frac_full - frac_sample).abs().max().item() < 0.02


@pytest.mark.parametrize("n", [32, 500, 1024])
def test_std_within_1e6_of_fp64_when_the_mean_is_large_against_it(n):
    """The one-pass variance loses digits as |mean| grows against std; past CANCELLATION_MAX
    the exact fp64 route takes over, so std stays within 1e-6 of torch's fp64 std whatever the
    shift (at mean/std = 30 the old threshold left 1e-4)."""
    g = torch.Generator().manual_seed(n)
    worst = 0.0
    for shift in (0.0, 0.5, 1.0, 1.5, 1.7, 2.0, 3.0, 5.0, 10.0, 30.0):
        for _ in range(40):
            x = torch.randn(n, generator=g) - shift
            ref = x.double().std().item()
            worst = max(worst, abs(hooks.summarize_tensor(x).std - ref) / ref)
    assert worst < 1e-6


def test_zero_count_exact_when_small_or_when_the_sample_shows_zeros():
    torch.manual_seed(3)
    # ReLU output (about half zeros), far larger than ZERO_EXACT_NUMEL: counted exactly
    r = torch.relu(torch.randn(512, 768))
    st = hooks.summarize_tensor(r)
    assert st.zero_exact and st.zero_frac == (r == 0).double().mean().item()
    # one zero row among 512 rows of 768: the sample's stride is shorter than a row, so the
    # row is seen and the zeros are counted exactly
    g = torch.randn(512, 768)
    g[137] = 0
    st = hooks.summarize_tensor(g)
    assert st.zero_exact and st.zero_frac == 768 / g.numel()
    # a single zero in a small tensor: exact
    s = torch.randn(ZERO_EXACT_NUMEL)
    s[5] = 0
    st = hooks.summarize_tensor(s)
    assert st.zero_exact and st.zero_frac == 1 / s.numel()
    # no zero at all in a large tensor: not counted, said so, and the rest is still exact
    big = torch.randn(300, 1000).abs_().add_(0.1)
    st = hooks.summarize_tensor(big)
    assert not st.zero_exact and st.zero_frac == 0.0
    assert_matches(st, big)
    assert TensorStats.from_dict(st.to_dict()) == st
    # a non-finite tensor takes the exact path
    big[0, 0] = float("nan")
    st = hooks.summarize_tensor(big)
    assert st.zero_exact and st.nan_count == 1 and st.zero_frac == 0.0


@pytest.mark.parametrize(
    "values",
    [([1e8] * 3, torch.float32), ([-(2.0**25)] * 5, torch.float32),
     ([-3e38, 0.0, 3e38], torch.float32), ([float("inf"), 1e8, 1e8], torch.float32),
     ([1e20] * 4, torch.float64), ([-1.5e308, 0.0, 1.5e308], torch.float64)],
    ids=["constant-1e8", "constant--2^25", "range-overflows", "inf-and-constant",
         "fp64-constant-1e20", "fp64-range-overflows"],
)
def test_degenerate_ranges_bin_like_histc_in_fp64(values):
    """A range that is 0 or infinite in its dtype (lo - 1 == lo at 1e8 in fp32) once crashed
    bincount. The reference bins each value by histc's rule in Python floats, on halved values
    so that the width stays finite (torch.histc itself returns all zeros there); a constant
    whose +-1 range vanished goes to the middle bin, as histc puts it."""
    values, dtype = values
    x = torch.tensor(values, dtype=dtype)
    st = hooks.summarize_tensor(x)
    assert sum(st.hist) == st.hist_count == int(torch.isfinite(x).sum())
    finite = x[torch.isfinite(x)].double()
    if st.hist_min == st.hist_max:  # the +-1 widening vanished: all in the middle bin
        assert st.hist[NUM_BINS // 2] == finite.numel()
        return
    lo, hi = st.hist_min / 2, st.hist_max / 2
    ref = [0] * NUM_BINS
    for v in finite.tolist():
        ref[min(max(int((v / 2 - lo) / (hi - lo) * NUM_BINS), 0), NUM_BINS - 1)] += 1
    assert st.hist == ref


def test_degenerate_range_inside_a_capture_keeps_the_trace():
    class Const(torch.nn.Module):
        def forward(self, x):
            return x * 0 + 1e8

    model = Const()
    with hooks.capture(model) as trace:
        model(torch.randn(4, 3))
    assert trace.forward[0].outputs[0].stats.hist_count == 12


def test_non_contiguous_and_requires_grad_inputs():
    w = torch.randn(8, 6, requires_grad=True)
    st = hooks.summarize_tensor(w.t())
    assert_matches(st, w.t())
    assert w.grad is None  # summarising never builds a graph


def test_summarize_rejects_complex_and_non_tensors():
    with pytest.raises(TypeError):
        hooks.summarize_tensor(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError):
        hooks.summarize_tensor([1.0, 2.0])  # type: ignore[arg-type]


def test_round_trip_dict_encodes_nonfinite_as_strings():
    x = torch.tensor([1.0, float("inf")])
    st = hooks.summarize_tensor(x)
    d = st.to_dict()
    assert TensorStats.from_dict(d) == st
    st2 = TensorStats(numel=1, mean=float("nan"))
    assert st2.to_dict()["mean"] == "nan"
    assert math.isnan(TensorStats.from_dict(st2.to_dict()).mean)


def test_uncounted_zero_fraction_is_not_compared_by_diff():
    big = torch.randn(300, 1000).abs_().add_(0.1)
    st = hooks.summarize_tensor(big)
    assert not st.zero_exact and st.values()["zero_frac"] is None
    small = hooks.summarize_tensor(torch.tensor([0.0, 1.0]))
    assert small.zero_exact and small.values()["zero_frac"] == 0.5


# -- background batches: the worker thread, and in-place writes after add ---------------------
def _gate(batch: StatsBatch) -> threading.Event:
    """Hold the shared worker until the returned event is set (jobs run in order)."""
    gate = threading.Event()
    batch.submit(lambda _: gate.wait(10), None)
    return gate


def _background_and_inline(xs):
    """(background batch's results, the inline batch's, the background slots) of ``xs``."""
    bg, inline = StatsBatch(background=True), StatsBatch()
    slots = [bg.add(x) for x in xs]
    for x in xs:
        inline.add(x)
    return bg.finalize(), inline.finalize(), slots


def test_background_batch_matches_torch_reductions_and_the_inline_batch():
    torch.manual_seed(0)
    xs = [torch.randn(64, 96) * 3 + 1, torch.randn(4, 128, 32).half(), torch.rand(3, 7)]
    xs[0][5] = 0.0
    got, ref, slots = _background_and_inline(xs)
    for slot, x, r in zip(slots, xs, ref, strict=True):
        assert_matches(got[slot], x.float())
        assert got[slot].hist == r.hist and got[slot].hist_count == r.hist_count
    assert got[slots[0]].zero_frac == pytest.approx(96 / xs[0].numel())


def test_background_batch_drops_a_tensor_written_in_place_before_the_worker_read_it():
    torch.manual_seed(1)
    batch = StatsBatch(background=True)
    gate = _gate(batch)
    x, y, z = torch.randn(64, 128), torch.randn(64, 128), torch.randn(64, 128)
    y_before = y.clone()
    sx, sy, sz = batch.add(x), batch.add(y), batch.add(z)
    x.mul_(2.0)  # the worker has not read x yet
    z.view(-1)[:10].add_(1.0)  # through a view: the version counter is shared
    gate.set()
    batch.drain()
    assert batch.modified == [sx, sz]
    out = batch.finalize()
    assert out[sx] is None and out[sz] is None
    assert_matches(out[sy], y_before)


def test_background_batch_keeps_values_written_after_the_drain():
    torch.manual_seed(2)
    batch = StatsBatch(background=True)
    x = torch.randn(96, 64)
    before = x.clone()
    slot = batch.add(x)
    batch.drain()
    x.zero_()  # after the drain: the statistics are those of the values added
    assert_matches(batch.finalize()[slot], before)
    assert batch.modified == []


def test_small_tensors_and_sync_adds_are_summarised_at_once():
    batch = StatsBatch(background=True)
    gate = _gate(batch)
    small = torch.randn(BACKGROUND_MIN_NUMEL - 1)
    big = torch.randn(BACKGROUND_MIN_NUMEL)
    ref_small, ref_big = small.clone(), big.clone()
    s1, s2 = batch.add(small), batch.add(big, sync=True)
    small.fill_(3.0)
    big.fill_(3.0)
    gate.set()
    out = batch.finalize()
    assert_matches(out[s1], ref_small)
    assert_matches(out[s2], ref_big)


def test_worker_runs_one_torch_thread_and_leaves_the_callers_count():
    from hooks.tensors.stats import _Worker

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        worker = _Worker()
        seen: list[int] = []
        done = threading.Event()
        worker.put(lambda _: seen.append(torch.get_num_threads()), None)
        worker.put(threading.Event.set, done, urgent=True)
        assert done.wait(10)
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [1] and torch.get_num_threads() == 2 and later == [2]
    finally:
        torch.set_num_threads(before)


def test_background_batch_bins_on_the_worker_like_the_inline_batch():
    torch.manual_seed(3)
    xs = [torch.randn(40, 64) * (i + 1) + i for i in range(150)]  # > _BIN_EVERY per batch
    got, ref, slots = _background_and_inline(xs)
    for slot, x, r in zip(slots, xs, ref, strict=True):
        st = got[slot]
        assert_matches(st, x)
        assert st.hist == r.hist and sum(st.hist) == st.hist_count == r.hist_count > 0
