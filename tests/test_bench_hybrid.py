"""benchmarks.hybrid: --smoke end to end on the CPU (tiny shapes: the records, the table and
the plot); the bytes model at Qwen3.5-27B shapes; the delta-rule variants against the library's
rule; the profile's attribution of HLO ops to source; the ratios on hand-made records."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from benchmarks import hybrid as bh
from benchmarks import profile as bprof
from mtpjax import hybrid


def test_smoke_run(tmp_path, capsys):
    out = tmp_path / "hybrid.json"
    assert bh.main(["--smoke", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["run"]["command"].startswith("python -m benchmarks.hybrid --smoke")
    records = data["records"]
    bad = [r for r in records if r["kernel"] in ("_section_error", "skipped")]
    assert not bad, bad
    W = 4  # --drafts 3

    steps = {(r["model"], r["snapshots"], r["rows"]): r for r in records if r["kernel"] == "step"}
    assert set(steps) == {
        ("mixed", W, 1), ("mixed", W, W), ("mixed", 1, 1), ("GDN", W, W), ("full", W, W),
        ("0.8b", W, 1), ("0.8b", W, W),
    }  # fmt: skip
    for r in steps.values():
        assert r["time_us"] > 0 and r["time_us_synced"] > 0 and r["roofline_us"] > 0
        assert r["bytes"]["total"] == sum(v for p, v in r["bytes"].items() if p != "total")
        assert 0 < r["frac_of_copy"] == pytest.approx(r["roofline_us"] / r["time_us"])
        # The donated state is the output's buffer (its base, int32[B], may be left out).
        assert r["memory"]["alias_size_in_bytes"] >= r["state_bytes"] - 4 * r["batch"]
    verify = steps[("mixed", W, W)]
    assert verify["vs_decode"] == pytest.approx(
        verify["time_us"] / steps[("mixed", W, 1)]["time_us"]
    )
    assert verify["vs_plain_decode"] == pytest.approx(
        verify["time_us"] / steps[("mixed", 1, 1)]["time_us"]
    )
    assert steps[("GDN", W, W)]["bytes"]["kv_read"] == 0
    assert steps[("full", W, W)]["bytes"]["gdn_state_written"] == 0
    assert steps[("0.8b", W, W)]["lm_head_us"] > 0
    heads = {r["rows"]: r["time_us"] for r in records if r["kernel"] == "lm_head"}
    assert set(heads) == {1, W}
    plain = steps[("mixed", 1, 1)]["in_64_layers_us"] + heads[1]
    assert verify["in_64_layers_vs_plain_decode_with_lm_head"] == pytest.approx(
        (verify["in_64_layers_us"] + heads[W]) / plain
    )

    delta = {(r["variant"], r["rows"]): r for r in records if r["kernel"] == "delta_rule"}
    assert set(delta) == {(v, s) for v in ("library", "one_pass") for s in (1, W)}
    assert delta[("library", W)]["window_exact"] and delta[("one_pass", W)]["window_exact"]
    assert delta[("one_pass", W)]["max_abs_vs_library"] < 1e-5

    (prof,) = [r for r in records if r["kernel"] == "profile"]
    assert (prof["model"], prof["rows"]) == ("GDN", W)
    assert prof["attributed_us"] > 0.5 * prof["busy_us"] > 0
    assert {"gdn projections", "ffn"} <= set(prof["categories"])

    (pre,) = [r for r in records if r["kernel"] == "prefill"]
    assert pre["time_us"] > 0 and pre["tokens_per_s"] > 0
    assert "verify (4 rows) / plain decode" in text and "prefill" in text
    assert (tmp_path / "hybrid.png").stat().st_size > 0
    assert bh.main(["--from-json", str(out), "--plot", str(tmp_path / "again.png")]) == 0


def test_step_bytes_at_qwen35_27b_shapes():
    """Weights and states of one GDN and one full-attention layer, counted by hand."""
    H, F = 5120, 17408
    ffn_and_norms = 3 * F * H * 2 + 2 * H * 2
    snap = 48 * 128 * 128 * 4  # F32 recurrent state per sequence
    C = 2 * 16 * 128 + 48 * 128  # conv channels q | k | v
    for pattern, rows in (("G", 4), ("F", 1)):  # one layer of each kind
        cfg = bh.config_27b(pattern, smoke=False)
        params, _ = jax.eval_shape(lambda k, c=cfg: hybrid.init(c, key=k), jax.random.key(0))
        got = bh.step_bytes(cfg, params, batch=1, rows=rows, context=4096)
        if pattern == "G":
            mixer = (C + 48 * 128 + 2 * 48) * H * 2 + H * 48 * 128 * 2  # in_proj_* and out_proj
            mixer += C * 4 * 2 + 2 * 48 * 2 + 128 * 2  # conv1d, dt_bias, A_log, norm (BF16)
            assert got["gdn_state_read"] == 3 * C * 4 + snap
            assert got["gdn_state_written"] == (3 + rows) * C * 4 + rows * snap
            assert got["kv_read"] == got["kv_written"] == 0
        else:
            mixer = (24 * 256 * 2 + 2 * 4 * 256) * H * 2 + H * 24 * 256 * 2  # q (gated), k, v, o
            mixer += 2 * 256 * 2  # q_norm, k_norm
            row = 2 * 4 * 256 * 2  # K and V, BF16
            assert got["kv_read"] == (4096 + rows) * row and got["kv_written"] == rows * row
            assert got["gdn_state_read"] == got["gdn_state_written"] == 0
        # + the final norm and the rows' embeddings (the table itself is not read whole)
        assert got["weights"] == mixer + ffn_and_norms + H * 2 + rows * H * 2


@pytest.mark.parametrize("variant", ["one_pass", "reduce"])
def test_delta_rule_variants_equal_the_library_and_are_window_exact(variant):
    shape = dict(batch=2, hv=3, dk=8, dv=4)
    inputs = bh.delta_inputs(0, rows=4, **shape)
    lib = jax.jit(hybrid.recurrent_delta_rule)
    fn_all, fn_one = jax.jit(bh.delta_variant(variant)), jax.jit(bh.delta_variant(variant))
    for got, want in zip(fn_all(*inputs), lib(*inputs), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    assert bh.window_exact(fn_all, fn_one, inputs)
    # The check can fail: a rule whose row 1 depends on the window differs from one-row calls.
    peek = jax.jit(lambda *a: (lib(*a)[0] + a[3].shape[1], lib(*a)[1]))
    assert not bh.window_exact(peek, lib, inputs)


def test_profile_attribution_follows_the_python_stack():
    shape = dict(batch=1, hv=2, dk=8, dv=4)
    q, k, v, g, beta, s = bh.delta_inputs(1, rows=3, **shape)
    conv_w = jnp.ones((16, 1, 4), jnp.float32)

    def f(x, q, k, v, g, beta, s):
        y = hybrid.causal_conv(x, conv_w)
        o, states = hybrid.recurrent_delta_rule(q, k, v, g, beta, s)
        return y.sum() + o.sum(), states

    x = jnp.ones((1, 6, 16), jnp.float32)
    sources = bprof.hlo_sources(jax.jit(f).lower(x, q, k, v, g, beta, s).compile().as_text())
    cats = {bh.categorize(stack)[0] for stack in sources.values()}
    assert {"conv", "delta rule (row body)"} <= cats
    # The row body's kernels: their innermost frame is the scan body or the per-position step
    # it calls (shared with the tree rule); the stack leads back to recurrent_delta_rule.
    body = [
        st
        for st in sources.values()
        if st and st[0][1].rpartition(".")[2] in ("body", "delta_step")
    ]
    assert body and any(fn == "recurrent_delta_rule" for _, fn, _ in body[0])  # its caller
    assert bh.categorize([("x.py", "nothing_known", 1)]) == ("other", None)
    # The stacked Triton kernel (interpret mode here) is its own category, not the layer scan
    # that calls it.
    *rows, s16 = bh.delta_inputs(2, rows=3, batch=1, hv=2, dk=16, dv=16)
    snapshots = jnp.zeros((2, 1, 4, *s16.shape[1:]), jnp.float32)
    step = functools.partial(pallas_kernels.recurrent_delta_rule_stacked, implementation="triton")
    lowered = jax.jit(step).lower(*rows, snapshots, layer=1, select=jnp.zeros(1, jnp.int32))
    kernel_sources = bprof.hlo_sources(lowered.compile().as_text())
    assert "delta rule (kernel)" in {bh.categorize(st)[0] for st in kernel_sources.values()}
    # Kernels without an HLO op, by name (the H200 trace's copies and Pallas GEMVs).
    names = ["memcpy128", "MemcpyD2D", "memcpy32_post", "bf16_gemv__4", "triton_softmax_11"]
    assert [bprof.unmapped_category(n) for n in names] == [
        "copies (no HLO op)", "copies (no HLO op)", "copies (no HLO op)",
        "matmuls (no HLO op)", "unattributed",
    ]  # fmt: skip


def test_derive_and_table_on_hand_made_records():
    def step(model, w, s, t, **kw):
        return dict(
            kernel="step", section="27b", model=model, batch=1, snapshots=w, rows=s, time_us=t,
            layers=4, context=4096, per_layer_us=t / 4, in_64_layers_us=t * 16,
            bytes_per_layer=1e8, roofline_us=t / 2, frac_of_copy=0.5, **kw,
        )  # fmt: skip

    records = bh.derive(
        [step("mixed", 4, 1, 1000.0), step("mixed", 4, 4, 1400.0), step("mixed", 1, 1, 1000.0)]
    )
    assert records[1]["vs_decode"] == pytest.approx(1.4)
    assert records[1]["vs_plain_decode"] == pytest.approx(1.4)
    assert "MISSES the <= 1.3 target" in bh.table(records)
    records = bh.derive([step("mixed", 4, 4, 1200.0), step("mixed", 1, 1, 1000.0)])
    assert records[0]["vs_decode"] is None and "meets the <= 1.3 target" in bh.table(records)
