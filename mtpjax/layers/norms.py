"""RMSNorm in the two conventions MTP checkpoints use, computed in F32.

Zero-centred (Qwen3-Next / Qwen3.5): `y = x / rms(x) * (1 + w)`, so a zero weight is the
identity. Plain (DeepSeek, GLM, MiMo): `y = x / rms(x) * w`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, zero_centered: bool) -> jax.Array:
    """Normalises over the last axis. x: [..., H], weight: [H] -> f32[..., H]."""
    x = x.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * (1.0 + w) if zero_centered else y * w
