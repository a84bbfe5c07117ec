"""rows_to_trim (the seed engine's rule), after_verify, free, and the rebuild invariant over
random propose / verify rounds."""

from __future__ import annotations

import dataclasses

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import (
    H,
    V,
    clone,
    held_rows,
    make,
    new_state,
    np_tree,
    pairs,
    propose_default,
    tiny_cfg,
)
from hypothesis import given, settings

from mtpjax import drafter, kv
from mtpjax.drafter import _trim as T

# --------------------------------------------------------------------------------------------
# rows_to_trim.


@pytest.mark.parametrize(
    "drafted, accepted, refeed, rows",
    [
        (1, 0, False, 1),
        (1, 1, False, 0),
        (2, 0, False, 2),
        (2, 1, False, 1),
        (2, 2, False, 0),
        (3, 3, False, 0),
        (1, 1, True, 0),
        (2, 1, True, 1),
        (2, 2, True, 1),
        (3, 2, True, 2),
        (3, 3, True, 2),
    ],
)
def test_rows_to_trim_table(drafted, accepted, refeed, rows):
    got = drafter.rows_to_trim(drafted, accepted, refeed)
    assert got == rows and type(got) is int
    arr = drafter.rows_to_trim(jnp.asarray([drafted]), jnp.asarray([accepted]), refeed)
    assert arr.dtype == jnp.int32 and int(arr[0]) == rows


def test_full_reject_is_the_same_with_and_without_refeed():
    for d in range(9):
        assert drafter.rows_to_trim(d, 0, True) == drafter.rows_to_trim(d, 0, False) == d


def test_never_more_than_drafted():
    for d in range(9):
        for a in range(d + 3):
            for refeed in (False, True):
                assert 0 <= drafter.rows_to_trim(d, a, refeed) <= d


_rows_to_trim = jax.jit(drafter.rows_to_trim)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 16), st.integers(0, 20), st.booleans()), min_size=1, max_size=8
    )
)
def test_rows_to_trim_properties(cases):
    # Padded to 8 cases so the array path always sees one shape.
    padded = cases + [(0, 0, False)] * (8 - len(cases))
    d, a, r = (np.asarray(c) for c in zip(*padded))
    vectorised = np.asarray(_rows_to_trim(d, a, r))
    for i, (di, ai, ri) in enumerate(cases):
        n = drafter.rows_to_trim(di, ai, ri)
        assert vectorised[i] == n  # ints and arrays agree, refeed per element
        # The formula, on the domain the engine produces (a <= d).
        if ai <= di:
            assert n == min(di, (di - ai) + (max(ai - 1, 0) if ri else 0))
        assert 0 <= n <= di
        # Rejected rows always go; refeed only ever drops more; within the engine's domain, one
        # more accepted draft never drops more rows.
        assert n >= min(di, max(di - ai, 0))
        assert drafter.rows_to_trim(di, ai, True) >= drafter.rows_to_trim(di, ai, False)
        if ai < di:
            assert drafter.rows_to_trim(di, ai + 1, ri) <= n


# --------------------------------------------------------------------------------------------
# after_verify and free on the state.


_append = jax.jit(kv.append)


def _drafted_state(cfg, drafted, lengths, last_keys):
    """A one-module state holding rows at keys ``last_keys[b] - lengths[b] + 1 ..``."""
    state = new_state(cfg, len(lengths))
    rows = np.ones((len(lengths), 9, cfg.num_key_value_heads, cfg.head_dim), np.float32)
    cache, _ = _append(state.kv[0], rows, rows, np.asarray(lengths, np.int32))
    R = cache.max_rows_per_seq
    idx = np.arange(R)[None, :]
    n, last = np.asarray(lengths)[:, None], np.asarray(last_keys)[:, None]
    keys = np.where(idx < n, last - n + 1 + idx, -1).astype(np.int32)
    return dataclasses.replace(
        state,
        kv=(cache,),
        row_keys=(jnp.asarray(keys),),
        last_num_drafted=jnp.asarray(drafted, jnp.int32),
    )


