"""The verify step: target LM head over the verify rows, acceptance, drafter trimming.

One call per speculative round. The target has already run its forward over each sequence's
verify window `[t_n, d_1, ..., d_K]` and hands over the K+1 post-final-norm hidden states; this
step projects them through the target's LM head (one batched call of B * (K+1) rows), accepts a
prefix of the drafts, trims the drafter rows the next propose must rebuild, and accumulates
vLLM-compatible metrics.

Shapes: `[B]` sequences, `[K]` drafts per sequence, `[H]` hidden, `[V]` vocab.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from mtpjax import device_values
from mtpjax.config import LMHeadConfig, configs_by_name
from mtpjax.drafter import ProposeOutput, after_verify
from mtpjax.head import LMHeadParams, lm_head
from mtpjax.kv import donation
from mtpjax.verify import accept as accept_lib
from mtpjax.verify import metrics as metrics_lib
from pallas_kernels.implementation import Implementation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyOutput:
    """Attributes:
    num_accepted: int32[B] drafts accepted (0 for inactive sequences).
    output_tokens: int32[B, K+1] tokens to commit: the accepted drafts then the target's token;
      -1 from `num_output` on (and everywhere for inactive sequences).
    num_output: int32[B] tokens to commit (`num_accepted + 1`; 0 for inactive sequences).
    metrics: the running `SpecDecodeMetrics` with this round added (K positions).
    """

    num_accepted: jax.Array
    output_tokens: jax.Array
    num_output: jax.Array
    metrics: metrics_lib.SpecDecodeMetrics


@configs_by_name
def verify(
    head: LMHeadParams,
    state,
    target_hidden: jax.Array,
    drafts: ProposeOutput,
    *,
    cfg: LMHeadConfig,
    temperature: float | jax.Array = 0.0,
    key: jax.Array | None = None,
    refeed: bool | jax.Array = False,
    metrics: metrics_lib.SpecDecodeMetrics | None = None,
    active: jax.Array | None = None,
    implementation: Implementation | str = Implementation.AUTO,
    num_proposed: jax.Array | None = None,
) -> tuple[VerifyOutput, object]:
    """Verifies one round of drafts; one jit (every temperature > 0 shares a program).

    Args:
      head: the target's LM head.
      state: the drafter state after `propose`; donated: its KV pool is trimmed in place.
      target_hidden: f32[B, K+1, H] the target's post-final-norm hidden over the verify window
        `[t_n, d_1, ..., d_K]`; row i scores the token after `d_i` (row 0: after `t_n`).
      drafts: the `ProposeOutput` of this round.
      cfg: the target's LM-head config (full vocab: drafts are checked against the target's
        own distribution).
      temperature: 0.0 for greedy acceptance; > 0 for lossless rejection sampling against
        `drafts.draft_probs`, the proposal of sampled drafts (propose at the same temperature),
        or, for argmax drafts (None), a draft distribution one-hot at each draft. A real scalar,
        traced (see `accept.check_temperature`).
      key: PRNG key, required when temperature > 0.
      refeed: bool or bool[B], traced; rebuild accepted chain rows from the target's hidden
        (see `after_verify`).
      metrics: running metrics to update; a fresh counter when None.
      active: bool[B] sequences taking part. Default: `drafts.active`, the sequences `propose`
        ran (a sequence that ran with zero valid drafts still gets the target's token); every
        sequence for drafts built by hand without it.
      implementation: `Implementation` (or its name, any case) of the LM head.
      num_proposed: int[B] drafts the drafter proposed when fewer were sent (`drafts.num_valid`
        cut by `draft_length.send`), for the metrics; default: as many as were sent.

    Returns:
      (VerifyOutput with the updated metrics, new drafter state).
    """
    temperature, key = accept_lib.check_temperature(temperature, key)
    return _verify(
        head,
        state,
        target_hidden,
        drafts,
        temperature,
        key,
        device_values.scalar(refeed, "bool")
        if isinstance(refeed, bool)
        else jnp.asarray(refeed, bool),
        metrics,
        active,
        num_proposed,
        cfg=cfg,
        # The canonical name: one static value per choice, and every layer below takes it.
        implementation=Implementation.parse(implementation).value,
    )


@donation.step(static_argnames=("cfg", "implementation"))
def _verify(
    head,
    state,
    target_hidden,
    drafts,
    temperature,
    key,
    refeed,
    metrics,
    active,
    num_proposed,
    *,
    cfg,
    implementation,
):
    B, K = drafts.tokens.shape
    chex.assert_shape(target_hidden, (B, K + 1, cfg.hidden_size))
    if active is None:
        active = jnp.ones((B,), bool) if drafts.active is None else drafts.active
    num_valid = jnp.where(active, drafts.num_valid, 0)
    logits = lm_head(
        head, target_hidden.reshape(B * (K + 1), -1), cfg=cfg, implementation=implementation
    )
    logits = logits.reshape(B, K + 1, -1).astype(jnp.float32)
    result = accept_lib.accept(
        drafts.tokens,
        drafts.draft_probs,
        logits,
        temperature=temperature,
        key=key,
        num_valid=num_valid,
    )
    num_accepted = jnp.where(active, result.num_accepted, 0)
    # Inactive sequences proposed nothing this round (last_num_drafted is 0 for them), so the
    # trim leaves them untouched.
    _, state = after_verify(state, num_accepted, refeed=refeed)
    if metrics is None:
        metrics = metrics_lib.empty(K)
    out = VerifyOutput(
        num_accepted=num_accepted,
        output_tokens=jnp.where(active[:, None], result.output_tokens, -1),
        num_output=jnp.where(active, result.num_output, 0),
        metrics=metrics_lib.update(
            metrics,
            num_accepted,
            num_valid,
            None if num_proposed is None else jnp.where(active, num_proposed, 0),
        ),
    )
    return out, state
