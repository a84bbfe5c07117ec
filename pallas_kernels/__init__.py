"""Pallas GPU kernels (Triton lowering; the NVFP4 and FP8 per-row GEMVs also through Mosaic GPU)
with pure-``jnp`` reference twins.

Every public kernel takes raw arrays (the DESIGN §3 weight leaves), an optional frozen tile
config and ``interpret: bool`` (True runs the same kernel on the CPU); its ``*_reference`` twin has
the same signature, accumulates in F32 and is both the fallback and the test oracle. Use
:func:`gpu_available` to decide between them.

Kernel families: ``gemv`` (Triton; 1..32 rows, the weight streamed once for all rows),
``gemv_mosaic`` (Mosaic GPU ``wgmma``; NVFP4, FP8 per-row and block-128, 1..128 rows), ``verify_gemm``
(Triton; 9..96 rows on the transposed padded copy of :func:`make_transposed`), ``argmax`` and
``paged_attention``. Which one a projection gets on the GPU is `mtpjax.kernels`' choice.
"""

from pallas_kernels._common import gpu_available
from pallas_kernels._paged_attention.api import paged_attention
from pallas_kernels._paged_attention.reference import paged_attention_reference
from pallas_kernels._paged_attention.triton import PagedAttentionConfig
from pallas_kernels.argmax import ArgmaxConfig, argmax_logprob, argmax_logprob_reference
from pallas_kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from pallas_kernels.gemv import (
    GemvConfig,
    bf16_gemv,
    bf16_gemv_reference,
    fp8_block_gemv,
    fp8_block_gemv_reference,
    fp8_row_gemv,
    fp8_row_gemv_reference,
    nvfp4_gemv,
    nvfp4_gemv_reference,
)
from pallas_kernels.gemv_mosaic import FP8_K_ALIGN as MOSAIC_FP8_K_ALIGN
from pallas_kernels.gemv_mosaic import K_ALIGN as MOSAIC_K_ALIGN
from pallas_kernels.gemv_mosaic import MAX_ROWS as MOSAIC_MAX_ROWS
from pallas_kernels.gemv_mosaic import N_ALIGN as MOSAIC_N_ALIGN
from pallas_kernels.gemv_mosaic import (
    MosaicGemvConfig,
    fp8_block_gemv_mosaic,
    fp8_row_gemv_mosaic,
    nvfp4_gemv_mosaic,
    prepare_fp8_block_mosaic,
    prepare_fp8_row_mosaic,
    prepare_nvfp4_mosaic,
)
from pallas_kernels.verify_gemm import (
    VerifyGemmConfig,
    make_transposed,
    verify_gemm_bf16,
    verify_gemm_bf16_reference,
    verify_gemm_fp8_block,
    verify_gemm_fp8_block_reference,
    verify_gemm_fp8_row,
    verify_gemm_fp8_row_reference,
    verify_gemm_nvfp4,
    verify_gemm_nvfp4_reference,
)

__all__ = [
    "GEMV_MAX_ROWS",
    "MOSAIC_FP8_K_ALIGN",
    "MOSAIC_K_ALIGN",
    "MOSAIC_MAX_ROWS",
    "MOSAIC_N_ALIGN",
    "ArgmaxConfig",
    "GemvConfig",
    "MosaicGemvConfig",
    "PagedAttentionConfig",
    "VerifyGemmConfig",
    "argmax_logprob",
    "argmax_logprob_reference",
    "bf16_gemv",
    "bf16_gemv_reference",
    "fp8_block_gemv",
    "fp8_block_gemv_mosaic",
    "fp8_block_gemv_reference",
    "fp8_row_gemv",
    "fp8_row_gemv_mosaic",
    "fp8_row_gemv_reference",
    "gpu_available",
    "make_transposed",
    "nvfp4_gemv",
    "nvfp4_gemv_mosaic",
    "nvfp4_gemv_reference",
    "paged_attention",
    "paged_attention_reference",
    "prepare_fp8_block_mosaic",
    "prepare_fp8_row_mosaic",
    "prepare_nvfp4_mosaic",
    "verify_gemm_bf16",
    "verify_gemm_bf16_reference",
    "verify_gemm_fp8_block",
    "verify_gemm_fp8_block_reference",
    "verify_gemm_fp8_row",
    "verify_gemm_fp8_row_reference",
    "verify_gemm_nvfp4",
    "verify_gemm_nvfp4_reference",
]
