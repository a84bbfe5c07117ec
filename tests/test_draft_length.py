"""Adaptive draft length (``mtpjax.verify.draft_length``): the choice is the brute-force
goodput argmax per sequence; ``send`` only cuts; the metrics count proposed and sent drafts
consistently; in ``generate`` greedy output stays the target's whatever is sent, and sampled
drafts leave greedy runs untouched (on a small random hybrid pair: quick compilations)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax import drafter as drafter_lib
from mtpjax import generation as gen
from mtpjax import hybrid
from mtpjax.config import DrafterConfig
from mtpjax.drafter import ProposeOutput
from mtpjax.verify import draft_length, metrics

K = 3


def _drafts(probs, num_valid, tokens=None):
    probs = np.asarray(probs, np.float32)
    B = probs.shape[0]
    if tokens is None:
        tokens = np.tile(np.arange(K, dtype=np.int32), (B, 1))
    return ProposeOutput(
        tokens=jnp.asarray(tokens, jnp.int32),
        probs=jnp.asarray(probs),
        confidence=jnp.asarray(np.minimum.accumulate(probs, axis=1)),
        num_valid=jnp.asarray(num_valid, jnp.int32),
        hidden=jnp.zeros((B, K, 1)),
    )


def _brute_force(probs, num_valid, policy):
    """Per sequence, over every n: (1 + sum of the running products) / cost, first max."""
    out = []
    for p, v in zip(probs, num_valid):
        best, pick = -1.0, 0
        for n in range(v + 1):
            tokens = 1.0 + sum(float(np.prod(p[: i + 1])) for i in range(n))
            goodput = tokens / (policy.propose_cost + policy.verify_cost[n])
            if goodput > best:
                best, pick = goodput, n
        out.append(pick)
    return out


def test_choice_is_the_goodput_argmax_per_sequence():
    rng = np.random.default_rng(0)
    policy = draft_length.DraftLengthPolicy(verify_cost=(1.0, 1.3, 1.6, 2.2), propose_cost=0.5)
    probs = rng.random((256, K)).astype(np.float32)
    num_valid = rng.integers(0, K + 1, 256)
    got = np.asarray(draft_length.choose(_drafts(probs, num_valid), policy=policy))
    np.testing.assert_array_equal(got, _brute_force(probs, num_valid, policy))
    assert set(got.tolist()) == set(range(K + 1))  # sequences of one batch differ
    # Flat verify costs send every valid draft; steep ones send none.
    flat = draft_length.DraftLengthPolicy(verify_cost=(1.0,) * 4, propose_cost=0.0)
    np.testing.assert_array_equal(draft_length.choose(_drafts(probs, num_valid), policy=flat),
                                  num_valid)  # fmt: skip
    steep = draft_length.DraftLengthPolicy(verify_cost=(1.0, 9.0, 17.0, 25.0), propose_cost=0.0)
    np.testing.assert_array_equal(draft_length.choose(_drafts(probs, num_valid), policy=steep), 0)


def test_send_cuts_and_keeps_the_rest():
    d = _drafts(np.full((3, K), 0.5), [3, 2, 0])
    cut = draft_length.send(d, jnp.asarray([1, 3, 2]))
    np.testing.assert_array_equal(cut.num_valid, [1, 2, 0])
    np.testing.assert_array_equal(cut.tokens, [[0, -1, -1], [0, 1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(cut.probs, d.probs)


def test_policy_validation_and_modelled_cost():
    for bad in (dict(verify_cost=(1.0,), propose_cost=0.0),
                        dict(verify_cost=(1.0, 0.0), propose_cost=0.0),
                dict(verify_cost=(1.0, 2.0), propose_cost=-1.0)):  # fmt: skip
        with pytest.raises(ValueError):
            draft_length.DraftLengthPolicy(**bad)
    policy = draft_length.DraftLengthPolicy(verify_cost=(1, 2, 3, 5), propose_cost=1)
    assert policy.num_drafts == K and hash(policy) == hash(
        draft_length.DraftLengthPolicy(verify_cost=(1.0, 2.0, 3.0, 5.0), propose_cost=1.0)
    )
    assert draft_length.modelled_cost(np.array([2, 0, 1, 3]), policy=policy) == 2 * 2 + 4 + 3 * 6
    with pytest.raises(ValueError, match="num_rounds_per_sent"):
        draft_length.modelled_cost(np.zeros(3), policy=policy)
    with pytest.raises(ValueError, match="3 entries"):
        draft_length.choose(_drafts(np.ones((1, K)), [K]), policy=draft_length.DraftLengthPolicy(
            verify_cost=(1, 2, 3), propose_cost=0))  # fmt: skip


def test_metrics_count_proposed_and_sent():
    m = metrics.update(metrics.empty(K), jnp.asarray([1, 0, 2, 0]), jnp.asarray([2, 0, 3, 0]),
                       jnp.asarray([3, 2, 3, 0]))  # fmt: skip
    assert int(m.num_draft_tokens) == 5 and int(m.num_proposed_tokens) == 8
    assert int(m.num_drafts) == 2  # rounds that sent >= 1 draft, as vLLM counts them
    np.testing.assert_array_equal(m.num_rounds_per_sent, [1, 0, 1, 1])  # the 4th proposed none
    plain = metrics.update(metrics.empty(K), jnp.asarray([1, 0]), jnp.asarray([2, 3]))
    assert int(plain.num_proposed_tokens) == int(plain.num_draft_tokens) == 5


# --------------------------------------------------------------------------------------------
# generate.


@pytest.fixture(scope="module")
def tiny():
    cfg = hybrid.HybridConfig.tiny(num_hidden_layers=2, full_attention_interval=2)
    params, head = hybrid.init(cfg, key=jax.random.key(0))
    dcfg = DrafterConfig.tiny(vocab_size=cfg.vocab_size)
    drafter = drafter_lib.init(dcfg, key=jax.random.key(1))
    target = hybrid.target_model(cfg, params, head, max_step=K + 1)
    rng = np.random.default_rng(5)
    prompts = rng.integers(0, cfg.vocab_size, (6, 6)).astype(np.int32)
    lengths = np.array([2, 6, 4, 5, 3, 6], np.int32)
    kw = dict(drafter_cfg=dcfg, head_cfg=cfg.lm_head_config(), max_new_tokens=10, num_drafts=K)
    base = jax.device_get(
        gen.generate_baseline(
            target,
            head,
            prompts,
            lengths,
            head_cfg=cfg.lm_head_config(),
            max_new_tokens=10,
            step_width=K + 1,
        )
    )
    return target, drafter, head, prompts, lengths, kw, base


def test_greedy_adaptive_length_equals_plain_greedy(tiny):
    """Whatever each sequence sends, greedy output is the target's; the counters add up."""
    target, drafter, head, prompts, lengths, kw, base = tiny
    # The random drafter's draft probabilities are small: verify costs this close make the
    # choice differ between rounds and sequences.
    policy = draft_length.DraftLengthPolicy(verify_cost=(1, 1.012, 1.0121, 1.0122), propose_cost=0)
    out = jax.device_get(gen.generate(target, drafter, head, prompts, lengths, draft_length=policy,
                                      **kw))  # fmt: skip
    np.testing.assert_array_equal(out.tokens, base.tokens)
    np.testing.assert_array_equal(out.lengths, base.lengths)
    m = out.metrics
    hist = np.asarray(m.num_rounds_per_sent)
    assert np.count_nonzero(hist) >= 2, hist  # the choice varied
    assert hist.sum() == out.active_steps.sum()  # every active round proposed K valid drafts
    assert int(m.num_proposed_tokens) == K * hist.sum()
    assert int(m.num_draft_tokens) == (hist * np.arange(K + 1)).sum()
    assert int(m.num_drafts) == hist[1:].sum()
    assert 0 <= int(m.num_accepted_tokens) <= int(m.num_draft_tokens)
    # Without the policy every proposed draft is sent.
    full = jax.device_get(gen.generate(target, drafter, head, prompts, lengths, **kw))
    assert int(full.metrics.num_proposed_tokens) == int(full.metrics.num_draft_tokens)
    np.testing.assert_array_equal(full.metrics.num_rounds_per_sent[:K], 0)


