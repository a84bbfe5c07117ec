"""Triton backend of ``cache_attention``: each query row over its sequence's contiguous KV cache.

The grid is (rows, Nkv, splits): a program takes one query row's G query heads of one KV head
(padded to 16 rows for the dot) and the cache rows of one split, walks them ``block_keys`` at a
time with an online softmax in F32, and writes its unnormalised partial output with its running
max and sum; a second kernel merges a row's splits in order. The products are F32 at IEEE
precision (no TF32), like the reference's HIGHEST.

A row's result does not depend on how many rows share the call, nor on the cache's length:
every program's tiles are fixed, a split always covers ``split_keys`` cache rows from a multiple
of it (never a share of the call's shape), splits past a row's length contribute exact zeros,
and the merge adds the splits in their order. A verify step's first row is then computed bit for
bit as the one-row plain step computes it, which greedy speculation's exactness rests on.

Shapes:
  q        f32[B, S, Nq, D]    S query rows per sequence
  k, v     [B, L, Nkv, D]      f32 or bf16 caches, or [layers, B, L, Nkv, D] stacks read in place
                               at a traced ``layer`` (a scan over a model's layers never copies
                               a layer's cache out for the kernel)
  lengths  int32[B, S]         row (b, s) attends to cache rows < lengths[b, s]
  out      f32[B, S, Nq, D]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C
from pallas_kernels._cache_attention.reference import check_operands

name = "triton"
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheAttentionConfig:
    """Tiles of the kernel.

    Attributes:
      block_keys: cache rows per loop step (power of two, >= 16).
      split_keys: cache rows per program (a multiple of block_keys). Fixed, never derived from
        the call's shapes: that is what keeps a row's sums the same at every row count and
        cache length.
      num_warps, num_stages: Triton launch parameters.
    """

    block_keys: int = 16
    split_keys: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not C.is_pow2(self.block_keys) or self.block_keys < 16:
            raise ValueError(f"block_keys must be a power of two >= 16, got {self.block_keys}")
        if self.split_keys < self.block_keys or self.split_keys % self.block_keys:
            raise ValueError(
                f"split_keys must be a multiple of block_keys={self.block_keys}, got "
                f"{self.split_keys}"
            )
        if not C.is_pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")


def supported_on(device) -> bool:
    """Whether the kernel compiles for ``device`` (any GPU; elsewhere only interpret mode)."""
    return device.platform == "gpu"


def supports(q: jax.Array, k_cache: jax.Array) -> str | None:
    """Why the kernel cannot take these operands, or None when it can."""
    d = q.shape[-1]
    if d < 16 or not C.is_pow2(d):
        return f"the kernel needs a power-of-two head_dim >= 16, got {d}"
    if k_cache.dtype not in (jnp.float32, jnp.bfloat16):
        return f"the kernel reads f32 or bf16 caches, got {k_cache.dtype}"
    return None


def _split_kernel(*refs, rows_per_seq, scale, bk, steps, stacked):
    if stacked:
        layer_ref, q_ref, k_ref, v_ref, len_ref, o_ref, m_ref, l_ref = refs
        at = (layer_ref[0],)
    else:
        q_ref, k_ref, v_ref, len_ref, o_ref, m_ref, l_ref = refs
        at = ()
    r, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = r // rows_per_seq
    g_pad, d = q_ref.shape[2], q_ref.shape[3]
    cache_len = k_ref.shape[-3]
    q = q_ref[r, h]  # f32[g_pad, d]
    qk_scale = scale * math.log2(math.e)
    length = jnp.minimum(len_ref[r], cache_len)
    first = s * steps * bk
    n_steps = jnp.clip((length - first + bk - 1) // bk, 0, steps)
    key_lane = jnp.arange(bk, dtype=jnp.int32)
    dim_lane = jnp.arange(d, dtype=jnp.int32)

    def body(j, carry):
        acc, m_i, l_i = carry
        keys = first + j * bk + key_lane
        ok = keys < length
        idx = (*at, b, keys[:, None], h, dim_lane[None, :])
        in_cache = jnp.broadcast_to((keys < cache_len)[:, None], (bk, d))
        k = plgpu.load(k_ref.at[idx], mask=in_cache, other=0).astype(jnp.float32)
        v = plgpu.load(v_ref.at[idx], mask=in_cache, other=0).astype(jnp.float32)
        qk = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32
        )
        qk = jnp.where(ok[None, :], qk * qk_scale, _NEG)
        m_new = jnp.maximum(m_i, jnp.max(qk, axis=1))
        corr = jnp.exp2(m_i - m_new)
        p = jnp.where(ok[None, :], jnp.exp2(qk - m_new[:, None]), 0.0)
        l_new = l_i * corr + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(
            p, v, (((1,), (0,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32
        )
        return acc * corr[:, None] + pv, m_new, l_new

    init = (
        jnp.zeros((g_pad, d), jnp.float32),
        jnp.full((g_pad,), _NEG, jnp.float32),
        jnp.zeros((g_pad,), jnp.float32),
    )
    acc, m_i, l_i = jax.lax.fori_loop(0, n_steps, body, init)
    o_ref[r, h, s] = acc
    m_ref[r, h, s] = m_i
    l_ref[r, h, s] = l_i


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, splits):
    """One (row, KV head): the splits' partial outputs merged in split order."""
    r, h = pl.program_id(0), pl.program_id(1)
    m_all = jax.lax.fori_loop(
        0, splits, lambda s, m: jnp.maximum(m, m_ref[r, h, s]), m_ref[r, h, 0]
    )

    def add(s, carry):
        num, den = carry
        w = jnp.exp2(m_ref[r, h, s] - m_all)
        return num + o_ref[r, h, s] * w[:, None], den + l_ref[r, h, s] * w

    g_pad, d = o_ref.shape[3], o_ref.shape[4]
    init = (jnp.zeros((g_pad, d), jnp.float32), jnp.zeros((g_pad,), jnp.float32))
    num, den = jax.lax.fori_loop(0, splits, add, init)
    out_ref[r, h] = num / jnp.where(den > 0, den, 1.0)[:, None]


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def cache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    layer: jax.Array | None = None,
    config: CacheAttentionConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The kernel: f32[B, S, Nq, D] (shapes in the module docstring)."""
    check_operands(q, k_cache, v_cache, lengths, layer)
    if (reason := supports(q, k_cache)) is not None:
        raise ValueError(reason)
    cfg = config or CacheAttentionConfig()
    B, S, n_q, d = q.shape
    L, n_kv = k_cache.shape[-3], k_cache.shape[-2]
    g = n_q // n_kv
    g_pad = max(16, C.next_pow2(g))
    R = B * S
    steps = cfg.split_keys // cfg.block_keys
    splits = C.cdiv(L, cfg.split_keys)
    qg = q.astype(jnp.float32).reshape(R, n_kv, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    f32 = jnp.float32
    stacked = layer is not None
    kernel = functools.partial(
        _split_kernel,
        rows_per_seq=S,
        scale=float(scale),
        bk=cfg.block_keys,
        steps=steps,
        stacked=stacked,
    )
    entry = (jnp.asarray(layer, jnp.int32).reshape(1),) if stacked else ()
    o, m, l = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((R, n_kv, splits, g_pad, d), f32),
            jax.ShapeDtypeStruct((R, n_kv, splits, g_pad), f32),
            jax.ShapeDtypeStruct((R, n_kv, splits, g_pad), f32),
        ),
        grid=(R, n_kv, splits),
        compiler_params=params,
        interpret=interpret,
        name="cache_attention",
    )(*entry, qg, k_cache, v_cache, lengths.reshape(R).astype(jnp.int32))
    out = pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits),
        out_shape=jax.ShapeDtypeStruct((R, n_kv, g_pad, d), f32),
        grid=(R, n_kv),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="cache_attention_merge",
    )(o, m, l)
    return out[:, :, :g].reshape(B, S, n_q, d)
