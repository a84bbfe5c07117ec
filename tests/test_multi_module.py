"""The multi-module proposer: construction, the module schedule, N = 1 against the single head,
N modules against draft_step chained by hand, the row invariant over random rounds against a
from-scratch rebuild, free and tracing.

Compilations are the cost here, so the tests share a few call shapes: N = 3 / CLAMP (asked for 5
drafts, clamped to 3), N = 1 / CYCLE / PINNED against the single head, N = 2 / CYCLE / PRE_NORM.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import (
    H,
    V,
    draft_step,
    held_rows,
    make,
    make_head,
    np_tree,
    pairs,
    pool,
    tiny_cfg,
)
from hypothesis import given, settings

from mtpjax import drafter, kv
from mtpjax import drafter as mm
from mtpjax.config import HiddenContract
from mtpjax.drafter import _propose as P
from mtpjax.drafter import _trim as T

B = 2
MAX_KEYS = 40  # rows per sequence of the test pools (max_seq_len 40, blocks of 4)
BASE = tiny_cfg()  # the single-module config: draft_step / kv_rows / drafter_forward use it
CLAMP, CYCLE = mm.ModuleSchedule.CLAMP, mm.ModuleSchedule.CYCLE


@functools.cache
def _multi(n: int, schedule: mm.ModuleSchedule = CLAMP):
    """(cfg, params, head) for n random modules (module 0 is the single-head tests' head)."""
    cfg = tiny_cfg(num_mtp_modules=n)
    first, _ = make(BASE)
    others = [drafter.init(BASE, key=jax.random.PRNGKey(100 + i)) for i in range(1, n)]
    params = mm.DrafterModules(modules=(first, *others), schedule=schedule)
    return cfg, params, make_head(BASE)


def _state(n: int):
    return mm.init_state(pool(BASE, max_seqs=B), num_seqs=B, num_modules=n)


def _window(tokens, hidden, keys_per_seq, width):
    """Pairs windows holding keys ``keys_per_seq[b]`` (consecutive) of tokens / hidden [B, L]."""
    tok = np.zeros((B, width), np.int32)
    hid = np.zeros((B, width, H), np.float32)
    for b, keys in enumerate(keys_per_seq):
        tok[b, : len(keys)] = [tokens[b][i + 1] for i in keys]
        hid[b, : len(keys)] = np.asarray(hidden[b][keys[0] : keys[-1] + 1], np.float32)
    count = [len(k) for k in keys_per_seq]
    start = [k[0] for k in keys_per_seq]
    return pairs(tok, hid.astype(jnp.bfloat16), count, start), (tok, hid, count, start)


def _assert_rows(got_state, want_state, b, *, exact=True):
    for g, w in zip(held_rows(got_state, b), held_rows(want_state, b)):
        assert g.shape == w.shape
        if exact or not w.size:
            np.testing.assert_array_equal(g, w)
        else:  # one BF16 rounding step apart at most
            np.testing.assert_allclose(g, w, rtol=2**-7, atol=2**-7 * np.abs(w).max())


def _propose(params, head, state, window, cfg, num_drafts=5, **kw):
    """propose_multi with the keyword set every call here shares (one compilation per N)."""
    kw.setdefault("hidden_contract", HiddenContract.POST_NORM)
    return mm.propose(params, head, state, window, cfg=cfg, num_drafts=num_drafts, **kw)


def _verify(state, accepted, refeed=(False, False)):
    return mm.after_verify(state, np.asarray(accepted, np.int32), refeed=np.asarray(refeed, bool))


def _held_keys(state: mm.DrafterState, m: int, b: int) -> list[int]:
    n = int(np.asarray(state.kv[m].seq_len)[b])
    keys = np.asarray(state.row_keys[m])[b]
    assert np.all(keys[n:] == -1)
    return keys[:n].tolist()


# --------------------------------------------------------------------------------------------
# Construction and the schedule.


def test_construction_errors_and_conversions():
    with pytest.raises(ValueError, match="at least one module"):
        mm.DrafterModules(modules=())
    with pytest.raises(ValueError, match="at least one module"):
        mm.init_state(pool(BASE, max_seqs=B), num_seqs=B, num_modules=0)
    with pytest.raises(TypeError, match="ModuleSchedule"):
        mm.DrafterModules(modules=(make(BASE)[0],), schedule="cycle")
    first, _ = make(BASE)
    params = mm.DrafterModules(modules=[first, first])
    assert params.modules == (first, first) and params.schedule is CLAMP
    ckpt = types.SimpleNamespace(modules=[first], head=None)
    assert mm.DrafterModules.from_checkpoint(ckpt, schedule=CYCLE).num_modules == 1
    # The module count is the config's; a mismatch names both and the fix.
    cfg, params3, head = _multi(3)
    with pytest.raises(ValueError, match="num_mtp_modules=1"):
        mm.propose(
            params3, head, _state(3), pairs(np.zeros((B, 2)), np.zeros((B, 2, H)), [1, 1], [0, 0]),
            cfg=BASE, num_drafts=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="3 module states, the drafter 2"):
        cfg2, params2, _ = _multi(2)
        mm.propose(
            params2, head, _state(3), pairs(np.zeros((B, 2)), np.zeros((B, 2, H)), [1, 1], [0, 0]),
            cfg=cfg2, num_drafts=2,
        )  # fmt: skip
    # init_multi: one independent module per cfg.num_mtp_modules.
    made = mm.init_modules(cfg, key=jax.random.PRNGKey(3))
    assert made.num_modules == 3
    for module, key in zip(made.modules, jax.random.split(jax.random.PRNGKey(3), 3)):
        want = drafter.init(BASE, key=key)
        for g, w in zip(jax.tree.leaves(module), jax.tree.leaves(want)):
            np.testing.assert_array_equal(g, w)
    w0, w1 = (np.asarray(m.fc.w, np.float32) for m in made.modules[:2])
    assert not np.array_equal(w0, w1)


def test_effective_num_drafts_clamps_or_cycles():
    assert [mm.effective_num_drafts(3, k, CLAMP) for k in (1, 2, 3, 4, 9)] == [1, 2, 3, 3, 3]
    assert [mm.effective_num_drafts(3, k, CYCLE) for k in (3, 6, 9)] == [3, 6, 9]
    assert mm.effective_num_drafts(1, 5, CYCLE) == 5
    for k in (1, 2, 4, 5):
        with pytest.raises(ValueError, match="multiple of N=3"):
            mm.effective_num_drafts(3, k, CYCLE)
    with pytest.raises(ValueError, match="num_drafts"):
        mm.effective_num_drafts(3, 0, CLAMP)
    # propose_multi refuses the same request before tracing anything.
    cfg, params, head = _multi(2, CYCLE)
    window = pairs(np.zeros((B, 2)), np.zeros((B, 2, H)), [1, 1], [0, 0])
    with pytest.raises(ValueError, match="multiple of N=2"):
        mm.propose(params, head, _state(2), window, cfg=cfg, num_drafts=3)


@pytest.mark.parametrize(
    "n, written, drafted, accepted, refeed, trims",
    [
        # CLAMP, N = 3, K = 3: module m keeps its row iff m <= a (its token d_m is committed).
        (3, [1, 1, 1], 3, 0, False, [0, 1, 1]),
        (3, [1, 1, 1], 3, 1, False, [0, 0, 1]),
        (3, [1, 1, 1], 3, 2, False, [0, 0, 0]),
        (3, [1, 1, 1], 3, 3, True, [0, 0, 0]),  # refeed only concerns module 0 of N = 1
        (3, [1, 1, 0], 2, 0, False, [0, 1, 0]),  # K = 2: module 2 did not run
        (3, [0, 0, 0], 0, 2, True, [0, 0, 0]),  # nothing drafted
        # CYCLE, N = 2, K = 4: module 0 has steps 0, 2 (keeps only its anchor), module 1 steps
        # 1, 3 (keeps those <= a).
        (2, [2, 2], 4, 0, False, [1, 2]),
        (2, [2, 2], 4, 1, False, [1, 1]),
        (2, [2, 2], 4, 3, False, [1, 0]),
        (2, [2, 2], 4, 4, False, [1, 0]),
        # N = 1 is the single head: rows_to_trim(K, min(a + 1, K), refeed).
        (1, [3], 3, 0, False, [2]),
        (1, [3], 3, 1, False, [1]),
        (1, [3], 3, 1, True, [2]),
        (1, [3], 3, 3, False, [0]),
        (1, [3], 3, 3, True, [2]),
    ],
)
def test_module_trims_table(n, written, drafted, accepted, refeed, trims):
    got = mm.module_trims(n, np.asarray([written]), [drafted], [accepted], refeed)
    np.testing.assert_array_equal(got, [trims])
    if n == 1:
        single = drafter.rows_to_trim(drafted, min(accepted + 1, drafted), refeed)
        assert single == trims[0]


# --------------------------------------------------------------------------------------------
# N = 1 is the single head.


def test_one_module_is_the_single_head():
    """CYCLE with N = 1 runs module 0 for every step: the single head, draft for draft and row for
    row, over rounds with random acceptance and refeed (PINNED contract)."""
    cfg, params, head = _multi(1, CYCLE)
    single = params.modules[0]
    K, width = 3, 4
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (B, 30)).tolist()
    target = rng.standard_normal((B, 30, H)).astype(jnp.bfloat16)
    multi_state, single_state = _state(1), drafter.init_state(pool(BASE, max_seqs=B), num_seqs=B)
    n = [4, 6]  # committed tokens t_0..t_n; the anchor is key n-1
    window_keys = [[n[b] - 1] for b in range(B)]  # no prefill: the anchor alone at first
    kw = dict(num_drafts=K, hidden_contract=HiddenContract.PINNED, return_logits=True)
    for accepted, refeed in (([0, 3], [False, True]), ([2, 1], [True, False]), ([3, 0], [0, 0])):
        window, _ = _window(tokens, target, window_keys, width)
        got, multi_state = _propose(params, head, multi_state, window, cfg, **kw)
        want, single_state = drafter.propose(single, head, single_state, window, cfg=BASE, **kw)
        for g, w in zip(jax.tree.leaves(np_tree(got)), jax.tree.leaves(np_tree(want))):
            np.testing.assert_array_equal(g, w)
        for _ in range(2):  # after propose, then after the verify
            module = multi_state
            for field in ("seq_len", "last_pair_key", "last_num_drafted"):
                np.testing.assert_array_equal(getattr(module, field), getattr(single_state, field))
            for b in range(B):
                _assert_rows(module, single_state, b)
                last = int(np.asarray(module.last_pair_key)[0, b])
                held = _held_keys(multi_state, 0, b)
                assert held == list(range(last - len(held) + 1, last + 1))
            a, r = np.asarray(accepted, np.int32), np.asarray(refeed, bool)
            if module.last_num_drafted[0] == 0:
                break
            t_multi, multi_state = _verify(multi_state, a, r)
            t_single, single_state = drafter.after_verify(single_state, a, refeed=r)
            np.testing.assert_array_equal(t_multi[:, 0], t_single[:, 0])
        drafts = np.asarray(got.tokens)
        for b in range(B):
            tokens[b][n[b] + 1 : n[b] + accepted[b] + 1] = drafts[b, : accepted[b]].tolist()
            window_keys[b] = list(range(n[b], n[b] + accepted[b] + 1))
            n[b] += accepted[b] + 1


