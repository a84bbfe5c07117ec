"""One pre-norm transformer decoder layer (GQA or MLA attention + dense or MoE FFN), residual form.

    a = input_layernorm(x);            x = x + o_proj(attn(a) * sigmoid(gate))
    y = post_attention_layernorm(x);   x = x + ffn(y)

The drafter runs this layer on its own paged KV (``mtpjax.drafter``); the reference target model
stacks it with dense causal attention (``decoder_layer``). Both share the pieces below so the two
paths cannot drift apart.

Shapes: ``[B]`` sequences, ``[T]`` rows, ``H`` hidden; everything returned is F32.

``cfg`` is any object with the attention attributes listed in ``mtpjax.layers.attention`` plus
``rms_norm_eps``, ``zero_centered_norm`` and ``moe`` (a ``MoeConfig`` for MoE layers, which
drives the routing). The layer's leaves are described in ``mtpjax.layers._spec``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from mtpjax.layers.attention import AttentionParams, causal_self_attention
from mtpjax.layers.expert_parallel import ExpertParallelMoeParams, expert_parallel_mix
from mtpjax.layers.ffn import DenseFfnParams, MoeFfnParams, dense_ffn, moe_ffn
from mtpjax.layers.mla import MlaParams, mla_causal_attention
from mtpjax.layers.norms import rms_norm

__all__ = ["DecoderLayerParams", "apply_ffn", "decoder_layer", "ffn_residual", "input_norm"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderLayerParams:
    """Attributes:
    input_layernorm: [H] norm weight before attention.
    attention: q/k/v/o projections and the q/k head norms, or MLA's (``mtpjax.layers.mla``;
      the type selects the attention).
    post_attention_layernorm: [H] norm weight before the FFN.
    ffn: a dense SwiGLU FFN or a routed MoE (the type selects the forward).
    """

    input_layernorm: jax.Array
    attention: AttentionParams | MlaParams
    post_attention_layernorm: jax.Array
    ffn: DenseFfnParams | MoeFfnParams


def _norm(x: jax.Array, weight: jax.Array, cfg: Any) -> jax.Array:
    return rms_norm(x, weight, eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm)


def input_norm(params: DecoderLayerParams, x: jax.Array, *, cfg: Any) -> jax.Array:
    """``input_layernorm(x)``: [..., H] -> f32[..., H], the input of q/k/v."""
    return _norm(x, params.input_layernorm, cfg)


def apply_ffn(
    ffn: DenseFfnParams | MoeFfnParams, y: jax.Array, *, cfg: Any, implementation="auto"
) -> jax.Array:
    """The layer's FFN on already-normed rows: [..., H] -> f32[..., H]."""
    if isinstance(ffn, MoeFfnParams):
        if cfg.moe is None:
            raise ValueError("MoE FFN weights were given but the config has no MoeConfig (moe)")
        moe = cfg.moe
        # Experts split over devices (mtpjax.drafter.shard_drafter) mix under shard_map.
        mix = expert_parallel_mix(ffn) if isinstance(ffn, ExpertParallelMoeParams) else None
        return moe_ffn(
            ffn,
            y,
            top_k=moe.num_experts_per_tok,
            normalize=moe.norm_topk_prob,
            scoring=moe.scoring,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            routed_scaling_factor=moe.routed_scaling_factor,
            implementation=implementation,
            mix=mix,
        )
    if isinstance(ffn, DenseFfnParams):
        return dense_ffn(ffn, y, implementation=implementation)
    raise TypeError(f"ffn must be DenseFfnParams or MoeFfnParams, got {type(ffn).__name__}")


def ffn_residual(
    params: DecoderLayerParams, x: jax.Array, *, cfg: Any, implementation="auto"
) -> jax.Array:
    """``x + ffn(post_attention_layernorm(x))``: [..., H] -> f32[..., H]."""
    y = _norm(x, params.post_attention_layernorm, cfg)
    return x.astype(jnp.float32) + apply_ffn(params.ffn, y, cfg=cfg, implementation=implementation)


def decoder_layer(
    params: DecoderLayerParams,
    x: jax.Array,
    positions: jax.Array,
    *,
    cfg: Any,
    implementation="auto",
) -> jax.Array:
    """Dense causal layer over x: [B, T, H] at positions [B, T] -> the new residual f32[B, T, H].

    Row i attends to the rows j of its sequence with ``positions[j] <= positions[i]`` (no paging,
    no cache): give padding rows positions past the real ones so no real row sees them.
    """
    x = x.astype(jnp.float32)
    a = input_norm(params, x, cfg=cfg)
    attention = (
        mla_causal_attention if isinstance(params.attention, MlaParams) else causal_self_attention
    )
    x = x + attention(params.attention, a, positions, cfg, implementation=implementation)
    return ffn_residual(params, x, cfg=cfg, implementation=implementation)
