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
