"""The jit'd verify step against the head, the acceptance rule and after_verify run separately."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
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

from mtpjax import drafter
from mtpjax.verify import metrics, verify

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
    out, new, m = verify(
        head, clone(state), jnp.asarray(hidden), drafts, head_cfg=cfg.lm_head_config()
    )
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
        out, new, _ = verify(
            head, clone(state), hidden, drafts, head_cfg=head_cfg, temperature=temperature, key=key
        )
        # The same pieces, one row at a time through the head's single-row path.
        from mtpjax.head import lm_head
        from mtpjax.verify import accept

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
    out, new, m = verify(
        head,
        clone(state),
        hidden,
        drafts,
        head_cfg=cfg.lm_head_config(),
        active=jnp.asarray(active),
    )
    assert np.all(np.asarray(out.output_tokens)[~active] == -1)
    np.testing.assert_array_equal(np.asarray(out.num_output)[~active], 0)
    assert np.all(np.asarray(out.num_output)[active] >= 1)
    after = np_tree(new)
    for a, b in ((after.seq_len[0], before.seq_len[0]),  # module 0 of the state's [N, B]
                 (after.last_pair_key[0], before.last_pair_key[0]),
                 (after.kv[0].block_table, before.kv[0].block_table)):  # fmt: skip
        np.testing.assert_array_equal(a[~active], b[~active])
    assert int(m.num_drafts) == 2 and int(m.num_draft_tokens) == 2 * K


def test_verify_traces_once():
    cfg = tiny_cfg()
    rng = np.random.default_rng(4)
    _, head, state, drafts = _proposed(cfg, rng)
    B = drafts.tokens.shape[0]
    head_cfg = cfg.lm_head_config()
    m = metrics.empty(K)
    traced = chex.assert_max_traces(verify.__wrapped__, n=1)
    step = jax.jit(traced, static_argnames=("head_cfg", "temperature", "implementation"))
    for _ in range(3):
        hidden = jnp.asarray(rng.standard_normal((B, K + 1, cfg.hidden_size)), jnp.float32)
        _, _, m = step(head, clone(state), hidden, drafts, head_cfg=head_cfg, metrics=m)
    assert int(m.num_drafts) == 3 * B
    chex.clear_trace_counter()
