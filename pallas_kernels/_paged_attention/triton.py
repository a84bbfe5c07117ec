"""Triton backend of ``paged_attention``: one query row per sequence, GQA, BF16 or FP8 KV.

Shapes:
  q:            [B, n_q, D]                       one query row per sequence (bf16 or f32)
  k_pool/v_pool:[num_blocks, block_size, n_kv, D] bf16, or float8_e4m3fn with scales
  block_tables: int32[B, max_blocks]               physical block of each logical block
  lengths:      int32[B]                           valid KV rows per sequence (0 -> zeros out)
  out:          [B, n_q, D]                        f32 by default (``out_dtype``)

Query head ``j`` reads KV head ``j // (n_q // n_kv)``. D must be a power of two >= 16 and the
block size a power of two (:func:`supports`); table slots past a sequence's length are never read.

FP8 KV scales: ``k_scale``/``v_scale`` are a per-tensor f32 scalar, per-(block, head)
f32[num_blocks, n_kv] (dequantised row = ``fp8 * scale[block, head]``), or per-(row, head)
f32[num_blocks, block_size, n_kv] (``fp8 * scale[block, slot, head]``, the drafter pool's own
layout: rows are written one decode step at a time, so a block cannot share one scale). Scales
never touch the tiles: the K scale multiplies the score columns and the V scale the
probabilities, a [G, rows] vector product per step.

Algorithm (flash decoding): the grid is (B, n_kv, splits); each program takes the G query heads of
one KV head (padded to 16 rows for ``pl.dot``) and an equal share of the sequence's pages, walks
``pages_per_step`` pages per step with an online softmax in F32, and writes its unnormalised
partial output with its running max and sum; a few ``jnp`` ops merge the splits. Probabilities
meet V in bf16 (float16 for FP8 KV) on the tensor cores, so results match the F32 reference to
bf16-level tolerance.
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
from pallas_kernels._paged_attention.reference import check_operands

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionConfig:
    """Tiles of the paged attention kernel.

    Attributes:
      pages_per_step: KV blocks gathered per loop step (power of two).
      splits: programs per (sequence, KV head) over the sequence; None fills the GPU.
      num_warps, num_stages: Triton launch parameters.
    """

    pages_per_step: int = 4
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not C.is_pow2(self.pages_per_step):
            raise ValueError(f"pages_per_step must be a power of two, got {self.pages_per_step}")
        if self.splits is not None and self.splits < 1:
            raise ValueError("splits must be >= 1")
        if not C.is_pow2(self.num_warps):
            raise ValueError("num_warps must be a power of two")


def _attn_kernel(
    q_ref,
    k_ref,
    v_ref,
    bt_ref,
    len_ref,
    *rest,
    scale,
    pps,
    bs,
    steps_per_split,
    max_blocks,
    scale_kind,
    fp8,
):
    if scale_kind == "none":
        o_ref, m_ref, l_ref = rest
        ks_ref = vs_ref = None
    else:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = rest
    b = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    g_pad, d = q_ref.shape[2], q_ref.shape[3]
    t = pps * bs
    mm_dtype = jnp.float16 if fp8 else jnp.bfloat16
    q = q_ref[b, h].astype(jnp.bfloat16)
    qk_scale = scale * math.log2(math.e)
    length = len_ref[b]
    n_pages = (length + bs - 1) // bs
    first_step = s * steps_per_split
    n_steps = jnp.clip((n_pages + pps - 1) // pps - first_step, 0, steps_per_split)
    page_lane = jnp.arange(pps, dtype=jnp.int32)
    tok_lane = jnp.arange(t, dtype=jnp.int32)
    row_lane = jnp.arange(bs, dtype=jnp.int32)
    dim_lane = jnp.arange(d, dtype=jnp.int32)

    def body(j, carry):
        acc, m_i, l_i = carry
        p0 = (first_step + j) * pps
        pages = p0 + page_lane
        pvalid = pages < jnp.minimum(n_pages, max_blocks)
        phys = plgpu.load(bt_ref.at[b, pl.ds(p0, pps)], mask=pvalid, other=0)
        kv_mask = jnp.broadcast_to(pvalid[:, None, None], (pps, bs, d))
        kv_idx = (phys[:, None, None], row_lane[None, :, None], h, dim_lane[None, None, :])
        k = plgpu.load(k_ref.at[kv_idx], mask=kv_mask, other=0).reshape(t, d)
        v = plgpu.load(v_ref.at[kv_idx], mask=kv_mask, other=0).reshape(t, d)
        if fp8:  # float8 pools arrive as uint8 bytes (Triton cannot build masked float8 loads)
            k = C.from_u8_e4m3(k, jnp.bfloat16)
            v = C.from_u8_e4m3(v, mm_dtype)
        qk = jax.lax.dot_general(
            q, k.astype(jnp.bfloat16), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        qk = qk * qk_scale
        if scale_kind == "block":
            ksc = plgpu.load(ks_ref.at[phys, h], mask=pvalid, other=0.0)
            vsc = plgpu.load(vs_ref.at[phys, h], mask=pvalid, other=0.0)
            ksc = jnp.broadcast_to(ksc[:, None], (pps, bs)).reshape(t)
            vsc = jnp.broadcast_to(vsc[:, None], (pps, bs)).reshape(t)
            qk = qk * ksc[None, :]
        elif scale_kind == "row":
            s_idx = (phys[:, None], row_lane[None, :], h)
            s_mask = jnp.broadcast_to(pvalid[:, None], (pps, bs))
            ksc = plgpu.load(ks_ref.at[s_idx], mask=s_mask, other=0.0).reshape(t)
            vsc = plgpu.load(vs_ref.at[s_idx], mask=s_mask, other=0.0).reshape(t)
            qk = qk * ksc[None, :]
        elif scale_kind == "tensor":
            qk = qk * ks_ref[0]
        tok_ok = (p0 * bs + tok_lane) < length
        qk = jnp.where(tok_ok[None, :], qk, _NEG)
        m_new = jnp.maximum(m_i, jnp.max(qk, axis=1))
        corr = jnp.exp2(m_i - m_new)
        p = jnp.exp2(qk - m_new[:, None])
        l_new = l_i * corr + jnp.sum(p, axis=1)
        if scale_kind in ("block", "row"):
            p = p * vsc[None, :]
        pv = jax.lax.dot_general(
            p.astype(mm_dtype),
            v.astype(mm_dtype),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        if scale_kind == "tensor":
            pv = pv * vs_ref[0]
        return acc * corr[:, None] + pv, m_new, l_new

    init = (
        jnp.zeros((g_pad, d), jnp.float32),
        jnp.full((g_pad,), _NEG, jnp.float32),
        jnp.zeros((g_pad,), jnp.float32),
    )
    acc, m_i, l_i = jax.lax.fori_loop(0, n_steps, body, init)
    o_ref[b, h, s] = acc
    m_ref[b, h, s] = m_i
    l_ref[b, h, s] = l_i


name = "triton"


def supported_on(device) -> bool:
    """Whether the kernel compiles for ``device`` (any GPU; elsewhere only interpret mode)."""
    return device.platform == "gpu"


def supports(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array | None = None) -> str | None:
    """Why the kernel cannot take these operands, or None when it can (``v_pool`` None: latent
    rows, whose value is part of the key row)."""
    if v_pool is None:
        return "the kernel reads separate K and V pools; latent rows (MLA) take the reference"
    d, bs = q.shape[-1], k_pool.shape[1]
    if d < 16 or not C.is_pow2(d) or not C.is_pow2(bs):
        return f"the kernel needs a power-of-two head_dim >= 16 and block_size (got {d}, {bs})"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "config", "out_dtype", "interpret"))
def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    config: PagedAttentionConfig | None = None,
    out_dtype=jnp.float32,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of one query row per sequence over a paged KV pool -> [B, n_q, D] in
    ``out_dtype`` (f32 or bf16); shapes and FP8 scales as in the module docstring, ``scale`` the
    softmax scale of q.k."""
    check_operands(q, k_pool, v_pool, block_tables, lengths, k_scale, v_scale)
    if (reason := supports(q, k_pool, v_pool)) is not None:
        raise ValueError(reason)
    bsz, n_q, d = q.shape
    nb, bs, n_kv, _ = k_pool.shape
    fp8 = k_pool.dtype == jnp.float8_e4m3fn
    cfg = config or PagedAttentionConfig()
    max_blocks = block_tables.shape[1]
    pps = min(cfg.pages_per_step, C.next_pow2(max_blocks))
    steps = C.cdiv(max_blocks, pps)
    splits = cfg.splits or max(1, min(steps, C.cdiv(2 * 132, bsz * n_kv)))
    steps_per_split = C.cdiv(steps, splits)
    splits = C.cdiv(steps, steps_per_split)
    g = n_q // n_kv
    g_pad = max(16, C.next_pow2(g))
    qg = jnp.pad(q.reshape(bsz, n_kv, g, d), ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, steps * pps - max_blocks)))
    ins = [qg, C.as_u8(k_pool), C.as_u8(v_pool), bt, lengths.astype(jnp.int32)]
    scale_kind = "none"
    if fp8:
        ks = jnp.asarray(k_scale, jnp.float32)
        vs = jnp.asarray(v_scale, jnp.float32)
        if ks.ndim == 0 and vs.ndim == 0:
            scale_kind = "tensor"
            ins += [ks.reshape(1), vs.reshape(1)]
        elif ks.ndim == 3 or vs.ndim == 3:
            if ks.shape != (nb, bs, n_kv) or vs.shape != (nb, bs, n_kv):
                raise ValueError(
                    f"per-row FP8 scales must both be [num_blocks, block_size, n_kv] = "
                    f"{[nb, bs, n_kv]}, got k_scale {list(ks.shape)}, v_scale {list(vs.shape)}"
                )
            scale_kind = "row"
            ins += [ks, vs]
        else:
            scale_kind = "block"
            ins += [jnp.broadcast_to(ks, (nb, n_kv)), jnp.broadcast_to(vs, (nb, n_kv))]
    kernel = functools.partial(
        _attn_kernel,
        scale=float(scale),
        pps=pps,
        bs=bs,
        steps_per_split=steps_per_split,
        max_blocks=max_blocks,
        scale_kind=scale_kind,
        fp8=fp8,
    )
    f32 = jnp.float32
    o, m, l = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, n_kv, splits, g_pad, d), f32),
            jax.ShapeDtypeStruct((bsz, n_kv, splits, g_pad), f32),
            jax.ShapeDtypeStruct((bsz, n_kv, splits, g_pad), f32),
        ),
        grid=(bsz, n_kv, splits),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="paged_attention",
    )(*ins)
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = l * jnp.exp2(m - m_all)
    denom = jnp.sum(w, axis=2)
    num = jnp.sum(o * jnp.exp2(m - m_all)[..., None], axis=2)
    out = num / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out[:, :, :g].reshape(bsz, n_q, d).astype(out_dtype)
