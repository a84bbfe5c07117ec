"""``benchmarks.cache_attention`` at tiny shapes on the CPU: every case recorded, the kernel
(interpret mode) close to the reference and its first row equal alone."""

from __future__ import annotations

import pytest

from benchmarks import cache_attention as bca
from benchmarks import harness


def test_smoke_run_records_every_case_and_config(tmp_path):
    out = tmp_path / "ca.json"
    argv = ["--smoke", "--products", "bf16x6,ieee", "--rows-per-dot", "16,32", "--json", str(out)]
    assert bca.main(argv) == 0
    records = harness.read_records(out)
    assert [(r["batch"], r["rows"], r["products"], r["rows_per_dot"]) for r in records] == [
        (c.batch, c.rows, p, n)
        for c in bca.SMOKE_CASES
        for p in ("bf16x6", "ieee")
        for n in (16, 32)
    ]
    assert {(r["block_keys"], r["split_keys"]) for r in records} == {(16, 32)}
    for r in records:
        assert r["max_err"] < 1e-5
        assert r["row0_alone"] is True
        assert r["kernel_us"] > 0 and r["xla_us"] > 0 and r["read_us"] > 0


def test_an_unknown_products_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        bca.main(["--smoke", "--products", "bf16x6,tf32", "--json", "/dev/null"])
    assert (
        "--products: unknown 'tf32', expected one of ['bf16x6', 'ieee']" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--rows-per-dot", "24", "rows_per_dot must be one of (16, 32, 64), got 24"),
        ("--split-keys", "40", "split_keys must be a multiple of block_keys=16, got 40"),
        ("--block-keys", "16,x", "--block-keys: expected comma-separated integers, got '16,x'"),
    ],
)
def test_a_bad_tile_is_refused_by_name(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        bca.main(["--smoke", flag, value, "--json", "/dev/null"])
    assert message in capsys.readouterr().err


def test_inputs_are_causal_rows_within_the_cache():
    case = bca.Case(3, 4, 40, 33)
    q, k, v, lengths = bca.inputs(case, bca.SMOKE_HEADS, bca.jax.random.key(1))
    assert q.shape == (3, 4, 6, 32) and k.shape == v.shape == (2, 3, 40, 2, 32)
    assert int(lengths.max()) == 33 and int(lengths.min()) >= 1
    assert (lengths[:, 1:] - lengths[:, :-1] == 1).all()
