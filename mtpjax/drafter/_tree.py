"""``propose_tree``: write a window of committed pairs, then draft a static tree (top-k children
per node, ``mtpjax.draft_tree``) with the single MTP head, one drafter forward per depth over
all of that depth's nodes.

Rows. The window is written into module 0 exactly as ``propose`` writes it (same checks, same
keys). The root is the anchor: its forward is the chain's step 0 (paged attention over the
held rows), and its top ``k_1`` tokens are the depth-1 nodes. A node at depth ``d >= 1`` gets the
row ``(its token, its parent's handed-over hidden)`` at key ``e + d`` (the chain's row for its
path), and its query attends to the committed rows and to the rows of its ancestors and itself
only: the tree mask over [committed rows | this round's tree rows]. The tree rows are rounded as
the pool stores them but never enter the pool: after the verify, the next window rewrites the
accepted path from the target's hidden (what ``after_verify(refeed=True)`` gives a chain), so
no row of a rejected branch can survive and no trim is needed. The round leaves no pending
rows (``last_num_drafted = 0``).

The committed rows are read through a dense view of the pool (``kv.gather``) once per round; a
paged kernel with an extra masked tail would avoid that copy on a GPU (TODO(#19)).

Shapes: ``[B]`` sequences, ``[S]`` tree rows (root included), ``[n_d]`` nodes at depth d, ``H``
hidden, ``V'`` draft vocab, ``R`` rows per sequence of the pool.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, HiddenContract, LMHeadConfig
from mtpjax.draft_tree import TreeShape, as_tree
from mtpjax.drafter._forward import output_head, pair_rows, resolve_head_cfg
from mtpjax.drafter._params import DrafterModules, DrafterParams
from mtpjax.drafter._propose import Pairs, check_propose_inputs, decode_row, write_window
from mtpjax.head import LMHeadParams
from mtpjax.kv import donation
from mtpjax.kv.cache import gather
from mtpjax.kv.pool import quantize_rows_fp8
from mtpjax.layers.attention import attend, output_projection, project_q
from mtpjax.layers.decoder import ffn_residual
from mtpjax.layers.mla import MlaParams
from pallas_kernels.implementation import Implementation

__all__ = ["TreeDrafts", "propose_tree"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "hidden", "logits", "active"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeDrafts:
    """The drafts of one ``propose_tree`` call.

    Attributes:
      tokens: int32[B, S-1] the token of tree nodes 1..S-1 (breadth first; -1 for inactive
        sequences); the root is the anchor's committed token.
      hidden: f32[B, S - n_D, H] what each inner node (root first) hands its children's rows
        under the hidden contract.
      logits: f32[B, S - n_D, V'] each inner node's draft logits (its children are their top
        k), only when ``return_logits``; else None.
      active: bool[B] the sequences the round ran.
    """

    tokens: jax.Array
    hidden: jax.Array
    logits: jax.Array | None
    active: jax.Array


def _as_stored(pool, rows: jax.Array) -> jax.Array:
    """rows f32[..., Nkv, D] as the pool would give them back (BF16 or FP8 rounding)."""
    if pool.k_scale is None:
        return rows.astype(pool.k.dtype).astype(jnp.float32)
    q, scale = quantize_rows_fp8(rows)
    return q.astype(jnp.float32) * scale[..., None]


@donation.step(
    static_argnames=(
        "cfg",
        "tree",
        "hidden_contract",
        "head_cfg",
        "return_logits",
        "implementation",
    )
)
def _propose_tree(
    params, head, state, pairs, *, cfg, tree, hidden_contract, head_cfg, return_logits,
    implementation,
):  # fmt: skip
    B, T = pairs.tokens.shape
    kw = dict(cfg=cfg, head_cfg=head_cfg, implementation=implementation.value)
    attn = params.layer.attention

    # 1. Module 0 writes the window's pairs it does not hold (as ``propose``).
    state, active, x, a = write_window(params, head, state, pairs, **kw)
    cache = state.kv[0]

    last = jnp.clip(pairs.count - 1, 0, T - 1)

    def at_last(y):
        return jnp.take_along_axis(y, last.reshape((B,) + (1,) * (y.ndim - 1)), axis=1)[:, 0]

    anchor_key = pairs.last_key
    anchor_hidden = at_last(pairs.hidden).astype(jnp.float32)  # [B, H]
    handed_over = {
        HiddenContract.POST_NORM: lambda o: o.h_out,
        HiddenContract.PRE_NORM: lambda o: o.residual,
        HiddenContract.PINNED: lambda o: jnp.broadcast_to(
            anchor_hidden.reshape(B, *(1,) * (o.h_out.ndim - 2), -1), o.h_out.shape
        ),
    }[hidden_contract]

    # 2. The root: the chain's step 0 on the anchor row.
    o = decode_row(params, head, cache, at_last(x), at_last(a), anchor_key, **kw)
    logits, hidden = [o.logits[:, None]], [handed_over(o)[:, None]]  # per level [B, n_d, ...]

    # 3. Depths 1..D-1 (the leaves need no forward): rows, tree-masked attention, top-k.
    ctx_k, ctx_v, ctx_valid = gather(cache, cache.max_rows_per_seq)  # [B, R, Nkv, D], [B, R]
    parents = tree.parents()
    ancestors = tree.ancestors()  # [S, S] numpy
    tokens = [jax.lax.top_k(o.logits, tree.branching[0])[1].astype(jnp.int32)]  # [B, n_1]
    tree_k, tree_v = [], []
    for d in range(1, tree.depth):
        n, first = tree.level_sizes[d], tree.level_starts[d]
        # Each node's parent is an inner node of level d - 1: its hidden feeds the row.
        parent_local = parents[first : first + n] - tree.level_starts[d - 1]
        tok = tokens[-1]
        hid = jnp.take(hidden[-1], parent_local, axis=1)  # [B, n, H]
        pos = jnp.broadcast_to(anchor_key[:, None] + d, (B, n))
        xs, as_, ks, vs = pair_rows(params, head, tok, hid, pos, **kw)
        tree_k.append(_as_stored(cache.pool, ks))
        tree_v.append(_as_stored(cache.pool, vs))
        k_all = jnp.concatenate([ctx_k, *tree_k], axis=1)
        v_all = jnp.concatenate([ctx_v, *tree_v], axis=1)
        # Tree part of the mask: the rows of levels 1..d that are ancestors of (or are) each
        # level-d node.
        in_tree = jnp.asarray(ancestors[first : first + n, 1 : first + n])  # [n, nodes so far]
        mask = jnp.concatenate(
            [
                jnp.broadcast_to(ctx_valid[:, None, :], (B, n, ctx_valid.shape[1])),
                jnp.broadcast_to(in_tree[None], (B, *in_tree.shape)),
            ],
            axis=2,
        )
        q, gate = project_q(attn, as_, pos, cfg, implementation=implementation.value)
        ctx = attend(q, k_all, v_all, mask)  # [B, n, Nq, D]
        y = xs + output_projection(attn, ctx, gate, implementation=implementation.value)
        y = ffn_residual(params.layer, y, cfg=cfg, implementation=implementation.value)
        o = output_head(params, head, y, **kw)
        logits.append(o.logits)
        hidden.append(handed_over(o))
        k_next = tree.branching[d]
        tokens.append(jax.lax.top_k(o.logits, k_next)[1].reshape(B, n * k_next).astype(jnp.int32))

    drafts = jnp.concatenate(tokens, axis=1)  # [B, S-1], breadth first
    state = dataclasses.replace(
        state, last_num_drafted=jnp.where(active, 0, state.last_num_drafted).astype(jnp.int32)
    )
    out = TreeDrafts(
        tokens=jnp.where(active[:, None], drafts, -1),
        hidden=jnp.where(active[:, None, None], jnp.concatenate(hidden, axis=1), 0.0),
        logits=jnp.concatenate(logits, axis=1) if return_logits else None,
        active=active,
    )
    return out, state


def propose_tree(
    params: DrafterParams | DrafterModules,
    head: LMHeadParams,
    state,
    pairs: Pairs,
    *,
    cfg: DrafterConfig,
    tree: TreeShape | tuple[int, ...],
    hidden_contract: HiddenContract | None = None,
    head_cfg: LMHeadConfig | None = None,
    return_logits: bool = False,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[TreeDrafts, object]:
    """Writes the window's new pairs and drafts a static tree per sequence (module docstring).

    Args:
      params: the single MTP head (``DrafterParams``, or ``DrafterModules`` of one module);
        GQA attention (an MLA head is a ValueError: its latent rows take another mask path).
      head: the target's embedding / LM head.
      state: the drafter state; donated.
      pairs: ``Pairs`` windows, as for ``propose``; the last pair of each is the anchor (root).
      cfg: static drafter config. tree: static ``TreeShape`` or its branching.
      hidden_contract: static; None: ``cfg.default_hidden_contract``.
      head_cfg: static LM head config (default ``cfg.lm_head_config()``).
      return_logits: static; also return each inner node's draft logits.
      implementation: ``Implementation`` or its name, for the projections and the attention.

    Returns:
      (``TreeDrafts``, the new state: the window written, no pending round).
    """
    if isinstance(params, DrafterModules):
        if params.num_modules != 1:
            raise ValueError(
                f"propose_tree drafts with one MTP module; got DrafterModules of "
                f"{params.num_modules}"
            )
        params = params.modules[0]
    if not isinstance(params, DrafterParams):
        raise TypeError(f"params must be DrafterParams, got {type(params).__name__}")
    if isinstance(params.layer.attention, MlaParams):
        raise ValueError("propose_tree supports GQA drafters; this head has MLA attention")
    tree = as_tree(tree)
    if hidden_contract is None:
        hidden_contract = cfg.default_hidden_contract
    if not isinstance(hidden_contract, HiddenContract):
        raise TypeError(f"hidden_contract must be a HiddenContract, got {hidden_contract!r}")
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    for d, k in enumerate(tree.branching):
        if k > head_cfg.draft_rows:
            raise ValueError(
                f"tree.branching[{d}]={k} exceeds the draft vocab V'={head_cfg.draft_rows}"
            )
    pairs = check_propose_inputs(state, pairs, cfg, 1)
    return _propose_tree(
        params,
        head,
        state,
        pairs,
        cfg=cfg,
        tree=tree,
        hidden_contract=hidden_contract,
        head_cfg=head_cfg,
        return_logits=bool(return_logits),
        implementation=Implementation.parse(implementation),
    )
