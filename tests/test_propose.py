"""propose and the paged single-row step: paged attention, chaining, contracts, masks, cuts."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import (
    V,
    clone,
    draft_step,
    held_rows,
    make,
    new_state,
    np_tree,
    pairs,
    propose_default,
    random_pairs,
    tiny_cfg,
)

from mtpjax import drafter, kv
from mtpjax.config import FfnKind, HiddenContract
from mtpjax.drafter import _propose as P
from pallas_kernels.implementation import Implementation

B, T, K = 2, 4, 3  # sequences, window width, drafts: shared so the tests share compilations
LENS = (5, 3)  # committed pairs per sequence (keys 0..n-1; the last one is the anchor)
PROPOSE_STATIC = (
    "cfg",
    "num_drafts",
    "hidden_contract",
    "head_cfg",
    "return_logits",
    "implementation",
)


def _committed(seed=0):
    """Committed pairs [B, 7] (tokens, target hidden) for keys 0..6."""
    return random_pairs(np.random.default_rng(seed), (B, 7))


def _prefilled(cfg, params, head, tokens, hidden):
    """State holding keys 0..n-2 of each sequence (the anchor key n-1 is left to propose)."""
    state = new_state(cfg, B)
    n = np.asarray(LENS)
    return drafter.prefill(
        params, head, state, pairs(tokens, hidden, n - 1, [0] * B), cfg=cfg, chunk_size=4
    )


def _anchor_window(tokens, hidden):
    """Width-T windows holding only each sequence's anchor pair (key n-1)."""
    n = np.asarray(LENS)
    idx = np.arange(B)
    tok = np.zeros((B, T), np.int32)
    hid = np.zeros((B, T, hidden.shape[-1]), hidden.dtype)
    tok[:, 0], hid[:, 0] = tokens[idx, n - 1], hidden[idx, n - 1]
    return pairs(tok, hid, [1] * B, n - 1)


_propose = propose_default


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    params, head = make(cfg)
    tokens, hidden = _committed()
    return cfg, params, head, tokens, hidden


# --------------------------------------------------------------------------------------------
# Paged attention.


