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
    impl = Implementation.parse(implementation)
    if impl is Implementation.MOSAIC_GPU:
        raise NotImplementedError("the delta rule has no Mosaic GPU backend; use triton")
    check_operands(q, k, v, g, beta, state)
    reason = triton.supports(q, v)
    on_gpu = triton.supported_on(C.default_device())
    if impl in (Implementation.PALLAS, Implementation.TRITON) and reason is not None:
        raise NotImplementedError(f"no Pallas delta rule for these operands: {reason}")
    kernel = impl in (Implementation.PALLAS, Implementation.TRITON) or (
        impl is Implementation.AUTO and on_gpu and reason is None
    )
    if not kernel:
        return recurrent_delta_rule_reference(q, k, v, g, beta, state)
    return triton.recurrent_delta_rule(q, k, v, g, beta, state, interpret=not on_gpu)
