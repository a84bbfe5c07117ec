"""Tests for mtpjax.verify.accept: greedy matching on constructed cases, and exactness of
rejection sampling measured by chi-square tests that also reject deliberately wrong rules.

Shapes: [N] sequences (one sample each), [K] drafts, [V] vocabulary.

Compiling `accept` dominates the run time, so the random-mode tests share a few signatures
(batch N, K in {1, 3}, V = 6, temperature T, `num_valid` always passed) and use "rbg" keys,
which compile about twice as fast on CPU as the default threefry keys; the rule itself is
generic over key implementations (the K = 0 test runs it with a default key).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trace_helpers import count_calls

from mtpjax.drafter import DraftProbs
from mtpjax.verify import accept as accept_lib
from mtpjax.verify.accept import PLACEHOLDER_TOKEN_ID, AcceptResult, accept

# N independent sequences in one batch (one jit call) per round. A test fails when a chi-square
# p-value falls below P_FLOOR. Inputs and keys are seeded, so a passing test keeps passing;
# P_FLOOR bounds how unlucky a seed could be (< 1e-5 over the few p-values a test takes), while
# the wrong rules below land near p = 0.
N = 100_000
P_FLOOR = 1e-6
V = 6
T = 0.7  # != 1, so the temperature scaling of the target is part of what is tested


def _key(seed: int) -> jax.Array:
    return jax.random.key(seed, impl="rbg")


def _chi2_sf(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution, Q(df/2, stat/2), in float64: the series for
    P when stat/2 < df/2 + 1, else the continued fraction for Q (modified Lentz)."""
    a, x = df / 2, stat / 2
    if x <= 0:
        return 1.0
    prefactor = math.exp(a * math.log(x) - x - math.lgamma(a))
    if x < a + 1:
        term = total = 1 / a
        n = 0
        while term > 1e-17 * total:
            n += 1
            term *= x / (a + n)
            total += term
        return 1.0 - prefactor * total
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    q = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        q *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return prefactor * q