def test_after_verify_trims_the_rows_with_uncommitted_tokens():
    cfg = tiny_cfg()
    # Four sequences that drafted 3, 3, 3 and 0 rows (the last did not take part).
    state = _drafted_state(cfg, [3, 3, 3, 0], [9, 9, 9, 4], [8, 8, 8, 3])
    accepted = jnp.asarray([0, 1, 3, 2], jnp.int32)
    trimmed, new = drafter.after_verify(clone(state), accepted, refeed=False)
    # Rows e..e+2 hold the anchor, (d1, .), (d2, .): the committed ones are the first a+1.
    np.testing.assert_array_equal(trimmed[:, 0], [2, 1, 0, 0])
    np.testing.assert_array_equal(new.seq_len[0], [7, 8, 9, 4])
    np.testing.assert_array_equal(new.last_pair_key[0], [6, 7, 8, 3])
    np.testing.assert_array_equal(new.last_num_drafted, [0, 0, 0, 0])
    # Refeed (per sequence here) also drops the committed rows built from the drafter's hidden.
    trimmed, new = drafter.after_verify(
        clone(state), accepted, refeed=jnp.asarray([True, True, True, False])
    )
    np.testing.assert_array_equal(trimmed[:, 0], [2, 2, 2, 0])
    np.testing.assert_array_equal(new.last_pair_key[0], [6, 6, 6, 3])
    # A second call trims nothing; accepted counts are clipped to what was drafted.
    again, same = drafter.after_verify(new, jnp.asarray([9, 9, 9, 9]), refeed=True)
    np.testing.assert_array_equal(again[:, 0], [0, 0, 0, 0])
    np.testing.assert_array_equal(same.seq_len[0], [7, 7, 7, 4])
    with pytest.raises(AssertionError):
        drafter.after_verify(same, jnp.asarray([1, 1]), refeed=False)


def test_free_returns_blocks_and_resets():
    cfg = tiny_cfg()
    state = _drafted_state(cfg, [3, 3], [9, 5], [8, 4])
    free_before = int(state.kv[0].allocator.num_free)
    freed = drafter.free(state, jnp.asarray([True, False]))
    assert int(freed.kv[0].allocator.num_free) == free_before + 3  # ceil(9 / 4) blocks
    np.testing.assert_array_equal(freed.seq_len[0], [0, 5])
    np.testing.assert_array_equal(freed.last_pair_key[0], [-1, 4])
    np.testing.assert_array_equal(freed.last_num_drafted, [0, 3])
    assert np.all(np.asarray(freed.kv[0].block_table[0]) == -1)
    np.testing.assert_array_equal(freed.freed, [True, False])


def test_free_sequences_resets_bookkeeping():
    # The pure function behind free, on a state built by hand (moved here from test_kv.py).
    state = _drafted_state(tiny_cfg(), [3, 3], [5, 2], [4, 1])
    out = kv.free_sequences(state, jnp.asarray([True, False]))
    assert np.asarray(out.last_pair_key[0]).tolist() == [-1, 1]
    assert np.asarray(out.last_num_drafted).tolist() == [0, 3]
    assert np.asarray(out.seq_len[0]).tolist() == [0, 2]
    assert int(out.kv[0].allocator.num_free) == int(state.kv[0].allocator.num_free) + 2


def test_after_verify_and_free_trace_once():
    cfg = tiny_cfg()
    sizes = T._after_verify._cache_size(), T._free._cache_size()
    counted = jax.jit(
        chex.assert_max_traces(T._after_verify.__wrapped__, n=1), donate_argnames=("state",)
    )
    counted_free = jax.jit(chex.assert_max_traces(T._free.__wrapped__, n=1))
    # The default refeed, passed or not, as a bool or per sequence: one program.
    refeeds = ({}, {"refeed": False}, {"refeed": np.asarray([True, False])})
    for i in range(3):
        state = _drafted_state(cfg, [3, i], [9, 5], [8, 4])
        _, state = counted(state, jnp.asarray([i, 1]), jnp.asarray([i % 2 == 0, True]))
        counted_free(state, jnp.asarray([i == 1, False]))
        state = _drafted_state(cfg, [3, i], [9, 5], [8, 4])
        _, state = drafter.after_verify(state, np.asarray([i, 1], np.int32), **refeeds[i])
        drafter.free(state, np.asarray([i == 1, False]))
    assert T._after_verify._cache_size() - sizes[0] <= 1
    assert T._free._cache_size() - sizes[1] <= 1
    chex.clear_trace_counter()


# --------------------------------------------------------------------------------------------
# The invariant: rounds of propose / verify / after_verify against a from-scratch rebuild.

K = 3
MAX_KEYS = 40  # the pool's rows per sequence (max_seq_len 40, blocks of 4)


class _Sequence:
    """What one sequence's drafter rows must hold, derived from the protocol's definitions.

    ``committed`` are the committed tokens c_0..c_n; the row of key i is the pair
    (c_{i+1}, target hidden_i). Rows kept from a draft chain without refeed hold the hidden the
    chain fed them instead: ``drafter_fed[i]``.
    """

    def __init__(self, prompt, target_hidden):
        self.committed = list(prompt)
        self.target = target_hidden  # [MAX_KEYS + K, H] the target's hidden by position
        self.drafter_fed: dict[int, np.ndarray] = {}

    @property
    def n(self):  # pairs committed: keys 0..n-1; the anchor is key n-1
        return len(self.committed) - 1

    def expected(self, drafts, chain_hidden):
        """(tokens, hidden) by key for 0..n+K-2 after a propose that drafted `drafts`."""
        tokens = [self.committed[i + 1] for i in range(self.n)]
        hidden = [self.drafter_fed.get(i, self.target[i]) for i in range(self.n)]
        tokens += list(drafts[: K - 1])
        hidden += list(chain_hidden[: K - 1])
        return tokens, hidden


