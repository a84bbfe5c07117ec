"""Adaptive draft length inside static shapes: per round and per sequence, how many of the K
drafts to send to verification.

The drafter's own probability of each draft estimates whether the target accepts it, so the
running product ``c_i = prod_{j <= i} probs_j`` estimates the chance that the first ``i``
drafts all survive, and sending ``n`` drafts yields an expected ``E(n) = 1 + c_1 + .. + c_n``
tokens (the target's own token included). ``probs`` is the top-1 probability of argmax drafts
and ``q(d)`` of sampled ones, an estimate of acceptance in both cases, never a bound on it. A round costs ``propose_cost`` (the K drafts are made
whatever is sent) plus ``verify_cost[n]``, the target step and verify over ``n + 1`` rows per
sequence, both measured numbers; inside ``generate`` they are traced (``round_costs``), so one
program serves every policy for the same K. Each sequence sends the ``n`` in
``[0, num_valid]`` with the largest estimated goodput ``E(n) / (propose_cost +
verify_cost[n])`` (the smallest such n on a tie), so sequences of one batch differ.

Shapes stay static: the drafts past ``n`` become invalid (token -1, outside ``num_valid``), the
target still runs its K + 1 rows, and the rule never accepts past ``num_valid``. Greedy output is
therefore the target's whatever is sent; the saving is what an engine whose verify is sized to
the rows sent would pay (``round_cost``), which the metrics' ``num_rounds_per_sent`` prices.

Shapes: ``[B]`` sequences, ``[K]`` drafts.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.drafter import ProposeOutput

__all__ = ["DraftLengthPolicy", "choose", "choose_by_cost", "modelled_cost", "round_costs", "send"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftLengthPolicy:
    """Measured step costs (any one unit, e.g. ms) of one round, for K drafts; hashable.

    Attributes:
      verify_cost: K + 1 costs; entry n is the target step plus verify over n + 1 rows per
        sequence (n drafts sent).
      propose_cost: cost of the round's propose of K drafts (paid whatever is sent), >= 0.
    """

    verify_cost: tuple[float, ...]
    propose_cost: float

    def __post_init__(self):
        costs = tuple(float(c) for c in self.verify_cost)
        object.__setattr__(self, "verify_cost", costs)
        object.__setattr__(self, "propose_cost", float(self.propose_cost))
        if len(costs) < 2:
            raise ValueError(f"verify_cost needs K + 1 >= 2 entries, got {len(costs)}")
        if not all(math.isfinite(c) and c > 0 for c in costs):
            raise ValueError(f"verify_cost entries must be finite and > 0, got {costs}")
        if not (math.isfinite(self.propose_cost) and self.propose_cost >= 0):
            raise ValueError(f"propose_cost must be finite and >= 0, got {self.propose_cost}")

    @property
    def num_drafts(self) -> int:
        """K, the drafts per round the costs are for."""
        return len(self.verify_cost) - 1

    def round_cost(self, sent: int) -> float:
        """Modelled cost of one sequence's round that sent ``sent`` drafts."""
        return self.propose_cost + self.verify_cost[sent]


def round_costs(policy: DraftLengthPolicy) -> np.ndarray:
    """f32[K+1]: entry n the modelled cost of a round that sends n drafts."""
    return np.float32(policy.propose_cost) + np.asarray(policy.verify_cost, np.float32)


def choose(drafts: ProposeOutput, *, policy: DraftLengthPolicy) -> jax.Array:
    """int32[B] drafts to send per sequence: the n in ``[0, num_valid]`` of largest estimated
    goodput (module docstring). ``drafts.tokens`` must be [B, K] with K = policy.num_drafts."""
    return choose_by_cost(drafts, round_costs(policy))


def choose_by_cost(drafts: ProposeOutput, cost: jax.Array) -> jax.Array:
    """``choose`` with the round costs ``round_costs(policy)`` f32[K+1] given as an array
    (traced or not; positive, as a policy's are)."""
    B, K = drafts.tokens.shape
    if cost.shape != (K + 1,):
        raise ValueError(
            f"the round costs have {cost.shape[0] if cost.ndim == 1 else list(cost.shape)} "
            f"entries (K + 1); the drafts have K={K}"
        )
    chain = jnp.cumprod(drafts.probs.astype(jnp.float32), axis=1)  # [B, K]
    expected = 1.0 + jnp.concatenate([jnp.zeros((B, 1)), jnp.cumsum(chain, axis=1)], axis=1)
    goodput = expected / jnp.asarray(cost, jnp.float32)[None, :]  # [B, K+1]
    allowed = jnp.arange(K + 1)[None, :] <= drafts.num_valid[:, None]
    return jnp.argmax(jnp.where(allowed, goodput, -jnp.inf), axis=1).astype(jnp.int32)


def send(drafts: ProposeOutput, sent: jax.Array) -> ProposeOutput:
    """The drafts with only the first ``sent`` int[B] valid (the rest token -1, outside
    ``num_valid``); every other field, the proposal included, as it was."""
    num_valid = jnp.minimum(drafts.num_valid, sent.astype(jnp.int32))
    K = drafts.tokens.shape[1]
    keep = jnp.arange(K, dtype=jnp.int32)[None, :] < num_valid[:, None]
    return dataclasses.replace(
        drafts, tokens=jnp.where(keep, drafts.tokens, -1), num_valid=num_valid
    )


def modelled_cost(num_rounds_per_sent, *, policy: DraftLengthPolicy) -> float:
    """Total modelled cost of the rounds counted by ``SpecDecodeMetrics.num_rounds_per_sent``
    (int[K+1]) under ``policy``'s costs."""
    counts = np.asarray(jax.device_get(num_rounds_per_sent), np.float64)
    if counts.shape != (policy.num_drafts + 1,):
        raise ValueError(
            f"num_rounds_per_sent must be int[K+1] = [{policy.num_drafts + 1}], got "
            f"{list(counts.shape)}"
        )
    return float(sum(c * policy.round_cost(n) for n, c in enumerate(counts)))
