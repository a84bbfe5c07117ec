"""One layer of parameters stacked over layers, for the body of a ``lax.scan`` over layers."""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels import StackedWeight, Weight


def layer_of(params: Any, index: jax.Array) -> Any:
    """Layer ``index`` (int32[], traced) of a pytree whose every leaf has a leading [L] axis.

    Each stacked ``[L, N, K]`` weight becomes a ``StackedWeight``, which ``linear``'s kernels
    read in place: a scan that takes its layers' weights as scanned inputs makes XLA:GPU copy
    each layer's weights to fresh buffers before every custom call, as many bytes again as
    the step reads. Every other leaf (norm scales, conv kernels, MoE expert stacks
    ``[L, E, N, K]``) is sliced.
    """

    def take(leaf):
        if isinstance(leaf, Weight) and len(leaf.shape) == 3:
            return StackedWeight(stack=leaf, index=index)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, False), leaf)

    return jax.tree.map(take, params, is_leaf=lambda x: isinstance(x, Weight))
