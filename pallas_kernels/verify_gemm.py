"""Verify-regime GEMM (9..96 rows) on a transposed, column-padded weight copy.

The verify pass projects batch x (k+1) rows (up to 96) through the LM head. A GEMV that loops over
rows would re-read the weight per row, and a square-tile GEMM wastes most of its M tile; this
kernel keeps every row in one tile (rows padded to a power of two >= 16), streams the weight once
and multiplies on the tensor cores (``pl.dot``).

It reads a *transposed* copy of the weight whose leading dimension (the vocabulary) is padded to a
multiple of 128, so odd vocabularies (e.g. 248077) need no row masks on the weight loads and every
tile load is contiguous along N. :func:`make_transposed` builds that copy from the DESIGN §3 leaves:

  format      DESIGN leaves                               transposed copy (N_pad = round_up(N, 128))
  bf16        w bf16[N, K]                                wt bf16[K, N_pad]
  fp8_row     q f8[N, K], scale f32[N]                    qt f8[K, N_pad], scale f32[N_pad]
  fp8_block   q f8[N, K], scale_inv f32[N/128, K/128]     qt f8[K, N_pad], scale_inv_t f32[K/128, N_pad/128]
  nvfp4       packed u8[N, K/2], scale f8[N, K/16], s2    packed_t u8[K/2, N_pad], scale_t f8[K/16, N_pad], s2

(``/128`` means ceil.) Byte ``packed_t[j, n]`` still holds elements 2j (low nibble) and 2j+1 of row
n; padded columns are zero. The kernels take ``n`` (the true N) and return f32[M, n].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

MAX_ROWS = 128
PAD_MULTIPLE = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyGemmConfig:
    """Tiles of the verify GEMM.

    Attributes:
      block_n: output columns per program (power of two, <= 128, divides 128).
      block_k: K elements per loop step (power of two, >= 128 for FP8 block-128, >= 32).
      split_k: K slices run as separate programs and summed afterwards.
      num_warps, num_stages: Triton launch parameters.
      decode: NVFP4 nibble decoder, "asm" (inline PTX) or "arith".
      prefetch: load step i+1's tiles before step i's math (loop-carried registers).
      row_chunks: split the rows into power-of-two chunks (96 -> 64 + 32) instead of padding
        them to the next power of two (128), saving tensor-core work.
      swap_ab: compute (weight tile)^T @ rows^T, putting the weight columns on the MMA's M side.
    """

    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    decode: Literal["asm", "arith"] = "asm"
    prefetch: bool = False
    row_chunks: bool = True
    swap_ab: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not C.is_pow2(v):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if not 16 <= self.block_n <= PAD_MULTIPLE:
            raise ValueError(f"block_n must be in [16, {PAD_MULTIPLE}], got {self.block_n}")
        if self.block_k < 32:
            raise ValueError(f"block_k must be >= 32, got {self.block_k}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError("split_k and num_stages must be >= 1")
        if self.decode not in ("asm", "arith"):
            raise ValueError(f"decode must be 'asm' or 'arith', got {self.decode!r}")


def default_config(fmt: str, m: int, n: int, k: int) -> VerifyGemmConfig:
    """Heuristic (measured on H200): 128-column tiles, shorter K steps as the row tile grows."""
    m_pad = sum(C.row_chunks(m))
    small_k, big_k, limit = (256, 128, 32) if fmt == "nvfp4" else (128, 64, 64)
    block_k = small_k if m_pad <= limit else big_k
    if fmt == "fp8_block":
        block_k = max(block_k, 128)
    block_k = min(block_k, max(32, C.next_pow2(k)))
    block_n = 128
    programs = C.cdiv(n, block_n)
    iters = C.cdiv(k, block_k)
    split_k = 1
    while programs * split_k < 2 * 132 and split_k * 2 <= iters:
        split_k *= 2
    return VerifyGemmConfig(
        block_n=block_n,
        block_k=block_k,
        split_k=split_k,
        num_warps=4 if m_pad <= 32 else 8,
        num_stages=3,
    )


# ---------------------------------------------------------------------------------------------
# Building the transposed, padded copy.
# ---------------------------------------------------------------------------------------------


def _pad_cols(a: jax.Array, n_pad: int) -> jax.Array:
    return jnp.pad(a, ((0, 0), (0, n_pad - a.shape[1])))


def make_transposed(fmt: str, *leaves: jax.Array) -> tuple[jax.Array, ...]:
    """Transpose a weight's DESIGN §3 leaves to [K, N_pad] (N_pad = round_up(N, 128)).

    Args:
      fmt: "bf16" | "fp8_row" | "fp8_block" | "nvfp4".
      *leaves: the format's leaves in DESIGN order (see the module docstring).

    Returns:
      The transposed leaves, to pass with ``n=N`` to the matching ``verify_gemm_*``.
    """
    if fmt == "bf16":
        (w,) = leaves
        n_pad = C.round_up(w.shape[0], PAD_MULTIPLE)
        return (_pad_cols(w.T, n_pad),)
    if fmt == "fp8_row":
        q, scale = leaves
        n_pad = C.round_up(q.shape[0], PAD_MULTIPLE)
        s = jnp.pad(scale.astype(jnp.float32), (0, n_pad - q.shape[0]))
        return _pad_cols(q.T, n_pad), s
    if fmt == "fp8_block":
        q, scale_inv = leaves
        n_pad = C.round_up(q.shape[0], PAD_MULTIPLE)
        s = scale_inv.astype(jnp.float32).T
        return _pad_cols(q.T, n_pad), _pad_cols(s, n_pad // 128)
    if fmt == "nvfp4":
        packed, scale, scale_2 = leaves
        n_pad = C.round_up(packed.shape[0], PAD_MULTIPLE)
        return (
            _pad_cols(packed.T, n_pad),
            _pad_cols(scale.T, n_pad),
            jnp.asarray(scale_2, jnp.float32),
        )
    raise ValueError(f"unknown format {fmt!r}; expected bf16|fp8_row|fp8_block|nvfp4")


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------


def _load(ref_view, mask):
    if mask is None:
        return ref_view[...]
    return plgpu.load(ref_view, mask=mask, other=0)


def _verify_kernel(
    *refs, fmt, m, chunks, n, k, bn, bk, iters_per_split, total_iters, asm, prefetch, swap_ab
):
    """One program: all rows x columns [n0, n0+bn) x K slice ``program_id(1)``.

    Refs (f8 data arrives as uint8 bytes; x operands are float16 row-scaled, bf16 for BF16):
      nvfp4:     x_even, x_odd [m_pad, K/2], xinv, packed_t u8[K/16, 8, N_pad],
                 scale_t u8[K/16, N_pad], gscale f32[1]
      fp8_row:   x [m_pad, K], xinv, qt u8[K, N_pad], col_scale f32[N_pad]
      fp8_block: x, xinv, qt u8[K, N_pad], scale_inv_t f32[K/128, N_pad/128]
      bf16:      x, xinv, wt bf16[K, N_pad]
    The rows are handled as power-of-two chunks (``chunks``, e.g. 64 + 32 for 96 rows), each its
    own dot and accumulator, all sharing one dequantised weight tile.
    """
    if fmt == "nvfp4":
        xe_ref, xo_ref, xinv_ref, packed_ref, scale_ref, gscale_ref, o_ref = refs
        x_refs = (xe_ref, xo_ref)
    elif fmt == "fp8_row":
        x_ref, xinv_ref, q_ref, cscale_ref, o_ref = refs
        x_refs = (x_ref,)
    elif fmt == "fp8_block":
        x_ref, xinv_ref, q_ref, sinv_ref, o_ref = refs
        x_refs = (x_ref,)
    else:
        x_ref, xinv_ref, w_ref, o_ref = refs
        x_refs = (x_ref,)
    pid_n = pl.program_id(0)
    pid_s = pl.program_id(1)
    n0 = pl.multiple_of(pid_n * bn, bn)
    k_tail = k % bk != 0
    offsets = [sum(chunks[:j]) for j in range(len(chunks))]

    def kmask(start, width, per):
        if not k_tail:
            return None
        return (start + jnp.arange(width, dtype=jnp.int32)) * per < k

    def load_x(start, width, per):
        km = kmask(start, width, per)
        return tuple(
            tuple(
                _load(ref.at[pl.ds(r0, c), pl.ds(start, width)], None if km is None else km[None])
                for r0, c in zip(offsets, chunks)
            )
            for ref in x_refs
        )

    def load(i):
        if fmt == "nvfp4":
            kg = bk // 16
            g0 = i * kg
            gm = kmask(g0, kg, 16)
            codes = _load(
                packed_ref.at[pl.ds(g0, kg), :, pl.ds(n0, bn)],
                None if gm is None else gm[:, None, None],
            )
            sc = _load(
                scale_ref.at[pl.ds(g0, kg), pl.ds(n0, bn)], None if gm is None else gm[:, None]
            )
            return codes, sc, load_x(i * (bk // 2), bk // 2, 2)
        if fmt == "fp8_block":
            kbs = sinv_ref.shape[0]
            out = []
            for c in range(bk // 128):
                kc = i * bk + c * 128
                km = kmask(kc, 128, 1)
                q = _load(
                    q_ref.at[pl.ds(kc, 128), pl.ds(n0, bn)], None if km is None else km[:, None]
                )
                s = sinv_ref[jnp.minimum(i * (bk // 128) + c, kbs - 1), n0 // 128]
                out.append((q, s, load_x(kc, 128, 1)))
            return tuple(out)
        km = kmask(i * bk, bk, 1)
        src = q_ref if fmt == "fp8_row" else w_ref
        w = _load(src.at[pl.ds(i * bk, bk), pl.ds(n0, bn)], None if km is None else km[:, None])
        return w, load_x(i * bk, bk, 1)

    def mm(xt, w):
        """x chunk [c, kk] times weight tile [kk, bn] -> [c, bn] (or its transpose)."""
        if swap_ab:
            return jax.lax.dot_general(
                w, xt, (((0,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
        return jax.lax.dot_general(
            xt, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    def compute_step(raw, accs):
        if fmt == "nvfp4":
            codes, sc, (xe, xo) = raw
            kg = bk // 16
            sc16 = jnp.broadcast_to(C.from_u8_e4m3(sc, jnp.float16)[:, None, :], (kg, 8, bn))
            lo, hi = C.decode_e2m1_scaled(codes, sc16, use_asm=asm)
            lo, hi = lo.reshape(bk // 2, bn), hi.reshape(bk // 2, bn)
            return tuple(a + mm(e, lo) + mm(o, hi) for a, e, o in zip(accs, xe, xo))
        if fmt == "fp8_block":
            for q, s, (xc,) in raw:
                w = C.from_u8_e4m3(q, jnp.float16)
                accs = tuple(a + mm(x, w) * s for a, x in zip(accs, xc))
            return accs
        w, (xc,) = raw
        if fmt == "fp8_row":
            w = C.from_u8_e4m3(w, jnp.float16)
        return tuple(a + mm(x, w) for a, x in zip(accs, xc))

    acc0 = tuple(jnp.zeros((bn, c) if swap_ab else (c, bn), jnp.float32) for c in chunks)
    accs = C.split_k_loop(
        load,
        compute_step,
        acc0,
        split_index=pid_s,
        iters_per_split=iters_per_split,
        total_iters=total_iters,
        prefetch=prefetch,
    )

    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    col_scale = None
    if fmt == "fp8_row":
        col_scale = cscale_ref[pl.ds(n0, bn)]
    gscale = gscale_ref[0] * C.E2M1_F16_UNBIAS if fmt == "nvfp4" else None
    for acc, r0, c in zip(accs, offsets, chunks):
        v = acc.T if swap_ab else acc  # [c, bn]
        v = v * xinv_ref[pl.ds(r0, c)][:, None]
        if col_scale is not None:
            v = v * col_scale[None, :]
        if gscale is not None:
            v = v * gscale
        mask = ((r0 + jnp.arange(c, dtype=jnp.int32)) < m)[:, None] & (cols < n)[None, :]
        plgpu.store(o_ref.at[pid_s, pl.ds(jnp.int32(r0), c), pl.ds(n0, bn)], v, mask=mask)


def _verify(fmt, x, weights, n, k, n_pad, config, interpret):
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {x.shape}")
    if n_pad % PAD_MULTIPLE or not 0 < n <= n_pad:
        raise ValueError(f"transposed weight must have N_pad % 128 == 0 >= n, got {n_pad}, n={n}")
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"verify_gemm takes 1..{MAX_ROWS} rows, got {m}")
    cfg = config or default_config(fmt, m, n, k)
    bn, bk = cfg.block_n, cfg.block_k
    if fmt == "fp8_block" and bk % 128:
        raise ValueError("FP8 block-128 needs block_k a multiple of 128")
    chunks = C.row_chunks(m) if cfg.row_chunks else (max(16, C.next_pow2(m)),)
    m_pad = sum(chunks)
    total_iters = C.cdiv(k, bk)
    split = max(1, min(cfg.split_k, total_iters))
    iters_per_split = C.cdiv(total_iters, split)
    split = C.cdiv(total_iters, iters_per_split)
    if fmt == "bf16":
        xs = (jnp.pad(x.astype(jnp.bfloat16), ((0, m_pad - m), (0, 0))),)
        xinv = jnp.ones((m_pad,), jnp.float32)
    else:
        x16, xinv = C.to_f16_rowscaled(x, m_pad)
        xinv = jnp.pad(xinv, (0, m_pad - m))
        if fmt == "nvfp4":
            x2 = x16.reshape(m_pad, k // 2, 2)
            xs = (x2[:, :, 0], x2[:, :, 1])
        else:
            xs = (x16,)
    if fmt == "nvfp4":
        packed_t, scale_t, gs = weights
        weights = (packed_t.reshape(k // 16, 8, n_pad), C.as_u8(scale_t), gs)
    elif fmt in ("fp8_row", "fp8_block"):
        weights = (C.as_u8(weights[0]), *weights[1:])
    kernel = functools.partial(
        _verify_kernel,
        fmt=fmt,
        m=m,
        chunks=chunks,
        n=n,
        k=k,
        bn=bn,
        bk=bk,
        iters_per_split=iters_per_split,
        total_iters=total_iters,
        asm=cfg.decode == "asm" and not interpret,
        prefetch=cfg.prefetch,
        swap_ab=cfg.swap_ab,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, m, n), jnp.float32),
        grid=(n_pad // bn, split),
        compiler_params=C.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=f"{fmt}_verify_gemm",
    )(*xs, xinv, *weights)
    return out[0] if split == 1 else jnp.sum(out, axis=0)


# ---------------------------------------------------------------------------------------------
# Public kernels and references (same signatures).
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("n", "config", "interpret"))
def verify_gemm_bf16(
    x: jax.Array,
    wt: jax.Array,
    *,
    n: int,
    config: VerifyGemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x bf16[M, K] (M <= 128) times wt bf16[K, N_pad] -> f32[M, n]."""
    k, n_pad = wt.shape
    return _verify("bf16", x, (wt,), n, k, n_pad, config, interpret)