def _chi2_pvalue(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed tokens in [0, len(probs)) against probabilities."""
    probs = np.asarray(probs, np.float64).ravel()
    assert tokens.size and tokens.min() >= 0 and tokens.max() < probs.size
    counts = np.bincount(tokens, minlength=probs.size)
    expected = tokens.size * probs
    # The chi-square approximation needs no tiny cells; the fixtures keep every cell large.
    assert expected.min() >= 20, expected.min()
    stat = float(np.sum((counts - expected) ** 2 / expected))
    return _chi2_sf(stat, probs.size - 1)


def test_chi2_sf_matches_closed_forms():
    # Both branches, up to where the tests' threshold lives, against the closed forms for
    # df = 1..4: erfc(√(x/2)), e^(-x/2), erfc(√(x/2)) + √(2x/π) e^(-x/2), e^(-x/2)(1 + x/2).
    for x in (0.5, 1.0, 3.0, 10.0, 27.6, 40.0):
        h = x / 2
        closed = {
            1: math.erfc(math.sqrt(h)),
            2: math.exp(-h),
            3: math.erfc(math.sqrt(h)) + math.sqrt(2 * x / math.pi) * math.exp(-h),
            4: math.exp(-h) * (1 + h),
        }
        for df, value in closed.items():
            np.testing.assert_allclose(_chi2_sf(x, df), value, rtol=1e-9)
    # The tabulated 1e-6 critical value for df = 5 (V = 6 tokens) is 35.888.
    assert 0.999e-6 < _chi2_sf(35.888, 5) < 1.001e-6


# --------------------------------------------------------------------------------------------
# Inputs: per-row target p [K+1, V], drafter q [K, V], drafts x_i ~ q_i, all built in numpy.


def _random_dists(rng: np.random.Generator, rows: int, favourites=None) -> np.ndarray:
    """[rows, V] distributions with logits ~ N(0, 0.5²), so no cell is tiny; `favourites` [rows]
    adds 3 to one token per row, making it the likely (argmax-like) draft."""
    logits = rng.normal(scale=0.5, size=(rows, V))
    if favourites is not None:
        logits[np.arange(rows), favourites] += 3.0
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def _target_and_drafter(rng, k, explicit_q, same_rows=False):
    """Target rows p [K+1, V] and draft distributions q [K, V].

    Explicit q: unrelated random distributions (acceptance ~0.8 per draft). A one-hot draft is
    accepted with probability p(x) only, so there both favour the same token per row, as an
    argmax drafter does, to keep every position populated. `same_rows` repeats one row.
    """
    rows = 1 if same_rows else k + 1
    favourites = None if explicit_q else rng.integers(0, V, size=rows)
    p = _random_dists(rng, rows, favourites)
    q = _random_dists(rng, rows, favourites)
    if same_rows:
        return np.repeat(p, k + 1, axis=0), np.repeat(q, k, axis=0)
    return p, q[:k]


def _round_inputs(rng, p, q, explicit_q, n=N):
    """(draft_tokens int32[n, K] with x_i ~ q_i, draft_probs [n, K, V] or None, logits).

    With explicit_q False, q is only where the one-hot drafts come from: the rule sees
    draft_probs=None, which is exact whatever distribution the drafts were taken from.
    """
    k = q.shape[0]
    cdf = np.cumsum(q, axis=-1)
    drafts = np.minimum((rng.random((n, k, 1)) > cdf[None]).sum(-1), V - 1).astype(np.int32)
    # softmax(T log p / T) = p: the target rows reach the rule through the temperature.
    logits = np.broadcast_to(T * np.log(p), (n, k + 1, V))
    draft_probs = np.broadcast_to(q, (n, k, V)) if explicit_q else None
    return drafts, draft_probs, logits


def _accept(drafts, draft_probs, logits, seed, num_valid=None) -> AcceptResult:
    """`accept` at temperature T, always with num_valid so compilations are shared."""
    if num_valid is None:
        num_valid = np.full(drafts.shape[0], drafts.shape[1], np.int32)
    return accept(drafts, draft_probs, logits, temperature=T, key=_key(seed), num_valid=num_valid)


# --------------------------------------------------------------------------------------------
# A deliberately wrong rule, written here and never in the library, to prove the tests can fail.

FLAWS = {"inverted_ratio": 0, "resample_from_p": 1}


@jax.jit
def _wrong_accept(draft_tokens, draft_probs, target_logits, key, flaw, temperature=T):
    """Rejection sampling with one flaw: 0 accepts with min(1, q/p); 1 resamples a rejection
    from p instead of the residual max(p - q, 0). draft_probs [N, K, V] is always explicit.
    -> (output_tokens [N, K+1], num_output [N])."""
    batch, k = draft_tokens.shape
    p = jax.nn.softmax(target_logits / temperature, axis=-1)  # [N, K+1, V]
    rows, cols = jnp.arange(batch)[:, None], jnp.arange(k)[None, :]
    p_x, q_x = p[rows, cols, draft_tokens], draft_probs[rows, cols, draft_tokens]  # [N, K]
    ratio = jnp.where(flaw == 0, q_x / p_x, p_x / q_x)
    key_u, key_s = jax.random.split(key)
    accepted = jax.random.uniform(key_u, (batch, k)) < jnp.minimum(1.0, ratio)
    n = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1)  # [N]
    p_row = p[jnp.arange(batch), n]
    q_row = draft_probs[jnp.arange(batch), jnp.minimum(n, k - 1)]
    resample = jnp.where(flaw == 1, p_row, jnp.maximum(p_row - q_row, 0.0))
    dist = jnp.where((n < k)[:, None], resample, p_row)
    token = jax.random.categorical(key_s, jnp.log(dist), axis=-1)
    slots = jnp.arange(k + 1)[None, :]
    drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=-1)
    out = jnp.where(slots < n[:, None], drafts, jnp.where(slots == n[:, None], token[:, None], -1))
    return out, n + 1


def _run_rule(rule, inputs, seed):
    """-> (output_tokens int[N, K+1], num_output int[N]) as numpy, for the library or a flaw."""
    if rule == "library":
        result = _accept(*inputs, seed)
        return np.asarray(result.output_tokens), np.asarray(result.num_output)
    drafts, draft_probs, logits = inputs
    if draft_probs is None:  # one-hot drafts, spelled out
        draft_probs = (drafts[..., None] == np.arange(V)).astype(np.float32)
    out, num_output = _wrong_accept(drafts, draft_probs, logits, _key(seed), FLAWS[rule])
    return np.asarray(out), np.asarray(num_output)


def _per_position_pvalues(out, num_output, p):
    """p-value of token j, among rounds that emitted it (num_output > j), against p_j."""
    return [_chi2_pvalue(out[num_output > j, j], p[j]) for j in range(out.shape[1])]


# --------------------------------------------------------------------------------------------
# Rejection sampling is exact.


@pytest.mark.parametrize("explicit_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_emits_the_target_distribution(k, explicit_q):
    """Token j, whenever emitted, is distributed as target row j, for j = 0..K (bonus included)."""
    rng = np.random.default_rng(10 * k + explicit_q)
    p, q = _target_and_drafter(rng, k, explicit_q)
    out, num_output = _run_rule("library", _round_inputs(rng, p, q, explicit_q), seed=k)
    pvalues = _per_position_pvalues(out, num_output, p)
    assert len(pvalues) == k + 1
    assert min(pvalues) > P_FLOOR, pvalues
    assert np.sum(num_output == k + 1) > N // 20  # the bonus row is well exercised


@pytest.mark.parametrize("explicit_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("flaw", list(FLAWS))
def test_wrong_rules_fail_the_per_position_test(flaw, explicit_q):
    rng = np.random.default_rng(7)
    p, q = _target_and_drafter(rng, 3, explicit_q)
    out, num_output = _run_rule(flaw, _round_inputs(rng, p, q, explicit_q), seed=3)
    pvalues = _per_position_pvalues(out, num_output, p)
    assert min(pvalues) < P_FLOOR, pvalues


@pytest.mark.parametrize(
    ("rule", "explicit_q"),
    [("library", True), ("library", False), *((flaw, True) for flaw in FLAWS)],
)
def test_joint_of_the_first_two_tokens(rule, explicit_q):
    """With every row the same p the target process is i.i.d. p, so the first two tokens of a
    generation (taking a second round when the first emits one) are jointly p ⊗ p."""
    rng = np.random.default_rng(11)
    p, q = _target_and_drafter(rng, 3, explicit_q, same_rows=True)
    out1, n1 = _run_rule(rule, _round_inputs(rng, p, q, explicit_q), seed=1)
    out2, _ = _run_rule(rule, _round_inputs(rng, p, q, explicit_q), seed=2)
    second = np.where(n1 >= 2, out1[:, 1], out2[:, 0])
    pvalue = _chi2_pvalue(out1[:, 0] * V + second, np.outer(p[0], p[0]))
    if rule == "library":
        assert pvalue > P_FLOOR, pvalue
    else:
        assert pvalue < P_FLOOR, pvalue


def test_rejection_sampling_respects_num_valid():
    """Drafts past num_valid are never accepted; the bonus is sampled from row num_valid."""
    rng = np.random.default_rng(21)
    p, q = _target_and_drafter(rng, 3, True)
    inputs = _round_inputs(rng, p, q, True)
    num_valid = rng.integers(0, 4, size=N).astype(np.int32)
    result = _accept(*inputs, seed=21, num_valid=num_valid)
    out, num_output = np.asarray(result.output_tokens), np.asarray(result.num_output)
    assert np.all(num_output <= num_valid + 1)
    assert min(_per_position_pvalues(out, num_output, p)) > P_FLOOR
    # Sequences with no valid draft sample row 0 directly.
    assert _chi2_pvalue(out[num_valid == 0, 0], p[0]) > P_FLOOR


def test_empty_residual_falls_back_to_the_target():
    """q = 2p (not a distribution) rejects half the drafts with max(p - q, 0) = 0 everywhere;
    the rule must then resample from p, so it still emits exactly p."""
    rng = np.random.default_rng(31)
    p = _random_dists(rng, 2)
    drafts, _, logits = _round_inputs(rng, p, p[:1], True)
    result = _accept(drafts, np.broadcast_to(2 * p[:1], (N, 1, V)), logits, seed=31)
    out, num_accepted = np.asarray(result.output_tokens), np.asarray(result.num_accepted)
    assert 0.49 < num_accepted.mean() < 0.51
    assert _chi2_pvalue(out[:, 0], p[0]) > P_FLOOR


# --------------------------------------------------------------------------------------------
# Deterministic properties of the random rule (same shapes as above: no new compilation).


@pytest.mark.parametrize("explicit_q", [True, False], ids=["draft_probs", "one_hot"])
def test_sampling_from_a_point_mass_target_equals_greedy(explicit_q):
    rng = np.random.default_rng(41)
    targets = rng.integers(0, V, size=(N, 4))
    other = rng.integers(0, V, size=(N, 3))
    drafts = np.where(rng.random((N, 3)) < 0.7, targets[:, :3], other).astype(np.int32)
    # A gap of 1000 makes p exactly one-hot in float32.
    logits = 1000.0 * (targets[..., None] == np.arange(V)).astype(np.float32)
    draft_probs = _random_dists(rng, 3) if explicit_q else None
    if explicit_q:
        draft_probs = np.broadcast_to(draft_probs, (N, 3, V))
    num_valid = rng.integers(0, 4, size=N).astype(np.int32)
    sampled = _accept(drafts, draft_probs, logits, seed=0, num_valid=num_valid)
    greedy = accept(drafts, None, logits, temperature=0.0, num_valid=num_valid)
    np.testing.assert_array_equal(sampled.num_accepted, greedy.num_accepted)
    np.testing.assert_array_equal(sampled.output_tokens, greedy.output_tokens)


def test_a_drafter_equal_to_the_target_is_always_accepted():
    rng = np.random.default_rng(51)
    p, _ = _target_and_drafter(rng, 3, True)
    drafts, _, logits = _round_inputs(rng, p, p[:3], True)
    # q = p up to float32 rounding, which can reject a draft with probability ~1e-7.
    result = _accept(drafts, np.broadcast_to(p[:3], (N, 3, V)), logits, seed=2)
    assert np.mean(np.asarray(result.num_accepted) == 3) > 0.9999


def test_random_rule_invariants():
    rng = np.random.default_rng(61)
    logits = rng.normal(size=(N, 4, V)).astype(np.float32)
    drafts = rng.integers(0, V, size=(N, 3)).astype(np.int32)
    result = _accept(drafts, None, logits, seed=3)
    assert isinstance(result, AcceptResult)
    assert len(jax.tree_util.tree_leaves(result)) == 3  # a pytree: it crosses jit boundaries
    assert result.output_tokens.shape == (N, 4)
    assert result.output_tokens.dtype == jnp.int32 and result.num_accepted.dtype == jnp.int32
    n, out = np.asarray(result.num_accepted), np.asarray(result.output_tokens)
    np.testing.assert_array_equal(result.num_output, n + 1)
    slots = np.arange(4)[None, :]
    accepted_slot = slots < n[:, None]
    np.testing.assert_array_equal(
        out[accepted_slot], np.pad(drafts, ((0, 0), (0, 1)))[accepted_slot]
    )
    assert np.all(out[slots > n[:, None]] == PLACEHOLDER_TOKEN_ID)
    emitted = out[slots == n[:, None]]
    assert np.all((emitted >= 0) & (emitted < V))
    # With a one-hot q the resampled token is never the rejected draft.
    rejected = n < 3
    rejected_draft = drafts[np.arange(N), np.minimum(n, 2)]
    assert np.all(emitted[rejected] != rejected_draft[rejected])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_zero_drafts_emit_one_target_token(temperature):
    logits = np.array([[[0.0, 50.0, 0.0]], [[90.0, 0.0, 0.0]]], np.float32)
    result = accept(
        np.zeros((2, 0), np.int32), None, logits, temperature=temperature, key=jax.random.key(0)
    )
    assert result.num_accepted.tolist() == [0, 0]
    assert result.output_tokens.tolist() == [[1], [0]]


# --------------------------------------------------------------------------------------------
# Greedy verification on constructed cases.

TARGETS = [1, 4, 2, 3]  # argmax of the K+1 = 4 verify rows


def _greedy_from_logits(drafts, logits, num_valid=None):
    """Greedy `accept` -> (num_accepted, output_tokens, num_output) as lists.

    Batches of up to 8 cases [B, 3] are padded to 8 rows so all constructed cases share one
    compilation; num_valid=None goes through as None, so its default is what is tested.
    """
    drafts, logits = np.asarray(drafts, np.int32), np.asarray(logits, np.float32)
    batch = drafts.shape[0]
    pad = ((0, 8 - batch),) + ((0, 0),) * (logits.ndim - 1)
    if num_valid is not None:
        num_valid = np.pad(np.asarray(num_valid, np.int32), pad[:1])
    result = accept(
        np.pad(drafts, pad[:2]), None, np.pad(logits, pad), temperature=0.0, num_valid=num_valid
    )
    return (
        result.num_accepted[:batch].tolist(),
        result.output_tokens[:batch].tolist(),
        result.num_output[:batch].tolist(),
    )


def _greedy(drafts, targets, num_valid=None):
    """Greedy `accept` on target argmax ids [B, K+1]."""
    targets = np.asarray(targets)
    # Distinct lower logits off the argmax, so only the argmax matters.
    logits = 3.0 * (targets[..., None] == np.arange(V)) + 0.1 * np.arange(V)[::-1]
    return _greedy_from_logits(drafts, logits, num_valid)


def test_greedy_all_accepted_takes_the_bonus_from_the_last_row():
    assert _greedy([[1, 4, 2]], [TARGETS]) == ([3], [[1, 4, 2, 3]], [4])


def test_greedy_none_accepted_emits_the_first_rows_argmax():
    assert _greedy([[0, 4, 2]], [TARGETS]) == ([0], [[1, -1, -1, -1]], [1])


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_mismatch_at_each_position(mismatch):
    drafts = [1, 4, 2]
    drafts[mismatch] = 0
    expected = TARGETS[: mismatch + 1] + [-1] * (3 - mismatch)
    assert _greedy([drafts], [TARGETS]) == ([mismatch], [expected], [mismatch + 1])


def test_greedy_matches_after_a_mismatch_do_not_count():
    assert _greedy([[1, 0, 2]], [TARGETS]) == ([1], [[1, 4, -1, -1]], [2])


@pytest.mark.parametrize("num_valid", [0, 1, 2, 3])
def test_greedy_num_valid_cuts_the_chain(num_valid):
    # The token after the cut is the target's own argmax at the row after the last valid draft.
    expected = TARGETS[: num_valid + 1] + [-1] * (3 - num_valid)
    got = _greedy([[1, 4, 2]], [TARGETS], num_valid=[num_valid])
    assert got == ([num_valid], [expected], [num_valid + 1])


def test_greedy_batch_with_different_outcomes():
    drafts = [[1, 4, 2], [0, 0, 0], [1, 4, 0], [1, 4, 2], [-1, -1, -1], [1, 9, 2]]
    targets = [TARGETS, [2, 2, 2, 2], TARGETS, TARGETS, [3, 0, 0, 0], TARGETS]
    num_accepted, out, num_output = _greedy(drafts, targets, num_valid=[3, 3, 3, 1, 0, 3])
    assert num_accepted == [3, 0, 2, 1, 0, 1]
    assert num_output == [4, 1, 3, 2, 1, 2]
    assert out == [
        [1, 4, 2, 3],
        [2, -1, -1, -1],
        [1, 4, 2, -1],
        [1, 4, -1, -1],
        [3, -1, -1, -1],
        [1, 4, -1, -1],  # an out-of-vocabulary draft (9) is rejected
    ]
    assert PLACEHOLDER_TOKEN_ID == -1


def test_greedy_ties_go_to_the_lowest_token():
    logits = np.zeros((2, 4, V), np.float32)
    logits[:, :, 2:4] = 1.0  # tokens 2 and 3 tie on every row
    got = _greedy_from_logits([[2, 2, 2], [3, 2, 2]], logits)
    assert got == ([3, 0], [[2, 2, 2, 2], [2, -1, -1, -1]], [4, 1])


def _greedy_reference(drafts, logits, num_valid):
    """Plain Python loop over sequences and positions."""
    batch, k = drafts.shape
    argmax = logits.argmax(-1)
    out = np.full((batch, k + 1), -1)
    counts = np.zeros(batch, int)
    for b in range(batch):
        i = 0
        while i < num_valid[b] and drafts[b, i] == argmax[b, i]:
            out[b, i] = drafts[b, i]
            i += 1
        out[b, i] = argmax[b, i]
        counts[b] = i
    return counts, out


def test_greedy_matches_a_python_loop_on_random_batches():
    rng = np.random.default_rng(0)
    batch, k, vocab = 512, 4, 3
    logits = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32)
    drafts = rng.integers(-1, vocab, size=(batch, k))
    # Half the drafts copy the target's argmax so that every acceptance length occurs.
    copy = rng.random((batch, k)) < 0.5
    drafts = np.where(copy, logits[:, :k].argmax(-1), drafts).astype(np.int32)
    num_valid = rng.integers(0, k + 1, size=batch).astype(np.int32)
    logits_bf16 = jnp.asarray(logits, jnp.bfloat16)  # any float dtype is accepted
    result = accept(drafts, None, logits_bf16, temperature=0.0, num_valid=num_valid)
    counts, out = _greedy_reference(drafts, np.asarray(logits_bf16, np.float32), num_valid)
    np.testing.assert_array_equal(result.num_accepted, counts)
    np.testing.assert_array_equal(result.output_tokens, out)
    assert set(counts.tolist()) == set(range(k + 1))


# --------------------------------------------------------------------------------------------
# Validation.


def test_validation_errors():
    drafts = np.zeros((2, 3), np.int32)
    logits = np.zeros((2, 4, 5), np.float32)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="temperature"):
        accept(drafts, None, logits, temperature=-1.0)
    with pytest.raises(ValueError, match="key is required"):
        accept(drafts, None, logits, temperature=1.0)
    with pytest.raises(ValueError, match="target_logits must have shape"):
        accept(drafts, None, np.zeros((2, 3, 5), np.float32), temperature=0.0)
    with pytest.raises(ValueError, match="target_logits must have shape"):
        accept(drafts, None, np.zeros((3, 4, 5), np.float32), temperature=0.0)
    with pytest.raises(ValueError, match="draft_probs"):
        accept(drafts, np.zeros((2, 3, 6), np.float32), logits, temperature=1.0, key=key)
    with pytest.raises(ValueError, match="draft_tokens"):
        accept(drafts.astype(np.float32), None, logits, temperature=0.0)
    with pytest.raises(ValueError, match="num_valid"):
        accept(drafts, None, logits, temperature=0.0, num_valid=np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="temperature must be a real scalar"):
        accept(drafts, None, logits, temperature="hot")
    for bad in (True, np.ones(2, np.float32), jnp.asarray(1, bool)):
        with pytest.raises(TypeError, match="temperature must be a real scalar"):
            accept(drafts, None, logits, temperature=bad, key=key)
    with pytest.raises(ValueError, match="finite"):
        accept(drafts, None, logits, temperature=np.float32("inf"), key=key)


# --------------------------------------------------------------------------------------------
# Temperature spellings: a traced value, one program for every temperature > 0.


def _spelling_inputs(seed=11, batch=5, k=3):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, k + 1, V)).astype(np.float32)
    drafts = rng.integers(0, V, size=(batch, k)).astype(np.int32)
    return drafts, logits, np.full(batch, k, np.int32)


def test_every_spelling_of_a_temperature_shares_one_program(monkeypatch):
    drafts, logits, num_valid = _spelling_inputs()
    sampling = count_calls(monkeypatch, accept_lib, "_rejection_sample")
    greedy = count_calls(monkeypatch, accept_lib, "_greedy")
    accept_lib._accept.clear_cache()
    key = _key(3)
    runs = [
        accept(drafts, None, logits, temperature=t, key=key, num_valid=num_valid)
        for t in (T, np.float32(T), jnp.float32(T), np.float64(T), 1.5, 2)
    ]
    assert len(sampling) == 1
    for run in runs[1:4]:
        np.testing.assert_array_equal(run.output_tokens, runs[0].output_tokens)
    assert len(greedy) == 1  # the greedy branch of the one sampling program
    for t in (0.0, 0, np.float32(0), jnp.float32(0)):
        accept(drafts, None, logits, temperature=t, key=key, num_valid=num_valid)
        accept(drafts, None, logits, temperature=t, num_valid=num_valid)
    assert len(greedy) == 2 and len(sampling) == 1  # greedy: its own program, keys ignored


def test_a_traced_temperature_samples_or_is_greedy_at_zero():
    drafts, logits, num_valid = _spelling_inputs(seed=12)
    key = _key(4)

    @jax.jit
    def run(t, key):
        return accept(drafts, None, logits, temperature=t, key=key, num_valid=num_valid)

    np.testing.assert_array_equal(
        run(jnp.float32(T), key).output_tokens,
        accept(drafts, None, logits, temperature=T, key=key, num_valid=num_valid).output_tokens,
    )
    np.testing.assert_array_equal(
        run(jnp.float32(0), key).output_tokens,
        accept(drafts, None, logits, temperature=0.0, num_valid=num_valid).output_tokens,
    )


# --------------------------------------------------------------------------------------------
# Sampled drafts: q given on its support (DraftProbs, the drafter's top-k renormalised).

SUPPORT = 4  # of V = 6 tokens: the target puts mass off the support, which only the residual
# can emit


def _sparse_inputs(rng, temperature, k=3, n=N):
    """(drafts int32[n, K] with x_i ~ q_i, DraftProbs [n, K, SUPPORT], target logits at
    `temperature`, p [K+1, V]): q_i is a random distribution over a random SUPPORT-token subset,
    drafted towards the target's favourite token so that every position is populated."""
    favourites = rng.integers(0, V, size=k + 1)
    p = _random_dists(rng, k + 1, favourites)
    others = [rng.permutation(np.setdiff1d(np.arange(V), [f]))[: SUPPORT - 1] for f in favourites]
    ids = np.stack([[f, *o] for f, o in zip(favourites[:k], others)]).astype(np.int32)  # [K, S]
    logits_q = rng.normal(scale=0.5, size=(k, SUPPORT)) + 2.0 * (ids == favourites[:k, None])
    q = np.exp(logits_q) / np.exp(logits_q).sum(-1, keepdims=True)  # [K, S]
    cdf = np.cumsum(q, axis=-1)
    pick = np.minimum((rng.random((n, k, 1)) > cdf[None]).sum(-1), SUPPORT - 1)
    drafts = np.take_along_axis(np.broadcast_to(ids, (n, k, SUPPORT)), pick[..., None], -1)
    support = DraftProbs(
        ids=np.broadcast_to(ids, (n, k, SUPPORT)),
        probs=np.broadcast_to(q.astype(np.float32), (n, k, SUPPORT)),
    )
    logits = np.broadcast_to(temperature * np.log(p), (n, k + 1, V))
    return drafts[..., 0].astype(np.int32), support, logits, p


def _dense(support: DraftProbs) -> np.ndarray:
    """q over the vocabulary, built in numpy: [n, K, V]."""
    ids, probs = np.asarray(support.ids), np.asarray(support.probs)
    out = np.zeros((*ids.shape[:-1], V), np.float32)
    np.put_along_axis(out, ids, probs, axis=-1)
    return out


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_drafts_emit_the_target_distribution(temperature):
    """Drafts from a top-k proposal given as (ids, probs): every emitted token is distributed as
    its target row at T = 0.7 and 1.0; the same rule with the dense q emits the same tokens."""
    rng = np.random.default_rng(71)
    drafts, support, logits, p = _sparse_inputs(rng, temperature)
    num_valid = np.full(N, 3, np.int32)
    kw = dict(temperature=temperature, key=_key(5), num_valid=num_valid)
    result = accept(drafts, support, logits, **kw)
    out, num_output = np.asarray(result.output_tokens), np.asarray(result.num_output)
    pvalues = _per_position_pvalues(out, num_output, p)
    assert min(pvalues) > P_FLOOR, pvalues
    assert np.sum(num_output == 4) > N // 20 and np.sum(num_output == 1) > N // 20
    # The support form is q itself, not an approximation: bit for bit the dense rule's draws.
    dense = accept(drafts, _dense(support), logits, **kw)
    np.testing.assert_array_equal(dense.output_tokens, result.output_tokens)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("flaw", list(FLAWS))
def test_wrong_rules_fail_with_sampled_drafts(flaw, temperature):
    """Accepting with min(1, p/q) but resampling a rejection from p (or inverting the ratio)
    fails the test the library passes above."""
    rng = np.random.default_rng(71)
    drafts, support, logits, p = _sparse_inputs(rng, temperature)
    out, num_output = _wrong_accept(
        drafts, _dense(support), logits, _key(5), FLAWS[flaw], temperature
    )
    pvalues = _per_position_pvalues(np.asarray(out), np.asarray(num_output), p)
    assert min(pvalues) < P_FLOOR, pvalues


def test_sampled_draft_off_its_support_is_accepted_iff_the_target_allows_it():
    """q(x) = 0 off the listed ids: u * 0 < p(x) accepts any such draft with p(x) > 0."""
    rng = np.random.default_rng(72)
    drafts, support, logits, _ = _sparse_inputs(rng, 1.0, n=64)
    off = np.stack([np.setdiff1d(np.arange(V), r)[0] for r in np.asarray(support.ids)[0]])
    drafts = np.broadcast_to(off, drafts.shape).astype(np.int32)
    result = accept(drafts, support, logits, temperature=1.0, key=_key(6))
    np.testing.assert_array_equal(result.num_accepted, 3)


def test_draft_probs_support_validation():
    drafts = np.zeros((2, 3), np.int32)
    logits = np.zeros((2, 4, 5), np.float32)
    key = jax.random.key(0)
    ids = np.zeros((2, 3, 4), np.int32)
    with pytest.raises(ValueError, match=r"draft_probs\.ids"):
        accept(drafts, DraftProbs(ids=ids[:, :2], probs=ids[:, :2] * 1.0), logits,
               temperature=1.0, key=key)  # fmt: skip
    with pytest.raises(ValueError, match=r"draft_probs\.probs"):
        accept(drafts, DraftProbs(ids=ids, probs=np.zeros((2, 3, 3), np.float32)), logits,
               temperature=1.0, key=key)  # fmt: skip
    with pytest.raises(ValueError, match=r"draft_probs\.ids"):
        accept(drafts, DraftProbs(ids=ids * 1.0, probs=ids * 1.0), logits,
               temperature=1.0, key=key)  # fmt: skip
