"""Tests for mtpjax.verify.metrics: counter arithmetic against a plain Python loop written after
vLLM's `SpecDecodingStats.observe_draft`, merging, the derived rates and the summary line.

Shapes: [B] sequences per round, [K] draft positions.
"""

import math

import chex
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

from mtpjax.verify import SpecDecodeMetrics, metrics
from mtpjax.verify.accept import accept

K = 4
B = 8


@jax.jit
@chex.assert_max_traces(n=1)
def _update(m, num_accepted, num_drafted):
    return metrics.update(m, num_accepted, num_drafted)


def _random_rounds(rng, rounds):
    """[(num_accepted int32[B], num_drafted int32[B])]: 0 <= accepted <= drafted <= K, with
    some sequences not drafting at all."""
    out = []
    for _ in range(rounds):
        drafted = rng.integers(0, K + 1, size=B)
        accepted = rng.integers(0, drafted + 1)
        out.append((accepted.astype(np.int32), drafted.astype(np.int32)))
    return out


def _python_loop(rounds):
    """The counters as vLLM accumulates them: one observed draft per sequence that drafted."""
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos = [0] * K
    for accepted, drafted in rounds:
        for a, d in zip(accepted.tolist(), drafted.tolist()):
            if d == 0:
                continue
            totals["num_drafts"] += 1
            totals["num_draft_tokens"] += d
            totals["num_accepted_tokens"] += a
            for i in range(a):
                per_pos[i] += 1
    return totals, per_pos


def _as_python(m: SpecDecodeMetrics):
    totals = {
        "num_drafts": int(m.num_drafts),
        "num_draft_tokens": int(m.num_draft_tokens),
        "num_accepted_tokens": int(m.num_accepted_tokens),
    }
    return totals, m.num_accepted_tokens_per_pos.tolist()


def test_update_matches_a_python_loop():
    rounds = _random_rounds(np.random.default_rng(0), 40)
    m = metrics.empty(K)
    for accepted, drafted in rounds:
        m = _update(m, accepted, drafted)
    assert _as_python(m) == _python_loop(rounds)
    assert m.num_accepted_tokens_per_pos.dtype == np.int32 and m.num_spec_tokens == K


def test_merge_equals_accumulating_in_one():
    rounds = _random_rounds(np.random.default_rng(1), 30)
    parts = []
    for chunk in (rounds[:7], rounds[7:20], rounds[20:]):
        m = metrics.empty(K)
        for accepted, drafted in chunk:
            m = _update(m, accepted, drafted)
        parts.append(m)
    merged = metrics.merge(metrics.merge(parts[0], parts[1]), parts[2])
    assert _as_python(merged) == _python_loop(rounds)
    # empty(K) is the identity, and merge is commutative.
    assert _as_python(metrics.merge(metrics.empty(K), parts[1])) == _as_python(parts[1])
    assert _as_python(metrics.merge(parts[0], parts[2])) == _as_python(
        metrics.merge(parts[2], parts[0])
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, K + 2), st.integers(-2, K + 2)), min_size=B, max_size=B))
def test_counts_stay_consistent_for_any_input(pairs):
    """Out-of-range inputs are clamped to 0 <= accepted <= min(drafted, K), so per-position
    counts always sum to the accepted total and never exceed the number of drafts."""
    accepted, drafted = (np.array(column, np.int32) for column in zip(*pairs))
    m = _update(metrics.empty(K), accepted, drafted)
    per_pos = m.num_accepted_tokens_per_pos
    assert int(per_pos.sum()) == int(m.num_accepted_tokens)
    assert np.all(np.diff(np.asarray(per_pos)) <= 0)  # position i+1 needs position i
    assert int(per_pos.max()) <= int(m.num_drafts) == int(np.sum(drafted > 0))
    assert (
        int(m.num_accepted_tokens) <= int(m.num_draft_tokens) == int(np.maximum(drafted, 0).sum())
    )
    expected = np.clip(accepted, 0, np.minimum(np.maximum(drafted, 0), K))
    assert int(m.num_accepted_tokens) == int(expected.sum())


