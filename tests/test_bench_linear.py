"""benchmarks.linear: the ratios it derives and the table it prints, on hand-made records; one
--smoke run end to end (tiny shapes, interpret mode, CPU)."""

import json

import pytest

from benchmarks import linear as bench_linear


def _rec(kernel, fmt, rows, t, **kw):
    return dict(kernel=kernel, format=fmt, rows=rows, n=64, k=32, shape="lm_head", time_us=t, **kw)


def test_derive_takes_the_mean_of_both_xla_passes_and_the_same_format_m1():
    records = [
        _rec("xla_bf16_dot", "bf16", 1, 600.0, pass_="before"),
        _rec("xla_bf16_dot", "bf16", 1, 700.0, pass_="after"),
        _rec("xla_bf16_dot", "bf16", 8, 640.0, pass_="before"),
        _rec("linear", "nvfp4", 1, 200.0),
        _rec("linear", "nvfp4", 8, 260.0),
        _rec("linear", "nvfp4", 32, 300.0),  # no XLA at 32 rows: falls back to the M=1 baseline
        _rec("linear", "fp8", 8, 500.0, ok=False),
    ]
    out = {(r["kernel"], r["format"], r["rows"]): r for r in bench_linear.derive(records)}
    m1 = out[("linear", "nvfp4", 1)]
    assert m1["baseline_time_us"] == pytest.approx(650.0)
    assert m1["baseline_spread_us"] == pytest.approx(100.0)
    assert m1["ratio"] == pytest.approx(200.0 / 650.0)
    m8 = out[("linear", "nvfp4", 8)]
    assert m8["ratio"] == pytest.approx(260.0 / 640.0)
    assert m8["ratio_vs_m1"] == pytest.approx(1.3)
    m32 = out[("linear", "nvfp4", 32)]
    assert m32["baseline"] == "xla_bf16_dot_m1" and m32["ratio"] == pytest.approx(300.0 / 650.0)
    assert out[("linear", "fp8", 8)]["ratio_vs_m1"] is None  # no M=1 fp8 time in the records


def test_summary_lists_failures_and_section_errors():
    records = bench_linear.derive(
        [
            _rec("linear", "fp8", 1, 400.0, ok=False, rel_err=0.5),
            dict(kernel="_section_error", section="head", error="boom"),
        ]
    )
    text = bench_linear.summary(records)
    assert "NOT OK 0.5" in text
    assert "SECTION ERROR head: boom" in text


def test_smoke_run(tmp_path):
    """BF16 only: the interpret-mode kernels of the other formats take seconds a launch."""
    out = tmp_path / "linear.json"
    argv = [
        "--smoke",
        "--formats",
        "bf16",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "l.png"),
    ]
    assert bench_linear.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["run"]["command"].startswith("python -m benchmarks.linear --smoke")
    assert data["run"]["jax"] and data["run"]["device"]
    records = data["records"]
    assert not [r for r in records if r["kernel"] == "_section_error"]
    timed = [r for r in records if r["kernel"] in ("linear", "lm_head_auto")]
    assert {(r["kernel"], r["format"], r["rows"]) for r in timed} == {
        (kern, fmt, m)
        for kern in ("linear", "lm_head_auto")
        for fmt in ("bf16",)
        for m in (1, 3, 12)
    }
    for r in timed:
        assert r["ok"] and r["time_us"] > 0 and r["time_us_synced"] > 0 and r["gbps"] > 0
    assert all(r["baseline_time_us"] > 0 for r in timed if r["kernel"] == "linear")
    assert (tmp_path / "l.png").stat().st_size > 0
    # --from-json reads this file and the bare lists written before the harness.
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(records))
    assert bench_linear.main(["--from-json", str(bare)]) == 0
