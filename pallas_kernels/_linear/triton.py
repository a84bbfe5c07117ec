"""Triton backend of ``linear``: GEMV and batched GEMV over BF16, FP8 per-row, FP8 block-128 and NVFP4 weights.

One kernel family: a grid over blocks of ``block_n`` weight rows (times ``split_k`` slices of K);
each program streams its rows once, K in ``block_k`` steps, for every activation row at once, so
M = 2..32 rows (BF16 and FP8 per-row: 2..128) cost one pass over the weight. Two ways to do the
multiply-add:

* ``compute="fma"``: dequantise to F32 and reduce with FMAs (best for one or two rows);
* ``compute="dot"``: dequantise to a float16 (BF16 for BF16 weights) tile and use the tensor
  cores with the rows padded to a power of two of at least 16 (``pl.dot``), the batched-GEMV
  form.

Shapes (the weight pytrees' leaves):
  x:         bf16[M, K]                      activations, M <= max_rows(format)
  w:         bf16[N, K]                      BF16
  q, scale:  float8_e4m3fn[N, K], f32[N]      FP8 per-row
  q, s_inv:  float8_e4m3fn[N, K], f32[ceil(N/128), ceil(K/128)]   FP8 block-128
  packed, scale, scale_2: uint8[N, K/2], float8_e4m3fn[N, K/16], f32[]   NVFP4
  out:       f32[M, N]

Numerics: weights are dequantised exactly (E2M1*E4M3 and E4M3 are exact in float16), products
and sums are F32, and the F32 row/global scale is applied once at the end. The ``dot`` path
scales each activation row by a power of two into float16 range first (exact for every bf16
value that matters, see ``_common.to_f16_rowscaled``). The oracle is ``linear``'s reference.
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
from pallas_kernels._linear.base import (
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    StackedWeight,
    Weight,
    WeightFormat,
    compute_capability,
)

#: Rows of one GEMV pass for NVFP4 and FP8 block-128 weights; more take row chunks.
MAX_ROWS = 32
#: Rows of one pass for BF16 and FP8 per-row weights on the tensor-core path: the accumulator is
#: ``block_n * m_pad / (32 * num_warps)`` F32 registers per thread, 64 at 128 rows.
WIDE_MAX_ROWS = 128
#: The formats with a fused XLA decode, which take an XLA dot on BF16 operands (FP8 widened
#: inside its fusion) from :data:`DOT_FROM_ROWS` rows.
XLA_DOT_FORMATS = (WeightFormat.BF16, WeightFormat.FP8)
#: Every row count one GEMV pass takes stays on it, a stack's entry read in place: one kernel
#: family for every decode and verify width, so a row's result does not depend on how many rows
#: share the call (an XLA dot rounds differently per shape; greedy speculation's exactness
#: against one-row decoding needs the verify's rows computed as one-row steps compute them).
#: Measured on the H200 (``benchmarks.stacked_rows``, the dense 27B layer's BF16 projections): a
#: stack's entry in one pass takes 0.48-0.67x the time of XLA's dot on a copy at 128 rows.
DOT_FROM_ROWS = WIDE_MAX_ROWS + 1
#: K elements a split-K slice is a multiple of, whatever the tile's ``block_k`` (when smaller):
#: every tile of a format then cuts K at the same places, so a row's partial sums, and their sum
#: (added in slice order), are the same at every row count.
SPLIT_GRANULE = 256


def max_rows(fmt: str) -> int:
    """Rows one GEMV pass takes for weight format ``fmt`` (its name)."""
    return WIDE_MAX_ROWS if WeightFormat(fmt) in XLA_DOT_FORMATS else MAX_ROWS


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemvConfig:
    """Tile sizes and lowering knobs of the GEMV kernels.

    Attributes:
      block_n: weight rows per program (power of two; <= 128 for FP8 block-128).
      block_k: K elements per loop step (power of two, >= 64; a multiple of 128 for FP8
        block-128).
      split_k: number of K slices run as separate programs and summed afterwards (fills the
        GPU when N is small).
      num_warps, num_stages: Triton launch parameters.
      compute: "fma" (F32 FMAs per row) or "dot" (tensor cores, rows padded to a power of two
        of at least 16).
      decode: NVFP4 nibble decoder, "asm" (inline PTX) or "arith" (integer ops; also the
        interpret-mode path).
      prefetch: issue the loads of step i+1 before the math of step i (loop-carried registers).
        Measured on the H200 (see BENCHMARKS.md), Triton's own ``num_stages`` pipelining beats
        it on the FMA and plain-dot paths; it helps the NVFP4 dot path, where the decode sits
        between the load and the dot, so the heuristic turns it on only there.
    """

    block_n: int = 64
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    compute: Literal["fma", "dot"] = "fma"
    decode: Literal["asm", "arith"] = "asm"
    prefetch: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not C.is_pow2(v):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.block_k < 64:
            raise ValueError(f"block_k must be >= 64, got {self.block_k}")
        if self.block_n < 16:
            raise ValueError(f"block_n must be >= 16, got {self.block_n}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError("split_k and num_stages must be >= 1")
        if self.compute not in ("fma", "dot"):
            raise ValueError(f"compute must be 'fma' or 'dot', got {self.compute!r}")
        if self.decode not in ("asm", "arith"):
            raise ValueError(f"decode must be 'asm' or 'arith', got {self.decode!r}")


_NUM_SMS = 132


def filling_split(n: int, k: int, block_n: int, block_k: int) -> int:
    """The heuristic's ``split_k``: doubled while the grid has fewer than four programs per SM
    and each slice keeps at least one K step of ``max(block_k, SPLIT_GRANULE)``."""
    programs, iters, split = C.cdiv(n, block_n), C.cdiv(k, max(block_k, SPLIT_GRANULE)), 1
    while programs * split < 4 * _NUM_SMS and split * 2 <= iters:
        split *= 2
    return split


def split_slices(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(slices, K steps of block_k per slice)`` for at most ``split_k`` slices of K: each slice
    whole granules of ``max(block_k, SPLIT_GRANULE)`` elements, so tiles of different ``block_k``
    (up to the granule) cut K at the same places."""
    granule = max(block_k, SPLIT_GRANULE)
    granules = C.cdiv(k, granule)
    per_split = C.cdiv(granules, max(1, min(split_k, granules)))
    return C.cdiv(granules, per_split), per_split * (granule // block_k)


def default_config(fmt: str, m: int, n: int, k: int) -> GemvConfig:
    """Heuristic tiles (measured on H200): enough programs to fill 132 SMs several times. Past
    32 rows (BF16 and FP8 per-row) 64-wide K steps four stages deep: the activation tile
    (``m_pad x block_k``) grows with the rows and the weight tile does not."""
    warps, stages = 4, 3
    if m > MAX_ROWS:
        compute, block_n, block_k, stages = "dot", 64, 64, 4
    elif fmt == "bf16":
        compute, block_n, block_k = "dot", 64, 128
    elif fmt == "fp8_block":
        compute, block_n, block_k = "dot", 64, 256
    elif fmt == "fp8":
        compute, block_n, block_k = ("fma", 64, 512) if m <= 2 else ("dot", 64, 256)
        warps = 8 if compute == "fma" else 4
    else:
        compute, block_n, block_k = ("fma", 32, 512) if m <= 2 else ("dot", 64, 256)
    block_k = min(block_k, max(128, C.next_pow2(k)))
    return GemvConfig(
        block_n=block_n,
        block_k=block_k,
        split_k=filling_split(n, k, block_n, block_k),
        num_warps=warps,
        num_stages=stages,
        compute=compute,
        decode="asm",
        prefetch=fmt == "nvfp4" and compute == "dot",
    )


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------


def _masked_load(ref_view, mask):
    if mask is None:
        return ref_view[...]
    return plgpu.load(ref_view, mask=mask, other=0)


def _and_masks(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _gemv_kernel(
    *refs,
    fmt,
    m,
    m_pad,
    n,
    k,
    bn,
    bk,
    iters_per_split,
    total_iters,
    compute,
    asm,
    prefetch,
    stacked,
):
    """One program: rows [n0, n0+bn) x K slice ``program_id(1)``; writes o[s, :, rows].

    Refs (f8 data arrives as uint8 bytes):
      nvfp4:     x_even, x_odd, xinv, packed3 u8[N, K/16, 8], scale u8[N, K/16], gscale f32[1]
      fp8_row:   x, xinv, q u8[N, K], row_scale f32[N]
      fp8_block: x, xinv, q u8[N, K], scale_inv f32[N/128, K/128]
      bf16:      x, xinv, w bf16[N, K]
    x operands are bf16[M, .] for ``compute="fma"`` and for BF16 weights, float16[m_pad, .] for
    the other formats' "dot" (row-scaled, padded by that fusion); NVFP4
    takes the even and odd K columns separately (shaped [M, K/16, 8] for fma). With
    ``stacked`` an int32[1] entry index comes first and the codes (NVFP4: and scales) are
    [L, N, ...] stacks, read at that entry.
    """
    entry = None
    if stacked:
        entry, refs = refs[0][0], refs[1:]

    def at(ref, *idx):
        """A view of weight ``ref`` (a stack's entry when stacked)."""
        return ref.at[idx] if entry is None else ref.at[(entry, *idx)]

    if fmt == "nvfp4":
        xe_ref, xo_ref, xinv_ref, packed_ref, scale_ref, gscale_ref, o_ref = refs
    elif fmt == "fp8":
        x_ref, xinv_ref, q_ref, rscale_ref, o_ref = refs
    elif fmt == "fp8_block":
        x_ref, xinv_ref, q_ref, sinv_ref, o_ref = refs
    else:
        x_ref, xinv_ref, w_ref, o_ref = refs
    pid_n = pl.program_id(0)
    pid_s = pl.program_id(1)
    n0 = pid_n * bn
    rows = n0 + jnp.arange(bn, dtype=jnp.int32)
    row_ok = (rows < n) if n % bn else None
    k_tail = k % bk != 0
    fma = compute == "fma"
    wdt = jnp.float32 if fma else jnp.float16

    def cmask(start, width, per):
        """Columns [start, start + width) (in units of ``per`` K elements) that lie inside K."""
        if not k_tail:
            return None
        return (start + jnp.arange(width, dtype=jnp.int32)) * per < k

    def rmask2(colmask):
        return _and_masks(
            None if row_ok is None else row_ok[:, None], None if colmask is None else colmask[None]
        )

    def load_x(ref, start, width, per):
        cm = cmask(start, width, per)
        if fma:
            return tuple(
                _masked_load(ref.at[jnp.int32(r), pl.ds(start, width)], cm) for r in range(m)
            )
        # BF16 rows arrive unpadded: the rows past m load as zeros, as padding would give.
        rm = (jnp.arange(m_pad, dtype=jnp.int32) < m)[:, None] if ref.shape[0] < m_pad else None
        mask = _and_masks(rm, None if cm is None else cm[None])
        return _masked_load(ref.at[pl.ds(0, m_pad), pl.ds(start, width)], mask)

    def load(i):
        """Raw tiles of loop step i (issued one step ahead when prefetching)."""
        if fmt == "nvfp4":
            kg = bk // 16
            g0 = i * kg
            gm = cmask(g0, kg, 16)
            m2 = rmask2(gm)
            codes = _masked_load(
                at(packed_ref, pl.ds(n0, bn), pl.ds(g0, kg), slice(None)),
                None if m2 is None else m2[:, :, None],
            )
            sc = _masked_load(at(scale_ref, pl.ds(n0, bn), pl.ds(g0, kg)), m2)
            if fma:
                xs = tuple(
                    tuple(
                        _masked_load(
                            ref.at[jnp.int32(r), pl.ds(g0, kg), :],
                            None if gm is None else gm[:, None],
                        )
                        for r in range(m)
                    )
                    for ref in (xe_ref, xo_ref)
                )
            else:
                b0 = i * (bk // 2)
                xs = (load_x(xe_ref, b0, bk // 2, 2), load_x(xo_ref, b0, bk // 2, 2))
            return codes, sc, xs
        if fmt == "fp8_block":
            chunks = []
            kbs = sinv_ref.shape[1]
            for c in range(bk // 128):
                kc = i * bk + c * 128
                q = _masked_load(
                    at(q_ref, pl.ds(n0, bn), pl.ds(kc, 128)), rmask2(cmask(kc, 128, 1))
                )
                s = sinv_ref[n0 // 128, jnp.minimum(i * (bk // 128) + c, kbs - 1)]
                chunks.append((q, s, load_x(x_ref, kc, 128, 1)))
            return tuple(chunks)
        src = q_ref if fmt == "fp8" else w_ref
        k0 = i * bk
        w = _masked_load(at(src, pl.ds(n0, bn), pl.ds(k0, bk)), rmask2(cmask(k0, bk, 1)))
        return w, load_x(x_ref, k0, bk, 1)

    def fma_rows(acc, w32, xs, factor=None):
        out = []
        for r in range(m):
            part = jnp.sum(w32 * xs[r].astype(jnp.float32)[None, :], axis=1)
            out.append(acc[r] + (part if factor is None else part * factor))
        return tuple(out)

    def dot_rows(w, xt):
        return jax.lax.dot_general(
            w, xt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    def compute_step(raw, acc):
        if fmt == "nvfp4":
            codes, sc, xs = raw
            kg = bk // 16
            sc16 = jnp.broadcast_to(C.from_u8_e4m3(sc, jnp.float16)[:, :, None], (bn, kg, 8))
            lo, hi = C.decode_e2m1_scaled(codes, sc16, use_asm=asm)
            if fma:
                (xe, xo) = xs
                lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
                out = []
                for r in range(m):
                    prod = (
                        lo32 * xe[r].astype(jnp.float32)[None]
                        + hi32 * xo[r].astype(jnp.float32)[None]
                    )
                    # [bn, kg] per-group partial sums; the cross-thread sum waits for the end.
                    out.append(acc[r] + jnp.sum(prod, axis=2))
                return tuple(out)
            xe, xo = xs
            kb = bk // 2
            return acc + dot_rows(lo.reshape(bn, kb), xe) + dot_rows(hi.reshape(bn, kb), xo)
        if fmt == "fp8_block":
            for q, s, xt in raw:
                w = C.from_u8_e4m3(q, wdt)
                acc = fma_rows(acc, w, xt, s) if fma else acc + dot_rows(w, xt) * s
            return acc
        w, xt = raw
        if fmt == "fp8":
            w = C.from_u8_e4m3(w, wdt)
        if fma:
            return fma_rows(acc, w.astype(jnp.float32), xt)
        return acc + dot_rows(w, xt)

    if fma:
        shape = (bn, bk // 16) if fmt == "nvfp4" else (bn,)
        acc0 = tuple(jnp.zeros(shape, jnp.float32) for _ in range(m))
    else:
        acc0 = jnp.zeros((bn, m_pad), jnp.float32)
    acc = C.split_k_loop(
        load,
        compute_step,
        acc0,
        split_index=pid_s,
        iters_per_split=iters_per_split,
        total_iters=total_iters,
        prefetch=prefetch,
    )

    # Epilogue: the weight's scale (FP8: per row [bn]; NVFP4: global), the activation rows'
    # (dot), then a masked store.
    wscale = None
    if fmt == "fp8":
        wscale = _masked_load(rscale_ref.at[pl.ds(n0, bn)], row_ok)
    elif fmt == "nvfp4":
        wscale = gscale_ref[0] * C.E2M1_F16_UNBIAS
    if fma:
        for r in range(m):
            v = jnp.sum(acc[r], axis=1) if fmt == "nvfp4" else acc[r]
            if wscale is not None:
                v = v * wscale
            dst = o_ref.at[pid_s, jnp.int32(r), pl.ds(n0, bn)]
            if row_ok is None:
                dst[...] = v
            else:
                plgpu.store(dst, v, mask=row_ok)
        return
    v = acc * xinv_ref[...][None, :]
    if wscale is not None:
        v = v * (wscale[:, None] if fmt == "fp8" else wscale)
    v = v.T  # [m_pad, bn]
    rmask = (jnp.arange(m_pad, dtype=jnp.int32) < m)[:, None]
    mask = _and_masks(rmask, None if row_ok is None else row_ok[None, :])
    plgpu.store(o_ref.at[pid_s, pl.ds(0, m_pad), pl.ds(n0, bn)], v, mask=mask)


def _gemv(
    fmt: str,
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    n: int,
    k: int,
    config,
    interpret,
    index: jax.Array | None = None,
):
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {x.shape}")
    m = x.shape[0]
    if not 1 <= m <= max_rows(fmt):
        raise ValueError(f"{fmt} GEMV kernels take 1..{max_rows(fmt)} rows, got {m}")
    cfg = config or default_config(fmt, m, n, k)
    if cfg.compute == "fma" and m > MAX_ROWS:  # one F32 accumulator per row, unrolled
        raise ValueError(f"compute='fma' takes 1..{MAX_ROWS} rows, got {m}")
    if fmt == "fp8_block" and (cfg.block_n > 128 or cfg.block_k % 128):
        raise ValueError("FP8 block-128 needs block_n <= 128 and block_k a multiple of 128")
    bn, bk = cfg.block_n, cfg.block_k
    asm = cfg.decode == "asm" and not interpret
    total_iters = C.cdiv(k, bk)
    split, iters_per_split = split_slices(k, bk, cfg.split_k)
    compute = cfg.compute
    m_pad = max(16, C.next_pow2(m)) if compute == "dot" else m
    if compute == "dot":
        if fmt == "bf16":  # unpadded: the kernel masks the rows past m (no pad kernel per call)
            xk = x.astype(jnp.bfloat16)
            xinv = jnp.ones((m_pad,), jnp.float32)
        else:
            xk, xinv = C.to_f16_rowscaled(x, m_pad)
            xinv = jnp.pad(xinv, (0, m_pad - m))
    else:
        xk = x.astype(jnp.bfloat16)
        xinv = jnp.ones((1,), jnp.float32)
    if fmt == "nvfp4":
        rows = xk.shape[0]
        x2 = xk.reshape(rows, k // 2, 2)
        xe, xo = x2[:, :, 0], x2[:, :, 1]
        if compute == "fma":
            xe, xo = xe.reshape(rows, k // 16, 8), xo.reshape(rows, k // 16, 8)
        xs = (xe, xo)
    else:
        xs = (xk,)
    kernel = functools.partial(
        _gemv_kernel,
        fmt=fmt,
        m=m,
        m_pad=m_pad,
        n=n,
        k=k,
        bn=bn,
        bk=bk,
        iters_per_split=iters_per_split,
        total_iters=total_iters,
        compute=compute,
        asm=asm,
        prefetch=cfg.prefetch,
        stacked=index is not None,
    )
    entry = () if index is None else (jnp.asarray(index, jnp.int32).reshape(1),)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, m, n), jnp.float32),
        grid=(C.cdiv(n, bn), split),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"{fmt}_gemv",
    )(*entry, *xs, xinv, *weights)
    return sum_in_order(out)


def sum_in_order(parts: jax.Array) -> jax.Array:
    """``parts[0] + parts[1] + ...`` over the leading axis, added in that order: elementwise adds,
    so an element's sum does not depend on the other axes' sizes (XLA's reduce picks its order
    from the whole shape)."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


# ---------------------------------------------------------------------------------------------
# The backend.
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def gemv(
    x: jax.Array,
    w: Weight | StackedWeight,
    *,
    config: GemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x: bf16[M, K]`` (M <= ``max_rows`` of its format) times one ``[N, K]`` weight of any
    format (or an entry of a stack of them: its codes read in place, its small scales sliced)
    -> f32[M, N]."""
    n, k = w.shape
    index = None
    if isinstance(w, StackedWeight):
        index, small = w.index, w.leaf
        w = w.stack
    else:
        small = lambda field: getattr(w, field)  # noqa: E731
    lead = w.shape[:-2]
    if isinstance(w, Bf16Weight):
        leaves = (w.w,)
    elif isinstance(w, Fp8RowWeight):
        leaves = (C.as_u8(w.q), small("scale"))
    elif isinstance(w, Fp8BlockWeight):
        leaves = (C.as_u8(w.q), small("scale_inv"))
    else:
        packed = w.packed.reshape(*lead, n, k // 16, 8)
        leaves = (packed, C.as_u8(w.scale), small("scale_2").reshape(1))
    return _gemv(w.format.value, x, leaves, n, k, config, interpret, index)


def bf16_operands_dot(x: jax.Array, w: Bf16Weight | Fp8RowWeight | StackedWeight) -> jax.Array:
    """``x @ w.T`` as one XLA dot on BF16 operands, F32 accumulation: f32[M, N].

    FP8 codes are exact in BF16 (widened inside the dot's fusion); the row scale comes after.
    A stack's entry is sliced out (XLA may fuse the slice into the dot or copy it).
    """
    if isinstance(w, StackedWeight):
        w = w.entry()
    xb = x.astype(jnp.bfloat16)
    wb = w.w if isinstance(w, Bf16Weight) else w.q.astype(jnp.bfloat16)
    y = jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y if isinstance(w, Bf16Weight) else y * w.scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonLinear:
    """The Triton GEMV, up to :func:`max_rows` rows a pass (row chunks beyond).

    Row heuristic: BF16 and FP8 per-row weights (a stack's entry read in place) take the GEMV in
    one pass up to :data:`WIDE_MAX_ROWS` rows and one XLA dot on BF16 operands beyond (FP8
    widened inside its fusion; a stack's entry sliced out first). NVFP4 and FP8 block-128 have
    no fused XLA decode (dequantise-then-dot writes and re-reads the weight in BF16, 8x slower
    than a GEMV pass), so they take the GEMV over 32-row chunks.
    """

    name: str = "triton"
    config_type: type = GemvConfig

    def supported_on(self, device) -> bool:
        """CUDA GPUs with the FP8 conversions (sm_89 and newer)."""
        cc = compute_capability(device)
        return cc is not None and cc >= (8, 9)

    def supports(self, rows: int, w: Weight) -> str | None:
        del rows, w  # every format and shape
        return None

    def __call__(self, x, w, *, config=None, interpret=False):
        if x.shape[0] >= DOT_FROM_ROWS and w.format in XLA_DOT_FORMATS:
            return bf16_operands_dot(x, w)
        kernel = functools.partial(gemv, w=w, config=config, interpret=interpret)
        return C.in_row_chunks(kernel, x, max_rows(w.format.value), w.out_features)


TRITON = TritonLinear()
