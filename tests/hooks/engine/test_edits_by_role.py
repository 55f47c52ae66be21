"""Edits by role (issue 36, item 1): a head patched from a source run, a head's q, k and v
columns, a head's attention pattern, steering by ``add`` and ``clamp``, each against an
independent plain-torch computation written here (forward hooks of the test's own, with the
attention layout written out by hand per model, not read from mdb's roles), on HF GPT-2 and
Llama built tiny from a config and on two home-grown GPTs of tests/hooks/roles (fused qkv with
an eager softmax; separate q/k/v with grouped KV heads and einsum) plus a RoPE one on SDPA.

Dimension legend: B batch, T positions, D hidden size, H query heads, Hkv key/value heads,
Dh head dim, S key positions.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

import hooks
from hooks.engine.edits import parse_edit, resolve_edits
from tests import families
from tests.hooks.roles import own_models as om

pytestmark = pytest.mark.usefixtures("one_thread")
ATOL = 1e-5  # fp32 throughout; SDPA recomputed explicitly differs from the kernel by ~1e-7


@dataclass
class Layout:
    """One model's attention at layer 1, written out by hand."""

    build: object
    attn: str
    o: str
    q: tuple[str, int]  # (projection, first column)
    k: tuple[str, int]
    v: tuple[str, int]
    block: str
    heads: int
    kv_heads: int
    dh: int
    rope: bool = False


LAYOUTS = {
    "hf_gpt2": Layout(families.hf_gpt2, "transformer.h.1.attn", "transformer.h.1.attn.c_proj",
                      ("transformer.h.1.attn.c_attn", 0), ("transformer.h.1.attn.c_attn", 64),
                      ("transformer.h.1.attn.c_attn", 128), "transformer.h.0", 4, 4, 16),
    "hf_llama": Layout(families.hf_llama, "model.layers.1.self_attn",
                       "model.layers.1.self_attn.o_proj", ("model.layers.1.self_attn.q_proj", 0),
                       ("model.layers.1.self_attn.k_proj", 0),
                       ("model.layers.1.self_attn.v_proj", 0), "model.layers.0", 4, 2, 16,
                       rope=True),
    "newcomer": Layout(om.newcomer, "blocks.1.attn", "blocks.1.attn.proj", ("blocks.1.attn.qkv", 0),
                       ("blocks.1.attn.qkv", 32), ("blocks.1.attn.qkv", 64), "blocks.0", 4, 4, 8),
    "separate_qkv": Layout(om.separate_qkv, "stack.1.attn", "stack.1.attn.mix",
                           ("stack.1.attn.to_query", 0), ("stack.1.attn.to_key", 0),
                           ("stack.1.attn.to_value", 0), "stack.0", 4, 2, 8),
    "rope_sdpa": Layout(om.rope_head_ln_f, "layers.1.attn", "layers.1.attn.wo",
                        ("layers.1.attn.wq", 0), ("layers.1.attn.wk", 0), ("layers.1.attn.wv", 0),
                        "layers.0", 4, 4, 8, rope=True),
}
MODELS = list(LAYOUTS)


def _logits(out):
    if isinstance(out, tuple):
        return out[0]
    return getattr(out, "logits", out)


def _setup(name):
    lay = LAYOUTS[name]
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    model, batch = lay.build()
    model.eval()
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    src = ids.clone()
    src[:, 3] = (src[:, 3] + 7) % 50
    src[:, 9] = (src[:, 9] + 5) % 50
    return lay, model, ids, src


def _edited(model, ids, spec, src=None):
    with torch.no_grad(), hooks.capture(model, edits=[spec], sources={"s": src} if src is not
                                        None else None) as trace:
        out = _logits(model(ids))
    rec = trace.edits[0]
    assert rec.applied and rec.note is None, rec.describe()
    return out


def _with_hooks(model, ids, hooks_):
    """Logits of ``model(ids)`` under the test's own ``(module, kind, fn)`` hooks."""
    mods = dict(model.named_modules())
    handles = [mods[m].register_forward_pre_hook(fn) if kind == "pre" else
               mods[m].register_forward_hook(fn) for m, kind, fn in hooks_]
    try:
        with torch.no_grad():
            return _logits(model(ids))
    finally:
        for h in handles:
            h.remove()


