"""Speculative-decoding acceptance counters with vLLM's names and meanings.

`SpecDecodeMetrics` is a pytree of int32 counters accumulated inside jit by `update` (one call
per verify round) and combined with `merge` (across rounds, hosts or runs). The derived rates
are host-side methods that read the counters back:

  mean acceptance length     1 + num_accepted_tokens / num_drafts   (counts the bonus token)
  draft acceptance rate      num_accepted_tokens / num_draft_tokens
  per-position acceptance    num_accepted_tokens_per_pos / num_drafts
  fraction of drafts sent    num_draft_tokens / num_proposed_tokens (1 unless an adaptive draft
                             length, ``mtpjax.verify.draft_length``, held drafts back)

A ratio whose denominator is zero (nothing drafted yet) is NaN, for every derived value alike:
"no data" stays distinguishable from "nothing accepted". vLLM's log line agrees for the
acceptance rate; its `compute_acceptance_len` returns 1 instead.

Counters are int32 (JAX's default integer), so one accumulator holds up to 2**31 - 1 tokens;
long runs should read the counters to the host and `merge` into fresh ones periodically.

Shapes:
  [B]  sequences in one verify round
  [K]  draft positions (the largest number of drafts per round)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SpecDecodeMetrics", "empty", "merge", "update"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecDecodeMetrics:
    """Accumulated acceptance counters (vLLM's `SpecDecodingStats`).

    Attributes:
      num_drafts: int32[] draft rounds, counting one per sequence per round that proposed at
        least one token.
      num_draft_tokens: int32[] drafted tokens submitted for verification.
      num_accepted_tokens: int32[] drafted tokens accepted (bonus tokens not included).
      num_accepted_tokens_per_pos: int32[K] entry i counts rounds whose draft at position i was
        accepted; it sums to `num_accepted_tokens`.
      num_proposed_tokens: int32[] drafted tokens the drafter proposed (valid drafts), of which
        `num_draft_tokens` were sent; the two differ only under an adaptive draft length.
      num_rounds_per_sent: int32[K+1] entry n counts rounds (per sequence) that proposed at
        least one draft and sent n of them: what a cost model of the verify needs.
    """

    num_drafts: jax.Array  # []
    num_draft_tokens: jax.Array  # []
    num_accepted_tokens: jax.Array  # []
    num_accepted_tokens_per_pos: jax.Array  # [K]
    num_proposed_tokens: jax.Array  # []
    num_rounds_per_sent: jax.Array  # [K+1]

    @property
    def num_spec_tokens(self) -> int:
        """K, the number of draft positions tracked."""
        return self.num_accepted_tokens_per_pos.shape[0]

    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per round, bonus included; NaN with no drafts."""
        num_drafts, _, num_accepted, _ = _host_counts(self)
        return 1.0 + _ratio(num_accepted, num_drafts)

    def draft_acceptance_rate(self) -> float:
        """accepted / drafted tokens, in [0, 1]; NaN when nothing was drafted."""
        _, num_draft_tokens, num_accepted, _ = _host_counts(self)
        return _ratio(num_accepted, num_draft_tokens)

    def acceptance_rate_per_pos(self) -> np.ndarray:
        """float64[K]: accepted_per_pos / drafts; all NaN with no drafts."""
        num_drafts, _, _, per_pos = _host_counts(self)
        if num_drafts == 0:
            return np.full(per_pos.shape, np.nan)
        return per_pos.astype(np.float64) / num_drafts

    def summary(self, elapsed_s: float | None = None) -> str:
        """One line in the form of vLLM's spec-decoding log; throughputs only with `elapsed_s`."""
        _, num_draft_tokens, num_accepted, _ = _host_counts(self)
        parts = [f"Mean acceptance length: {self.mean_acceptance_length():.2f}"]
        if elapsed_s is not None and elapsed_s > 0:
            parts += [
                f"Accepted throughput: {num_accepted / elapsed_s:.2f} tokens/s",
                f"Drafted throughput: {num_draft_tokens / elapsed_s:.2f} tokens/s",
            ]
        rates = ", ".join(f"{r:.3f}" for r in self.acceptance_rate_per_pos())
        parts += [
            f"Accepted: {num_accepted} tokens",
            f"Drafted: {num_draft_tokens} tokens",
            f"Per-position acceptance rate: {rates}",
            f"Avg Draft acceptance rate: {100 * self.draft_acceptance_rate():.1f}%",
        ]
        return "SpecDecoding metrics: " + ", ".join(parts)


def empty(k: int) -> SpecDecodeMetrics:
    """Zero counters for K draft positions."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k (draft positions) must be an int >= 0, got {k!r}")
    zero = jnp.zeros((), jnp.int32)
    return SpecDecodeMetrics(
        num_drafts=zero,
        num_draft_tokens=zero,
        num_accepted_tokens=zero,
        num_accepted_tokens_per_pos=jnp.zeros((k,), jnp.int32),
        num_proposed_tokens=zero,
        num_rounds_per_sent=jnp.zeros((k + 1,), jnp.int32),
    )


@jax.jit
def update(
    metrics: SpecDecodeMetrics,
    num_accepted: jax.Array,
    num_drafted: jax.Array,
    num_proposed: jax.Array | None = None,
) -> SpecDecodeMetrics:
    """Adds one verify round. Pure; jitted, so a host loop over rounds stays cheap.

    Args:
      metrics: the counters so far, K positions.
      num_accepted: int[B] drafts accepted per sequence (`AcceptResult.num_accepted`).
      num_drafted: int[B] drafts sent for verification per sequence (e.g. `num_valid`);
        sequences with 0 did not draft and add nothing, not even to `num_drafts`.
      num_proposed: int[B] drafts the drafter proposed, of which `num_drafted` were sent
        (clamped to >= num_drafted); default `num_drafted`.

    Counts are clamped so that ``0 <= accepted <= min(drafted, K)``; this keeps
    ``sum(num_accepted_tokens_per_pos) == num_accepted_tokens`` even for inconsistent inputs.
    """
    if num_accepted.ndim != 1 or num_accepted.shape != num_drafted.shape:
        raise ValueError(
            "num_accepted and num_drafted must both be int[B], got "
            f"{list(num_accepted.shape)} and {list(num_drafted.shape)}"
        )
    k = metrics.num_spec_tokens
    drafted = jnp.maximum(num_drafted.astype(jnp.int32), 0)  # [B]
    accepted = jnp.clip(num_accepted.astype(jnp.int32), 0, jnp.minimum(drafted, k))  # [B]
    positions = jnp.arange(k, dtype=jnp.int32)
    per_pos = jnp.sum(accepted[:, None] > positions[None, :], axis=0, dtype=jnp.int32)  # [K]
    if num_proposed is None:
        proposed = drafted
    else:
        if num_proposed.shape != num_drafted.shape:
            raise ValueError(
                f"num_proposed must be int[B] like num_drafted {list(num_drafted.shape)}, got "
                f"{list(num_proposed.shape)}"
            )
        proposed = jnp.maximum(num_proposed.astype(jnp.int32), drafted)
    sent = jnp.minimum(drafted, k)
    lengths = jnp.arange(k + 1, dtype=jnp.int32)
    per_sent = jnp.sum((proposed[:, None] > 0) & (sent[:, None] == lengths), axis=0)  # [K+1]
    return SpecDecodeMetrics(
        num_drafts=metrics.num_drafts + jnp.sum(drafted > 0, dtype=jnp.int32),
        num_draft_tokens=metrics.num_draft_tokens + jnp.sum(drafted, dtype=jnp.int32),
        num_accepted_tokens=metrics.num_accepted_tokens + jnp.sum(accepted, dtype=jnp.int32),
        num_accepted_tokens_per_pos=metrics.num_accepted_tokens_per_pos + per_pos,
        num_proposed_tokens=metrics.num_proposed_tokens + jnp.sum(proposed, dtype=jnp.int32),
        num_rounds_per_sent=metrics.num_rounds_per_sent + per_sent.astype(jnp.int32),
    )


@jax.jit
def merge(a: SpecDecodeMetrics, b: SpecDecodeMetrics) -> SpecDecodeMetrics:
    """Sum of two accumulators over the same K. Pure; jitted."""
    if a.num_spec_tokens != b.num_spec_tokens:
        raise ValueError(
            f"cannot merge metrics over {a.num_spec_tokens} and {b.num_spec_tokens} positions"
        )
    return jax.tree_util.tree_map(jnp.add, a, b)


def _host_counts(metrics: SpecDecodeMetrics) -> tuple[int, int, int, np.ndarray]:
    """Reads the counters to the host as Python ints (and int64[K])."""
    m = jax.device_get(metrics)
    return (
        int(m.num_drafts),
        int(m.num_draft_tokens),
        int(m.num_accepted_tokens),
        np.asarray(m.num_accepted_tokens_per_pos, np.int64),
    )


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else float("nan")
