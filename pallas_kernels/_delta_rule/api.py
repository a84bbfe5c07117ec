"""``recurrent_delta_rule``: the gated delta rule over a step's positions, one dispatch.

AUTO takes the Triton kernel on a GPU when it takes the operands (a row's result does not depend
on the step's row count, see ``triton``), else the reference; PALLAS or TRITON the kernel
(interpret mode off-GPU); XLA the reference. Shapes as ``triton``'s.
"""

from __future__ import annotations

import jax

from pallas_kernels import _common as C
from pallas_kernels._delta_rule import triton
from pallas_kernels._delta_rule.reference import check_operands, recurrent_delta_rule_reference
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
