"""The hybrid target's weights, described once per leaf, and their random initialiser.

A full-attention layer is the library's ``DecoderLayerParams`` (``mtpjax.layers``); a GDN layer
is a ``GdnLayerParams`` with the same norms and FFN around a ``GdnParams`` mixer. Every leaf is
a ``mtpjax.layers.Leaf`` whose name is its checkpoint name relative to the text model
(``layers.{i}.linear_attn.in_proj_qkv``, ``layers.{i}.mlp.experts.gate_proj``, ``norm``); the
initialiser, the loader's expected shapes and its error messages derive from them.

The layers are stored by slot of the repeating pattern (``HybridConfig.period``): slot ``p``
holds layers ``p, p + P, p + 2P, ..`` with every leaf stacked on a leading [G] axis, so the
forward is a ``lax.scan`` over the G groups with the P slots unrolled inside.

Shapes: see ``HybridConfig``'s glossary.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mtpjax.config import FfnKind
from mtpjax.head import LMHeadParams, init_lm_head
from mtpjax.hybrid._config import GdnLayout, HybridConfig, LayerType
from mtpjax.layers import Leaf, init_leaf, layer_from_named, layer_leaves, with_normal_draws
from mtpjax.layers.decoder import DecoderLayerParams
from mtpjax.layers.ffn import DenseFfnParams, MoeFfnParams
from mtpjax.weights import Precision, Projection, Weight, parse_precision

__all__ = [
    "GdnLayerParams",
    "GdnParams",
    "HybridParams",
    "check_params",
    "from_named",
    "init",
    "layer_leaves_of",
    "model_leaves",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class GdnParams:
    """One Gated DeltaNet mixer (``linear_attn.*``); the layout's unused projections are None.

    Packed (Qwen3-Next): in_proj_qkvz [2*Hk*dk + 2*Hv*dv, H], in_proj_ba [2*Hv, H], grouped
    per key head (``GdnLayout.PACKED``). Split (Qwen3.5): in_proj_qkv [C, H], in_proj_z
    [Hv*dv, H], in_proj_b / in_proj_a [Hv, H]. Both: conv1d [C, 1, K] (the depthwise conv over
    q | k | v), dt_bias [Hv], A_log [Hv], norm [dv] (the gated output norm's weight, NOT
    zero-centred), out_proj [H, Hv*dv].
    """

    in_proj_qkvz: Weight | None = None
    in_proj_ba: Weight | None = None
    in_proj_qkv: Weight | None = None
    in_proj_z: Weight | None = None
    in_proj_b: Weight | None = None
    in_proj_a: Weight | None = None
    conv1d: jax.Array
    dt_bias: jax.Array
    A_log: jax.Array
    norm: jax.Array
    out_proj: Weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class GdnLayerParams:
    """A GDN decoder layer: input_layernorm [H], the mixer, post_attention_layernorm [H], and a
    dense or MoE FFN (as in ``DecoderLayerParams``)."""

    input_layernorm: jax.Array
    linear_attn: GdnParams
    post_attention_layernorm: jax.Array
    ffn: DenseFfnParams | MoeFfnParams


LayerParams = DecoderLayerParams | GdnLayerParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridParams:
    """layers: one entry per slot of the layer pattern (``DecoderLayerParams`` for full
    attention, ``GdnLayerParams`` for GDN), each leaf stacked on a leading [G] axis;
    final_norm: [H] (zero-centred). The embedding and LM head are ``LMHeadParams``."""

    layers: tuple[LayerParams, ...]
    final_norm: jax.Array


# ------------------------------------------------------------------------------------------
# The description.


@dataclasses.dataclass(frozen=True)
class _LayerView:
    """``cfg`` as ``mtpjax.layers`` reads it for one layer: its own FFN kind, every other
    attribute the config's."""

    cfg: HybridConfig
    ffn: FfnKind

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cfg, name)


def layer_view(cfg: HybridConfig, layer: int) -> _LayerView:
    return _LayerView(cfg, cfg.ffn_kinds[layer])


