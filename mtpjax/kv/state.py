"""Per-sequence drafter state: the paged KV cache plus the speculative bookkeeping.

Shapes: `[B]` sequence slots.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mtpjax.kv.cache import PagedKVCache, free, init_cache
from mtpjax.kv.pool import PoolConfig


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kv", "last_pair_key", "last_num_drafted"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterState:
    """Attributes:
    kv: the drafter's paged KV cache (one row per pair `(token_{i+1}, hidden_i)`).
    last_pair_key: int32[B] sequence position of the newest row, -1 for none.
    last_num_drafted: int32[B] drafts proposed in the last round (for `after_verify`).
    """

    kv: PagedKVCache
    last_pair_key: jax.Array
    last_num_drafted: jax.Array

    @property
    def seq_len(self) -> jax.Array:
        return self.kv.seq_len

    @property
    def block_table(self) -> jax.Array:
        return self.kv.block_table

    @property
    def num_seqs(self) -> int:
        return self.kv.seq_len.shape[0]


def init_state(cfg: PoolConfig, *, num_seqs: int) -> DrafterState:
    """A state with `num_seqs` empty sequence slots."""
    return DrafterState(
        kv=init_cache(cfg, num_seqs=num_seqs),
        last_pair_key=jnp.full((num_seqs,), -1, jnp.int32),
        last_num_drafted=jnp.zeros((num_seqs,), jnp.int32),
    )


def free_sequences(state: DrafterState, mask: jax.Array) -> DrafterState:
    """Releases the blocks of the sequences where `mask[b]` and resets their bookkeeping."""
    mask = jnp.asarray(mask, bool)
    return DrafterState(
        kv=free(state.kv, mask),
        last_pair_key=jnp.where(mask, -1, state.last_pair_key),
        last_num_drafted=jnp.where(mask, 0, state.last_num_drafted),
    )
