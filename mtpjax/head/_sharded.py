"""Vocab-parallel LM head: each device projects a contiguous slice of the vocabulary.

``shard_lm_head(params, mesh, axis_name)`` pads the head's rows to ``Vp`` and places rows
``[d * Vl, (d + 1) * Vl)`` on device ``d`` of the mesh axis (``Vl = Vp / D``).
``sharded_lm_head`` then runs the replicated head's own projection (``_project``) on each slice
under ``jax.shard_map``:

- logits: every column is computed by the same code on the same hidden rows as in the replicated
  head, only on a different device, so the assembled logits are bit-identical to
  ``lm_head(...)`` for the same implementation (the tests check it on 2, 4 and 8
  devices). This rests on ``hidden`` being bit-identical on every device, which a replicated
  input guarantees.
- greedy: each device takes the max / first argmax / sum of ``exp(logit - global max)`` over its
  real columns; a ``pmax``, a ``pmin`` over the winning devices' indices and a ``psum`` combine
  them, so the token (ties to the lowest id, as ``jnp.argmax``) and its log-probability need no
  gather of the full logits. ``with_logits=False`` skips that gather altogether.

Padded rows (``Vp > V``) are zero weights; their logits are masked out of the greedy reductions
and sliced off the assembled logits, so they can neither win nor leak. A reduced draft vocab
masks columns ``>= V'`` the same way: the slices are fixed by the placement, so the drafter's
projection still costs a full slice per device.

The embedding stays replicated: ``embed(sharded_params, tokens, cfg=cfg)`` works unchanged.

Shape glossary:
  ...  leading dims of hidden, flattened to M rows       H   hidden_size
  V    vocab_size        V'  draft vocab                  D   devices on the mesh axis
  Vp   padded vocab: a multiple of D (of 128 * D for a block-128 FP8 head, whose slices hold
       whole 128-row tiles)                              Vl  Vp / D rows per device
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtpjax.config import LMHeadConfig
from mtpjax.head._lm_head import (
    LMHeadParams,
    _check_cfg_shape,
    _check_head_weight,
    _check_hidden,
    _finish_logits,
    _output_columns,
    _pad_rows,
    _project,
    _round_up,
)
from mtpjax.layers import partition_spec
from mtpjax.weights import FP8_BLOCK, Fp8BlockWeight, Implementation, Weight

__all__ = [
    "HeadOutput",
    "ShardedLMHeadParams",
    "padded_vocab",
    "shard_lm_head",
    "sharded_lm_head",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedLMHeadParams:
    """An LM head placed vocab-parallel over one mesh axis (build with ``shard_lm_head``).

    weight:        [Vp, H] rows split over ``axis_name`` (zero rows past V).
    embedding:     bf16[V, H] replicated.
    final_norm:    [H] replicated, or None.
    mesh, axis_name, vocab_size (V): static.
    """

    weight: Weight
    embedding: jax.Array
    final_norm: jax.Array | None = None
    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    axis_name: str = dataclasses.field(metadata=dict(static=True))
    vocab_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_shards(self) -> int:
        return self.mesh.shape[self.axis_name]

    @property
    def padded_vocab(self) -> int:
        return self.weight.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadOutput:
    """What the vocab-parallel head returns.

    logits:  [..., V] (or [..., V'] for a draft projection), F32 or BF16 per the config; None
             when not asked for.
    token:   int32[...] the greedy token (first index of the maximum logit).
    logprob: f32[...] its log-probability, ``logit - logsumexp(logits)`` over the real columns.
    """

    logits: jax.Array | None
    token: jax.Array
    logprob: jax.Array


def padded_vocab(weight: Weight, num_shards: int) -> int:
    """Rows after padding: a multiple of ``num_shards``, and of 128 per shard when the head is
    block-128 FP8 (a shard must hold whole scale tiles)."""
    quantum = num_shards
    if isinstance(weight, Fp8BlockWeight):
        quantum *= FP8_BLOCK
    return _round_up(weight.out_features, quantum)


# The head's leaves: the projection's rows are the vocab (split), the embedding's are not.
HEAD_AXES = {
    "weight": ("vocab", "embed"),
    "embedding": ("vocab_in", "embed"),
    "final_norm": ("embed",),
}


def _place(tree, specs, mesh: Mesh):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def shard_lm_head(params: LMHeadParams, mesh: Mesh, axis_name: str) -> ShardedLMHeadParams:
    """Pads the head to ``Vp`` rows and places it vocab-parallel over ``mesh``'s ``axis_name``:
    each leaf by its ``HEAD_AXES`` under ``{"vocab": axis_name}`` (other mesh axes replicate)."""
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has axes {tuple(mesh.shape)}; no axis named {axis_name!r}")
    _check_head_weight(params.weight)
    num_shards = mesh.shape[axis_name]
    vp = padded_vocab(params.weight, num_shards)
    weight = params.weight.map_rows(lambda a, per: _pad_rows(a, vp // per))
    rules = {"vocab": axis_name}
    leaves = {"weight": weight, "embedding": params.embedding, "final_norm": params.final_norm}
    return ShardedLMHeadParams(
        **{k: _place(v, partition_spec(v, HEAD_AXES[k], rules), mesh) for k, v in leaves.items()},
        mesh=mesh,
        axis_name=axis_name,
        vocab_size=params.weight.out_features,
    )


def _local_head(
    weight: Weight,
    x: jax.Array,
    *,
    cfg: LMHeadConfig,
    n_valid: int,
    implementation: Implementation,
    axis: str,
    with_logits: bool,
):
    """One device's slice: logits [M, Vl] and the combined greedy token / log-probability."""
    vl = weight.out_features
    logits = _finish_logits(_project(weight, x, n_cols=vl, implementation=implementation), cfg)
    offset = jax.lax.axis_index(axis) * vl
    ids = offset + jnp.arange(vl, dtype=jnp.int32)  # [Vl] global token ids of this slice
    scores = jnp.where(ids < n_valid, logits.astype(jnp.float32), -jnp.inf)  # [M, Vl]
    local_max = jnp.max(scores, axis=-1)  # [M]
    local_arg = offset + jnp.argmax(scores, axis=-1).astype(jnp.int32)  # first max of the slice
    global_max = jax.lax.pmax(local_max, axis)
    # Among the slices holding the global max, the lowest holds the first index overall.
    big = jnp.iinfo(jnp.int32).max
    token = jax.lax.pmin(jnp.where(local_max == global_max, local_arg, big), axis)
    total = jax.lax.psum(jnp.sum(jnp.exp(scores - global_max[:, None]), axis=-1), axis)
    logprob = -jnp.log(total)  # max - logsumexp, with the max factored out of the sum
    return (logits if with_logits else None), token, logprob


def sharded_lm_head(
    params: ShardedLMHeadParams,
    hidden: jax.Array,
    *,
    cfg: LMHeadConfig,
    draft: bool = False,
    implementation: Implementation | str = Implementation.AUTO,
    with_logits: bool = True,
) -> HeadOutput:
    """Vocab-parallel ``lm_head`` of ``hidden [..., H]`` (replicated) with a fused greedy top-1.

    Arguments as for ``lm_head``; ``with_logits=False`` returns only the token and its
    log-probability, and the full logits are never gathered.
    """
    impl = Implementation.parse(implementation)
    return _sharded_lm_head(
        params, hidden, cfg=cfg, draft=draft, implementation=impl, with_logits=with_logits
    )


@functools.partial(jax.jit, static_argnames=("cfg", "draft", "implementation", "with_logits"))
def _sharded_lm_head(params, hidden, *, cfg, draft, implementation, with_logits):
    hidden = jnp.asarray(hidden)
    _check_hidden(hidden, cfg)
    unpadded = (params.vocab_size, params.weight.shape[1])
    _check_cfg_shape(cfg, "ShardedLMHeadParams.weight before padding", unpadded)
    lead = hidden.shape[:-1]
    x = hidden.reshape(-1, cfg.hidden_size)
    n = _output_columns(cfg, draft)
    axis = params.axis_name
    local = functools.partial(
        _local_head,
        cfg=cfg,
        n_valid=n,
        implementation=implementation,
        axis=axis,
        with_logits=with_logits,
    )
    mesh = params.mesh
    # Every device must see the same rows (bit-identity rests on it), whatever x's placement.
    x = jax.sharding.reshard(x, NamedSharding(mesh, P()))
    # Custom kernels carry no varying-across-devices annotations; the outputs declared
    # replicated are made so by pmax / pmin / psum.
    logits, token, logprob = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(partition_spec(params.weight, HEAD_AXES["weight"], {"vocab": axis}), P()),
        out_specs=(P(None, axis) if with_logits else None, P(), P()),
        check_vma=False,
    )(params.weight, x)
    if with_logits and n != params.padded_vocab:
        # An uneven split cannot be expressed, so a padded or reduced vocab is assembled
        # replicated before the padding is cut off; an exact split stays vocab-sharded.
        logits = jax.sharding.reshard(logits, NamedSharding(mesh, P()))[:, :n]
    if with_logits:
        logits = logits.reshape(*lead, n)
    return HeadOutput(logits=logits, token=token.reshape(lead), logprob=logprob.reshape(lead))
