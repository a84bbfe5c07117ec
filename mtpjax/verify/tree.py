"""Verification of a draft tree (``mtpjax.draft_tree``): the longest accepted root-to-leaf path.

Row ``i`` of ``target_logits`` ([B, S, V]) scores the token that follows tree node ``i`` (row 0:
after the root, the newest committed token). The walk starts at the root and, depth by depth,
tries the current node's children in their rank order:

- greedy (``temperature == 0``): a child is accepted when its token is the argmax of the
  current node's row (ties to the lowest id); children are distinct tokens, so at most one
  matches. The emitted token after the path is the argmax of the last accepted node's row, so
  greedy tree speculation reproduces greedy decoding token for token.
- sampled: recursive rejection sampling over siblings (SpecInfer's multi-candidate rule). With
  ``r = p`` (the current node's row, softmax at the temperature), child ``j`` with token ``x``
  drawn from ``q`` is accepted with probability ``min(1, r(x) / q(x))``; on a rejection
  ``r <- normalize(max(r - q, 0))`` and the next sibling is tried against it. Accepting moves to
  that child with ``r`` its own row; when every child is rejected the emitted token is sampled
  from the last residual; at a leaf, from the leaf's row (the bonus). The emitted tokens are
  then distributed exactly as the target's own samples when each node's children are i.i.d.
  draws from its ``q`` (``draft_probs``), or are any tokens fixed before the target's
  randomness (``draft_probs=None``: ``q`` one-hot at each child, so a rejected child's token
  is removed from the residual) — the top-k children ``propose_tree`` drafts.

Shapes: ``[B]`` sequences, ``[S]`` tree rows (root included), ``[D]`` depth, ``[V]`` vocab,
``[I]`` inner nodes (``S - n_D``, root first), ``[H]`` hidden.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

from mtpjax.draft_tree import TreeShape, as_tree
from mtpjax.head import LMHeadParams, lm_head
from mtpjax.verify import metrics as metrics_lib
from mtpjax.verify.accept import PLACEHOLDER_TOKEN_ID, check_temperature
from pallas_kernels.implementation import Implementation

__all__ = ["TreeAcceptResult", "accept_tree", "verify_tree"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeAcceptResult:
    """Outcome of one tree verify round.

    Attributes:
      num_accepted: int32[B] depth of the last accepted node (drafts accepted; 0 for inactive
        sequences in ``verify_tree``).
      output_tokens: int32[B, D+1] the accepted path's tokens, then the target's token; -1 from
        ``num_output`` on.
      num_output: int32[B] ``num_accepted + 1`` (0 for inactive sequences in ``verify_tree``).
      path: int32[B, D+1] node numbers of the accepted path, root first; past ``num_accepted``
        it repeats the last accepted node.
      metrics: the running ``SpecDecodeMetrics`` over D positions (``verify_tree`` only).
    """

    num_accepted: jax.Array
    output_tokens: jax.Array
    num_output: jax.Array
    path: jax.Array
    metrics: metrics_lib.SpecDecodeMetrics | None = None


def _rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b, ...]]: [B, R, ...] x int[B, ...] -> [B, ..., ...]."""
    b = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (index.ndim - 1))
    return x[b, index]


