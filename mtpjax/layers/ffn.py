"""Feed-forward blocks: SwiGLU dense FFN and the routed MoE with an optional shared expert.

Routers: Qwen's softmax over all experts then top-k; DeepSeek-V3 / GLM-4.5's sigmoid scores, with
the ``e_score_correction_bias`` added for the choice only and the choice restricted to the best
``topk_group`` of ``n_group`` expert groups, weighted by the unbiased scores and
``routed_scaling_factor``. Qwen gates its shared expert by a sigmoid; DeepSeek / GLM add it ungated.

Shapes: `[T]` rows (any leading dims are flattened), `H` hidden, `I` expert width, `E` experts,
`k` experts per token, `G` expert groups.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mtpjax.config import RouterScoring
from mtpjax.weights import Weight, linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseFfnParams:
    """gate_proj, up_proj: [I, H]; down_proj: [H, I]. Stacked [E, ...] when used as experts."""

    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeFfnParams:
    """router: [E, H]; experts: DenseFfnParams stacked on a leading [E] axis;
    shared_expert: DenseFfnParams or None; shared_expert_gate: [1, H] or None;
    score_correction_bias: f32[E] (DeepSeek/GLM ``e_score_correction_bias``) or None."""

    router: Weight
    experts: DenseFfnParams
    shared_expert: DenseFfnParams | None = None
    shared_expert_gate: Weight | None = None
    score_correction_bias: jax.Array | None = None

    @property
    def num_experts(self) -> int:
        return self.router.out_features


def dense_ffn(params: DenseFfnParams, y: jax.Array, *, implementation="auto") -> jax.Array:
    """down(silu(gate(y)) * up(y)): [..., H] -> f32[..., H]."""
    g = linear(y, params.gate_proj, out_dtype=jnp.float32, implementation=implementation)
    u = linear(y, params.up_proj, out_dtype=jnp.float32, implementation=implementation)
    return linear(
        jax.nn.silu(g) * u, params.down_proj, out_dtype=jnp.float32, implementation=implementation
    )


def route(
    router_logits: jax.Array,
    *,
    top_k: int,
    normalize: bool,
    scoring: RouterScoring = RouterScoring.SOFTMAX,
    correction_bias: jax.Array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Expert weights and ids of each row: router_logits [T, E] -> (f32[T, k], int32[T, k]).

    Scores are ``softmax`` over all experts or a per-expert ``sigmoid`` of the logits, in F32.
    The top-k is taken over the scores plus ``correction_bias`` f32[E] (selection only: the
    weights are the scores themselves), among the experts of the ``topk_group`` best of
    ``n_group`` equal contiguous groups (a group's value: the sum of its two best biased scores
    with a correction bias, as DeepSeek-V3 / GLM-4.5's ``noaux_tc``; else its best score, as
    DeepSeek-V2's group-limited greedy). The weights are divided by their sum when
    ``normalize``, then multiplied by ``routed_scaling_factor``.
    """
    logits = router_logits.astype(jnp.float32)
    if scoring is RouterScoring.SOFTMAX:
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, n_group, E // n_group)
        if correction_bias is None:
            group_value = jnp.max(grouped, axis=-1)
        else:
            group_value = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, best = jax.lax.top_k(group_value, topk_group)  # [T, topk_group]
        keep = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, E // n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        # The reference's guard: sigmoid weights can all be ~0 (softmax ones never are).
        tiny = 0.0 if scoring is RouterScoring.SOFTMAX else 1e-20
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + tiny)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def mix_experts(
    experts: DenseFfnParams,
    y: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    *,
    implementation="auto",
) -> jax.Array:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(y[t])`` over experts stacked [E, ...]: y [T, H],
    weights f32[T, k], ids int32[T, k] in [0, E) -> f32[T, H].

    With few rows (decode: T*k <= E) only the chosen experts' weights are gathered and read;
    otherwise every expert runs on every row and the routing weights select (prefill, training).
    """
    (T, H), top_k = y.shape, ids.shape[-1]
    num_experts = jax.tree.leaves(experts)[0].shape[0]
    expert = functools.partial(dense_ffn, implementation=implementation)
    if T * top_k <= num_experts:
        chosen = jax.tree.map(lambda a: a[ids.reshape(-1)], experts)
        rows = jnp.repeat(y, top_k, axis=0)
        out = jax.vmap(lambda w, x: expert(w, x[None])[0])(chosen, rows).reshape(T, top_k, H)
        return jnp.sum(weights[..., None] * out, axis=1)
    every = jax.vmap(expert, in_axes=(0, None))(experts, y)  # [E, T, H]
    dense_w = jnp.zeros((T, num_experts), jnp.float32)
    dense_w = dense_w.at[jnp.arange(T)[:, None], ids].add(weights)
    return jnp.einsum("te,eth->th", dense_w, every)


def moe_ffn(
    params: MoeFfnParams,
    y: jax.Array,
    *,
    top_k: int,
    normalize: bool,
    scoring: RouterScoring = RouterScoring.SOFTMAX,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    implementation="auto",
    mix: Callable[..., jax.Array] | None = None,
) -> jax.Array:
    """sum_k w_k * expert_k(y) + [sigmoid(shared_gate(y))] * shared(y): [..., H] -> f32[..., H].

    Routing as ``route`` (with ``params.score_correction_bias``), the experts as ``mix_experts``
    or ``mix`` (same signature; the expert-parallel drafter's runs each device's experts).
    """
    lead, H = y.shape[:-1], y.shape[-1]
    y2 = y.reshape(-1, H)
    logits = linear(y2, params.router, out_dtype=jnp.float32, implementation=implementation)
    weights, ids = route(
        logits,
        top_k=top_k,
        normalize=normalize,
        scoring=scoring,
        correction_bias=params.score_correction_bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
    )
    expert = functools.partial(dense_ffn, implementation=implementation)
    mix = mix_experts if mix is None else mix
    routed = mix(params.experts, y2, weights, ids, implementation=implementation)
    if params.shared_expert is not None:
        shared = expert(params.shared_expert, y2)
        if params.shared_expert_gate is not None:
            gate = linear(
                y2, params.shared_expert_gate, out_dtype=jnp.float32, implementation=implementation
            )
            shared = jax.nn.sigmoid(gate) * shared
        routed = routed + shared
    return routed.reshape(*lead, H)
