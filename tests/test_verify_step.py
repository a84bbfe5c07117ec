"""The jit'd verify step against the head, the acceptance rule and after_verify run separately."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import (
    V,
    clone,
    make,
    new_state,
    np_tree,
    pairs,
    random_pairs,
    tiny_cfg,
)
from trace_helpers import count_calls

from mtpjax import drafter
from mtpjax.verify import _step, metrics, verify
from pallas_kernels.implementation import Implementation

K = 3


def _proposed(cfg, rng, B=4, counts=(6, 5, 4, 6)):
    """A drafter state right after one propose of K drafts for B sequences, and its drafts
    (a sequence with count 0 takes no part in the propose)."""
    params, head = make(cfg)
    state = new_state(cfg, B)
    tokens, hidden = random_pairs(rng, (B, 6))
    window = pairs(tokens, hidden, list(counts), [0, 0, 0, 0])
    drafts, state = drafter.propose(params, head, state, window, cfg=cfg, num_drafts=K)
    return params, head, state, drafts


def _target_argmax(head, hidden):
    w = np.asarray(head.weight.w, np.float64)
    return (np.asarray(hidden, np.float64) @ w.T).argmax(-1)


def test_greedy_verify_accepts_the_matching_prefix_and_trims_the_drafter():
    cfg = tiny_cfg()
    rng = np.random.default_rng(0)
    _, head, state, drafts = _proposed(cfg, rng)
    B = drafts.tokens.shape[0]
    hidden = rng.standard_normal((B, K + 1, cfg.hidden_size)).astype(np.float32)
    target = _target_argmax(head, hidden)  # [B, K+1]
    # Sequence b's drafts match the target for exactly b positions (b = 3: all, bonus from row K).
    tokens = np.where(
        np.arange(K)[None] < np.arange(B)[:, None], target[:, :K], (target[:, :K] + 1) % V
    )
    drafts = drafter.ProposeOutput(
        tokens=jnp.asarray(tokens, jnp.int32),
        probs=drafts.probs,
        confidence=drafts.confidence,
        num_valid=jnp.full((B,), K, jnp.int32),
        hidden=drafts.hidden,
    )
    before = np_tree(state.seq_len)
    out, new = verify(head, clone(state), jnp.asarray(hidden), drafts, cfg=cfg.lm_head_config())
    m = out.metrics
    np.testing.assert_array_equal(out.num_accepted, [0, 1, 2, 3])
    np.testing.assert_array_equal(out.num_output, [1, 2, 3, 4])
    for b in range(B):
        expect = [*tokens[b, :b], target[b, b]]
        np.testing.assert_array_equal(np.asarray(out.output_tokens[b, : b + 1]), expect)
        assert np.all(np.asarray(out.output_tokens[b, b + 1 :]) == -1)
    # The drafter keeps the rows whose token is committed: min(a + 1, K) of the K it wrote.
    kept = np.minimum(np.arange(B) + 1, K)
    np.testing.assert_array_equal(new.seq_len, before - (K - kept))
    np.testing.assert_array_equal(new.last_num_drafted, 0)
    assert int(m.num_drafts) == B and int(m.num_accepted_tokens) == 6
    np.testing.assert_array_equal(m.num_accepted_tokens_per_pos, [3, 2, 1])


def test_verify_equals_head_then_accept_then_after_verify():
    cfg = tiny_cfg()
    rng = np.random.default_rng(1)
    _, head, state, drafts = _proposed(cfg, rng)
    B = drafts.tokens.shape[0]
    hidden = jnp.asarray(rng.standard_normal((B, K + 1, cfg.hidden_size)), jnp.float32)
    head_cfg = cfg.lm_head_config()
    for temperature, key in [(0.0, None), (0.8, jax.random.key(3))]:
        out, new = verify(
            head, clone(state), hidden, drafts, cfg=head_cfg, temperature=temperature, key=key
        )
        # The same pieces, one row at a time through the head's single-row path.
        from mtpjax import accept
        from mtpjax.head import lm_head

        rows = jnp.stack([lm_head(head, hidden[:, i], cfg=head_cfg) for i in range(K + 1)], 1)
        ref = accept(
            drafts.tokens, None, rows, temperature=temperature, key=key, num_valid=drafts.num_valid
        )
        np.testing.assert_array_equal(out.num_accepted, ref.num_accepted)
        np.testing.assert_array_equal(out.output_tokens, ref.output_tokens)
        _, ref_state = drafter.after_verify(clone(state), ref.num_accepted, refeed=False)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_inactive_sequences_are_untouched_and_not_counted():
    cfg = tiny_cfg()
    rng = np.random.default_rng(2)
    # Sequences 1 and 3 hold rows from an earlier round but take no part in this one.
    params, head = make(cfg)
    state = new_state(cfg, 4)
    tokens, hidden = random_pairs(rng, (4, 6))
    state = drafter.prefill(
        params, head, state, pairs(tokens, hidden, [6, 3, 6, 2], [0] * 4), cfg=cfg
    )
    window = pairs(tokens, hidden, [1, 0, 1, 0], [6, 0, 6, 0])
    drafts, state = drafter.propose(params, head, state, window, cfg=cfg, num_drafts=K)
    before = np_tree(state)
    hidden = jnp.asarray(rng.standard_normal((4, K + 1, cfg.hidden_size)), jnp.float32)
    active = np.asarray([True, False, True, False])
    out, new = verify(
        head,
        clone(state),
        hidden,
        drafts,
        cfg=cfg.lm_head_config(),
        active=jnp.asarray(active),
    )
    m = out.metrics
    assert np.all(np.asarray(out.output_tokens)[~active] == -1)
    np.testing.assert_array_equal(np.asarray(out.num_output)[~active], 0)
    assert np.all(np.asarray(out.num_output)[active] >= 1)
    after = np_tree(new)
    for a, b in ((after.seq_len[0], before.seq_len[0]),  # module 0 of the state's [N, B]
                 (after.last_pair_key[0], before.last_pair_key[0]),
                 (after.kv[0].block_table, before.kv[0].block_table)):  # fmt: skip
        np.testing.assert_array_equal(a[~active], b[~active])
    assert int(m.num_drafts) == 2 and int(m.num_draft_tokens) == 2 * K


def test_inactive_in_propose_is_inactive_in_verify_by_default():
    """With ``active=None`` a sequence that took no part in ``propose`` emits nothing."""
    cfg = tiny_cfg()
    rng = np.random.default_rng(3)
    _, head, state, drafts = _proposed(cfg, rng, counts=(6, 0, 5, 0))
    np.testing.assert_array_equal(drafts.num_valid, [K, 0, K, 0])
    hidden = jnp.asarray(rng.standard_normal((4, K + 1, cfg.hidden_size)), jnp.float32)
    before = np_tree(state)
    out, new = verify(head, clone(state), hidden, drafts, cfg=cfg.lm_head_config())
    explicit, _ = verify(
        head,
        clone(state),
        hidden,
        drafts,
        cfg=cfg.lm_head_config(),
        active=jnp.asarray([True, False, True, False]),
    )
    np.testing.assert_array_equal(np.asarray(out.num_output)[[1, 3]], 0)
    assert np.all(np.asarray(out.num_output)[[0, 2]] >= 1)
    assert np.all(np.asarray(out.output_tokens)[[1, 3]] == -1)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(explicit)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    after = np_tree(new)
    idle = np.asarray([1, 3])
    for field in ("seq_len", "last_pair_key"):  # [N, B]
        np.testing.assert_array_equal(
            np.asarray(getattr(after, field))[:, idle], np.asarray(getattr(before, field))[:, idle]
        )
    for cache_after, cache_before in zip(after.kv, before.kv):
        np.testing.assert_array_equal(cache_after.block_table[idle], cache_before.block_table[idle])
    assert int(out.metrics.num_drafts) == 2


def test_active_with_no_valid_draft_still_gets_the_target_token():
    """A grammar mask that allows nothing at the first draft leaves ``num_valid`` 0 for a
    sequence that did run: verify still emits the target's token from row 0."""
    cfg = tiny_cfg()
    rng = np.random.default_rng(5)
    params, head = make(cfg)
    state = new_state(cfg, 2)
    tokens, hidden = random_pairs(rng, (2, 6))
    words = -(-V // 32)
    bitmask = np.full((2, K, words), -1, np.int32)
    bitmask[0, 0] = 0  # sequence 0: no token allowed at its first draft
    drafts, state = drafter.propose(
        params,
        head,
        state,
        pairs(tokens, hidden, [6, 6], [0, 0]),
        cfg=cfg,
        num_drafts=K,
        bitmask=jnp.asarray(bitmask),
    )
    np.testing.assert_array_equal(drafts.num_valid, [0, K])
    target_hidden = rng.standard_normal((2, K + 1, cfg.hidden_size)).astype(np.float32)
    out, _ = verify(head, state, jnp.asarray(target_hidden), drafts, cfg=cfg.lm_head_config())
    np.testing.assert_array_equal(out.num_output[0], 1)
    assert int(out.output_tokens[0, 0]) == int(_target_argmax(head, target_hidden)[0, 0])
    assert int(out.num_output[1]) >= 1


def test_verify_traces_once(monkeypatch):
    cfg = tiny_cfg()
    rng = np.random.default_rng(4)
    _, head, state, drafts = _proposed(cfg, rng)
    B = drafts.tokens.shape[0]
    head_cfg = cfg.lm_head_config()
    traces = count_calls(monkeypatch, _step, "lm_head")  # called once per trace of the body
    _step._verify.clear_cache()
    m = metrics.empty(K)
    for _ in range(3):
        hidden = jnp.asarray(rng.standard_normal((B, K + 1, cfg.hidden_size)), jnp.float32)
        out, _ = verify(head, clone(state), hidden, drafts, cfg=head_cfg, metrics=m)
        m = out.metrics
    assert int(m.num_drafts) == 3 * B
    assert len(traces) == 1


def test_every_spelling_of_an_argument_shares_one_program(monkeypatch):
    """``implementation`` by enum or name in any case, ``refeed`` omitted or given, and any
    spelling of a sampling temperature: one trace for greedy, one for sampling."""
    cfg = tiny_cfg()
    rng = np.random.default_rng(6)
    _, head, state, drafts = _proposed(cfg, rng)
    hidden = jnp.asarray(rng.standard_normal((4, K + 1, cfg.hidden_size)), jnp.float32)
    kw = dict(cfg=cfg.lm_head_config())
    traces = count_calls(monkeypatch, _step, "lm_head")
    _step._verify.clear_cache()
    for spelling in (
        {},
        dict(implementation="auto"),
        dict(implementation="AUTO"),
        dict(implementation=Implementation.AUTO),
        dict(refeed=False),
        dict(refeed=True),
        dict(refeed=np.bool_(True)),
        dict(temperature=0.0, key=jax.random.key(0)),
    ):
        verify(head, clone(state), hidden, drafts, **kw, **spelling)
    assert len(traces) == 1
    key = jax.random.key(1)
    sampled = [
        verify(head, clone(state), hidden, drafts, **kw, temperature=t, key=key)[0]
        for t in (0.7, np.float32(0.7), jnp.float32(0.7), jnp.asarray(0.7, jnp.bfloat16), 1.3)
    ]
    assert len(traces) == 2
    for out in sampled[1:3]:
        np.testing.assert_array_equal(out.output_tokens, sampled[0].output_tokens)


def test_clear_errors():
    cfg = tiny_cfg()
    rng = np.random.default_rng(7)
    _, head, state, drafts = _proposed(cfg, rng)
    hidden = jnp.zeros((4, K + 1, cfg.hidden_size), jnp.float32)
    with pytest.raises(TypeError, match="cfg must be passed by name"):
        verify(head, state, hidden, drafts, cfg.lm_head_config())
    with pytest.raises(ValueError, match="unknown implementation 'cudnn'; expected one of"):
        verify(head, state, hidden, drafts, cfg=cfg.lm_head_config(), implementation="cudnn")
    with pytest.raises(ValueError, match="key is required"):
        verify(head, state, hidden, drafts, cfg=cfg.lm_head_config(), temperature=0.5)