def _walk(tree: TreeShape, tokens, logits, draft_probs, temperature, key, sample: bool):
    """The walk of the module docstring. tokens int32[B, S] (root's slot unused); logits
    f32[B, S, V]. Returns (num_accepted, final token, path [B, D+1])."""
    B, V = logits.shape[0], logits.shape[2]
    current = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    path = [current]
    if sample:
        probs = jax.nn.softmax(logits / temperature, axis=-1)
        keys = iter(jax.random.split(key, sum(tree.branching) + 1))
        final = _rows(probs, current)  # where a sequence's emitted token is drawn from
    else:
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, S]
    for d in range(1, tree.depth + 1):
        children = jnp.asarray(tree.children(d))  # [n_{d-1}, k_d]
        mine = children[current - tree.level_starts[d - 1]]  # [B, k_d]
        x = _rows(tokens, mine)  # [B, k_d]
        valid = (x >= 0) & (x < V)
        if not sample:
            match = alive[:, None] & valid & (x == _rows(best, current)[:, None])
            found = jnp.any(match, axis=1)
            chosen = _rows(mine, jnp.argmax(match, axis=1).astype(jnp.int32))
        else:
            residual = _rows(probs, current)  # [B, V], normalised
            q = None if draft_probs is None else _rows(draft_probs, current)  # [B, V]
            found = jnp.zeros((B,), bool)
            chosen = current
            for j in range(tree.branching[d - 1]):
                xj = jnp.clip(x[:, j], 0, V - 1)
                if q is None:
                    qj = jax.nn.one_hot(jnp.where(valid[:, j], x[:, j], -1), V)
                else:
                    qj = jnp.where(valid[:, j, None], q, 0.0)
                q_x = jnp.take_along_axis(qj, xj[:, None], axis=1)[:, 0]
                r_x = jnp.take_along_axis(residual, xj[:, None], axis=1)[:, 0]
                u = jax.random.uniform(next(keys), (B,))
                # u < r/q as u*q < r: q(x) = 0 accepts iff r(x) > 0.
                ok = alive & ~found & valid[:, j] & (u * q_x < r_x)
                chosen = jnp.where(ok, mine[:, j], chosen)
                found = found | ok
                # The residual after this rejection, for the next sibling (and the final draw).
                rest = jnp.maximum(residual - qj, 0.0)
                mass = jnp.sum(rest, axis=-1, keepdims=True)
                rest = jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), residual)
                residual = jnp.where((found | ~valid[:, j])[:, None], residual, rest)
            dies = alive & ~found
            final = jnp.where(dies[:, None], residual, final)
            final = jnp.where(found[:, None], _rows(probs, chosen), final)
        current = jnp.where(found, chosen, current)
        alive = alive & found
        path.append(current)
    num_accepted = jnp.sum(jnp.stack(path[1:]) != jnp.stack(path[:-1]), axis=0).astype(jnp.int32)
    if sample:
        token = jax.random.categorical(next(keys), jnp.log(final), axis=-1).astype(jnp.int32)
    else:
        token = _rows(best, current)
    return num_accepted, token, jnp.stack(path, axis=1)


def accept_tree(
    tree_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_logits: jax.Array,
    *,
    tree: TreeShape | tuple[int, ...],
    temperature: float | jax.Array,
    key: jax.Array | None = None,
) -> TreeAcceptResult:
    """Accepts the longest path of a draft tree and samples the token after it (module
    docstring); one jit per tree.

    Args:
      tree_tokens: int[B, S-1] tokens of nodes 1..S-1 (breadth first); ids outside [0, V) are
        never accepted.
      draft_probs: f[B, I, V] the distribution each inner node's children were drawn from
        (already at the temperature), or None for children fixed before verification (top-k).
      target_logits: f[B, S, V] the target's logits for the S tree rows, before temperature.
      tree: static ``TreeShape`` or its branching. temperature: real scalar >= 0 (0: greedy).
      key: PRNG key, required when temperature > 0.

    Returns:
      ``TreeAcceptResult`` (metrics None).
    """
    tree = as_tree(tree)
    temperature, key = check_temperature(temperature, key)
    tree_tokens, target_logits = jnp.asarray(tree_tokens), jnp.asarray(target_logits)
    B = tree_tokens.shape[0]
    if tree_tokens.ndim != 2 or tree_tokens.shape[1] != tree.num_drafts:
        raise ValueError(
            f"tree_tokens must be int[B, S-1={tree.num_drafts}] for tree {tree.branching}, got "
            f"{list(tree_tokens.shape)}"
        )
    if target_logits.ndim != 3 or target_logits.shape[:2] != (B, tree.num_rows):
        raise ValueError(
            f"target_logits must be float[B={B}, S={tree.num_rows}, V], got "
            f"{list(target_logits.shape)}"
        )
    if draft_probs is not None:
        draft_probs = jnp.asarray(draft_probs)
        want = (B, tree.num_inner, target_logits.shape[2])
        if draft_probs.shape != want:
            raise ValueError(
                f"draft_probs must be float{list(want)} (B, inner nodes, V) or None, got "
                f"{list(draft_probs.shape)}"
            )
    return _accept_tree(tree_tokens, draft_probs, target_logits, temperature, key, tree=tree)


