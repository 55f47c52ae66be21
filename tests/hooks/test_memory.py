"""``trace.memory`` (hooks.engine.memory) against independent references: the saved bytes as
counted here with saved_tensors_hooks of the test's own, PyTorch's MemTracker per module, the
optimizer's real state after a step, and the timeline's own maximum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hooks
from minillm import MiniLLM, MiniLLMConfig


def _model(attn: str = "eager", experts: int = 0) -> MiniLLM:
    torch.manual_seed(0)
    cfg = MiniLLMConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=experts, num_experts_per_tok=2,
                        max_position_embeddings=64, attn_implementation=attn)
    return MiniLLM(cfg).train()


def _ids(b: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(1))


def _reference_saved(model: nn.Module, ids: torch.Tensor):
    """The test's own count: per module call (name, call index) the bytes of distinct
    storages autograd saved while it was the innermost module running, parameters and
    buffers apart; each storage once in the step (a storage autograd dropped during forward,
    a graph part that feeds no loss, is another storage than one allocated at its address
    later: both count)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    stack: list[tuple[str, int]] = []
    counts: dict[str, int] = {}
    seen: set[int] = set()
    per_call: dict[tuple[str, int], int] = {}
    totals = {"act": 0, "param": 0}

    keep = []  # every saved storage alive until the end: no address is reused in the step

    def pack(t):
        keep.append(t.detach())
        st = t.untyped_storage()
        if st.data_ptr() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            kind = "param" if st.data_ptr() in weights else "act"
            totals[kind] += st.nbytes()
            if kind == "act" and stack:
                per_call[stack[-1]] = per_call.get(stack[-1], 0) + st.nbytes()
        return t.detach()

    handles = []
    for name, m in model.named_modules():
        def pre(mod, args, name=name):
            ci = counts.get(name, 0)
            counts[name] = ci + 1
            stack.append((name, ci))

        def post(mod, args, out):
            stack.pop()

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = model(ids, labels=ids).loss
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return per_call, totals


@pytest.mark.parametrize("attn,experts", [("eager", 0), ("sdpa", 4)])
def test_saved_bytes_equal_the_tests_own_count(attn, experts):
    model, ids = _model(attn, experts), _ids()
    ref, totals = _reference_saved(model, ids)
    model.zero_grad(set_to_none=True)
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    mem = tr.memory
    assert mem.saved_bytes == totals["act"] > 0
    assert sum(c.param_saved_bytes for c in mem.calls) == totals["param"] > 0
    mine = {tr.forward[c.call].key: c.saved_bytes for c in mem.calls if c.saved_bytes}
    assert mine == {k: v for k, v in ref.items() if v}
    if attn == "eager":  # each layer saves its (B, H, T, T) probabilities once
        assert mem.square_bytes == 2 * (2 * 4 * 16 * 16) * 4  # per layer: probs, fp32


def test_params_grads_and_adam_state_equal_the_tensors_themselves():
    model, ids = _model(), _ids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hooks.capture(model, optimizer=opt) as tr:  # before the first step: estimated
        model(ids, labels=ids).loss.backward()
    before = tr.memory
    opt.step()
    opt.zero_grad(set_to_none=False)
    with hooks.capture(model, optimizer=opt) as tr:
        model(ids, labels=ids).loss.backward()
    mem = tr.memory
    params = list(model.parameters())
    assert mem.param_bytes == sum(p.numel() * p.element_size() for p in params)
    assert mem.grad_bytes == sum(p.grad.untyped_storage().nbytes() for p in params)
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    assert mem.optimizer_bytes == state == before.optimizer_bytes
    assert all(p.estimated for p in before.params) and not any(p.estimated for p in mem.params)
    by_name = {p.name: p for p in mem.params}
    w = model.model.embed_tokens.weight
    assert by_name["model.embed_tokens.weight"].bytes == w.numel() * 4
    assert set(by_name["model.embed_tokens.weight"].state) == {"exp_avg", "exp_avg_sq", "step"}


def test_peak_is_the_timelines_maximum_and_what_is_alive_there_adds_up():
    model, ids = _model(), _ids(4, 32)
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    mem = tr.memory
    lives = [p.live_bytes for p in mem.timeline]
    assert mem.peak_bytes == max(lives) == lives[mem.peak_point]
    peak = mem.timeline[mem.peak_point]
    assert sum(a.bytes for a in mem.at_peak) == peak.saved_bytes - mem.unattributed_bytes
    assert peak.live_bytes == (mem.param_bytes + mem.buffer_bytes + peak.grad_bytes
                               + peak.saved_bytes)
    fwd = [p for p in mem.timeline if p.phase == "forward"]
    assert fwd[-1].saved_bytes == mem.saved_bytes  # every save alive when forward ends
    assert mem.timeline[-1].saved_bytes == 0  # backward released every one
    assert len(fwd) == len(tr.forward)