def _gdn_leaves(cfg: HybridConfig) -> tuple[Leaf, ...]:
    H, C, Hv, dv = (
        cfg.hidden_size,
        cfg.conv_dim,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
    )
    kd = "linear_num_key_heads * linear_key_head_dim"
    vd = "linear_num_value_heads * linear_value_head_dim"
    hv = "linear_num_value_heads"
    into, out = ("heads", "embed"), ("embed", "heads")
    # The projection roles pick init's storage format: the inputs and out_proj are stored like
    # attention projections; the per-head gates b and a, tiny and precision-sensitive like a
    # router, stay BF16.
    P = Projection
    if cfg.gdn_layout is GdnLayout.PACKED:
        rows = [
            ("in_proj_qkvz", (2 * cfg.key_dim + 2 * cfg.value_dim, H), f"[2 * {kd} + 2 * {vd}, hidden_size]", into, P.Q_PROJ),
            ("in_proj_ba", (2 * Hv, H), f"[2 * {hv}, hidden_size]", into, P.ROUTER),
        ]  # fmt: skip
    else:
        rows = [
            ("in_proj_qkv", (C, H), f"[2 * {kd} + {vd}, hidden_size]", into, P.Q_PROJ),
            ("in_proj_z", (cfg.value_dim, H), f"[{vd}, hidden_size]", into, P.Q_PROJ),
            ("in_proj_b", (Hv, H), f"[{hv}, hidden_size]", into, P.ROUTER),
            ("in_proj_a", (Hv, H), f"[{hv}, hidden_size]", into, P.ROUTER),
        ]
    rows += [
        ("conv1d", (C, 1, cfg.linear_conv_kernel_dim), f"[2 * {kd} + {vd}, 1, linear_conv_kernel_dim]", ("heads", None, None), None),
        ("dt_bias", (Hv,), f"[{hv}]", ("heads",), None),
        ("A_log", (Hv,), f"[{hv}]", ("heads",), None),
        ("norm", (dv,), "[linear_value_head_dim]", (None,), None),
        ("out_proj", (H, cfg.value_dim), f"[hidden_size, {vd}]", out, P.O_PROJ),
    ]  # fmt: skip
    return tuple(
        Leaf(name=f"linear_attn.{name}", shape=shape, what=what, axes=axes, role=role)
        for name, shape, what, axes, role in rows
    )


def layer_leaves_of(cfg: HybridConfig, layer: int) -> tuple[Leaf, ...]:
    """The leaves of decoder layer ``layer`` (names relative to ``layers.{layer}.``), in the
    initialiser's draw order: the library's full-attention layer, or the GDN mixer followed by
    the same FFN and norms."""
    leaves = layer_leaves(layer_view(cfg, layer))
    if cfg.layer_types[layer] is LayerType.FULL_ATTENTION:
        return leaves
    return _gdn_leaves(cfg) + tuple(f for f in leaves if not f.name.startswith("self_attn."))


def model_leaves(cfg: HybridConfig) -> tuple[tuple[str, Leaf], ...]:
    """``(name relative to the text model, leaf)`` for every layer leaf and the final norm."""
    final = Leaf(name="norm", shape=(cfg.hidden_size,), what="[hidden_size]", axes=("embed",))
    return (
        *(
            (f"layers.{i}.{leaf.name}", leaf)
            for i in range(cfg.num_hidden_layers)
            for leaf in layer_leaves_of(cfg, i)
        ),
        ("norm", final),
    )


