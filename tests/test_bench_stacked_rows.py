"""benchmarks.stacked_rows: one --smoke run end to end (tiny shapes, interpret mode, CPU)."""

import json

from benchmarks import stacked_rows


def test_smoke_times_every_variant_and_checks_each_stack_read(tmp_path):
    out = tmp_path / "stacked.json"
    argv = ["--smoke", "--rows", "4,40", "--tiles", "split", "--json", str(out)]
    assert stacked_rows.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["run"]["command"].startswith("python -m benchmarks.stacked_rows --smoke")
    records = [r for r in data["records"] if r["kind"] == "projection"]
    assert not [r for r in records if "error" in r]
    # Every variant at every row count: the three XLA programs, linear, the Triton
    # GEMV's default and each tile.
    want = {"xla_copy", "xla_copy_dsf", "xla_plain", "linear", "triton_default", "triton"}
    for rows in (4, 40):
        at = [r for r in records if r["rows"] == rows]
        assert {r["variant"] for r in at} == want
        assert len([r for r in at if r["variant"] == "triton"]) == len(stacked_rows.SPLIT_TILES)
    for r in records:
        assert r["us_per_entry"] > 0 and r["ratio_to_ideal"] > 0 and r["temp_bytes"] is not None
        # Each program that reads the stack in place sums the same products as the copy path.
        if r["variant"] not in ("xla_copy", "xla_plain"):
            assert r["max_rel_err"] < 1e-5, r
