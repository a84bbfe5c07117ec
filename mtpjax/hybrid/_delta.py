"""The gated delta rule (chunked for prefill, recurrent for steps) and the causal depthwise conv.

Per value head, with a state ``S: f32[dk, dv]`` and per position inputs ``q, k: [dk]`` (already
L2-normalised, q scaled by 1/sqrt(dk)), ``v: [dv]``, ``g <= 0`` (log decay) and ``beta`` in
(0, 1):

    S <- S * exp(g);   u = beta * (v - k^T S);   S <- S + k u^T;   o = q^T S

A position with ``beta = 0`` and ``g = 0`` leaves S unchanged (ragged padding).

The chunked form computes the same over chunks of C positions. Inside a chunk with starting
state S0 and cumulative log decay ``c_i = g_0 + .. + g_i``:

    S_i = exp(c_i) S0 + sum_{j<=i} exp(c_i - c_j) k_j u_j^T
    u_i = beta_i (v_i - exp(c_i) k_i^T S0) - sum_{j<i} beta_i exp(c_i - c_j) (k_i . k_j) u_j

so ``(I + A) U = beta V - beta exp(c) K S0`` with ``A`` strictly lower triangular, solved once
per chunk for both right-hand sides (``U = W_v - W_k S0``); then
``o_i = exp(c_i) q_i^T S0 + sum_{j<=i} exp(c_i - c_j) (q_i . k_j) u_j`` and the state after the
chunk is ``exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T``. A ``lax.scan`` carries S from
chunk to chunk. Exponents are only taken of ``c_i - c_j`` with ``j <= i`` (never positive).

Shapes: ``B`` sequences, ``T`` positions, ``Hv`` value heads (keys and queries already repeated
to them), ``dk`` / ``dv`` key / value head dims, ``C`` conv channels, ``K`` conv kernel.
All math is F32 at HIGHEST matmul precision (a GPU's default would round operands to TF32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import Implementation
from pallas_kernels._delta_rule.reference import delta_step

__all__ = [
    "causal_conv",
    "chunked_delta_rule",
    "l2_normalize",
    "recurrent_delta_rule",
    "tree_delta_rule",
]

_HI = jax.lax.Precision.HIGHEST


def l2_normalize(
    x: jax.Array, eps: float = 1e-6, *, implementation: Implementation | str = Implementation.XLA
) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in F32 (the eps of transformers' FLA-
    compatible ``l2norm``); ``implementation`` as ``mtpjax.layers.rms_norm``'s."""
    return pk.l2_normalize(x, eps=eps, implementation=implementation)


def causal_conv(x: jax.Array, weight: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Depthwise causal conv with SiLU: x f32[B, K-1+T, C] (K-1 rows of history, then T new
    inputs), weight [C, 1, K] -> f32[B, T, C].

    ``out[t] = silu(sum_j weight[:, 0, j] * x[t + j])``: tap K-1 meets the newest input. The taps
    are summed in order, one elementwise pass each, so a row's value does not depend on how
    many rows share the call. ``rows`` int32[T, K] replaces ``t + j`` by ``rows[t, j]`` (a draft
    tree's rows read their own ancestors' inputs), with the same arithmetic.
    """
    K = weight.shape[-1]
    T = x.shape[1] - (K - 1)
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]

    def tap(j):
        return x[:, j : j + T] if rows is None else x[:, rows[:, j]]

    acc = tap(0) * w[:, 0]
    for j in range(1, K):
        acc = acc + tap(j) * w[:, j]
    return jax.nn.silu(acc)


def recurrent_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    implementation: Implementation | str = Implementation.XLA,
) -> tuple[jax.Array, jax.Array]:
    """One position at a time. XLA (this function's default): a ``lax.scan`` over T, which XLA
    unrolls away at T = 1 and so may round a one-row step's row differently from the same row in
    a longer step. AUTO / PALLAS: on a GPU ``pallas_kernels.recurrent_delta_rule``'s kernel, in
    which every position runs the same loop body (a row's result independent of the step's row
    count). The hybrid target's chain steps run the same kernel over their stack of snapshots
    (``pallas_kernels.recurrent_delta_rule_stacked``, updated in place).

    q, k: [B, T, Hv, dk]; v: [B, T, Hv, dv]; g, beta: [B, T, Hv]; state: f32[B, Hv, dk, dv].
    Returns (o f32[B, T, Hv, dv], states f32[B, T, Hv, dk, dv]: the state after each position).
    """
    return pk.recurrent_delta_rule(q, k, v, g, beta, state, implementation=implementation)


def tree_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    parents: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The delta rule over a draft tree: node i continues from its parent's state (``state``
    for the root, ``parents[i] = -1``), so every root-to-leaf path sees exactly the recurrence
    of a chain over its tokens. A ``lax.scan`` over the nodes in order (``parents[i] < i``)
    with the step of ``recurrent_delta_rule``, so a node's result is the one a chain row over
    the same inputs gets.

    Shapes as ``recurrent_delta_rule`` with T = S nodes; parents: int32[S]. Returns (o f32[B,
    S, Hv, dv], states f32[B, S, Hv, dk, dv]: the state after each node).
    """
    S = q.shape[1]
    state = state.astype(jnp.float32)
    # Slot 0 holds the state before the tree, slot i + 1 the state after node i.
    buffer = jnp.zeros((S + 1, *state.shape), jnp.float32).at[0].set(state)

    def body(buffer, xs):
        i, parent, step_inputs = xs
        s, o = delta_step(buffer[parent + 1], step_inputs)
        return buffer.at[i + 1].set(s), o

    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta))
    nodes = jnp.arange(S, dtype=jnp.int32)
    buffer, o = jax.lax.scan(body, buffer, (nodes, jnp.asarray(parents, jnp.int32), xs))
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(buffer[1:], 0, 1)


