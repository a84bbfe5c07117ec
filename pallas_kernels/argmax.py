"""Batched argmax with the top-1 log-probability, over a large vocabulary.

``argmax_logprob(logits[M, V]) -> (idx int32[M], logprob f32[M])`` with
``logprob = logit_max - logsumexp(logits)`` in F32 and ties resolved to the lowest index (as
``jnp.argmax``). One pass over the logits.

Shapes: M rows, V vocabulary, S vocabulary slices per row (``splits``), B lanes of one load
(``block_v``), U loads per loop step (``unroll``), so one step reads a chunk of C = U * B logits.

The grid is rows x S slices of whole chunks. Each lane keeps a running max, where that max first
occurs and the sum of ``exp(x - max)``. A step issues its U loads back to back (U * 16 bytes per
thread in flight, while the lane state stays at one [B] set), reduces them to a per-lane chunk
max in registers, rescales the lane sum once and adds one exponential per element (a single
``ex2.approx.ftz`` on the GPU). The first position of the max is tracked either per element or,
with ``reload``, as the chunk only, whose U values the lanes holding the slice's max re-read once
at the end. Full chunks are loaded without masks; the one partial chunk at the end of a row, if
any, is read by the last slice with a mask. The lanes are reduced once per program, and the S
partial results of a row are merged either inside the kernel by the last program of the row to
finish (:attr:`Merge.IN_KERNEL`: a per-row atomic counter, so no merge launch after the kernel,
only a memset of the counters before it) or by one variadic XLA reduction (:attr:`Merge.XLA`).

NaN logits are not supported (the result is unspecified); ``-inf`` logits are fine, a row of only
``-inf`` is not.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

_NEG = float(jnp.finfo(jnp.float32).min)
_LOG2E = 1.4426950408889634
_INT_MAX = 2**31 - 1
#: Enough programs to fill the 132 SMs of an H200 a few times over.
_TARGET_PROGRAMS = 4 * 132


class Merge(enum.Enum):
    """Where the S partial results of a row are merged."""

    XLA = "xla"
    IN_KERNEL = "in_kernel"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArgmaxConfig:
    """Tiles of the argmax kernel.

    Attributes:
      block_v: lanes of one load (power of two); None gives every thread 16 bytes per load
        (``num_warps * 32 * 16 / itemsize``).
      unroll: independent loads per loop step (the chunk is ``unroll * block_v`` logits).
      splits: vocabulary slices per row (programs per row); None picks enough programs to fill
        the GPU a few times.
      num_warps, num_stages: Triton launch parameters.
      merge: where the per-slice partial results are merged.
      reload: track only the chunk of each lane's maximum in the loop (one max per element)
        and re-read that chunk once at the end for the first position; else track the position
        per element (a compare and two selects more per element, no re-read).
    """

    block_v: int | None = None
    unroll: int = 4
    splits: int | None = None
    num_warps: int = 8
    num_stages: int = 1
    merge: Merge = Merge.IN_KERNEL
    reload: bool = True

    def __post_init__(self):
        if self.block_v is not None and (not C.is_pow2(self.block_v) or self.block_v < 32):
            raise ValueError(f"block_v must be a power of two >= 32, got {self.block_v}")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.splits is not None and self.splits < 1:
            raise ValueError("splits must be >= 1")
        if not C.is_pow2(self.num_warps):
            raise ValueError("num_warps must be a power of two")
        if not isinstance(self.merge, Merge):
            raise ValueError(f"merge must be a Merge, got {self.merge!r}")


def default_config(m: int, v: int, dtype) -> ArgmaxConfig:
    """The measured default for ``m`` rows of ``v`` logits of ``dtype``.

    Measured on an H200 over V = 248320 (``scripts/bench_kernels.py --sections argmax``; the
    96-row sweep is the target; times are steady-state per launch):

    * 8 warps, 16-byte loads, 4 loads per step from 64 rows: bf16 at 96 rows took 17.2 us
      against 18.1 / 21.9 / 32.5 us with 2 / 8 / 16 loads; f32 was within noise (26.7-27.6 us).
      Below 64 rows 2 loads per step (more, shorter programs per row); those timings are
      dominated by launch overhead and noisy, but mostly favoured 2.
    * Slices from ``_TARGET_PROGRAMS`` (6 per row at 96 rows): best for bf16 (3 to 16 slices
      were up to 28% slower), within noise for f32.
    * The in-kernel merge: 0.5-1.4 us faster than the XLA merge at 96 rows.
    * ``reload`` off for f32: f32 runs within 10% of an XLA row max over the same bytes (bound
      by memory), so the re-read's extra round trip at the end of every program only costs
      (2-2.6 us at 96 rows). On for 2-byte logits, where instruction issue matters: 17.2 against
      18.5 us at 96 rows, a margin near the noise (the synced timings of that pair disagree).
    """
    del v
    small = jnp.dtype(dtype).itemsize < 4
    return ArgmaxConfig(unroll=4 if m >= 64 else 2, merge=Merge.IN_KERNEL, reload=small)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tiling of one call, resolved from a config and the shape."""

    bv: int  # B, lanes of one load
    unroll: int  # U, loads per full chunk
    chunk: int  # C = U * B
    full_chunks: int  # chunks of one row without a tail
    tail: int  # logits in the partial last chunk (0: none)
    cps: int  # chunks per slice
    splits: int  # S


