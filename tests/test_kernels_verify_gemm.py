"""Verify GEMM on the transposed, column-padded weight copy (interpret mode)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import leaves, numpy_dequant, rel_err

from pallas_kernels import gemv as G
from pallas_kernels import verify_gemm as V

FORMATS = ("bf16", "fp8_row", "fp8_block", "nvfp4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_make_transposed_layout(fmt):
    rng = np.random.default_rng(1)
    n, k = 1021, 272 if fmt != "fp8_block" else 384
    lv = leaves(fmt, n, k, rng)
    t = V.make_transposed(fmt, *lv)
    assert t[0].shape[1] == 1024 and t[0].shape[0] == (k // 2 if fmt == "nvfp4" else k)
    # The copy holds the same weight (padding columns are zero).
    if fmt == "bf16":
        w = np.asarray(t[0], np.float64).T
    elif fmt == "fp8_row":
        w = np.asarray(t[0], np.float64).T * np.asarray(t[1], np.float64)[:, None]
    elif fmt == "fp8_block":
        w = numpy_dequant("fp8_block", np.asarray(t[0]).T, np.asarray(t[1]).T)
        assert t[1].shape == (3, 8)
    else:
        w = numpy_dequant("nvfp4", np.asarray(t[0]).T, np.asarray(t[1]).T, t[2])
    np.testing.assert_array_equal(w[:n], numpy_dequant(fmt, *lv))
    np.testing.assert_array_equal(w[n:], 0.0)


@pytest.mark.parametrize(
    ("fmt", "m"), [("nvfp4", 9), ("nvfp4", 96), ("fp8_row", 33), ("fp8_block", 17), ("bf16", 64)]
)
def test_verify_gemm_matches_reference(fmt, m):
    """Odd N (1021), K tail, rows 9..96 (96 = a 64-row and a 32-row chunk), split-K."""
    rng = np.random.default_rng(m)
    n, k = 1021, (272 if fmt != "fp8_block" else 384)
    lv = leaves(fmt, n, k, rng)
    t = V.make_transposed(fmt, *lv)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    cfg = V.VerifyGemmConfig(block_n=128, block_k=128, split_k=2, decode="arith")
    kern, ref = V.KERNELS[fmt]
    out = kern(x, *t, n=n, config=cfg, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, ref(x, *t, n=n)) < 2e-6
    # Same numbers as the GEMV reference on the original leaves.
    assert rel_err(out, G.KERNELS[fmt][1](x, *lv)) < 2e-6


@pytest.mark.parametrize(
    "kw", [dict(swap_ab=True), dict(row_chunks=False), dict(prefetch=False), dict(block_n=64)]
)
def test_verify_gemm_variants(kw):
    rng = np.random.default_rng(7)
    n, k, m = 250, 512, 40
    lv = leaves("nvfp4", n, k, rng)
    t = V.make_transposed("nvfp4", *lv)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    cfg = V.VerifyGemmConfig(block_k=256, decode="arith", **kw)
    out = V.verify_gemm_nvfp4(x, *t, n=n, config=cfg, interpret=True)
    assert rel_err(out, V.verify_gemm_nvfp4_reference(x, *t, n=n)) < 2e-6


def test_default_config_heuristic():
    for fmt in FORMATS:
        for m in (9, 32, 96):
            cfg = V.default_config(fmt, m, 248077, 5120)
            assert 128 % cfg.block_n == 0
            if fmt == "fp8_block":
                assert cfg.block_k % 128 == 0


def test_rejects_bad_inputs():
    rng = np.random.default_rng(0)
    (w,) = leaves("bf16", 100, 64, rng)
    (wt,) = V.make_transposed("bf16", w)
    with pytest.raises(ValueError, match="N_pad"):
        V.verify_gemm_bf16(jnp.zeros((9, 64), jnp.bfloat16), wt, n=200, interpret=True)
    with pytest.raises(ValueError, match="rows"):
        V.verify_gemm_bf16(jnp.zeros((129, 64), jnp.bfloat16), wt, n=100, interpret=True)
    with pytest.raises(ValueError):
        V.make_transposed("int4", w)
    with pytest.raises(ValueError):
        V.VerifyGemmConfig(block_n=256)
