"""Expert-parallel MoE: the routed experts split over a mesh axis, the tokens replicated.

Each of the ``n`` devices holds ``E / n`` whole experts (``[E / n, I, H]``, contiguous: device
``d`` has experts ``[d * E / n, (d + 1) * E / n)``). Routing runs replicated (the router and its
top-k are the single-device ``route``), then under ``jax.shard_map`` each device mixes the
chosen experts it holds, with the weights of the others zeroed, and one ``psum`` sums the
partial outputs. No expert weight moves; the traffic is the ``[T, H]`` all-reduce.

The weights' ``experts`` leaves carry the split; ``ExpertParallelMoeParams`` is a
``MoeFfnParams`` that also names the mesh and axis (static), which is how ``apply_ffn`` knows to
take this path. Under plain ``jit`` propagation a gather from experts split over devices is
lowered as a masked local gather whose result (the chosen experts' weights) is all-reduced:
the weights would cross the interconnect every draft, which is why this is a ``shard_map``.

The sum over the chosen experts is reassociated (per device, then across devices), so the
output matches ``moe_ffn``'s to F32 rounding, not bit for bit.

Shapes: ``[T]`` rows, ``H`` hidden, ``E`` experts, ``k`` experts per token, ``n`` devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mtpjax.layers.ffn import DenseFfnParams, MoeFfnParams, mix_experts

__all__ = ["ExpertParallelMoeParams", "expert_parallel_mix"]


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertParallelMoeParams(MoeFfnParams):
    """A ``MoeFfnParams`` whose ``experts`` are split over ``mesh``'s ``axis_name`` (static)."""

    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    axis_name: str = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def wrap(cls, params: MoeFfnParams, mesh: Mesh, axis_name: str) -> ExpertParallelMoeParams:
        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(MoeFfnParams)}
        return cls(**fields, mesh=mesh, axis_name=axis_name)

    def unwrap(self) -> MoeFfnParams:
        return MoeFfnParams(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(MoeFfnParams)}
        )


def _local_mix(experts, y, weights, ids, *, axis: str, implementation):
    """One device: its experts' share of the mix, summed over the devices."""
    num_local = jax.tree.leaves(experts)[0].shape[0]
    local = ids - jax.lax.axis_index(axis) * num_local  # [T, k] ids among this device's experts
    mine = (local >= 0) & (local < num_local)
    part = mix_experts(
        experts,
        y,
        jnp.where(mine, weights, 0.0),
        jnp.clip(local, 0, num_local - 1),
        implementation=implementation,
    )
    return jax.lax.psum(part, axis)


def expert_parallel_mix(params: ExpertParallelMoeParams):
    """``mix_experts``'s signature over ``params``' split experts (for ``moe_ffn(mix=...)``)."""
    mesh, axis = params.mesh, params.axis_name

    def mix(experts: DenseFfnParams, y, weights, ids, *, implementation="auto"):
        specs = jax.tree.map(lambda a: P(axis, *(None,) * (a.ndim - 1)), experts)
        # The kernels inside carry no varying-across-devices annotations; the output declared
        # replicated is made so by the psum.
        return jax.shard_map(
            functools.partial(_local_mix, axis=axis, implementation=implementation),
            mesh=mesh,
            in_specs=(specs, P(), P(), P()),
            out_specs=P(),
            check_vma=False,
        )(experts, y, weights, ids)

    return mix