# --------------------------------------------------------------------------------------------
# N modules against draft_step chained by hand.


def _hand_round(modules, head, states, window, *, K, module_of, contract):
    """One round by draft_step alone: module 0 writes the window's pairs one at a time (all new),
    the last is the anchor; step s >= 1 runs module_of(s) on the previous draft and hidden."""
    tok, hid, count, start = window
    count, start = np.asarray(count), np.asarray(start, np.int32)
    states = list(states)
    anchor = [None] * B
    for t in range(count.max()):
        out, states[0] = draft_step(
            modules[0], head, states[0], tok[:, t], hid[:, t], start + t, cfg=BASE,
            active=t < count,
        )  # fmt: skip
        out = np_tree(out)
        for b in np.flatnonzero(t == count - 1):
            anchor[b] = jax.tree.map(lambda x, b=b: x[b], out)
    out = jax.tree.map(lambda *x: np.stack(x), *anchor)
    anchor_hidden = hid[np.arange(B), count - 1]
    e = start + count - 1
    drafts, probs, handed = [], [], []
    for s in range(K):
        if s > 0:
            out, states[module_of(s)] = draft_step(
                modules[module_of(s)], head, states[module_of(s)], drafts[-1], handed[-1], e + s,
                cfg=BASE, active=np.ones(B, bool),
            )  # fmt: skip
            out = np_tree(out)
        p = np.exp(out.logits - out.logits.max(-1, keepdims=True))
        drafts.append(out.logits.argmax(-1).astype(np.int32))
        probs.append((p / p.sum(-1, keepdims=True)).max(-1))
        handed.append(
            {
                HiddenContract.POST_NORM: out.h_out,
                HiddenContract.PRE_NORM: out.residual,
                HiddenContract.PINNED: anchor_hidden,
            }[contract].astype(np.float32)
        )
    return np.stack(drafts, 1), np.stack(probs, 1), np.stack(handed, 1), states


