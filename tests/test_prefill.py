"""The attention-free drafter prefill: same rows as the one-at-a-time path, chunking, skipping,
the BF16 fc/k/v requirement."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from drafter_helpers import (
    clone,
    draft_step,
    held_rows,
    make,
    new_state,
    np_tree,
    pairs,
    random_pairs,
    tiny_cfg,
)

from mtpjax import drafter, kv
from mtpjax.config import FfnKind
from mtpjax.drafter import _propose as P
from pallas_kernels.implementation import Implementation

B, T = 2, 7
COUNTS = (7, 5)  # pairs per window: with chunks of 4 and blocks of 4, both cross boundaries


def _bf16_close(got, want):
    # Both sides store the same F32 rows rounded to BF16; XLA may sum a row's dot products in a
    # different order for a chunk than for a single row, which can flip one BF16 rounding.
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(0), (B, T))
    return cfg, params, head, tokens, hidden


def test_prefill_rows_equal_the_row_by_row_path(setup):
    cfg, params, head, tokens, hidden = setup
    start = np.asarray([0, 3])  # sequence 1's pairs start at key 3: a drafter joining late
    state = drafter.prefill(
        params, head, new_state(cfg, B), pairs(tokens, hidden, COUNTS, start), cfg=cfg,
        chunk_size=4,
    )  # fmt: skip
    np.testing.assert_array_equal(state.seq_len[0], COUNTS)
    np.testing.assert_array_equal(state.last_pair_key[0], start + np.asarray(COUNTS) - 1)
    np.testing.assert_array_equal(state.last_num_drafted, [0, 0])
    # One paged row at a time through draft_step (which also attends; its rows must match).
    stepped = new_state(cfg, B).kv[0]
    for t in range(T):
        active = np.asarray([t < c for c in COUNTS])
        _, stepped = draft_step(
            params, head, stepped, tokens[:, t], hidden[:, t], (start + t).astype(np.int32),
            cfg=cfg, active=active,
        )  # fmt: skip
    np.testing.assert_array_equal(stepped.seq_len, COUNTS)
    positions = (start[:, None] + np.arange(T)[None, :]).astype(np.int32)
    want_k, want_v = np_tree(drafter.kv_rows(params, head, tokens, hidden, positions, cfg=cfg))
    for b, n in enumerate(COUNTS):
        got_k, got_v = held_rows(state, b)
        step_k, step_v = held_rows(stepped, b)
        _bf16_close(got_k, step_k)
        _bf16_close(got_v, step_v)
        _bf16_close(got_k, want_k[b, :n])
        _bf16_close(got_v, want_v[b, :n])
    # One chunk or two: the same rows.
    whole = drafter.prefill(
        params, head, new_state(cfg, B), pairs(tokens, hidden, COUNTS, start), cfg=cfg,
        chunk_size=64,
    )  # fmt: skip
    for b in range(B):
        for g, w in zip(held_rows(whole, b), held_rows(state, b)):
            _bf16_close(g, w)


def test_prefill_skips_held_pairs(setup):
    # Two overlapping windows write each key once: the rows equal one prefill of the union.
    cfg, params, head, tokens, hidden = setup
    once = drafter.prefill(
        params, head, new_state(cfg, B), pairs(tokens, hidden, COUNTS, [0, 0]), cfg=cfg,
        chunk_size=4,
    )  # fmt: skip
    first = drafter.prefill(
        params, head, new_state(cfg, B), pairs(tokens, hidden, [4, 2], [0, 0]), cfg=cfg,
        chunk_size=4,
    )  # fmt: skip
    # Keys 2.. of each sequence, given as a window starting at key 2 (keys 2, 3 of sequence 0
    # are held already and skipped).
    shifted_t = np.pad(tokens[:, 2:], ((0, 0), (0, 2)))
    shifted_h = np.pad(hidden[:, 2:], ((0, 0), (0, 2), (0, 0)))
    second = drafter.prefill(
        params, head, first, pairs(shifted_t, shifted_h, [5, 3], [2, 2]), cfg=cfg, chunk_size=4
    )
    np.testing.assert_array_equal(second.seq_len[0], COUNTS)
    np.testing.assert_array_equal(second.last_pair_key[0], np.asarray(COUNTS) - 1)
    for b in range(B):
        for g, w in zip(held_rows(second, b), held_rows(once, b)):
            _bf16_close(g, w)


def test_inactive_sequences_are_untouched(setup):
    cfg, params, head, tokens, hidden = setup
    base = drafter.prefill(
        params, head, new_state(cfg, B), pairs(tokens, hidden, [2, 3], [0, 0]), cfg=cfg,
        chunk_size=4,
    )  # fmt: skip
    before = clone(base)
    for window in (
        pairs(tokens, hidden, [7, 7], [2, 3], active=[True, False]),
        pairs(tokens, hidden, [7, 0], [2, 3]),
    ):
        new = drafter.prefill(params, head, clone(base), window, cfg=cfg, chunk_size=4)
        got, want = np_tree(new), np_tree(before)
        assert got.kv[0].seq_len[0] == 9 and got.kv[0].seq_len[1] == want.kv[0].seq_len[1]
        assert new.last_pair_key[0, 1] == before.last_pair_key[0, 1]
        np.testing.assert_array_equal(got.kv[0].block_table[1], want.kv[0].block_table[1])
        for g, w in zip(held_rows(new, 1), held_rows(before, 1)):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "ffn, precision, ok",
    [
        (FfnKind.DENSE, "fp8", False),
        (FfnKind.MOE, "nvfp4", False),
        (FfnKind.DENSE, "nvfp4", True),  # q/o NVFP4 but fc/k/v BF16
    ],
)
def test_prefill_needs_bf16_fc_k_v(ffn, precision, ok):
    cfg = tiny_cfg(ffn)
    params, head = make(cfg, precision)
    tokens, hidden = random_pairs(np.random.default_rng(1), (B, T))
    window = pairs(tokens, hidden, COUNTS, [0, 0])
    if not ok:
        with pytest.raises(ValueError, match=r"needs fc, k_proj and v_proj stored BF16.*fc="):
            drafter.prefill(params, head, new_state(cfg, B), window, cfg=cfg)
        with pytest.raises(ValueError, match="BF16"):
            drafter.check_prefill_support(params)
        return
    state = drafter.prefill(params, head, new_state(cfg, B), window, cfg=cfg, chunk_size=4)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    want_k, _ = np_tree(drafter.kv_rows(params, head, tokens, hidden, positions, cfg=cfg))
    for b, n in enumerate(COUNTS):
        _bf16_close(held_rows(state, b)[0], want_k[b, :n])


def test_prefill_traces_once(setup):
    cfg, params, head, _, _ = setup
    counted = jax.jit(
        chex.assert_max_traces(P._prefill.__wrapped__, n=1),
        static_argnames=("cfg", "chunk_size", "head_cfg", "implementation"),
        donate_argnames=("state",),
    )
    modules = drafter.DrafterModules(modules=(params,), schedule=drafter.ModuleSchedule.CYCLE)
    before = P._prefill._cache_size()
    rng = np.random.default_rng(2)
    for i in range(3):
        tokens, hidden = random_pairs(rng, (B, T))
        window = pairs(tokens, hidden, [7 - i, 2 + i], [i, 3 * i])
        counted(
            modules, head, new_state(cfg, B), P.check_propose_inputs(new_state(cfg, B), window, cfg, 1),
            cfg=cfg, chunk_size=4, head_cfg=cfg.lm_head_config(),
            implementation=Implementation.AUTO,
        )  # fmt: skip
        drafter.prefill(
            params, head, new_state(cfg, B), window, cfg=cfg, chunk_size=4,
            implementation=("auto", "AUTO", Implementation.AUTO)[i],
        )  # fmt: skip
    assert P._prefill._cache_size() - before <= 1
    chex.clear_trace_counter()


def test_a_count_past_the_window_width_is_refused(setup):
    """A window claiming more pairs than it is wide writes nothing and flags the sequence (its
    neighbour is served); the flag names the reason on the host and clears with free."""
    cfg, params, head, tokens, hidden = setup
    state = drafter.prefill(
        params, head, new_state(cfg, B), pairs(tokens, hidden, [T + 3, 4], [0, 0]), cfg=cfg,
        chunk_size=4,
    )  # fmt: skip
    np.testing.assert_array_equal(state.seq_len[0], [0, 4])
    np.testing.assert_array_equal(state.last_pair_key[0], [-1, 3])
    np.testing.assert_array_equal(
        state.window_error, [int(drafter.WindowError.COUNT_PAST_WIDTH), 0]
    )
    with pytest.raises(kv.KVCacheError, match=r"sequence 0: Pairs\.count exceeds the window width"):
        drafter.raise_on_state_error(state)
    # Sticky: a good window for the flagged sequence is skipped until it is freed.
    state = drafter.prefill(params, head, state, pairs(tokens, hidden, [2, 5], [0, 4]), cfg=cfg)
    np.testing.assert_array_equal(state.seq_len[0], [0, 9])
    state = drafter.free(state, np.asarray([True, True]))
    drafter.raise_on_state_error(state)
    state = drafter.prefill(params, head, state, pairs(tokens, hidden, [2, 5], [0, 0]), cfg=cfg)
    np.testing.assert_array_equal(state.seq_len[0], [2, 5])