@pytest.mark.parametrize("kv_dtype", [kv.KVDtype.BF16, kv.KVDtype.FP8])
def test_paged_attention_equals_dense_attention(kv_dtype):
    rng = np.random.default_rng(0)
    Nq, Nkv, D = 4, 2, 16
    cfg = kv.PoolConfig(
        num_kv_heads=Nkv, head_dim=D, num_blocks=12, max_blocks_per_seq=5, block_size=4,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    cache = kv.init_cache(cfg, num_seqs=3)
    append = jax.jit(kv.append)
    # Interleaved appends, so each sequence's blocks are scattered through the pool.
    for n in ([3, 5, 0], [4, 0, 6], [2, 3, 1]):
        rows = rng.standard_normal((2, 3, 6, Nkv, D)).astype(np.float32)
        cache, ok = append(cache, rows[0], rows[1], np.asarray(n, np.int32))
        assert bool(ok.all())
    q = rng.standard_normal((3, Nq, D)).astype(np.float32)
    got = np.asarray(drafter.paged_attention(q, cache, implementation="xla"))
    lens = np.asarray(cache.seq_len)
    assert list(lens) == [9, 8, 7]
    k, v, valid = np_tree(jax.jit(kv.gather, static_argnums=1)(cache, 9))
    for b in range(3):
        kb, vb = np.asarray(k[b, : lens[b]], np.float64), np.asarray(v[b, : lens[b]], np.float64)
        for h in range(Nq):
            s = kb[:, h // 2] @ q[b, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ vb[:, h // 2]
            np.testing.assert_allclose(got[b, h], want, rtol=1e-5, atol=1e-5)
    # The dense reference on the same rows, through the shared `attend`.
    from mtpjax.layers import attend

    dense = jax.jit(attend)(q[:, None], k, v, valid[:, None])[:, 0]
    np.testing.assert_allclose(got, dense, rtol=1e-6, atol=1e-6)
    # The Pallas kernel (interpret mode here) on the same cache; FP8 pools pass their
    # per-(row, head) scales.
    kernel = drafter.paged_attention(q, cache, implementation="pallas")
    np.testing.assert_allclose(kernel, got, rtol=2e-2, atol=2e-2)  # P.V meets in bf16 / f16


# --------------------------------------------------------------------------------------------
# propose against the single-row step and the teacher-forced forward.


def _manual_chain(cfg, params, head, state, tokens, hidden, contract, k=K):
    """The anchor's draft_step then k-1 draft_steps, each fed what `contract` says."""
    n = np.asarray(LENS)
    idx = np.arange(B)
    anchor_hidden = hidden[idx, n - 1]
    tok, hid, pos = tokens[idx, n - 1], anchor_hidden, (n - 1).astype(np.int32)
    drafts, probs = [], []
    for _ in range(k):
        out, state = draft_step(params, head, state, tok, hid, pos, cfg=cfg)
        out = np_tree(out)
        p = np.exp(out.logits - out.logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        tok = out.logits.argmax(-1).astype(np.int32)
        drafts.append(tok)
        probs.append(p.max(-1))
        hid = {
            HiddenContract.POST_NORM: out.h_out,
            HiddenContract.PRE_NORM: out.residual,
            HiddenContract.PINNED: anchor_hidden.astype(np.float32),
        }[contract]
        pos = pos + 1
    return np.stack(drafts, 1), np.stack(probs, 1), state


@pytest.mark.parametrize("contract", list(HiddenContract))
def test_propose_equals_manual_single_row_steps(setup, contract):
    cfg, params, head, tokens, hidden = setup
    state = _prefilled(cfg, params, head, tokens, hidden)
    manual_tokens, manual_probs, manual_state = _manual_chain(
        cfg, params, head, clone(state).kv[0], tokens, hidden, contract
    )
    out, new = _propose(
        params, head, state, _anchor_window(tokens, hidden), cfg, hidden_contract=contract
    )
    np.testing.assert_array_equal(out.tokens, manual_tokens)
    np.testing.assert_allclose(out.probs, manual_probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.confidence, np.minimum.accumulate(manual_probs, 1), rtol=1e-5)
    np.testing.assert_array_equal(out.num_valid, [K] * B)
    np.testing.assert_array_equal(new.seq_len[0], manual_state.seq_len)
    np.testing.assert_array_equal(new.last_pair_key[0], np.asarray(LENS) - 1 + K - 1)
    np.testing.assert_array_equal(new.last_num_drafted, [K] * B)
    for b in range(B):
        for got, want in zip(held_rows(new, b), held_rows(manual_state, b)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_hidden_contracts_feed_what_they_say(setup):
    # Draft 2 of each contract equals a single-row step fed that contract's hidden, and the
    # three hand different vectors to step 2.
    cfg, params, head, tokens, hidden = setup
    base = _prefilled(cfg, params, head, tokens, hidden)
    n = np.asarray(LENS)
    idx = np.arange(B)
    first, after_anchor = draft_step(
        params, head, clone(base).kv[0], tokens[idx, n - 1], hidden[idx, n - 1],
        (n - 1).astype(np.int32), cfg=cfg,
    )  # fmt: skip
    first = np_tree(first)
    d1 = first.logits.argmax(-1).astype(np.int32)
    fed = {
        HiddenContract.POST_NORM: first.h_out,
        HiddenContract.PRE_NORM: first.residual,
        HiddenContract.PINNED: hidden[idx, n - 1].astype(np.float32),
    }
    seconds = {}
    for contract, h in fed.items():
        out, _ = _propose(
            params, head, clone(base), _anchor_window(tokens, hidden), cfg,
            hidden_contract=contract,
        )  # fmt: skip
        np.testing.assert_allclose(out.hidden[:, 0], h, rtol=1e-5, atol=1e-5)
        step2, _ = draft_step(params, head, clone(after_anchor), d1, h, n.astype(np.int32), cfg=cfg)
        step2 = np_tree(step2)
        np.testing.assert_array_equal(out.tokens[:, 1], step2.logits.argmax(-1))
        np.testing.assert_allclose(out.logits[:, 1], step2.logits, rtol=1e-5, atol=1e-5)
        seconds[contract] = np.asarray(out.logits[:, 1])
    a, b, c = seconds.values()
    assert np.abs(a - b).max() > 1e-2 and np.abs(a - c).max() > 1e-2 and np.abs(b - c).max() > 1e-2


def test_paged_path_equals_drafter_forward(setup):
    # The chain's logits equal the teacher-forced forward over committed + chain pairs; the gap
    # is the pool's BF16 storage of K/V (relative 2^-9 per element), which moves O(5) logits by
    # well under 0.05.
    cfg, params, head, tokens, hidden = setup
    state = _prefilled(cfg, params, head, tokens, hidden)
    out, _ = _propose(params, head, state, _anchor_window(tokens, hidden), cfg)
    # Per sequence: its n committed pairs then the K-1 chain pairs, padded to 7 rows at the end
    # (padding gets later positions, so no real row sees it).
    seq_tokens = np.zeros((B, 7), np.int32)
    seq_hidden = np.zeros((B, 7, hidden.shape[-1]), np.float32)
    for b, n in enumerate(LENS):
        seq_tokens[b, :n] = tokens[b, :n]
        seq_tokens[b, n : n + K - 1] = out.tokens[b, : K - 1]
        seq_hidden[b, :n] = np.asarray(hidden[b, :n], np.float32)
        seq_hidden[b, n : n + K - 1] = out.hidden[b, : K - 1]
    positions = np.arange(7, dtype=np.int32)[None].repeat(B, 0)
    ref = np_tree(
        drafter.drafter_forward(params, head, seq_tokens, seq_hidden, cfg=cfg, positions=positions)
    )
    for b, n in enumerate(LENS):
        rows = slice(n - 1, n - 1 + K)
        np.testing.assert_allclose(out.logits[b], ref.logits[b, rows], atol=5e-2, rtol=0)
        np.testing.assert_allclose(out.hidden[b], ref.h_out[b, rows], atol=1e-2, rtol=0)
        np.testing.assert_array_equal(out.tokens[b], ref.logits[b, rows].argmax(-1))


def test_window_catch_up_equals_prefill(setup):
    # Without a prefill, one window carrying the committed pairs writes the same rows and drafts
    # the same tokens; a window overlapping held rows skips them.
    cfg, params, head, tokens, hidden = setup
    n = np.asarray(LENS)
    prefilled = _prefilled(cfg, params, head, tokens, hidden)
    want, want_state = _propose(params, head, prefilled, _anchor_window(tokens, hidden), cfg)
    # Two windows of width T: keys 0..T-1, then the rest. The first propose's anchor rows are
    # held by the second, which drops the first one's unverified chain rows and skips the
    # overlap.
    state = new_state(cfg, B)
    first = np.minimum(n, T)
    _, state = _propose(
        params, head, state, pairs(tokens[:, :T], hidden[:, :T], first, [0, 0]), cfg
    )
    start = n - np.minimum(n, T)  # overlaps what is held
    idx = np.arange(B)[:, None]
    cols = start[:, None] + np.arange(T)[None, :]
    cols = np.minimum(cols, 6)
    window = pairs(tokens[idx, cols], hidden[idx, cols], n - start, start)
    got, got_state = _propose(params, head, state, window, cfg)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.probs, want.probs, rtol=1e-5)
    np.testing.assert_array_equal(got_state.seq_len, want_state.seq_len)
    np.testing.assert_array_equal(got_state.last_pair_key, want_state.last_pair_key)
    for b in range(B):
        for g, w in zip(held_rows(got_state, b), held_rows(want_state, b)):
            np.testing.assert_allclose(g, w, rtol=2**-8, atol=1e-6)


def test_proposing_twice_at_the_same_point_is_idempotent(setup):
    cfg, params, head, tokens, hidden = setup
    state = _prefilled(cfg, params, head, tokens, hidden)
    window = _anchor_window(tokens, hidden)
    first, state = _propose(params, head, state, window, cfg)
    snapshot = clone(state)
    second, state = _propose(params, head, state, window, cfg)
    np.testing.assert_array_equal(second.tokens, first.tokens)
    np.testing.assert_array_equal(state.seq_len, snapshot.seq_len)
    for b in range(B):
        for g, w in zip(held_rows(state, b), held_rows(snapshot, b)):
            np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------------------------
# Masks, reduced vocab, confidence cut, inactive sequences.


def _pack(allowed: np.ndarray) -> np.ndarray:
    """bool[..., V] -> packed int32[..., ceil(V/32)] (bit j%32 of word j//32)."""
    V_ = allowed.shape[-1]
    words = -(-V_ // 32)
    padded = np.zeros((*allowed.shape[:-1], words * 32), bool)
    padded[..., :V_] = allowed
    bits = padded.reshape(*allowed.shape[:-1], words, 32).astype(np.uint64)
    packed = (bits << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return packed.view(np.int32)


def test_unpack_bitmask_round_trip():
    allowed = np.random.default_rng(0).random((3, 100)) < 0.3
    unpack = jax.jit(drafter.unpack_bitmask, static_argnums=1)
    np.testing.assert_array_equal(unpack(_pack(allowed), 100), allowed)


def test_grammar_bitmask_forces_the_allowed_set(setup):
    cfg, params, head, tokens, hidden = setup
    rng = np.random.default_rng(1)
    allowed = rng.random((B, V)) < 0.08
    allowed[:, 5] = True
    state = _prefilled(cfg, params, head, tokens, hidden)
    out, _ = _propose(
        params, head, state, _anchor_window(tokens, hidden), cfg, bitmask=_pack(allowed)
    )
    assert all(allowed[b, t] for b in range(B) for t in np.asarray(out.tokens[b]))
    # The argmax over the allowed set, with the disallowed logits masked out.
    logits = np.asarray(out.logits)
    assert np.all(np.isneginf(logits[0][:, ~allowed[0]]))
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    # An empty mask leaves nothing to draft: the sequence's chain is cut before draft 1.
    allowed[1] = False
    state = _prefilled(cfg, params, head, tokens, hidden)
    out, _ = _propose(
        params, head, state, _anchor_window(tokens, hidden), cfg, bitmask=_pack(allowed)
    )
    np.testing.assert_array_equal(out.num_valid, [K, 0])
    np.testing.assert_array_equal(out.tokens[1], [-1] * K)
    with pytest.raises(ValueError, match="bitmask must be"):
        _propose(
            params, head, state, _anchor_window(tokens, hidden), cfg, bitmask=_pack(allowed)[:, :1]
        )


def test_per_draft_bitmask_and_reduced_vocab_on_a_moe_head():
    # One compilation covers four options: a MoE head (NVFP4, few-rows expert gather), its FP8
    # KV pool, a reduced draft vocab V' = 40 and per-draft masks.
    full = tiny_cfg(FfnKind.MOE)
    cfg = tiny_cfg(FfnKind.MOE, mtp_vocab_size=40)
    params, head = make(full, "nvfp4")
    tokens, hidden = _committed(3)
    n = np.asarray(LENS)
    count = np.minimum(n, T)
    window = pairs(tokens[:, :T], hidden[:, :T], count, [0, 0])
    # Draft 1 free, draft 2 forced to one token (sequence 1: nothing allowed), draft 3 free.
    forced = np.ones((B, K, V), bool)
    forced[:, 1] = False
    forced[0, 1, 17] = True
    # An NVFP4 head keeps its KV in FP8 (per-row scales) by default.
    fp8_pool = drafter.pool_config(cfg, precision="nvfp4", max_seq_len=40, max_seqs=B, block_size=4)
    assert fp8_pool.kv_dtype is kv.KVDtype.FP8
    state = drafter.init_state(fp8_pool, num_seqs=B)
    out, state = _propose(params, head, state, window, cfg, bitmask=_pack(forced))
    assert out.logits.shape == (B, K, 40)
    np.testing.assert_array_equal(out.num_valid, [K, 1])
    assert int(out.tokens[0, 1]) == 17 and float(out.probs[0, 1]) == pytest.approx(1.0)
    assert int(out.tokens[0].min()) >= 0 and int(out.tokens[0].max()) < 40
    np.testing.assert_array_equal(out.tokens[1, 1:], [-1, -1])
    # Draft 1 scores the first V' logits of the full head at the anchor row. The FP8 pool
    # stores K and V with 3 mantissa bits (relative error up to 2^-4 per element), which moves
    # these O(5) logits by ~0.1: compare at 0.25, and check the draft is the reference argmax up
    # to that noise.
    ref = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=full))
    anchor = ref.logits[np.arange(B), count - 1, :40]
    np.testing.assert_allclose(out.logits[:, 0], anchor, atol=0.25)
    chosen = anchor[np.arange(B), out.tokens[:, 0]]
    assert np.all(chosen >= anchor.max(-1) - 0.5)
    np.testing.assert_array_equal(state.seq_len[0], count + K - 1)
    drafter.raise_on_state_error(state)


def test_confidence_threshold_cuts_the_chain(setup):
    cfg, params, head, tokens, hidden = setup

    def run(threshold):
        state = _prefilled(cfg, params, head, tokens, hidden)
        return _propose(
            params, head, state, _anchor_window(tokens, hidden), cfg,
            threshold=np.asarray(threshold, np.float32),
        )[0]  # fmt: skip

    base = run([0.0, 0.0])
    conf = np.asarray(base.confidence)
    assert np.all(np.diff(conf, axis=1) <= 0) and np.all(conf > 0)
    np.testing.assert_array_equal(base.num_valid, [K, K])
    # Per sequence: a threshold between its confidence before and after its first drop, at
    # draft j+1, so draft j+1 is the first below and stays valid and later ones are cut; a
    # sequence without a drop gets a threshold above every probability (only draft 1 stays).
    thresholds, want_valid = [], []
    for b in range(B):
        drops = np.flatnonzero(np.diff(conf[b]) < 0)
        if drops.size:
            j = int(drops[0]) + 1
            thresholds.append((conf[b, j - 1] + conf[b, j]) / 2)
            want_valid.append(j + 1)
        else:
            thresholds.append(1.5)
            want_valid.append(1)
    assert max(want_valid) > 1, "the test needs a confidence drop within some chain"
    cut = run(thresholds)
    np.testing.assert_array_equal(cut.num_valid, want_valid)
    for b in range(B):
        want = np.asarray(base.tokens[b]).copy()
        want[want_valid[b] :] = -1
        np.testing.assert_array_equal(cut.tokens[b], want)
    np.testing.assert_allclose(cut.confidence, base.confidence)


def test_inactive_sequences_are_untouched(setup):
    cfg, params, head, tokens, hidden = setup
    state = _prefilled(cfg, params, head, tokens, hidden)
    window = _anchor_window(tokens, hidden)
    all_active, _ = _propose(params, head, clone(state), window, cfg)
    before = clone(state)
    for inactive in (
        pairs(window.tokens, window.hidden, [1, 1], window.start, active=[True, False]),
        pairs(window.tokens, window.hidden, [1, 0], window.start),
    ):
        out, new = _propose(params, head, clone(state), inactive, cfg)
        np.testing.assert_array_equal(out.tokens[0], all_active.tokens[0])
        np.testing.assert_array_equal(out.tokens[1], [-1] * K)
        np.testing.assert_array_equal(out.num_valid, [K, 0])
        got, want = np_tree(new), np_tree(before)
        assert got.kv[0].seq_len[1] == want.kv[0].seq_len[1]
        assert new.last_pair_key[0, 1] == before.last_pair_key[0, 1]
        assert got.last_num_drafted[1] == want.last_num_drafted[1]
        np.testing.assert_array_equal(got.kv[0].block_table[1], want.kv[0].block_table[1])
        for g, w in zip(held_rows(new, 1), held_rows(before, 1)):
            np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------------------------
# Tracing.


def test_propose_traces_once(setup):
    cfg, params, head, _, _ = setup
    counted = jax.jit(
        chex.assert_max_traces(P._propose.__wrapped__, n=1),
        static_argnames=PROPOSE_STATIC,
        donate_argnames=("state",),
    )
    size = P._propose._cache_size()
    rng = np.random.default_rng(5)
    mask = np.full((B, -(-V // 32)), -1, np.int32)
    for i in range(3):
        # Different counts, starts, values and thresholds every call, and every spelling of the
        # implementation: one program.
        tok, hid = random_pairs(rng, (B, T))
        window = P.check_propose_inputs(
            new_state(cfg, B), pairs(tok, hid, [1 + i, 3 - i], [i, 2 * i]), cfg, 1
        )
        _, state = counted(
            drafter.DrafterModules(modules=(params,), schedule=drafter.ModuleSchedule.CYCLE),
            head, new_state(cfg, B), window, None, jnp.full((B,), 0.1 * i), cfg=cfg,
            num_drafts=K, hidden_contract=HiddenContract.POST_NORM, head_cfg=cfg.lm_head_config(),
            return_logits=False, implementation=Implementation.AUTO,
        )  # fmt: skip
        _, state = drafter.propose(
            params, head, state, window, cfg=cfg, num_drafts=K, return_logits=True,
            bitmask=mask, confidence_threshold=np.full((B,), 0.1 * i, np.float32),
            implementation=("auto", "AUTO", Implementation.AUTO)[i],
        )  # fmt: skip
    # The library's own jitted step: at most one new compilation for all those calls.
    assert P._propose._cache_size() - size <= 1
    chex.clear_trace_counter()


def test_num_drafts_must_be_an_int(setup):
    cfg, params, head, tokens, hidden = setup
    state = new_state(cfg, B)
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match=f"num_drafts must be an int >= 1, got {bad!r}"):
            drafter.propose(
                params, head, state, _anchor_window(tokens, hidden), cfg=cfg, num_drafts=bad
            )


# --------------------------------------------------------------------------------------------
# Windows the drafter must not take at face value.


def test_rewinding_with_another_token_rewrites_the_anchor_row(setup):
    """Back at the prompt end with a different first token: the held anchor row (and what was
    built on it) goes, and the drafts equal a clean run's from that token."""
    cfg, params, head, tokens, hidden = setup
    window = _anchor_window(tokens, hidden)
    other = np.asarray(window.tokens).copy()
    other[:, 0] = (other[:, 0] + 1) % V
    rewound = pairs(other, window.hidden, window.count, window.start)
    state = _prefilled(cfg, params, head, tokens, hidden)
    _, state = _propose(params, head, state, window, cfg)
    _, state = drafter.after_verify(state, np.asarray([2, 0], np.int32))
    got, got_state = _propose(params, head, state, rewound, cfg)
    want, want_state = _propose(
        params, head, _prefilled(cfg, params, head, tokens, hidden), rewound, cfg
    )
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got_state.seq_len, want_state.seq_len)
    for b in range(B):
        for g, w in zip(held_rows(got_state, b), held_rows(want_state, b)):
            np.testing.assert_array_equal(g, w)


def test_a_gap_and_a_late_start_after_free_are_refused(setup):
    cfg, params, head, tokens, hidden = setup
    state = _prefilled(cfg, params, head, tokens, hidden)  # keys 0..3 and 0..1
    before = clone(state)
    window = _anchor_window(tokens, hidden)
    gap = pairs(window.tokens, window.hidden, window.count, np.asarray(LENS) - 1 + [1, 0])
    out, state = _propose(params, head, state, gap, cfg)
    np.testing.assert_array_equal(out.num_valid, [0, K])  # sequence 0 starts past key 4
    np.testing.assert_array_equal(state.window_error, [int(drafter.WindowError.GAP), 0])
    assert int(state.seq_len[0, 0]) == int(before.seq_len[0, 0])
    with pytest.raises(kv.KVCacheError, match=r"sequence 0: Pairs\.start is past"):
        drafter.raise_on_state_error(state)
    # free clears the flag; the slot's next window must then start at key 0.
    state = drafter.free(state, np.asarray([True, False]))
    _, after = _propose(params, head, clone(state), window, cfg)  # sequence 0 at key 4
    np.testing.assert_array_equal(after.window_error, [int(drafter.WindowError.NOT_FROM_START), 0])
    np.testing.assert_array_equal(after.seq_len[0], [0, LENS[1] + K - 1])
    fresh = pairs(window.tokens, window.hidden, window.count, [0, LENS[1] - 1])
    out, state = _propose(params, head, state, fresh, cfg)
    np.testing.assert_array_equal(out.num_valid, [K, K])
    drafter.raise_on_state_error(state)
