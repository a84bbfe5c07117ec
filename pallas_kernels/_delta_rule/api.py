"""``recurrent_delta_rule``: the gated delta rule over a step's positions, one dispatch.

AUTO takes the Triton kernel on a GPU when it takes the operands (a row's result does not depend
on the step's row count, see ``triton``), else the reference; PALLAS or TRITON the kernel
(interpret mode off-GPU); XLA the reference. Shapes as ``triton``'s.
"""

from __future__ import annotations

import jax

from pallas_kernels import _common as C
from pallas_kernels._delta_rule import triton
from pallas_kernels._delta_rule.reference import (
    check_operands,
    check_stacked_operands,
    recurrent_delta_rule_reference,
    recurrent_delta_rule_stacked_reference,
)
from pallas_kernels.implementation import Implementation


def recurrent_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, jax.Array]:
    """(o f32[B, T, Hv, dv], the state after each position f32[B, T, Hv, dk, dv])."""
    check_operands(q, k, v, g, beta, state)
    if not C.runs_triton_kernel(implementation, triton.supports(q, v), op="delta rule"):
        return recurrent_delta_rule_reference(q, k, v, g, beta, state)
    interpret = not triton.supported_on(C.default_device())
    return triton.recurrent_delta_rule(q, k, v, g, beta, state, interpret=interpret)


def recurrent_delta_rule_stacked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    snapshots: jax.Array,
    *,
    layer: jax.Array,
    select: jax.Array,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, jax.Array]:
    """The delta rule over a stack of snapshots f32[layers, B, W, Hv, dk, dv] (T <= W): each
    sequence b starts from snapshot ``select[b]`` (int32[B]) of layer ``layer`` (int32[]), and
    the states after its T positions become that layer's snapshots 0..T-1. Returns (o f32[B, T,
    Hv, dv], the updated stack); the kernel updates the stack in place when the caller donates
    it (a model step's scan over its layers)."""
    check_stacked_operands(q, k, v, g, beta, snapshots, layer, select)
    if not C.runs_triton_kernel(implementation, triton.supports(q, v), op="delta rule"):
        return recurrent_delta_rule_stacked_reference(q, k, v, g, beta, snapshots, layer, select)
    interpret = not triton.supported_on(C.default_device())
    return triton.recurrent_delta_rule_stacked(
        q, k, v, g, beta, snapshots, layer, select, interpret=interpret
    )
