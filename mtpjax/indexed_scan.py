"""``lax.scan`` over an index that is carried, not scanned: what the layer stacks and the draft
chain loop over.

A scan over ``jnp.arange(n)`` reads its index with a dynamic slice per iteration, which XLA:GPU
runs as a dynamic-slice thunk of its own (a launch per iteration); a while loop holding such a
thunk cannot become a node of a CUDA graph (XLA's command buffers), and neither can any loop
around it, such as ``generate``'s decode loop. An index carried and incremented is a plain loop
variable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def indexed_scan(body: Callable, carry: Any, length: int, *, start: int = 0) -> tuple[Any, Any]:
    """``body(carry, i) -> (carry, y)`` for ``i = start .. start + length - 1`` (int32[],
    traced), as ``lax.scan`` over those indices: returns ``(carry, ys)``, ys stacked [length]."""

    def step(c, _):
        inner, i = c
        inner, y = body(inner, i)
        return (inner, i + 1), y

    (carry, _), ys = jax.lax.scan(step, (carry, jnp.int32(start)), length=length)
    return carry, ys
