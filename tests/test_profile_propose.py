"""benchmarks.profile: the Perfetto parsing on a hand-written trace, and the point syntax."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import profile


def _load():
    return profile


def _write_trace(path: Path, events: list[dict]) -> None:
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_breakdown_sums_gpu_events_per_call(tmp_path):
    pp = _load()
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
    ]
    gpu = [
        {"ph": "X", "pid": 7, "name": "gemv", "ts": 0, "dur": 30.0},
        {"ph": "X", "pid": 7, "name": "gemv", "ts": 50, "dur": 50.0},
        {"ph": "X", "pid": 7, "name": "argmax", "ts": 120, "dur": 20.0},
    ]
    host = [{"ph": "X", "pid": 1, "name": "dispatch", "ts": 0, "dur": 900.0}]
    _write_trace(tmp_path / "plugins" / "profile" / "run", meta + gpu + host)
    events = pp.device_events(tmp_path)
    assert sorted(e["name"] for e in events) == ["argmax", "gemv", "gemv"]  # host ignored
    rows, busy = pp.breakdown(events, calls=2)
    assert busy == pytest.approx(50.0)  # (30 + 50 + 20) / 2 calls
    assert [r["kernel"] for r in rows] == ["gemv", "argmax"]  # by time, largest first
    assert rows[0]["us_per_call"] == pytest.approx(40.0)
    assert rows[0]["launches_per_call"] == pytest.approx(1.0)


def test_missing_trace_names_the_directory(tmp_path):
    pp = _load()
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        pp.device_events(tmp_path)


def test_point_parsing_rejects_unknown_names():
    pp = _load()
    assert pp.parse_point("dense/fp8/3/8") == ("dense", "fp8", 3, 8, "propose")
    assert pp.parse_point("moe/nvfp4/1/1/round")[-1] == "round"
    for bad in ("dense/fp8/3", "huge/fp8/3/8", "dense/fp4/3/8", "dense/fp8/3/8/verify"):
        with pytest.raises(Exception, match="point"):
            pp.parse_point(bad)


def test_propose_kernels_are_attributed_to_their_parts():
    """Every part of a propose named in STEP_PARTS owns some of the compiled program's ops,
    found through the HLO's stack frames (the tiny dense drafter, K = 1, on the CPU)."""
    propose, _, params, lm, state, pairs, _ = profile.build("dense", "bf16", 1, 1, 16, smoke=True)
    text = propose.lower(params, lm, state, pairs).compile().as_text()
    parts = {profile.categorize_step(st)[0] for st in profile.hlo_sources(text).values()}
    expected = {
        "embedding", "LM head + argmax", "linear's XLA ops (casts, row chunks)", "attention",
        "q/k norm + RoPE", "page allocation", "KV write", "norms", "pair window and records",
        "draft selection", "outputs and counters",
    }  # fmt: skip
    assert expected <= parts, sorted(expected - parts)
    # The frame that names the part is the one matched, innermost first.
    stack = [("/x/pool.py", "write_rows", 3), ("/x/cache.py", "append", 9)]
    assert profile.categorize_step(stack) == ("KV write", stack[0])
    alloc = [("/x/allocator.py", "allocate", 5), ("/x/cache.py", "append", 9)]
    assert profile.categorize_step(alloc) == ("page allocation", alloc[0])
    assert profile.categorize_step([("/x/y.py", "unknown", 1)]) == ("other", None)


def test_kernels_inside_command_buffers_map_by_name():
    """Inside a command buffer the trace's ``hlo_op`` names the buffer, not the fusion: the
    kernel's own name (the fusion's, '.' as '_') is the op then; Pallas kernels map by name."""
    sources = {
        "fusion.3": [("/x/pool.py", "write_rows", 3)],
        "fusion_3": [("/x/pool.py", "write_rows", 3)],
    }
    events = [
        {"name": "fusion_3", "args": {"hlo_op": "command_buffer_1"}},
        {"name": "bf16_gemv__2", "args": {"hlo_op": "command_buffer_1"}},
        {"name": "fusion_3", "args": {"hlo_op": "fusion.3"}},
    ]
    assert profile.kernel_ops(events, sources) == {
        "fusion_3": "fusion_3",
        "bf16_gemv__2": "bf16_gemv__2",
    }
    assert profile.unmapped_category("paged_attention") == "attention (no HLO op)"
    assert profile.unmapped_category("bf16_gemv__2") == "matmuls (no HLO op)"
