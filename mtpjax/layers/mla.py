"""DeepSeek multi-head latent attention (MLA), split into the pieces the teacher-forced path, the
paged decode path and the KV-only prefill share.

Per row, on ``a = input_layernorm(x)`` (transformers' ``DeepseekV3Attention``):

    q = q_b_proj(q_a_layernorm(q_a_proj(a)))      (q_proj(a) when q_lora_rank is None)
        -> per head [q_nope (Dn), q_rope (R)], q_rope rotated
    c, k_rope = split(kv_a_proj_with_mqa(a), [L, R]);  c = kv_a_layernorm(c);  k_rope rotated
    k_nope, v = split(kv_b_proj(c), per head [Dn, Dv])
    attn = softmax(q . [k_nope, k_rope] * scale) @ v;  out = o_proj(attn)

RoPE is on the R = ``qk_rope_head_dim`` dims only, with the one ``k_rope`` shared by every head,
DeepSeek's interleaved pairs when ``rope_interleave`` and YaRN when configured; ``scale`` is
``(Dn + R)^-0.5`` times YaRN's ``mscale_all_dim`` correction.

The cache row of a token is ``[c, k_rope]`` (L + R wide, one "head"), never the expanded K/V:
DeepSeek-V3 stores (512 + 64) values per row instead of 128 heads * (192 + 128) = 40960 (71x
fewer; 1152 against 81920 bytes in BF16). Decode absorbs ``kv_b_proj`` instead of expanding
the cache: ``W_UK`` (the k_nope rows) folds into the query, ``q_lat = q_nope @ W_UK`` [L], so the
scores are ``[q_lat, q_rope] . [c, k_rope]``, which is multi-query attention over the cache rows
with the latent ``c`` as the value; ``W_UV`` (the v rows) then maps the attended latent to each
head's output. Both forms compute the same attention (``tests/test_mla.py`` checks it).

Shapes: ``[..., T]`` rows, ``H`` hidden, ``Nq`` heads, ``Dn`` qk_nope_head_dim, ``R``
qk_rope_head_dim, ``Dv`` v_head_dim, ``L`` kv_lora_rank, ``Q`` q_lora_rank.

``cfg`` is a ``DrafterConfig`` with ``mla`` set (``num_attention_heads``, ``rope_theta``,
``rope_scaling``, ``rms_norm_eps``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from mtpjax.layers.attention import attend
from mtpjax.layers.norms import rms_norm
from mtpjax.layers.rope import apply_rope
from mtpjax.weights import Projection, Weight, dequantize, linear

__all__ = [
    "MlaParams",
    "absorbed_output",
    "absorbed_query",
    "latent_rows",
    "mla_causal_attention",
    "mla_leaf_rows",
    "softmax_scale",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaParams:
    """Checkpoint names under ``self_attn.``; q_a_proj / q_a_layernorm / q_b_proj when
    ``q_lora_rank`` is set, else q_proj.

    Attributes:
      q_a_proj: [Q, H]; q_a_layernorm: [Q]; q_b_proj: [Nq*(Dn+R), Q]; q_proj: [Nq*(Dn+R), H].
      kv_a_proj_with_mqa: [L+R, H]; kv_a_layernorm: [L].
      kv_b_proj: [Nq*(Dn+Dv), L], per head its Dn key rows then its Dv value rows.
      o_proj: [H, Nq*Dv].
    """

    kv_a_proj_with_mqa: Weight
    kv_a_layernorm: jax.Array
    kv_b_proj: Weight
    o_proj: Weight
    q_a_proj: Weight | None = None
    q_a_layernorm: jax.Array | None = None
    q_b_proj: Weight | None = None
    q_proj: Weight | None = None

    @property
    def query_projection(self) -> Weight:
        """The projection that emits the per-head queries (q_b_proj, or q_proj)."""
        return self.q_proj if self.q_b_proj is None else self.q_b_proj


def mla_leaf_rows(cfg: Any) -> list[tuple]:
    """``(name, shape, what, axes, role)`` of the attention leaves, for ``layers._spec``.

    Roles: the queries' projections are Q_PROJ, ``kv_a_proj_with_mqa`` (the one projection a
    cache row needs, so the drafter prefill's) K_PROJ, ``kv_b_proj`` V_PROJ, o_proj O_PROJ.
    """
    m, H, N, P = cfg.mla, cfg.hidden_size, cfg.num_attention_heads, Projection
    qk, per_head = m.qk_head_dim, "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)"
    rows = []
    if m.q_lora_rank is None:
        rows.append(("self_attn.q_proj", (N * qk, H), f"[{per_head}, hidden_size]",
                     ("heads", "embed"), P.Q_PROJ))  # fmt: skip
    else:
        Q = m.q_lora_rank
        rows += [
            ("self_attn.q_a_proj", (Q, H), "[q_lora_rank, hidden_size]", (None, "embed"),
             P.Q_PROJ),
            ("self_attn.q_a_layernorm", (Q,), "[q_lora_rank]", (None,), None),
            ("self_attn.q_b_proj", (N * qk, Q), f"[{per_head}, q_lora_rank]", ("heads", None),
             P.Q_PROJ),
        ]  # fmt: skip
    kv_b = "num_attention_heads * (qk_nope_head_dim + v_head_dim)"
    rows += [
        ("self_attn.kv_a_proj_with_mqa", (m.latent_width, H),
         "[kv_lora_rank + qk_rope_head_dim, hidden_size]", (None, "embed"), P.K_PROJ),
        ("self_attn.kv_a_layernorm", (m.kv_lora_rank,), "[kv_lora_rank]", (None,), None),
        ("self_attn.kv_b_proj", (N * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
         f"[{kv_b}, kv_lora_rank]", ("heads", None), P.V_PROJ),
        ("self_attn.o_proj", (H, N * m.v_head_dim), "[hidden_size, num_attention_heads * "
         "v_head_dim]", ("embed", "heads"), P.O_PROJ),
    ]  # fmt: skip
    return rows


def mla_from_named(named: Any, attn: str) -> MlaParams:
    """The attention whose leaves are ``named[attn + "." + name]`` (``attn`` ends in self_attn)."""
    fields = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj")
    return MlaParams(
        kv_a_proj_with_mqa=named[f"{attn}.kv_a_proj_with_mqa"],
        kv_a_layernorm=named[f"{attn}.kv_a_layernorm"],
        kv_b_proj=named[f"{attn}.kv_b_proj"],
        o_proj=named[f"{attn}.o_proj"],
        **{f: named.get(f"{attn}.{f}") for f in fields},
    )


def softmax_scale(cfg: Any) -> float:
    """The scale of q.k: ``qk_head_dim^-0.5``, times YaRN's ``mscale_all_dim`` correction."""
    scale = cfg.mla.qk_head_dim**-0.5
    if cfg.rope_scaling is not None:
        scale *= cfg.rope_scaling.softmax_scale_factor
    return scale


