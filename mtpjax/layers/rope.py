"""NeoX-style (rotate-halves) rotary embedding on the first `rotary_dim` dims of each head.

Shapes: `[..., T]` positions, `[..., T, N, D]` per-head vectors with head dim D >= rotary_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(
    positions: jax.Array, *, rotary_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[..., T, rotary_dim // 2] for integer positions [..., T]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, positions: jax.Array, *, rotary_dim: int, theta: float) -> jax.Array:
    """Rotates x: [..., T, N, D] at positions [..., T]; dims past `rotary_dim` pass through. F32."""
    x = x.astype(jnp.float32)
    cos, sin = rope_cos_sin(positions, rotary_dim=rotary_dim, theta=theta)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
