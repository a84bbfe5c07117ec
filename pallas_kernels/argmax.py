"""Batched argmax with the top-1 log-probability, over a large vocabulary.

``argmax_logprob(logits[M, V]) -> (idx int32[M], logprob f32[M])`` with
``logprob = logit_max - logsumexp(logits)`` in F32 and ties resolved to the lowest index (as
``jnp.argmax``). One pass over the logits: the grid is rows x ``splits`` vocabulary slices; each
lane of a program keeps its own running max, first index of that max and sum of
``exp(x - max)`` (one exponential per element), reduced across lanes once at the end; the
``splits`` partial results of a row are merged in a few ``jnp`` ops on [M, splits] values.

NaN logits are not supported (the result is unspecified); ``-inf`` logits are fine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

_NEG = float(jnp.finfo(jnp.float32).min)
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArgmaxConfig:
    """Tiles of the argmax kernel.

    Attributes:
      block_v: vocabulary entries per loop step (power of two).
      splits: vocabulary slices per row (programs per row); None picks enough programs to fill
        the GPU several times.
      num_warps, num_stages: Triton launch parameters.
      prefetch: load step j+1 before the math of step j (loop-carried registers).
    """

    block_v: int = 1024
    splits: int | None = None
    num_warps: int = 8
    num_stages: int = 3
    prefetch: bool = False

    def __post_init__(self):
        if not C.is_pow2(self.block_v) or self.block_v < 32:
            raise ValueError(f"block_v must be a power of two >= 32, got {self.block_v}")
        if self.splits is not None and self.splits < 1:
            raise ValueError("splits must be >= 1")
        if not C.is_pow2(self.num_warps):
            raise ValueError("num_warps must be a power of two")


def _splits(cfg: ArgmaxConfig, m: int, v: int) -> int:
    steps = C.cdiv(v, cfg.block_v)
    if cfg.splits is not None:
        return max(1, min(cfg.splits, steps))
    return max(1, min(C.cdiv(8 * 132, m), steps))


def _argmax_kernel(x_ref, m_ref, i_ref, l_ref, *, v, bv, steps_per_split, prefetch):
    """Program (row r, slice s): lane-wise online max / first-argmax / sum-exp over the slice."""
    r = pl.program_id(0)
    s = pl.program_id(1)
    lanes = jnp.arange(bv, dtype=jnp.int32)
    start = s * steps_per_split
    n_steps = jnp.minimum(steps_per_split, C.cdiv(v, bv) - start)

    def load(j):
        off = (start + j) * bv
        return plgpu.load(x_ref.at[r, pl.ds(off, bv)], mask=off + lanes < v, other=-jnp.inf)

    def update(j, x, carry):
        vm, vi, vl = carry
        x = x.astype(jnp.float32)
        gt = x > vm
        # One exponential per element: exp(-|x - vm|) rescales whichever side is smaller.
        t = jnp.exp2(jnp.abs(x - vm) * -_LOG2E)
        vl = jnp.where(gt, vl * t + 1.0, vl + t)
        vi = jnp.where(gt, (start + j) * bv + lanes, vi)
        return jnp.maximum(vm, x), vi, vl

    init = (
        jnp.full((bv,), _NEG, jnp.float32),
        jnp.zeros((bv,), jnp.int32),
        jnp.zeros((bv,), jnp.float32),
    )
    if prefetch:

        def body(j, carry):
            state, x = carry
            nxt = load(jnp.minimum(j + 1, n_steps - 1))
            return update(j, x, state), nxt

        (vm, vi, vl), _ = jax.lax.fori_loop(0, n_steps, body, (init, load(0)))
    else:
        vm, vi, vl = jax.lax.fori_loop(0, n_steps, lambda j, c: update(j, load(j), c), init)
    mx = jnp.max(vm)
    idx = jnp.min(jnp.where(vm == mx, vi, jnp.int32(2**31 - 1)))
    total = jnp.sum(vl * jnp.exp2((vm - mx) * _LOG2E))
    m_ref[r, s] = mx
    i_ref[r, s] = idx
    l_ref[r, s] = total


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def argmax_logprob(
    logits: jax.Array, *, config: ArgmaxConfig | None = None, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Row-wise argmax and its log-probability.

    Args:
      logits: f32 or bf16 [M, V].

    Returns:
      idx: int32[M], the first index of each row's maximum.
      logprob: f32[M], ``max - logsumexp`` of each row (<= 0).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [M, V], got {logits.shape}")
    cfg = config or ArgmaxConfig()
    m, v = logits.shape
    bv = min(cfg.block_v, max(32, C.next_pow2(v)))
    steps = C.cdiv(v, bv)
    splits = _splits(dataclasses.replace(cfg, block_v=bv), m, v)
    steps_per_split = C.cdiv(steps, splits)
    splits = C.cdiv(steps, steps_per_split)
    kernel = functools.partial(
        _argmax_kernel, v=v, bv=bv, steps_per_split=steps_per_split, prefetch=cfg.prefetch
    )
    part = jax.ShapeDtypeStruct((m, splits), jnp.float32)
    mx, idx, tot = pl.pallas_call(
        kernel,
        out_shape=(part, jax.ShapeDtypeStruct((m, splits), jnp.int32), part),
        grid=(m, splits),
        compiler_params=C.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="argmax_logprob",
    )(logits)
    row_max = jnp.max(mx, axis=1)
    first = jnp.argmax(mx == row_max[:, None], axis=1)
    out_idx = jnp.take_along_axis(idx, first[:, None], axis=1)[:, 0]
    total = jnp.sum(tot * jnp.exp(mx - row_max[:, None]), axis=1)
    return out_idx, -jnp.log(total)


def argmax_logprob_reference(
    logits: jax.Array, *, config: ArgmaxConfig | None = None, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp twin of :func:`argmax_logprob`."""
    del config, interpret
    x = logits.astype(jnp.float32)
    idx = jnp.argmax(x, axis=1).astype(jnp.int32)
    lp = jnp.max(x, axis=1) - jax.nn.logsumexp(x, axis=1)
    return idx, lp
