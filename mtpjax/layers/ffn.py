"""Feed-forward blocks: SwiGLU dense FFN and the Qwen-style MoE with a gated shared expert.

Shapes: `[T]` rows (any leading dims are flattened), `H` hidden, `I` expert width, `E` experts,
`k` experts per token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

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
    shared_expert: DenseFfnParams or None; shared_expert_gate: [1, H] or None."""

    router: Weight
    experts: DenseFfnParams
    shared_expert: DenseFfnParams | None = None
    shared_expert_gate: Weight | None = None

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


def route(router_logits: jax.Array, *, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts in F32, then top-k (renormalised to sum 1 when `normalize`).

    router_logits: [T, E] -> (weights f32[T, k], expert ids int32[T, k]).
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def moe_ffn(
    params: MoeFfnParams, y: jax.Array, *, top_k: int, normalize: bool, implementation="auto"
) -> jax.Array:
    """sum_k w_k * expert_k(y) + sigmoid(shared_gate(y)) * shared(y): [..., H] -> f32[..., H].

    With few rows (decode: T*k <= E) only the chosen experts' weights are gathered and read;
    otherwise every expert runs on every row and the routing weights select (prefill, training).
    """
    lead, H = y.shape[:-1], y.shape[-1]
    y2 = y.reshape(-1, H)
    T = y2.shape[0]
    logits = linear(y2, params.router, out_dtype=jnp.float32, implementation=implementation)
    weights, ids = route(logits, top_k=top_k, normalize=normalize)
    expert = functools.partial(dense_ffn, implementation=implementation)
    if T * top_k <= params.num_experts:
        chosen = jax.tree.map(lambda a: a[ids.reshape(-1)], params.experts)
        rows = jnp.repeat(y2, top_k, axis=0)
        out = jax.vmap(lambda w, x: expert(w, x[None])[0])(chosen, rows).reshape(T, top_k, H)
        routed = jnp.sum(weights[..., None] * out, axis=1)
    else:
        every = jax.vmap(expert, in_axes=(0, None))(params.experts, y2)  # [E, T, H]
        dense_w = jnp.zeros((T, params.num_experts), jnp.float32)
        dense_w = dense_w.at[jnp.arange(T)[:, None], ids].add(weights)
        routed = jnp.einsum("te,eth->th", dense_w, every)
    if params.shared_expert is not None:
        shared = expert(params.shared_expert, y2)
        if params.shared_expert_gate is not None:
            gate = linear(
                y2, params.shared_expert_gate, out_dtype=jnp.float32, implementation=implementation
            )
            shared = jax.nn.sigmoid(gate) * shared
        routed = routed + shared
    return routed.reshape(*lead, H)
