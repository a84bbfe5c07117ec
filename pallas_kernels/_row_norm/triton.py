"""Triton backend of the row norms: every row reduced by the same program, whatever the row count.

XLA picks a reduction's tiling (and so the order its sums are added in) from the whole shape, so
XLA:GPU can round a row's RMSNorm differently in a call of 8 rows than in one of 16. Here each
program normalises ``rows_per_program`` rows of one ``[rows_per_program, N_pad]`` tile; the tile
and its reduction depend on N alone, so a row's result never depends on how many rows share the
call (greedy speculation's exactness against one-row decoding rests on that).

Shapes: x f32[R, N], weight f32[N] (optional) -> f32[R, N].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

name = "triton"
#: Elements of one program's tile (rows x padded N), at most.
TILE_ELEMENTS = 8192


def supported_on(device) -> bool:
    """Whether the kernel compiles for ``device`` (any GPU; elsewhere only interpret mode)."""
    return device.platform == "gpu"


def _kernel(*refs, n, rows, eps, mean, weight_mode):
    if weight_mode == "none":
        x_ref, o_ref = refs
        w_ref = None
    else:
        x_ref, w_ref, o_ref = refs
    n_pad = C.next_pow2(n)
    r0 = pl.program_id(0) * rows
    row = r0 + jnp.arange(rows, dtype=jnp.int32)
    col = jnp.arange(n_pad, dtype=jnp.int32)
    mask = (row < x_ref.shape[0])[:, None] & (col < n)[None, :]
    idx = (row[:, None], col[None, :])
    x = plgpu.load(x_ref.at[idx], mask=mask, other=0.0)
    ss = jnp.sum(x * x, axis=1)
    if mean:
        ss = ss / jnp.float32(n)
    y = x * jax.lax.rsqrt(ss + jnp.float32(eps))[:, None]
    if w_ref is not None:
        w = plgpu.load(w_ref.at[col], mask=col < n, other=0.0)
        y = y * ((1.0 + w) if weight_mode == "zero_centered" else w)[None, :]
    plgpu.store(o_ref.at[idx], y, mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "mean", "zero_centered", "interpret"))
def row_norm(
    x: jax.Array,
    weight: jax.Array | None,
    *,
    eps: float,
    mean: bool,
    zero_centered: bool,
    interpret: bool = False,
) -> jax.Array:
    """The kernel over ``x: [..., N]``: f32[..., N] (see ``row_norm_reference``)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).astype(jnp.float32)
    r = x2.shape[0]
    rows = max(1, TILE_ELEMENTS // C.next_pow2(n))
    ins = [x2]
    mode = "none"
    if weight is not None:
        ins.append(weight.astype(jnp.float32))
        mode = "zero_centered" if zero_centered else "plain"
    kernel = functools.partial(_kernel, n=n, rows=rows, eps=float(eps), mean=mean, weight_mode=mode)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((r, n), jnp.float32),
        grid=(C.cdiv(r, rows),),
        compiler_params=plgpu.CompilerParams(num_warps=4 if n <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="row_norm",
    )(*ins)
    return out.reshape(x.shape)
