"""The MTP drafter's math and its teacher-forced forward over whole sequences.

Row ``i`` of a sequence is computed from the pair ``(token_{i+1}, hidden_i)``: the token that
followed position ``i`` and the target's hidden at position ``i``. Its RoPE position is ``i``
(the pair key). Per row:

    e = embed(token)                                       (the target's table unless dedicated;
                                                            zero at key 0: DeepSeek, GLM, MiMo)
    x = fc(concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])     (MiMo: hidden first)
    a = input_layernorm(x);  k, v = k_norm/RoPE(k_proj(a) + bias), v_proj(a) + bias
    x = x + o_proj(attn(q, K, V) [* sigmoid(gate)])        (causal over the sequence's rows)
    x = x + ffn(post_attention_layernorm(x))               (the pre-norm residual)
    h_out = mtp.norm(x);  logits = lm_head(h_out)          (first V' rows when reduced)

A row's K/V depend on its pair only (one layer), which is what lets the drafter prefill write
rows without attention. Activations stay F32 between projections; ``linear`` reads each weight
format exactly and accumulates in F32.

The other families (DeepSeek-V3, GLM, MiMo) run the same steps under their own checkpoint names
(``DrafterParams``), with plain RMSNorm and, where configured, MLA attention
(``mtpjax.layers.mla``: the cache row is the latent, ``[1, L + R]``, and its value is ``None``).

Shapes: ``[B]`` sequences (optional in ``drafter_forward``), ``[T]`` rows, ``H`` hidden,
``Nkv``/``D`` KV heads / head dim, ``V'`` draft vocab.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, InputOrder, LMHeadConfig
from mtpjax.drafter._params import DrafterParams, check_runnable
from mtpjax.head import LMHeadParams, embed, lm_head
from mtpjax.layers.attention import project_kv
from mtpjax.layers.decoder import decoder_layer, input_norm
from mtpjax.layers.mla import MlaParams, latent_rows
from mtpjax.layers.norms import rms_norm
from mtpjax.weights import linear

__all__ = ["DrafterOutput", "drafter_forward", "kv_rows"]


class DrafterOutput(NamedTuple):
    """What ``drafter_forward`` returns (unpacks as ``h_out, logits, residual``).

    Attributes:
      h_out: f32[..., T, H] ``mtp.norm(x)``, the hidden the POST_NORM contract chains.
      logits: f32[..., T, V'] the LM head over h_out (first V' rows when the vocab is reduced).
      residual: f32[..., T, H] the pre-norm residual x, what the PRE_NORM contract chains.
    """

    h_out: jax.Array
    logits: jax.Array
    residual: jax.Array


def resolve_head_cfg(cfg: DrafterConfig, head_cfg: LMHeadConfig | None) -> LMHeadConfig:
    """The LM head config to project through: ``cfg.lm_head_config()`` unless given."""
    head_cfg = cfg.lm_head_config() if head_cfg is None else head_cfg
    if head_cfg.hidden_size != cfg.hidden_size:
        raise ValueError(
            f"LM head hidden_size={head_cfg.hidden_size} does not match the drafter's "
            f"hidden_size={cfg.hidden_size}"
        )
    return head_cfg


def embed_pairs(
    params: DrafterParams,
    head: LMHeadParams,
    tokens: jax.Array,
    *,
    cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
) -> jax.Array:
    """Token embeddings f32[..., H]: the dedicated MTP table if the config asks, else the head's."""
    if cfg.mtp_use_dedicated_embeddings:
        if params.embed_tokens is None:
            raise ValueError(
                "cfg.mtp_use_dedicated_embeddings is set but DrafterParams.embed_tokens is None"
            )
        return jnp.take(params.embed_tokens, tokens, axis=0).astype(jnp.float32)
    return embed(head, tokens, cfg=head_cfg)


def fuse_inputs(
    params: DrafterParams,
    head: LMHeadParams,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    *,
    cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
    implementation="auto",
) -> jax.Array:
    """``fc(concat[norm_e(embed(tokens)), norm_h(hidden)])`` (MiMo: ``concat[norm_h, norm_e]``):
    tokens [...], hidden [..., H] at positions [...] -> the layer input x f32[..., H].

    With ``zero_embedding_at_position_0`` (DeepSeek, GLM, MiMo) the row at key 0 reads a zero
    embedding, as vLLM's MTP modules do (``inputs_embeds[positions == 0] = 0``)."""
    eps, zc = cfg.rms_norm_eps, cfg.zero_centered_norm
    e = embed_pairs(params, head, tokens, cfg=cfg, head_cfg=head_cfg)
    if cfg.zero_embedding_at_position_0:
        e = jnp.where((positions == 0)[..., None], 0.0, e)
    e = rms_norm(e, params.pre_fc_norm_embedding, eps=eps, zero_centered=zc)
    h = rms_norm(hidden, params.pre_fc_norm_hidden, eps=eps, zero_centered=zc)
    pair = [h, e] if cfg.input_order is InputOrder.HIDDEN_FIRST else [e, h]
    return linear(
        jnp.concatenate(pair, axis=-1),
        params.fc,
        out_dtype=jnp.float32,
        implementation=implementation,
    )


