"""Sampled drafts: ``sample_top_k`` draws from exactly the proposal it returns, and ``propose``
with a temperature and a key drafts by sampling, chains on the sampled tokens, keeps the grammar
mask and the reduced vocab, and is the argmax propose at temperature 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import V, make, new_state, pairs, propose_default, random_pairs, tiny_cfg
from test_accept import P_FLOOR, _chi2_pvalue

from mtpjax import drafter
from mtpjax.config import FfnKind
from mtpjax.drafter._sampling import sample_top_k

B, T, K = 2, 4, 3  # as tests/test_propose.py


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sample_top_k_draws_from_the_probs_it_returns(temperature):
    """100k rows of the same logits (one key, rows independent): the draws fit the returned q,
    which is the tempered softmax of the top-k logits; a masked token never has mass."""
    n, top_k = 100_000, 4
    logits = np.array([0.3, -1.0, 1.2, -np.inf, 0.8, 0.0, -0.4, 2.0], np.float32)
    token, ids, probs = sample_top_k(
        jnp.broadcast_to(logits, (n, 8)), jnp.float32(temperature), jax.random.key(3), top_k=top_k
    )
    ids, probs, token = np.asarray(ids[0]), np.asarray(probs[0]), np.asarray(token)
    np.testing.assert_array_equal(ids, [7, 2, 4, 0])  # the top 4, by decreasing logit
    want = np.exp(logits[ids] / temperature)
    np.testing.assert_allclose(probs, want / want.sum(), rtol=1e-6)
    where = np.searchsorted(np.sort(ids), token)
    assert np.all(np.sort(ids)[np.minimum(where, 3)] == token)  # only support tokens drawn
    order = np.argsort(ids)
    assert _chi2_pvalue(where, probs[order]) > P_FLOOR
    # Masked rows: fewer allowed tokens than k leave the rest at 0; none allowed, all 0.
    masked = np.full((2, 8), -np.inf, np.float32)
    masked[0, [1, 5]] = [0.0, 1.0]
    tok, ids2, probs2 = sample_top_k(
        jnp.asarray(masked), jnp.float32(1.0), jax.random.key(0), top_k=4
    )
    assert set(np.asarray(ids2[0, :2])) == {1, 5} and int(tok[0]) in (1, 5)
    np.testing.assert_array_equal(np.asarray(probs2[0, 2:]), 0.0)
    np.testing.assert_array_equal(np.asarray(probs2[1]), 0.0)


# --------------------------------------------------------------------------------------------
# propose.


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(0), (B, T))
    return cfg, params, head, pairs(tokens, hidden, [4, 2], [0, 0])


def _sampled(setup, seed=0, *, temperature=1.0, top_k=8, **kw):
    cfg, params, head, window = setup
    return propose_default(
        params, head, new_state(cfg, B), window, cfg,
        temperature=temperature, key=jax.random.key(seed), draft_top_k=top_k, **kw,
    )[0]  # fmt: skip


def test_sampled_propose_returns_its_proposal(setup):
    out = _sampled(setup)
    q = out.draft_probs
    assert q.ids.shape == q.probs.shape == (B, K, 8)
    np.testing.assert_allclose(q.probs.sum(-1), 1.0, rtol=1e-5)
    # Each draft is on its step's support and its probs entry is q(draft).
    hit = q.ids == out.tokens[..., None]
    assert np.all(hit.sum(-1) == 1)
    np.testing.assert_allclose(out.probs, (q.probs * hit).sum(-1), rtol=1e-6)
    # The support is the top 8 of the step's logits, and q their tempered softmax (T = 1).
    top = np.argsort(-out.logits, axis=-1, kind="stable")[..., :8]
    np.testing.assert_array_equal(q.ids, top)
    lg = np.take_along_axis(out.logits, top, -1)
    e = np.exp(lg - lg.max(-1, keepdims=True))
    np.testing.assert_allclose(q.probs, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    # Other keys, other drafts; the argmax propose returns no proposal.
    others = [_sampled(setup, seed).tokens for seed in (1, 2, 3)]
    assert any(np.any(o != out.tokens) for o in others)
    cfg, params, head, window = setup
    argmax, _ = propose_default(params, head, new_state(cfg, B), window, cfg)
    assert argmax.draft_probs is None


def test_sampled_chain_feeds_the_sampled_tokens(setup):
    """The argmax chain forced (by a per-draft grammar mask) onto the sampled tokens runs the
    same rows: its handed-over hidden states and its logits at the drafts equal the sampled
    run's, which they would not if the chain had fed its argmax."""
    cfg, params, head, window = setup
    out = _sampled(setup, seed=4)
    assert np.any(out.tokens != out.logits.argmax(-1)), "the test needs a non-argmax draft"
    allowed = np.zeros((B, K, V), bool)
    allowed[np.arange(B)[:, None], np.arange(K)[None, :], out.tokens] = True
    bits = (allowed.reshape(B, K, -1, 32) * (1 << np.arange(32, dtype=np.int64))).sum(-1)
    forced, _ = propose_default(
        params, head, new_state(cfg, B), window, cfg, bitmask=bits.astype(np.uint32).view(np.int32)
    )
    np.testing.assert_array_equal(forced.tokens, out.tokens)
    np.testing.assert_array_equal(forced.hidden, out.hidden)
    pick = out.tokens[..., None]
    np.testing.assert_array_equal(
        np.take_along_axis(forced.logits, pick, -1), np.take_along_axis(out.logits, pick, -1)
    )


