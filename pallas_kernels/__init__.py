"""Pallas GPU ops with ``implementation=`` dispatch and pure-``jnp`` references.

* :func:`linear` — ``x @ W.T`` for BF16, FP8 per-row, FP8 block-128 and NVFP4 weight pytrees;
  backends Mosaic GPU (``wgmma``, sm_90) and Triton; :func:`linear_reference` is the XLA path.
* :func:`paged_attention` — one query row per sequence over a paged KV pool (Triton);
  :func:`paged_attention_reference` is the XLA path.
* :func:`cache_attention` — query rows over each sequence's contiguous KV cache (Triton), and
  :func:`rms_norm` / :func:`l2_normalize` (Triton): kernels whose rows' results do not depend on
  how many rows share the call, for the target models' steps; :func:`recurrent_delta_rule`
  (Triton) likewise for the Gated DeltaNet layers' steps, and :func:`recurrent_delta_rule_stacked`
  over a model's stack of GDN snapshots, updated in place.

Every backend declares where it compiles (``supported_on(device)``) and what it takes
(``supports``); AUTO picks the first that holds, else the reference. This package never imports
``mtpjax``.
"""

from pallas_kernels._cache_attention.api import cache_attention
from pallas_kernels._cache_attention.reference import cache_attention_reference
from pallas_kernels._cache_attention.triton import CacheAttentionConfig
from pallas_kernels._delta_rule.api import recurrent_delta_rule, recurrent_delta_rule_stacked
from pallas_kernels._delta_rule.reference import (
    recurrent_delta_rule_reference,
    recurrent_delta_rule_stacked_reference,
)
from pallas_kernels._linear.api import BACKENDS, linear, linear_backend
from pallas_kernels._linear.base import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    FP8_BLOCK,
    NVFP4_BLOCK,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    LinearBackend,
    Nvfp4Weight,
    StackedWeight,
    Weight,
    WeightFormat,
    decode_e2m1,
    unpack_e2m1,
)
from pallas_kernels._linear.mosaic_gpu import MOSAIC_GPU, MosaicGemvConfig, MosaicLinear
from pallas_kernels._linear.reference import linear_reference
from pallas_kernels._linear.triton import TRITON, GemvConfig, TritonLinear
from pallas_kernels._paged_attention.api import paged_attention
from pallas_kernels._paged_attention.reference import paged_attention_reference
from pallas_kernels._paged_attention.triton import PagedAttentionConfig
from pallas_kernels._row_norm.api import l2_normalize, rms_norm
from pallas_kernels._row_norm.reference import row_norm_reference
from pallas_kernels.implementation import Implementation

__all__ = [
    "BACKENDS",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_BLOCK",
    "MOSAIC_GPU",
    "NVFP4_BLOCK",
    "TRITON",
    "Bf16Weight",
    "CacheAttentionConfig",
    "Fp8BlockWeight",
    "Fp8RowWeight",
    "GemvConfig",
    "Implementation",
    "LinearBackend",
    "MosaicGemvConfig",
    "MosaicLinear",
    "Nvfp4Weight",
    "PagedAttentionConfig",
    "StackedWeight",
    "TritonLinear",
    "Weight",
    "WeightFormat",
    "cache_attention",
    "cache_attention_reference",
    "decode_e2m1",
    "l2_normalize",
    "linear",
    "linear_backend",
    "linear_reference",
    "paged_attention",
    "paged_attention_reference",
    "recurrent_delta_rule",
    "recurrent_delta_rule_reference",
    "recurrent_delta_rule_stacked",
    "recurrent_delta_rule_stacked_reference",
    "rms_norm",
    "row_norm_reference",
    "unpack_e2m1",
]
