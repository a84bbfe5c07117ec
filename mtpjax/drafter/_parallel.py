"""A drafter spread over a device mesh: tensor-parallel attention and FFN, expert-parallel MoE, a
vocab-parallel LM head and a paged KV pool split by KV head.

``shard_drafter(params, head, state, mesh, cfg=cfg)`` places every leaf with a ``NamedSharding``
derived from its logical axes (``mtpjax.layers._spec``, ``partition_specs``) under ``rules``;
``propose``, ``prefill``, ``after_verify`` and ``verify`` then run unchanged on the placed pytrees
and ``jit`` propagates the shardings (XLA inserts the reductions):

- attention: q/k/v column-parallel by head (``heads``, ``kv_heads``), so each device holds whole
  query heads and the KV heads they read; ``o_proj`` row-parallel (its input is ``heads``), one
  all-reduce of the [B, H] output. MLA: its query and ``kv_b_proj`` rows and ``o_proj`` split
  by head; ``kv_a_proj_with_mqa`` and the latent rows replicate, since one latent row is every
  head's key and value (a split of the row would need a reduction inside every score).
- dense FFN and the shared expert: gate/up column-parallel, down row-parallel (``mlp``).
- MoE: the experts split over ``expert_axis`` (``experts``; each device holds ``E / n`` whole
  experts). The tokens and the routing are replicated (decode has a few rows); under
  ``shard_map`` every device mixes the chosen experts it holds and one ``psum`` of the [T, H]
  output sums them (``mtpjax.layers.expert_parallel``). Chosen over an all-to-all dispatch
  because decode rows are few and the expert weights are what costs: replicated rows move
  nothing but that one reduction, and no expert weight ever crosses devices (plain propagation
  would all-reduce the gathered experts' weights). Its limit: a device reads
  ``min(T * k, E / n)`` experts (the slots routed elsewhere still read a clipped local expert
  in XLA's gather), so it divides the expert bytes only once ``T * k`` exceeds ``E / n``.
  ``expert_axis=None`` instead splits each expert's width like the dense FFN (``mlp``), which
  divides every chosen expert's bytes by ``n`` even at B = 1.
- LM head: its rows split by vocab (``vocab``); logits come out vocab-sharded and the argmax,
  max and sum over the vocab are cross-device reductions.
- KV pool: ``[P, S, Nkv, D]`` split on the KV-head axis (and its FP8 scales); MLA's latent pool
  replicates. Block tables, lengths, keys and the allocator replicate: every device runs the
  same bookkeeping on the same values.

Everything the mesh splits must divide evenly (checked, with the leaf named): whole heads and
experts per device, and each weight's (and scale's) split dimension.

Run the placed steps with ``implementation="xla"`` on GPUs: a Pallas kernel is a custom call
with no partitioning rule, so propagation must hand it whole operands, which would gather the
weights and the pool on every call (correct, but slower than one device). The kernels' own
split (``shard_map`` around each call) is issue 21's next step.

Shapes: ``n`` devices on the mesh axis, ``E`` experts, ``V`` vocab, ``Nkv`` KV heads.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtpjax.config import DrafterConfig, FfnKind
from mtpjax.drafter._params import DrafterModules, DrafterParams, as_modules, partition_specs
from mtpjax.head import LMHeadParams
from mtpjax.head._sharded import HEAD_AXES
from mtpjax.kv.state import DrafterState
from mtpjax.layers import MoeFfnParams, Rules, partition_spec
from mtpjax.layers.expert_parallel import ExpertParallelMoeParams

__all__ = ["drafter_shardings", "parallel_rules", "shard_drafter"]


def parallel_rules(*, axis: str, expert_axis: str | None) -> dict[str, str | None]:
    """Logical axis -> mesh axis of the tensor/expert-parallel drafter (see the module doc)."""
    rules = {"heads": axis, "kv_heads": axis, "mlp": axis, "vocab": axis}
    if expert_axis is not None:
        rules["experts"] = expert_axis
    return rules


def _dedupe(spec: P) -> P:
    """A mesh axis may split one dimension only: the first (outermost) keeps it. An expert's
    ``[E, I, H]`` under ``experts`` and ``mlp`` on one axis splits E."""
    seen, out = set(), []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        keep = tuple(n for n in names if n not in seen)
        seen.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


def _leaf_specs(value, axes, rules: Rules):
    return jax.tree.map(_dedupe, partition_spec(value, axes, rules))


def _check_divisible(name: str, array, spec: P, mesh: Mesh) -> None:
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        n = 1
        for a in names:
            n *= mesh.shape[a]
        if array.shape[dim] % n:
            raise ValueError(
                f"{name}: dimension {dim} of shape {tuple(array.shape)} must split evenly over "
                f"mesh axes {names} ({n} devices), found {array.shape[dim]}"
            )


def _module_specs(module: DrafterParams, cfg: DrafterConfig, rules: Rules) -> DrafterParams:
    return jax.tree.map(_dedupe, partition_specs(module, cfg, rules))


def _state_specs(state: DrafterState, cfg: DrafterConfig, axis: str) -> DrafterState:
    """Pool buffers [P, S, Nkv, D] (scales [P, S, Nkv]) split by KV head; MLA's latent rows and
    all the bookkeeping replicated."""
    kv_spec = P() if cfg.mla is not None else P(None, None, axis)

    def cache_specs(cache):
        pool = cache.pool
        pool_specs = dataclasses.replace(
            pool,
            k=kv_spec,
            v=None if pool.v is None else kv_spec,
            k_scale=None if pool.k_scale is None else kv_spec,
            v_scale=None if pool.v_scale is None else kv_spec,
        )
        rep = jax.tree.map(lambda _: P(), dataclasses.replace(cache, pool=None))
        return dataclasses.replace(rep, pool=pool_specs)

    rep = jax.tree.map(lambda _: P(), dataclasses.replace(state, kv=()))
    return dataclasses.replace(rep, kv=tuple(cache_specs(c) for c in state.kv))


def drafter_shardings(
    params: DrafterParams | DrafterModules,
    head: LMHeadParams,
    state: DrafterState | None,
    mesh: Mesh,
    *,
    cfg: DrafterConfig,
    axis: str = "tp",
    expert_axis: str | None = "tp",
):
    """The ``NamedSharding`` of every leaf of ``(params, head, state)`` (same structures; None
    for a None state), as ``shard_drafter`` places them; checks that every split divides
    evenly."""
    for a in (axis, expert_axis):
        if a is None:
            continue
        if a not in mesh.shape:
            raise ValueError(f"mesh has axes {tuple(mesh.shape)}; no axis named {a!r}")
        kind = dict(zip(mesh.axis_names, mesh.axis_types))[a]
        if kind is not AxisType.Auto:
            raise ValueError(
                f"mesh axis {a!r} is {kind}; the drafter's steps let jit propagate the "
                "shardings, which needs AxisType.Auto (jax.make_mesh(..., axis_types="
                "(AxisType.Auto,)))"
            )
    if cfg.ffn is FfnKind.DENSE:
        expert_axis = None
    # Whole heads and experts per device: an even split of a projection's rows alone could cut
    # a head in two.
    counts = [("num_attention_heads", cfg.num_attention_heads, axis)]
    if cfg.mla is None:
        counts.append(("num_key_value_heads", cfg.num_key_value_heads, axis))
    if expert_axis is not None:
        counts.append(("moe.num_experts", cfg.moe.num_experts, expert_axis))
    for name, count, a in counts:
        if count % mesh.shape[a]:
            raise ValueError(
                f"cfg.{name}={count} must be a multiple of the {mesh.shape[a]} devices on mesh "
                f"axis {a!r}"
            )
    rules = parallel_rules(axis=axis, expert_axis=expert_axis)
    modules = as_modules(params, cfg)
    module_cfg = dataclasses.replace(cfg, num_mtp_modules=1)
    specs = [_module_specs(m, module_cfg, rules) for m in modules.modules]
    param_specs = (
        specs[0]
        if isinstance(params, DrafterParams)
        else dataclasses.replace(modules, modules=tuple(specs))
    )
    head_specs = LMHeadParams(
        weight=_leaf_specs(head.weight, HEAD_AXES["weight"], rules),
        embedding=P(),
        final_norm=None if head.final_norm is None else P(),
    )
    state_specs = None if state is None else _state_specs(state, cfg, axis)
    trees = (params, head, state)
    spec_trees = (param_specs, head_specs, state_specs)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    for name, tree, spec_tree in zip(("params", "head", "state"), trees, spec_trees):
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        flat_specs = jax.tree.leaves(spec_tree, is_leaf=is_spec)
        for (path, leaf), spec in zip(paths, flat_specs, strict=True):
            _check_divisible(name + jax.tree_util.keystr(path), leaf, spec, mesh)
    return tuple(
        jax.tree.map(lambda s: NamedSharding(mesh, s), t, is_leaf=is_spec) for t in spec_trees
    )


def shard_drafter(
    params: DrafterParams | DrafterModules,
    head: LMHeadParams,
    state: DrafterState | None,
    mesh: Mesh,
    *,
    cfg: DrafterConfig,
    axis: str = "tp",
    expert_axis: str | None = "tp",
) -> tuple[DrafterParams | DrafterModules, LMHeadParams, DrafterState | None]:
    """``(params, head, state)`` placed over ``mesh`` per ``drafter_shardings``: tensor-parallel
    over ``axis`` (an ``AxisType.Auto`` mesh axis), the experts over ``expert_axis`` (None:
    each expert's width split over ``axis`` instead). A dense head ignores ``expert_axis``.

    Places a new state or one already written (a state of the same ``PoolConfig`` can be placed
    alone with ``jax.device_put(state, drafter_shardings(...)[2])``). The steps then take the
    placed pytrees as they take the unsharded ones and return the state placed the same way.
    """
    shardings = drafter_shardings(
        params, head, state, mesh, cfg=cfg, axis=axis, expert_axis=expert_axis
    )
    params, head, state = jax.device_put((params, head, state), shardings)
    if cfg.ffn is FfnKind.MOE and expert_axis is not None:
        params = _expert_parallel(params, mesh, expert_axis)
    return params, head, state


def _expert_parallel(params, mesh: Mesh, axis: str):
    """Every module's MoE as ``ExpertParallelMoeParams`` (its experts mix under shard_map)."""

    def wrap(module: DrafterParams) -> DrafterParams:
        ffn = module.layer.ffn
        assert isinstance(ffn, MoeFfnParams)
        layer = dataclasses.replace(module.layer, ffn=ExpertParallelMoeParams.wrap(ffn, mesh, axis))
        return dataclasses.replace(module, layer=layer)

    if isinstance(params, DrafterParams):
        return wrap(params)
    return dataclasses.replace(params, modules=tuple(wrap(m) for m in params.modules))