def _plan(cfg: ArgmaxConfig, m: int, v: int, itemsize: int) -> _Plan:
    bv = cfg.block_v or cfg.num_warps * 32 * (16 // itemsize)
    bv = min(bv, max(32, C.next_pow2(v)))
    unroll = max(1, min(cfg.unroll, C.cdiv(v, bv)))
    chunk = unroll * bv
    chunks = C.cdiv(v, chunk)
    splits = cfg.splits if cfg.splits is not None else C.cdiv(_TARGET_PROGRAMS, m)
    cps = C.cdiv(chunks, max(1, min(splits, chunks)))
    return _Plan(bv, unroll, chunk, v // chunk, v % chunk, cps, C.cdiv(chunks, cps))


def _ex2(x, asm: bool):
    """``2**x``; with ``asm`` one ``ex2.approx.ftz`` (GPU only; subnormal results flush to 0).

    ``jnp.exp2`` lowers to libdevice's ``__nv_exp2f``; with it the kernel took 19-36% longer over
    bf16 logits at 96 rows (4% over f32).
    """
    if not asm:
        return jnp.exp2(x)
    (y,) = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y


def _argmax_kernel(x_ref, *refs, v: int, plan: _Plan, merge: Merge, reload: bool, asm: bool):
    """Program (row r, slice s): lane-wise max / first index / sum-exp over the slice's chunks."""
    if merge is Merge.IN_KERNEL:
        _, m_ref, i_ref, l_ref, cnt_ref, idx_ref, lp_ref = refs
    else:
        m_ref, i_ref, l_ref = refs
    bv, chunk, unroll = plan.bv, plan.chunk, plan.unroll
    r = pl.program_id(0)
    s = pl.program_id(1)
    lanes = jnp.arange(bv, dtype=jnp.int32)
    c0 = s * plan.cps
    ex2 = functools.partial(_ex2, asm=asm)

    def load(c, u, masked):
        off = c * chunk + u * bv
        if masked:
            return plgpu.load(x_ref.at[r, pl.ds(off, bv)], mask=off + lanes < v, other=-jnp.inf)
        return plgpu.load(x_ref.at[r, pl.ds(off, bv)])

    def update(c, xs, state):
        """Folds the loads ``xs`` of chunk ``c`` (in index order) into the lane state."""
        vm, vi, vl = state
        if reload:
            # vi is the chunk of the lane's first maximum; the epilogue finds the load in it.
            cur = xs[0]
            for x in xs[1:]:
                cur = jnp.maximum(cur, x)  # exact in the input dtype
            cur = cur.astype(jnp.float32)
            vi = jnp.where(cur > vm, c, vi)
        else:
            xs = [x.astype(jnp.float32) for x in xs]
            cur, cu = xs[0], jnp.zeros((bv,), jnp.int32)
            for u, x in enumerate(xs[1:], 1):
                gt = x > cur  # strict: the earlier load keeps a tie
                cur = jnp.maximum(cur, x)
                cu = jnp.where(gt, u, cu)
            vi = jnp.where(cur > vm, c * chunk + cu * bv + lanes, vi)
        nm = jnp.maximum(vm, cur)  # finite: vm starts at the F32 minimum
        vl = vl * ex2((vm - nm) * _LOG2E)
        for x in xs:
            vl = vl + ex2((x.astype(jnp.float32) - nm) * _LOG2E)
        return nm, vi, vl

    state = (
        jnp.full((bv,), _NEG, jnp.float32),
        jnp.full((bv,), c0, jnp.int32) if reload else jnp.zeros((bv,), jnp.int32),
        jnp.zeros((bv,), jnp.float32),
    )
    n_full = jnp.clip(plan.full_chunks - c0, 0, plan.cps)
    if plan.full_chunks:

        def body(j, st):
            c = c0 + j
            return update(c, [load(c, u, False) for u in range(unroll)], st)

        state = jax.lax.fori_loop(0, n_full, body, state)
    if plan.tail:
        # The partial chunk: its whole loads unmasked, the last one masked if it is cut short.
        n_loads = C.cdiv(plan.tail, bv)
        ragged = plan.tail % bv != 0

        def tail(st):
            c = c0 + n_full  # == plan.full_chunks in the last slice (traced: a dynamic start)
            xs = [load(c, u, ragged and u == n_loads - 1) for u in range(n_loads)]
            return update(c, xs, st)

        if plan.splits == 1:
            state = tail(state)
        else:
            state = jax.lax.cond(s == plan.splits - 1, tail, lambda st: st, state)
    vm, vi, vl = state
    mx = jnp.max(vm)
    hit = vm == mx
    if reload:
        # Re-read the chunk of each lane holding the maximum (a masked gather: usually one lane)
        # and take its first load equal to it; none found only if the slice is all -inf.
        first = jnp.full((bv,), unroll, jnp.int32)
        for u in reversed(range(unroll)):
            pos = vi * chunk + u * bv + lanes
            x = plgpu.load(x_ref.at[r, pos], mask=hit & (pos < v), other=-jnp.inf)
            first = jnp.where(x.astype(jnp.float32) == mx, u, first)
        pos = jnp.where(hit & (first < unroll), vi * chunk + first * bv + lanes, _INT_MAX)
        idx = jnp.min(pos)
        idx = jnp.where(idx == _INT_MAX, c0 * chunk, idx)
    else:
        idx = jnp.min(jnp.where(hit, vi, jnp.int32(_INT_MAX)))
    total = jnp.sum(vl * ex2((vm - mx) * _LOG2E))
    m_ref[r, s] = mx
    i_ref[r, s] = idx
    l_ref[r, s] = total
    if merge is not Merge.IN_KERNEL:
        return
    # The scalar stores above and this atomic are issued by the same thread, and the atomic is
    # acquire-release at GPU scope, so the program that sees the count S - 1 sees every partial.
    done = plgpu.atomic_add(cnt_ref, (r,), jnp.int32(1))

    @pl.when(done == plan.splits - 1)
    def _():
        sp = m_ref.shape[1]
        k = jnp.arange(sp, dtype=jnp.int32)
        ok = k < plan.splits
        # Volatile: read the partials coherently (not from a stale line in this SM's L1).
        pm = plgpu.load(m_ref.at[r, pl.ds(0, sp)], mask=ok, other=_NEG, volatile=True)
        pi = plgpu.load(i_ref.at[r, pl.ds(0, sp)], mask=ok, other=_INT_MAX, volatile=True)
        pt = plgpu.load(l_ref.at[r, pl.ds(0, sp)], mask=ok, other=0.0, volatile=True)
        row_max = jnp.max(pm)
        # Slices are in index order, so the smallest index among the maximal slices is the first.
        idx_ref[r] = jnp.min(jnp.where(pm == row_max, pi, jnp.int32(_INT_MAX)))
        lp_ref[r] = -jnp.log(jnp.sum(pt * ex2((pm - row_max) * _LOG2E)))


def _merge_partials(mx, idx, tot):
    """One variadic reduction over the slices: (max, first index of it, rescaled sum)."""

    def combine(a, b):
        (m1, i1, t1), (m2, i2, t2) = a, b
        m = jnp.maximum(m1, m2)
        i = jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))
        t = t1 * jnp.exp(m1 - m) + t2 * jnp.exp(m2 - m)  # finite: partial maxima are >= _NEG
        return m, i, t

    init = (jnp.float32(_NEG), jnp.int32(_INT_MAX), jnp.float32(0.0))
    _, out_idx, total = jax.lax.reduce((mx, idx, tot), init, combine, (1,))
    return out_idx, -jnp.log(total)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def argmax_logprob(
    logits: jax.Array, *, config: ArgmaxConfig | None = None, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Row-wise argmax and its log-probability.

    Args:
      logits: f32 or bf16 [M, V].
      config: tiles; None takes :func:`default_config`.

    Returns:
      idx: int32[M], the first index of each row's maximum.
      logprob: f32[M], ``max - logsumexp`` of each row (<= 0).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [M, V], got {logits.shape}")
    m, v = logits.shape
    cfg = config or default_config(m, v, logits.dtype)
    plan = _plan(cfg, m, v, jnp.dtype(logits.dtype).itemsize)
    kernel = functools.partial(
        _argmax_kernel,
        v=v,
        plan=plan,
        merge=cfg.merge,
        reload=cfg.reload,
        asm=not interpret,
    )
    params = C.compiler_params(cfg.num_warps, cfg.num_stages)
    if cfg.merge is Merge.IN_KERNEL:
        sp = C.next_pow2(plan.splits)  # the merge loads a power-of-two row of partials
        part = jax.ShapeDtypeStruct((m, sp), jnp.float32)
        row = jax.ShapeDtypeStruct((m,), jnp.int32)
        outs = pl.pallas_call(
            kernel,
            out_shape=(
                part,
                jax.ShapeDtypeStruct((m, sp), jnp.int32),
                part,
                row,
                row,
                jax.ShapeDtypeStruct((m,), jnp.float32),
            ),
            grid=(m, plan.splits),
            input_output_aliases={1: 3},
            compiler_params=params,
            interpret=interpret,
            name="argmax_logprob",
        )(logits, jnp.zeros((m,), jnp.int32))
        return outs[4], outs[5]
    part = jax.ShapeDtypeStruct((m, plan.splits), jnp.float32)
    mx, idx, tot = pl.pallas_call(
        kernel,
        out_shape=(part, jax.ShapeDtypeStruct((m, plan.splits), jnp.int32), part),
        grid=(m, plan.splits),
        compiler_params=params,
        interpret=interpret,
        name="argmax_logprob",
    )(logits)
    return _merge_partials(mx, idx, tot)


def argmax_logprob_reference(
    logits: jax.Array, *, config: ArgmaxConfig | None = None, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp twin of :func:`argmax_logprob`."""
    del config, interpret
    x = logits.astype(jnp.float32)
    idx = jnp.argmax(x, axis=1).astype(jnp.int32)
    lp = jnp.max(x, axis=1) - jax.nn.logsumexp(x, axis=1)
    return idx, lp