def _hand_trim(states, trims):
    """Drops trims[m][b] newest rows of hand state m (what after_verify_multi must do)."""
    return [kv.truncate(s, jnp.asarray(t, jnp.int32)) for s, t in zip(states, trims)]


def _two_hand_rounds(n_modules, schedule, K, contract, accepted, want_trims):
    """Two rounds of propose_multi against _hand_round, no prefill (the first window is the
    anchor alone); after each verify the trims must be ``want_trims`` (literal, per test) and
    each module must hold the keys of its steps whose token was committed."""
    cfg, params, head = _multi(n_modules, schedule)
    width = K + 1
    rng = np.random.default_rng(n_modules)
    tokens = rng.integers(0, V, (B, 30)).tolist()
    target = rng.standard_normal((B, 30, H)).astype(jnp.bfloat16)
    state = _state(n_modules)
    hand = [kv.init_cache(pool(BASE, max_seqs=B), num_seqs=B) for _ in range(n_modules)]
    n = [3, 5]
    first_anchor = [n[b] - 1 for b in range(B)]
    window_keys = [[n[b] - 1] for b in range(B)]
    module_of = (lambda s: s) if schedule is CLAMP else (lambda s: s % n_modules)
    kept = [[[] for _ in range(n_modules)] for _ in range(B)]  # keys of kept chain rows
    kw = dict(num_drafts=5 if schedule is CLAMP else K, hidden_contract=contract)
    for rnd in range(2):
        window, raw = _window(tokens, target, window_keys, width)
        out, state = _propose(params, head, state, window, cfg, **kw)
        out = np_tree(out)
        drafts, probs, handed, hand = _hand_round(
            params.modules, head, hand, raw, K=K, module_of=module_of, contract=contract
        )
        assert out.tokens.shape == (B, K)
        np.testing.assert_array_equal(out.tokens, drafts)
        np.testing.assert_allclose(out.probs, probs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.hidden, handed, rtol=1e-4, atol=1e-4)
        for m in range(n_modules):
            np.testing.assert_array_equal(state.kv[m].seq_len, hand[m].seq_len)
            for b in range(B):
                _assert_rows(state.kv[m], hand[m], b, exact=False)
        a = np.asarray(accepted[rnd], np.int32)
        trims, state = _verify(state, a)
        np.testing.assert_array_equal(trims, want_trims[rnd])
        hand = _hand_trim(hand, np.asarray(want_trims[rnd]).T)
        for b in range(B):
            e = n[b] - 1
            for s in range(1, min(a[b], K - 1) + 1):
                if module_of(s) != 0:  # module 0 keeps only the dense run of committed keys
                    kept[b][module_of(s)].append(e + s)
            assert _held_keys(state, 0, b) == list(range(first_anchor[b], e + 1))
            for m in range(n_modules):
                if m:
                    assert _held_keys(state, m, b) == kept[b][m]
                _assert_rows(state.kv[m], hand[m], b, exact=False)
            tokens[b][n[b] + 1 : n[b] + a[b] + 1] = drafts[b, : a[b]].tolist()
            window_keys[b] = list(range(n[b], n[b] + a[b] + 1))
            n[b] += a[b] + 1


