"""Device copies of the small host values the steps' wrappers pass on every call.

A NumPy or Python value handed to a jitted step is copied to the device on each call: on a GPU,
a host-to-device transfer the program waits for, tens of µs of a call that is otherwise a few
hundred. The values the wrappers fill in repeat from call to call (greedy's temperature 0, a
``refeed`` flag, an all-active mask), so each distinct one is made on the device once and
reused; no step donates them. Under a trace (a wrapper called inside a caller's jit or
shard_map) they stay NumPy values, constants of the program being traced: a device array made
there would carry that trace's mesh into later calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# jax is pinned; whether a trace is active has no public API in it.
from jax._src.core import trace_state_clean


@functools.lru_cache(maxsize=256)
def _device_full(shape: tuple[int, ...], value, dtype: str) -> jax.Array:
    return jnp.full(shape, value, dtype)


def full(shape: tuple[int, ...], value: bool | int | float, dtype: str) -> jax.Array | np.ndarray:
    """An array of ``shape`` filled with ``value`` as ``dtype`` (a NumPy dtype name): on the
    device, made once per triple, outside traces; a NumPy array under one."""
    if not trace_state_clean():
        return np.full(shape, value, dtype)
    return _device_full(shape, value, dtype)


def scalar(value: bool | int | float, dtype: str) -> jax.Array | np.ndarray:
    """``full((), value, dtype)``."""
    return full((), value, dtype)


def as_int32(x) -> jax.Array:
    """``x`` as int32, without a device op (or a copy) when it already is one."""
    if isinstance(x, jax.Array) and x.dtype == jnp.int32:
        return x
    return jnp.asarray(x, jnp.int32)
