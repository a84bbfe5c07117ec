"""Shared helpers for the Pallas (Triton-lowered) GPU kernels.

Shape glossary used across the kernel modules:
  M  rows of activations (decode batch, verify rows)
  N  output features (vocab rows for the LM head)
  K  input features (hidden size)
  G  K // 16, NVFP4 scale groups

Number formats:
  E2M1 nibble: bit 3 sign, bits 0..2 index the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; element 2j of
  a row is the low nibble of byte j. The kernels decode a nibble straight into float16 bits,
  ``sign << 15 | index << 9``, which is exactly ``e2m1 * 2**-14`` (index 1 lands on the float16
  subnormal 2**-15). Multiplying by the E4M3 block scale in float16 stays exact (every product is a
  multiple of 2**-24 below 0.17), so the F32 global scale times ``2**14`` is applied once at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.implementation import Implementation

#: ``e2m1 * E2M1_F16_BIAS`` is the float16 value the nibble decoder produces.
E2M1_F16_BIAS = 2.0**-14
#: Fold this into the output scale to undo :data:`E2M1_F16_BIAS`.
E2M1_F16_UNBIAS = 2.0**14


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(a: int) -> int:
    return 1 << max(0, (int(a) - 1).bit_length())


def is_pow2(a: int) -> bool:
    return a > 0 and (a & (a - 1)) == 0


def default_device():
    """The device ops dispatch for: the first of JAX's default backend."""
    return jax.devices()[0]


def runs_triton_kernel(implementation, reason: str | None, *, op: str) -> bool:
    """Whether an op whose one Pallas backend is a Triton kernel runs it: AUTO on a GPU when the
    kernel takes the operands (``reason`` None: else why not), PALLAS or TRITON always
    (interpret mode off a GPU; NotImplementedError naming ``reason`` when it cannot), XLA never;
    MOSAIC_GPU is refused."""
    impl = Implementation.parse(implementation)
    if impl is Implementation.MOSAIC_GPU:
        raise NotImplementedError(f"{op} has no Mosaic GPU backend; use triton")
    if impl in (Implementation.PALLAS, Implementation.TRITON):
        if reason is not None:
            raise NotImplementedError(f"no Pallas {op} for these operands: {reason}")
        return True
    return impl is Implementation.AUTO and reason is None and default_device().platform == "gpu"


def in_row_chunks(kernel, x: jax.Array, chunk: int, n: int) -> jax.Array:
    """``kernel`` over ``x: [M, K]`` in chunks of at most ``chunk`` rows -> ``[M, n]``.

    One kernel in a loop over the chunks (zero rows pad the last), not one call per chunk
    unrolled into the program: a prefill-sized M stays one kernel to compile.
    """
    m = x.shape[0]
    if m <= chunk:
        return kernel(x)
    chunks = jnp.pad(x, ((0, -m % chunk), (0, 0))).reshape(-1, chunk, x.shape[1])
    return jax.lax.map(kernel, chunks).reshape(-1, n)[:m]


# ---------------------------------------------------------------------------------------------
# In-kernel E2M1 decoding.
# ---------------------------------------------------------------------------------------------

# Four packed bytes in one 32-bit register ($3), their four float16 scales in two registers ($4 =
# scales of bytes 0,1; $5 = bytes 2,3); outputs $0,$1 = one nibble of bytes 0..3 as f16x2. prmt
# spreads bytes 0,1 (2,3) into bits 8..15 and 24..31, so a high nibble sits at bits 12..15 with
# its sign on bit 15/31 already and ``>> 3`` moves its 3-bit index to bits 9..11; a low nibble is
# first shifted up by 4 into the same place. (Two single-output snippets: the Pallas lowering of
# a multi-output inline asm is broken in jax 0.11.2.)
_E2M1_ASM_HEAD = """
{
.reg .b32 z, t0, t1, a, b;
mov.b32 z, 0;
prmt.b32 t0, $2, z, 0x1404;
prmt.b32 t1, $2, z, 0x3424;
"""
_E2M1_ASM_PAIR = """
shr.b32 a, {t}, 3;
and.b32 a, a, 0x0E000E00;
and.b32 b, {t}, 0x80008000;
or.b32 a, a, b;
mul.rn.f16x2 {out}, a, {scale};
"""


def _e2m1_asm(high: bool) -> str:
    body = _E2M1_ASM_HEAD
    if not high:
        body += "shl.b32 t0, t0, 4;\nshl.b32 t1, t1, 4;\n"
    body += _E2M1_ASM_PAIR.format(t="t0", out="$0", scale="$3")
    body += _E2M1_ASM_PAIR.format(t="t1", out="$1", scale="$4")
    return body + "}\n"


