"""Wires the Pallas GPU kernels of `pallas_kernels/` into `linear` and the LM head.

Which kernel a ``[N, K]`` weight and ``M`` rows of activations get on the GPU (measured on the
H200 LM head; `benchmarks/results/linear_h200.json` times this dispatch against XLA):

* NVFP4, FP8 per-row and FP8 block-128 weights whose shape suits the TMA copies (N % 8 == 0;
  K % 256 == 0 for NVFP4, K % 128 == 0 for FP8 — every real projection and head): the Mosaic GPU
  tensor-core GEMV at every row count, up to 128 rows per call and a loop over 128-row chunks
  beyond, reading the row-major weight once per call. One kernel family for every row count
  also means a row's logits do not depend on how many rows share the call (decode, verify and
  a batch score it alike; bench_linear checks it bit for bit on the GPU).
* BF16: the Triton GEMV for 1..8 rows; from 9 rows one XLA dot on BF16 operands.
* The quantised formats in other shapes: the Triton GEMV for up to 32 rows, a loop over
  32-row chunks beyond (FP8 per-row: the XLA BF16-operand dot from 9 rows, FP8 widened to
  BF16 inside the dot's fusion and the per-row scale applied after). XLA has no fused decode
  for NVFP4 or block scales: its dequantise-then-dot path writes and re-reads the weight in
  BF16 and was 8x slower than a GEMV pass.

The LM head's verify tier (the Triton verify GEMM on the transposed copy that
``with_verify_copy`` builds) is registered for every format with ``auto=False``: the row-major
paths above were faster at verify widths on the H200 LM head, so the default tier choice never
reads a copy; ``tier="verify_gemm"`` still runs the kernel. At 96 rows, one run each: NVFP4 606
us against 2357 on the copy, FP8 714 against 1597 (`kernels_mosaic_rows_fp8_h200.json`, before
the fused epilogue); FP8 block-128 1567 against 2122, BF16 682 against 882
(`linear_h200_verify_copy.json`; all four synced timings).

The XLA reference computes F32 activations in F32 at HIGHEST precision (exact on the CPU, and
FFMA-bound on a GPU); the kernels take BF16 activations (W4A16 / W8A16 / BF16): F32
activations are rounded to BF16 on the way in, so a forced Pallas path agrees with the F32
XLA path to BF16 activation rounding, not bit for bit. Importing `mtpjax` registers
everything once.
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

# Per format: the Triton GEMV kernel and the weight's leaves in the kernel's argument order.
_GEMVS: dict[WeightFormat, tuple[Callable, Callable[[Weight], tuple[jax.Array, ...]]]] = {
    WeightFormat.BF16: (pk.bf16_gemv, lambda w: (w.w,)),
    WeightFormat.FP8: (pk.fp8_row_gemv, lambda w: (w.q, w.scale)),
    WeightFormat.FP8_BLOCK: (pk.fp8_block_gemv, lambda w: (w.q, w.scale_inv)),
    WeightFormat.NVFP4: (pk.nvfp4_gemv, lambda w: (w.packed, w.scale, w.scale_2)),
}

# Per format whose Mosaic GEMV exists: the kernel, its leaves and its K granularity.
_MOSAIC_GEMVS: dict[WeightFormat, tuple[Callable, Callable[[Weight], tuple], int]] = {
    WeightFormat.FP8: (pk.fp8_row_gemv_mosaic, lambda w: (w.q, w.scale), pk.MOSAIC_FP8_K_ALIGN),
    WeightFormat.FP8_BLOCK: (
        pk.fp8_block_gemv_mosaic,
        lambda w: (w.q, w.scale_inv),
        pk.MOSAIC_FP8_K_ALIGN,
    ),
    WeightFormat.NVFP4: (
        pk.nvfp4_gemv_mosaic,
        lambda w: (w.packed, w.scale, w.scale_2),
        pk.MOSAIC_K_ALIGN,
    ),
}

_VERIFY_GEMMS: dict[WeightFormat, tuple[Callable, Callable]] = {
    WeightFormat.BF16: (pk.verify_gemm_bf16, lambda vw: (vw.wt,)),
    WeightFormat.FP8: (pk.verify_gemm_fp8_row, lambda vw: (vw.qt, vw.scale)),
    WeightFormat.FP8_BLOCK: (pk.verify_gemm_fp8_block, lambda vw: (vw.qt, vw.scale_inv_t)),
    WeightFormat.NVFP4: (pk.verify_gemm_nvfp4, lambda vw: (vw.packed_t, vw.scale_t, vw.scale_2)),
}


def _takes_mosaic(w: Weight) -> bool:
    """Whether ``w`` has a Mosaic GEMV and a shape its TMA copies take."""
    if w.format not in _MOSAIC_GEMVS:
        return False
    k_align = _MOSAIC_GEMVS[w.format][2]
    return w.out_features % pk.MOSAIC_N_ALIGN == 0 and w.in_features % k_align == 0


def _row_kernel(w: Weight, interpret: bool) -> tuple[Callable[[jax.Array], jax.Array], int]:
    """The GEMV kernel for ``w`` as ``bf16[M, K] -> f32[M, N]``, and its most rows per call."""
    if _takes_mosaic(w):
        kernel, leaves, _ = _MOSAIC_GEMVS[w.format]
        # Tiles: the kernel's default_config, measured per row band on the H200 LM head.
        return lambda xb: kernel(xb, *leaves(w), interpret=interpret), pk.MOSAIC_MAX_ROWS
    kernel, leaves = _GEMVS[w.format]
    return lambda xb: kernel(xb, *leaves(w), interpret=interpret), pk.GEMV_MAX_ROWS


def _in_row_chunks(kernel: Callable, xb: jax.Array, chunk: int, n: int) -> jax.Array:
    """``kernel`` over ``xb: [M, K]`` in chunks of at most ``chunk`` rows -> ``[M, n]``.

    One kernel in a loop over the chunks (zero rows pad the last), not one call per chunk
    unrolled into the program: a prefill-sized M stays one kernel to compile.
    """
    m = xb.shape[0]
    if m <= chunk:
        return kernel(xb)
    chunks = jnp.pad(xb, ((0, -m % chunk), (0, 0))).reshape(-1, chunk, xb.shape[1])
    return jax.lax.map(kernel, chunks).reshape(-1, n)[:m]


def _gemv_kernel(x: jax.Array, w: Weight, *, out_dtype, interpret: bool) -> jax.Array:
    """1..8 rows: one GEMV call, the weight streamed once for all rows."""
    kernel, _ = _row_kernel(w, interpret)
    return kernel(x.astype(jnp.bfloat16)).astype(out_dtype)


def _bf16_operands_dot(x: jax.Array, w: Weight) -> jax.Array:
    """``x @ w.T`` on BF16 operands with F32 accumulation: f32[M, N] (BF16 and FP8 per-row)."""
    xb = x.astype(jnp.bfloat16)
    wb = w.w if w.format is WeightFormat.BF16 else w.q.astype(jnp.bfloat16)  # FP8 is exact in BF16
    y = jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y if w.format is WeightFormat.BF16 else y * w.scale


def _many_rows_kernel(x: jax.Array, w: Weight, *, out_dtype, interpret: bool) -> jax.Array:
    """9 rows and more: the GEMV kernel over row chunks, or one BF16-operand XLA dot."""
    if w.format is WeightFormat.BF16 or (w.format is WeightFormat.FP8 and not _takes_mosaic(w)):
        return _bf16_operands_dot(x, w).astype(out_dtype)
    kernel, chunk = _row_kernel(w, interpret)
    y = _in_row_chunks(kernel, x.astype(jnp.bfloat16), chunk, w.out_features)
    return y.astype(out_dtype)


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
            register_kernel(fmt, regime, _gemv_kernel)
        for regime in (RowsRegime.TILE_GEMM, RowsRegime.GEMM):
            register_kernel(fmt, regime, _many_rows_kernel)
        register_verify_kernel(fmt, _verify_kernel(fmt), auto=False)