def _record(model, ids, module, kind):
    """The module's input (``pre``) or output (``out``; a tuple's first) on ``ids``."""
    got = []
    if kind == "pre":
        fn = lambda m, a: got.append(a[0].detach().clone())  # noqa: E731
    else:
        fn = lambda m, a, o: got.append((o[0] if isinstance(o, tuple) else o).detach().clone())  # noqa: E731
    _with_hooks(model, ids, [(module, kind, fn)])
    assert len(got) == 1
    return got[0]


def _close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _set_cols(a, b, values):
    def pre(m, args):
        x = args[0].clone()
        x[..., a:b] = values(x[..., a:b])
        return (x, *args[1:])
    return pre


def _set_out_cols(a, b, values):
    def post(m, args, out):
        x = out.clone()
        x[..., a:b] = values(x[..., a:b])
        return x
    return post


# -- a head of the o projection's input ---------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_patch_head_takes_its_o_input_columns_from_the_source_run(name):
    lay, model, ids, src = _setup(name)
    h = 2
    a, b = h * lay.dh, (h + 1) * lay.dh
    z_src = _record(model, src, lay.o, "pre")
    ref = _with_hooks(model, ids, [(lay.o, "pre", _set_cols(a, b, lambda x: z_src[..., a:b]))])
    got = _edited(model, ids, f"patch {lay.attn} head={h} from=s", src)
    _close(got, ref)
    ref_s = _with_hooks(model, ids, [(lay.o, "pre", _set_cols(a, b, lambda x: 3 * x))])
    _close(_edited(model, ids, f"scale {lay.attn} head={h} by=3"), ref_s)


@pytest.mark.parametrize("name", ["hf_gpt2", "newcomer"])
def test_patch_head_at_positions_only(name):
    lay, model, ids, src = _setup(name)
    h, dh = 1, lay.dh
    z_src = _record(model, src, lay.o, "pre")

    def pre(m, args):
        x = args[0].clone()
        x[:, 3:6, h * dh:(h + 1) * dh] = z_src[:, 3:6, h * dh:(h + 1) * dh]
        return (x,)

    ref = _with_hooks(model, ids, [(lay.o, "pre", pre)])
    _close(_edited(model, ids, f"patch {lay.attn} head={h} from=s pos=3:6", src), ref)


# -- q, k, v -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("part", ["q", "k", "v"])
def test_q_k_v_edits_act_on_the_heads_projection_columns(name, part):
    lay, model, ids, src = _setup(name)
    proj, start = getattr(lay, part)
    h = 1  # a KV head for k/v with grouped KV heads
    a, b = start + h * lay.dh, start + (h + 1) * lay.dh
    for spec, values in ((f"zero {lay.attn} {part} head={h}", torch.zeros_like),
                         (f"scale {lay.attn} {part} head={h} factor=0.25", lambda x: x * 0.25)):
        ref = _with_hooks(model, ids, [(proj, "out", _set_out_cols(a, b, values))])
        got = _edited(model, ids, spec)
        _close(got, ref)
        assert not torch.allclose(got, _with_hooks(model, ids, []), atol=1e-4)
    out_src = _record(model, src, proj, "out")
    ref = _with_hooks(model, ids, [(proj, "out",
                                    _set_out_cols(a, b, lambda x: out_src[..., a:b]))])
    _close(_edited(model, ids, f"patch {lay.attn} {part} head={h} from=s", src), ref)


def test_a_kv_head_index_is_checked_against_the_kv_heads():
    lay, model, _, _ = _setup("separate_qkv")
    resolve_edits(model, [f"zero {lay.attn} q head=3"])
    with pytest.raises(ValueError) as err:
        resolve_edits(model, [f"zero {lay.attn} k head=2"])
    msg = str(err.value)
    assert "2 KV heads (0…1)" in msg and "grouped-query" in msg and "\n" not in msg


