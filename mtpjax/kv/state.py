"""The drafter state: one paged KV cache per drafter module plus the speculative bookkeeping.

A single MTP head is the one-module case. Row keys are sequence positions (the row at key ``i``
holds the pair ``(token_{i+1}, hidden_i)``); a module's keys are ascending but may be sparse, so
they are recorded per row.

Shapes: ``[B]`` sequence slots, ``[N]`` modules, ``[R]`` rows per sequence of a module's pool.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.kv.cache import KVCacheError, PagedKVCache, free, init_cache, raise_on_error, truncate
from mtpjax.kv.pool import PoolConfig


class WindowError(enum.IntFlag):
    """Per-sequence bits of ``DrafterState.window_error``: a ``Pairs`` window the drafter refused.

    Disjoint from ``KVError``'s bits, so ``DrafterState.error`` carries both. A refused window
    writes nothing and drafts nothing; the bit is sticky (the sequence is skipped) until ``free``.
    """

    COUNT_PAST_WIDTH = 1 << 8  # Pairs.count > the window width T
    GAP = 1 << 9  # start > newest held key + 1: the keys in between would be missing
    NOT_FROM_START = 1 << 10  # the first window after `free` does not start at key 0


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kv", "row_keys", "row_tokens", "last_num_drafted", "window_error", "freed"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterState:
    """Attributes:
    kv: one paged KV cache per module (its own pool, allocator and block tables).
    row_keys: per module int32[B, R]: the key of each held row, -1 from ``seq_len`` on.
    row_tokens: int32[B, R] the token of each held row of module 0 (a window whose pair differs
      from a held row rewrites it; see ``mtpjax.drafter.propose``).
    last_num_drafted: int32[B] K of the last ``propose`` (0 after ``after_verify``).
    window_error: int32[B] ``WindowError`` bits (0 = healthy).
    freed: bool[B] the slot was freed and its next window must start at key 0.
    """

    kv: tuple[PagedKVCache, ...]
    row_keys: tuple[jax.Array, ...]
    row_tokens: jax.Array
    last_num_drafted: jax.Array
    window_error: jax.Array
    freed: jax.Array

    @property
    def num_modules(self) -> int:
        return len(self.kv)

    @property
    def num_seqs(self) -> int:
        return self.last_num_drafted.shape[0]

    @property
    def seq_len(self) -> jax.Array:
        """int32[N, B] rows held per module and sequence."""
        return jnp.stack([c.seq_len for c in self.kv])

    @property
    def last_pair_key(self) -> jax.Array:
        """int32[N, B] key of each module's newest row, -1 where it holds none."""
        return jnp.stack([newest_key(k, c.seq_len) for k, c in zip(self.row_keys, self.kv)])

    @property
    def error(self) -> jax.Array:
        """int32[B] every module's ``KVError`` bits and the ``WindowError`` bits (0 = healthy)."""
        error = self.window_error
        for cache in self.kv:
            error = error | cache.error
        return error


def init_state(
    cfg: PoolConfig | tuple[PoolConfig, ...], *, num_seqs: int, num_modules: int = 1
) -> DrafterState:
    """Empty state for ``num_seqs`` slots: ``num_modules`` pools of ``cfg``, or one pool per entry
    of a tuple of ``PoolConfig`` (then ``num_modules`` is not read). A fresh slot's first window may start at any key (a drafter
    joining a sequence late attends to the rows it has)."""
    cfgs = (cfg,) * num_modules if isinstance(cfg, PoolConfig) else tuple(cfg)
    if not cfgs:
        raise ValueError(
            f"a drafter state needs at least one module, got num_modules={num_modules}"
        )
    return DrafterState(
        kv=tuple(init_cache(c, num_seqs=num_seqs) for c in cfgs),
        row_keys=tuple(jnp.full((num_seqs, c.max_rows_per_seq), -1, jnp.int32) for c in cfgs),
        row_tokens=jnp.zeros((num_seqs, cfgs[0].max_rows_per_seq), jnp.int32),
        last_num_drafted=jnp.zeros((num_seqs,), jnp.int32),
        window_error=jnp.zeros((num_seqs,), jnp.int32),
        freed=jnp.zeros((num_seqs,), bool),
    )


def newest_key(keys: jax.Array, length: jax.Array) -> jax.Array:
    """int32[B] key of row ``length - 1`` of keys int32[B, R] (-1 when empty)."""
    last = jnp.take_along_axis(keys, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(length > 0, last, -1)


def put_rows(rows: jax.Array, first: jax.Array, num: jax.Array, values: jax.Array) -> jax.Array:
    """rows int32[B, R] with ``rows[b, first[b] + t] = values[b, t]`` for ``t < num[b]``.

    A select over the rows rather than a scatter, so it fuses with what else touches them."""
    t = jnp.arange(rows.shape[1], dtype=jnp.int32)[None, :] - first[:, None]  # [B, R]
    put = (t >= 0) & (t < num[:, None])
    return jnp.where(put, jnp.take_along_axis(values, jnp.clip(t, 0, values.shape[1] - 1), 1), rows)


def drop_newest(state: DrafterState, num_rows: jax.Array) -> DrafterState:
    """Drops each module's newest ``num_rows[:, m]`` rows (int32[B, N]) of every sequence."""
    kv, keys = [], []
    for m, (cache, k) in enumerate(zip(state.kv, state.row_keys)):
        cache = truncate(cache, num_rows[:, m])
        kv.append(cache)
        keys.append(jnp.where(jnp.arange(k.shape[1])[None, :] < cache.seq_len[:, None], k, -1))
    return dataclasses.replace(state, kv=tuple(kv), row_keys=tuple(keys))


def free_sequences(state: DrafterState, mask: jax.Array) -> DrafterState:
    """Returns every module's blocks of the sequences where ``mask`` bool[B] and resets them (no
    rows, no pending round, no error); their next window must start at key 0."""
    mask = jnp.asarray(mask, bool)
    return DrafterState(
        kv=tuple(free(c, mask) for c in state.kv),
        row_keys=tuple(jnp.where(mask[:, None], -1, k) for k in state.row_keys),
        row_tokens=state.row_tokens,
        last_num_drafted=jnp.where(mask, 0, state.last_num_drafted),
        window_error=jnp.where(mask, 0, state.window_error),
        freed=state.freed | mask,
    )


def raise_on_state_error(state: DrafterState) -> None:
    """Host-side check: raises ``KVCacheError`` naming each sequence whose cache write or window
    was refused, and why."""
    for cache in state.kv:
        raise_on_error(cache)
    error = np.asarray(state.window_error)
    why = {
        WindowError.COUNT_PAST_WIDTH: "Pairs.count exceeds the window width",
        WindowError.GAP: "Pairs.start is past the newest held key + 1",
        WindowError.NOT_FROM_START: "the first window after free must start at key 0",
    }
    problems = [
        f"sequence {b}: " + " and ".join(w for bit, w in why.items() if error[b] & bit)
        for b in np.flatnonzero(error)
    ]
    if problems:
        raise KVCacheError(
            "drafter window refused (nothing written; free the sequence): " + "; ".join(problems)
        )
