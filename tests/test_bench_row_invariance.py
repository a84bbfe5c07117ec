"""``benchmarks.row_invariance`` at tiny shapes on the CPU: the records it writes, and a
comparison that can fail."""

from __future__ import annotations

import numpy as np

from benchmarks import harness
from benchmarks import row_invariance as ri


def test_compare_counts_the_elements_that_differ():
    a = np.zeros((2, 3), np.float32)
    b = a.copy()
    b[1, 2] = np.float32(1e-7)
    rec = ri.compare("x", 2, 4, a, b)
    assert rec["equal"] is False and rec["mismatches"] == 1
    assert rec["max_abs_diff"] == np.float32(1e-7)
    assert ri.compare("x", 2, 4, a, a.copy())["equal"] is True


def test_smoke_run_records_every_op_at_every_width(tmp_path):
    out = tmp_path / "ri.json"
    assert ri.main(["--smoke", "--sections", "ops", "--json", str(out)]) == 0
    records = harness.read_records(out)
    names = {r["what"] for r in records}
    assert {"rms_norm", "rms_norm_xla", "attend_cache", "attend_xla", "q_proj"} <= names
    assert {"lm_head_bf16", "lm_head_nvfp4"} <= names
    assert {r["width"] for r in records} == set(ri.SMOKE["op_widths"])
    # Off a GPU the steps' path is XLA's, whose dots may or may not keep rows invariant
    # depending on the CPU (its vector width picks the blocking): the records only have to agree
    # with themselves.
    for r in records:
        assert r["equal"] == (r["mismatches"] == 0), r
        assert r["mismatches"] >= 0 and r["max_abs_diff"] >= 0.0
