"""One pre-norm transformer decoder layer (gated GQA attention + dense or MoE FFN), residual form.

    a = input_layernorm(x);            x = x + o_proj(attn(a) * sigmoid(gate))
    y = post_attention_layernorm(x);   x = x + ffn(y)

The drafter runs this layer on its own paged KV (``mtpjax.drafter``); the reference target model
stacks it with dense causal attention (``decoder_layer``). Both share the pieces below so the two
paths cannot drift apart.

Shapes: ``[B]`` sequences, ``[T]`` rows, ``H`` hidden; everything returned is F32.

``cfg`` is any object with the attention attributes listed in ``mtpjax.layers.attention`` plus
``rms_norm_eps``, ``zero_centered_norm``, ``ffn`` (an ``FfnKind``, used by the initialiser),
``intermediate_size`` and ``moe`` (a ``MoeConfig`` for MoE layers: ``num_experts_per_tok`` and
``norm_topk_prob`` drive the routing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mtpjax.config import FfnKind
from mtpjax.layers.attention import AttentionParams, causal_self_attention
from mtpjax.layers.ffn import DenseFfnParams, MoeFfnParams, dense_ffn, moe_ffn
from mtpjax.layers.norms import rms_norm
from mtpjax.weights import Precision, Projection, Weight, parse_precision, projection_format
from mtpjax.weights import quantize as quantize_weight

__all__ = [
    "DecoderLayerParams",
    "Draw",
    "apply_ffn",
    "build_decoder_layer",
    "decoder_layer",
    "ffn_residual",
    "init_decoder_layer",
    "init_norm",
    "init_projection",
    "input_norm",
    "with_normal_draws",
]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["input_layernorm", "attention", "post_attention_layernorm", "ffn"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderLayerParams:
    """Attributes:
    input_layernorm: [H] norm weight before attention.
    attention: q/k/v/o projections and the q/k head norms.
    post_attention_layernorm: [H] norm weight before the FFN.
    ffn: a dense SwiGLU FFN or a routed MoE (the type selects the forward).
    """

    input_layernorm: jax.Array
    attention: AttentionParams
    post_attention_layernorm: jax.Array
    ffn: DenseFfnParams | MoeFfnParams


def input_norm(params: DecoderLayerParams, x: jax.Array, *, cfg: Any) -> jax.Array:
    """``input_layernorm(x)``: [..., H] -> f32[..., H], the input of q/k/v."""
    return rms_norm(
        x, params.input_layernorm, eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm
    )


def apply_ffn(
    ffn: DenseFfnParams | MoeFfnParams, y: jax.Array, *, cfg: Any, implementation="auto"
) -> jax.Array:
    """The layer's FFN on already-normed rows: [..., H] -> f32[..., H]."""
    if isinstance(ffn, MoeFfnParams):
        if cfg.moe is None:
            raise ValueError("MoE FFN weights were given but the config has no MoeConfig (moe)")
        return moe_ffn(
            ffn,
            y,
            top_k=cfg.moe.num_experts_per_tok,
            normalize=cfg.moe.norm_topk_prob,
            implementation=implementation,
        )
    if isinstance(ffn, DenseFfnParams):
        return dense_ffn(ffn, y, implementation=implementation)
    raise TypeError(f"ffn must be DenseFfnParams or MoeFfnParams, got {type(ffn).__name__}")


def ffn_residual(
    params: DecoderLayerParams, x: jax.Array, *, cfg: Any, implementation="auto"
) -> jax.Array:
    """``x + ffn(post_attention_layernorm(x))``: [..., H] -> f32[..., H]."""
    y = rms_norm(
        x,
        params.post_attention_layernorm,
        eps=cfg.rms_norm_eps,
        zero_centered=cfg.zero_centered_norm,
    )
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
    x = x + causal_self_attention(
        params.attention, a, positions, cfg, implementation=implementation
    )
    return ffn_residual(params, x, cfg=cfg, implementation=implementation)


# ------------------------------------------------------------------------------------------
# Random initialisation.
#
# Builders take `draw(shape) -> f32 N(0, 1)` instead of keys: `with_normal_draws` slices every
# draw out of ONE `jax.random.normal` call. Each RNG call is its own threefry program, and
# compiling one per weight dominated the initialiser's cost.

Draw = Callable[[tuple[int, ...]], jax.Array]


def with_normal_draws[T](key: jax.Array, build: Callable[[Draw], T]) -> T:
    """Runs ``build(draw)`` with every ``draw(shape)`` sliced from one N(0, 1) sample of ``key``.

    The draws' sizes are found by tracing ``build`` abstractly first (``jax.eval_shape``), so
    ``build`` must draw the same shapes in the same order each time (any pure builder does).
    """
    sizes: list[int] = []

    def count(shape):
        sizes.append(math.prod(shape))
        return jnp.zeros(shape, jnp.float32)

    jax.eval_shape(lambda: build(count))
    sample = jax.random.normal(key, (sum(sizes),), jnp.float32)
    offset = 0

    def draw(shape):
        nonlocal offset
        size = math.prod(shape)
        out = jax.lax.slice_in_dim(sample, offset, offset + size).reshape(shape)
        offset += size
        return out

    return build(draw)


