"""`linear` and the LM head reach the Pallas kernels (interpret mode on CPU) and agree with XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.config import LMHeadConfig
from mtpjax.head import HeadTier, init_lm_head, lm_head, with_verify_copy
from mtpjax.weights import RowsRegime, WeightFormat, linear, quantize, registered_kernels

FORMATS = ["bf16", "fp8", "fp8_block", "nvfp4"]


def test_every_format_has_gemv_kernels_registered():
    table = registered_kernels()
    for fmt in WeightFormat:
        for regime in (RowsRegime.GEMV, RowsRegime.BATCHED_GEMV):
            assert (fmt, regime) in table


def test_every_format_has_many_rows_kernels_registered():
    table = registered_kernels()
    for fmt in WeightFormat:
        for regime in (RowsRegime.TILE_GEMM, RowsRegime.GEMM):
            assert (fmt, regime) in table


# [200, 256] takes the Mosaic GEMV for the quantised formats (up to 128 rows a call, so 140
# rows are two chunks); [203, 384] does not suit its TMA copies, so they fall back to the
# Triton GEMV (in 32-row chunks) and, for FP8 per-row from 9 rows, the XLA dot.
@pytest.mark.parametrize(
    "fmt, rows, shape",
    [(f, r, (200, 256)) for f in FORMATS for r in (1, 3, 40, 140)]
    + [(f, r, (203, 384)) for f in ("fp8", "fp8_block", "nvfp4") for r in (5, 40)],
)
def test_linear_pallas_matches_xla(fmt, rows, shape):
    kw, kx = jax.random.split(jax.random.key(hash(fmt) % 1000 + rows))
    w = quantize(jax.random.normal(kw, shape) * 0.05, fmt)
    # BF16 activations: the kernels' own input type, so both paths see the same operands.
    x = jax.random.normal(kx, (rows, shape[1])).astype(jnp.bfloat16)
    got = linear(x, w, out_dtype=jnp.float32, implementation="pallas")
    ref = linear(x, w, out_dtype=jnp.float32, implementation="xla")
    # Same operands, F32 accumulation in another order: a few F32 ulps of sum |x*w|.
    bound = 1e-5 * np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(mtpjax.dequantize(w))).T
    assert np.all(np.abs(np.asarray(got) - np.asarray(ref)) <= bound + 1e-6)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_head_verify_tier_uses_the_verify_kernel(fmt):
    cfg = LMHeadConfig(vocab_size=1021, hidden_size=128)
    head = with_verify_copy(init_lm_head(cfg, key=jax.random.key(0), precision=fmt))
    hidden = jax.random.normal(jax.random.key(1), (12, 128)).astype(jnp.bfloat16)
    got = lm_head(head, hidden, cfg=cfg, tier=HeadTier.VERIFY_GEMM, implementation="pallas")
    ref = lm_head(head, hidden, cfg=cfg, tier=HeadTier.GEMM, implementation="xla")
    assert got.shape == (12, 1021)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(ref, -1))