def _layer_from_named(named: Mapping[str, Any], prefix: str, cfg: HybridConfig, i: int):
    view = layer_view(cfg, i)
    if cfg.layer_types[i] is LayerType.FULL_ATTENTION:
        return layer_from_named(named, prefix, cfg=view)
    # The shared builder assembles the norms and the FFN; a GDN layer has no self_attn leaves.
    absent = {f"{prefix}self_attn.{p}": None for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    shared = layer_from_named(collections.ChainMap(named, absent), prefix, cfg=view)
    gdn = {
        f.name: named.get(f"{prefix}linear_attn.{f.name}") for f in dataclasses.fields(GdnParams)
    }
    return GdnLayerParams(
        input_layernorm=shared.input_layernorm,
        linear_attn=GdnParams(**gdn),
        post_attention_layernorm=shared.post_attention_layernorm,
        ffn=shared.ffn,
    )


def from_named(named: Mapping[str, Any], cfg: HybridConfig) -> HybridParams:
    """The params whose leaves are ``named[name]`` (names as ``model_leaves``), stacked by slot;
    a missing required leaf raises KeyError."""
    layers = [
        _layer_from_named(named, f"layers.{i}.", cfg, i) for i in range(cfg.num_hidden_layers)
    ]
    P = cfg.period
    slots = tuple(jax.tree.map(lambda *a: jnp.stack(a), *layers[p::P]) for p in range(P))
    return HybridParams(layers=slots, final_norm=named["norm"])


def check_params(params: HybridParams, cfg: HybridConfig) -> None:
    """Raises naming the slot when ``params`` does not have ``cfg``'s layer pattern."""
    if not isinstance(params, HybridParams):
        raise TypeError(f"params must be HybridParams, got {type(params).__name__}")
    if len(params.layers) != cfg.period:
        raise ValueError(
            f"params hold {len(params.layers)} layer slots, the config's pattern has "
            f"period={cfg.period}"
        )
    for p, layer in enumerate(params.layers):
        want = (
            DecoderLayerParams if cfg.layer_types[p] is LayerType.FULL_ATTENTION else GdnLayerParams
        )
        if not isinstance(layer, want):
            raise TypeError(
                f"params.layers[{p}] is {type(layer).__name__}, expected {want.__name__} for "
                f"layer_types[{p}]={cfg.layer_types[p].value}"
            )


# ------------------------------------------------------------------------------------------
# Random initialisation.


def _gdn_array(name: str, draw, leaf: Leaf, cfg: HybridConfig) -> jax.Array:
    """The GDN arrays' random values (bf16): conv taps with std 1/sqrt(K); A_log around -2 and
    dt_bias around 0, so that g = -exp(A_log) * softplus(a + dt_bias) keeps a memory of about
    ten positions; the output norm's weight around 1 (it multiplies, unlike the zero-centred
    norms)."""
    x = draw(leaf.shape)
    scale, offset = {
        "conv1d": (cfg.linear_conv_kernel_dim**-0.5, 0.0),
        "A_log": (0.5, -2.0),
        "dt_bias": (0.5, 0.0),
        "norm": (0.1, 1.0),
    }[name]
    return (offset + scale * x).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init(cfg: HybridConfig, key: jax.Array, precision: Precision) -> HybridParams:
    leaves = model_leaves(cfg)

    def value(name: str, leaf: Leaf, draw) -> Any:
        local = name.rpartition(".")[2]
        if leaf.name.startswith("linear_attn.") and leaf.role is None:
            return _gdn_array(local, draw, leaf, cfg)
        # A target has no drafter-prefill rule: every projection takes the asked format.
        return init_leaf(leaf, draw, precision, dense_ffn=False)

    def build(draw) -> HybridParams:
        return from_named({n: value(n, leaf, draw) for n, leaf in leaves}, cfg)

    return with_normal_draws(key, build)


def init(
    cfg: HybridConfig, *, key: jax.Array, precision: Precision | str = Precision.BF16
) -> tuple[HybridParams, LMHeadParams]:
    """Random weights for ``cfg``: ``(params, head)``.

    Projections have std 1/sqrt(fan_in) and are stored per ``precision`` (``bf16 | fp8 |
    nvfp4``; the GDN gates b/a, the router and the shared-expert gate stay BF16); norm weights
    are small (zero-centred norms near the identity). The head is ``init_lm_head``'s (tied when
    ``cfg.tie_word_embeddings``), at the same precision.
    """
    if not isinstance(cfg, HybridConfig):
        raise TypeError(f"cfg must be a HybridConfig, got {type(cfg).__name__}")
    k_layers, k_head = jax.random.split(key)
    precision = parse_precision(precision)
    params = _init(cfg, k_layers, precision)
    head = init_lm_head(cfg.lm_head_config(), key=k_head, precision=precision.value)
    return params, head
