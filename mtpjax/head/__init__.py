"""The target's LM head and embedding, and the vocab-parallel head.

params = head.from_arrays(cfg, lm_head=w, embedding=e, precision="nvfp4")
logits = head.lm_head(params, hidden, cfg=cfg)   # [..., V]
sharded = head.shard_lm_head(params, mesh, "tp")
out = head.sharded_lm_head(sharded, hidden, cfg=cfg, with_logits=False)  # token, logprob
"""

from mtpjax.head._lm_head import (
    XLA_ROW_QUANTUM,
    LMHeadParams,
    embed,
    from_arrays,
    init_lm_head,
    lm_head,
)
from mtpjax.head._sharded import (
    HeadOutput,
    ShardedLMHeadParams,
    padded_vocab,
    shard_lm_head,
    sharded_lm_head,
)

__all__ = [
    "XLA_ROW_QUANTUM",
    "HeadOutput",
    "LMHeadParams",
    "ShardedLMHeadParams",
    "embed",
    "from_arrays",
    "init_lm_head",
    "lm_head",
    "padded_vocab",
    "shard_lm_head",
    "sharded_lm_head",
]
