"""NVFP4, FP8 per-row and FP8 block-128 GEMV (1 to 128 rows) on Hopper tensor cores through Mosaic
GPU Pallas.

The Triton NVFP4 GEMV (:func:`pallas_kernels.gemv.nvfp4_gemv`) spends ~5-6 ALU instructions per
weight element (decode, scale, convert, FMA) and is ALU-bound on H200. Here the multiply-adds go
to ``wgmma``: each warpgroup decodes a ``[block_n, 64]`` float16 weight tile into registers, the
*left* operand of ``wgmma.m64nNk16`` (weight rows are the MMA's M), and the activations sit in
shared memory as the right operand (rows padded to a multiple of 8, the MMA's N, at most 256;
:data:`MAX_ROWS` = 128). What is left on the ALUs per 8 NVFP4 weight elements is one 32-bit
shared load, a scale byte load + ``cvt``, four ``f16x2`` multiplies and 11 shift/mask/``prmt``
ops (every layout); per 4 FP8 elements, one 32-bit shared load and two ``cvt.rn.f16x2.e4m3x2``.

NVFP4 decode (per thread, per 32-bit word ``w`` = four packed bytes of one weight row, the
register the ``WGMMA_LAYOUT_8BIT`` load gives): a nibble ``s i2 i1 i0`` placed as float16 bits
``s << 15 | i << 9`` is exactly ``e2m1 * 2**-14`` (see :mod:`pallas_kernels._common`), so each
of the four float16 pairs of a word is a few shifts and masks of ``w`` (``_DECODE_TERMS``; the
kernel's op sequence is :func:`_pair_words`), multiplied by the block scale in ``f16x2``
(exact), and is already one register of the ``WGMMA_LAYOUT`` operand. That fixes a permutation
of K inside every 32-element block (logical column ``8i + 2q + e`` holds element
``8q + i + 4e``), applied to the activations on the host (:func:`permute_k`).

FP8 per-row decode (:func:`fp8_row_gemv_mosaic`): the same word holds four E4M3 elements of one
row; each byte pair converts exactly to one ``f16x2`` register (E4M3 is exact in float16), so
inside every 16-element block logical column ``8u + 2q + e`` holds element ``4q + 2u + e``
(:func:`permute_k` with ``fmt="fp8"``).

FP8 block-128 (:func:`fp8_block_gemv_mosaic`, DeepSeek-V3 ``weight_scale_inv``): the FP8 decode
and pipeline, with 64- or 128-row CTAs aligned to the 128-row scale blocks, so a CTA's scale is
one scalar per 128-wide K block: each K block's two ``wgmma`` chunks accumulate into a fresh F32
accumulator, awaited and added into the main one (a pipeline carry) times that scalar, in F32.
Measured on H200 (LM head, steady state): 279 us at M=1, 291 at M=8, 308 at M=32, 384 at M=64,
575 at M=96 (128-row CTAs), within 2% of the FP8 per-row kernel up to M=32 (5% on [12288,
5120] at M=1; Triton FP8 block-128: 364, 374, 444 us at M=1, 8, 32; XLA BF16 GEMV 561 us).

Epilogue: each CTA scales its F32 accumulator in registers (FP8: ``acc * scale[n] * xinv[row]``;
NVFP4: ``acc * (xinv[row] * scale_2 * 2**14)``, the factor made by the wrapper; in F32, the order
the earlier XLA epilogue used, so the bits are the same), stores it transposed into shared
memory and TMA-copies the [rows, block_n] tile to the f32[M, N] output, which drops the padded
rows and the columns past N. The wrapper slices only when ``n`` is below the weight's padded N.

Weight layouts (:data:`WEIGHT_LAYOUTS`, NVFP4 only, made once by :func:`prepare_nvfp4_mosaic`): the
checkpoint's own, or with the bits moved within each word ("relaid": 11 ops without ``prmt``, made
when the checkpoint's took 15), or relaid and stored as contiguous CTA tiles ("tiled"). Measured on
H200, LM head [248320, 5120], with the output transposed by XLA after the kernel and the 15-op
"checkpoint" decode: M=1 243 us tiled / 242 relaid / 266 checkpoint (XLA BF16 GEMV 664 us, Triton
NVFP4 359 us); M=2..8 ~245 us tiled. The kernel alone took 229 us and the same with the decode
arithmetic removed also 229 us: the decode is hidden and the limit is the data movement (~3.1 TB/s);
the other ~14 us were the activation preparation and the output transpose around the kernel. With
the fused epilogue and the 11-op checkpoint decode, against that earlier path in the same run
(``scripts/bench_mosaic_gemv.py --sections epilogue``, medians of 5 interleaved rounds, ~5%
round-to-round spread at M=1): NVFP4 M=1 checkpoint 237 us (was 256), tiled 231 (244), M=8
checkpoint 257 (278), M=96 557 (616); FP8 M=1 387 (390), M=96 607 (631). The kernel alone at M=1,
checkpoint: 230 us, 250 with the 15-op decode.

More rows (M > 8; `mtpjax.kernels.mosaic_tiles` has the tiles measured per row band): the weight is still read once, but every CTA
streams all of x through shared memory, [m_pad, block_k] float16 per step from L2, so at large M
the activation traffic outgrows the weight's (at M=96 and 64-row CTAs, 48 KB of x per 9 KB NVFP4
step) and the MMA work grows with M (~310 us of tensor-core time for the LM head at 96 rows).
:func:`default_config` therefore widens the CTA to 128 rows where the accumulator
(``block_n * m_pad / 128`` F32 registers per thread) allows; see there. The epilogue writes the
final f32[M, N] (at M=96 the earlier transposed f32[N, m_pad] output was ~95 MB written and
moved again by XLA).

Shapes:
  x:        bf16[M, K]            activations, 1 <= M <= 128
  NVFP4:    packed uint8[N, K/2] (element 2j of a row is the low nibble of byte j),
            scale float8_e4m3fn[N, K/16], scale_2 f32[]
  FP8:      q float8_e4m3fn[N, K], scale f32[N]
  FP8 block-128: q float8_e4m3fn[N, K], scale_inv f32[ceil(N/128), K/128]
  out:      f32[M, N]

Layout requirements: the TMA copies move swizzled 8-row tiles of 128-byte rows, so N must be a
multiple of 8 and K of 256 for NVFP4 (also 16-byte aligned ``scale`` rows of K/16 bytes) or of
128 for FP8 (one 128-byte swizzle row). :func:`prepare_nvfp4_mosaic` /
:func:`prepare_fp8_row_mosaic` / :func:`prepare_fp8_block_mosaic` pad other weights once (pass
``n=`` the original N to drop the padded rows). N need not be a multiple of block_n, nor K of block_k, for the untiled layouts: TMA
zero-fills the rows and columns past the weight's.

Interpret mode (``interpret=True``, CPU): Mosaic GPU's interpreter cannot run inline Mosaic code
nor take a register ``wgmma`` operand, so the kernel decodes with the same ops (or E4M3 cast)
in ``jnp`` (:func:`decode_tile`, :func:`decode_tile_fp8`), stages the tile in shared
memory and runs the same ``wgmma`` and pipeline; only the register-level decode differs. The
tests replay that decode thread by thread in numpy and lower the kernel for CUDA on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common as C
from pallas_kernels._linear.base import (
    Fp8BlockWeight,
    Fp8RowWeight,
    Nvfp4Weight,
    Weight,
    compute_capability,
)

#: Most activation rows: the MMA's N (rows padded to a multiple of 8) may reach 256, but the
#: accumulator takes ``block_n * m_pad / 128`` F32 registers per thread and the activation tile
#: ``m_pad * block_k * 2`` bytes of shared memory per stage; 128 keeps both in budget.
MAX_ROWS = 128
#: K granularity of the NVFP4 kernel (16-byte aligned scale rows for TMA).
K_ALIGN = 256
#: K granularity of the FP8 kernel (one 128-byte swizzle row of codes).
FP8_K_ALIGN = 128
#: N granularity of the kernel (the swizzled TMA copy of the codes moves 8-row tiles).
N_ALIGN = 8
#: Logical K columns per ``wgmma`` call (one 128-byte swizzle row of float16).
_CHUNK = 64
#: K elements per code byte, per weight format.
_ELEMS_PER_BYTE = {"nvfp4": 2, "fp8": 1, "fp8_block": 1}
#: The FP8 formats: one E4M3 code per byte, the same decode and K permutation.
_FP8_FORMATS = ("fp8", "fp8_block")
#: Rows and columns of one FP8 block-128 scale (DeepSeek-V3 ``weight_scale_inv``).
FP8_BLOCK = 128

_IDX = 0x0E000E00  # index bits of a float16 pair (9..11 and 25..27)
_SIGN = 0x80008000  # sign bits of a float16 pair (15 and 31)

#: Per weight layout, per float16 pair i of a 32-bit word: the (shift, mask) terms OR-ed into
#: it (a positive shift is to the left). Pair i holds elements 8q + i (low half) and 8q + i + 4
#: (high half) of the word's 8 K elements, in every layout.
#:
#: "checkpoint": the packed bytes as stored (element 2j = low nibble of byte j), so pair i is
#: (lo b0, lo b2), (hi b0, hi b2), (lo b1, lo b3), (hi b1, hi b3); every pair needs a shift for
#: its index bits and another for its sign bit: 15 integer ops per word this way. The kernel
#: computes the same pairs in 11 (:data:`_NIBBLE_BYTE_TERMS`).
#:
#: "relaid" (:func:`relayout_words`, applied once by ``prepare_nvfp4_mosaic``): the bits of each
#: word are moved so that two pairs are one AND (pair 0 sits in place) or one shift and one AND
#: away, and the other two need two shifts: 11 integer ops per word. In each 16-bit half, pair 0
#: has its index bits on 9..11 and sign on 15, pair 1 on 0..2 / 6, pair 2 on 3..5 / 7 and pair 3
#: on 12..14 / 8 (no 16-bit tiling by four copies of the float16 pattern exists).
_DECODE_TERMS = {
    "checkpoint": (
        ((9, _IDX), (12, _SIGN)),
        ((5, _IDX), (8, _SIGN)),
        ((1, _IDX), (4, _SIGN)),
        ((-3, _IDX), (0, _SIGN)),
    ),
    "relaid": (
        ((0, _IDX | _SIGN),),
        ((9, _IDX | _SIGN),),
        ((6, _IDX), (8, _SIGN)),
        ((-3, _IDX), (7, _SIGN)),
    ),
}
_DECODE_TERMS["tiled"] = _DECODE_TERMS["relaid"]
#: "checkpoint" in 11 integer ops per word (:func:`_pair_words`; the same pairs as its
#: ``_DECODE_TERMS``): first two words that hold one nibble per byte, placed as the high byte of
#: a float16 pair half wants it (index bits on bits 1..3 of the byte, sign on bit 7), the low
#: nibbles (shifts 1 and 4) and the high nibbles (shift -3 and in place), 7 ops; then each pair
#: is the odd bytes of one of them (one AND) or its even bytes moved up (one ``prmt``).
_NIBBLE_BYTE_TERMS = (
    ((1, 0x0E0E0E0E), (4, 0x80808080)),  # low nibbles
    ((-3, 0x0E0E0E0E), (0, 0x80808080)),  # high nibbles
)
#: Per pair of "checkpoint": (nibble word, whether its even bytes move up into the odd ones).
_NIBBLE_BYTE_PAIRS = ((0, True), (1, True), (0, False), (1, False))
_ODD_BYTES = 0xFF00FF00
#: Where the "relaid" layout keeps (index bit 0, sign bit) of pair i in each 16-bit half.
_RELAID_POS = ((9, 15), (0, 6), (3, 7), (12, 8))
#: "checkpoint": codes as stored, [N, K/2]. "relaid": bits moved within each word, [N, K/2].
#: "tiled": relaid bits, and every [block_n, block_k] tile of a CTA step stored contiguously,
#: [N/block_n, K/block_k, block_n, block_k/2] (scales likewise), so each TMA copy streams one
#: contiguous block of HBM instead of block_n row segments.
WEIGHT_LAYOUTS = ("checkpoint", "relaid", "tiled")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGemvConfig:
    """Tile sizes of the Mosaic GPU NVFP4 and FP8 GEMVs.

    Attributes:
      block_n: weight rows per CTA (one warpgroup; a multiple of 64, at most 256). The
        accumulator takes ``block_n * m_pad / 128`` F32 registers per thread.
      block_k: K elements per pipeline step (a multiple of 128, of 256 for NVFP4; at most
        2048).
      stages: pipeline depth: steps whose TMA copies are in flight per CTA (at least 2; one
        stage would not overlap the copies with the decode). On H200 more CTAs per SM beat
        deeper pipelines: at M=1, 64 x 512 x 2 (52 KB of shared memory, 4 CTAs per SM) was
        4-13% faster than 3 or 4 stages or 128-row CTAs (128 rows tied at M=2 and 4).
    """

    block_n: int = 64
    block_k: int = 512
    stages: int = 2

    def __post_init__(self):
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n must be a multiple of 64 in [64, 256], got {self.block_n}")
        if self.block_k % FP8_K_ALIGN or not FP8_K_ALIGN <= self.block_k <= 2048:
            raise ValueError(
                f"block_k must be a multiple of {FP8_K_ALIGN} in [{FP8_K_ALIGN}, 2048] (of "
                f"{K_ALIGN} for NVFP4), got {self.block_k}"
            )
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")


def default_config(m: int, n: int, k: int, *, fmt: str = "nvfp4") -> MosaicGemvConfig:
    """Tile heuristic per row count (``m_pad = round_up(m, 8)``). Shared memory per CTA is
    ``stages * (weight tile + m_pad * block_k * 2)`` bytes (the tests read it off the lowering).

    * m_pad == 8 (M = 1..8), measured on H200 for NVFP4: 64-row CTAs, 2 stages and little shared
      memory, so several CTAs share an SM (NVFP4 64x512: 52 KB, 4 per SM). FP8 takes 64x256: the
      same 16 KB of codes per step as NVFP4's 64x512, 40 KB, 5 per SM.
    * 8 < m_pad <= 32: 64x256 (NVFP4 M=16: 282 us against 302 with 128-row CTAs; FP8 M=32:
      403 against 422; NVFP4 M=32 tied).
    * NVFP4, m_pad > 32: 128-row CTAs, 256-wide K steps. Each CTA streams all of x through shared
      memory, so at these M the activation traffic (from L2) outgrows the weight's; 128 rows per
      CTA halve it against 64 (NVFP4 M=64: 420 against 473 us, M=128: 693 against 761; FP8
      M=96: 714 against 817). At m_pad > 48 only one CTA fits an SM with either width, so the
      wider CTA costs no occupancy, only registers (an accumulator of m_pad F32 per thread).
    * FP8 block-128 (``fmt="fp8_block"``) to 32 rows: 64x256. Its CTA holds two accumulators
      (the main one and each K block's partial sum) of ``block_n * m_pad / 128`` F32 registers
      per thread. Measured on the H200 LM head (steady state,
      ``benchmarks/results/kernels_mosaic_fp8_block_h200.json``): M=1 64x256 279 us, 64x512
      279; M=8 291 against 290 with 128 rows.
    * Both FP8 formats above 32 rows: 128-wide K steps, whose smaller stages let two or three
      CTAs share an SM, so one CTA's decode overlaps another's MMAs (with 256-wide steps one CTA
      fits and its tensor cores wait while it decodes). Per-row 128x128, block-128 64x128 (two
      accumulators). Steady state on the H200 LM head
      (``benchmarks/results/kernels_mosaic_fp8_tiles_h200.json``, ``--sections fp8_tiles``),
      against the best 256-wide tile: per-row M=64 352 us (391), M=96 430 (514), M=128 563
      (577); block-128 M=64 385 (387), M=96 514 (610), M=128 617 (753).

    Timed on the H200 LM head [248320, 5120]; the rows up to 32 and NVFP4 before the fused
    epilogue (``benchmarks/results/kernels_mosaic_rows_fp8_h200.json``, from
    ``scripts/bench_mosaic_gemv.py --sections mosaic_rows,mosaic_fp8``).
    """
    del n
    if fmt not in _ELEMS_PER_BYTE:
        raise ValueError(f"fmt must be one of {tuple(_ELEMS_PER_BYTE)}, got {fmt!r}")
    m_pad = C.round_up(m, 8)
    if m_pad <= 8:
        block_n, block_k = 64, (512 if fmt == "nvfp4" else 256)
    elif m_pad <= 32:
        block_n, block_k = 64, 256
    elif fmt == "nvfp4":
        block_n, block_k = 128, 256
    else:
        block_n, block_k = (128 if fmt == "fp8" else 64), FP8_K_ALIGN
    block_k = block_k if k >= block_k else (K_ALIGN if fmt == "nvfp4" else FP8_K_ALIGN)
    return MosaicGemvConfig(block_n=block_n, block_k=block_k, stages=2)


# ---------------------------------------------------------------------------------------------
# Host-side layout helpers.
# ---------------------------------------------------------------------------------------------


def relayout_words(packed: jax.Array) -> jax.Array:
    """uint8[N, K/2] checkpoint codes -> the same bytes in the "relaid" bit layout.

    Each 32-bit word (4 bytes, 8 K elements ``e_t``, t = 2 * byte + nibble) keeps its elements;
    element t moves to pair ``t % 4`` of half ``t // 4`` at the bit positions ``_RELAID_POS``.
    """
    n, kh = packed.shape
    w = jax.lax.bitcast_convert_type(packed.reshape(n, kh // 4, 4), jnp.uint32)
    out = jnp.zeros_like(w)
    for t in range(8):
        nib = (w >> (4 * t)) & 0xF
        idx_pos, sign_pos = _RELAID_POS[t % 4]
        base = 16 * (t // 4)
        out = out | ((nib & 7) << (base + idx_pos)) | ((nib >> 3) << (base + sign_pos))
    return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(n, kh)


def prepare_nvfp4_mosaic(
    packed: jax.Array,
    scale: jax.Array,
    *,
    layout: str = "checkpoint",
    block_n: int = 64,
    block_k: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Convert a weight once to the kernel's layout (a checkpoint-conversion step).

    Pads N and K with zero codes and zero scales (padded rows and columns decode to zero; call
    :func:`nvfp4_gemv_mosaic` with ``n=`` the original N to drop the padded output rows; x is
    zero-padded to the weight's K on every call, which is cheap): to multiples of 8 and
    :data:`K_ALIGN`, or of ``block_n`` and ``block_k`` for ``layout="tiled"``. "relaid" and
    "tiled" move the code bits within each 32-bit word (:func:`relayout_words`); "tiled" also
    stores each CTA step's tile contiguously (see :data:`WEIGHT_LAYOUTS`) and fixes the kernel's
    block_n and block_k to those given here. Pass the same ``layout`` to
    :func:`nvfp4_gemv_mosaic`. The padding is a no-op for every Qwen3.5/3.6 projection and the
    248320-row LM head.

    Returns:
      "checkpoint"/"relaid": (packed uint8[Np, Kp/2], scale float8_e4m3fn[Np, Kp/16]);
      "tiled": (uint8[Np/bn, Kp/bk, bn, bk/2], float8_e4m3fn[Np/bn, Kp/bk, bn, bk/16]).
    """
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    tiled = layout == "tiled"
    if tiled:  # validates the tile
        MosaicGemvConfig(block_n=block_n, block_k=block_k)
    n, kh = packed.shape
    n_align, k_align = (block_n, block_k) if tiled else (N_ALIGN, K_ALIGN)
    np_, kp = C.round_up(n, n_align), C.round_up(kh * 2, k_align)
    if (np_, kp) != (n, kh * 2):
        packed = jnp.pad(packed, ((0, np_ - n), (0, kp // 2 - kh)))
        scale = jnp.pad(scale, ((0, np_ - n), (0, kp // 16 - scale.shape[1])))
    if layout != "checkpoint":
        packed = relayout_words(packed)
    if tiled:

        def tile(a, width):
            a = a.reshape(np_ // block_n, block_n, kp // block_k, width)
            return a.transpose(0, 2, 1, 3)

        packed, scale = tile(packed, block_k // 2), tile(scale, block_k // 16)
    return packed, scale


def prepare_fp8_block_mosaic(q: jax.Array, scale_inv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pad an FP8 block-128 weight once to the kernel's granularity (a checkpoint-conversion
    step).

    Pads N to a multiple of :data:`N_ALIGN` and K to one of :data:`FP8_BLOCK` with zero codes;
    ``scale_inv`` f32[ceil(N/128), ceil(K/128)] already covers the padded weight (padded codes
    are zero whatever their scale) and is only cast to F32. Call :func:`fp8_block_gemv_mosaic`
    with ``n=`` the original N. A no-op for every Qwen3.5/3.6 projection and the LM head.

    Returns:
      (q float8_e4m3fn[Np, Kp], scale_inv f32[Np/128 rounded up, Kp/128]).
    """
    n, k = q.shape
    if scale_inv.shape != (C.cdiv(n, FP8_BLOCK), C.cdiv(k, FP8_BLOCK)):
        raise ValueError(
            f"scale_inv must be [{C.cdiv(n, FP8_BLOCK)}, {C.cdiv(k, FP8_BLOCK)}], "
            f"got {list(scale_inv.shape)}"
        )
    np_, kp = C.round_up(n, N_ALIGN), C.round_up(k, FP8_BLOCK)
    if (np_, kp) != (n, k):
        q = jnp.pad(q, ((0, np_ - n), (0, kp - k)))
    return q, scale_inv.astype(jnp.float32)


def prepare_fp8_row_mosaic(q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pad an FP8 per-row weight once to the kernel's granularity (a checkpoint-conversion step).

    Pads N to a multiple of :data:`N_ALIGN` and K to one of :data:`FP8_K_ALIGN` with zero codes
    (and zero row scales); call :func:`fp8_row_gemv_mosaic` with ``n=`` the original N. A no-op
    for every Qwen3.5/3.6 projection and both LM heads ([248320, 5120], [151936, 2048]).

    Returns:
      (q float8_e4m3fn[Np, Kp], scale f32[Np]).
    """
    n, k = q.shape
    np_, kp = C.round_up(n, N_ALIGN), C.round_up(k, FP8_K_ALIGN)
    scale = scale.astype(jnp.float32)
    if (np_, kp) != (n, k):
        q = jnp.pad(q, ((0, np_ - n), (0, kp - k)))
        scale = jnp.pad(scale, (0, np_ - n))
    return q, scale


def _k_permutation(fmt: str = "nvfp4") -> np.ndarray:
    """int[B]: logical column L of a B-element block holds original element ``perm[L]``.

    NVFP4 (B = 32): L = 8i + 2q + e holds 8q + i + 4e. FP8 (B = 16): L = 8u + 2q + e holds
    4q + 2u + e.
    """
    if fmt == "nvfp4":
        i, q, e = np.meshgrid(np.arange(4), np.arange(4), np.arange(2), indexing="ij")
        return (8 * q + i + 4 * e).reshape(-1)
    u, q, e = np.meshgrid(np.arange(2), np.arange(4), np.arange(2), indexing="ij")
    return (4 * q + 2 * u + e).reshape(-1)


def permute_k(x: jax.Array, fmt: str = "nvfp4") -> jax.Array:
    """[..., K] -> [..., K] in the kernel's logical K order (K a multiple of 32 or 16)."""
    *lead, k = x.shape
    nd = len(lead) + 4
    if fmt == "nvfp4":
        blocks = x.reshape(*lead, k // 32, 4, 2, 4)  # original element 8q + 4e + i -> [q, e, i]
        order = (nd - 1, nd - 3, nd - 2)  # -> [i, q, e]
    else:
        blocks = x.reshape(*lead, k // 16, 4, 2, 2)  # original element 4q + 2u + e -> [q, u, e]
        order = (nd - 2, nd - 3, nd - 1)  # -> [u, q, e]
    return jnp.moveaxis(blocks, order, (nd - 3, nd - 2, nd - 1)).reshape(x.shape)


def _shift(w, s: int):
    return (w << s) if s >= 0 else (w >> -s)


def _or_terms(w, terms, shift, band, bor):
    """OR of ``shift(w, s) & mask`` over ``terms`` ((s, mask), ...)."""
    bits = None
    for s, mask in terms:
        v = band(shift(w, s) if s else w, mask)
        bits = v if bits is None else bor(bits, v)
    return bits


def _pair_words(
    w, layout: str, *, shift=None, band=None, bor=None, even_up=None, terms_only: bool = False
) -> list:
    """The four float16-pair words of 32-bit code words ``w``, computed the way the kernel does.

    The ops default to numpy / ``jnp`` operators on uint32 arrays; the kernel passes MLIR
    builders (``even_up``: a ``prmt`` moving bytes 0 and 2 to 1 and 3, zeroing the others).
    ``terms_only`` evaluates ``_DECODE_TERMS`` as written (a timing baseline: 15 ops for
    "checkpoint"; the same words).
    """
    if shift is None:
        u32 = w.dtype.type
        shift = lambda v, s: _shift(v, s)  # noqa: E731
        band = lambda v, m: v & u32(m)  # noqa: E731
        bor = lambda a, b: a | b  # noqa: E731
        even_up = lambda v: (v << 8) & u32(_ODD_BYTES)  # noqa: E731
    if layout != "checkpoint" or terms_only:
        return [_or_terms(w, t, shift, band, bor) for t in _DECODE_TERMS[layout]]
    nib = [_or_terms(w, t, shift, band, bor) for t in _NIBBLE_BYTE_TERMS]
    return [even_up(nib[j]) if up else band(nib[j], _ODD_BYTES) for j, up in _NIBBLE_BYTE_PAIRS]


def decode_tile(codes: jax.Array, scale_u8: jax.Array, *, layout: str = "checkpoint") -> jax.Array:
    """Decode a tile the way the kernel's registers hold it, in plain ``jnp``.

    Args:
      codes: uint8[R, B] packed bytes in weight layout ``layout`` (B a multiple of 16).
      scale_u8: uint8[R, B/8] E4M3 block scales as bytes.

    Returns:
      float16[R, 2B]: ``e2m1 * scale * 2**-14`` in the logical K order of :func:`permute_k`.
    """
    r, b = codes.shape
    w = jax.lax.bitcast_convert_type(codes.reshape(r, b // 4, 4), jnp.uint32)  # [R, W]
    pairs = _pair_words(w, layout)
    h = jax.lax.bitcast_convert_type(jnp.stack(pairs, axis=-1), jnp.float16)  # [R, W, 4i, 2e]
    s = C.from_u8_e4m3(scale_u8, jnp.float16)  # [R, B/8]; word W lies in scale group W // 2
    h = h * jnp.repeat(s, 2, axis=1)[:, :, None, None]
    h = h.reshape(r, b // 16, 4, 4, 2)  # [R, J, q, i, e]
    return h.transpose(0, 1, 3, 2, 4).reshape(r, 2 * b)


def decode_tile_fp8(codes: jax.Array) -> jax.Array:
    """uint8[R, B] E4M3 bytes -> float16[R, B] (exact) in the logical K order of
    ``permute_k(..., "fp8")``, the way the kernel's registers hold it."""
    return permute_k(C.from_u8_e4m3(codes, jnp.float16), "fp8")


# ---------------------------------------------------------------------------------------------
# Register-level decode (GPU only).
# ---------------------------------------------------------------------------------------------


def _register_origins(layout, shape: tuple[int, int]) -> dict[tuple[int, ...], tuple[int, int]]:
    """Static (row, col) of each register's first element; a thread adds its own offset."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    strides = tuple(mgpu_utils.get_contiguous_strides(shape))
    tile_strides = layout.tiling.tile_strides(strides)
    out = {}
    for idx in np.ndindex(*layout.registers_shape(shape)):
        lin = sum(i * s for i, s in zip(idx, tile_strides))
        out[idx] = divmod(lin, shape[1])
    return out


def _chunk_plan(block_n: int, tile_bytes: int, chunk: int, fmt: str = "nvfp4"):
    """Which code registers feed which operand registers for logical K chunk ``chunk``.

    The codes (uint8[block_n, tile_bytes], ``WGMMA_LAYOUT_8BIT``) give each thread 4 bytes
    ``16j + 4q + [0, 4)`` of a row per register; the operand (float16[block_n, 64],
    ``WGMMA_LAYOUT``) wants columns ``8t + 2q + [0, 2)`` of the same row per register. A code
    register holds ``E = 4 * elems_per_byte`` elements, ``E / 2`` float16 pairs, so the register
    at byte block j (within the chunk) feeds operand tiles ``t = (E / 8) j + i`` with pair i
    (NVFP4: 4 pairs of ``_DECODE_TERMS``; FP8: byte pairs (0, 1) and (2, 3)). Both layouts give
    a thread the same rows (16 * warp + lane // 4, + 8) and the same q = lane % 4; the tests
    check this thread by thread.

    Returns:
      [(code register index, ((operand register index, pair i), ...)), ...].
    """
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    epb = _ELEMS_PER_BYTE[fmt]
    out_slot = {
        rc: idx for idx, rc in _register_origins(fa.WGMMA_LAYOUT, (block_n, _CHUNK)).items()
    }
    chunk_bytes = _CHUNK // epb
    col0 = chunk * chunk_bytes
    plan = []
    for idx, (r0, k0) in _register_origins(fa.WGMMA_LAYOUT_8BIT, (block_n, tile_bytes)).items():
        if col0 <= k0 < col0 + chunk_bytes:
            j = (k0 - col0) // 16
            slots = tuple((out_slot[(r0, 16 * epb * j + 8 * i)], i) for i in range(2 * epb))
            plan.append((idx, slots))
    return plan


def _decode_chunk_gpu(
    codes,
    scale_smem,
    *,
    fmt: str,
    chunk: int,
    block_n: int,
    layout: str,
    skip: bool,
    terms_only: bool = False,
):
    """float16[block_n, 64] ``WGMMA_LAYOUT`` operand for logical K chunk ``chunk`` of ``codes``.

    ``codes`` is a uint8[block_n, B] code tile in ``WGMMA_LAYOUT_8BIT`` (each register: 4
    consecutive bytes of one row); for NVFP4 ``scale_smem`` is the step's uint8[block_n,
    block_k/16] scale tile in shared memory (FP8: None). ``skip`` (a timing diagnostic, wrong
    results) replaces the decode by a bitcast; ``terms_only`` see :func:`_pair_words`.
    """
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    out_shape = (block_n, _CHUNK)
    nvfp4 = fmt == "nvfp4"

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_8BIT, *((plgpu.RefType(),) if nvfp4 else ())),
        return_type=plgpu.ShapeDtypeStruct(out_shape, jnp.float16, plgpu.Layout.WGMMA),
    )
    def decode(_, codes, *scales):
        i8 = ir.IntegerType.get_signless(8)
        i16 = ir.IntegerType.get_signless(16)
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        c = mgpu_utils.c
        if codes.layout != fa.WGMMA_LAYOUT_8BIT or codes.registers.flat[0].type != (
            ir.VectorType.get((4,), i8)
        ):
            raise NotImplementedError(f"unexpected code registers {codes.layout}")

        def e4m3x2_to_f16x2(b16):
            """Two E4M3 bytes (low byte -> low half) -> f16x2, exact."""
            out = mgpu_utils.inline_ptx("cvt.rn.f16x2.e4m3x2 $0, $1;", b16, result_types=i32)
            return mgpu_utils.bitcast(out, f16x2)

        def nvfp4_pairs(w, row, col):
            # The word's block scale, duplicated into both bytes of a b16 and widened to f16x2.
            sb = memref.load(scales[0], [row, arith.divui(col, c(8, index))])
            s2 = e4m3x2_to_f16x2(arith.muli(arith.extui(i16, sb), c(0x0101, i16)))
            words = _pair_words(
                w,
                layout,
                shift=lambda v, s: (
                    arith.shli(v, c(s, i32)) if s > 0 else arith.shrui(v, c(-s, i32))
                ),
                band=lambda v, m: arith.andi(v, c(m, i32)),
                bor=arith.ori,
                even_up=lambda v: mgpu_utils.prmt(v, c(0, i32), c(0x2404, i32)),
                terms_only=terms_only,
            )
            return [arith.mulf(mgpu_utils.bitcast(v, f16x2), s2) for v in words]

        def fp8_pairs(w, row, col):
            del row, col
            lo = arith.trunci(i16, w)
            hi = arith.trunci(i16, arith.shrui(w, c(16, i32)))
            return [e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(hi)]

        # (row, col) of each register's first byte for this thread, in register order.
        thread_rc = dict(
            zip(
                np.ndindex(*codes.registers.shape),
                fa.WGMMA_LAYOUT_8BIT.thread_idxs(codes.shape),
                strict=True,
            )
        )
        out_regs = np.full(fa.WGMMA_LAYOUT.registers_shape(out_shape), None, dtype=object)
        for reg_idx, slots in _chunk_plan(block_n, codes.shape[1], chunk, fmt):
            w = mgpu_utils.bitcast(codes.registers[reg_idx], i32)
            if skip:
                pairs = [mgpu_utils.bitcast(w, f16x2)] * len(slots)
            else:
                pairs = (nvfp4_pairs if nvfp4 else fp8_pairs)(w, *thread_rc[reg_idx])
            for out_idx, i in slots:
                out_regs[out_idx] = pairs[i]
        if any(v is None for v in out_regs.flat):
            raise AssertionError("decode plan left operand registers unset")
        return fa.FragmentedArray(_registers=out_regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return decode(codes, *((scale_smem,) if nvfp4 else ()))


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------


def _swizzled(bits: int) -> tuple:
    return (plgpu.TilingTransform((8, 1024 // bits)), plgpu.SwizzleTransform(128))


def _weight_specs(fmt: str, layout: str, bn: int, bk: int, ni) -> list:
    """BlockSpecs of the weight operands of one CTA step (codes first)."""
    if fmt in _FP8_FORMATS:
        return [plgpu.BlockSpec((bn, bk), lambda ki: (ni, ki), transforms=_swizzled(8))]
    if layout == "tiled":  # one contiguous [bn, bk] tile per step
        return [
            plgpu.BlockSpec(
                (None, None, bn, bk // 2), lambda ki: (ni, ki, 0, 0), transforms=_swizzled(8)
            ),
            plgpu.BlockSpec((None, None, bn, bk // 16), lambda ki: (ni, ki, 0, 0)),
        ]
    return [
        plgpu.BlockSpec((bn, bk // 2), lambda ki: (ni, ki), transforms=_swizzled(8)),
        plgpu.BlockSpec((bn, bk // 16), lambda ki: (ni, ki)),
    ]


#: Output epilogues of :func:`_build_kernel`: "fused" writes the final f32[M, N] with the row
#: (and FP8 column) factors applied; "transposed" writes the raw accumulator f32[N, m_pad] and
#: leaves the factors and the transpose to XLA (the earlier path, kept as a timing baseline).
EPILOGUES = ("fused", "transposed")


def _broadcast_wgmma(v: jax.Array, shape: tuple[int, int], dim: int) -> jax.Array:
    """[shape[dim]] -> ``shape`` along ``dim``, in the ``WGMMA`` layout (a register-local
    broadcast of a row (dim 0) or column (dim 1) vector in the matching reduced layout)."""
    out = jax.lax.broadcast_in_dim(v, shape, (dim,))
    return plgpu.layout_cast(out, plgpu.Layout.WGMMA)


def _build_kernel(
    m: int,
    n: int,
    k: int,
    cfg: MosaicGemvConfig,
    interpret: bool,
    layout: str = "checkpoint",
    *,
    fmt: str = "nvfp4",
    skip_decode: bool = False,
    epilogue: str = "fused",
    terms_decode: bool = False,
):
    """The GEMV kernel of every format (one pipeline, the decode chosen by ``fmt``).

    Operands: x float16[m_pad, K] (permuted for ``fmt``), f32[m_pad] row factors, then NVFP4
    codes uint8[N, K/2] and scales uint8[N, K/16] (4-D tiles for "tiled"), or FP8 codes
    uint8[N, K] and f32[cdiv(N, block_n) * block_n] row scales of the weight ("fp8"), or
    FP8 codes uint8[N, K] and block scales f32[cdiv(N, 128), K/128] ("fp8_block").

    FP8 block-128 (``block_n`` 64 or 128, so a CTA's rows share one scale row): each 128-wide K
    block (one 128-byte code slab, two ``wgmma`` chunks) accumulates into a fresh F32
    accumulator, which is awaited (``wgmma_wait(0)``) and added into the main one, a pipeline
    carry, times the block's scale, read as a scalar from global memory (in F32: scaling the
    float16 operand would round).

    Returns (``epilogue="fused"``) f32[m, N]: ``acc * row_factor`` (NVFP4, FP8 block-128) or
    ``acc * scale[n] * row_factor`` (FP8 per-row), in that order in F32. Each CTA scales its
    [block_n, m_pad] accumulator
    in registers, moves it to the ``WGMMA_TRANSPOSED`` layout (one shuffle per register pair),
    stores it into a [m_pad, block_n] shared-memory tile through a transposed view (the
    pipeline's buffers, free by then) and copies the tile out with TMA, which drops the rows
    past ``m`` and the columns past N.

    Timing baselines (the earlier kernel): ``epilogue="transposed"`` takes no factor operands
    and returns the raw accumulator f32[cdiv(N, block_n) * block_n, m_pad]; ``terms_decode``
    decodes "checkpoint" with its 15 ``_DECODE_TERMS`` ops. ``skip_decode`` is a timing
    diagnostic (GPU only, wrong results).
    """
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    m_pad = C.round_up(m, 8)
    bn, bk = cfg.block_n, cfg.block_k
    n_blocks = C.cdiv(n, bn)
    k_steps = C.cdiv(k, bk)
    tile_bytes = bk // _ELEMS_PER_BYTE[fmt]
    # NVFP4 loads a step's codes at once (measured); FP8 one 128-byte swizzle row (two chunks)
    # at a time, so the live code registers stay at ``block_n`` bytes per thread.
    slab = tile_bytes if fmt == "nvfp4" else 128
    chunks_per_slab = slab * _ELEMS_PER_BYTE[fmt] // _CHUNK
    n_weights = 2 if fmt == "nvfp4" else 1
    fused = epilogue == "fused"
    block_scaled = fmt == "fp8_block"
    if block_scaled and (FP8_BLOCK % bn or k % FP8_BLOCK):
        raise ValueError(
            f"fp8_block needs block_n in (64, 128) and K % {FP8_BLOCK} == 0, got "
            f"block_n={bn}, K={k}"
        )
    k_cols = k // FP8_BLOCK  # scale columns (fp8_block)

    def body(x_gmem, *refs):
        rowf_gmem, refs = (refs[0], refs[1:]) if fused else (None, refs)
        w_gmem, refs = refs[:n_weights], refs[n_weights:]
        bscale_gmem, refs = (refs[0], refs[1:]) if block_scaled else (None, refs)
        *colf_gmem, out_gmem = refs
        ni = jax.lax.axis_index("n")

        def block_scale(ki, s):
            """The scale of K block ``s`` of step ``ki``, an F32 scalar (blocks past K, which
            the pipeline zero-fills, read the last column)."""
            col = ki * (bk // FP8_BLOCK) + s
            if k % bk:
                col = jnp.minimum(col, k_cols - 1)
            return bscale_gmem[ni * bn // FP8_BLOCK, col]

        def step_block_gpu(ki, carry, x_smem, codes_smem):
            for s in range(bk // FP8_BLOCK):
                codes = plgpu.load(
                    codes_smem.at[:, pl.ds(s * FP8_BLOCK, FP8_BLOCK)],
                    layout=plgpu.Layout.WGMMA_8BIT,
                )
                scale = block_scale(ki, s)  # loaded early: its latency hides behind the MMAs

                def block_mma(part_ref, codes=codes, s=s):
                    for c in range(FP8_BLOCK // _CHUNK):
                        a = _decode_chunk_gpu(
                            codes,
                            None,
                            fmt=fmt,
                            chunk=c,
                            block_n=bn,
                            layout=layout,
                            skip=skip_decode,
                        )
                        col = s * FP8_BLOCK + c * _CHUNK
                        plgpu.wgmma(part_ref, a, x_smem.at[:, pl.ds(col, _CHUNK)].T)
                        plgpu.wgmma_wait(1)
                    return part_ref[...]  # waits for every wgmma

                part = pl.run_scoped(block_mma, plgpu.ACC((bn, m_pad)))
                carry = carry + part * scale
            return carry

        def step_block_interpret(ki, carry, x_smem, a_smem, codes_smem):
            a_smem[...] = decode_tile_fp8(codes_smem[...])
            for s in range(bk // FP8_BLOCK):

                def block_mma(part_ref, s=s):
                    for c in range(FP8_BLOCK // _CHUNK):
                        cols = pl.ds(s * FP8_BLOCK + c * _CHUNK, _CHUNK)
                        plgpu.wgmma(part_ref, a_smem.at[:, cols], x_smem.at[:, cols].T)
                        plgpu.wgmma_wait(1)
                    return part_ref[...]

                part = pl.run_scoped(block_mma, plgpu.ACC((bn, m_pad)))
                carry = carry + part * block_scale(ki, s)
            return carry

        def step_gpu(acc_ref, x_smem, codes_smem, *scale_smem):
            for s in range(tile_bytes // slab):
                view = codes_smem if slab == tile_bytes else codes_smem.at[:, pl.ds(s * slab, slab)]
                codes = plgpu.load(view, layout=plgpu.Layout.WGMMA_8BIT)
                for c in range(chunks_per_slab):
                    a = _decode_chunk_gpu(
                        codes,
                        scale_smem[0] if scale_smem else None,
                        fmt=fmt,
                        chunk=c,
                        block_n=bn,
                        layout=layout,
                        skip=skip_decode,
                        terms_only=terms_decode,
                    )
                    col = (s * chunks_per_slab + c) * _CHUNK
                    plgpu.wgmma(acc_ref, a, x_smem.at[:, pl.ds(col, _CHUNK)].T)
                    plgpu.wgmma_wait(1)

        def step_interpret(acc_ref, x_smem, a_smem, codes_smem, *scale_smem):
            if fmt == "nvfp4":
                a_smem[...] = decode_tile(codes_smem[...], scale_smem[0][...], layout=layout)
            else:
                a_smem[...] = decode_tile_fp8(codes_smem[...])
            for c in range(bk // _CHUNK):
                cols = pl.ds(c * _CHUNK, _CHUNK)
                plgpu.wgmma(acc_ref, a_smem.at[:, cols], x_smem.at[:, cols].T)
                plgpu.wgmma_wait(1)

        in_specs = [
            *_weight_specs(fmt, layout, bn, bk, ni),
            plgpu.BlockSpec((m_pad, bk), lambda ki: (0, ki), transforms=_swizzled(16)),
        ]

        def run(acc_ref, *scratch):
            def pipeline_body(_, *smem):
                *w_smem, x_smem = smem
                if interpret:
                    step_interpret(acc_ref, x_smem, *scratch, *w_smem)
                else:
                    step_gpu(acc_ref, x_smem, *w_smem)
                # The last wgmma reads x_smem: finish it before the pipeline refills the slot
                # (cheaper in shared memory than releasing every slot one step late).
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                pipeline_body, grid=(k_steps,), in_specs=in_specs, max_concurrent_steps=cfg.stages
            )(*w_gmem, x_gmem)
            return acc_ref[...]

        def run_block_scaled(*scratch):
            """fp8_block: the main accumulator is the pipeline's carry (each K block's partial
            sum, already awaited, is added to it in registers)."""

            def pipeline_body(idx, *smem_and_carry):
                *w_smem, x_smem, carry = smem_and_carry
                if interpret:
                    return step_block_interpret(idx[0], carry, x_smem, *scratch, *w_smem)
                return step_block_gpu(idx[0], carry, x_smem, *w_smem)

            zero = plgpu.layout_cast(jnp.zeros((bn, m_pad), jnp.float32), plgpu.Layout.WGMMA)
            return plgpu.emit_pipeline(
                pipeline_body,
                grid=(k_steps,),
                in_specs=in_specs,
                max_concurrent_steps=cfg.stages,
                init_carry=zero,
            )(*w_gmem, x_gmem)

        def store_fused(acc, o_smem):
            if colf_gmem:  # FP8: the weight row's scale first, as the unfused path did
                colf = plgpu.load(
                    colf_gmem[0].at[pl.ds(ni * bn, bn)],
                    layout=plgpu.Layout.WGMMA.reduce(1),
                    optimized=False,
                )
                acc = acc * _broadcast_wgmma(colf, (bn, m_pad), 0)
            rowf = plgpu.load(rowf_gmem, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            acc = acc * _broadcast_wgmma(rowf, (bn, m_pad), 1)
            o_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(0, m_pad), pl.ds(ni * bn, bn)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def with_scratch(*scratch):
            if block_scaled:
                acc = run_block_scaled(*scratch)
            else:
                acc = pl.run_scoped(lambda acc_ref: run(acc_ref, *scratch), plgpu.ACC((bn, m_pad)))
            if not fused:
                out_gmem.at[pl.ds(ni * bn, bn)][...] = acc
            else:  # a scope after the pipeline's: its shared memory is reused
                pl.run_scoped(
                    lambda o_smem: store_fused(acc, o_smem), plgpu.SMEM((m_pad, bn), jnp.float32)
                )

        if interpret:  # the interpreter's wgmma takes its left operand from shared memory only
            pl.run_scoped(with_scratch, plgpu.SMEM((bn, bk), jnp.float16, transforms=_swizzled(16)))
        else:
            with_scratch()

    out_shape = (m, n) if fused else (n_blocks * bn, m_pad)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(n_blocks,),
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


# ---------------------------------------------------------------------------------------------
# Public kernel.
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("n", "layout", "config", "interpret"))
def nvfp4_gemv_mosaic(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    scale_2: jax.Array,
    *,
    n: int | None = None,
    layout: str = "checkpoint",
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """NVFP4 W4A16 GEMV on Hopper tensor cores; same contract as ``gemv.nvfp4_gemv``.

    Args:
      x: bf16[M, K] activations, 1 <= M <= 128, K a multiple of 16.
      packed: uint8[Nw, Kw/2], Nw a multiple of 8 and Kw of 256 with K <= Kw < K + 256, or
        for "tiled" uint8[Nw/bn, Kw/bk, bn, bk/2] (see :func:`prepare_nvfp4_mosaic`); columns
        past K must decode to zero (they do after it).
      scale: float8_e4m3fn[Nw, Kw/16] (tiled: [Nw/bn, Kw/bk, bn, bk/16]).
      scale_2: f32[] global scale.
      n: output rows to keep (the weight's N before ``prepare`` padded it); default Nw.
      layout: the layout of ``packed`` (:data:`WEIGHT_LAYOUTS`): "checkpoint" (as stored), or
        what ``prepare_nvfp4_mosaic(..., layout=...)`` made.
      config: tile sizes (:func:`default_config` when None; for "tiled" the weight's tile).
      interpret: run Mosaic GPU's CPU interpreter (slow; tests only).

    Returns:
      f32[M, n].
    """
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    _check_rows(x)
    m, k = x.shape
    if layout == "tiled":
        if packed.ndim != 4:
            raise ValueError(f"tiled codes must be 4-D, got {packed.shape}; see prepare")
        nt, kt, tile_n, tile_kh = packed.shape
        nw, kw = nt * tile_n, kt * tile_kh * 2
        if config is None:
            config = MosaicGemvConfig(block_n=tile_n, block_k=tile_kh * 2, stages=2)
        if (config.block_n, config.block_k) != (tile_n, tile_kh * 2):
            raise ValueError(
                f"config tile {config.block_n}x{config.block_k} must match the weight's "
                f"{tile_n}x{tile_kh * 2} tiles"
            )
        want_scale = (nt, kt, tile_n, tile_kh // 8)
        k_align = tile_kh * 2
    else:
        nw, kh = packed.shape
        kw = kh * 2
        want_scale = (nw, kw // 16)
        k_align = K_ALIGN
        if kw % K_ALIGN or nw % N_ALIGN:
            raise ValueError(
                f"packed must be [N, K/2] with N % {N_ALIGN} == 0 and K % {K_ALIGN} == 0, got "
                f"N={nw}, K={kw}; pad the weight once with prepare_nvfp4_mosaic"
            )
    if k % 16 or not k <= kw < k + k_align:
        raise ValueError(f"x K={k} must be a multiple of 16 and match the weight's K={kw}")
    if scale.shape != want_scale:
        raise ValueError(f"scale must be {list(want_scale)}, got {scale.shape}")
    n = _check_n(n, nw, config.block_n if layout == "tiled" else N_ALIGN)
    cfg = config or default_config(m, nw, kw)
    if cfg.block_k % K_ALIGN:
        raise ValueError(f"NVFP4 needs block_k a multiple of {K_ALIGN}, got {cfg.block_k}")
    x16, xinv = _prepare_x(x, kw, "nvfp4")
    gscale = jnp.asarray(scale_2, jnp.float32) * C.E2M1_F16_UNBIAS
    kernel = _build_kernel(m, nw, kw, cfg, interpret, layout, fmt="nvfp4")
    out = kernel(x16, _pad_to(xinv * gscale, x16.shape[0]), packed, C.as_u8(scale))
    return out[:, :n] if n < nw else out


def _check_rows(x: jax.Array) -> None:
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {x.shape}")


def _check_fp8(x: jax.Array, q: jax.Array, k_align: int, prepare: str) -> tuple[int, int, int]:
    """Checks x [M, K] against FP8 codes [Nw, Kw] (Nw % 8, Kw % k_align, K <= Kw < K + k_align).
    Returns (M, Nw, Kw)."""
    _check_rows(x)
    m, k = x.shape
    if q.ndim != 2 or q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"q must be float8_e4m3fn[N, K], got {q.dtype}{list(q.shape)}")
    nw, kw = q.shape
    if kw % k_align or nw % N_ALIGN:
        raise ValueError(
            f"q must be [N, K] with N % {N_ALIGN} == 0 and K % {k_align} == 0, got "
            f"N={nw}, K={kw}; pad the weight once with {prepare}"
        )
    if not k <= kw < k + k_align:
        raise ValueError(f"x K={k} must match the weight's K={kw}")
    return m, nw, kw


def _check_n(n: int | None, nw: int, n_align: int) -> int:
    n = nw if n is None else n
    if not nw - n_align < n <= nw:
        raise ValueError(f"n={n} must be in ({nw - n_align}, {nw}] for a weight of {nw} rows")
    return n


def _pad_to(a: jax.Array, size: int) -> jax.Array:
    """f32[L] -> f32[size], zero-padded (no-op when L == size)."""
    return a if a.shape[0] == size else jnp.pad(a, (0, size - a.shape[0]))


def _prepare_x(x: jax.Array, kw: int, fmt: str = "nvfp4") -> tuple[jax.Array, jax.Array]:
    """The kernel's activation operand: x row-scaled to float16, rows padded to a multiple of
    8, K zero-padded to the weight's ``kw`` and permuted for ``fmt`` (:func:`permute_k`).

    Returns:
      (float16[m_pad, kw], f32[M] the factors that undo the row scaling).
    """
    m, k = x.shape
    x16, xinv = C.to_f16_rowscaled(x, C.round_up(m, 8))
    if kw != k:
        x16 = jnp.pad(x16, ((0, 0), (0, kw - k)))
    return permute_k(x16, fmt), xinv


@functools.partial(jax.jit, static_argnames=("n", "config", "interpret"))
def fp8_row_gemv_mosaic(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    *,
    n: int | None = None,
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """FP8 per-row W8A16 GEMV on Hopper tensor cores; same contract as ``gemv.fp8_row_gemv``:
    ``x @ (q * scale[:, None]).T``.

    Args:
      x: bf16[M, K] activations, 1 <= M <= 128.
      q: float8_e4m3fn[Nw, Kw], Nw a multiple of 8 and Kw of 128 with K <= Kw < K + 128
        (:func:`prepare_fp8_row_mosaic` pads other weights once; columns past K must be zero).
      scale: f32[Nw] per-row scale, applied in F32 after the F32-accumulated MMA.
      n: output rows to keep (the weight's N before padding); default Nw.
      config: tile sizes (:func:`default_config` with ``fmt="fp8"`` when None).
      interpret: run Mosaic GPU's CPU interpreter (slow; tests only).

    Returns:
      f32[M, n].
    """
    m, nw, kw = _check_fp8(x, q, FP8_K_ALIGN, "prepare_fp8_row_mosaic")
    if scale.shape != (nw,):
        raise ValueError(f"scale must be [{nw}], got {scale.shape}")
    n = _check_n(n, nw, N_ALIGN)
    cfg = config or default_config(m, nw, kw, fmt="fp8")
    x16, xinv = _prepare_x(x, kw, "fp8")
    kernel = _build_kernel(m, nw, kw, cfg, interpret, fmt="fp8")
    colf = _pad_to(scale.astype(jnp.float32), C.cdiv(nw, cfg.block_n) * cfg.block_n)
    out = kernel(x16, _pad_to(xinv, x16.shape[0]), C.as_u8(q), colf)
    return out[:, :n] if n < nw else out


@functools.partial(jax.jit, static_argnames=("n", "config", "interpret"))
def fp8_block_gemv_mosaic(
    x: jax.Array,
    q: jax.Array,
    scale_inv: jax.Array,
    *,
    n: int | None = None,
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """FP8 block-128 W8A16 GEMV on Hopper tensor cores; same contract as
    ``gemv.fp8_block_gemv``: ``x @ w.T`` with ``w = q * scale_inv[n // 128, k // 128]``.

    Args:
      x: bf16[M, K] activations, 1 <= M <= 128.
      q: float8_e4m3fn[Nw, Kw], Nw a multiple of 8 and Kw of 128 with K <= Kw < K + 128
        (:func:`prepare_fp8_block_mosaic` pads other weights once; columns past K must be zero).
      scale_inv: f32[ceil(Nw/128), Kw/128] block scales, applied in F32 to each 128-wide K
        block's F32 partial sum.
      n: output rows to keep (the weight's N before padding); default Nw.
      config: tile sizes, ``block_n`` 64 or 128 (:func:`default_config` with
        ``fmt="fp8_block"`` when None).
      interpret: run Mosaic GPU's CPU interpreter (slow; tests only).

    Returns:
      f32[M, n].
    """
    m, nw, kw = _check_fp8(x, q, FP8_BLOCK, "prepare_fp8_block_mosaic")
    want = (C.cdiv(nw, FP8_BLOCK), kw // FP8_BLOCK)
    if scale_inv.shape != want:
        raise ValueError(f"scale_inv must be {list(want)}, got {list(scale_inv.shape)}")
    n = _check_n(n, nw, N_ALIGN)
    cfg = config or default_config(m, nw, kw, fmt="fp8_block")
    if cfg.block_n > FP8_BLOCK:
        raise ValueError(f"fp8_block needs block_n <= {FP8_BLOCK}, got {cfg.block_n}")
    x16, xinv = _prepare_x(x, kw, "fp8_block")
    kernel = _build_kernel(m, nw, kw, cfg, interpret, fmt="fp8_block")
    out = kernel(x16, _pad_to(xinv, x16.shape[0]), C.as_u8(q), scale_inv.astype(jnp.float32))
    return out[:, :n] if n < nw else out


# ---------------------------------------------------------------------------------------------
# The backend.
# ---------------------------------------------------------------------------------------------


def gemv(
    x: jax.Array, w: Weight, *, config: MosaicGemvConfig | None = None, interpret: bool = False
) -> jax.Array:
    """``x: bf16[M, K]`` (M <= 128) times an aligned NVFP4 / FP8 / FP8 block-128 weight."""
    if isinstance(w, Nvfp4Weight):
        return nvfp4_gemv_mosaic(
            x, w.packed, w.scale, w.scale_2, config=config, interpret=interpret
        )
    if isinstance(w, Fp8RowWeight):
        return fp8_row_gemv_mosaic(x, w.q, w.scale, config=config, interpret=interpret)
    return fp8_block_gemv_mosaic(x, w.q, w.scale_inv, config=config, interpret=interpret)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicLinear:
    """The ``wgmma`` GEMV for NVFP4, FP8 per-row and FP8 block-128 weights whose shape suits the
    TMA copies, at every row count (128-row chunks beyond :data:`MAX_ROWS`). One kernel family
    for every row count means a row's result does not depend on how many rows share the call.
    """

    name: str = "mosaic_gpu"
    config_type: type = MosaicGemvConfig

    def supported_on(self, device) -> bool:
        """Hopper (sm_90): ``wgmma`` exists on compute capability 9.x only."""
        cc = compute_capability(device)
        return cc is not None and cc[0] == 9

    def supports(self, rows: int, w: Weight) -> str | None:
        del rows  # every row count
        if not isinstance(w, Nvfp4Weight | Fp8RowWeight | Fp8BlockWeight):
            return f"no Mosaic GEMV for {w.format.value} weights"
        n, k = w.shape
        k_align = K_ALIGN if isinstance(w, Nvfp4Weight) else FP8_K_ALIGN
        if n % N_ALIGN or k % k_align:
            return (
                f"the TMA copies need N % {N_ALIGN} == 0 and K % {k_align} == 0 for "
                f"{w.format.value} weights, got [{n}, {k}]"
            )
        return None

    def __call__(self, x, w, *, config=None, interpret=False):
        kernel = functools.partial(gemv, w=w, config=config, interpret=interpret)
        return C.in_row_chunks(kernel, x, MAX_ROWS, w.out_features)


MOSAIC_GPU = MosaicLinear()