# -- the attention pattern -----------------------------------------------------------------
def _probs_by_hand(model, ids, lay):
    """(B, H, T, S) probabilities of layer 1 from the q and k projections' outputs on ``ids``:
    causal softmax(q·kᵀ/√Dh), KV head h // (H/Hkv) (no positional rotation: the models
    without RoPE)."""
    qp, qa = lay.q
    kp, ka = lay.k
    q = _record(model, ids, qp, "out")[..., qa:qa + lay.heads * lay.dh]
    k = _record(model, ids, kp, "out")[..., ka:ka + lay.kv_heads * lay.dh]
    bsz, t = q.shape[:2]
    q = q.view(bsz, t, lay.heads, lay.dh).transpose(1, 2)
    k = k.view(bsz, t, lay.kv_heads, lay.dh).transpose(1, 2)
    k = k.repeat_interleave(lay.heads // lay.kv_heads, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(lay.dh)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    return s.softmax(-1)


def _hf_eager_probs(model, ids, layer=1):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        return ref(ids, output_attentions=True).attentions[layer]


@pytest.mark.parametrize("name", MODELS)
def test_zero_pattern_head_equals_that_heads_output_zeroed(name):
    """z_h = P_h·V_h: P_h = 0 gives head h's o-input columns 0, exactly (SDPA models: the
    kernel is recomputed explicitly; eager: the softmax's output edited)."""
    lay, model, ids, _ = _setup(name)
    h = 3
    a, b = h * lay.dh, (h + 1) * lay.dh
    ref = _with_hooks(model, ids, [(lay.o, "pre", _set_cols(a, b, torch.zeros_like))])
    _close(_edited(model, ids, f"zero {lay.attn} pattern head={h}"), ref)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "newcomer", "separate_qkv"])
def test_patch_pattern_head_weighs_this_runs_values_by_the_sources_probabilities(name):
    lay, model, ids, src = _setup(name)
    h = 1
    p_src = _hf_eager_probs(model, src) if lay.rope else _probs_by_hand(model, src, lay)
    vp, va = lay.v
    v = _record(model, ids, vp, "out")[..., va:va + lay.kv_heads * lay.dh]
    bsz, t = v.shape[:2]
    v = v.view(bsz, t, lay.kv_heads, lay.dh).transpose(1, 2)
    kvh = h // (lay.heads // lay.kv_heads)
    z_h = p_src[:, h] @ v[:, kvh]  # (B, T, Dh)
    a, b = h * lay.dh, (h + 1) * lay.dh
    ref = _with_hooks(model, ids, [(lay.o, "pre", _set_cols(a, b, lambda x: z_h))])
    _close(_edited(model, ids, f"patch {lay.attn} pattern head={h} from=s", src), ref)


def test_patch_pattern_at_query_positions_only():
    lay, model, ids, src = _setup("newcomer")
    h = 2
    p_src = _probs_by_hand(model, src, lay)
    v = _record(model, ids, "blocks.1.attn.qkv", "out")[..., 64:96]
    v = v.view(*v.shape[:2], 4, lay.dh).transpose(1, 2)
    z_h = p_src[:, h] @ v[:, h]  # (B, T, Dh)
    a, b = h * lay.dh, (h + 1) * lay.dh

    def pre(m, args):
        x = args[0].clone()
        x[:, 4:7, a:b] = z_h[:, 4:7]
        return (x,)

    ref = _with_hooks(model, ids, [(lay.o, "pre", pre)])
    _close(_edited(model, ids, f"patch {lay.attn} pattern head={h} from=s pos=4:7", src), ref)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_pattern_edits_on_hf_eager_attention_edit_its_softmax(name):
    lay, model, ids, _ = _setup(name)
    model.set_attn_implementation("eager")
    h = 0
    ref = _with_hooks(model, ids, [(lay.o, "pre", _set_cols(0, lay.dh, torch.zeros_like))])
    _close(_edited(model, ids, f"zero {lay.attn} pattern head={h}"), ref)
    half = _with_hooks(model, ids, [(lay.o, "pre", _set_cols(0, lay.dh, lambda x: x / 2))])
    _close(_edited(model, ids, f"scale {lay.attn} pattern head={h} by=0.5"), half)


