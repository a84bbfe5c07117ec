"""Parameter leaves described once: name, logical shape, how the shape follows from config.json,
projection role and logical axes. Random init, the converter's shape checks, the loader's
expected shapes and shardings are all derived from these descriptions.

A leaf's value is a weight pytree (a projection, stored per ``projection_format`` of its role),
a bf16 norm weight (``role=None``) or a bf16 embedding table (``embedding=True``). Names are
checkpoint names relative to the module (``self_attn.q_proj``, ``mlp.experts.gate_proj``).

Shapes: ``H`` hidden, ``D`` head dim, ``I`` FFN width, ``E`` experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mtpjax.config import FfnKind
from mtpjax.layers.attention import AttentionParams
from mtpjax.layers.decoder import DecoderLayerParams
from mtpjax.layers.ffn import DenseFfnParams, MoeFfnParams
from mtpjax.layers.mla import MlaParams, mla_from_named, mla_leaf_rows
from mtpjax.weights import Precision, Projection, projection_format, quantize

# Logical axis -> mesh axis (or axes, or None = replicated); axes a table omits replicate.
Rules = Mapping[str, str | tuple[str, ...] | None]
Draw = Callable[[tuple[int, ...]], jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Leaf:
    """One parameter leaf.

    Attributes:
      name: checkpoint name relative to its module, without ``.weight``.
      shape: logical shape (``[..., N, K]`` for a projection).
      what: how ``shape`` follows from config.json, for error messages.
      axes: one logical axis name per dimension of ``shape`` (None: never sharded).
      role: projection role (decides the storage format), or None for a bf16 array.
      embedding: a bf16 embedding table (``role`` is None).
      f32: an f32 array rather than bf16 (the router's score-correction bias, which checkpoints
        keep in F32 because expert choice compares it with sigmoid scores).
      bias: an additive bias (``role`` is None), not a norm weight.
    """

    name: str
    shape: tuple[int, ...]
    what: str
    axes: tuple[str | None, ...]
    role: Projection | None = None
    embedding: bool = False
    f32: bool = False
    bias: bool = False


def layer_leaves(cfg: Any) -> tuple[Leaf, ...]:
    """The leaves of one decoder layer for ``cfg`` (attention attributes, ``ffn``, ``moe``), in
    the random initialiser's draw order."""
    H, D, P = cfg.hidden_size, cfg.head_dim, Projection
    q_width = "num_attention_heads * head_dim" + (" * 2" if cfg.attn_output_gate else "")
    kv, o = "num_key_value_heads * head_dim", "num_attention_heads * head_dim"
    q, kv_, o_ = ("heads", "embed"), ("kv_heads", "embed"), ("embed", "heads")
    mla = getattr(cfg, "mla", None)
    if mla is not None:
        rows = mla_leaf_rows(cfg)
    else:
        rows = [
            ("self_attn.q_proj", (cfg.q_proj_width, H), f"[{q_width}, hidden_size]", q, P.Q_PROJ),
            ("self_attn.k_proj", (cfg.kv_width, H), f"[{kv}, hidden_size]", kv_, P.K_PROJ),
            ("self_attn.v_proj", (cfg.kv_width, H), f"[{kv}, hidden_size]", kv_, P.V_PROJ),
            ("self_attn.o_proj", (H, cfg.num_attention_heads * D), f"[hidden_size, {o}]", o_,
             P.O_PROJ),
        ]  # fmt: skip
        if getattr(cfg, "attention_bias", False):
            rows += [
                ("self_attn.q_proj.bias", (cfg.q_proj_width,), f"[{q_width}]", ("heads",), None),
                ("self_attn.k_proj.bias", (cfg.kv_width,), f"[{kv}]", ("kv_heads",), None),
                ("self_attn.v_proj.bias", (cfg.kv_width,), f"[{kv}]", ("kv_heads",), None),
            ]
    f32 = set()
    if cfg.qk_norm:
        norms = ("self_attn.q_norm", "self_attn.k_norm")
        rows += [(n, (D,), "[head_dim]", ("head_dim",), None) for n in norms]
    if cfg.ffn is FfnKind.DENSE:
        roles = (P.GATE_PROJ, P.UP_PROJ, P.DOWN_PROJ)
        rows += _ffn_rows("mlp", (), cfg.intermediate_size, "intermediate_size", H, roles)
    else:
        moe, E = cfg.moe, cfg.moe.num_experts
        rows.append(
            ("mlp.gate", (E, H), "[num_experts, hidden_size]", ("experts", "embed"), P.ROUTER)
        )
        if moe.score_correction_bias:
            bias = "mlp.gate.e_score_correction_bias"
            rows.append((bias, (E,), "[num_experts]", ("experts",), None))
            f32.add(bias)
        I, i = moe.moe_intermediate_size, "moe_intermediate_size"
        rows += _ffn_rows("mlp.experts", (E,), I, i, H, (P.EXPERTS,) * 3)
        if moe.has_shared_expert:
            S, s = moe.shared_expert_intermediate_size, "shared_expert_intermediate_size"
            rows += _ffn_rows(shared_expert_name(cfg), (), S, s, H, (P.SHARED_EXPERT,) * 3)
            if moe.shared_expert_gate:
                gate = (None, "embed"), P.SHARED_EXPERT_GATE
                rows.append(("mlp.shared_expert_gate", (1, H), "[1, hidden_size]", *gate))
    norms = ("input_layernorm", "post_attention_layernorm")
    rows += [(n, (H,), "[hidden_size]", ("embed",), None) for n in norms]
    return tuple(
        Leaf(
            name=name,
            shape=shape,
            what=what,
            axes=axes,
            role=role,
            f32=name in f32,
            bias=name.endswith("bias"),  # q/k/v_proj.bias, e_score_correction_bias
        )
        for name, shape, what, axes, role in rows
    )


