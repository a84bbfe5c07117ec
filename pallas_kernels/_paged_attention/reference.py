"""Pure-jnp paged decode attention: the XLA path of ``paged_attention`` and its test oracle.

It gathers each sequence's pages through the block table, dequantises them in F32 and runs masked
GQA softmax attention in F32 at HIGHEST precision, with the same operations in the same order as
``mtpjax.layers.attention.attend`` on the gathered context (so the two agree bit for bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def check_operands(
    q, k_pool, v_pool, block_table, seq_len, k_scale, v_scale, value_dim=None
) -> None:
    """One clear ValueError for operands no path can take."""
    bsz, n_q, d = q.shape
    n_kv, dk = k_pool.shape[-2:]
    if v_pool is None:
        if not isinstance(value_dim, int) or not 0 < value_dim < dk or v_scale is not None:
            raise ValueError(
                f"latent rows (v_pool=None) need an int value_dim in (0, {dk}) and no v_scale; "
                f"got value_dim={value_dim!r}, v_scale {'set' if v_scale is not None else 'None'}"
            )
        if k_pool.ndim != 4 or dk != d:
            raise ValueError(f"pool shape {k_pool.shape} does not match q {q.shape}")
    elif value_dim is not None:
        raise ValueError(f"value_dim={value_dim} is for latent rows (v_pool=None) only")
    elif k_pool.ndim != 4 or k_pool.shape != v_pool.shape or dk != d:
        raise ValueError(f"pool shapes {k_pool.shape} / {v_pool.shape} do not match q {q.shape}")
    if n_q % n_kv:
        raise ValueError(f"n_q={n_q} must be a multiple of n_kv={n_kv}")
    if block_table.ndim != 2 or block_table.shape[0] != bsz or seq_len.shape != (bsz,):
        raise ValueError(
            f"block_table must be [B, max_blocks] and seq_len [B] for B = {bsz}, got "
            f"{list(block_table.shape)} and {list(seq_len.shape)}"
        )
    fp8 = k_pool.dtype == jnp.float8_e4m3fn
    scales_match = (k_scale is None) == (v_scale is None) or v_pool is None
    if fp8 != (k_scale is not None) or not scales_match:
        raise ValueError("FP8 pools need k_scale and v_scale; BF16 pools take neither")


def _rows_f32(pool: jax.Array, scale: jax.Array | None, bt: jax.Array) -> jax.Array:
    """Pages of ``bt: [B, max_blocks]`` -> f32[B, max_blocks * block_size, n_kv, D] (dequantised)."""
    nb, bs, n_kv, d = pool.shape
    rows = pool[bt].astype(jnp.float32)  # [B, max_blocks, bs, n_kv, D]
    if scale is not None:  # scalar, per (block, head) [nb, n_kv] or per (row, head) [nb, bs, n_kv]
        sc = jnp.asarray(scale, jnp.float32)
        sc = sc[:, None, :] if sc.ndim == 2 else sc
        rows = rows * jnp.broadcast_to(sc, (nb, bs, n_kv))[bt][..., None]
    return rows.reshape(bt.shape[0], -1, n_kv, d)


@functools.partial(jax.jit, static_argnames=("scale", "value_dim"))
def paged_attention_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array | None,
    block_table: jax.Array,
    seq_len: jax.Array,
    *,
    scale: float,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    value_dim: int | None = None,
) -> jax.Array:
    """q [B, Nq, D] over pools [num_blocks, block_size, Nkv, D] -> f32[B, Nq, D]; with
    ``v_pool`` None (latent rows) the values are the key rows' first ``value_dim`` dims and the
    output is f32[B, Nq, value_dim].

    Slots of ``block_table`` past ``seq_len`` may hold anything (-1 included): they are masked.
    A sequence of length 0 gives zeros.
    """
    bsz, n_q, d = q.shape
    bt = jnp.clip(block_table, 0, k_pool.shape[0] - 1)
    k = _rows_f32(k_pool, k_scale, bt)  # [B, T, Nkv, D]
    v = k[..., :value_dim] if v_pool is None else _rows_f32(v_pool, v_scale, bt)
    n_kv = k.shape[-2]
    qg = q.astype(jnp.float32).reshape(bsz, 1, n_kv, n_q // n_kv, d)
    mask = jnp.arange(k.shape[1])[None, None, :] < seq_len[:, None, None]  # [B, 1, T]
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=hi) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v, precision=hi)
    return out.reshape(bsz, n_q, v.shape[-1])
