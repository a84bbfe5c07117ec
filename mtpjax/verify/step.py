"""The jit'd verify step: target LM head over the verify rows, acceptance, drafter trimming.

One call per speculative round. The target has already run its forward over each sequence's
verify window `[t_n, d_1, ..., d_K]` and hands over the K+1 post-final-norm hidden states; this
step projects them through the target's LM head (one batched call of B * (K+1) rows, so the
head's verify tier serves it), accepts a prefix of the drafts, trims the drafter rows the next
propose must rebuild, and accumulates vLLM-compatible metrics.

Shapes: `[B]` sequences, `[K]` drafts per sequence, `[H]` hidden, `[V]` vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

from mtpjax.config import LMHeadConfig
from mtpjax.drafter import ProposeOutput, after_verify
from mtpjax.head import LMHeadParams, lm_head
from mtpjax.verify import metrics as metrics_lib
from mtpjax.verify.accept import accept
from mtpjax.verify.metrics import SpecDecodeMetrics


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["num_accepted", "output_tokens", "num_output"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyOutput:
    """Attributes:
    num_accepted: int32[B] drafts accepted (0 for inactive sequences).
    output_tokens: int32[B, K+1] tokens to commit: the accepted drafts then the target's token;
      -1 from `num_output` on (and everywhere for inactive sequences).
    num_output: int32[B] tokens to commit (`num_accepted + 1`; 0 for inactive sequences).
    """

    num_accepted: jax.Array
    output_tokens: jax.Array
    num_output: jax.Array


@functools.partial(
    jax.jit,
    static_argnames=("head_cfg", "temperature", "implementation"),
    donate_argnames=("state",),
)
def verify(
    head: LMHeadParams,
    state,
    target_hidden: jax.Array,
    drafts: ProposeOutput,
    *,
    head_cfg: LMHeadConfig,
    temperature: float = 0.0,
    key: jax.Array | None = None,
    refeed: bool | jax.Array = False,
    metrics: SpecDecodeMetrics | None = None,
    active: jax.Array | None = None,
    implementation: str = "auto",
) -> tuple[VerifyOutput, object, SpecDecodeMetrics]:
    """Verifies one round of drafts.

    Args:
      head: the target's LM head.
      state: the drafter state after `propose` (a `DrafterState` or a multi-module state);
        donated: its KV pool is trimmed in place.
      target_hidden: f32[B, K+1, H] the target's post-final-norm hidden over the verify window
        `[t_n, d_1, ..., d_K]`; row i scores the token after `d_i` (row 0: after `t_n`).
      drafts: the `ProposeOutput` of this round (its `tokens` and `num_valid` are used).
      head_cfg: the target's LM-head config (full vocab: drafts are checked against the
        target's own distribution).
      temperature: 0.0 for greedy acceptance; > 0 for lossless rejection sampling (the drafts
        are argmax drafts, so the draft distribution is one-hot at each draft).
      key: PRNG key, required when temperature > 0.
      refeed: rebuild accepted chain rows from the target's hidden (see `after_verify`).
      metrics: running metrics to update; a fresh counter when None.
      active: bool[B] sequences taking part (default: those with a valid draft or row).

    Returns:
      (VerifyOutput, new drafter state, updated metrics).
    """
    B, K = drafts.tokens.shape
    chex.assert_shape(target_hidden, (B, K + 1, head_cfg.hidden_size))
    if active is None:
        active = jnp.ones((B,), bool)
    num_valid = jnp.where(active, drafts.num_valid, 0)
    logits = lm_head(
        head, target_hidden.reshape(B * (K + 1), -1), cfg=head_cfg, implementation=implementation
    )
    logits = logits.reshape(B, K + 1, -1).astype(jnp.float32)
    result = accept(
        drafts.tokens, None, logits, temperature=temperature, key=key, num_valid=num_valid
    )
    num_accepted = jnp.where(active, result.num_accepted, 0)
    out = VerifyOutput(
        num_accepted=num_accepted,
        output_tokens=jnp.where(active[:, None], result.output_tokens, -1),
        num_output=jnp.where(active, result.num_output, 0),
    )
    # Inactive sequences proposed nothing this round (last_num_drafted is 0 for them), so the
    # trim leaves them untouched. after_verify serves single- and multi-module states alike.
    _, state = after_verify(state, num_accepted, refeed=refeed)
    if metrics is None:
        metrics = metrics_lib.empty(K)
    metrics = metrics_lib.update(metrics, num_accepted, num_valid)
    return out, state, metrics