def init_projection(
    draw: Draw,
    shape: tuple[int, ...],
    projection: Projection,
    precision: Precision | str,
    *,
    dense_ffn: bool,
) -> Weight:
    """A random ``[..., N, K]`` projection, std ``1/sqrt(K)``, stored per ``projection_format``.

    With unit-RMS inputs (every projection here reads a normed or O(1) vector) the outputs stay
    O(1), so activations neither vanish nor blow up through the layer.
    """
    w = draw(shape) * shape[-1] ** -0.5
    return quantize_weight(w, projection_format(projection, precision, dense_ffn=dense_ffn))


def init_norm(draw: Draw, size: int) -> jax.Array:
    """A bf16 [size] norm weight ~ N(0, 0.1^2).

    Small but non-zero: a zero-centred norm with w = 0 is the identity, which would hide a wrong
    ``(1 + w)`` vs ``w`` convention from every test.
    """
    return (0.1 * draw((size,))).astype(jnp.bfloat16)


def _init_dense_ffn(
    draw: Draw,
    lead: tuple[int, ...],
    hidden: int,
    width: int,
    roles: tuple[Projection, Projection, Projection],
    precision: Precision,
    dense: bool,
) -> DenseFfnParams:
    """gate/up [*lead, I, H] and down [*lead, H, I], stored per the formats of ``roles``."""
    gate, up, down = roles
    return DenseFfnParams(
        gate_proj=init_projection(draw, (*lead, width, hidden), gate, precision, dense_ffn=dense),
        up_proj=init_projection(draw, (*lead, width, hidden), up, precision, dense_ffn=dense),
        down_proj=init_projection(draw, (*lead, hidden, width), down, precision, dense_ffn=dense),
    )


def build_decoder_layer(cfg: Any, draw: Draw, precision: Precision) -> DecoderLayerParams:
    """Random layer weights from ``draw`` (see ``init_decoder_layer``)."""
    dense = cfg.ffn is FfnKind.DENSE
    H = cfg.hidden_size

    def proj(shape, role):
        return init_projection(draw, shape, role, precision, dense_ffn=dense)

    attention = AttentionParams(
        q_proj=proj((cfg.q_proj_width, H), Projection.Q_PROJ),
        k_proj=proj((cfg.kv_width, H), Projection.K_PROJ),
        v_proj=proj((cfg.kv_width, H), Projection.V_PROJ),
        o_proj=proj((H, cfg.num_attention_heads * cfg.head_dim), Projection.O_PROJ),
        q_norm=init_norm(draw, cfg.head_dim) if cfg.qk_norm else None,
        k_norm=init_norm(draw, cfg.head_dim) if cfg.qk_norm else None,
    )
    if dense:
        roles = (Projection.GATE_PROJ, Projection.UP_PROJ, Projection.DOWN_PROJ)
        ffn: DenseFfnParams | MoeFfnParams = _init_dense_ffn(
            draw, (), H, cfg.intermediate_size, roles, precision, dense
        )
    else:
        moe = cfg.moe
        router = proj((moe.num_experts, H), Projection.ROUTER)
        experts = _init_dense_ffn(
            draw,
            (moe.num_experts,),
            H,
            moe.moe_intermediate_size,
            (Projection.EXPERTS,) * 3,
            precision,
            dense,
        )
        shared = shared_gate = None
        if moe.has_shared_expert:
            shared = _init_dense_ffn(
                draw,
                (),
                H,
                moe.shared_expert_intermediate_size,
                (Projection.SHARED_EXPERT,) * 3,
                precision,
                dense,
            )
            if moe.shared_expert_gate:
                shared_gate = proj((1, H), Projection.SHARED_EXPERT_GATE)
        ffn = MoeFfnParams(
            router=router, experts=experts, shared_expert=shared, shared_expert_gate=shared_gate
        )
    return DecoderLayerParams(
        input_layernorm=init_norm(draw, H),
        attention=attention,
        post_attention_layernorm=init_norm(draw, H),
        ffn=ffn,
    )


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_decoder_layer(cfg: Any, key: jax.Array, precision: Precision) -> DecoderLayerParams:
    return with_normal_draws(key, lambda draw: build_decoder_layer(cfg, draw, precision))


def init_decoder_layer(
    cfg: Any, *, key: jax.Array, precision: Precision | str = Precision.BF16
) -> DecoderLayerParams:
    """Random layer weights for ``cfg`` (a hashable config) with each projection stored per
    ``projection_format``; one jitted program.

    Projections have std ``1/sqrt(fan_in)``; norm weights are bf16 (as in checkpoints); the MoE
    router and shared-expert gate are BF16.
    """
    return _init_decoder_layer(cfg, key, parse_precision(precision))