def verify_gemm_bf16_reference(x, wt, *, n, config=None, interpret=False):
    del config, interpret
    w = wt[:, :n].astype(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("n", "config", "interpret"))
def verify_gemm_fp8_row(
    x: jax.Array,
    qt: jax.Array,
    scale: jax.Array,
    *,
    n: int,
    config: VerifyGemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x bf16[M, K] times (qt f8[K, N_pad] * scale f32[N_pad]) -> f32[M, n]."""
    k, n_pad = qt.shape
    return _verify("fp8_row", x, (qt, scale.astype(jnp.float32)), n, k, n_pad, config, interpret)


def verify_gemm_fp8_row_reference(x, qt, scale, *, n, config=None, interpret=False):
    del config, interpret
    w = qt[:, :n].astype(jnp.float32) * scale[:n].astype(jnp.float32)[None, :]
    return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("n", "config", "interpret"))
def verify_gemm_fp8_block(
    x: jax.Array,
    qt: jax.Array,
    scale_inv_t: jax.Array,
    *,
    n: int,
    config: VerifyGemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x bf16[M, K] times qt f8[K, N_pad] * scale_inv_t[k // 128, n // 128] -> f32[M, n]."""
    k, n_pad = qt.shape
    if scale_inv_t.shape != (C.cdiv(k, 128), n_pad // 128):
        raise ValueError(f"scale_inv_t must be [{C.cdiv(k, 128)}, {n_pad // 128}]")
    sinv = scale_inv_t.astype(jnp.float32)
    return _verify("fp8_block", x, (qt, sinv), n, k, n_pad, config, interpret)


def verify_gemm_fp8_block_reference(x, qt, scale_inv_t, *, n, config=None, interpret=False):
    del config, interpret
    w = C.dequant_fp8_block(qt.T, scale_inv_t.T)[:n]
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("n", "config", "interpret"))
def verify_gemm_nvfp4(
    x: jax.Array,
    packed_t: jax.Array,
    scale_t: jax.Array,
    scale_2: jax.Array,
    *,
    n: int,
    config: VerifyGemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x bf16[M, K] times NVFP4 packed_t u8[K/2, N_pad], scale_t f8[K/16, N_pad] -> f32[M, n]."""
    kh, n_pad = packed_t.shape
    k = kh * 2
    if k % 16 or scale_t.shape != (k // 16, n_pad):
        raise ValueError(f"NVFP4 needs K % 16 == 0 and scale_t [{k // 16}, {n_pad}]")
    gs = jnp.asarray(scale_2, jnp.float32).reshape(1)
    return _verify("nvfp4", x, (packed_t, scale_t, gs), n, k, n_pad, config, interpret)


def verify_gemm_nvfp4_reference(x, packed_t, scale_t, scale_2, *, n, config=None, interpret=False):
    del config, interpret
    w = C.dequant_nvfp4(packed_t[:, :n].T, scale_t[:, :n].T, scale_2)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)


KERNELS = {
    "bf16": (verify_gemm_bf16, verify_gemm_bf16_reference),
    "fp8_row": (verify_gemm_fp8_row, verify_gemm_fp8_row_reference),
    "fp8_block": (verify_gemm_fp8_block, verify_gemm_fp8_block_reference),
    "nvfp4": (verify_gemm_nvfp4, verify_gemm_nvfp4_reference),
}
