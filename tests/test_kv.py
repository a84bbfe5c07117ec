"""Paged KV pool, allocator and drafter state against a plain-Python model of the same cache."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mtpjax import kv

H, D = 2, 4


def _cfg(num_blocks=16, max_blocks_per_seq=4, block_size=4, kv_dtype=kv.KVDtype.BF16):
    return kv.PoolConfig(
        num_kv_heads=H,
        head_dim=D,
        num_blocks=num_blocks,
        max_blocks_per_seq=max_blocks_per_seq,
        block_size=block_size,
        kv_dtype=kv_dtype,
    )


@pytest.mark.parametrize(
    ("max_seq_len", "max_seqs", "block_size", "main", "expected"),
    [
        (4096, 8, 16, None, (4096 // 16 + 1) * 8),
        (100, 3, 16, None, 7 * 3),
        (4096, 8, 16, 1000, 1000),  # capped by the main pool
        (4096, 8, 16, 10, 257),  # never below one sequence's worth
        (4096, 2, 16, 100_000, 514),  # cap above the need: the need wins
        (15, 1, 16, None, 1),
    ],
)
def test_pool_num_blocks_rule(max_seq_len, max_seqs, block_size, main, expected):
    got = kv.pool_num_blocks(
        max_seq_len=max_seq_len, max_seqs=max_seqs, block_size=block_size, main_kv_blocks=main
    )
    assert got == expected


def test_pool_config_is_keyword_only():
    with pytest.raises(TypeError, match=r"^PoolConfig takes keyword arguments only; got 2 "):
        kv.PoolConfig(16, 2)


def test_pool_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        _cfg(block_size=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        kv.pool_num_blocks(max_seq_len=0, max_seqs=1)
    cfg = kv.PoolConfig.for_sequences(num_kv_heads=2, head_dim=8, max_seq_len=64, max_seqs=3)
    assert cfg.max_blocks_per_seq == 5 and cfg.num_blocks == 15 and cfg.max_rows_per_seq == 80


def sequential_grants(num_free: int, counts: list[int | None]) -> list[bool | None]:
    """Reference allocator: the requests one by one, fewest blocks first (ties in index order),
    each granted whole if it fits in what the earlier grants left; a refusal takes nothing.
    A request whose count is None takes no part (its entry stays None)."""
    granted: list[bool | None] = [None] * len(counts)
    asking = [r for r, c in enumerate(counts) if c is not None]
    for r in sorted(asking, key=lambda r: (counts[r], r)):
        granted[r] = counts[r] <= num_free
        num_free -= counts[r] if granted[r] else 0
    return granted


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.lists(st.integers(0, 4), min_size=3, max_size=3)),
            st.tuples(st.just("release"), st.integers(0, 2)),
        ),
        max_size=12,
    )
)
def test_allocator_matches_set_model(ops):
    """Granted requests get distinct free blocks; refusals take nothing; releases come back."""
    num_blocks = 10
    alloc = kv.init_allocator(num_blocks)
    free_set = set(range(num_blocks))
    owned: list[list[int]] = [[], [], []]
    alloc_fn = jax.jit(kv.allocate)
    for op, arg in ops:
        if op == "alloc":
            counts = np.asarray(arg, np.int32)
            new, first, granted = alloc_fn(alloc, counts)
            expected = sequential_grants(len(free_set), counts.tolist())
            for r, c in enumerate(counts):
                expect = expected[r]
                assert bool(granted[r]) == expect
                if c and expect:
                    ids = np.asarray(kv.block_ids(alloc, first[r] + jnp.arange(c))).tolist()
                    assert set(ids) <= free_set
                    free_set -= set(ids)
                    owned[r] += ids
            alloc = new
        else:
            alloc = kv.release(alloc, jnp.asarray(owned[arg] + [-1], jnp.int32))
            free_set |= set(owned[arg])
            owned[arg] = []
        assert int(alloc.num_free) == len(free_set)
        assert set(np.asarray(alloc.free_stack[: int(alloc.num_free)]).tolist()) == free_set


class CacheModel:
    """Reference: each sequence is a Python list of rows."""

    def __init__(self, num_seqs, capacity, num_blocks, block_size):
        self.rows = [[] for _ in range(num_seqs)]
        self.blocks = [0] * num_seqs
        self.error = [0] * num_seqs
        self.capacity, self.free_blocks, self.block_size = capacity, num_blocks, block_size

    def append(self, k, num_new):
        needs: list[int | None] = [None] * len(num_new)
        for b, n in enumerate(num_new):
            if self.error[b]:
                continue
            new_len = len(self.rows[b]) + n
            if new_len > self.capacity:
                self.error[b] |= kv.KVError.CAPACITY_EXCEEDED
                continue
            needs[b] = max(-(-new_len // self.block_size) - self.blocks[b], 0)
        for b, granted in enumerate(sequential_grants(self.free_blocks, needs)):
            if granted is None:
                continue
            if not granted:
                self.error[b] |= kv.KVError.OUT_OF_BLOCKS
                continue
            self.free_blocks -= needs[b]
            self.blocks[b] += needs[b]
            self.rows[b] += [k[b, t] for t in range(num_new[b])]

    def truncate(self, rows):
        for b, r in enumerate(rows):
            del self.rows[b][max(len(self.rows[b]) - r, 0) :]

    def free(self, mask):
        for b, m in enumerate(mask):
            if m:
                self.free_blocks += self.blocks[b]
                self.rows[b], self.blocks[b], self.error[b] = [], 0, 0


@settings(max_examples=25, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(
            st.sampled_from(["append", "truncate", "free"]),
            st.lists(st.integers(0, 5), min_size=3, max_size=3),
        ),
        min_size=1,
        max_size=10,
    ),
    seed=st.integers(0, 2**16),
)
def test_cache_matches_list_model(rounds, seed):
    """Random append / truncate / free rounds: every healthy sequence's rows equal the model's."""
    cfg = _cfg(num_blocks=7, max_blocks_per_seq=4, block_size=4)
    cache = kv.init_cache(cfg, num_seqs=3)
    model = CacheModel(3, cfg.max_rows_per_seq, cfg.num_blocks, cfg.block_size)
    rng = np.random.default_rng(seed)
    append = jax.jit(kv.append)
    for op, arg in rounds:
        if op == "append":
            k = rng.standard_normal((3, 5, H, D)).astype(np.float32)
            k = k.astype(ml_dtypes.bfloat16).astype(np.float32)  # exact in the BF16 pool
            cache, _ = append(cache, k, -k, jnp.asarray(arg, jnp.int32))
            model.append(k, arg)
        elif op == "truncate":
            cache = kv.truncate(cache, jnp.asarray(arg, jnp.int32))
            model.truncate(arg)
        else:
            mask = [a % 2 == 1 for a in arg]
            cache = kv.free(cache, jnp.asarray(mask))
            model.free(mask)
        assert np.asarray(cache.error).tolist() == [int(e) for e in model.error]
        assert int(cache.allocator.num_free) == model.free_blocks
        k_all, v_all, valid = kv.gather(cache, cfg.max_rows_per_seq)
        for b in range(3):
            n = len(model.rows[b])
            assert int(cache.seq_len[b]) == n
            assert np.asarray(valid[b]).sum() == n
            if n:
                np.testing.assert_array_equal(np.asarray(k_all[b, :n]), np.stack(model.rows[b]))
                np.testing.assert_array_equal(np.asarray(v_all[b, :n]), -np.stack(model.rows[b]))
        # No block is owned twice and owned + free = the pool.
        table = np.asarray(cache.block_table)
        owned = table[table >= 0].tolist()
        free_ids = np.asarray(cache.allocator.free_stack[: int(cache.allocator.num_free)]).tolist()
        assert len(set(owned)) == len(owned)
        assert sorted(owned + free_ids) == list(range(cfg.num_blocks))


def test_out_of_blocks_never_corrupts_other_sequences():
    cfg = _cfg(num_blocks=3, max_blocks_per_seq=4, block_size=4)
    cache = kv.init_cache(cfg, num_seqs=2)
    rows = jnp.arange(2 * 8 * H * D, dtype=jnp.float32).reshape(2, 8, H, D)
    cache, ok = kv.append(cache, rows, rows, jnp.asarray([4, 4], jnp.int32))
    assert np.asarray(ok).tolist() == [True, True]
    before_k, _, _ = kv.gather(cache, 4)
    # Sequence 0 needs 2 more blocks, only 1 left: refused; sequence 1 needs none for 0 rows.
    cache, ok = kv.append(cache, rows + 1000, rows, jnp.asarray([8, 0], jnp.int32))
    assert np.asarray(ok).tolist() == [False, True]
    assert int(cache.error[0]) == kv.KVError.OUT_OF_BLOCKS and int(cache.error[1]) == 0
    after_k, _, _ = kv.gather(cache, 4)
    np.testing.assert_array_equal(np.asarray(after_k), np.asarray(before_k))
    assert np.asarray(cache.seq_len).tolist() == [4, 4]
    with pytest.raises(kv.KVCacheError, match=r"sequence 0: out of KV blocks \(pool of 3 blocks"):
        kv.raise_on_error(cache)
    # The error is sticky until the sequence is freed; sequence 1 can still use the last block.
    cache, ok = kv.append(cache, rows, rows, jnp.asarray([1, 4], jnp.int32))
    assert np.asarray(ok).tolist() == [False, True]
    cache = kv.free(cache, jnp.asarray([True, False]))
    kv.raise_on_error(cache)
    assert int(cache.allocator.num_free) == 1


def test_a_refused_sequence_leaves_later_sequences_their_blocks():
    """2 free blocks of 4 rows: asking 12 rows (3 blocks) fails only the asker, in either order."""
    cfg = _cfg(num_blocks=2, max_blocks_per_seq=4, block_size=4)
    rows = jnp.arange(2 * 12 * H * D, dtype=jnp.float32).reshape(2, 12, H, D)
    for num_new, expected in (([12, 4], [False, True]), ([4, 12], [True, False])):
        cache, ok = kv.append(kv.init_cache(cfg, num_seqs=2), rows, rows, jnp.asarray(num_new))
        assert np.asarray(ok).tolist() == expected
        oob = int(kv.KVError.OUT_OF_BLOCKS)
        assert np.asarray(cache.error).tolist() == [0 if g else oob for g in expected]
        assert np.asarray(cache.seq_len).tolist() == [4 if g else 0 for g in expected]
        assert int(cache.allocator.num_free) == 1
        k, _, valid = kv.gather(cache, 4)
        b = expected.index(True)
        assert np.asarray(valid[b]).all()
        np.testing.assert_array_equal(np.asarray(k[b]), np.asarray(rows[b, :4]))
        with pytest.raises(kv.KVCacheError, match=f"sequence {1 - b}: out of KV blocks"):
            kv.raise_on_error(cache)


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 10),
    block_size=st.sampled_from([1, 2, 4]),
    rounds=st.lists(st.lists(st.integers(0, 13), min_size=4, max_size=4), min_size=1, max_size=4),
)
@example(num_blocks=2, block_size=4, rounds=[[12, 4, 0, 0]])
@example(num_blocks=3, block_size=2, rounds=[[2, 6, 2, 0], [0, 0, 3, 1]])
@example(num_blocks=3, block_size=1, rounds=[[3, 1, 0, 2], [1, 1, 1, 1]])
def test_reserve_matches_a_sequential_reference(num_blocks, block_size, rounds):
    """Rounds of `reserve` on a random pool: every sequence's ok, error flag, held blocks and the
    free count equal a plain-Python allocator that serves the sequences one after another."""
    num_seqs = 4
    cfg = _cfg(num_blocks=num_blocks, max_blocks_per_seq=3, block_size=block_size)
    capacity = cfg.max_rows_per_seq
    cache = kv.init_cache(cfg, num_seqs=num_seqs)
    free_blocks, held = num_blocks, [0] * num_seqs
    length, error = [0] * num_seqs, [0] * num_seqs
    for num_new in rounds:
        needs: list[int | None] = [None] * num_seqs
        for b, n in enumerate(num_new):
            if error[b]:
                continue
            if length[b] + n > capacity:
                error[b] |= kv.KVError.CAPACITY_EXCEEDED
                continue
            needs[b] = max(-(-(length[b] + n) // block_size) - held[b], 0)
        expected_ok = []
        for b, granted in enumerate(sequential_grants(free_blocks, needs)):
            if granted:
                free_blocks, held[b] = free_blocks - needs[b], held[b] + needs[b]
                length[b] += num_new[b]
            elif granted is False:
                error[b] |= kv.KVError.OUT_OF_BLOCKS
            expected_ok.append(bool(granted))
        cache, ok = kv.reserve(cache, jnp.asarray(num_new, jnp.int32))
        # reserve only makes room; commit the rows as append would.
        seq_len = cache.seq_len + jnp.where(ok, jnp.asarray(num_new, jnp.int32), 0)
        cache = dataclasses.replace(cache, seq_len=seq_len)
        assert np.asarray(ok).tolist() == expected_ok
        assert np.asarray(cache.error).tolist() == [int(e) for e in error]
        table = np.asarray(cache.block_table)
        assert (table >= 0).sum(axis=1).tolist() == held
        assert int(cache.allocator.num_free) == free_blocks
        owned = table[table >= 0].tolist()
        free_ids = np.asarray(cache.allocator.free_stack[:free_blocks]).tolist()
        assert sorted(owned + free_ids) == list(range(num_blocks))


def test_capacity_exceeded_is_flagged():
    cfg = _cfg(num_blocks=16, max_blocks_per_seq=2, block_size=4)
    cache = kv.init_cache(cfg, num_seqs=2)
    rows = jnp.ones((2, 9, H, D))
    cache, ok = kv.append(cache, rows, rows, jnp.asarray([9, 8], jnp.int32))
    assert np.asarray(ok).tolist() == [False, True]
    assert int(cache.error[0]) == kv.KVError.CAPACITY_EXCEEDED
    with pytest.raises(kv.KVCacheError, match="sequence 0: past its capacity of 8 rows"):
        kv.raise_on_error(cache)


def test_fp8_pool_round_trip_error():
    cfg = _cfg(kv_dtype=kv.KVDtype.FP8)
    cache = kv.init_cache(cfg, num_seqs=1)
    rows = jax.random.normal(jax.random.key(0), (1, 6, H, D)) * 300.0
    cache, _ = kv.append(cache, rows, rows, jnp.asarray([6], jnp.int32))
    k, _, _ = kv.gather(cache, 6)
    ref = np.asarray(rows[0], np.float64)
    amax = np.abs(ref).max(-1, keepdims=True)
    # E4M3 has 3 mantissa bits: relative half-ulp 2^-4 of each element, bounded via the row amax.
    assert np.all(np.abs(np.asarray(k[0]) - ref) <= amax * 2.0**-4 + 1e-6)
    assert cache.pool.k.dtype == jnp.float8_e4m3fn


def test_jitted_steps_trace_once():
    cfg = _cfg()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(cache, k, n):
        cache, _ = kv.append(cache, k, k, n)
        return kv.truncate(cache, n // 2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def alloc_step(alloc, counts):
        return kv.allocate(alloc, counts)

    cache = kv.init_cache(cfg, num_seqs=2)
    alloc = kv.init_allocator(8)
    for i in range(4):
        cache = step(cache, jnp.full((2, 3, H, D), float(i)), jnp.asarray([i % 4, 3 - i % 4]))
        alloc, _, _ = alloc_step(alloc, jnp.asarray([i % 2, 1], jnp.int32))
    chex.clear_trace_counter()