def test_policies_for_one_k_share_one_program_and_keep_their_choices(tiny):
    """The costs are traced: a second policy runs the first one's program, and still sends what
    its own costs pick (all drafts when verifying more rows costs nothing, none when each row
    costs ten times the round)."""
    target, drafter, head, prompts, lengths, kw, base = tiny
    run = lambda policy: jax.device_get(  # noqa: E731
        gen.generate(target, drafter, head, prompts, lengths, draft_length=policy, **kw)
    )
    flat = run(draft_length.DraftLengthPolicy(verify_cost=(1, 1, 1, 1), propose_cost=0))
    programs = gen._generate._cache_size()
    steep = run(draft_length.DraftLengthPolicy(verify_cost=(1, 10, 100, 1000), propose_cost=0))
    assert gen._generate._cache_size() == programs  # the first policy's program
    for out in (flat, steep):
        np.testing.assert_array_equal(out.tokens, base.tokens)
    np.testing.assert_array_equal(np.asarray(flat.metrics.num_rounds_per_sent)[:K], 0)
    np.testing.assert_array_equal(np.asarray(steep.metrics.num_rounds_per_sent)[1:], 0)


def test_draft_sampling_leaves_greedy_alone_and_samples_otherwise(tiny):
    target, drafter, head, prompts, lengths, kw, base = tiny
    for sampling in (True, False):
        out = gen.generate(target, drafter, head, prompts, lengths, draft_sampling=sampling,
                           key=jax.random.key(0), **kw)  # fmt: skip
        np.testing.assert_array_equal(out.tokens, base.tokens)
    V = kw["head_cfg"].vocab_size
    runs = {
        s: jax.device_get(
            gen.generate(
                target,
                drafter,
                head,
                prompts,
                lengths,
                temperature=1.0,
                key=jax.random.key(2),
                draft_sampling=s,
                draft_top_k=16,
                **kw,
            )
        )
        for s in (True, False)
    }
    for out in runs.values():
        assert np.all((out.tokens >= 0) & (out.tokens < V))
        np.testing.assert_array_equal(out.lengths, 10)
    assert np.any(runs[True].tokens != runs[False].tokens)  # the drafts took their own draws
    with pytest.raises(TypeError, match="draft_sampling"):
        gen.generate(target, drafter, head, prompts, lengths, draft_sampling=1, **kw)
    with pytest.raises(ValueError, match="draft_length has costs for K=2"):
        gen.generate(target, drafter, head, prompts, lengths, **kw,
                     draft_length=draft_length.DraftLengthPolicy(verify_cost=(1, 2, 3),
                                                                 propose_cost=0))  # fmt: skip