def test_three_modules_chain_like_hand_steps():
    """N = 3, CLAMP, 5 drafts asked: 3 drafts, draft s + 1 from module s at key e + s, and module m
    keeps its row iff m <= a, over two rounds (the second attends to the rows the first kept)."""
    accepted = ([1, 2], [0, 3])
    trims = ([[0, 0, 1], [0, 0, 0]], [[0, 1, 1], [0, 0, 0]])
    _two_hand_rounds(3, CLAMP, 3, HiddenContract.POST_NORM, accepted, trims)


def test_modules_cycle_with_the_reuse_rule():
    """N = 2, CYCLE, K = 4: steps run modules 0, 1, 0, 1; module 0 keeps only its anchor (the next
    window rewrites the keys after it), module 1 keeps its steps <= a (PRE_NORM contract)."""
    accepted = ([3, 1], [0, 4])
    trims = ([[1, 0], [1, 1]], [[1, 2], [1, 0]])
    _two_hand_rounds(2, CYCLE, 4, HiddenContract.PRE_NORM, accepted, trims)


# --------------------------------------------------------------------------------------------
# The invariant: every module's rows against a from-scratch rebuild, over random rounds.

K3 = 3  # N = 3 modules, CLAMP: 5 drafts asked, 3 made
PAD = 48  # rebuild width (> any key count here); padding rows sit at positions >= 1000