def _example():
    """One round, K = 3: accepted [3, 1, 0, 2, 0] of drafted [3, 3, 3, 3, 0]."""
    m = metrics.update(
        metrics.empty(3), np.array([3, 1, 0, 2, 0], np.int32), np.array([3, 3, 3, 3, 0], np.int32)
    )
    return m


def test_derived_values_follow_vllm_formulas():
    m = _example()
    # 4 drafts (the sequence that drafted nothing is not one), 12 draft tokens, 6 accepted.
    assert _as_python(m) == (
        {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6},
        [3, 2, 1],
    )
    assert m.mean_acceptance_length() == pytest.approx(1 + 6 / 4)
    assert m.draft_acceptance_rate() == pytest.approx(6 / 12)
    np.testing.assert_allclose(m.acceptance_rate_per_pos(), [3 / 4, 2 / 4, 1 / 4])
    # Mean acceptance length = 1 + sum of the per-position rates.
    assert m.mean_acceptance_length() == pytest.approx(1 + m.acceptance_rate_per_pos().sum())


def test_summary_is_one_line_in_vllms_format():
    line = _example().summary()
    assert "\n" not in line
    assert line == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 6 tokens, "
        "Drafted: 12 tokens, Per-position acceptance rate: 0.750, 0.500, 0.250, "
        "Avg Draft acceptance rate: 50.0%"
    )
    timed = _example().summary(elapsed_s=2.0)
    assert "Accepted throughput: 3.00 tokens/s, Drafted throughput: 6.00 tokens/s" in timed
    assert timed.startswith("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted thr")


def test_no_drafts_gives_nan_everywhere():
    m = metrics.update(metrics.empty(2), np.zeros(3, np.int32), np.zeros(3, np.int32))
    assert int(m.num_drafts) == 0
    assert math.isnan(m.mean_acceptance_length())
    assert math.isnan(m.draft_acceptance_rate())
    assert np.all(np.isnan(m.acceptance_rate_per_pos()))
    assert m.summary() == (
        "SpecDecoding metrics: Mean acceptance length: nan, Accepted: 0 tokens, "
        "Drafted: 0 tokens, Per-position acceptance rate: nan, nan, "
        "Avg Draft acceptance rate: nan%"
    )


def test_counts_accept_results():
    """Fed `AcceptResult.num_accepted` and `num_valid`, position i counts results with
    num_accepted > i."""
    targets = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0], [1, 2, 0, 0]])
    logits = (targets[..., None] == np.arange(5)).astype(np.float32)
    drafts = np.array([[1, 2, 3], [1, 2, 0], [1, 1, 1], [1, 2, 3]], np.int32)
    num_valid = np.array([3, 3, 2, 0], np.int32)
    result = accept(drafts, None, logits, temperature=0.0, num_valid=num_valid)
    assert result.num_accepted.tolist() == [3, 2, 0, 0]
    m = metrics.update(metrics.empty(3), result.num_accepted, num_valid)
    assert _as_python(m) == (
        {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 5},
        [2, 2, 1],
    )


def test_metrics_are_a_pytree():
    m = _example()
    leaves = jax.tree_util.tree_leaves(m)
    assert len(leaves) == 6
    rebuilt = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(m), leaves)
    assert isinstance(rebuilt, SpecDecodeMetrics) and _as_python(rebuilt) == _as_python(m)


def test_validation_errors():
    with pytest.raises(ValueError, match="int\\[B\\]"):
        metrics.update(metrics.empty(2), np.zeros(3, np.int32), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="int\\[B\\]"):
        metrics.update(metrics.empty(2), np.zeros((3, 1), np.int32), np.zeros((3, 1), np.int32))
    with pytest.raises(ValueError, match="cannot merge"):
        metrics.merge(metrics.empty(2), metrics.empty(3))
    with pytest.raises(ValueError, match="k"):
        metrics.empty(-1)