@pytest.mark.parametrize("attn,experts", [("eager", 0), ("sdpa", 4)])
def test_memtracker_per_module_retained_bytes(attn, experts):
    """PyTorch's MemTracker (torch.distributed._tools.mem_tracker, runs on CPU): per module
    call, the activation bytes alive after its forward less those before it equal the call's
    retained_bytes."""
    mt_mod = pytest.importorskip("torch.distributed._tools.mem_tracker")
    model, ids = _model(attn, experts), _ids()
    mt = mt_mod.MemTracker()  # its own step: it would count the capture's statistics too
    # the batch is known before the step: else MemTracker registers its storage as an
    # activation the first time an op returns a view of it (labels[:, 1:] in the loss)
    mt.track_external(model, ids)
    with mt:
        model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    act = "Activation"  # its reference types and module states are str enums
    theirs: dict[tuple[str, int], int] = {}
    for stats in mt.memory_tracking.values():
        pre = stats.snapshots["Pre-Forward"]
        post = stats.snapshots["Post-Forward"]
        name = stats.mod_fqn.split(".", 1)[1] if "." in stats.mod_fqn else ""
        for i, (a, b) in enumerate(zip(pre, post, strict=True)):
            dev = torch.device("cpu")
            theirs[(name, i)] = b.get(dev, {}).get(act, 0) - a.get(dev, {}).get(act, 0)
    by_call = tr.memory.call_bytes()
    mine = {r.key: by_call[r.index].retained_bytes if r.index in by_call else 0
            for r in tr.forward}
    assert set(mine) == set(theirs)
    assert mine == theirs


def test_in_place_write_to_a_saved_tensor_is_still_an_error():
    a = torch.randn(5, requires_grad=True)
    lin = nn.Linear(5, 5)
    with hooks.capture(lin):
        x = lin(a).sigmoid()
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            x.sum().backward()


def test_saved_outputs_are_not_kept_alive_by_the_accounting():
    import gc
    import weakref

    lin = nn.Linear(4, 4)
    with hooks.capture(lin):
        y = lin(torch.randn(2, 4)).exp()  # exp saves its own output
        ref = weakref.ref(y)
        del y
        gc.collect()
        assert ref() is None


def test_memory_off_and_old_traces(tmp_path):
    lin = nn.Linear(4, 4)
    with hooks.capture(lin, memory=False) as tr:
        lin(torch.randn(2, 4)).sum().backward()
    assert tr.memory is None
    with hooks.capture(lin) as tr:
        lin(torch.randn(2, 4)).sum().backward()
    tr.save(tmp_path / "t")
    assert hooks.Trace.load(tmp_path / "t").memory == tr.memory


def test_a_tampered_memory_record_is_one_format_error(tmp_path):
    import json

    lin = nn.Linear(4, 4)
    with hooks.capture(lin) as tr:
        lin(torch.randn(2, 4)).sum().backward()
    tr.save(tmp_path / "t")
    path = tmp_path / "t" / "trace.json"
    good = json.loads(path.read_text())
    for change, words in [(("peak_bytes", -1), "never negative"),
                          (("peak_bytes", 1), "largest live bytes"),
                          (("calls", [{"call": 99}]), "not one of the"),
                          (("calls", [{"call": "x"}]), "not of the type")]:
        data = json.loads(json.dumps(good))
        data["memory"][change[0]] = change[1]
        path.write_text(json.dumps(data))
        with pytest.raises(hooks.TraceFormatError, match=words):
            hooks.Trace.load(tmp_path / "t")


def test_the_trainer_and_run_watch_hand_their_optimizer_to_the_capture(tmp_path):
    from hooks.store.store import RunStore
    from hooks.train.trainer import Trainer, load_trace

    model, ids = _model(), _ids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, (ids,), opt, total_steps=3,
                      loss_fn=lambda out, batch: out.logits.float().pow(2).mean())
    trainer.train_step(1)  # Adam allocates its state at this first step
    report = trainer.train_step(2, capture=True)
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values())
    assert report.trace.memory.optimizer == "AdamW"
    assert report.trace.memory.optimizer_bytes == state > 0

    db = tmp_path / "runs.sqlite"
    model, ids = _model(), _ids()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with hooks.run("mem", db=db) as run:
        run.watch(model, every=2, optimizer=opt)
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(loss=1.0)
    momentum = sum(s["momentum_buffer"].untyped_storage().nbytes() for s in opt.state.values())
    with RunStore(db) as store:
        info = store.run("mem")
        trace = load_trace(store, info.id, 2)
    assert trace.memory.optimizer == "SGD" and trace.memory.optimizer_bytes == momentum > 0


def test_a_paused_capture_counts_no_saves():
    model, ids = _model(), _ids()
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    cap = hooks.capture(model)
    with cap as tr2:
        with cap.paused():  # mdb's own replay inside a captured step (the loop doctor's)
            model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
    assert tr2.memory.saved_bytes == tr.memory.saved_bytes > 0


def test_master_copies_count_as_optimizer_state():
    """An optimizer that updates fp32 copies of the parameters (mixed precision's master
    weights): the copies and their state are optimizer bytes, apart in master_bytes."""
    model, ids = _model(), _ids()
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW([*model.parameters(), *masters[:2]], lr=1e-3)
    (sum(m.sum() for m in masters[:2]) + model(ids, labels=ids).loss).backward()
    opt.step()  # the state exists now, for the parameters and the two copies
    with hooks.capture(model, optimizer=opt) as tr:
        model(ids, labels=ids).loss.backward()
    copies = sum(m.numel() * 4 for m in masters[:2])
    copy_state = sum(v.untyped_storage().nbytes() for m in masters[:2]
                     for v in opt.state[m].values())
    all_state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values())
    assert tr.memory.master_bytes == copies + copy_state
    assert tr.memory.optimizer_bytes == all_state + copies