def _rope(x: jax.Array, positions: jax.Array, cfg: Any) -> jax.Array:
    m = cfg.mla
    return apply_rope(
        x,
        positions,
        rotary_dim=m.qk_rope_head_dim,
        theta=cfg.rope_theta,
        scaling=cfg.rope_scaling,
        interleaved=m.rope_interleave,
    )


def _lin(x: jax.Array, w: Weight, implementation: Any) -> jax.Array:
    return linear(x, w, out_dtype=jnp.float32, implementation=implementation)


def queries(
    params: MlaParams, a: jax.Array, positions: jax.Array, cfg: Any, *, implementation="auto"
) -> tuple[jax.Array, jax.Array]:
    """q_nope f32[..., T, Nq, Dn] and the rotated q_rope f32[..., T, Nq, R] of a [..., T, H]."""
    m = cfg.mla
    if params.q_b_proj is None:
        q = _lin(a, params.q_proj, implementation)
    else:
        c = _lin(a, params.q_a_proj, implementation)
        c = rms_norm(c, params.q_a_layernorm, eps=m.latent_norm_eps, zero_centered=False)
        q = _lin(c, params.q_b_proj, implementation)
    q = q.reshape(*a.shape[:-1], cfg.num_attention_heads, m.qk_head_dim)
    q_nope, q_rope = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
    return q_nope, _rope(q_rope, positions, cfg)


