"""scripts/bench_linear.py: the ratios it derives and the table it prints, on hand-made records."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_linear.py"
_SPEC = importlib.util.spec_from_file_location("bench_linear", _PATH)
bench_linear = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_linear)


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


def test_summary_lists_failures_and_row_consistency():
    records = bench_linear.derive(
        [
            _rec("linear", "fp8", 1, 400.0, ok=False, rel_err=0.5),
            dict(
                kernel="row_consistency",
                format="nvfp4",
                rows=4,
                n=64,
                k=32,
                shape="lm_head",
                against_rows=256,
                bitwise=False,
                max_abs_diff=1e-6,
                argmax_equal=True,
            ),
            dict(kernel="_section_error", section="head", error="boom"),
        ]
    )
    text = bench_linear.summary(records)
    assert "NOT OK 0.5" in text
    assert "bitwise=False" in text and "(vs 256 rows)" in text
    assert "SECTION ERROR head: boom" in text
