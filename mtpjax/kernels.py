"""Wires the Pallas GPU kernels of `pallas_kernels/` into `linear` and the LM head.

`linear` serves 1 row (GEMV) and 2..8 rows (batched GEMV, the weight streamed once) from the
Pallas GEMV kernels; 9..96 rows and more stay on XLA there, because the verify GEMM reads a
transposed copy that only the LM head keeps (`LMHeadParams.verify_weight`), and the head's
verify tier calls the verify GEMM on it. Importing `mtpjax` registers everything once.

The kernels take BF16 activations (W4A16 / W8A16 / BF16 GEMVs): F32 activations are rounded to
BF16 on the way in, so a forced Pallas path agrees with the F32 XLA path to BF16 activation
rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from mtpjax.head import register_verify_kernel
from mtpjax.weights import (
    RowsRegime,
    Weight,
    WeightFormat,
    register_kernel,
    registered_kernels,
)

# Per format: the GEMV kernel and the weight's leaves in the kernel's argument order.
_GEMVS: dict[WeightFormat, tuple[Callable, Callable[[Weight], tuple[jax.Array, ...]]]] = {
    WeightFormat.BF16: (pk.bf16_gemv, lambda w: (w.w,)),
    WeightFormat.FP8: (pk.fp8_row_gemv, lambda w: (w.q, w.scale)),
    WeightFormat.FP8_BLOCK: (pk.fp8_block_gemv, lambda w: (w.q, w.scale_inv)),
    WeightFormat.NVFP4: (pk.nvfp4_gemv, lambda w: (w.packed, w.scale, w.scale_2)),
}

_VERIFY_GEMMS: dict[WeightFormat, tuple[Callable, Callable]] = {
    WeightFormat.BF16: (pk.verify_gemm_bf16, lambda vw: (vw.wt,)),
    WeightFormat.FP8: (pk.verify_gemm_fp8_row, lambda vw: (vw.qt, vw.scale)),
    WeightFormat.FP8_BLOCK: (pk.verify_gemm_fp8_block, lambda vw: (vw.qt, vw.scale_inv_t)),
    WeightFormat.NVFP4: (pk.verify_gemm_nvfp4, lambda vw: (vw.packed_t, vw.scale_t, vw.scale_2)),
}


def _gemv_kernel(fmt: WeightFormat):
    kernel, leaves = _GEMVS[fmt]

    def run(x: jax.Array, w: Weight, *, out_dtype, interpret: bool) -> jax.Array:
        y = kernel(x.astype(jnp.bfloat16), *leaves(w), interpret=interpret)
        return y.astype(out_dtype)

    return run


def _verify_kernel(fmt: WeightFormat):
    kernel, leaves = _VERIFY_GEMMS[fmt]

    def run(x: jax.Array, vw, *, n_cols: int, interpret: bool) -> jax.Array:
        return kernel(x.astype(jnp.bfloat16), *leaves(vw), n=n_cols, interpret=interpret)

    return run


def register_pallas_kernels() -> None:
    """Registers every Pallas kernel; calling it again is a no-op."""
    if any(k[0] is WeightFormat.BF16 for k in registered_kernels()):
        return
    for fmt in _GEMVS:
        for regime in (RowsRegime.GEMV, RowsRegime.BATCHED_GEMV):
            register_kernel(fmt, regime, _gemv_kernel(fmt))
        register_verify_kernel(fmt, _verify_kernel(fmt))
