"""benchmarks.latency: the per-call timeline from a hand-written trace, and a CPU smoke run."""

from __future__ import annotations

import json

import pytest

from benchmarks import latency


def _meta():
    return [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "python"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
    ]


def _x(pid, name, ts, dur, tid=3):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_timeline_splits_each_call_into_its_parts():
    calls = [_x(1, latency.ANNOTATION, 0, 1000), _x(1, latency.ANNOTATION, 2000, 600)]
    host = [
        _x(1, "Thunks::Initialize", 10, 300),
        _x(1, "Thunks::Initialize", 2010, 100),
        _x(1, "outside any call", 1500, 400),
    ]
    device = [
        # call 1: first event at 400, overlapping events 400-600 and 500-700 (busy 300), idle
        # 700-800, one more 800-900: busy 400, idle 100, tail 1000 - 900
        _x(7, "gemv", 400, 200, tid=9),
        _x(7, "attn", 500, 200, tid=10),
        _x(7, "gemv", 800, 100, tid=9),
        # call 2: one event 2200-2500: first 200, busy 300, idle 0, tail 100
        _x(7, "gemv", 2200, 300, tid=9),
        _x(7, "between calls", 1700, 50, tid=9),
    ]
    dev, hst, threads = latency.split_events(_meta() + calls + host + device)
    assert len(dev) == 5 and len(hst) == 5
    t = latency.call_timeline(dev, hst, threads)
    assert t["calls"] == 2
    assert t["wall_us"] == pytest.approx(800)  # median of 1000 and 600
    assert t["to_first_kernel_us"] == pytest.approx(300)  # median of 400, 200
    assert t["busy_us"] == pytest.approx(350)  # median of 400 (overlap counted once), 300
    assert t["idle_us"] == pytest.approx(50)  # median of 100, 0
    assert t["after_last_kernel_us"] == pytest.approx(100)  # median of 100, 100
    assert t["device_events"] == pytest.approx(2)  # median of 3 and 1 (none between calls)
    (init,) = t["host_events"]  # the event outside both calls is not counted
    assert init["name"] == "Thunks::Initialize" and init["thread"] == "python"
    assert init["us_per_call"] == pytest.approx(200) and init["count_per_call"] == 1
    kernels = {r["kernel"]: r for r in t["device_kernels"]}
    assert set(kernels) == {"gemv", "attn"}
    assert kernels["gemv"]["us_per_call"] == pytest.approx(300)  # (200 + 100 + 300) / 2
    assert kernels["gemv"]["launches_per_call"] == pytest.approx(1.5)


def test_timeline_without_annotations_is_an_error():
    dev, hst, threads = latency.split_events([*_meta(), _x(7, "gemv", 0, 10)])
    with pytest.raises(ValueError, match=latency.ANNOTATION):
        latency.call_timeline(dev, hst, threads)


def test_smoke_run_records_every_part(tmp_path):
    out = tmp_path / "latency.json"
    argv = [
        "--smoke", "--json", str(out), "--points", "dense/bf16/1/1", "--variants", "default",
        "--iters", "1", "--calls", "1", "--context", "16",
    ]  # fmt: skip
    assert latency.main(argv) == 0
    result = json.loads(out.read_text())
    assert "--smoke" in result["run"]["command"]
    assert set(result["floors"]) == {"one_op", "chain"}
    (rec,) = result["records"]
    assert "error" not in rec, rec.get("error")
    for step in ("propose", "verify"):
        s = rec[step]
        assert 0 < s["dispatch_us"] <= s["sync_us"]
        assert s["profile"]["calls"] == 1 and s["profile"]["host_events"]
        assert s["hlo"]["copies"] >= 0 and "custom_calls" in s["hlo"]
        lay = s["layers"]
        assert 0 < lay["program"]["dispatch_us"] <= lay["program"]["sync_us"]
        assert lay["program"]["python_us"] > 0
        assert lay["arguments"]["leaves"] > 10  # the weights and the state's leaves
        assert 0 < lay["arguments"]["dispatch_us"] <= lay["arguments"]["sync_us"]
        assert 0 < s["public"]["dispatch_us"] <= s["public"]["sync_us"]
    head = rec["verify"]["layers"]["head"]
    assert 0 < head["dispatch_us"] <= head["sync_us"]
