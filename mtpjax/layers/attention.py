"""GQA self-attention (Qwen3-Next / Qwen3.5's output-gated form, GLM-4.5's and Qwen2's with q/k/v
bias), split into the pieces the dense (teacher-forced) path, the paged decode path and the
KV-only prefill share.

Shapes: `[..., T]` rows, `H` hidden, `Nq` / `Nkv` query / KV heads, `D` head dim,
`[B, Tq, Tk]` attention masks.

`cfg` is any object with the attributes `num_attention_heads`, `num_key_value_heads`,
`head_dim`, `rotary_dim`, `rope_theta`, `rms_norm_eps`, `zero_centered_norm`,
`attn_output_gate` and `qk_norm` (the drafter and the reference target configs both have them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from mtpjax.layers.norms import rms_norm
from mtpjax.layers.rope import apply_rope
from mtpjax.weights import Weight, linear
from pallas_kernels import Implementation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionParams:
    """q_proj: [Nq*D*(2 if gated), H] (per head `[q_h, gate_h]`); k/v_proj: [Nkv*D, H];
    o_proj: [H, Nq*D]; q_norm / k_norm: [D] or None; q_bias / k_bias / v_bias: the projections'
    output bias ([Nq*D*(2 if gated)] / [Nkv*D]) or None."""

    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    q_bias: jax.Array | None = None
    k_bias: jax.Array | None = None
    v_bias: jax.Array | None = None


def _project(x: jax.Array, w: Weight, bias: jax.Array | None, implementation) -> jax.Array:
    """``x @ w.T (+ bias)``: [..., H] -> f32[..., N]."""
    y = linear(x, w, out_dtype=jnp.float32, implementation=implementation)
    return y if bias is None else y + bias.astype(jnp.float32)


def _norm_rope(
    x: jax.Array, w: jax.Array | None, positions: jax.Array, cfg: Any, norm_implementation
) -> jax.Array:
    """The head norm (when ``w`` is given), then RoPE: [..., T, N, D] -> f32[..., T, N, D]."""
    if w is not None:
        x = rms_norm(
            x,
            w,
            eps=cfg.rms_norm_eps,
            zero_centered=cfg.zero_centered_norm,
            implementation=norm_implementation,
        )
    return apply_rope(x, positions, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)


def project_kv(
    params: AttentionParams,
    x: jax.Array,
    positions: jax.Array,
    cfg: Any,
    *,
    implementation="auto",
    norm_implementation=Implementation.XLA,
) -> tuple[jax.Array, jax.Array]:
    """K and V rows for x: [..., T, H] at positions [..., T] -> two f32[..., T, Nkv, D].

    K gets its head norm and RoPE here, so a cache row is final once written. The projections
    take ``implementation``, the head norm ``norm_implementation`` (``rms_norm``'s).
    """
    lead = x.shape[:-1]
    k = _project(x, params.k_proj, params.k_bias, implementation)
    v = _project(x, params.v_proj, params.v_bias, implementation)
    k = k.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
    return _norm_rope(k, params.k_norm, positions, cfg, norm_implementation), v


def project_q(
    params: AttentionParams,
    x: jax.Array,
    positions: jax.Array,
    cfg: Any,
    *,
    implementation="auto",
    norm_implementation=Implementation.XLA,
) -> tuple[jax.Array, jax.Array | None]:
    """Queries f32[..., T, Nq, D] (normed, rotated) and the output gate f32[..., T, Nq, D] or
    None; implementations as ``project_kv``'s."""
    lead = x.shape[:-1]
    q = _project(x, params.q_proj, params.q_bias, implementation)
    gate = None
    if cfg.attn_output_gate:
        # The projection is interleaved per head: [q_h (D), gate_h (D)] for each head h.
        q = q.reshape(*lead, cfg.num_attention_heads, 2 * cfg.head_dim)
        q, gate = q[..., : cfg.head_dim], q[..., cfg.head_dim :]
    else:
        q = q.reshape(*lead, cfg.num_attention_heads, cfg.head_dim)
    return _norm_rope(q, params.q_norm, positions, cfg, norm_implementation), gate


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """Masked GQA softmax attention in F32, the reference for every attention path.

    q: [B, Tq, Nq, D]; k: [B, Tk, Nkv, D]; v: [B, Tk, Nkv, Dv]; mask: bool[B, Tq, Tk] (True =
    attend); ``scale`` of q.k, default ``D**-0.5``. Query head h reads KV head h // (Nq // Nkv).
    A row with nothing to attend gives zeros. Returns f32[B, Tq, Nq, Dv].
    """
    B, Tq, Nq, D = q.shape
    Nkv = k.shape[-2]
    scale = D**-0.5 if scale is None else scale
    q = q.astype(jnp.float32).reshape(B, Tq, Nkv, Nq // Nkv, D)
    # HIGHEST: this is the F32 reference; a GPU's default would round the operands to TF32.
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k.astype(jnp.float32), precision=hi) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v.astype(jnp.float32), precision=hi)
    return out.reshape(B, Tq, Nq, v.shape[-1])


def attend_cache(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    layer: jax.Array | None = None,
    implementation: Implementation | str = Implementation.AUTO,
) -> jax.Array:
    """Each query row over its sequence's cache rows: row (b, s) of q [B, S, Nq, D] attends to
    rows ``< lengths[b, s]`` of k / v [B, L, Nkv, D] (entry ``layer``, traced, of [layers, B,
    L, Nkv, D] stacks) -> f32[B, S, Nq, D].

    On a GPU (AUTO) ``pallas_kernels.cache_attention``'s kernel, which reads a stack's entry in
    place and whose rows' results do not depend on the row count or the cache length (a
    target's verify step then computes its first row as the one-row step does); elsewhere its
    reference, ``attend``'s operations under the same mask.
    """
    return pk.cache_attention(
        q,
        k_cache,
        v_cache,
        lengths,
        scale=q.shape[-1] ** -0.5,
        layer=layer,
        implementation=implementation,
    )


def output_projection(
    params: AttentionParams, attn: jax.Array, gate: jax.Array | None, *, implementation="auto"
) -> jax.Array:
    """attn: [..., T, Nq, D] (times sigmoid(gate) when gated) -> o_proj -> f32[..., T, H]."""
    if gate is not None:
        attn = attn * jax.nn.sigmoid(gate)
    attn = attn.reshape(*attn.shape[:-2], -1)
    return linear(attn, params.o_proj, out_dtype=jnp.float32, implementation=implementation)


def causal_self_attention(
    params: AttentionParams, x: jax.Array, positions: jax.Array, cfg: Any, *, implementation="auto"
) -> jax.Array:
    """Dense causal self-attention over x: [B, T, H] at positions [B, T] -> f32[B, T, H].

    Row i attends to rows j with positions[j] <= positions[i] (no paging, no cache).
    """
    q, gate = project_q(params, x, positions, cfg, implementation=implementation)
    k, v = project_kv(params, x, positions, cfg, implementation=implementation)
    mask = positions[:, None, :] <= positions[:, :, None]
    return output_projection(params, attend(q, k, v, mask), gate, implementation=implementation)
