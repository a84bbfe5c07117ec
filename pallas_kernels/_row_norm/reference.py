"""Pure-jnp row norms: the XLA path of ``rms_norm`` / ``l2_normalize`` and their test oracle.

The same operations in the same order as ``mtpjax.layers.norms.rms_norm`` and
``mtpjax.hybrid``'s ``l2_normalize``, in F32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_norm_reference(
    x: jax.Array, weight: jax.Array | None, *, eps: float, mean: bool, zero_centered: bool
) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps)`` (``mean``) or ``x * rsqrt(sum(x^2) + eps)`` over the last
    axis, times ``1 + weight`` (``zero_centered``) or ``weight`` when given. f32[..., N]."""
    x = x.astype(jnp.float32)
    ss = jnp.mean(x * x, axis=-1, keepdims=True) if mean else jnp.sum(x * x, -1, keepdims=True)
    y = x * jax.lax.rsqrt(ss + eps)
    if weight is None:
        return y
    w = weight.astype(jnp.float32)
    return y * (1.0 + w) if zero_centered else y * w
