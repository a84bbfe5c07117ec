"""The drafter's K-step chain, teacher-forced over whole sequences, exactly as ``propose`` runs it.

``propose`` with a single head (``DrafterParams``) drafts from an anchor row ``e`` (the pair
``(t_{e+1}, h_e)``, the target's hidden): step 0 is the anchor row's forward over the committed
rows ``0..e``; step ``s >= 1`` appends the row ``(d_s, g_{s-1})`` at key ``e + s`` and runs it
over the committed rows ``0..e`` and the chain's own rows ``e+1..e+s``, where ``g_{s-1}`` is
what step ``s - 1`` hands over under the hidden contract (``h_out``, the pre-norm residual, or
``h_e``). ``chain_forward`` runs that for every anchor of a sequence at once, with the true next
tokens in place of the drafts (teacher forcing): each anchor has its own chain, so the rows of
step ``s`` attend to the committed rows up to their anchor and to their own chain only, never to
another anchor's chain rows (a dense causal mask over step ``s``'s rows would be the cheaper
train-time form of DeepSeek / FastMTP, which ``propose`` does not run).

Shapes: ``[B]`` sequences, ``[T]`` rows (row ``i`` is the pair ``(tokens[i], hidden[i])``:
``tokens[i]`` the token at position ``i + 1``), ``[S]`` steps, ``[R] = T - S + 1`` anchors (the
rows whose chain fits in the sequence), ``H`` hidden, ``Nq``/``Nkv``/``D`` heads / KV heads /
head dim, ``V'`` draft vocab.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, HiddenContract, LMHeadConfig
from mtpjax.drafter._forward import output_head, pair_rows, resolve_head_cfg
from mtpjax.drafter._params import DrafterParams, check_runnable
from mtpjax.head import LMHeadParams
from mtpjax.layers.attention import output_projection, project_q
from mtpjax.layers.decoder import ffn_residual
from mtpjax.layers.mla import MlaParams

__all__ = ["ChainOutput", "chain_forward"]


class ChainOutput(NamedTuple):
    """What ``chain_forward`` returns.

    Attributes:
      logits: f32[B, S, R, V'] step s's draft logits for anchor e: the prediction of the token
        at position ``e + s + 2`` (``tokens[e + s + 1]``).
      hidden: f32[B, S, R, H] what step s hands to step s + 1 under the contract (``propose``'s
        ``ProposeOutput.hidden[:, s]`` for the anchor e).
    """

    logits: jax.Array
    hidden: jax.Array


def _round(x: jax.Array, dtype) -> jax.Array:
    """x as the KV pool stores it (``dtype``), back in F32; None keeps F32."""
    return x if dtype is None else x.astype(dtype).astype(jnp.float32)


def chain_attention(
    q: jax.Array,
    k0: jax.Array,
    v0: jax.Array,
    kc: jax.Array,
    vc: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Each anchor's query over the committed rows up to it and its own chain rows, in F32.

    q: [B, R, Nq, D] (anchor e's row of the current step); k0, v0: [B, T, Nkv, D] the committed
    rows (row e attends to rows j <= e); kc, vc: [B, R, C, Nkv, D] anchor e's own C chain rows
    (all attended). One softmax over the T + C scores (masked committed rows excluded), GQA as
    ``mtpjax.layers.attention.attend`` (query head h reads KV head h // (Nq // Nkv)). Returns
    f32[B, R, Nq, D].
    """
    B, R, Nq, D = q.shape
    T, Nkv = k0.shape[1], k0.shape[2]
    scale = D**-0.5 if scale is None else scale
    # HIGHEST: the reference F32 attention, as ``attend`` (a GPU's default would use TF32).
    hi = jax.lax.Precision.HIGHEST
    qg = q.astype(jnp.float32).reshape(B, R, Nkv, Nq // Nkv, D)
    s0 = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k0.astype(jnp.float32), precision=hi) * scale
    causal = jnp.arange(T)[None, :] <= jnp.arange(R)[:, None]  # [R, T]
    s0 = jnp.where(causal, s0, -jnp.inf)
    sc = jnp.einsum("bqhgd,bqjhd->bhgqj", qg, kc.astype(jnp.float32), precision=hi) * scale
    scores = jnp.concatenate([s0, sc], axis=-1)  # every row sees at least its own committed row
    weights = jax.nn.softmax(scores, axis=-1)
    w0, wc = weights[..., :T], weights[..., T:]
    out = jnp.einsum("bhgqk,bkhd->bqhgd", w0, v0.astype(jnp.float32), precision=hi)
    out = out + jnp.einsum("bhgqj,bqjhd->bqhgd", wc, vc.astype(jnp.float32), precision=hi)
    return out.reshape(B, R, Nq, v0.shape[-1])


@functools.partial(
    jax.jit,
    static_argnames=(
        "cfg",
        "num_steps",
        "hidden_contract",
        "head_cfg",
        "kv_dtype",
        "implementation",
    ),
)
def chain_forward(
    params: DrafterParams,
    head: LMHeadParams,
    tokens: jax.Array,
    hidden: jax.Array,
    *,
    cfg: DrafterConfig,
    num_steps: int,
    hidden_contract: HiddenContract = HiddenContract.POST_NORM,
    head_cfg: LMHeadConfig | None = None,
    kv_dtype=None,
    implementation: str = "xla",
) -> ChainOutput:
    """The teacher-forced K-step chain of ``propose`` for every anchor (module docstring).

    Args:
      params, head: one MTP head and the target's embedding / LM head.
      tokens: int[B, T]; ``tokens[:, i]`` is the token at position i + 1 (step s of anchor e
        reads ``tokens[:, e + s]``: the true token where ``propose`` reads its draft d_s).
      hidden: [B, T, H] the target's hidden at positions 0..T-1 (rows at RoPE position i).
      cfg: static drafter config (GQA attention; MLA heads are not supported here).
      num_steps: static S >= 1, with S <= T; S = 1 is ``drafter_forward``.
      hidden_contract: static, what steps 1.. read (``propose``'s option of the same name).
      head_cfg: static LM head config, default ``cfg.lm_head_config()``.
      kv_dtype: static; round the K/V rows to this dtype as a paged pool stores them (e.g.
        ``jnp.bfloat16`` to reproduce a BF16 pool bit for bit); None keeps F32 (training).
      implementation: the projections' implementation; "xla" (the default) is differentiable.

    Returns:
      ``ChainOutput`` with R = T - S + 1 anchors.
    """
    check_runnable(cfg)
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    if isinstance(params.layer.attention, MlaParams):
        raise ValueError("chain_forward runs GQA attention heads; an MLA head is not supported")
    if not isinstance(hidden_contract, HiddenContract):
        raise TypeError(f"hidden_contract must be a HiddenContract, got {hidden_contract!r}")
    chex.assert_rank(tokens, 2)
    B, T = tokens.shape
    chex.assert_shape(hidden, (B, T, cfg.hidden_size))
    if not isinstance(num_steps, int) or not 1 <= num_steps <= T:
        raise ValueError(f"num_steps must be an int in [1, T={T}], got {num_steps!r}")
    S, R = num_steps, T - num_steps + 1
    kw = dict(cfg=cfg, head_cfg=head_cfg, implementation=implementation)
    attn = params.layer.attention
    hidden = hidden.astype(jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    # The committed rows (target hidden); step 0 is every anchor's row over them.
    x, a, k0, v0 = pair_rows(params, head, tokens, hidden, positions, **kw)
    k0, v0 = _round(k0, kv_dtype), _round(v0, kv_dtype)
    head_dim = cfg.head_dim
    kc = jnp.zeros((B, R, 0, cfg.num_key_value_heads, head_dim), jnp.float32)
    vc = kc
    anchor_hidden = hidden[:, :R]
    handed_over = {
        HiddenContract.POST_NORM: lambda o: o.h_out,
        HiddenContract.PRE_NORM: lambda o: o.residual,
        HiddenContract.PINNED: lambda o: anchor_hidden,
    }[hidden_contract]

    logits, handed = [], []
    g = None
    for s in range(S):
        pos = positions[:, :R] + s
        if s == 0:
            x_s, a_s = x[:, :R], a[:, :R]
        else:
            x_s, a_s, k_s, v_s = pair_rows(params, head, tokens[:, s : s + R], g, pos, **kw)
            kc = jnp.concatenate([kc, _round(k_s, kv_dtype)[:, :, None]], axis=2)
            vc = jnp.concatenate([vc, _round(v_s, kv_dtype)[:, :, None]], axis=2)
        q, gate = project_q(attn, a_s, pos, cfg, implementation=implementation)
        ctx = chain_attention(q, k0, v0, kc, vc)
        h = x_s + output_projection(attn, ctx, gate, implementation=implementation)
        h = ffn_residual(params.layer, h, cfg=cfg, implementation=implementation)
        out = output_head(params, head, h, **kw)
        g = handed_over(out)
        logits.append(out.logits)
        handed.append(g)
    return ChainOutput(logits=jnp.stack(logits, axis=1), hidden=jnp.stack(handed, axis=1))
