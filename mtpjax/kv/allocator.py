"""A functional block allocator that runs inside `jit`.

The free list is a stack: `free_stack[:num_free]` holds the ids of free blocks. Allocation pops
from the top, release pushes back. Both are vectorised over a batch of requests, so a whole
batch of sequences crossing a block boundary costs one scatter, and neither ever recompiles
for new values.

Shapes: `[P]` blocks in the pool, `[R]` requests in one call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["free_stack", "num_free"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockAllocator:
    """Free-list of pool blocks.

    Attributes:
      free_stack: int32[P]; entries `[:num_free]` are the free block ids, the rest is stale.
      num_free: int32[] number of free blocks.
    """

    free_stack: jax.Array
    num_free: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.free_stack.shape[0]


def init_allocator(num_blocks: int) -> BlockAllocator:
    """All `num_blocks` blocks free; lower ids are handed out first."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return BlockAllocator(
        free_stack=jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32),
        num_free=jnp.asarray(num_blocks, jnp.int32),
    )


def allocate(
    alloc: BlockAllocator, counts: jax.Array
) -> tuple[BlockAllocator, jax.Array, jax.Array]:
    """Hands out `counts[r]` blocks to request `r`, each request whole or not at all.

    Requests are served one by one, smallest first (ties in request order), each from the blocks
    the earlier grants left. In that order the grants are a prefix: a request that does not fit
    leaves every later one, which is no smaller, not fitting either. So the blocks handed out
    before each request (the counts of the requests that precede it in that order) decide them
    all without a loop or a sort over R, and a refused request takes nothing: it never changes
    what another request gets. The precedence is an [R, R] comparison: R is the number of
    sequences, so it stays one small elementwise pass.

    Args:
      alloc: the allocator.
      counts: int32[R] blocks wanted per request (>= 0).

    Returns:
      (new allocator, `first` int32[R], `granted` bool[R]). Request r's blocks are
      `taken(first[r] + j)` for j < counts[r]; use `block_ids` to read them.
    """
    counts = jnp.asarray(counts, jnp.int32)
    mine, other = counts[:, None], counts[None, :]  # [R, 1], [1, R]
    index = jnp.arange(counts.shape[0])
    precedes = (other < mine) | ((other == mine) & (index[None, :] < index[:, None]))  # [R, R]
    first = jnp.sum(jnp.where(precedes, other, 0), axis=1, dtype=jnp.int32)
    ends = first + counts
    granted = ends <= alloc.num_free
    total = jnp.max(jnp.where(granted, ends, 0), initial=0)  # the end of the granted prefix
    return (
        BlockAllocator(free_stack=alloc.free_stack, num_free=alloc.num_free - total),
        first,
        granted,
    )


def block_ids(alloc_before: BlockAllocator, offsets: jax.Array) -> jax.Array:
    """Ids of the blocks at allocation offsets (0 = the first block popped). int32, same shape."""
    index = alloc_before.num_free - 1 - offsets
    return alloc_before.free_stack[jnp.clip(index, 0, alloc_before.num_blocks - 1)]


def release(alloc: BlockAllocator, blocks: jax.Array) -> BlockAllocator:
    """Returns blocks to the free list.

    Args:
      blocks: int32[...] block ids; negative entries are ignored (unused table slots).
    """
    blocks = blocks.reshape(-1)
    valid = blocks >= 0
    slot = alloc.num_free + jnp.cumsum(valid) - 1
    slot = jnp.where(valid, slot, alloc.num_blocks)  # out of range: dropped by the scatter
    free_stack = alloc.free_stack.at[slot].set(blocks, mode="drop")
    return BlockAllocator(
        free_stack=free_stack, num_free=alloc.num_free + jnp.sum(valid, dtype=jnp.int32)
    )
