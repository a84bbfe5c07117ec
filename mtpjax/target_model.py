"""The interface between a target model and the generation loop (``mtpjax.generation``).

A target is data plus three static callables, so any model plugs in: the full-attention
reference (``mtpjax.generation.reference_target``) and the hybrid Gated DeltaNet model
(``mtpjax.hybrid.target_model``) both build one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["TargetModel"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetModel:
    """A target model as the generation loop sees it.

    Attributes:
      params: any pytree of arrays, passed as the first argument of ``prefill`` and ``step``.
      init_cache: ``(batch, max_len) -> cache``, an empty cache pytree for ``batch`` sequences
        of up to ``max_len`` positions.
      prefill: ``(params, cache, tokens int32[B, T], lengths int32[B]) -> (hidden [B, T, H],
        cache)``: runs each right-padded prompt from position 0; ``hidden`` is what the LM head
        and the drafter read (post-final-norm for Qwen-style heads).
      step: ``(params, cache, tokens int32[B, S], start int32[B]) -> (hidden [B, S, H],
        cache)``: runs S tokens at positions ``start .. start + S - 1``, attending to cache rows
        at positions up to each query's own; rows past the committed length are overwritten by
        the next step that starts there (rollback by restarting).
      tree_step: optional, for tree drafting (``generate(..., tree=...)``): ``(params, cache,
        tokens int32[B, S], start int32[B], parents int32[S]) -> (hidden [B, S, H], cache)``
        runs a draft tree (``mtpjax.draft_tree``): row i at position ``start + depth(i)``,
        attending to the committed positions and to its ancestors (itself included) only.
      commit_path: with ``tree_step``: ``(params, cache, start int32[B], path int32[B, P]) ->
        cache`` commits the tree step's accepted path (node numbers, root first): afterwards
        the cache is what a chain step over the path's tokens at ``start`` would have left, so
        the next ``step`` or ``tree_step`` starts at the new committed length as usual.

    The callables are static (jit metadata): use module-level functions or frozen dataclasses so
    that equal models compare equal and never retrace.
    """

    params: Any
    init_cache: Callable[[int, int], Any] = dataclasses.field(metadata=dict(static=True))
    prefill: Callable[..., tuple[jax.Array, Any]] = dataclasses.field(metadata=dict(static=True))
    step: Callable[..., tuple[jax.Array, Any]] = dataclasses.field(metadata=dict(static=True))
    tree_step: Callable[..., tuple[jax.Array, Any]] | None = dataclasses.field(
        default=None, metadata=dict(static=True)
    )
    commit_path: Callable[..., Any] | None = dataclasses.field(
        default=None, metadata=dict(static=True)
    )
