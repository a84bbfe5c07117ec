"""``paged_attention``: one query row per sequence over a paged KV pool, one dispatch.

Shapes:
  q:             [B, Nq, D]                        one query row per sequence
  k_pool/v_pool: [num_blocks, block_size, Nkv, D]  bf16, or float8_e4m3fn with k_scale/v_scale
                 (f32 scalar, per (block, head) [num_blocks, Nkv] or per (row, head)
                 [num_blocks, block_size, Nkv]); v_pool None for latent rows (MLA), whose
                 value is each key row's first ``value_dim`` dims (dequantised by k_scale)
  block_table:   int32[B, max_blocks]              slots past seq_len may hold -1 (never read)
  seq_len:       int32[B]                          sequence b attends to rows 0..seq_len[b]-1
  out:           f32[B, Nq, D]  (latent rows: f32[B, Nq, value_dim])

Query head h reads KV head h // (Nq // Nkv).
"""

from __future__ import annotations

import jax

from pallas_kernels import _common as C
from pallas_kernels._paged_attention import triton
from pallas_kernels._paged_attention.reference import check_operands, paged_attention_reference
from pallas_kernels.implementation import Implementation


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_table: jax.Array,
    seq_len: jax.Array,
    *,
    scale: float,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    value_dim: int | None = None,
    implementation: Implementation | str = Implementation.AUTO,
    config: triton.PagedAttentionConfig | None = None,
) -> jax.Array:
    """Softmax attention of ``q`` over each sequence's pages -> f32[B, Nq, D or value_dim].

    ``implementation``: AUTO takes the Triton kernel on a GPU when it supports the operands (D
    and block_size powers of two, D >= 16, separate K and V pools), else the reference; PALLAS or
    TRITON the kernel (interpret mode off-GPU; NotImplementedError naming the reason when it
    cannot take the operands: latent rows among them); XLA the reference. ``config``: the
    kernel's tiles (None: its heuristic).
    """
    check_operands(q, k_pool, v_pool, block_table, seq_len, k_scale, v_scale, value_dim)
    scales = dict(scale=float(scale), k_scale=k_scale, v_scale=v_scale)
    reason = triton.supports(q, k_pool, v_pool)
    use_kernel = C.runs_triton_kernel(implementation, reason, op="paged attention")
    if not use_kernel:
        return paged_attention_reference(
            q, k_pool, v_pool, block_table, seq_len, value_dim=value_dim, **scales
        )
    return triton.paged_attention(
        q,
        k_pool,
        v_pool,
        block_table,
        seq_len,
        config=config,
        interpret=not triton.supported_on(C.default_device()),
        **scales,
    )