def pair_rows(
    params: DrafterParams,
    head: LMHeadParams,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    *,
    cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
    implementation="auto",
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Everything a row needs before attention, for pairs [..., T] at positions [..., T].

    Returns x f32[..., T, H] (layer input), a f32[..., T, H] (``input_layernorm(x)``, the q/k/v
    input), and the cache rows k, v f32[..., T, Nkv, D] (k normed and rotated); MLA: k the latent
    rows f32[..., T, 1, L + R] and v None.
    """
    x = fuse_inputs(
        params, head, tokens, hidden, positions, cfg=cfg, head_cfg=head_cfg,
        implementation=implementation,
    )  # fmt: skip
    a = input_norm(params.layer, x, cfg=cfg)
    attn = params.layer.attention
    if isinstance(attn, MlaParams):
        return x, a, latent_rows(attn, a, positions, cfg, implementation=implementation), None
    k, v = project_kv(attn, a, positions, cfg, implementation=implementation)
    return x, a, k, v


def output_head(
    params: DrafterParams,
    head: LMHeadParams,
    x: jax.Array,
    *,
    cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
    implementation="auto",
) -> DrafterOutput:
    """From the layer's output residual x f32[..., H]: ``h_out = mtp.norm(x)`` and the logits."""
    h_out = rms_norm(x, params.norm, eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm)
    logits = lm_head(head, h_out, cfg=head_cfg, draft=True, implementation=implementation)
    return DrafterOutput(h_out=h_out, logits=logits.astype(jnp.float32), residual=x)


def _check_pairs(
    tokens: jax.Array, hidden: jax.Array, positions: jax.Array | None, cfg: DrafterConfig
) -> None:
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer token ids, got {tokens.dtype}")
    if tokens.ndim not in (1, 2):
        raise ValueError(f"tokens must be [T] or [B, T], got shape {tuple(tokens.shape)}")
    chex.assert_shape(hidden, (*tokens.shape, cfg.hidden_size))
    if positions is not None:
        chex.assert_shape(positions, tokens.shape)


@functools.partial(jax.jit, static_argnames=("cfg", "head_cfg", "implementation"))
def drafter_forward(
    params: DrafterParams,
    head: LMHeadParams,
    tokens: jax.Array,
    hidden: jax.Array,
    *,
    cfg: DrafterConfig,
    positions: jax.Array | None = None,
    head_cfg: LMHeadConfig | None = None,
    implementation="auto",
) -> DrafterOutput:
    """Teacher-forced drafter forward over whole sequences of pairs, causal, no paging.

    Args:
      params, head: the MTP head and the target's embedding/LM head.
      tokens: int[B, T] or int[T]; ``tokens[..., i]`` is token_{i+1}.
      hidden: [B, T, H] or [T, H]; ``hidden[..., i, :]`` is the target's hidden at position i.
      cfg: static drafter config.
      positions: int[B, T] / int[T] pair keys (RoPE positions), default ``arange(T)``. Row i
        attends to the rows j with ``positions[j] <= positions[i]``; pad at the end with larger
        positions.
      head_cfg: static LM head config, default ``cfg.lm_head_config()``.
      implementation: "auto" | "xla" | "pallas" for the projections.

    Returns:
      ``DrafterOutput(h_out, logits, residual)`` with the leading dims of ``tokens``.
    """
    check_runnable(cfg)
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    tokens = jnp.asarray(tokens)
    hidden = jnp.asarray(hidden)
    _check_pairs(tokens, hidden, positions, cfg)
    unbatched = tokens.ndim == 1
    if unbatched:
        tokens, hidden = tokens[None], hidden[None]
        positions = None if positions is None else jnp.asarray(positions)[None]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = fuse_inputs(
        params, head, tokens, hidden, positions, cfg=cfg, head_cfg=head_cfg,
        implementation=implementation,
    )  # fmt: skip
    x = decoder_layer(params.layer, x, positions, cfg=cfg, implementation=implementation)
    out = output_head(params, head, x, cfg=cfg, head_cfg=head_cfg, implementation=implementation)
    if unbatched:
        out = DrafterOutput(*(a[0] for a in out))
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "head_cfg", "implementation"))
def kv_rows(
    params: DrafterParams,
    head: LMHeadParams,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    *,
    cfg: DrafterConfig,
    head_cfg: LMHeadConfig | None = None,
    implementation="auto",
) -> tuple[jax.Array, jax.Array | None]:
    """The cache rows of pairs tokens [..., T], hidden [..., T, H] at positions [..., T].

    Returns k, v: f32[..., T, Nkv, D], exactly what a paged write stores (before the pool's
    storage rounding); MLA: the latent rows f32[..., T, 1, L + R] and None. Used to rebuild a
    drafter's KV from scratch.
    """
    check_runnable(cfg)
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    _, _, k, v = pair_rows(
        params,
        head,
        jnp.asarray(tokens),
        jnp.asarray(hidden),
        jnp.asarray(positions),
        cfg=cfg,
        head_cfg=head_cfg,
        implementation=implementation,
    )
    return k, v
