"""benchmarks.launch_cost: one --smoke run end to end (tiny dense head, CPU), the concatenated
weights' outputs against the separate projections' and an F32 oracle, and bad flags refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import harness
from benchmarks import launch_cost as lc


def test_smoke_run_records_every_variant_and_rows(tmp_path):
    out = tmp_path / "launch_cost.json"
    assert lc.main(["--smoke", "--json", str(out)]) == 0
    records = harness.read_records(out)
    assert not [r for r in records if r["kernel"] in ("_section_error", "skipped")]
    assert len([r for r in records if r["kernel"] == "device_copy"]) == 2  # a child a row count
    timed = {(r["variant"], r["rows"]): r for r in records if r["kernel"] == "launch_cost"}
    assert set(timed) == {(v, m) for v in lc.VARIANTS for m in (1, 8)}
    step_bytes = {r["weight_bytes"] for r in timed.values()}
    assert len(step_bytes) == 1  # every variant reads the same weights
    for (variant, rows), r in timed.items():
        assert "error" not in r and r["finite"], r
        # The program runs one matmul per weight it was built with: 8, 5, 4, 8.
        assert r["gemvs"] == len(lc.GROUPS[variant]) == r["hlo_matmuls"], r
        assert r["kernels"] >= r["custom_calls"] + r["fusions"] > 0
        assert r["bytes"] > r["weight_bytes"]
        for t in ("queued", "synced"):
            assert r[f"time_{t}_us"] > 0 and r[f"{t}_over_roofline"] > 0
            assert r[f"{t}_over_separate"] == pytest.approx(
                r[f"time_{t}_us"] / timed[("separate", rows)][f"time_{t}_us"]
            )
        # On the CPU (XLA's reference dot) a column's sum over K does not depend on the
        # weight's other rows: the concatenated weights give the separate numbers bit for bit.
        if variant in ("fused", "one"):
            assert r["equal_to_separate"] is True and r["max_abs_diff"] == 0.0, r
    assert timed[("glue", 1)]["kernels"] > timed[("separate", 1)]["kernels"]


@pytest.mark.parametrize("rows", [1, 8])
def test_each_variant_gives_the_separate_projections(rows):
    cfg = lc.head_config(smoke=True)
    (params,) = lc.weight_sets(cfg, [0])
    step = lc.projections(params)
    widths = {p: w.out_features for p, w in step.items()}
    in_widths = {lc.PROJECTIONS[p]: w.in_features for p, w in step.items()}
    (xs,) = lc.inputs("separate", in_widths, rows)
    outs = {
        v: lc.split(v, jax.jit(lc.program(v, cfg))(lc.layout(v, params), xs), widths)
        for v in ("separate", "fused", "one")
    }
    assert set(outs["separate"]) == set(lc.PROJECTIONS)
    for p, w in step.items():
        # The oracle: each projection of its own input in F32 (BF16 products are exact in F32).
        x = np.asarray(xs[lc.PROJECTIONS[p]], np.float32)
        want = x @ np.asarray(w.w, np.float32).T
        got = outs["separate"][p]
        assert got.shape == (rows, w.out_features)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        for v in ("fused", "one"):
            np.testing.assert_array_equal(outs[v][p], got, err_msg=f"{v}: {p}")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--variants", "separate,fuse", "--variants: unknown 'fuse', expected one of"),
        (
            "--rows",
            "1,0",
            "--rows: expected distinct comma-separated integers in 1..128, got '1,0'",
        ),
        (
            "--rows",
            "1,x",
            "--rows: expected distinct comma-separated integers in 1..128, got '1,x'",
        ),
    ],
)
def test_a_bad_flag_is_refused_by_name(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        lc.main(["--smoke", flag, value, "--json", "/dev/null"])
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1


def test_split_takes_each_projection_in_the_concatenation_order():
    widths = dict(q=3, k=1, v=1, gate=2, up=2, o=4, down=4, fc=4)
    outs = (jnp.arange(9.0)[None], jnp.zeros((1, 4)), jnp.ones((1, 4)), jnp.full((1, 4), 2.0))
    parts = lc.split("one", outs, widths)
    assert parts["q"].tolist() == [[0, 1, 2]] and parts["v"].tolist() == [[4]]
    assert parts["up"].tolist() == [[7, 8]] and parts["fc"].tolist() == [[2, 2, 2, 2]]
