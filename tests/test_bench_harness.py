"""benchmarks.harness: the timers, the child runner and the record files; benchmarks.kernels'
table on hand-made records."""

import argparse
import json
import time

import pytest

from benchmarks import harness, kernels


def test_time_queued_takes_the_difference_of_two_queue_lengths():
    calls = []

    def call():  # a call that takes 2 ms
        calls.append(None)
        time.sleep(0.002)
        return 0

    us = harness.time_queued(call, calls=(2, 8), reps=3)
    assert len(calls) == 3 * (2 + 8)
    assert 1500 < us < 4000
    assert harness.time_queued(call, calls=(0, 2), reps=1) > 0


def test_stats_are_median_and_percentiles():
    st = harness.stats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert st["time_us"] == 3.0 and st["n"] == 5
    assert st["p10_us"] < 2.0 < st["p90_us"] < 100.0


def test_records_round_trip_and_old_bare_lists_read(tmp_path):
    path = tmp_path / "sub" / "r.json"
    harness.write_records(path, [dict(kernel="x", time_us=1.0)], dict(command="c"))
    assert json.loads(path.read_text())["run"] == {"command": "c"}
    assert harness.read_records(path) == [dict(kernel="x", time_us=1.0)]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([dict(kernel="y")]))
    assert harness.read_records(bare) == [dict(kernel="y")]
    info = harness.run_info("benchmarks.x", ["--smoke"], env=dict(kernel="_env", jax="0.0"))
    assert info["command"] == "python -m benchmarks.x --smoke" and info["jax"] == "0.0"
    assert "kernel" not in info


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path):
    # benchmarks.kernels with an unknown section: the child raises, the parent goes on.
    records = harness.run_sections(
        "benchmarks.kernels", ["nope"], budget_s=60, extra=["--smoke"], workdir=str(tmp_path)
    )
    errors = [r for r in records if r["kernel"] == "_section_error"]
    assert errors and "nope" in errors[0]["error"]


def test_kernels_table_ratios_and_failures():
    records = kernels.derive(
        [
            dict(kernel="device_copy", op="copy", gbps=4000.0, time_us=500.0),
            dict(kernel="linear_pallas", format="nvfp4", rows=1, time_us=250.0, gbps=3000.0,
                 ratio=0.4, is_default=True, ok=True),
            dict(kernel="linear_pallas", format="nvfp4", rows=1, config={"block_n": 128},
                 ok=False, error="ValueError: block_n"),
            dict(kernel="_section_error", section="attention", error="boom"),
        ]
    )  # fmt: skip
    assert records[1]["frac_of_copy_bw"] == pytest.approx(0.75)
    text = kernels.summary(records)
    assert "default" in text and "0.400" in text
    assert "NOT OK ValueError: block_n" in text and "SECTION ERROR attention: boom" in text


def test_propose_ab_counts_device_ops_with_while_bodies_per_trip():
    import jax
    import jax.numpy as jnp

    from benchmarks.propose_ab import device_ops

    def body(c):
        i, x = c
        return i + 1, jnp.sin(x) * 2.0 + jnp.cumsum(x)

    def f(x):
        x = jnp.cos(x) + 1.0
        return jax.lax.fori_loop(0, 5, lambda i, c: body((i, c))[1], x) @ x

    hlo = jax.jit(f).lower(jnp.ones((8,))).compile().as_text()
    once = device_ops(hlo.replace('"n":"5"', '"n":"1"'))
    assert device_ops(hlo) > once  # the loop body counts once per trip
    loop_free = device_ops(
        jax.jit(lambda x: jnp.cos(x) + 1.0).lower(jnp.ones((8,))).compile().as_text()
    )
    assert loop_free >= 1


def test_kernels_cases_name_known_linear_cases():
    assert kernels._cases("nvfp4/32/mosaic_gpu,bf16/1/triton") == (
        "nvfp4/32/mosaic_gpu",
        "bf16/1/triton",
    )
    with pytest.raises(argparse.ArgumentTypeError, match="nvfp4/3/mosaic_gpu"):
        kernels._cases("nvfp4/3/mosaic_gpu")
