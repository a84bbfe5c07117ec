"""The target's LM head and embedding: the row-count ladder, the transposed verify copy, and the
vocab-parallel head (DESIGN §7).

    params = head.from_arrays(cfg, lm_head=w, embedding=e, precision="nvfp4")
    if head.verify_copy_used(params.weight.format):  # a verify kernel for the default tiers
        params = head.with_verify_copy(params)       # for 9..96-row verify projections
    logits = head.lm_head(params, hidden, cfg=cfg)   # [..., V]
    sharded = head.shard_lm_head(params, mesh, "tp")
    out = head.sharded_lm_head(sharded, hidden, cfg=cfg, with_logits=False)  # token, logprob
"""

from mtpjax.head.lm_head import (
    BATCHED_GEMV_MAX_ROWS,
    VERIFY_COLUMN_ALIGN,
    VERIFY_MAX_ROWS,
    XLA_ROW_QUANTUM,
    Bf16VerifyWeight,
    Fp8BlockVerifyWeight,
    Fp8RowVerifyWeight,
    HeadTier,
    LMHeadParams,
    Nvfp4VerifyWeight,
    VerifyKernel,
    VerifyWeight,
    build_verify_copy,
    embed,
    from_arrays,
    head_tier,
    init_lm_head,
    lm_head,
    register_verify_kernel,
    registered_verify_kernels,
    verify_copy_used,
    verify_matmul_reference,
    with_verify_copy,
)
from mtpjax.head.sharded import (
    HeadOutput,
    ShardedLMHeadParams,
    padded_vocab,
    shard_lm_head,
    sharded_lm_head,
)

__all__ = [
    "BATCHED_GEMV_MAX_ROWS",
    "VERIFY_COLUMN_ALIGN",
    "VERIFY_MAX_ROWS",
    "XLA_ROW_QUANTUM",
    "Bf16VerifyWeight",
    "Fp8BlockVerifyWeight",
    "Fp8RowVerifyWeight",
    "HeadOutput",
    "HeadTier",
    "LMHeadParams",
    "Nvfp4VerifyWeight",
    "ShardedLMHeadParams",
    "VerifyKernel",
    "VerifyWeight",
    "build_verify_copy",
    "embed",
    "from_arrays",
    "head_tier",
    "init_lm_head",
    "lm_head",
    "padded_vocab",
    "register_verify_kernel",
    "registered_verify_kernels",
    "shard_lm_head",
    "sharded_lm_head",
    "verify_copy_used",
    "verify_matmul_reference",
    "with_verify_copy",
]
