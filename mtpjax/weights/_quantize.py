"""Quantise dense weights into the storage formats, dequantise them back, pack E2M1 nibbles.

Everything here is pure ``jnp`` and jit-compatible (the format is static); the leading stacked
axes of ``[..., N, K]`` inputs (MoE experts) are carried through, one set of scales per matrix.

Shape glossary:
  N, K   output / input features of one matrix
  ...    leading stacked axes
  NB, KB ceil(N / 128), ceil(K / 128)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import (
    E2M1_MAX,
    E4M3_MAX,
    FP8_BLOCK,
    NVFP4_BLOCK,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Nvfp4Weight,
    Weight,
    WeightFormat,
    decode_e2m1,
    unpack_e2m1,
)

__all__ = [
    "dequantize",
    "encode_e2m1",
    "pack_e2m1",
    "quantize",
]

# Rounding thresholds between consecutive E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, and whether a
# value exactly on the threshold rounds up. Ties go to the even code (IEEE round-half-to-even),
# which is also what ModelOpt's `_cast_fp4` and a float4_e2m1fn cast produce.
_E2M1_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


@jax.jit
def encode_e2m1(x: jax.Array) -> jax.Array:
    """Rounds F32 values to the nearest E2M1 code (ties to even, saturating at ±6). -> uint8[...].

    The sign bit is set for negative inputs (so a small negative value becomes code 8, -0).
    """
    mag = jnp.abs(x)
    idx = jnp.zeros(x.shape, jnp.uint8)
    for threshold, tie_up in _E2M1_THRESHOLDS:
        passed = mag >= threshold if tie_up else mag > threshold
        idx = idx + passed.astype(jnp.uint8)
    sign = (x < 0).astype(jnp.uint8) << 3
    return sign | idx


def pack_e2m1(codes: jax.Array) -> jax.Array:
    """Packs codes ``uint8[..., K]`` (each < 16) into ``uint8[..., K/2]``; 2j -> low nibble of j."""
    if codes.dtype != jnp.uint8:
        raise TypeError(f"pack_e2m1 expects uint8 codes, got {codes.dtype}")
    if codes.ndim < 1 or codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dim, got codes of shape {codes.shape}")
    return _pack(codes)


@jax.jit
def _pack(codes: jax.Array) -> jax.Array:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _as_f32_matrix(w: jax.Array) -> jax.Array:
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"quantize expects a weight of shape [..., N, K], got shape {w.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"quantize expects a floating-point weight (f32/bf16), got {w.dtype}")
    return w.astype(jnp.float32)


def _ieee_div(num: jax.Array, den: jax.Array | float) -> jax.Array:
    """``num / den`` rounded as one IEEE division (``den`` broadcasts to ``num``).

    XLA's algebraic simplifier rewrites division by a constant or a broadcast into multiplication
    by the reciprocal, which is an ulp off for about half the inputs and would break bit-exact
    agreement with ModelOpt / DeepSeek quantisers. Selecting the divisor through a predicate on
    the numerator leaves nothing to hoist; it fuses into the same loop and changes no value.
    """
    den = jnp.broadcast_to(jnp.asarray(den, num.dtype), num.shape)
    return num / jnp.where(jnp.isnan(num), jnp.ones_like(den), den)


def _safe_scale(scale: jax.Array) -> jax.Array:
    # All-zero rows/tiles (amax 0) get scale 1 so the codes are 0 and nothing divides by zero.
    return jnp.where(scale > 0, scale, jnp.float32(1.0))


def _to_e4m3(x: jax.Array) -> jax.Array:
    # float8_e4m3fn has no infinity: anything rounding past 448 would become NaN, so clamp first.
    # The clamp only touches values that f32 rounding nudged a hair above the range.
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


@jax.jit
def _quantize_fp8_row(w: jax.Array) -> Fp8RowWeight:
    amax = jnp.max(jnp.abs(w), axis=-1)  # [..., N]
    scale = _safe_scale(_ieee_div(amax, E4M3_MAX))
    return Fp8RowWeight(q=_to_e4m3(_ieee_div(w, scale[..., None])), scale=scale)


@jax.jit
def _quantize_fp8_block(w: jax.Array) -> Fp8BlockWeight:
    *lead, n, k = w.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    # Zero padding never raises a tile's amax, so ragged edge tiles see only their real values.
    pad = [(0, 0)] * len(lead) + [(0, nb * FP8_BLOCK - n), (0, kb * FP8_BLOCK - k)]
    tiles = jnp.pad(w, pad).reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))  # [..., NB, KB]
    scale = _safe_scale(_ieee_div(amax, E4M3_MAX))
    q = _to_e4m3(_ieee_div(tiles, scale[..., :, None, :, None]))
    q = q.reshape(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k]
    return Fp8BlockWeight(q=q, scale_inv=scale)


@jax.jit
def _quantize_nvfp4(w: jax.Array) -> Nvfp4Weight:
    *lead, n, k = w.shape
    if k % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 needs K (the last dim) to be a multiple of {NVFP4_BLOCK}, got K = {k} "
            f"for a weight of shape {w.shape}"
        )
    blocks = w.reshape(*lead, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    # ModelOpt: the global scale maps the tensor's amax to 6 * 448, so the largest block scale
    # lands on E4M3's maximum and every block scale stays inside its range.
    amax = jnp.max(jnp.abs(w), axis=(-2, -1))  # [...]
    scale_2 = _safe_scale(_ieee_div(amax, E2M1_MAX * E4M3_MAX))
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)  # [..., N, K/16]
    block_scale = _ieee_div(block_amax, E2M1_MAX * scale_2[..., None, None])
    block_scale = jnp.where(block_scale == 0, jnp.float32(1.0), block_scale)
    scale = _to_e4m3(block_scale)
    eff = scale.astype(jnp.float32) * scale_2[..., None, None]  # [..., N, K/16]
    # A block far below the tensor's amax can round its scale to E4M3 zero; its values are below
    # the format's resolution, so it is stored as zero codes instead of dividing by zero.
    live = eff > 0
    scaled = jnp.where(
        live[..., None], _ieee_div(blocks, jnp.where(live, eff, jnp.float32(1.0))[..., None]), 0.0
    )
    codes = encode_e2m1(scaled).reshape(*lead, n, k)
    return Nvfp4Weight(packed=pack_e2m1(codes), scale=scale, scale_2=scale_2)


def quantize(w: jax.Array, fmt: str | WeightFormat) -> Weight:
    """Quantises ``w: f32|bf16[..., N, K]`` into ``fmt`` ("bf16", "fp8", "fp8_block", "nvfp4").

    - bf16: round to nearest even.
    - fp8 (per row): ``scale = amax_row / 448``; codes ``e4m3(w / scale)``.
    - fp8_block: the same per 128x128 tile (ragged edge tiles allowed), stored as ``scale_inv``.
    - nvfp4 (NVIDIA ModelOpt): ``scale_2 = amax / (6 * 448)`` per matrix; per 16-element block
      ``scale = e4m3(amax_block / (6 * scale_2))``; codes round ``w / (scale * scale_2)`` to the
      nearest E2M1 value, ties to even. K must be a multiple of 16.

    All-zero rows, tiles, blocks and tensors get scale 1 and zero codes (never NaN/inf). Jit with
    ``fmt`` static.
    """
    fmt = WeightFormat.parse(fmt)
    w = _as_f32_matrix(w)
    if fmt is WeightFormat.BF16:
        return Bf16Weight(w=w.astype(jnp.bfloat16))
    if fmt is WeightFormat.FP8:
        return _quantize_fp8_row(w)
    if fmt is WeightFormat.FP8_BLOCK:
        return _quantize_fp8_block(w)
    return _quantize_nvfp4(w)


def dequantize(qw: Weight) -> jax.Array:
    """Dequantises a weight to ``f32[..., N, K]`` exactly per its format's definition."""
    if not isinstance(qw, Weight):
        raise TypeError(f"dequantize expects a weight pytree, got {type(qw).__name__}")
    return _dequantize(qw)


@jax.jit
def _dequantize(qw: Weight) -> jax.Array:
    if isinstance(qw, Bf16Weight):
        return qw.w.astype(jnp.float32)
    if isinstance(qw, Fp8RowWeight):
        return qw.q.astype(jnp.float32) * qw.scale[..., None]
    if isinstance(qw, Fp8BlockWeight):
        n, k = qw.shape[-2:]
        scale = jnp.repeat(jnp.repeat(qw.scale_inv, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
        scale = scale[..., :n, :k]  # ragged edge tiles: drop the padding
        return qw.q.astype(jnp.float32) * scale
    if isinstance(qw, Nvfp4Weight):
        values = decode_e2m1(unpack_e2m1(qw.packed))  # [..., N, K]
        scale = jnp.repeat(qw.scale.astype(jnp.float32), NVFP4_BLOCK, axis=-1)
        return values * scale * qw.scale_2[..., None, None]
    raise AssertionError(type(qw))