def chunked_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """The delta rule over chunks of ``chunk_size`` positions (see the module docstring).

    Shapes as ``recurrent_delta_rule``; T is padded to a multiple of the chunk with positions
    that leave the state unchanged. Returns (o f32[B, T, Hv, dv], final state f32[B, Hv, dk,
    dv]).
    """
    B, T, Hv = g.shape
    dv = v.shape[-1]
    Cn = chunk_size
    N = -(-T // Cn)
    pad = N * Cn - T

    def chunks(a: jax.Array) -> jax.Array:
        # [B, T, Hv, ...] -> [B, Hv, N, Cn, ...]
        a = jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(B, N, Cn, *a.shape[2:])
        return jnp.moveaxis(a, 3, 1)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    c = jnp.cumsum(g, axis=-1)  # [B, Hv, N, Cn]
    i = jnp.arange(Cn)
    causal = i[:, None] >= i[None, :]  # j <= i
    strict = i[:, None] > i[None, :]
    diff = c[..., :, None] - c[..., None, :]
    decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))  # exp(c_i - c_j), 0 above the diagonal
    kk = jnp.einsum("...ik,...jk->...ij", k, k, precision=_HI)
    A = jnp.where(strict, beta[..., :, None] * decay * kk, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(c))[..., None] * k], axis=-1)
    sol = jax.scipy.linalg.solve_triangular(A, rhs, lower=True, unit_diagonal=True)
    w_v, w_k = sol[..., :dv], sol[..., dv:]  # U = w_v - w_k @ S0
    qk = jnp.einsum("...ik,...jk->...ij", q, k, precision=_HI) * decay
    q_decay = q * jnp.exp(c)[..., None]
    k_tail = k * jnp.exp(c[..., -1:] - c)[..., None]
    last = jnp.exp(c[..., -1])[..., None, None]  # [B, Hv, N, 1, 1]

    def body(s, xs):
        w_v, w_k, qk, q_decay, k_tail, last = xs
        u = w_v - jnp.einsum("bhik,bhkv->bhiv", w_k, s, precision=_HI)
        o = jnp.einsum("bhik,bhkv->bhiv", q_decay, s, precision=_HI)
        o = o + jnp.einsum("bhij,bhjv->bhiv", qk, u, precision=_HI)
        s = last * s + jnp.einsum("bhik,bhiv->bhkv", k_tail, u, precision=_HI)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (w_v, w_k, qk, q_decay, k_tail, last))
    s, o = jax.lax.scan(body, state.astype(jnp.float32), xs)  # o: [N, B, Hv, Cn, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, Hv, N * Cn, dv)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), s
