"""RMSNorm in the two conventions MTP checkpoints use, computed in F32.

Zero-centred (Qwen3-Next / Qwen3.5): `y = x / rms(x) * (1 + w)`, so a zero weight is the
identity. Plain (DeepSeek, GLM, MiMo): `y = x / rms(x) * w`.

``implementation`` is XLA by default: plain jnp that XLA fuses with its neighbours (the
drafter's steps, training). The target models' steps pass theirs (AUTO), which on a GPU takes
``pallas_kernels.rms_norm``'s kernel: a row's result then does not depend on how many rows share
the call, which greedy speculation's exactness against one-row decoding needs.
"""

from __future__ import annotations

import jax

import pallas_kernels as pk
from pallas_kernels import Implementation


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    zero_centered: bool,
    implementation: Implementation | str = Implementation.XLA,
) -> jax.Array:
    """Normalises over the last axis. x: [..., H], weight: [H] -> f32[..., H]."""
    return pk.rms_norm(
        x, weight, eps=eps, zero_centered=zero_centered, implementation=implementation
    )
