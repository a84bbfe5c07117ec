"""NeoX-style (rotate-halves) rotary embedding on the first `rotary_dim` dims of each head, with
optional YaRN frequency scaling and DeepSeek's interleaved-pair layout.

Shapes: `[..., T]` positions, `[..., T, N, D]` per-head vectors with head dim D >= rotary_dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import YarnScaling


def yarn_inv_freq(*, rotary_dim: int, theta: float, scaling: YarnScaling) -> np.ndarray:
    """f32[rotary_dim // 2] YaRN inverse frequencies (transformers' ``_compute_yarn_parameters``):
    extrapolated (``theta^-2i/R``) above the correction range, interpolated (``/ factor``) below
    it, a linear ramp between; computed in F32 as the reference does."""
    R, base = rotary_dim, theta

    def correction_dim(rotations: float) -> float:
        return (
            R * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    pos_freqs = np.float32(base) ** (np.arange(0, R, 2, dtype=np.float32) / np.float32(R))
    ramp = np.clip((np.arange(R // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def rope_cos_sin(
    positions: jax.Array, *, rotary_dim: int, theta: float, scaling: YarnScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[..., T, rotary_dim // 2] for integer positions [..., T] (YaRN: scaled
    frequencies, and cos / sin times ``scaling.cos_sin_scale``)."""
    if scaling is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    else:
        inv_freq = jnp.asarray(yarn_inv_freq(rotary_dim=rotary_dim, theta=theta, scaling=scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling is not None:
        cos, sin = cos * scaling.cos_sin_scale, sin * scaling.cos_sin_scale
    return cos, sin


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    rotary_dim: int,
    theta: float,
    scaling: YarnScaling | None = None,
    interleaved: bool = False,
) -> jax.Array:
    """Rotates x: [..., T, N, D] at positions [..., T]; dims past `rotary_dim` pass through. F32.

    ``interleaved``: the rotary dims hold pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek), each
    rotated by one frequency; the result is laid out in halves (``[real parts, imaginary
    parts]``), as transformers' ``apply_rotary_pos_emb_interleave`` returns it. Queries and keys
    get the same permutation, so their dot products are those of the pairs.
    """
    x = x.astype(jnp.float32)
    if interleaved:
        rot = x[..., :rotary_dim]
        x = jnp.concatenate([rot[..., 0::2], rot[..., 1::2], x[..., rotary_dim:]], axis=-1)
    cos, sin = rope_cos_sin(positions, rotary_dim=rotary_dim, theta=theta, scaling=scaling)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