def shared_expert_name(cfg: Any) -> str:
    """Where the shared expert lives: ``mlp.shared_experts`` in the NextN families (DeepSeek,
    GLM: ``n_shared_experts`` experts fused into one), ``mlp.shared_expert`` in Qwen's."""
    nextn = getattr(cfg, "first_mtp_layer", None) is not None
    return "mlp.shared_experts" if nextn else "mlp.shared_expert"


def _ffn_rows(base, lead, width, width_what, H, roles) -> list[tuple]:
    """gate/up ``[*lead, I, H]``, down ``[*lead, H, I]`` (``lead`` = ``(E,)`` for experts)."""
    e, n = ("experts",) * len(lead), "num_experts, " * len(lead)
    up = ((*lead, width, H), f"[{n}{width_what}, hidden_size]", (*e, "mlp", "embed"))
    down = ((*lead, H, width), f"[{n}hidden_size, {width_what}]", (*e, "embed", "mlp"))
    names = (f"{base}.gate_proj", f"{base}.up_proj", f"{base}.down_proj")
    return [(name, *spec, role) for name, spec, role in zip(names, (up, up, down), roles)]


def _ffn(named: Mapping[str, Any], base: str) -> DenseFfnParams:
    return DenseFfnParams(
        gate_proj=named[f"{base}.gate_proj"],
        up_proj=named[f"{base}.up_proj"],
        down_proj=named[f"{base}.down_proj"],
    )


