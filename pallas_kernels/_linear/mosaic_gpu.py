"""Mosaic GPU backend of ``linear``: NVFP4, FP8 per-row and FP8 block-128 GEMV (1 to 128 rows a
call) on Hopper tensor cores.

The multiply-adds go to ``wgmma``: each warpgroup decodes a ``[block_n, 64]`` float16 weight tile
into registers, the *left* operand of ``wgmma.m64nNk16`` (weight rows are the MMA's M), and the
activations sit in shared memory as the right operand (rows padded to a multiple of 8, the MMA's
N; :data:`MAX_ROWS` = 128). What is left on the ALUs per 8 NVFP4 weight elements is one 32-bit
shared load, a scale byte load + ``cvt``, four ``f16x2`` multiplies and 11 shift/mask/``prmt``
ops; per 4 FP8 elements, one 32-bit shared load and two ``cvt.rn.f16x2.e4m3x2``. Measured on the
H200 the kernel is bound by data movement, not by the decode (see BENCHMARKS.md).

NVFP4 decode (per thread, per 32-bit word ``w`` = four packed bytes of one weight row, the
register the ``WGMMA_LAYOUT_8BIT`` load gives): a nibble ``s i2 i1 i0`` placed as float16 bits
``s << 15 | i << 9`` is exactly ``e2m1 * 2**-14`` (see :mod:`pallas_kernels._common`), so each
of the four float16 pairs of a word is a few shifts and masks of ``w`` (:func:`_pair_words`),
multiplied by the block scale in ``f16x2`` (exact), and is already one register of the
``WGMMA_LAYOUT`` operand. That fixes a permutation of K inside every 32-element block (logical
column ``8i + 2q + e`` holds element ``8q + i + 4e``), applied to the activations on the host
(:func:`permute_k`).

FP8 per-row decode: the same word holds four E4M3 elements of one row; each byte pair converts
exactly to one ``f16x2`` register (E4M3 is exact in float16), so inside every 16-element block
logical column ``8u + 2q + e`` holds element ``4q + 2u + e`` (:func:`permute_k` with
``fmt="fp8"``).

FP8 block-128 (DeepSeek-V3 ``weight_scale_inv``): the FP8 decode and pipeline, with 64- or
128-row CTAs aligned to the 128-row scale blocks, so a CTA's scale is one scalar per 128-wide K
block: each K block's two ``wgmma`` chunks accumulate into a fresh F32 accumulator, awaited and
added into the main one (a pipeline carry) times that scalar, in F32.

Epilogue: each CTA scales its F32 accumulator in registers (FP8: ``acc * scale[n] * xinv[row]``;
NVFP4: ``acc * (xinv[row] * scale_2 * 2**14)``, the factor made by the wrapper), stores it
transposed into shared memory and TMA-copies the [rows, block_n] tile to the f32[M, N] output,
which drops the padded rows and the columns past N.

Rows: the weight is read once per call, but every CTA streams all of x through shared memory,
[m_pad, block_k] float16 per step from L2, so at large M the activation traffic outgrows the
weight's and the MMA work grows with M; :func:`default_config` widens the CTA to 128 rows where
the accumulator (``block_n * m_pad / 128`` F32 registers per thread) allows.

Shapes:
  x:        bf16[M, K]            activations, 1 <= M <= 128
  NVFP4:    packed uint8[N, K/2] (element 2j of a row is the low nibble of byte j),
            scale float8_e4m3fn[N, K/16], scale_2 f32[]
  FP8:      q float8_e4m3fn[N, K], scale f32[N]
  FP8 block-128: q float8_e4m3fn[N, K], scale_inv f32[ceil(N/128), K/128]
  out:      f32[M, N]

Layout requirements: the TMA copies move swizzled 8-row tiles of 128-byte rows, so N must be a
multiple of 8 and K of 256 for NVFP4 (also 16-byte aligned ``scale`` rows of K/16 bytes) or of
128 for FP8 (one 128-byte swizzle row); :meth:`MosaicLinear.supports` sends other weights
elsewhere. N need not be a multiple of block_n, nor K of block_k: TMA zero-fills the rows and
columns past the weight's.

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
    Fp8RowWeight,
    Nvfp4Weight,
    StackedWeight,
    Weight,
    WeightFormat,
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
#: Rows and columns of one FP8 block-128 scale (DeepSeek-V3 ``weight_scale_inv``).
FP8_BLOCK = 128
#: The weight formats the kernel decodes.
_FORMATS = (WeightFormat.NVFP4, WeightFormat.FP8, WeightFormat.FP8_BLOCK)
#: Registers per thread the producer warpgroup of a warp-specialised CTA keeps (it only issues
#: copies); the consumers share the rest of the SM's register file.
PRODUCER_REGISTERS = 40


#: The four float16 pairs of a code word in 11 integer ops (:func:`_pair_words`): pair i holds
#: elements 8q + i (low half) and 8q + i + 4 (high half) of the word's 8 K elements, i.e.
#: (lo b0, lo b2), (hi b0, hi b2), (lo b1, lo b3), (hi b1, hi b3). First two words that hold one
#: nibble per byte, placed as the high byte of a float16 pair half wants it (index bits on bits
#: 1..3 of the byte, sign on bit 7), the low nibbles (shifts 1 and 4) and the high nibbles
#: (shift -3 and in place), 7 ops; then each pair is the odd bytes of one of them (one AND) or
#: its even bytes moved up (one ``prmt``).
_NIBBLE_BYTE_TERMS = (
    ((1, 0x0E0E0E0E), (4, 0x80808080)),  # low nibbles
    ((-3, 0x0E0E0E0E), (0, 0x80808080)),  # high nibbles
)
#: Per pair: (nibble word, whether its even bytes move up into the odd ones).
_NIBBLE_BYTE_PAIRS = ((0, True), (1, True), (0, False), (1, False))
_ODD_BYTES = 0xFF00FF00


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGemvConfig:
    """Tile sizes of the Mosaic GPU NVFP4 and FP8 GEMVs.

    Attributes:
      block_n: weight rows per CTA (one warpgroup; a multiple of 64, at most 256). The
        accumulator takes ``block_n * m_pad / 128`` F32 registers per thread.
      block_k: K elements per pipeline step (a multiple of 128, of 256 for NVFP4; at most
        2048).
      stages: pipeline depth: steps whose TMA copies are in flight per CTA (at least 2; one
        stage would not overlap the copies with the decode). Measured on the H200, more CTAs
        per SM beat deeper pipelines (see BENCHMARKS.md).
      consumers: compute warpgroups per CTA. 1: the warpgroup issues its own copies, and
        several CTAs share an SM. 2: a warp-specialised CTA, one producer warpgroup issuing
        the copies and two consumer warpgroups of ``block_n / 2`` weight rows each, which
        share every activation tile in shared memory (the activations cross L2 once per
        ``block_n`` rows instead of once per 64). The producer hands its registers to the
        consumers, so such a CTA takes a whole SM: ``stages`` sets the bytes in flight. (Four
        consumers would deadlock: Pallas sizes their register increase for a whole SM, more
        than 640 threads' launch share leaves.)
    """

    block_n: int = 64
    block_k: int = 512
    stages: int = 2
    consumers: int = 1

    def __post_init__(self):
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n must be a multiple of 64 in [64, 256], got {self.block_n}")
        if self.consumers not in (1, 2) or self.block_n % (64 * self.consumers):
            raise ValueError(
                f"consumers must be 1 or 2 with block_n a multiple of 64 * consumers, got "
                f"consumers={self.consumers}, block_n={self.block_n}"
            )
        if self.block_k % FP8_K_ALIGN or not FP8_K_ALIGN <= self.block_k <= 2048:
            raise ValueError(
                f"block_k must be a multiple of {FP8_K_ALIGN} in [{FP8_K_ALIGN}, 2048] (of "
                f"{K_ALIGN} for NVFP4), got {self.block_k}"
            )
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")


def default_config(m: int, n: int, k: int, *, fmt: str = "nvfp4") -> MosaicGemvConfig:
    """Tile heuristic per row count (``m_pad = round_up(m, 8)``), measured on the H200 LM head
    (see BENCHMARKS.md). Shared memory per CTA is ``stages * (weight tile + m_pad * block_k * 2)``
    bytes (the tests read it off the lowering).

    * m_pad == 8: 64-row CTAs, 2 stages and little shared memory, so several CTAs share an SM
      (NVFP4 64x512: 52 KB, 4 per SM; FP8 64x256, the same 16 KB of codes per step: 5 per SM).
    * 8 < m_pad <= 32: 64x256.
    * NVFP4, m_pad > 32: 128-row CTAs, 256-wide K steps: each CTA streams all of x through shared
      memory, and 128 rows per CTA halve that traffic against 64. At m_pad > 48 one CTA fits an
      SM with either width, so the wider CTA costs registers (m_pad F32 per thread), not
      occupancy.
    * Both FP8 formats above 32 rows: 128-wide K steps, whose smaller stages let two or three
      CTAs share an SM, so one CTA's decode overlaps another's MMAs. Per-row 128x128, block-128
      64x128 (its CTA holds two accumulators: the main one and each K block's partial sum).
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
# The K permutation and the jnp decode (interpret mode, tests).
# ---------------------------------------------------------------------------------------------


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


def _pair_words(w, *, shift=None, band=None, bor=None, even_up=None) -> list:
    """The four float16-pair words of 32-bit code words ``w``, computed the way the kernel does.

    The ops default to numpy / ``jnp`` operators on uint32 arrays; the kernel passes MLIR
    builders (``even_up``: a ``prmt`` moving bytes 0 and 2 to 1 and 3, zeroing the others).
    """
    if shift is None:
        u32 = w.dtype.type
        shift = lambda v, s: _shift(v, s)  # noqa: E731
        band = lambda v, m: v & u32(m)  # noqa: E731
        bor = lambda a, b: a | b  # noqa: E731
        even_up = lambda v: (v << 8) & u32(_ODD_BYTES)  # noqa: E731
    nib = [_or_terms(w, t, shift, band, bor) for t in _NIBBLE_BYTE_TERMS]
    return [even_up(nib[j]) if up else band(nib[j], _ODD_BYTES) for j, up in _NIBBLE_BYTE_PAIRS]


def decode_tile(codes: jax.Array, scale_u8: jax.Array) -> jax.Array:
    """Decode a tile the way the kernel's registers hold it, in plain ``jnp``.

    Args:
      codes: uint8[R, B] packed bytes (B a multiple of 16).
      scale_u8: uint8[R, B/8] E4M3 block scales as bytes.

    Returns:
      float16[R, 2B]: ``e2m1 * scale * 2**-14`` in the logical K order of :func:`permute_k`.
    """
    r, b = codes.shape
    w = jax.lax.bitcast_convert_type(codes.reshape(r, b // 4, 4), jnp.uint32)  # [R, W]
    pairs = _pair_words(w)
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
    (NVFP4: the 4 pairs of :func:`_pair_words`; FP8: byte pairs (0, 1) and (2, 3)). Both layouts give
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


def _decode_chunk_gpu(codes, scale_smem, *, fmt: str, chunk: int, block_n: int):
    """float16[block_n, 64] ``WGMMA_LAYOUT`` operand for logical K chunk ``chunk`` of ``codes``.

    ``codes`` is a uint8[block_n, B] code tile in ``WGMMA_LAYOUT_8BIT`` (each register: 4
    consecutive bytes of one row); for NVFP4 ``scale_smem`` is the step's uint8[block_n,
    block_k/16] scale tile in shared memory (FP8: None).
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
                shift=lambda v, s: (
                    arith.shli(v, c(s, i32)) if s > 0 else arith.shrui(v, c(-s, i32))
                ),
                band=lambda v, m: arith.andi(v, c(m, i32)),
                bor=arith.ori,
                even_up=lambda v: mgpu_utils.prmt(v, c(0, i32), c(0x2404, i32)),
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


def _weight_specs(fmt: str, bn: int, bk: int, ni, entry) -> list:
    """BlockSpecs of the weight operands of one CTA step (codes first); ``entry`` (a scalar
    read in the kernel, or None) selects one matrix of stacked [L, N, .] operands, whose
    squeezed leading axis the TMA copies index in place."""

    def spec(cols: int, **kw):
        if entry is None:
            return plgpu.BlockSpec((bn, cols), lambda ki: (ni, ki), **kw)
        return plgpu.BlockSpec((None, bn, cols), lambda ki: (entry, ni, ki), **kw)

    if fmt != "nvfp4":  # FP8: one E4M3 code per byte
        return [spec(bk, transforms=_swizzled(8))]
    return [spec(bk // 2, transforms=_swizzled(8)), spec(bk // 16)]


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
    *,
    fmt: str = "nvfp4",
    stacked: bool = False,
):
    """The GEMV kernel of every format (one pipeline, the decode chosen by ``fmt``) -> f32[m, N].

    Operands: x float16[m_pad, K] (permuted for ``fmt``), f32[m_pad] row factors, with
    ``stacked`` an int32[1] entry index and the codes (NVFP4: and scales) as [L, N, .] stacks
    read at that entry, then NVFP4
    codes uint8[N, K/2] and scales uint8[N, K/16]; FP8 codes uint8[N, K] and f32[cdiv(N,
    block_n) * block_n] weight-row scales ("fp8"); or FP8 codes uint8[N, K] and block scales
    f32[cdiv(N, 128), K/128] ("fp8_block", ``block_n`` 64 or 128 so a CTA's rows share one
    scale row). The block scales multiply each K block's F32 partial sum (scaling the float16
    operand would round); the epilogue (module docstring) moves the scaled accumulator to the
    ``WGMMA_TRANSPOSED`` layout, one shuffle per register pair, into the pipeline's freed
    shared memory.
    """
    m_pad = C.round_up(m, 8)
    bn, bk = cfg.block_n, cfg.block_k
    n_blocks = C.cdiv(n, bn)
    k_steps = C.cdiv(k, bk)
    tile_bytes = bk // _ELEMS_PER_BYTE[fmt]
    # NVFP4 loads a step's codes at once (measured); FP8 one 128-byte swizzle row (two chunks)
    # at a time, so the live code registers stay at ``block_n`` bytes per thread.
    slab_bytes = tile_bytes if fmt == "nvfp4" else 128
    chunks_per_slab = slab_bytes * _ELEMS_PER_BYTE[fmt] // _CHUNK
    n_weights = 2 if fmt == "nvfp4" else 1
    block_scaled = fmt == "fp8_block"
    if block_scaled and (FP8_BLOCK % bn or k % FP8_BLOCK):
        raise ValueError(
            f"fp8_block needs block_n in (64, 128) and K % {FP8_BLOCK} == 0, got "
            f"block_n={bn}, K={k}"
        )
    consumers = cfg.consumers
    if block_scaled and consumers > 1:
        raise ValueError(f"fp8_block takes one consumer warpgroup, got consumers={consumers}")
    rows = bn // consumers  # weight rows per compute warpgroup
    # Warp-specialised: per consumer, its output staging tile (and in interpret mode its
    # decoded operand), allocated for the kernel since scopes inside one thread's branch
    # cannot allocate shared memory.
    scratch = []
    if consumers > 1:
        scratch.append(plgpu.SMEM((consumers, m_pad, rows), jnp.float32))
        if interpret:
            scratch.append(plgpu.SMEM((consumers, rows, bk), jnp.float16, transforms=_swizzled(16)))
    k_cols = k // FP8_BLOCK  # scale columns (fp8_block)

    def body(x_gmem, *refs):
        rowf_gmem, refs = refs[0], refs[1:]
        entry, refs = (refs[0][0], refs[1:]) if stacked else (None, refs)
        w_gmem, refs = refs[:n_weights], refs[n_weights:]
        bscale_gmem, refs = (refs[0], refs[1:]) if block_scaled else (None, refs)
        refs, scratch_refs = refs[: len(refs) - len(scratch)], refs[len(refs) - len(scratch) :]
        *colf_gmem, out_gmem = refs
        ni = jax.lax.axis_index("n")

        def block_scale(ki, s):
            """The scale of K block ``s`` of step ``ki``, an F32 scalar (blocks past K, which
            the pipeline zero-fills, read the last column)."""
            col = ki * (bk // FP8_BLOCK) + s
            if k % bk:
                col = jnp.minimum(col, k_cols - 1)
            return bscale_gmem[ni * bn // FP8_BLOCK, col]

        def slab(codes_smem, scale_smem, a_smem, s):
            """``c -> float16[bn, 64]``, the operand of chunk ``c`` of slab ``s`` of the step's
            codes: decoded in registers from the slab's codes (GPU), or a view of ``a_smem``,
            into which the interpreter decodes the whole tile at the first slab."""
            if a_smem is None:
                view = codes_smem
                if slab_bytes != tile_bytes:
                    view = codes_smem.at[:, pl.ds(s * slab_bytes, slab_bytes)]
                codes = plgpu.load(view, layout=plgpu.Layout.WGMMA_8BIT)
                return lambda c: _decode_chunk_gpu(
                    codes, scale_smem, fmt=fmt, chunk=c, block_n=rows
                )
            if s == 0:
                tile = codes_smem[...]
                fp8 = scale_smem is None
                a_smem[...] = decode_tile_fp8(tile) if fp8 else decode_tile(tile, scale_smem[...])
            return lambda c: a_smem.at[:, pl.ds((s * chunks_per_slab + c) * _CHUNK, _CHUNK)]

        def mma(acc_ref, x_smem, operand, s):
            """The wgmma of slab ``s``'s chunks into ``acc_ref``."""
            for c in range(chunks_per_slab):
                col = (s * chunks_per_slab + c) * _CHUNK
                plgpu.wgmma(acc_ref, operand(c), x_smem.at[:, pl.ds(col, _CHUNK)].T)
                plgpu.wgmma_wait(1)

        def step(acc_ref, x_smem, a_smem, codes_smem, scale_smem=None):
            for s in range(tile_bytes // slab_bytes):
                mma(acc_ref, x_smem, slab(codes_smem, scale_smem, a_smem, s), s)

        def step_block(ki, carry, x_smem, a_smem, codes_smem):
            for s in range(bk // FP8_BLOCK):  # one slab per K block
                operand = slab(codes_smem, None, a_smem, s)
                scale = block_scale(ki, s)  # loaded early: its latency hides behind the MMAs

                def block_mma(part_ref, operand=operand, s=s):
                    mma(part_ref, x_smem, operand, s)
                    return part_ref[...]  # waits for every wgmma

                carry = carry + pl.run_scoped(block_mma, plgpu.ACC((bn, m_pad))) * scale
            return carry

        in_specs = [
            *_weight_specs(fmt, bn, bk, ni, entry),
            plgpu.BlockSpec((m_pad, bk), lambda ki: (0, ki), transforms=_swizzled(16)),
        ]

        def run(acc_ref, a_smem):
            def pipeline_body(_, *smem):
                *w_smem, x_smem = smem
                step(acc_ref, x_smem, a_smem, *w_smem)
                # The last wgmma reads x_smem: finish it before the pipeline refills the slot
                # (cheaper in shared memory than releasing every slot one step late).
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                pipeline_body, grid=(k_steps,), in_specs=in_specs, max_concurrent_steps=cfg.stages
            )(*w_gmem, x_gmem)
            return acc_ref[...]

        def run_block_scaled(a_smem):
            """fp8_block: the main accumulator is the pipeline's carry (each K block's partial
            sum, already awaited, is added to it in registers)."""

            def pipeline_body(idx, *smem_and_carry):
                *w_smem, x_smem, carry = smem_and_carry
                return step_block(idx[0], carry, x_smem, a_smem, *w_smem)

            zero = plgpu.layout_cast(jnp.zeros((bn, m_pad), jnp.float32), plgpu.Layout.WGMMA)
            return plgpu.emit_pipeline(
                pipeline_body,
                grid=(k_steps,),
                in_specs=in_specs,
                max_concurrent_steps=cfg.stages,
                init_carry=zero,
            )(*w_gmem, x_gmem)

        def store_fused(acc, o_smem, col0):
            """Scales the f32[rows, m_pad] accumulator of weight rows ``col0 + [0, rows)`` and
            copies it, transposed through ``o_smem``, into the output's columns."""
            if colf_gmem:  # FP8: the weight row's scale first, then the row factor
                colf = plgpu.load(
                    colf_gmem[0].at[pl.ds(col0, rows)],
                    layout=plgpu.Layout.WGMMA.reduce(1),
                    optimized=False,
                )
                acc = acc * _broadcast_wgmma(colf, (rows, m_pad), 0)
            rowf = plgpu.load(rowf_gmem, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            acc = acc * _broadcast_wgmma(rowf, (rows, m_pad), 1)
            o_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(0, m_pad), pl.ds(col0, rows)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def run_warp_specialized(o_all, a_all=None):
            """One producer warpgroup issues the copies of every stage; consumer ``wg`` decodes
            and multiplies weight rows ``wg * rows + [0, rows)`` of each stage against the
            stage's shared activation tile, then stores its own output columns."""
            wg = jax.lax.axis_index("wg")
            mine = pl.ds(wg * rows, rows)
            a_smem = None if a_all is None else a_all.at[wg]

            def pipeline_body(_, *smem_and_acc):
                *w_smem, x_smem, acc_ref = smem_and_acc
                step(acc_ref, x_smem, a_smem, *(r.at[mine] for r in w_smem))
                plgpu.wgmma_wait(0)  # the stage is released to the producer after the body
                return acc_ref

            def consumer(pipeline):
                def with_acc(acc_ref):
                    pipeline(acc_ref)
                    store_fused(acc_ref[...], o_all.at[wg], ni * bn + wg * rows)

                pl.run_scoped(with_acc, plgpu.ACC((rows, m_pad)))

            plgpu.emit_pipeline_warp_specialized(
                pipeline_body,
                grid=(k_steps,),
                memory_registers=PRODUCER_REGISTERS,
                in_specs=in_specs,
                max_concurrent_steps=cfg.stages,
                wg_axis="wg",
                num_compute_wgs=consumers,
                compute_context=consumer,
            )(*w_gmem, x_gmem)

        def with_scratch(a_smem=None):
            if block_scaled:
                acc = run_block_scaled(a_smem)
            else:
                acc = pl.run_scoped(lambda acc_ref: run(acc_ref, a_smem), plgpu.ACC((bn, m_pad)))
            # A scope after the pipeline's: its shared memory is reused.
            pl.run_scoped(
                lambda o_smem: store_fused(acc, o_smem, ni * bn),
                plgpu.SMEM((m_pad, bn), jnp.float32),
            )

        if consumers > 1:
            run_warp_specialized(*scratch_refs)
        elif interpret:  # the interpreter's wgmma takes its left operand from shared memory only
            pl.run_scoped(with_scratch, plgpu.SMEM((bn, bk), jnp.float16, transforms=_swizzled(16)))
        else:
            with_scratch()

    threads = dict(num_threads=consumers + 1, thread_name="wg") if consumers > 1 else {}
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(n_blocks,),
        grid_names=("n",),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        **threads,
    )


# ---------------------------------------------------------------------------------------------
# The kernels per format.
# ---------------------------------------------------------------------------------------------


def _check_aligned(x: jax.Array, nw: int, kw: int, k_align: int) -> tuple[int, int]:
    """Checks x [M, K] against a weight of [nw, kw] (nw % 8, kw % k_align, K <= kw < K +
    k_align: x's columns past K are zero-padded). Returns (M, K)."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {x.shape}")
    m, k = x.shape
    if kw % k_align or nw % N_ALIGN:
        raise ValueError(
            f"the weight must be [N, K] with N % {N_ALIGN} == 0 and K % {k_align} == 0 for the "
            f"TMA copies, got N={nw}, K={kw}"
        )
    if not k <= kw < k + k_align:
        raise ValueError(f"x K={k} must match the weight's K={kw}")
    return m, k


def _check_fp8_codes(q: jax.Array, index) -> None:
    rank = 2 if index is None else 3
    if q.ndim != rank or q.dtype != jnp.float8_e4m3fn:
        want = "[N, K]" if index is None else "[L, N, K] (with an entry index)"
        raise ValueError(f"q must be float8_e4m3fn{want}, got {q.dtype}{list(q.shape)}")


def _entry(a: jax.Array, index) -> jax.Array:
    """Entry ``index`` of a stacked small operand (scales), or ``a`` itself when unstacked."""
    return a if index is None else jax.lax.dynamic_index_in_dim(a, index, 0, False)


def _index_operand(index) -> tuple:
    """The kernel's int32[1] entry operand (none for an unstacked weight)."""
    return () if index is None else (jnp.asarray(index, jnp.int32).reshape(1),)


def _pad_to(a: jax.Array, size: int) -> jax.Array:
    """f32[L] -> f32[size], zero-padded (no-op when L == size)."""
    return a if a.shape[0] == size else jnp.pad(a, (0, size - a.shape[0]))


def _prepare_x(x: jax.Array, kw: int, fmt: str) -> tuple[jax.Array, jax.Array]:
    """The kernel's activation operand: x row-scaled to float16, rows padded to a multiple of
    8, K zero-padded to the weight's ``kw`` and permuted for ``fmt`` (:func:`permute_k`).

    Returns:
      (float16[m_pad, kw], f32[m_pad] the factors that undo the row scaling, zero-padded).
    """
    m, k = x.shape
    x16, xinv = C.to_f16_rowscaled(x, C.round_up(m, 8))
    if kw != k:
        x16 = jnp.pad(x16, ((0, 0), (0, kw - k)))
    return permute_k(x16, fmt), _pad_to(xinv, x16.shape[0])


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def nvfp4_gemv_mosaic(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    scale_2: jax.Array,
    *,
    index: jax.Array | None = None,
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """NVFP4 W4A16 GEMV: x bf16[M, K] (1 <= M <= 128, K a multiple of 16) times packed
    uint8[N, K/2], scale float8_e4m3fn[N, K/16], scale_2 f32[] -> f32[M, N]; ``index``: an
    int32[] entry of [L, ...]-stacked leaves, read in place; ``config``: tiles
    (:func:`default_config` when None); ``interpret``: Mosaic GPU's CPU interpreter."""
    *lead, nw, kh = packed.shape
    kw = kh * 2
    if len(lead) != (0 if index is None else 1):
        raise ValueError(f"packed must be [N, K/2], or [L, N, K/2] with an index, got {lead}")
    m, k = _check_aligned(x, nw, kw, K_ALIGN)
    if k % 16:
        raise ValueError(f"x K={k} must be a multiple of 16")
    if scale.shape != (*lead, nw, kw // 16):
        raise ValueError(f"scale must be {[*lead, nw, kw // 16]}, got {list(scale.shape)}")
    cfg = config or default_config(m, nw, kw)
    if cfg.block_k % K_ALIGN:
        raise ValueError(f"NVFP4 needs block_k a multiple of {K_ALIGN}, got {cfg.block_k}")
    x16, xinv = _prepare_x(x, kw, "nvfp4")
    gscale = jnp.asarray(_entry(scale_2, index), jnp.float32) * C.E2M1_F16_UNBIAS
    kernel = _build_kernel(m, nw, kw, cfg, interpret, fmt="nvfp4", stacked=index is not None)
    return kernel(x16, xinv * gscale, *_index_operand(index), packed, C.as_u8(scale))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp8_row_gemv_mosaic(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    *,
    index: jax.Array | None = None,
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """FP8 per-row W8A16 GEMV: ``x @ (q * scale[:, None]).T`` for x bf16[M, K], q
    float8_e4m3fn[N, K], scale f32[N] (applied in F32 after the F32-accumulated MMA) ->
    f32[M, N]; ``index``: an int32[] entry of [L, ...]-stacked leaves, the codes read in
    place."""
    _check_fp8_codes(q, index)
    *lead, nw, kw = q.shape
    m, _ = _check_aligned(x, nw, kw, FP8_K_ALIGN)
    if scale.shape != (*lead, nw):
        raise ValueError(f"scale must be {[*lead, nw]}, got {list(scale.shape)}")
    cfg = config or default_config(m, nw, kw, fmt="fp8")
    x16, xinv = _prepare_x(x, kw, "fp8")
    kernel = _build_kernel(m, nw, kw, cfg, interpret, fmt="fp8", stacked=index is not None)
    colf = _pad_to(_entry(scale, index).astype(jnp.float32), C.cdiv(nw, cfg.block_n) * cfg.block_n)
    return kernel(x16, xinv, *_index_operand(index), C.as_u8(q), colf)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp8_block_gemv_mosaic(
    x: jax.Array,
    q: jax.Array,
    scale_inv: jax.Array,
    *,
    index: jax.Array | None = None,
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """FP8 block-128 W8A16 GEMV: ``x @ w.T`` with ``w = q * scale_inv[n // 128, k // 128]`` for
    x bf16[M, K], q float8_e4m3fn[N, K], scale_inv f32[ceil(N/128), K/128] (applied in F32 to
    each 128-wide K block's partial sum) -> f32[M, N]. ``config.block_n`` must be 64 or 128;
    ``index``: an int32[] entry of [L, ...]-stacked leaves, the codes read in place."""
    _check_fp8_codes(q, index)
    *lead, nw, kw = q.shape
    m, _ = _check_aligned(x, nw, kw, FP8_BLOCK)
    want = (*lead, C.cdiv(nw, FP8_BLOCK), kw // FP8_BLOCK)
    if scale_inv.shape != want:
        raise ValueError(f"scale_inv must be {list(want)}, got {list(scale_inv.shape)}")
    cfg = config or default_config(m, nw, kw, fmt="fp8_block")
    if cfg.block_n > FP8_BLOCK:
        raise ValueError(f"fp8_block needs block_n <= {FP8_BLOCK}, got {cfg.block_n}")
    x16, xinv = _prepare_x(x, kw, "fp8_block")
    kernel = _build_kernel(m, nw, kw, cfg, interpret, fmt="fp8_block", stacked=index is not None)
    sinv = _entry(scale_inv, index).astype(jnp.float32)
    return kernel(x16, xinv, *_index_operand(index), C.as_u8(q), sinv)


# ---------------------------------------------------------------------------------------------
# The backend.
# ---------------------------------------------------------------------------------------------


def gemv(
    x: jax.Array,
    w: Weight | StackedWeight,
    *,
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x: bf16[M, K]`` (M <= 128) times an aligned NVFP4 / FP8 / FP8 block-128 weight (or an
    entry of a stack of them, read in place)."""
    index = None
    if isinstance(w, StackedWeight):
        w, index = w.stack, w.index
    kw = dict(index=index, config=config, interpret=interpret)
    if isinstance(w, Nvfp4Weight):
        return nvfp4_gemv_mosaic(x, w.packed, w.scale, w.scale_2, **kw)
    if isinstance(w, Fp8RowWeight):
        return fp8_row_gemv_mosaic(x, w.q, w.scale, **kw)
    return fp8_block_gemv_mosaic(x, w.q, w.scale_inv, **kw)


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

    def supports(self, rows: int, w: Weight | StackedWeight) -> str | None:
        del rows  # every row count
        if w.format not in _FORMATS:
            return f"no Mosaic GEMV for {w.format.value} weights"
        n, k = w.shape
        k_align = K_ALIGN if w.format is WeightFormat.NVFP4 else FP8_K_ALIGN
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
