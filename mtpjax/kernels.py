"""Wires the Pallas GPU kernels of `pallas_kernels/` into `linear` and the LM head.

`linear` serves 1 row (GEMV) and 2..8 rows (batched GEMV, the weight streamed once) from the
Pallas GEMV kernels (NVFP4: the Mosaic GPU tensor-core kernel where the shape allows). Nine rows and more (a batch of sequences, a verify-wide window, MoE
experts over every row) cannot use the verify GEMM, which reads a transposed copy that only the
LM head keeps (`LMHeadParams.verify_weight`; the head's verify tier calls it). They take the
tensor cores on BF16 operands with F32 accumulation instead:

* BF16 and FP8 per-row weights: one XLA dot on BF16 operands (FP8 widened to BF16 inside the
  dot's fusion, the per-row scale applied after), so the weight is read once at any row count;
* NVFP4 and FP8 block-128: the batched GEMV kernel over chunks of 32 rows, one weight pass per
  chunk. XLA has no fused decode for these formats: its dequantise-then-dot path writes and
  re-reads the weight in BF16 and was 8x slower than a GEMV pass on the H200.

The XLA reference computes F32 activations in F32 at HIGHEST precision (exact on the CPU, and
FFMA-bound on a GPU); the kernels round activations to BF16 on the way in, like every kernel
here. Importing `mtpjax` registers everything once.

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


def _nvfp4_gemv(x, packed, scale, scale_2, *, interpret: bool) -> jax.Array:
    """NVFP4 GEMV: the Mosaic GPU tensor-core kernel where the checkpoint layout suits its TMA
    copies (N % 8 == 0, K % 256 == 0: every real projection and head), else the Triton one.
    On the H200 LM head the Mosaic kernel took 266 us at M=1 against Triton's 359, and stays
    flat up to M=8 (Triton: 515 us) because the MMA, not the ALUs, does the multiply-adds."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if n % pk.MOSAIC_N_ALIGN == 0 and k % pk.MOSAIC_K_ALIGN == 0:
        # The tile every row count up to 32 ran with in the H200 propose benchmark; the wider
        # tiles the kernel's own heuristic picks above 8 rows are not measured yet.
        cfg = pk.MosaicGemvConfig(
            block_n=64, block_k=512 if k >= 512 else pk.MOSAIC_K_ALIGN, stages=2
        )
        return pk.nvfp4_gemv_mosaic(x, packed, scale, scale_2, config=cfg, interpret=interpret)
    return pk.nvfp4_gemv(x, packed, scale, scale_2, interpret=interpret)


# Per format: the GEMV kernel and the weight's leaves in the kernel's argument order.
_GEMVS: dict[WeightFormat, tuple[Callable, Callable[[Weight], tuple[jax.Array, ...]]]] = {
    WeightFormat.BF16: (pk.bf16_gemv, lambda w: (w.w,)),
    WeightFormat.FP8: (pk.fp8_row_gemv, lambda w: (w.q, w.scale)),
    WeightFormat.FP8_BLOCK: (pk.fp8_block_gemv, lambda w: (w.q, w.scale_inv)),
    WeightFormat.NVFP4: (_nvfp4_gemv, lambda w: (w.packed, w.scale, w.scale_2)),
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


#: Rows per batched-GEMV pass in the many-rows regimes (the kernel's ceiling).
GEMV_CHUNK_ROWS = pk.GEMV_MAX_ROWS


def _bf16_operands_dot(x: jax.Array, w: Weight) -> jax.Array:
    """``x @ w.T`` on BF16 operands with F32 accumulation: f32[M, N] (BF16 and FP8 per-row)."""
    xb = x.astype(jnp.bfloat16)
    wb = w.w if w.format is WeightFormat.BF16 else w.q.astype(jnp.bfloat16)  # FP8 is exact in BF16
    y = jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y if w.format is WeightFormat.BF16 else y * w.scale


def _many_rows_kernel(fmt: WeightFormat):
    gemv, leaves = _GEMVS[fmt]
    dot_in_xla = fmt in (WeightFormat.BF16, WeightFormat.FP8)

    def run(x: jax.Array, w: Weight, *, out_dtype, interpret: bool) -> jax.Array:
        if dot_in_xla:
            return _bf16_operands_dot(x, w).astype(out_dtype)
        m = x.shape[0]
        xb = x.astype(jnp.bfloat16)
        if m <= GEMV_CHUNK_ROWS:
            return gemv(xb, *leaves(w), interpret=interpret).astype(out_dtype)
        # One kernel in a loop over 32-row chunks (zero rows pad the last), not one call per
        # chunk unrolled into the program: a prefill-sized M stays one kernel to compile.
        chunks = jnp.pad(xb, ((0, -m % GEMV_CHUNK_ROWS), (0, 0)))
        chunks = chunks.reshape(-1, GEMV_CHUNK_ROWS, x.shape[1])
        y = jax.lax.map(lambda c: gemv(c, *leaves(w), interpret=interpret), chunks)
        return y.reshape(-1, w.out_features)[:m].astype(out_dtype)

    return run


def register_pallas_kernels() -> None:
    """Registers every Pallas kernel; calling it again is a no-op."""
    if any(k[0] is WeightFormat.BF16 for k in registered_kernels()):
        return
    for fmt in _GEMVS:
        for regime in (RowsRegime.GEMV, RowsRegime.BATCHED_GEMV):
            register_kernel(fmt, regime, _gemv_kernel(fmt))
        for regime in (RowsRegime.TILE_GEMM, RowsRegime.GEMM):
            register_kernel(fmt, regime, _many_rows_kernel(fmt))
        register_verify_kernel(fmt, _verify_kernel(fmt))