def decode_e2m1_scaled(
    codes: jax.Array, scale_f16: jax.Array, *, use_asm: bool
) -> tuple[jax.Array, jax.Array]:
    """Decode packed E2M1 bytes times their block scale, in float16.

    Args:
      codes: uint8[...] packed bytes (any shape; with ``use_asm`` each thread must hold a
        multiple of 4 consecutive bytes along the last axis, which contiguous loads give).
      scale_f16: float16[...] same shape, the E4M3 block scale of each byte.
      use_asm: decode with inline PTX (GPU only) instead of integer ``jnp`` ops.

    Returns:
      (lo, hi): float16[...] ``e2m1(nibble) * scale * 2**-14`` for the low and high nibbles.
    """
    if use_asm:
        out = []
        for high in (False, True):
            (v,) = plgpu.elementwise_inline_asm(
                _e2m1_asm(high),
                args=[codes, scale_f16],
                constraints="=r,=r,r,r,r",
                pack=4,
                result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.float16)],
            )
            out.append(v)
        return out[0], out[1]
    c = codes.astype(jnp.uint16)
    lo_bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    hi_bits = ((c & 0x80) << 8) | ((c & 0x70) << 5)
    lo = jax.lax.bitcast_convert_type(lo_bits, jnp.float16) * scale_f16
    hi = jax.lax.bitcast_convert_type(hi_bits, jnp.float16) * scale_f16
    return lo, hi


def as_u8(a: jax.Array) -> jax.Array:
    """View a float8 array as uint8 (free); other dtypes pass through.

    Triton cannot build the zero fill of a masked float8 load, so float8 data travels as bytes
    and is bitcast back inside the kernel (:func:`from_u8_e4m3`).
    """
    if a.dtype == jnp.float8_e4m3fn:
        return jax.lax.bitcast_convert_type(a, jnp.uint8)
    return a


def from_u8_e4m3(a: jax.Array, dtype) -> jax.Array:
    """In-kernel: uint8 bytes holding E4M3 -> ``dtype`` (exact for f16/bf16/f32)."""
    return jax.lax.bitcast_convert_type(a, jnp.float8_e4m3fn).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Activation preparation.
# ---------------------------------------------------------------------------------------------


def to_f16_rowscaled(x: jax.Array, m_pad: int) -> tuple[jax.Array, jax.Array]:
    """Scale each row of ``x`` by a power of two so it fits float16, pad rows to ``m_pad``.

    The largest magnitude of each row lands in [2**14, 2**15), so every bf16 value in the
    float16 normal range converts exactly; values below ``2**-28 * rowmax`` lose bits, which
    is far below the F32 accumulation error of a K-long dot product.

    Returns:
      x16: float16[m_pad, K]; inv: f32[M], the factor that undoes the scaling.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1)
    _, ex = jnp.frexp(jnp.where(jnp.isfinite(amax) & (amax > 0), amax, 1.0))
    shift = jnp.clip(15 - ex, -120, 120)
    # ldexp builds the exact power of two (XLA:CPU's exp2(-13.0) is off by ~5e-7 relative).
    one = jnp.ones_like(amax)
    x16 = (xf * jnp.ldexp(one, shift)[:, None]).astype(jnp.float16)
    x16 = jnp.pad(x16, ((0, m_pad - x.shape[0]), (0, 0)))
    return x16, jnp.ldexp(one, -shift)


def split_k_loop(load, compute_step, acc0, *, split_index, iters_per_split, total_iters, prefetch):
    """The K loop of a split-K program: this program's K-tiles, optionally loading tile i+1
    while tile i is computed (register prefetch). Returns the final accumulator.

    load(i) -> raw tile; compute_step(raw, acc) -> acc.
    """
    if iters_per_split >= total_iters:
        lo_it, hi_it = 0, total_iters
    else:
        lo_it = split_index * iters_per_split
        hi_it = jnp.minimum(lo_it + iters_per_split, total_iters)
    if prefetch:

        def body(i, carry):
            acc, raw = carry
            nxt = load(jnp.minimum(i + 1, hi_it - 1))
            return compute_step(raw, acc), nxt

        acc, _ = jax.lax.fori_loop(lo_it, hi_it, body, (acc0, load(lo_it)))
        return acc
    return jax.lax.fori_loop(lo_it, hi_it, lambda i, a: compute_step(load(i), a), acc0)
