"""Paged KV pool, functional block allocator, per-sequence drafter state, and which of its
leaves a jitted step donates (`donation`)."""

from mtpjax.kv.allocator import BlockAllocator, allocate, block_ids, init_allocator, release
from mtpjax.kv.cache import (
    KVCacheError,
    KVError,
    PagedKVCache,
    append,
    free,
    gather,
    init_cache,
    raise_on_error,
    reserve,
    row_address,
    truncate,
)
from mtpjax.kv.pool import (
    KVDtype,
    KVPool,
    PoolConfig,
    init_pool,
    pool_num_blocks,
    quantize_rows_fp8,
    read_rows,
    write_rows,
)
from mtpjax.kv.state import (
    DrafterState,
    WindowError,
    free_sequences,
    init_state,
    raise_on_state_error,
)

__all__ = [
    "BlockAllocator",
    "DrafterState",
    "KVCacheError",
    "KVDtype",
    "KVError",
    "KVPool",
    "PagedKVCache",
    "PoolConfig",
    "WindowError",
    "allocate",
    "append",
    "block_ids",
    "free",
    "free_sequences",
    "gather",
    "init_allocator",
    "init_cache",
    "init_pool",
    "init_state",
    "pool_num_blocks",
    "quantize_rows_fp8",
    "raise_on_error",
    "raise_on_state_error",
    "read_rows",
    "release",
    "reserve",
    "row_address",
    "truncate",
    "write_rows",
]
