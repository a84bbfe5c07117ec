"""NVFP4 GEMV on Hopper tensor cores through the Mosaic GPU Pallas lowering.

The Triton NVFP4 GEMV (:func:`pallas_kernels.gemv.nvfp4_gemv`) spends ~5-6 ALU instructions per
weight element (decode, scale, convert, FMA) and is ALU-bound on H200. Here the multiply-adds go
to ``wgmma``: each warpgroup decodes a ``[block_n, 64]`` float16 weight tile into registers, the
*left* operand of ``wgmma.m64n{8,16,..}k16`` (weight rows are the MMA's M), and the activations
sit in shared memory as the right operand (the rows padded to a multiple of 8, the MMA's N). What
is left on the ALUs is about 2.6 instructions per weight element: one 32-bit shared load per 8
elements, 19 shift/mask/multiply ops per 8 elements, and a scale load + ``cvt`` per 8 elements.

Decode (per thread, per 32-bit word ``w`` = four packed bytes ``b0..b3`` of one weight row, the
register the ``WGMMA_LAYOUT_8BIT`` load gives): the four float16 pairs ``(lo b0, lo b2)``,
``(hi b0, hi b2)``, ``(lo b1, lo b3)``, ``(hi b1, hi b3)`` each come from two shifts and two masks
of ``w`` (``_PAIR_SHIFTS``), because a nibble ``s i2 i1 i0`` placed as float16 bits
``s << 15 | i << 9`` is exactly ``e2m1 * 2**-14`` (see :mod:`pallas_kernels._common`). Each pair
is multiplied by the block scale in ``f16x2`` (exact) and is already one register of the
``WGMMA_LAYOUT`` operand. That fixes a permutation of K inside every 32-element block (logical
column ``8i + 2q + e`` holds element ``8q + i + 4e``), which is applied to the activations on the
host (:func:`permute_k`); the weight keeps its checkpoint layout.

Shapes:
  x:        bf16[M, K]            activations, 1 <= M <= 32
  packed:   uint8[N, K/2]         element 2j of a row is the low nibble of byte j
  scale:    float8_e4m3fn[N, K/16]
  scale_2:  f32[]
  out:      f32[M, N]

Layout requirements: the TMA copies need 16-byte aligned rows, so K must be a multiple of 256
(``scale`` rows of K/16 bytes), and the swizzled copy of the codes moves whole 8-row tiles, so N
must be a multiple of 8. :func:`prepare_nvfp4_mosaic` pads other weights once (a one-time layout
decision, like any checkpoint conversion; pass ``n=`` the original N to drop the padded rows).
N need not be a multiple of the tile: TMA zero-fills the rows past N.

Interpret mode (``interpret=True``, CPU): Mosaic GPU's interpreter cannot run inline Mosaic code
nor take a register ``wgmma`` operand, so the kernel decodes with the same shift table in
``jnp`` (:func:`decode_tile`), stages the tile in shared memory and runs the same ``wgmma`` and
pipeline; only the register-level decode differs, and the CUDA lowering is checked separately.
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

MAX_ROWS = 32
#: K granularity of the kernel (16-byte aligned scale rows for TMA).
K_ALIGN = 256
#: N granularity of the kernel (the swizzled TMA copy of the codes moves 8-row tiles).
N_ALIGN = 8
#: Logical K columns per ``wgmma`` call (one 128-byte swizzle row of float16).
_CHUNK = 64

# (magnitude shift, sign shift) for the four float16 pairs decoded from one 32-bit word; a
# positive shift is to the left. Pair i holds (lo b0, lo b2), (hi b0, hi b2), (lo b1, lo b3),
# (hi b1, hi b3): the index bits land on 9..11 / 25..27 and the sign bit on 15 / 31.
_PAIR_SHIFTS = ((9, 12), (5, 8), (1, 4), (-3, 0))
_MAG_MASK = 0x0E000E00
_SIGN_MASK = 0x80008000


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGemvConfig:
    """Tile sizes of the Mosaic GPU NVFP4 GEMV.

    Attributes:
      block_n: weight rows per CTA (one warpgroup; a multiple of 64, at most 256).
      block_k: K elements per pipeline step (a multiple of 256, at most 2048).
      stages: pipeline depth, TMA copies in flight per CTA (at least 2: the activation tile
        of the last ``wgmma`` of a step is released one step late).
    """

    block_n: int = 128
    block_k: int = 512
    stages: int = 4

    def __post_init__(self):
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n must be a multiple of 64 in [64, 256], got {self.block_n}")
        if self.block_k % K_ALIGN or not K_ALIGN <= self.block_k <= 2048:
            raise ValueError(
                f"block_k must be a multiple of {K_ALIGN} in [{K_ALIGN}, 2048], got {self.block_k}"
            )
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")


def default_config(m: int, n: int, k: int) -> MosaicGemvConfig:
    """Heuristic tiles: 128 rows per CTA unless N is small, the largest block_k dividing K."""
    del m
    block_n = 128 if n >= 128 * 132 else 64
    block_k = next(bk for bk in (512, 256) if bk <= max(k, K_ALIGN))
    return MosaicGemvConfig(block_n=block_n, block_k=block_k, stages=4)


# ---------------------------------------------------------------------------------------------
# Host-side layout helpers.
# ---------------------------------------------------------------------------------------------


def prepare_nvfp4_mosaic(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pad a weight once to the kernel's layout: N to a multiple of 8, K to one of :data:`K_ALIGN`.

    The padding is zero codes and zero scales, so padded rows and columns decode to zero; call
    :func:`nvfp4_gemv_mosaic` with ``n=`` the original N to drop the padded output rows (x is
    zero-padded to the weight's K on every call, which is cheap). A no-op on aligned weights,
    e.g. every Qwen3.5/3.6 projection and the 248320-row LM head.

    Returns:
      (packed uint8[Np, Kp/2], scale float8_e4m3fn[Np, Kp/16]).
    """
    n, kh = packed.shape
    np_, kp = C.round_up(n, N_ALIGN), C.round_up(kh * 2, K_ALIGN)
    if (np_, kp) == (n, kh * 2):
        return packed, scale
    packed = jnp.pad(packed, ((0, np_ - n), (0, kp // 2 - kh)))
    scale = jnp.pad(scale, ((0, np_ - n), (0, kp // 16 - scale.shape[1])))
    return packed, scale


def _k_permutation() -> np.ndarray:
    """int[32]: logical column L of a 32-element block holds original element ``perm[L]``."""
    i, q, e = np.meshgrid(np.arange(4), np.arange(4), np.arange(2), indexing="ij")
    return (8 * q + i + 4 * e).reshape(-1)


def permute_k(x: jax.Array) -> jax.Array:
    """[..., K] -> [..., K] in the kernel's logical K order (K a multiple of 32)."""
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // 32, 4, 2, 4)  # original element 8q + 4e + i -> [q, e, i]
    nd = blocks.ndim
    return jnp.moveaxis(blocks, (nd - 1, nd - 3, nd - 2), (nd - 3, nd - 2, nd - 1)).reshape(x.shape)


def _shift(w, s: int):
    return (w << s) if s >= 0 else (w >> -s)


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
    pairs = []
    mag_mask, sign_mask = jnp.uint32(_MAG_MASK), jnp.uint32(_SIGN_MASK)
    for mag, sign in _PAIR_SHIFTS:
        pairs.append((_shift(w, mag) & mag_mask) | (_shift(w, sign) & sign_mask))
    h = jax.lax.bitcast_convert_type(jnp.stack(pairs, axis=-1), jnp.float16)  # [R, W, 4i, 2e]
    s = C.from_u8_e4m3(scale_u8, jnp.float16)  # [R, B/8]; word W lies in scale group W // 2
    h = h * jnp.repeat(s, 2, axis=1)[:, :, None, None]
    h = h.reshape(r, b // 16, 4, 4, 2)  # [R, J, q, i, e]
    return h.transpose(0, 1, 3, 2, 4).reshape(r, 2 * b)


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


def _chunk_plan(block_n: int, half_k: int, chunk: int):
    """Which code registers feed which operand registers for logical K chunk ``chunk``.

    The codes (uint8[block_n, half_k], ``WGMMA_LAYOUT_8BIT``) give each thread 4 bytes
    ``16j + 4q + [0, 4)`` of a row per register; the operand (float16[block_n, 64],
    ``WGMMA_LAYOUT``) wants columns ``8t + 2q + [0, 2)`` of the same row per register, so the
    code register at byte block j feeds operand tiles ``t = 4j' + i`` (j' = j within the chunk)
    with pair i of ``_PAIR_SHIFTS``. Both layouts give a thread the same rows (16 * warp +
    lane // 4, + 8) and the same q = lane % 4; the tests check this thread by thread.

    Returns:
      [(code register index, ((operand register index, pair i), ...)), ...].
    """
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    out_slot = {
        rc: idx for idx, rc in _register_origins(fa.WGMMA_LAYOUT, (block_n, _CHUNK)).items()
    }
    col0 = chunk * _CHUNK // 2
    plan = []
    for idx, (r0, k0) in _register_origins(fa.WGMMA_LAYOUT_8BIT, (block_n, half_k)).items():
        if col0 <= k0 < col0 + _CHUNK // 2:
            j = (k0 - col0) // 16
            plan.append((idx, tuple((out_slot[(r0, 32 * j + 8 * i)], i) for i in range(4))))
    return plan


def _decode_chunk_gpu(codes, scale_smem, *, chunk: int, block_n: int):
    """float16[block_n, 64] ``WGMMA_LAYOUT`` operand for logical K chunk ``chunk`` of a step.

    ``codes`` is the step's uint8[block_n, block_k/2] tile in ``WGMMA_LAYOUT_8BIT`` (each
    register: 4 consecutive bytes of one row); ``scale_smem`` the step's uint8[block_n,
    block_k/16] scale tile in shared memory.
    """
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    out_shape = (block_n, _CHUNK)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_8BIT, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct(out_shape, jnp.float16, plgpu.Layout.WGMMA),
    )
    def decode(_, codes, scales):
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
        # (row, col) of each register's first byte for this thread, in register order.
        thread_rc = dict(
            zip(
                np.ndindex(*codes.registers.shape),
                fa.WGMMA_LAYOUT_8BIT.thread_idxs(codes.shape),
                strict=True,
            )
        )
        out_regs = np.full(fa.WGMMA_LAYOUT.registers_shape(out_shape), None, dtype=object)
        for reg_idx, slots in _chunk_plan(block_n, codes.shape[1], chunk):
            w = mgpu_utils.bitcast(codes.registers[reg_idx], i32)
            row, col = thread_rc[reg_idx]
            # The word's block scale, duplicated into both bytes of a b16 and widened to f16x2.
            sb = memref.load(scales, [row, arith.divui(col, c(8, index))])
            sb = arith.muli(arith.extui(i16, sb), c(0x0101, i16))
            s2 = mgpu_utils.bitcast(
                mgpu_utils.inline_ptx("cvt.rn.f16x2.e4m3x2 $0, $1;", sb, result_types=i32), f16x2
            )
            for out_idx, i in slots:
                mag, sign = _PAIR_SHIFTS[i]
                mag_v = arith.shli(w, c(mag, i32)) if mag > 0 else arith.shrui(w, c(-mag, i32))
                sign_v = arith.shli(w, c(sign, i32)) if sign else w
                bits = arith.ori(
                    arith.andi(mag_v, c(_MAG_MASK, i32)), arith.andi(sign_v, c(_SIGN_MASK, i32))
                )
                out_regs[out_idx] = arith.mulf(mgpu_utils.bitcast(bits, f16x2), s2)
        if any(v is None for v in out_regs.flat):
            raise AssertionError("decode plan left operand registers unset")
        return fa.FragmentedArray(_registers=out_regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return decode(codes, scale_smem)


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------


def _swizzled(bits: int) -> tuple:
    return (plgpu.TilingTransform((8, 1024 // bits)), plgpu.SwizzleTransform(128))


def _build_kernel(m_pad: int, n: int, k: int, cfg: MosaicGemvConfig, interpret: bool):
    bn, bk, kh = cfg.block_n, cfg.block_k, k // 2
    n_blocks = C.cdiv(n, bn)
    k_steps = C.cdiv(k, bk)
    chunks = bk // _CHUNK

    def body(x_gmem, packed_gmem, scale_gmem, out_gmem):
        ni = jax.lax.axis_index("n")

        def step_gpu(acc_ref, p_smem, s_smem, x_smem):
            codes = plgpu.load(p_smem, layout=plgpu.Layout.WGMMA_8BIT)
            for c in range(chunks):
                a = _decode_chunk_gpu(codes, s_smem, chunk=c, block_n=bn)
                plgpu.wgmma(acc_ref, a, x_smem.at[:, pl.ds(c * _CHUNK, _CHUNK)].T)
                plgpu.wgmma_wait(1)

        def step_interpret(acc_ref, p_smem, s_smem, x_smem, a_smem):
            a_smem[...] = decode_tile(p_smem[...], s_smem[...])
            for c in range(chunks):
                cols = pl.ds(c * _CHUNK, _CHUNK)
                plgpu.wgmma(acc_ref, a_smem.at[:, cols], x_smem.at[:, cols].T)
                plgpu.wgmma_wait(0)

        def run(acc_ref, *scratch):
            def pipeline_body(_, p_smem, s_smem, x_smem):
                if interpret:
                    step_interpret(acc_ref, p_smem, s_smem, x_smem, *scratch)
                else:
                    step_gpu(acc_ref, p_smem, s_smem, x_smem)

            plgpu.emit_pipeline(
                pipeline_body,
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec(
                        (bn, bk // 2), lambda ki: (ni, ki), transforms=_swizzled(8), delay_release=1
                    ),
                    plgpu.BlockSpec((bn, bk // 16), lambda ki: (ni, ki), delay_release=1),
                    plgpu.BlockSpec(
                        (m_pad, bk), lambda ki: (0, ki), transforms=_swizzled(16), delay_release=1
                    ),
                ],
                max_concurrent_steps=cfg.stages,
            )(packed_gmem, scale_gmem, x_gmem)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        def with_scratch(*scratch):
            acc = pl.run_scoped(lambda acc_ref: run(acc_ref, *scratch), plgpu.ACC((bn, m_pad)))
            out_gmem.at[pl.ds(ni * bn, bn)][...] = acc

        if interpret:  # the interpreter's wgmma takes its left operand from shared memory only
            pl.run_scoped(with_scratch, plgpu.SMEM((bn, bk), jnp.float16, transforms=_swizzled(16)))
        else:
            with_scratch()

    del kh
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_blocks * bn, m_pad), jnp.float32),
        grid=(n_blocks,),
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


# ---------------------------------------------------------------------------------------------
# Public kernel.
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("n", "config", "interpret"))
def nvfp4_gemv_mosaic(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    scale_2: jax.Array,
    *,
    n: int | None = None,
    config: MosaicGemvConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """NVFP4 W4A16 GEMV on Hopper tensor cores; same contract as ``gemv.nvfp4_gemv``.

    Args:
      x: bf16[M, K] activations, 1 <= M <= 32, K a multiple of 16.
      packed: uint8[Nw, Kw/2], Nw a multiple of 8 and Kw of 256 with K <= Kw < K + 256 (see
        :func:`prepare_nvfp4_mosaic`); columns past K must decode to zero (they do after it).
      scale: float8_e4m3fn[Nw, Kw/16].
      scale_2: f32[] global scale.
      n: output rows to keep (the weight's N before ``prepare`` padded it); default Nw.
      config: tile sizes (:func:`default_config` when None).
      interpret: run Mosaic GPU's CPU interpreter (slow; tests only).

    Returns:
      f32[M, n].
    """
    nw, kh = packed.shape
    kw = kh * 2
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {x.shape}")
    m, k = x.shape
    if kw % K_ALIGN or nw % N_ALIGN:
        raise ValueError(
            f"packed must be [N, K/2] with N % {N_ALIGN} == 0 and K % {K_ALIGN} == 0, got "
            f"N={nw}, K={kw}; pad the weight once with prepare_nvfp4_mosaic"
        )
    if k % 16 or not k <= kw < k + K_ALIGN:
        raise ValueError(f"x K={k} must be a multiple of 16 and match the weight's K={kw}")
    if scale.shape != (nw, kw // 16):
        raise ValueError(f"scale must be [{nw}, {kw // 16}], got {scale.shape}")
    n = nw if n is None else n
    if not nw - N_ALIGN < n <= nw:
        raise ValueError(f"n={n} must be in ({nw - N_ALIGN}, {nw}] for a weight of {nw} rows")
    cfg = config or default_config(m, nw, kw)
    m_pad = C.round_up(m, 8)
    x16, xinv = C.to_f16_rowscaled(x, m_pad)  # float16[m_pad, K], f32[M]
    x16 = permute_k(jnp.pad(x16, ((0, 0), (0, kw - k))))
    kernel = _build_kernel(m_pad, nw, kw, cfg, interpret)
    out_t = kernel(x16, packed, C.as_u8(scale))  # f32[cdiv(Nw, block_n) * block_n, m_pad]
    gscale = jnp.asarray(scale_2, jnp.float32) * C.E2M1_F16_UNBIAS
    return (out_t[:n, :m] * (xinv * gscale)[None, :]).T
