"""Paged KV cache: a pool, its allocator and the per-sequence block tables, as one pytree.

Every operation is a pure function that returns a new cache; inside `jit` the pool buffers are
updated in place when the caller donates them. Failures never touch another sequence: a
sequence that runs out of blocks or past its capacity has its rows dropped, keeps its old
length and gets a sticky error flag that `raise_on_error` turns into a clear message on the
host (the flag clears only when the sequence is freed).

Shapes: `[B]` sequences, `[M]` block-table width (max blocks per sequence), `[T]` rows offered
per sequence in one append, `[H]` KV heads, `[D]` head dim, `[S]` block size.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.kv.allocator import BlockAllocator, allocate, block_ids, init_allocator, release
from mtpjax.kv.pool import KVPool, PoolConfig, init_pool, read_rows, write_rows


class KVError(enum.IntFlag):
    """Per-sequence error bits held in `PagedKVCache.error`."""

    OUT_OF_BLOCKS = 1
    CAPACITY_EXCEEDED = 2


class KVCacheError(RuntimeError):
    """Raised on the host when a sequence's cache write failed."""


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["pool", "allocator", "block_table", "seq_len", "error"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKVCache:
    """Attributes:
    pool: the KV storage.
    allocator: free list of pool blocks.
    block_table: int32[B, M] pool block of each logical block, -1 where none.
    seq_len: int32[B] rows written per sequence.
    error: int32[B] `KVError` bits (0 = healthy).
    """

    pool: KVPool
    allocator: BlockAllocator
    block_table: jax.Array
    seq_len: jax.Array
    error: jax.Array

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def max_rows_per_seq(self) -> int:
        return self.block_table.shape[1] * self.pool.block_size


def init_cache(cfg: PoolConfig, *, num_seqs: int) -> PagedKVCache:
    """An empty cache for `num_seqs` sequence slots over a fresh pool."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    return PagedKVCache(
        pool=init_pool(cfg),
        allocator=init_allocator(cfg.num_blocks),
        block_table=jnp.full((num_seqs, cfg.max_blocks_per_seq), -1, jnp.int32),
        seq_len=jnp.zeros((num_seqs,), jnp.int32),
        error=jnp.zeros((num_seqs,), jnp.int32),
    )


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def reserve(cache: PagedKVCache, num_new: jax.Array) -> tuple[PagedKVCache, jax.Array]:
    """Makes room for `num_new[b]` more rows per sequence, allocating blocks as needed.

    Returns the new cache and `ok` bool[B]: whether sequence b may write its rows. Sequences
    that already carry an error, or would exceed their capacity, or cannot get blocks, are not
    ok; their flag is set and their table is unchanged. Blocks go to the sequences fewest new
    blocks first (ties in index order, see `allocate`) and a refused sequence takes none, so one
    sequence's failure never changes another's outcome.
    """
    num_new = jnp.asarray(num_new, jnp.int32)
    S = cache.block_size
    M = cache.block_table.shape[1]
    new_len = cache.seq_len + num_new
    fits = new_len <= cache.max_rows_per_seq
    healthy = cache.error == 0
    held = jnp.sum(cache.block_table >= 0, axis=1, dtype=jnp.int32)
    need = jnp.where(fits & healthy, jnp.maximum(_cdiv(new_len, S) - held, 0), 0)
    allocator, first, granted = allocate(cache.allocator, need)
    ok = fits & healthy & granted
    # Table slot m of sequence b receives the (m - held[b])-th of its new blocks.
    j = jnp.arange(M, dtype=jnp.int32)[None, :] - held[:, None]
    fresh = (j >= 0) & (j < need[:, None]) & ok[:, None]
    ids = block_ids(cache.allocator, first[:, None] + j)
    block_table = jnp.where(fresh, ids, cache.block_table)
    # Blocks handed to a refused request cannot exist (allocate grants whole requests only), so
    # the allocator needs no roll-back.
    error = cache.error
    error = error | jnp.where(healthy & ~fits, int(KVError.CAPACITY_EXCEEDED), 0)
    error = error | jnp.where(healthy & fits & ~granted, int(KVError.OUT_OF_BLOCKS), 0)
    return (
        dataclasses.replace(cache, allocator=allocator, block_table=block_table, error=error),
        ok,
    )


def row_address(cache: PagedKVCache, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(block, slot) of rows `positions[b, ...]` of each sequence; unheld rows map to block P."""
    S = cache.block_size
    logical = jnp.clip(positions // S, 0, cache.block_table.shape[1] - 1)
    block = jnp.take_along_axis(
        cache.block_table, logical.reshape(positions.shape[0], -1), axis=1
    ).reshape(positions.shape)
    held = (block >= 0) & (positions >= 0) & (positions < cache.max_rows_per_seq)
    block = jnp.where(held, block, cache.pool.num_blocks)
    return block, positions % S


def append(
    cache: PagedKVCache, k: jax.Array, v: jax.Array | None, num_new: jax.Array
) -> tuple[PagedKVCache, jax.Array]:
    """Appends rows `k[b, :num_new[b]]`, `v[b, :num_new[b]]` to each sequence.

    Args:
      k, v: [B, T, H, D] candidate rows (rows t >= num_new[b] are ignored); v is None for a
        latent pool (MLA: the value is the key row's leading `value_dim` dims).
      num_new: int32[B] rows to append, 0 <= num_new <= T.

    Returns:
      (new cache, `ok` bool[B]); a sequence that is not ok wrote nothing (see `reserve`).
    """
    B, T = k.shape[:2]
    cache, ok = reserve(cache, num_new)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = cache.seq_len[:, None] + t
    block, slot = row_address(cache, positions)
    write = ok[:, None] & (t < num_new[:, None])
    block = jnp.where(write, block, cache.pool.num_blocks)
    pool = write_rows(
        cache.pool,
        block.reshape(-1),
        slot.reshape(-1),
        k.reshape(B * T, *k.shape[2:]),
        None if v is None else v.reshape(B * T, *v.shape[2:]),
    )
    seq_len = cache.seq_len + jnp.where(ok, num_new, 0)
    return dataclasses.replace(cache, pool=pool, seq_len=seq_len), ok


def truncate(cache: PagedKVCache, num_rows: jax.Array) -> PagedKVCache:
    """Drops the newest `num_rows[b]` rows of each sequence (clamped at 0).

    The blocks stay with the sequence: the rows are rewritten on the next append.
    """
    seq_len = jnp.maximum(cache.seq_len - jnp.asarray(num_rows, jnp.int32), 0)
    return dataclasses.replace(cache, seq_len=seq_len)


def free(cache: PagedKVCache, mask: jax.Array) -> PagedKVCache:
    """Returns every block of the sequences where `mask[b]` to the allocator and resets them."""
    mask = jnp.asarray(mask, bool)
    returned = jnp.where(mask[:, None], cache.block_table, -1)
    return dataclasses.replace(
        cache,
        allocator=release(cache.allocator, returned),
        block_table=jnp.where(mask[:, None], -1, cache.block_table),
        seq_len=jnp.where(mask, 0, cache.seq_len),
        error=jnp.where(mask, 0, cache.error),
    )


def gather(cache: PagedKVCache, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dense view of each sequence's first `length` rows, dequantised.

    Returns k, v: f32[B, length, H, D] (v of a latent pool: k's first `value_dim` dims) and
    valid: bool[B, length] (row < seq_len). Rows past a sequence's length hold whatever the pool
    has; mask them with `valid`.
    """
    B = cache.block_table.shape[0]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (B, length))
    block, slot = row_address(cache, positions)
    block = jnp.minimum(block, cache.pool.num_blocks - 1)
    k, v = read_rows(cache.pool, block, slot)
    return k, v, positions < cache.seq_len[:, None]


def raise_on_error(cache: PagedKVCache) -> None:
    """Host-side check: raises `KVCacheError` naming each failed sequence and why."""
    error = np.asarray(cache.error)
    if not error.any():
        return
    problems = []
    for b in np.flatnonzero(error):
        reasons = []
        if error[b] & KVError.OUT_OF_BLOCKS:
            reasons.append(
                f"out of KV blocks (pool of {cache.pool.num_blocks} blocks, "
                f"{int(cache.allocator.num_free)} free)"
            )
        if error[b] & KVError.CAPACITY_EXCEEDED:
            reasons.append(f"past its capacity of {cache.max_rows_per_seq} rows")
        problems.append(f"sequence {b}: " + " and ".join(reasons))
    raise KVCacheError(
        "KV cache write refused; the affected sequences kept their previous rows and must be "
        "freed: " + "; ".join(problems)
    )
