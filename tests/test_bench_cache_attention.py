"""``benchmarks.cache_attention`` at tiny shapes on the CPU: every case recorded, the kernel
(interpret mode) close to the reference and its first row equal alone."""

from __future__ import annotations

import pytest

from benchmarks import cache_attention as bca
from benchmarks import harness


def test_smoke_run_records_every_case_and_products(tmp_path):
    out = tmp_path / "ca.json"
    assert bca.main(["--smoke", "--products", "bf16x6,ieee", "--json", str(out)]) == 0
    records = harness.read_records(out)
    assert [(r["batch"], r["rows"], r["products"]) for r in records] == [
        (c.batch, c.rows, p) for c in bca.SMOKE_CASES for p in ("bf16x6", "ieee")
    ]
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


def test_inputs_are_causal_rows_within_the_cache():
    case = bca.Case(3, 4, 40, 33)
    q, k, v, lengths = bca.inputs(case, bca.SMOKE_HEADS, bca.jax.random.key(1))
    assert q.shape == (3, 4, 6, 32) and k.shape == v.shape == (2, 3, 40, 2, 32)
    assert int(lengths.max()) == 33 and int(lengths.min()) >= 1
    assert (lengths[:, 1:] - lengths[:, :-1] == 1).all()