def test_sampled_propose_keeps_the_mask_and_the_reduced_vocab():
    cfg = tiny_cfg(FfnKind.DENSE, mtp_vocab_size=40)
    params, head = make(tiny_cfg())
    tokens, hidden = random_pairs(np.random.default_rng(1), (B, T))
    allowed = np.random.default_rng(2).random((B, V)) < 0.25
    allowed[:, 3] = True
    bits = (allowed.reshape(B, -1, 32) * (1 << np.arange(32, dtype=np.int64))).sum(-1)
    out, _ = propose_default(
        params, head, new_state(cfg, B), pairs(tokens, hidden, [4, 2], [0, 0]), cfg,
        bitmask=bits.astype(np.uint32).view(np.int32), temperature=1.0, key=jax.random.key(0),
    )  # fmt: skip
    q = out.draft_probs
    assert q.ids.shape == (B, K, 40) and int(q.ids.max()) < 40  # k clamped to V' = 40
    ok = allowed[np.arange(B)[:, None, None], q.ids]
    np.testing.assert_array_equal(q.probs[~ok], 0.0)
    assert np.all(allowed[np.arange(B)[:, None], out.tokens]) and int(out.tokens.max()) < 40


def test_temperature_zero_is_the_argmax_propose(setup):
    """A concrete 0 drops the key (the argmax program itself); a traced 0 with a key samples
    nothing: the same drafts, probabilities and a one-hot proposal."""
    cfg, params, head, window = setup
    argmax, _ = propose_default(params, head, new_state(cfg, B), window, cfg)
    zero = _sampled(setup, temperature=0.0)
    assert zero.draft_probs is None
    np.testing.assert_array_equal(zero.tokens, argmax.tokens)

    @jax.jit
    def traced(t, key, state):
        return drafter.propose(
            params, head, state, window, cfg=cfg, num_drafts=K, temperature=t, key=key
        )[0]

    out = jax.device_get(traced(jnp.float32(0), jax.random.key(1), new_state(cfg, B)))
    np.testing.assert_array_equal(out.tokens, argmax.tokens)
    # Two programs (the traced one also holds the sampling branch), whose reductions XLA:CPU
    # may order differently: the softmax peaks agree to float32 rounding of a sum over V.
    np.testing.assert_allclose(out.probs, argmax.probs, rtol=1e-5)
    np.testing.assert_array_equal(
        out.draft_probs.probs, out.draft_probs.ids == out.tokens[..., None]
    )


def test_bad_sampling_arguments(setup):
    cfg, params, head, window = setup
    with pytest.raises(ValueError, match="draft_top_k"):
        drafter.propose(params, head, new_state(cfg, B), window, cfg=cfg, num_drafts=K,
                        temperature=1.0, key=jax.random.key(0), draft_top_k=0)  # fmt: skip
    with pytest.raises(ValueError, match="key is required"):
        drafter.propose(params, head, new_state(cfg, B), window, cfg=cfg, num_drafts=K,
                        temperature=1.0)  # fmt: skip


def test_sampled_drafts_through_a_cycle_of_two_modules():
    """K = 4 drafts from two modules under CYCLE (the second cycle runs in the chain's scan):
    every step samples from its own top-k proposal of its own logits."""
    from drafter_helpers import make_head, pool

    cfg = tiny_cfg(num_mtp_modules=2)
    params = drafter.init_modules(cfg, key=jax.random.key(3), schedule=drafter.ModuleSchedule.CYCLE)
    state = drafter.init_state(pool(cfg, max_seqs=B), num_seqs=B, num_modules=2)
    tokens, hidden = random_pairs(np.random.default_rng(4), (B, T))
    out, _ = drafter.propose(
        params, make_head(cfg), state, pairs(tokens, hidden, [4, 2], [0, 0]), cfg=cfg,
        num_drafts=4, temperature=1.0, key=jax.random.key(5), draft_top_k=8, return_logits=True,
    )  # fmt: skip
    out = jax.device_get(out)
    q = out.draft_probs
    assert q.ids.shape == (B, 4, 8)
    assert np.all((q.ids == out.tokens[..., None]).sum(-1) == 1)
    top = np.argsort(-out.logits, axis=-1, kind="stable")[..., :8]
    np.testing.assert_array_equal(q.ids, top)
