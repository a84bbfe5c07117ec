"""``cache_attention``: query rows over each sequence's contiguous KV cache, one dispatch.

Shapes:
  q        [B, S, Nq, D]      S query rows per sequence (a target step's window)
  k, v     [B, L, Nkv, D]     the layer's caches (f32 or bf16 for the kernel), or
                              [layers, B, L, Nkv, D] stacks with a traced ``layer`` (read in
                              place by the kernel)
  lengths  int32[B, S]        row (b, s) attends to cache rows < lengths[b, s]
  out      f32[B, S, Nq, D]

Query head h reads KV head h // (Nq // Nkv). AUTO takes the Triton kernel on a GPU when it takes
the operands (its rows' results do not depend on the row count or the cache length, see
``triton``), else the reference; PALLAS or TRITON the kernel (interpret mode off-GPU); XLA the
reference.
"""

from __future__ import annotations

import jax

from pallas_kernels import _common as C
from pallas_kernels._cache_attention import triton
from pallas_kernels._cache_attention.reference import cache_attention_reference, check_operands
from pallas_kernels.implementation import Implementation


def cache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    layer: jax.Array | None = None,
    implementation: Implementation | str = Implementation.AUTO,
    config: triton.CacheAttentionConfig | None = None,
) -> jax.Array:
    """Softmax attention of each query row over its sequence's cache rows -> f32[B, S, Nq, D]."""
    check_operands(q, k_cache, v_cache, lengths, layer)
    kw = dict(scale=float(scale), layer=layer)
    if not C.runs_triton_kernel(implementation, triton.supports(q, k_cache), op="cache attention"):
        return cache_attention_reference(q, k_cache, v_cache, lengths, **kw)
    interpret = not triton.supported_on(C.default_device())
    return triton.cache_attention(
        q, k_cache, v_cache, lengths, config=config, interpret=interpret, **kw
    )
