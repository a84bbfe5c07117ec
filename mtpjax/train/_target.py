"""The frozen target's outputs on a batch of sequences: its hidden states and logits, computed
once per batch under ``jax.lax.stop_gradient`` (no gradient ever reaches the target).

Shapes: ``[B]`` sequences, ``[N]`` tokens, ``H`` hidden, ``V`` vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtpjax import hybrid
from mtpjax.head import LMHeadParams, lm_head
from mtpjax.train._loss import Batch

__all__ = ["hybrid_batch"]


@functools.partial(jax.jit, static_argnames=("cfg", "with_logits", "implementation"))
def hybrid_batch(
    target: hybrid.HybridParams,
    head: LMHeadParams,
    tokens: jax.Array,
    mask: jax.Array,
    *,
    cfg: hybrid.HybridConfig,
    with_logits: bool,
    implementation: str = "xla",
) -> Batch:
    """A ``Batch`` of tokens int32[B, N] with mask f32[B, N]: ``hybrid.forward``'s hidden f32[B,
    N, H] (what the target hands the drafter at inference) and, with ``with_logits``, its
    logits f32[B, N, V] through its own head (what it verifies with)."""
    target, head = jax.lax.stop_gradient((target, head))
    hidden, _ = hybrid.forward(target, head, tokens, cfg=cfg, implementation=implementation)
    logits = None
    if with_logits:
        # The F32 hidden, as the verify step projects it.
        head_cfg = cfg.lm_head_config()
        logits = lm_head(head, hidden, cfg=head_cfg, implementation=implementation)
        logits = logits.astype(jnp.float32)
    return Batch(tokens=tokens, hidden=hidden, target_logits=logits, mask=mask.astype(jnp.float32))
