"""Pure-jnp recurrent gated delta rule: the XLA path of ``recurrent_delta_rule`` and its oracle.

Per value head, with a state ``S: f32[dk, dv]`` and per position ``q, k: [dk]`` (L2-normalised,
q scaled), ``v: [dv]``, ``g <= 0`` (log decay) and ``beta`` in (0, 1):

    S <- S * exp(g);   u = beta * (v - k^T S);   S <- S + k u^T;   o = q^T S

In F32 at HIGHEST matmul precision (a GPU's default would round operands to TF32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def check_operands(q, k, v, g, beta, state) -> None:
    """One clear ValueError for operands no path can take."""
    B, T, Hv, dk = q.shape
    dv = v.shape[-1]
    want = dict(
        k=(B, T, Hv, dk), v=(B, T, Hv, dv), g=(B, T, Hv), beta=(B, T, Hv), state=(B, Hv, dk, dv)
    )
    for name, a in dict(k=k, v=v, g=g, beta=beta, state=state).items():
        if a.shape != want[name]:
            raise ValueError(
                f"delta rule: {name} must be {list(want[name])} for q {list(q.shape)}, got "
                f"{list(a.shape)}"
            )


def check_stacked_operands(q, k, v, g, beta, snapshots, layer, select) -> None:
    """One clear ValueError for stacked operands no path can take (the rest as
    :func:`check_operands`, against the snapshots' per-sequence shape)."""
    B, T, Hv, dk = q.shape
    dv = v.shape[-1]
    if snapshots.ndim != 6 or snapshots.shape[1] != B or snapshots.shape[3:] != (Hv, dk, dv):
        raise ValueError(
            f"delta rule: snapshots must be [layers, {B}, W, {Hv}, {dk}, {dv}] for q "
            f"{list(q.shape)} and v {list(v.shape)}, got {list(snapshots.shape)}"
        )
    if snapshots.shape[2] < T:
        raise ValueError(
            f"delta rule: the snapshots keep W={snapshots.shape[2]} states a sequence, fewer "
            f"than the step's T={T} positions"
        )
    if snapshots.dtype != jnp.float32:
        raise ValueError(f"delta rule: snapshots must be float32, got {snapshots.dtype}")
    if jnp.shape(layer) != ():
        raise ValueError(f"delta rule: layer must be a scalar, got shape {jnp.shape(layer)}")
    if select.shape != (B,) or not jnp.issubdtype(select.dtype, jnp.integer):
        raise ValueError(
            f"delta rule: select must be int32[{B}], got {select.dtype}{list(select.shape)}"
        )
    check_operands(q, k, v, g, beta, jnp.zeros((B, Hv, dk, dv), jnp.float32))


def delta_step(s, xs):
    """One position for every sequence and head: state s f32[B, Hv, dk, dv] and (q, k
    [B, Hv, dk], v [B, Hv, dv], g, beta [B, Hv]) -> (new state, o f32[B, Hv, dv])."""
    q_t, k_t, v_t, g_t, b_t = xs
    s = s * jnp.exp(g_t)[..., None, None]
    kv = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HI)
    u = (v_t - kv) * b_t[..., None]
    s = s + k_t[..., :, None] * u[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HI)
    return s, o


def recurrent_delta_rule_reference(q, k, v, g, beta, state):
    """One position at a time, a ``lax.scan`` over T: q, k [B, T, Hv, dk], v [B, T, Hv, dv],
    g, beta [B, T, Hv], state f32[B, Hv, dk, dv] -> (o f32[B, T, Hv, dv], the state after each
    position f32[B, T, Hv, dk, dv])."""

    def body(s, xs):
        s, o = delta_step(s, xs)
        return s, (o, s)

    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta))
    _, (o, states) = jax.lax.scan(body, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def recurrent_delta_rule_stacked_reference(q, k, v, g, beta, snapshots, layer, select):
    """The delta rule from snapshot ``select[b]`` of layer ``layer`` of a stack of snapshots
    f32[layers, B, W, Hv, dk, dv], its T states written back at snapshots 0..T-1 of that layer:
    (o f32[B, T, Hv, dv], the updated stack)."""
    b = jnp.arange(q.shape[0])
    s0 = snapshots[layer, b, select]
    o, states = recurrent_delta_rule_reference(q, k, v, g, beta, s0)
    at = (jnp.asarray(layer, jnp.int32), *(jnp.int32(0),) * 5)
    return o, jax.lax.dynamic_update_slice(snapshots, states[None], at)