@jax.jit
def _rebuild_module(module, head, tokens, hidden, positions):
    """Rows (k, v) and h_out of one module over pairs [B, PAD] at positions [B, PAD]."""
    k, v = drafter.kv_rows(module, head, tokens, hidden, positions, cfg=BASE)
    out = drafter.drafter_forward(module, head, tokens, hidden, cfg=BASE, positions=positions)
    return k, v, out.h_out


def _rebuild(params, head, tokens, target, keys):
    """Each module's rows from scratch (POST_NORM): module 0 over (t_{i+1}, h_i); module m over
    (t_{i+1}, h_out of module m-1's forward at key i-1 over its rows at keys <= i-1)."""
    rows, prev = [], None
    for m, module in enumerate(params.modules):
        tok = np.zeros((B, PAD), np.int32)
        hid = np.zeros((B, PAD, H), np.float32)
        pos = np.broadcast_to(1000 + np.arange(PAD, dtype=np.int32), (B, PAD)).copy()
        for b in range(B):
            ks = keys[b][m]
            tok[b, : len(ks)] = [tokens[b][i + 1] for i in ks]
            pos[b, : len(ks)] = ks
            for j, i in enumerate(ks):
                if m == 0:
                    hid[b, j] = np.asarray(target[b, i], np.float32)
                else:
                    prev_keys, prev_h = prev[b]
                    assert i - 1 in prev_keys, f"module {m} row {i} without module {m - 1} row"
                    hid[b, j] = prev_h[prev_keys.index(i - 1)]
        k, v, h_out = np_tree(_rebuild_module(module, head, tok, hid, pos))
        rows.append([(k[b, : len(keys[b][m])], v[b, : len(keys[b][m])]) for b in range(B)])
        prev = [(keys[b][m], h_out[b]) for b in range(B)]
    return rows


