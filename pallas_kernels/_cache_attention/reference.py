"""Pure-jnp attention of query rows over a contiguous KV cache: the XLA path of
``cache_attention`` and its test oracle.

Masked GQA softmax attention in F32 at HIGHEST precision, with the operations of
``mtpjax.layers.attention.attend`` (row ``(b, s)`` sees cache rows ``< lengths[b, s]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_operands(q, k_cache, v_cache, lengths, layer=None) -> None:
    """One clear ValueError for operands no path can take."""
    rank = 4 if layer is None else 5
    if q.ndim != 4 or k_cache.ndim != rank or k_cache.shape != v_cache.shape:
        caches = "[B, L, Nkv, D]" if layer is None else "[layers, B, L, Nkv, D] (with a layer)"
        raise ValueError(
            f"q must be [B, S, Nq, D] and the caches {caches} alike, got q "
            f"{list(q.shape)}, k_cache {list(k_cache.shape)}, v_cache {list(v_cache.shape)}"
        )
    B, S, n_q, d = q.shape
    b2, _, n_kv, d2 = k_cache.shape[-4:]
    if b2 != B or d2 != d or n_q % n_kv:
        raise ValueError(
            f"q {list(q.shape)} does not match the caches {list(k_cache.shape)} (same B and D, "
            "Nq a multiple of Nkv)"
        )
    if lengths.shape != (B, S):
        raise ValueError(f"lengths must be int32[B, S] = {[B, S]}, got {list(lengths.shape)}")


def cache_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    layer: jax.Array | None = None,
) -> jax.Array:
    """q [B, S, Nq, D] over caches [B, L, Nkv, D] (entry ``layer`` of [layers, B, L, Nkv, D]
    stacks), row (b, s) attending to rows < lengths[b, s] -> f32[B, S, Nq, D]; a row with nothing
    to attend gives zeros."""
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    B, S, n_q, d = q.shape
    n_kv = k_cache.shape[2]
    mask = jnp.arange(k_cache.shape[1])[None, None, :] < lengths[:, :, None]  # [B, S, L]
    qg = q.astype(jnp.float32).reshape(B, S, n_kv, n_q // n_kv, d)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_cache.astype(jnp.float32), precision=hi)
    scores = jnp.where(mask[:, None, None], scores * scale, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v_cache.astype(jnp.float32), precision=hi)
    return out.reshape(B, S, n_q, d)
