"""Triton backend of ``cache_attention``: each query row over its sequence's contiguous KV cache.

The grid is (B, Nkv, chunks, splits): a program takes one chunk of ``rows_per_dot`` of a
sequence's window rows under one KV head (the S x G query heads side by side, padded to whole chunks) and the cache
rows of one split, in blocks of ``block_keys`` keys, keeping an online softmax in F32 per row; it
writes each row's unnormalised partial output with its running max and sum, and a second kernel
merges a row's splits in order. By default each F32 dot runs on the tensor cores as six BF16
products of its operands' three-way BF16 splits, accumulated in F32 (``BF16_BF16_F32_X6``;
``products="ieee"`` keeps F32 multiply-adds on the CUDA cores): within a few
F32 ulps of the reference's HIGHEST products (at the 27B shapes the largest difference is
about twice that of IEEE F32 dots on the CUDA cores), and on an H200 at those shapes never
slower than those dots: up to 1.4x faster on F32 caches, 2.8x on BF16 ones.

A row's result does not depend on how many rows share the call, nor on the cache's length:
every dot is ``rows_per_dot`` rows (a constant of the config) by one key block whatever the
window, a split always covers
``split_keys`` cache rows from a multiple of it (never a share of the call's shape), blocks past
a row's length (a program runs to its longest row) leave the row's sums unchanged bit for bit,
splits past it contribute exact zeros, and the merge adds the splits in their order. A verify
step's first row is then computed bit for bit as the one-row plain step computes it, which
greedy speculation's exactness rests on.

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
#: How a dot's F32 products are formed (``CacheAttentionConfig.products``). Either way a row's
#: products and their F32 accumulation are fixed by the dot's shape alone (``rows_per_dot`` by
#: ``block_keys``, constants of the config): rows stay invariant.
PRODUCTS = {
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,  # six BF16 tensor-core products
    "ieee": jax.lax.Precision.HIGHEST,  # F32 fused multiply-adds on the CUDA cores
}
#: The chunk sizes a config may take: the tensor-core dots' M.
ROWS_PER_DOT = (16, 32, 64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheAttentionConfig:
    """Tiles of the kernel.

    Attributes:
      block_keys: cache rows per loop step (power of two, >= 16).
      split_keys: cache rows per program (a multiple of block_keys). Fixed, never derived from
        the call's shapes: that is what keeps a row's sums the same at every row count and
        cache length.
      rows_per_dot: query rows per program and per dot (one of ``ROWS_PER_DOT``): a sequence's
        S x G window rows under a KV head are cut into chunks of this many, padded. Fixed,
        never derived from the call's shapes, for the same reason as ``split_keys``; a larger
        chunk reads a key block once for more rows and pads a short window more.
      num_warps, num_stages: Triton launch parameters.
      products: how the dots form their F32 products, a key of ``PRODUCTS``.
    """

    block_keys: int = 16
    split_keys: int = 32
    rows_per_dot: int = 16
    num_warps: int = 4
    num_stages: int = 2
    products: str = "bf16x6"

    def __post_init__(self):
        if not C.is_pow2(self.block_keys) or self.block_keys < 16:
            raise ValueError(f"block_keys must be a power of two >= 16, got {self.block_keys}")
        if self.split_keys < self.block_keys or self.split_keys % self.block_keys:
            raise ValueError(
                f"split_keys must be a multiple of block_keys={self.block_keys}, got "
                f"{self.split_keys}"
            )
        if self.rows_per_dot not in ROWS_PER_DOT:
            raise ValueError(f"rows_per_dot must be one of {ROWS_PER_DOT}, got {self.rows_per_dot}")
        if not C.is_pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")
        if self.products not in PRODUCTS:
            raise ValueError(f"products must be one of {sorted(PRODUCTS)}, got {self.products!r}")


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


def _dot(a, b, contract, products):
    return jax.lax.dot_general(
        a, b, ((contract[:1], contract[1:]), ((), ())), precision=PRODUCTS[products],
        preferred_element_type=jnp.float32,
    )  # fmt: skip


def _split_kernel(*refs, scale, bk, steps, rows_per_dot, stacked, products):
    if stacked:
        layer_ref, q_ref, k_ref, v_ref, len_ref, o_ref, m_ref, l_ref = refs
        at = (layer_ref[0],)
    else:
        q_ref, k_ref, v_ref, len_ref, o_ref, m_ref, l_ref = refs
        at = ()
    b, h, c, s = (pl.program_id(i) for i in range(4))
    rows = pl.ds(c * rows_per_dot, rows_per_dot)
    d = q_ref.shape[-1]
    cache_len = k_ref.shape[-3]
    q = q_ref[b, h, rows]  # f32[rows_per_dot, d]
    qk_scale = scale * math.log2(math.e)
    lengths = jnp.minimum(len_ref[b, rows], cache_len)
    first = s * steps * bk
    # The loop runs to the chunk's longest row; for a shorter row the extra blocks are fully
    # masked and leave its sums unchanged bit for bit (correction exp2(0) = 1, nothing added).
    n_steps = jnp.clip((lengths.max() - first + bk - 1) // bk, 0, steps)
    key_lane = jnp.arange(bk, dtype=jnp.int32)
    dim_lane = jnp.arange(d, dtype=jnp.int32)

    def body(j, carry):
        acc, m_i, l_i = carry
        keys = first + j * bk + key_lane
        idx = (*at, b, keys[:, None], h, dim_lane[None, :])
        in_cache = jnp.broadcast_to((keys < cache_len)[:, None], (bk, d))
        k = plgpu.load(k_ref.at[idx], mask=in_cache, other=0).astype(jnp.float32)
        v = plgpu.load(v_ref.at[idx], mask=in_cache, other=0).astype(jnp.float32)
        ok = keys[None, :] < lengths[:, None]  # [rows_per_dot, bk]
        qk = jnp.where(ok, _dot(q, k, (1, 1), products) * qk_scale, _NEG)
        m_new = jnp.maximum(m_i, jnp.max(qk, axis=1))
        corr = jnp.exp2(m_i - m_new)
        p = jnp.where(ok, jnp.exp2(qk - m_new[:, None]), 0.0)
        l_new = l_i * corr + jnp.sum(p, axis=1)
        return acc * corr[:, None] + _dot(p, v, (1, 0), products), m_new, l_new

    init = (
        jnp.zeros((rows_per_dot, d), jnp.float32),
        jnp.full((rows_per_dot,), _NEG, jnp.float32),
        jnp.zeros((rows_per_dot,), jnp.float32),
    )
    acc, m_i, l_i = jax.lax.fori_loop(0, n_steps, body, init)
    o_ref[b, h, s, rows] = acc
    m_ref[b, h, s, rows] = m_i
    l_ref[b, h, s, rows] = l_i


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, splits, rows_per_dot):
    """One (sequence, KV head, chunk): the chunk's split partials merged in split order."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(c * rows_per_dot, rows_per_dot)
    d = o_ref.shape[-1]
    m_all = jax.lax.fori_loop(
        0, splits, lambda s, m: jnp.maximum(m, m_ref[b, h, s, rows]), m_ref[b, h, 0, rows]
    )

    def add(s, carry):
        num, den = carry
        w = jnp.exp2(m_ref[b, h, s, rows] - m_all)
        return num + o_ref[b, h, s, rows] * w[:, None], den + l_ref[b, h, s, rows] * w

    init = (jnp.zeros((rows_per_dot, d), jnp.float32), jnp.zeros((rows_per_dot,), jnp.float32))
    num, den = jax.lax.fori_loop(0, splits, add, init)
    out_ref[b, h, rows] = num / jnp.where(den > 0, den, 1.0)[:, None]


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
    chunks = C.cdiv(S * g, cfg.rows_per_dot)
    r_pad = chunks * cfg.rows_per_dot
    steps = cfg.split_keys // cfg.block_keys
    splits = C.cdiv(L, cfg.split_keys)
    # A sequence's window rows side by side under each KV head: row (s, j) of head h at s*g + j.
    qw = q.astype(jnp.float32).reshape(B, S, n_kv, g, d).transpose(0, 2, 1, 3, 4)
    qw = jnp.pad(qw.reshape(B, n_kv, S * g, d), ((0, 0), (0, 0), (0, r_pad - S * g), (0, 0)))
    row_len = jnp.repeat(lengths.astype(jnp.int32), g, axis=1)
    row_len = jnp.pad(row_len, ((0, 0), (0, r_pad - S * g)))  # padding rows attend to nothing
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    f32 = jnp.float32
    stacked = layer is not None
    kernel = functools.partial(
        _split_kernel,
        scale=float(scale),
        bk=cfg.block_keys,
        steps=steps,
        rows_per_dot=cfg.rows_per_dot,
        stacked=stacked,
        products=cfg.products,
    )
    entry = (jnp.asarray(layer, jnp.int32).reshape(1),) if stacked else ()
    o, m, l = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((B, n_kv, splits, r_pad, d), f32),
            jax.ShapeDtypeStruct((B, n_kv, splits, r_pad), f32),
            jax.ShapeDtypeStruct((B, n_kv, splits, r_pad), f32),
        ),
        grid=(B, n_kv, chunks, splits),
        compiler_params=params,
        interpret=interpret,
        name="cache_attention",
    )(*entry, qw, k_cache, v_cache, row_len)
    out = pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits, rows_per_dot=cfg.rows_per_dot),
        out_shape=jax.ShapeDtypeStruct((B, n_kv, r_pad, d), f32),
        grid=(B, n_kv, chunks),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="cache_attention_merge",
    )(o, m, l)
    out = out[:, :, : S * g].reshape(B, n_kv, S, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, S, n_q, d)