# -- steering and clamping -----------------------------------------------------------------
def _add_out(delta):
    def post(m, args, out):
        if isinstance(out, tuple):
            return (out[0] + delta, *out[1:])
        return out + delta
    return post


@pytest.mark.parametrize("name", MODELS)
def test_add_a_vector_from_a_safetensors_file(name, tmp_path):
    from safetensors.torch import save_file

    lay, model, ids, _ = _setup(name)
    d = _record(model, ids, lay.block, "out").shape[-1]
    g = torch.Generator().manual_seed(1)
    vec, per_pos = torch.randn(d, generator=g), torch.randn(ids.shape[1], d, generator=g)
    save_file({"steer": vec}, str(tmp_path / "v.safetensors"))
    save_file({"a": vec, "b": per_pos}, str(tmp_path / "two.safetensors"))
    ref = _with_hooks(model, ids, [(lay.block, "out", _add_out(2.5 * vec))])
    _close(_edited(model, ids, f"add {lay.block} vector={tmp_path}/v.safetensors scale=2.5"),
           ref)
    ref2 = _with_hooks(model, ids, [(lay.block, "out", _add_out(per_pos))])
    _close(_edited(model, ids, f"add {lay.block} vector={tmp_path}/two.safetensors tensor=b"),
           ref2)


@pytest.mark.parametrize("name", ["hf_llama", "newcomer", "separate_qkv"])
def test_add_from_a_source_and_clamp(name):
    lay, model, ids, src = _setup(name)
    out_src = _record(model, src, lay.block, "out")
    ref = _with_hooks(model, ids, [(lay.block, "out", _add_out(-0.5 * out_src))])
    _close(_edited(model, ids, f"add {lay.block} from=s scale=-0.5", src), ref)
    mlp = {"hf_llama": "model.layers.0.mlp"}.get(name, lay.block.replace(".0", ".0.mlp"))
    out = _record(model, ids, mlp, "out").flatten()
    lo, hi = (float(f"{float(out.quantile(q)):.4g}") for q in (0.3, 0.7))  # both bind
    ref_c = _with_hooks(model, ids, [(mlp, "out", lambda m, a, o: o.clamp(lo, hi))])
    _close(_edited(model, ids, f"clamp {mlp} min={lo:.4g} max={hi:.4g}"), ref_c)
    only_max = _with_hooks(model, ids, [(mlp, "out", lambda m, a, o: o.clamp(max=hi))])
    _close(_edited(model, ids, f"clamp {mlp} max={hi:.4g}"), only_max)


# -- the grammar and its one-line refusals -------------------------------------------------
@pytest.mark.parametrize("spec", [
    "patch blocks.1.attn head=2 from=clean",
    "zero blocks.1.attn q head=1",
    "scale blocks.1.attn v head=0 factor=0.5",
    "scale blocks.1.attn k by=2",
    "patch blocks.1.attn pattern head=3 from=clean pos=2:5",
    "zero blocks.1.attn pattern",
    "add blocks.0 vector=steer.safetensors tensor=dir scale=-4",
    "add blocks.0 from=clean scale=0.5",
    "clamp blocks.0.mlp min=-1 max=2.5",
    "clamp blocks.0.mlp max=3",
    "patch blocks.1.attn from=clean head=2 pos=-1",
    "clamp blocks.0.mlp max=2 min=-1",
    "add blocks.0 scale=2 from=clean",
    "scale blocks.1.attn q head=01 by=0.50",
    "clamp blocks.0.mlp min=-1e-3 max=2.0",
])
def test_specs_echo_what_was_typed(spec):
    e = parse_edit(spec)
    assert e.spec == spec and parse_edit(e.spec) == e