@functools.partial(jax.jit, static_argnames=("tree",))
def _accept_tree(tree_tokens, draft_probs, target_logits, temperature, key, *, tree):
    tokens = jnp.pad(tree_tokens.astype(jnp.int32), ((0, 0), (1, 0)), constant_values=-1)
    logits = target_logits.astype(jnp.float32)
    if draft_probs is not None:
        # Leaves have no children: pad the inner rows to S so node numbers index them.
        pad = tree.num_rows - tree.num_inner
        draft_probs = jnp.pad(draft_probs.astype(jnp.float32), ((0, 0), (0, pad), (0, 0)))

    def greedy():
        return _walk(tree, tokens, logits, None, temperature, key, sample=False)

    def sample():
        return _walk(tree, tokens, logits, draft_probs, temperature, key, sample=True)

    if key is None:
        num_accepted, token, path = greedy()
    else:
        num_accepted, token, path = jax.lax.cond(temperature > 0, sample, greedy)
    D = tree.depth
    slots = jnp.arange(D + 1, dtype=jnp.int32)[None, :]
    n = num_accepted[:, None]
    path_tokens = _rows(tokens, path)[:, 1:]  # [B, D]
    path_tokens = jnp.pad(path_tokens, ((0, 0), (0, 1)), constant_values=PLACEHOLDER_TOKEN_ID)
    output = jnp.where(
        slots < n, path_tokens, jnp.where(slots == n, token[:, None], PLACEHOLDER_TOKEN_ID)
    )
    return TreeAcceptResult(
        num_accepted=num_accepted,
        output_tokens=output.astype(jnp.int32),
        num_output=num_accepted + 1,
        path=path,
    )


def verify_tree(
    head: LMHeadParams,
    target_hidden: jax.Array,
    drafts,
    *,
    cfg,
    tree: TreeShape | tuple[int, ...],
    temperature: float | jax.Array = 0.0,
    key: jax.Array | None = None,
    metrics: metrics_lib.SpecDecodeMetrics | None = None,
    active: jax.Array | None = None,
    implementation: Implementation | str = Implementation.AUTO,
) -> TreeAcceptResult:
    """One tree verify round: the target's LM head over the S tree rows, ``accept_tree``, and
    the metrics over D positions (a round drafts D tokens per path); one jit. No drafter state
    to trim: ``propose_tree`` keeps no tree rows.

    Args:
      head: the target's LM head. target_hidden: f32[B, S, H] the target's tree step output.
      drafts: the round's ``TreeDrafts``. cfg: the target's ``LMHeadConfig``.
      tree, temperature, key: as ``accept_tree`` (top-k drafts: ``draft_probs=None``).
      metrics: running metrics (D positions), fresh when None.
      active: bool[B] (default ``drafts.active``); inactive sequences emit nothing.
    """
    tree = as_tree(tree)
    temperature, key = check_temperature(temperature, key)
    return _verify_tree(
        head,
        target_hidden,
        drafts,
        temperature,
        key,
        metrics,
        active,
        cfg=cfg,
        tree=tree,
        implementation=Implementation.parse(implementation).value,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "tree", "implementation"))
def _verify_tree(
    head, target_hidden, drafts, temperature, key, metrics, active, *, cfg, tree, implementation
):
    B, S = drafts.tokens.shape[0], tree.num_rows
    chex.assert_shape(target_hidden, (B, S, cfg.hidden_size))
    if active is None:
        active = drafts.active
    logits = lm_head(head, target_hidden.reshape(B * S, -1), cfg=cfg, implementation=implementation)
    logits = logits.reshape(B, S, -1).astype(jnp.float32)
    result = _accept_tree(drafts.tokens, None, logits, temperature, key, tree=tree)
    num_accepted = jnp.where(active, result.num_accepted, 0)
    D = tree.depth
    if metrics is None:
        metrics = metrics_lib.empty(D)
    num_valid = jnp.where(active, D, 0).astype(jnp.int32)
    return TreeAcceptResult(
        num_accepted=num_accepted,
        output_tokens=jnp.where(active[:, None], result.output_tokens, -1),
        num_output=jnp.where(active, result.num_output, 0),
        path=result.path,
        metrics=metrics_lib.update(metrics, num_accepted, num_valid),
    )