def layer_from_named(named: Mapping[str, Any], prefix: str, *, cfg: Any) -> DecoderLayerParams:
    """The layer whose leaves are ``named[prefix + leaf.name]`` (weights, arrays or stand-ins
    such as ``jax.ShapeDtypeStruct`` or axes); a missing required leaf raises KeyError."""
    attn, mlp = f"{prefix}self_attn", f"{prefix}mlp"
    if cfg.ffn is FfnKind.DENSE:
        ffn: DenseFfnParams | MoeFfnParams = _ffn(named, mlp)
    else:
        ffn = MoeFfnParams(
            router=named[f"{mlp}.gate"],
            experts=_ffn(named, f"{mlp}.experts"),
            shared_expert=_ffn(named, prefix + shared_expert_name(cfg))
            if cfg.moe.has_shared_expert
            else None,
            shared_expert_gate=named.get(f"{mlp}.shared_expert_gate"),
            score_correction_bias=named[f"{mlp}.gate.e_score_correction_bias"]
            if cfg.moe.score_correction_bias
            else None,
        )
    if getattr(cfg, "mla", None) is not None:
        attention: AttentionParams | MlaParams = mla_from_named(named, attn)
    else:
        bias = getattr(cfg, "attention_bias", False)
        attention = AttentionParams(
            **{p: named[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
            q_norm=named.get(f"{attn}.q_norm"),
            k_norm=named.get(f"{attn}.k_norm"),
            **{f"{p}_bias": named[f"{attn}.{p}_proj.bias"] if bias else None for p in "qkv"},
        )
    return DecoderLayerParams(
        input_layernorm=named[f"{prefix}input_layernorm"],
        attention=attention,
        post_attention_layernorm=named[f"{prefix}post_attention_layernorm"],
        ffn=ffn,
    )


# ------------------------------------------------------------------------------------------
# Random initialisation.
#
# Leaves are drawn through `draw(shape) -> f32 N(0, 1)` instead of keys: `with_normal_draws`
# slices every draw out of ONE `jax.random.normal` call. Each RNG call is its own threefry
# program, and compiling one per weight dominated the initialiser's cost.


def with_normal_draws[T](key: jax.Array, build: Callable[[Draw], T]) -> T:
    """Runs ``build(draw)`` with every ``draw(shape)`` sliced from one N(0, 1) sample of ``key``.

    The draws' sizes are found by tracing ``build`` abstractly first (``jax.eval_shape``), so
    ``build`` must draw the same shapes in the same order each time (any pure builder does).
    """
    sizes: list[int] = []

    def count(shape):
        sizes.append(math.prod(shape))
        return jnp.zeros(shape, jnp.float32)

    jax.eval_shape(lambda: build(count))
    sample = jax.random.normal(key, (sum(sizes),), jnp.float32)
    offset = 0

    def draw(shape):
        nonlocal offset
        size = math.prod(shape)
        out = jax.lax.slice_in_dim(sample, offset, offset + size).reshape(shape)
        offset += size
        return out

    return build(draw)


def init_leaf(
    leaf: Leaf, draw: Draw, precision: Precision, *, dense_ffn: bool, norm_offset: float = 0.0
) -> Any:
    """A random value for ``leaf``.

    Projections: std ``1/sqrt(K)``, stored per ``projection_format``; with unit-RMS inputs
    (every projection reads a normed or O(1) vector) the outputs stay O(1). Norms: bf16
    ``norm_offset + N(0, 0.1^2)``, small but non-zero, since a zero-centred norm with w = 0 is
    the identity and would hide a wrong ``(1 + w)`` vs ``w`` convention from every test (a
    plain ``x / rms * w`` norm takes ``norm_offset = 1``). Embeddings: bf16 N(0, 1). Biases:
    N(0, 0.1^2), bf16 or (a routing bias) f32.
    """
    x = draw(leaf.shape)
    if leaf.role is not None:
        fmt = projection_format(leaf.role, precision, dense_ffn=dense_ffn)
        return quantize(x * leaf.shape[-1] ** -0.5, fmt)
    if leaf.embedding:
        return x.astype(jnp.bfloat16)
    value = 0.1 * x if leaf.bias else norm_offset + 0.1 * x
    return value if leaf.f32 else value.astype(jnp.bfloat16)


def partition_spec(value: Any, axes: tuple[str | None, ...], rules: Rules) -> Any:
    """``value``'s PartitionSpecs (one per array of a weight pytree) from the leaf's logical
    ``axes`` under ``rules``. Each array of a weight spans the leading dims of its logical
    ``[..., N, K]``: a per-row scale drops K, a per-matrix global scale drops N and K."""

    def spec(array):
        return PartitionSpec(
            *(None if a is None else rules.get(a) for a in axes[: len(array.shape)])
        )

    return jax.tree.map(spec, value)