@pytest.mark.parametrize("spec, says", [
    ("zero m.attn x head=1", "'x' is not a part of attention"),
    ("mean m.attn q", "mean takes no part 'q'"),
    ("add m.0", "add needs vector= or from="),
    ("add m.0 vector=a.safetensors from=s", "not both"),
    ("add m.0 from=s tensor=x", "tensor= names a tensor of vector=FILE"),
    ("clamp m.0", "clamp needs min= or max="),
    ("clamp m.0 min=2 max=1", "min=2 is above max=1"),
    ("clamp m.0 min=nan", "min must be a finite number"),
    ("add m.0 from=s scale=inf", "scale must be a finite number"),
])
def test_bad_specs_are_one_line(spec, says):
    with pytest.raises(ValueError) as err:
        parse_edit(spec)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_bad_vector_files_are_one_line(tmp_path):
    from safetensors.torch import save_file

    model, _ = om.newcomer()
    save_file({"a": torch.ones(32), "b": torch.ones(32)}, str(tmp_path / "two.safetensors"))
    save_file({"a": torch.tensor([1.0, math.inf])}, str(tmp_path / "inf.safetensors"))
    save_file({"a": torch.ones(2, 3, 4)}, str(tmp_path / "3d.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    cases = {"missing.safetensors": "no such file",
             "two.safetensors": "holds 2 tensors (a, b): name one with tensor=NAME",
             "inf.safetensors": "non-finite", "3d.safetensors": "(2, 3, 4)",
             "junk.safetensors": "is not a safetensors file"}
    for file, says in cases.items():
        with pytest.raises(ValueError) as err:
            resolve_edits(model, [f"add blocks.0 vector={tmp_path}/{file}"])
        assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
    save_file({"a": torch.ones(7)}, str(tmp_path / "narrow.safetensors"))
    ids = om.ids()
    with pytest.raises(ValueError) as err, torch.no_grad(), hooks.capture(
            model, edits=[f"add blocks.0 vector={tmp_path}/narrow.safetensors"]):
        model(ids)
    assert "the vector is (7,), blocks.0's output (2, 16, 32): give (D,) or (T, D) with D=32" \
        in str(err.value)


def test_a_part_of_a_module_that_is_not_attention_names_the_declaring_line():
    model, _ = om.newcomer()
    with pytest.raises(ValueError) as err:
        resolve_edits(model, ["zero blocks.0.mlp pattern head=0"])
    msg = str(err.value)
    assert "blocks.0.mlp" in msg and "looked for" in msg and "hooks.roles(model, " in msg
    assert "\n" not in msg


def test_pattern_on_a_kernel_mdb_cannot_see_is_a_note_with_the_way_out():
    """Attention whose probabilities come from no softmax and no SDPA (exp / sum written
    out), declared: the pattern edit changes nothing and says how to get an eager one."""
    model, ids = om.newcomer()
    attn = model.blocks[1].attn

    def manual(x):
        bsz, t, d = x.shape
        q, k, v = attn.qkv(x).split(d, dim=-1)
        q, k, v = (u.view(bsz, t, 4, d // 4).transpose(1, 2) for u in (q, k, v))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d // 4)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        e = (s - s.amax(-1, keepdim=True)).exp()
        return attn.proj(((e / e.sum(-1, keepdim=True)) @ v).transpose(1, 2).reshape(bsz, t, d))

    hooks.roles(model, attention="blocks.*.attn", heads=4)
    attn.forward = manual
    with torch.no_grad(), hooks.capture(model, edits=["zero blocks.1.attn pattern head=0"]) as tr:
        model(ids)
    note = tr.edits[0].note
    assert tr.edits[0].calls == 1 and not tr.edits[0].changed
    assert "attn_implementation=\"eager\"" in note and "no softmax" in note


def test_edit_options_offer_the_new_operations_where_the_role_exists():
    from hooks.engine.edits import edit_options

    model, _ = om.separate_qkv()
    opts = edit_options(model, "stack.1.attn")
    for op in ("patch stack.1.attn head=0 from=rolled", "zero stack.1.attn pattern head=0",
               "zero stack.1.attn q head=0", "add stack.1.attn from=rolled scale=0.5",
               "clamp stack.1.attn min=-1 max=1"):
        assert op in opts
    mlp = edit_options(model, "stack.1.mlp")
    assert not any(" head=" in o or " pattern" in o for o in mlp)
    assert "clamp stack.1.mlp min=-1 max=1" in mlp
    resolve_edits(model, [o for o in opts if "from=" not in o])


def test_rerun_edited_applies_edits_by_role_from_the_rolled_batch():
    """What ``e`` runs (``hooks.whatif.rerun.rerun_edited``): a block's output plus half the
    rolled batch's, and head 1 of layer 1 patched from it, against the test's own hooks."""
    from hooks.whatif.rerun import rerun_edited, run_step

    lay, model, ids, _ = _setup("newcomer")
    rolled = torch.roll(ids, 1, dims=0)
    out_src = _record(model, rolled, lay.block, "out")
    z_src = _record(model, rolled, lay.o, "pre")  # the source run is the model's own, unedited
    hooks_ = [(lay.block, "out", _add_out(0.5 * out_src))]
    a, b = lay.dh, 2 * lay.dh
    hooks_.append((lay.o, "pre", _set_cols(a, b, lambda x: z_src[..., a:b])))
    mods = dict(model.named_modules())
    handles = [mods[m].register_forward_hook(fn) if k == "out" else
               mods[m].register_forward_pre_hook(fn) for m, k, fn in hooks_]
    try:
        with torch.no_grad():
            want = float(model(ids, ids)[1])
    finally:
        for h in handles:
            h.remove()
    trace = run_step(model, (ids, ids))
    got = rerun_edited(trace, [f"add {lay.block} from=rolled scale=0.5",
                               f"patch {lay.attn} head=1 from=rolled"])
    assert got.meta["loss"] == pytest.approx(want, abs=ATOL)
    assert abs(got.meta["loss"] - trace.meta["loss"]) > 1e-3



@pytest.mark.parametrize("name", ["newcomer", "hf_gpt2", "hf_llama_eager"])
def test_an_attention_capture_records_the_edited_pattern_once(name):
    """With ``attention=True`` the step's attention record of the edited module is the pattern
    the model went on with: head h zeroed (or the source's), the other heads as recorded
    without the edit; one record per call, one change counted (Tensor.softmax and F.softmax
    seen through the capture's swap; SDPA recomputed by both)."""
    lay, model, ids, src = _setup("hf_llama" if name == "hf_llama_eager" else name)
    if name == "hf_llama_eager":
        model.set_attn_implementation("eager")

    def records(edits):
        with torch.no_grad(), hooks.capture(model, attention=True, edits=edits,
                                            sources={"s": src}) as tr:
            model(ids)
        got = [r.probs for r in tr.attention if r.module == lay.attn]
        assert len(got) == 1 and (not edits or tr.edits[0].changed == 1), tr.edits
        return got[0]

    h = 1
    plain, zeroed = records([]), records([f"zero {lay.attn} pattern head={h}"])
    assert float(plain[:, h].abs().sum()) > 1 and float(zeroed[:, h].abs().max()) == 0
    others = [i for i in range(lay.heads) if i != h]
    _close(zeroed[:, others], plain[:, others])
    if not lay.rope:
        patched = records([f"patch {lay.attn} pattern head={h} from=s"])
        _close(patched[:, h], _probs_by_hand(model, src, lay)[:, h])


@pytest.mark.parametrize("style", ["nanogpt", "mingpt"])
def test_pattern_and_v_edits_on_karpathys_files(style):
    """karpathy's nanoGPT (SDPA with is_causal and dropout_p) and minGPT (an eager softmax), their
    real files: head 1's pattern zeroed, or its v columns zeroed, equals its o-input columns
    zeroed by the test's own hook (z_1 = P_1·V_1)."""
    path = {"nanogpt": om.NANOGPT, "mingpt": om.MINGPT}[style]
    if not path.exists():
        pytest.skip(f"{path} is not here (set MDB_{style.upper()})")
    model, ids = getattr(om, style)()
    model.eval()
    attn, dh = "transformer.h.1.attn", model.transformer.h[1].attn.c_proj.in_features // 4
    if style == "mingpt":
        dh = model.transformer.h[1].attn.c_proj.in_features // 3
    ref = _with_hooks(model, ids, [(f"{attn}.c_proj", "pre",
                                    _set_cols(dh, 2 * dh, torch.zeros_like))])
    for spec in (f"zero {attn} pattern head=1", f"zero {attn} v head=1"):
        _close(_edited(model, ids, spec), ref)