def latent_rows(
    params: MlaParams, a: jax.Array, positions: jax.Array, cfg: Any, *, implementation="auto"
) -> jax.Array:
    """The cache rows ``[kv_a_layernorm(c), rope(k_rope)]`` of a [..., T, H] at positions
    [..., T]: f32[..., T, 1, L + R] (one shared "head"), final once written."""
    m = cfg.mla
    kv = _lin(a, params.kv_a_proj_with_mqa, implementation)
    c = rms_norm(
        kv[..., : m.kv_lora_rank], params.kv_a_layernorm, eps=m.latent_norm_eps, zero_centered=False
    )
    k_rope = _rope(kv[..., None, m.kv_lora_rank :], positions, cfg)  # [..., T, 1, R]
    return jnp.concatenate([c[..., None, :], k_rope], axis=-1)


def _kv_b(params: MlaParams, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """``kv_b_proj`` dequantised and split per head: W_UK f32[Nq, Dn, L], W_UV f32[Nq, Dv, L]."""
    m = cfg.mla
    w = dequantize(params.kv_b_proj).reshape(
        cfg.num_attention_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank
    )
    return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]


_HI = jax.lax.Precision.HIGHEST


def absorbed_query(
    params: MlaParams, a: jax.Array, positions: jax.Array, cfg: Any, *, implementation="auto"
) -> jax.Array:
    """The decode query over latent rows: ``[q_nope @ W_UK, q_rope]`` f32[..., T, Nq, L + R]."""
    q_nope, q_rope = queries(params, a, positions, cfg, implementation=implementation)
    w_uk, _ = _kv_b(params, cfg)
    q_lat = jnp.einsum("...hd,hdl->...hl", q_nope, w_uk, precision=_HI)
    return jnp.concatenate([q_lat, q_rope], axis=-1)


def absorbed_output(
    params: MlaParams, ctx: jax.Array, cfg: Any, *, implementation="auto"
) -> jax.Array:
    """The attended latents ctx [..., Nq, L] -> per head ``@ W_UV^T`` -> o_proj -> f32[..., H]."""
    _, w_uv = _kv_b(params, cfg)
    out = jnp.einsum("...hl,hvl->...hv", ctx.astype(jnp.float32), w_uv, precision=_HI)
    return _lin(out.reshape(*out.shape[:-2], -1), params.o_proj, implementation)


def mla_causal_attention(
    params: MlaParams, a: jax.Array, positions: jax.Array, cfg: Any, *, implementation="auto"
) -> jax.Array:
    """Dense causal MLA over a: [B, T, H] at positions [B, T] -> f32[B, T, H], in transformers'
    expanded form (``kv_b_proj`` applied to every row's latent): the oracle of the absorbed one.

    Row i attends to rows j with positions[j] <= positions[i] (no paging, no cache).
    """
    m, N = cfg.mla, cfg.num_attention_heads
    q_nope, q_rope = queries(params, a, positions, cfg, implementation=implementation)
    rows = latent_rows(params, a, positions, cfg, implementation=implementation)  # [B, T, 1, L+R]
    kv = _lin(rows[..., 0, : m.kv_lora_rank], params.kv_b_proj, implementation)
    kv = kv.reshape(*kv.shape[:-1], N, m.qk_nope_head_dim + m.v_head_dim)
    k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
    k_rope = jnp.broadcast_to(rows[..., m.kv_lora_rank :], (*k_nope.shape[:-1], m.qk_rope_head_dim))
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    mask = positions[:, None, :] <= positions[:, :, None]
    out = attend(q, k, v, mask, scale=softmax_scale(cfg))  # [B, T, Nq, Dv]
    return _lin(out.reshape(*out.shape[:-2], -1), params.o_proj, implementation)
