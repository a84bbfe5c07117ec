"""Pallas GPU kernels (Triton lowering; the NVFP4 GEMV also through Mosaic GPU) with pure-``jnp``
reference twins.

Every public kernel takes raw arrays (the DESIGN §3 weight leaves), an optional frozen tile
config and ``interpret: bool`` (True runs the same kernel on the CPU); its ``*_reference`` twin has
the same signature, accumulates in F32 and is both the fallback and the test oracle. Use
:func:`gpu_available` to decide between them.

Row-count dispatch for a projection (DESIGN §7): 1..8 rows (and 16, 32) -> ``gemv`` kernels, which
stream the weight once for all rows; 9..96 rows -> ``verify_gemm`` on the transposed padded copy
(:func:`make_transposed`), which only the LM head keeps; `mtpjax.kernels` serves the other
projections' many-row regimes from BF16 tensor-core dots and chunked batched GEMVs.
"""

from pallas_kernels._common import gpu_available
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
from pallas_kernels.gemv_mosaic import K_ALIGN as MOSAIC_K_ALIGN
from pallas_kernels.gemv_mosaic import N_ALIGN as MOSAIC_N_ALIGN
from pallas_kernels.gemv_mosaic import (
    MosaicGemvConfig,
    nvfp4_gemv_mosaic,
    prepare_nvfp4_mosaic,
)
from pallas_kernels.paged_attention import (
    PagedAttentionConfig,
    paged_attention,
    paged_attention_reference,
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
    "MOSAIC_K_ALIGN",
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
    "fp8_block_gemv_reference",
    "fp8_row_gemv",
    "fp8_row_gemv_reference",
    "gpu_available",
    "make_transposed",
    "nvfp4_gemv",
    "nvfp4_gemv_mosaic",
    "nvfp4_gemv_reference",
    "paged_attention",
    "paged_attention_reference",
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
