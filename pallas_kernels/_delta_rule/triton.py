"""Triton backend of the recurrent delta rule: one program per (sequence, value head) walks the
step's T positions with the state in registers.

XLA compiles a one-position step without its loop (a trip count of one is unrolled away) and a
several-position step with it, and rounds the two differently: the contractions ``k^T S`` and
``q^T S`` take other fusions. Here every position runs the same loop body over the same
``[dk, dv]`` tile, and the trip count is a run-time value (no compiler specialises the loop on
it), so a row's output and state do not depend on how many rows the step has.

Shapes: q, k f32[B, T, Hv, dk]; v f32[B, T, Hv, dv]; g, beta f32[B, T, Hv]; state
f32[B, Hv, dk, dv] -> (o f32[B, T, Hv, dv], states f32[B, T, Hv, dk, dv]). dk and dv are powers
of two.

Stacked (:func:`recurrent_delta_rule_stacked`): the states live in a model's stack of snapshots
f32[layers, B, W, Hv, dk, dv]; a program reads its initial state at ``[layer, b, select[b], h]``
and writes the state after position t at ``[layer, b, t, h]``, into the stack itself (an aliased
output). A scan over the layers then neither gathers a layer's initial states out nor copies its
new ones in: at B = 32 and four snapshots of 48 heads of 128 x 128 those copies are 400 MB a
layer. Reading and writing one buffer is safe: no two programs touch the same (b, h), and every
element a program writes is computed from the element of its initial state at the same place
(and the rest of that column, through ``k^T S``), so no write can overtake the read of the
snapshot it may overwrite (``select[b] < T``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C
from pallas_kernels._delta_rule.reference import check_operands, check_stacked_operands

name = "triton"


def supported_on(device) -> bool:
    """Whether the kernel compiles for ``device`` (any GPU; elsewhere only interpret mode)."""
    return device.platform == "gpu"


def supports(q: jax.Array, v: jax.Array) -> str | None:
    """Why the kernel cannot take these operands, or None when it can."""
    dk, dv = q.shape[-1], v.shape[-1]
    if not (C.is_pow2(dk) and C.is_pow2(dv) and dk >= 16 and dv >= 16):
        return f"the kernel needs power-of-two head dims >= 16, got dk={dk}, dv={dv}"
    return None


def _kernel(steps_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, st_ref):
    b, h = pl.program_id(0), pl.program_id(1)

    def keep(t, s):
        st_ref[b, t, h] = s

    _walk(steps_ref[0], q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref[b, h], o_ref, keep)


def _stacked_kernel(
    steps_ref, layer_ref, select_ref, q_ref, k_ref, v_ref, g_ref, b_ref, snap_in, o_ref, snap_out
):
    del snap_in  # the same buffer as snap_out
    b, h = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    def keep(t, s):
        snap_out[layer, b, t, h] = s

    s0 = snap_out[layer, b, select_ref[b], h]
    _walk(steps_ref[0], q_ref, k_ref, v_ref, g_ref, b_ref, s0, o_ref, keep)


def _walk(steps, q_ref, k_ref, v_ref, g_ref, b_ref, s0, o_ref, keep):
    """The program's positions from state ``s0`` f32[dk, dv]; ``keep(t, s)`` stores the state
    after position t."""
    b, h = pl.program_id(0), pl.program_id(1)

    def body(t, s):
        k_t = k_ref[b, t, h]  # [dk]
        s = s * jnp.exp(g_ref[b, t, h])
        kv = jnp.sum(k_t[:, None] * s, axis=0)  # [dv]
        u = (v_ref[b, t, h] - kv) * b_ref[b, t, h]
        s = s + k_t[:, None] * u[None, :]
        o_ref[b, t, h] = jnp.sum(q_ref[b, t, h][:, None] * s, axis=0)
        keep(t, s)
        return s

    # The trip count is read at run time: no compiler can unroll a one-position loop away.
    jax.lax.fori_loop(0, steps, body, s0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def recurrent_delta_rule(q, k, v, g, beta, state, *, interpret: bool = False):
    """The kernel (shapes in the module docstring)."""
    check_operands(q, k, v, g, beta, state)
    if (reason := supports(q, v)) is not None:
        raise ValueError(reason)
    B, T, Hv, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    ins = [a.astype(f32) for a in (q, k, v, g, beta, state)]
    steps = jnp.full((1,), T, jnp.int32)
    return pl.pallas_call(
        _kernel,
        out_shape=(
            jax.ShapeDtypeStruct((B, T, Hv, dv), f32),
            jax.ShapeDtypeStruct((B, T, Hv, dk, dv), f32),
        ),
        grid=(B, Hv),
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="recurrent_delta_rule",
    )(steps, *ins)


@functools.partial(jax.jit, static_argnames=("interpret",))
def recurrent_delta_rule_stacked(
    q, k, v, g, beta, snapshots, layer, select, *, interpret: bool = False
):
    """The stacked kernel (module docstring): (o f32[B, T, Hv, dv], the updated snapshots)."""
    check_stacked_operands(q, k, v, g, beta, snapshots, layer, select)
    if (reason := supports(q, v)) is not None:
        raise ValueError(reason)
    B, T, Hv, _ = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    ins = [a.astype(f32) for a in (q, k, v, g, beta)]
    steps = jnp.full((1,), T, jnp.int32)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    select = jnp.asarray(select, jnp.int32)
    return pl.pallas_call(
        _stacked_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((B, T, Hv, dv), f32),
            jax.ShapeDtypeStruct(snapshots.shape, f32),
        ),
        grid=(B, Hv),
        input_output_aliases={8: 1},  # snapshots -> the second output
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="recurrent_delta_rule",
    )(steps, layer, select, *ins, snapshots)
