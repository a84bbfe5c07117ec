"""Pure-jnp ``linear``: the XLA path (the CPU fallback) and the oracle of the Pallas backends.

It never rounds the weight: E2M1 * E4M3 products and E4M3 codes are exact in BF16, so the weight
is expanded in the activation's compute dtype (BF16 for BF16 activations, F32 otherwise), the dot
accumulates in F32 at HIGHEST precision, and the F32 global / row scale is applied once to the
F32 result. Block-128 FP8 applies each tile's factor to that tile's partial dot, as a kernel
streaming K-tiles does.

Shape glossary:
  ...  leading dims of x (batch, sequence...)
  K    input features; N output features
  KB   ceil(K / 128) K-tiles of a block-128 weight
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._linear.base import (
    FP8_BLOCK,
    NVFP4_BLOCK,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Nvfp4Weight,
    StackedWeight,
    Weight,
    decode_e2m1,
    unpack_e2m1,
)


def _dot_nk(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x: [..., K]`` . ``w: [N, K]`` -> ``f32[..., N]`` with F32 accumulation."""
    return jax.lax.dot_general(
        x,
        w,
        (((x.ndim - 1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


@jax.jit
def reference_f32(x: jax.Array, w: Weight | StackedWeight) -> jax.Array:
    if isinstance(w, StackedWeight):
        w = w.entry()
    # BF16 activations meet a BF16 weight; any other activation dtype computes in F32.
    cdt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    x = x.astype(cdt)
    if isinstance(w, Bf16Weight):
        return _dot_nk(x, w.w.astype(cdt))
    if isinstance(w, Fp8RowWeight):
        return _dot_nk(x, w.q.astype(cdt)) * w.scale
    if isinstance(w, Nvfp4Weight):
        scale = jnp.repeat(w.scale.astype(cdt), NVFP4_BLOCK, axis=-1)  # [N, K]
        w_c = decode_e2m1(unpack_e2m1(w.packed), cdt) * scale  # exact: 2 x 4 significant bits
        return _dot_nk(x, w_c) * w.scale_2
    if isinstance(w, Fp8BlockWeight):
        n, k = w.shape
        kb = w.scale_inv.shape[-1]
        pad = kb * FP8_BLOCK - k
        x_t = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        x_t = x_t.reshape(*x.shape[:-1], kb, FP8_BLOCK)  # [..., KB, 128]
        q_t = jnp.pad(w.q.astype(cdt), [(0, 0), (0, pad)]).reshape(n, kb, FP8_BLOCK)
        partial = jnp.einsum(
            "...tk,ntk->...nt",
            x_t,
            q_t,
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )  # [..., N, KB]
        scale = jnp.repeat(w.scale_inv, FP8_BLOCK, axis=0)[:n]  # [N, KB]
        return jnp.sum(partial * scale, axis=-1)
    raise AssertionError(type(w))  # check_inputs admits only the four weight types


def check_inputs(x: jax.Array, w: Weight | StackedWeight) -> None:
    if not isinstance(w, Weight | StackedWeight):
        raise TypeError(f"linear expects a weight pytree, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(
            f"linear takes one [N, K] weight, got a stacked {w.format.value} weight of shape "
            f"{w.shape}; vmap over the leading axes, or pass one layer as a StackedWeight"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"linear expects floating-point activations, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != w.in_features:
        raise ValueError(
            f"linear: x of shape {tuple(x.shape)} does not match the {w.format.value} weight of "
            f"shape {w.shape}; x's last dim must be K = {w.in_features}"
        )


def linear_reference(
    x: jax.Array, w: Weight | StackedWeight, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """XLA reference: ``x: [..., K]``, ``w: [N, K]`` -> ``[..., N]`` in out_dtype (default x's)."""
    x = jnp.asarray(x)
    check_inputs(x, w)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return reference_f32(x, w).astype(out_dtype)