@jax.jit
def _rebuild(params, head, tokens, hidden):
    cfg = tiny_cfg()
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    return drafter.kv_rows(params, head, tokens, hidden, positions, cfg=cfg)


def _check_rows(params, head, state, b, seq, drafts, chain_hidden):
    tokens, hidden = seq.expected(drafts, chain_hidden)
    rows = len(tokens)
    assert np.asarray(state.seq_len[0])[b] == rows
    pad = MAX_KEYS - rows
    tok = np.pad(np.asarray(tokens, np.int32), (0, pad))
    hid = np.pad(np.stack([np.asarray(h, np.float32) for h in hidden]), ((0, pad), (0, 0)))
    want_k, want_v = np_tree(_rebuild(params, head, tok, hid))
    got_k, got_v = held_rows(state, b)
    # The pool stores BF16: allow one BF16 rounding step (relative 2^-8) between the two.
    for got, want in ((got_k, want_k[:rows]), (got_v, want_v[:rows])):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    prompt_lens=st.tuples(st.integers(2, 7), st.integers(2, 7)),
    rounds=st.lists(
        st.tuples(
            st.tuples(st.integers(0, K), st.integers(0, K)),  # drafts accepted per sequence
            st.tuples(st.booleans(), st.booleans()),  # refeed per sequence
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_rows_equal_a_rebuild_after_random_rounds(seed, prompt_lens, rounds):
    cfg = tiny_cfg()
    params, head = make(cfg)
    B = 2
    rng = np.random.default_rng(seed)
    target = rng.standard_normal((B, MAX_KEYS + K, H)).astype(jnp.bfloat16)
    seqs = [
        _Sequence(rng.integers(0, V, n + 1).tolist(), np.asarray(target[b]))
        for b, n in enumerate(prompt_lens)
    ]
    # Prefill keys 0..n-2 of each prompt (width 7, in chunks of 4); the anchor goes to propose.
    state = new_state(cfg, B)
    tok = np.zeros((B, 7), np.int32)
    for b, s in enumerate(seqs):
        tok[b, : s.n - 1] = s.committed[1 : s.n]
    state = drafter.prefill(
        params, head, state, pairs(tok, target[:, :7], [s.n - 1 for s in seqs], [0, 0]),
        cfg=cfg, chunk_size=4,
    )  # fmt: skip
    window_start = [s.n - 1 for s in seqs]
    for accepted, refeed in rounds:
        # The window: keys window_start..n-1 (the anchor alone at first, then the verify's).
        width = K + 1
        tok = np.zeros((B, width), np.int32)
        hid = np.zeros((B, width, H), np.float32)
        count = []
        for b, s in enumerate(seqs):
            keys = list(range(window_start[b], s.n))
            count.append(len(keys))
            tok[b, : len(keys)] = [s.committed[i + 1] for i in keys]
            hid[b, : len(keys)] = np.asarray(target[b, keys[0] : keys[-1] + 1], np.float32)
        window = pairs(tok, hid.astype(jnp.bfloat16), count, window_start)
        out, state = propose_default(params, head, state, window, cfg)
        drafter.raise_on_state_error(state)
        drafts, chain_hidden = np.asarray(out.tokens), np.asarray(out.hidden)
        for b, s in enumerate(seqs):
            _check_rows(params, head, state, b, s, drafts[b], chain_hidden[b])
        # Verify: accept a prefix of the drafts, then the target's own token.
        _, state = drafter.after_verify(
            state, np.asarray(accepted, np.int32), refeed=np.asarray(refeed)
        )
        for b, s in enumerate(seqs):
            e, a = s.n - 1, accepted[b]
            if not refeed[b]:  # accepted chain rows stay with the drafter-side hidden
                for j in range(1, min(a, K - 1) + 1):
                    s.drafter_fed[e + j] = chain_hidden[b, j - 1]
            window_start[b] = s.n
            s.committed += [*drafts[b, :a].tolist(), int(rng.integers(0, V))]
            assert np.asarray(state.last_pair_key[0])[b] <= s.n - 1
    # A refeed round after round leaves no drafter-fed row: the rows are the rebuild exactly.
    if all(all(r) for _, r in rounds):
        assert not any(s.drafter_fed for s in seqs)