def _check_invariant(params, head, state, tokens, target, keys):
    want = _rebuild(params, head, tokens, target, keys)
    for m in range(len(params.modules)):
        for b in range(B):
            assert _held_keys(state, m, b) == keys[b][m], (m, b)
            got = held_rows(state, b, m)
            for g, w in zip(got, want[m][b]):
                assert g.shape == w.shape
                if not w.size:
                    continue
                # BF16 storage, and hidden taken from attention over BF16 rows: a few roundings.
                np.testing.assert_allclose(g, w, rtol=2**-7, atol=2**-7 * np.abs(w).max())


@functools.cache
def _invariant_setup():
    return _multi(3, CLAMP)


@settings(max_examples=5, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    prompt_lens=st.tuples(st.integers(2, 7), st.integers(2, 7)),
    rounds=st.lists(
        st.tuples(
            st.tuples(st.integers(0, K3), st.integers(0, K3)),  # drafts accepted per sequence
            st.booleans(),  # verified (else proposed again, as if all rejected)
            st.tuples(st.booleans(), st.booleans()),  # refeed: no effect with N = 3
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_rows_equal_a_rebuild_after_random_rounds(seed, prompt_lens, rounds):
    cfg, params, head = _invariant_setup()
    rng = np.random.default_rng(seed)
    target = rng.standard_normal((B, MAX_KEYS + K3, H)).astype(jnp.bfloat16)
    tokens = [rng.integers(0, V, n + 1).tolist() for n in prompt_lens]  # t_0..t_n
    # Prefill keys 0..n-2 into module 0; the anchor goes to propose.
    state = _state(3)
    tok = np.zeros((B, 7), np.int32)
    for b, t in enumerate(tokens):
        tok[b, : len(t) - 2] = t[1:-1]
    state = mm.prefill(
        params, head, state, pairs(tok, target[:, :7], [n - 1 for n in prompt_lens], [0, 0]),
        cfg=cfg, chunk_size=4,
    )  # fmt: skip
    keys = [[list(range(n - 1)), [], []] for n in prompt_lens]
    _check_invariant(params, head, state, tokens, target, keys)
    window_keys = [[n - 1] for n in prompt_lens]
    for accepted, verified, refeed in rounds:
        window, _ = _window(tokens, target, window_keys, K3 + 1)
        out, state = _propose(params, head, state, window, cfg)
        mm.raise_on_state_error(state)
        drafts = np.asarray(out.tokens)
        assert drafts.shape == (B, K3)
        pending = []
        for b in range(B):
            e = len(tokens[b]) - 2
            keys[b][0] = list(range(keys[b][0][0] if keys[b][0] else e, e + 1))
            for m in (1, 2):
                keys[b][m].append(e + m)
            pending.append(tokens[b] + drafts[b, : K3 - 1].tolist())
        _check_invariant(params, head, state, pending, target, keys)
        for b in range(B):
            e = len(tokens[b]) - 2
            a = accepted[b] if verified else 0
            keys[b][1:] = [[i for i in keys[b][m] if i != e + m or m <= a] for m in (1, 2)]
        if not verified:
            continue  # the next propose drops the round's rows itself
        _, state = _verify(state, accepted, refeed)
        for b in range(B):
            a = accepted[b]
            window_keys[b] = list(range(len(tokens[b]) - 1, len(tokens[b]) + a))
            tokens[b] += [*drafts[b, :a].tolist(), int(rng.integers(0, V))]
        _check_invariant(params, head, state, tokens, target, keys)


# --------------------------------------------------------------------------------------------
# free, rewinds and tracing.


def _drafted_three_module_state():
    cfg, params, head = _invariant_setup()
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, V, (B, 12)).tolist()
    target = rng.standard_normal((B, 12, H)).astype(jnp.bfloat16)
    state = _state(3)
    tok = np.zeros((B, 7), np.int32)
    tok[:, :6] = np.asarray(tokens)[:, 1:7]
    state = mm.prefill(
        params, head, state, pairs(tok, target[:, :7], [6, 4], [0, 0]), cfg=cfg, chunk_size=4
    )
    window, _ = _window(tokens, target, [[6], [4]], K3 + 1)
    return cfg, params, head, tokens, target, state, window


def test_free_returns_every_modules_blocks():
    cfg, params, head, _, _, state, window = _drafted_three_module_state()
    _, state = _propose(params, head, state, window, cfg)
    _, state = _verify(state, [2, 1])
    total = [int(c.allocator.num_blocks) for c in state.kv]
    held = [np.sum(np.asarray(c.block_table) >= 0, axis=1) for c in state.kv]
    assert all(h[0] > 0 for h in held)  # every module holds blocks for sequence 0
    state = mm.free(state, np.asarray([True, False]))
    for m, cache in enumerate(state.kv):
        assert int(cache.allocator.num_free) == total[m] - held[m][1]
        assert np.all(np.asarray(cache.block_table[0]) == -1)
        assert int(cache.seq_len[0]) == 0 and int(state.last_pair_key[m, 0]) == -1
        assert _held_keys(state, m, 0) == []
    state = mm.free(state, np.asarray([False, True]))
    for m, cache in enumerate(state.kv):
        assert int(cache.allocator.num_free) == total[m]
    np.testing.assert_array_equal(state.last_num_drafted, [0, 0])


def test_rewind_and_unverified_rounds():
    """A propose never verified counts as a full reject; a window ending before the held rows
    drops every module's rows past its anchor."""
    cfg, params, head, tokens, target, state, window = _drafted_three_module_state()
    first, state = _propose(params, head, state, window, cfg)
    _, state = _verify(state, [2, 2])
    assert [_held_keys(state, m, 0) for m in (1, 2)] == [[7], [8]]
    # Propose from the next window, then again (unverified) from the same window: same drafts.
    drafts = np.asarray(first.tokens)
    tokens = [
        t[: n + 1] + drafts[b, :2].tolist() + [3] for b, (t, n) in enumerate(zip(tokens, [7, 5]))
    ]
    nxt, _ = _window(tokens, target, [[7, 8, 9], [5, 6, 7]], K3 + 1)
    again = []
    for _ in range(2):
        out, state = _propose(params, head, state, nxt, cfg)
        again.append(np.asarray(out.tokens))
        assert [_held_keys(state, m, 0) for m in (1, 2)] == [[7, 10], [8, 11]]
    np.testing.assert_array_equal(again[0], again[1])
    # Rewind sequence 0 to anchor key 7 (sequence 1 sits out): rows past key 7 go everywhere.
    back, _ = _window(tokens, target, [[7], [7]], K3 + 1)
    back = dataclasses.replace(back, count=jnp.asarray([1, 0], jnp.int32))
    out, state = _propose(params, head, state, back, cfg)
    assert _held_keys(state, 0, 0) == list(range(8))
    assert [_held_keys(state, m, 0) for m in (1, 2)] == [[7, 8], [9]]  # key 8 held t_9
    np.testing.assert_array_equal(out.num_valid, [K3, 0])


def test_public_steps_trace_once():
    cfg, params, head, _, target, state, _ = _drafted_three_module_state()
    steps = (P._propose, T._after_verify, T._free, P._prefill)
    sizes = [f._cache_size() for f in steps]
    rng = np.random.default_rng(4)
    for i in range(3):
        tok = rng.integers(0, V, (B, 7)).astype(np.int32)
        state = mm.prefill(
            params, head, state, pairs(tok, target[:, :7], [i + 1, 3 - i], [8 + i, 6]),
            cfg=cfg, chunk_size=4,
        )  # fmt: skip
        win = pairs(tok[:, :4], target[:, :4], [1 + i, 3 - i], [9 + i, 7 + i])
        _, state = _propose(params, head, state, win, cfg)
        _, state = _verify(state, [i, 3 - i], [i == 1, True])
        state = mm.free(state, np.asarray([i == 2, False]))
    for f, size in zip(steps, sizes):
        assert f._cache_size() - size <= 1, f


def test_the_verify_step_trims_a_multi_module_state():
    """mtpjax.verify.verify takes the multi-module state as it is and trims it like
    after_verify_multi for the drafts it accepted."""
    from mtpjax.verify import verify

    cfg, params, head, _, _, state, window = _drafted_three_module_state()
    drafts, state = _propose(params, head, state, window, cfg)
    reference = jax.tree.map(jnp.copy, state)
    # Target hidden whose argmax accepts the first draft of sequence 0 only: the LM head row of
    # d_1 scaled up is a hidden the head maps to d_1 (random rows elsewhere).
    rng = np.random.default_rng(2)
    target_hidden = rng.standard_normal((B, K3 + 1, H)).astype(np.float32)
    weight = np.asarray(jax.jit(lambda w: w.w.astype(jnp.float32))(head.weight))
    target_hidden[0, 0] = 50.0 * weight[int(drafts.tokens[0, 0])]
    out, state = verify(head, state, target_hidden, drafts, cfg=cfg.lm_head_config())
    accepted = np.asarray(out.num_accepted)
    assert accepted[0] >= 1
    _, want = _verify(reference, accepted)
    for g, w in zip(jax.tree.leaves(np_tree(state)), jax.tree.leaves(np_tree(want))):
        np.testing.assert_array_equal(g, w)


def test_single_head_entry_points_serve_multi_module_drafters():
    """propose / prefill / after_verify / free / verify take a multi-module drafter unchanged."""
    from mtpjax.verify import verify

    cfg, params, head = _multi(3)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, V, (B, 12)).astype(np.int32)
    hidden = rng.standard_normal((B, 12, H)).astype(np.float32)
    window, _ = _window(tokens, hidden, [range(0, 6), range(0, 4)], 8)
    clone = jax.jit(lambda t: jax.tree.map(jnp.copy, t))

    s0 = _state(3)
    via_entry = drafter.prefill(params, head, clone(s0), window, cfg=cfg)
    direct = mm.prefill(params, head, clone(s0), window, cfg=cfg, implementation="XLA")
    for a, b in zip(jax.tree.leaves(via_entry), jax.tree.leaves(direct)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    anchor, _ = _window(tokens, hidden, [range(6, 7), range(4, 5)], 8)
    out, s1 = drafter.propose(params, head, clone(via_entry), anchor, cfg=cfg, num_drafts=5)
    ref, _ = _propose(params, head, clone(via_entry), anchor, cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.tokens.shape == (B, 3)  # clamped to the module count

    target_hidden = jnp.asarray(rng.standard_normal((B, 4, H)), jnp.float32)
    verified, s2 = verify(head, clone(s1), target_hidden, out, cfg=cfg.lm_head_config())
    accepted = _accepted_by_verify(head, target_hidden, out, cfg)
    _, s2_ref = drafter.after_verify(clone(s1), accepted)
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(s2_ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(verified.metrics.num_drafts) == B

    freed = drafter.free(s2, jnp.asarray([True, False]))
    assert int(np.asarray(freed.seq_len)[:, 0].sum()) == 0
    assert np.all(np.asarray(freed.seq_len)[:, 1] == np.asarray(s2_ref.seq_len)[:, 1])


def _accepted_by_verify(head, target_hidden, drafts, cfg):
    from mtpjax import accept
    from mtpjax.head import lm_head

    logits = lm_head(head, target_hidden, cfg=cfg.lm_head_config())
    return accept(
        drafts.tokens, None, logits, temperature=0.0, num_valid=drafts.num_valid
    ).num_accepted
