"""Static draft trees: the shape a tree-drafting round drafts and verifies, and the ancestry
arithmetic the targets derive their tree masks from.

A ``TreeShape`` with branching ``(k_1, .., k_D)`` has one root (the newest committed token
``t_n``), ``k_1`` children of the root, ``k_2`` children of each of those, and so on to depth D:
level ``d`` holds ``n_d = k_1 * .. * k_d`` nodes and the tree ``S = 1 + n_1 + .. + n_D`` rows.
Nodes are numbered breadth first: the root is node 0, level ``d`` takes the next ``n_d``
numbers, parent-major (the children of a level's node ``c`` are ``k_{d+1}`` consecutive nodes,
in the drafter's rank order). So ``parents[i] < i`` and every level is contiguous; the chain
of K drafts is the tree ``(1,) * K``.

Verify window: row ``i`` of the target's tree step holds node ``i``'s token at position
``start + depth[i]`` and attends to the committed positions and to its ancestors (itself
included) only.

Shapes: ``[S]`` tree rows (root included), ``[D]`` depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TreeShape", "ancestor_table", "ancestry_mask", "as_tree", "tree_depths"]


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A static draft tree (see the module docstring); hashable, a static jit argument.

    Attributes:
      branching: ``(k_1, .., k_D)``, children per node at each depth, each >= 1, D >= 1.
    """

    branching: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.branching
        if (
            not isinstance(b, tuple)
            or not b
            or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in b)
        ):
            raise ValueError(
                f"TreeShape.branching must be a non-empty tuple of ints >= 1, got {b!r}"
            )

    @property
    def depth(self) -> int:
        """D: drafts along every root-to-leaf path (the most a round can accept)."""
        return len(self.branching)

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """``(1, n_1, .., n_D)``: nodes per level, the root's level first."""
        sizes = [1]
        for k in self.branching:
            sizes.append(sizes[-1] * k)
        return tuple(sizes)

    @property
    def level_starts(self) -> tuple[int, ...]:
        """Node number of each level's first node: ``(0, 1, 1 + n_1, ..)`` (D + 1 entries)."""
        return tuple(int(x) for x in np.cumsum((0, *self.level_sizes[:-1])))

    @property
    def num_rows(self) -> int:
        """S: tree rows of the verify step, the root included."""
        return sum(self.level_sizes)

    @property
    def num_drafts(self) -> int:
        """S - 1: drafted nodes (every node but the root)."""
        return self.num_rows - 1

    @property
    def num_inner(self) -> int:
        """Nodes the drafter runs a forward on (all but the leaves): S - n_D."""
        return self.num_rows - self.level_sizes[-1]

    def parents(self) -> np.ndarray:
        """int32[S]: each node's parent, -1 for the root."""
        out = [-1]
        for d, k in enumerate(self.branching):
            first = self.level_starts[d]
            out += [first + c for c in range(self.level_sizes[d]) for _ in range(k)]
        return np.asarray(out, np.int32)

    def depths(self) -> np.ndarray:
        """int32[S]: each node's depth (0 for the root)."""
        return np.repeat(np.arange(self.depth + 1), self.level_sizes).astype(np.int32)

    def ancestors(self) -> np.ndarray:
        """bool[S, S]: ``[i, j]`` when node j is node i or one of its ancestors."""
        parents, S = self.parents(), self.num_rows
        out = np.eye(S, dtype=bool)
        for i in range(1, S):  # parents come first: their rows are complete
            out[i] |= out[parents[i]]
        return out

    def children(self, d: int) -> np.ndarray:
        """int32[n_{d-1}, k_d]: the children of each level-(d-1) node, for d in 1..D."""
        first, k = self.level_starts[d], self.branching[d - 1]
        return (first + np.arange(self.level_sizes[d])).reshape(-1, k).astype(np.int32)


def as_tree(tree: TreeShape | Sequence[int]) -> TreeShape:
    """A ``TreeShape`` from itself or its branching (any int sequence)."""
    if isinstance(tree, TreeShape):
        return tree
    if isinstance(tree, (str, bytes)) or not isinstance(tree, Sequence):
        raise TypeError(f"tree must be a TreeShape or a sequence of ints, got {tree!r}")
    return TreeShape(tuple(tree))


def ancestor_table(parents: jax.Array, steps: int) -> jax.Array:
    """int32[steps + 1, S]: row m holds each node's m-th ancestor (row 0 the node itself), -1
    past the root. ``parents`` int32[S] (traced or not) with ``parents[i] < i``, -1 at roots."""
    parents = jnp.asarray(parents, jnp.int32)
    rows = [jnp.arange(parents.shape[0], dtype=jnp.int32)]
    for _ in range(steps):
        up = rows[-1]
        rows.append(jnp.where(up >= 0, parents[jnp.maximum(up, 0)], -1))
    return jnp.stack(rows)


def ancestry_mask(parents: jax.Array) -> jax.Array:
    """bool[S, S] from parents int32[S]: ``[i, j]`` when j is i or an ancestor of i."""
    S = parents.shape[0]
    table = ancestor_table(parents, S - 1)  # [S, S]: every ancestor of each node
    return jnp.any(table[:, :, None] == jnp.arange(S, dtype=jnp.int32)[None, None, :], axis=0)


def tree_depths(parents: jax.Array) -> jax.Array:
    """int32[S] depth of each node from parents int32[S]."""
    table = ancestor_table(parents, parents.shape[0] - 1)
    return jnp.sum(table[1:] >= 0, axis=0).astype(jnp.int32)
