"""`linear` reaches the Pallas backends (interpret mode on CPU, compiled on a GPU) and agrees
with XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.weights import linear, quantize

FORMATS = ["bf16", "fp8", "fp8_block", "nvfp4"]


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
