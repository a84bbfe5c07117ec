"""Weights of the drafter: one MTP module (``DrafterParams``), N modules with the static schedule
that runs them (``DrafterModules``), their random initialisers and the drafter's KV pool rule.

A module owns ``fc`` and its norms, one decoder layer and the final ``mtp.norm``; the embedding
and the LM head are the target's, passed separately as ``mtpjax.head.LMHeadParams`` (a head with
``mtp_use_dedicated_embeddings`` carries its own embedding table here). Checkpoint names are
the family's (``module_leaves``): Qwen's modules share ``mtp.{fc, pre_fc_norm_*, norm}`` and own
layer ``mtp.layers.{i}``; a NextN module (DeepSeek-V3, GLM) is ``model.layers.{first_mtp_layer +
i}.{eh_proj, enorm, hnorm, shared_head.norm}`` beside its layer's leaves, a MiMo module
``model.mtp_layers.{i}.{input_proj, token_layernorm, hidden_layernorm, final_layernorm}``.

Shapes: ``H`` hidden, ``V`` vocab.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping
from typing import Any

import jax

from mtpjax.config import Architecture, DrafterConfig, FfnKind
from mtpjax.kv import KVDtype, PoolConfig
from mtpjax.layers import (
    Leaf,
    Rules,
    init_leaf,
    layer_from_named,
    layer_leaves,
    partition_spec,
    with_normal_draws,
)
from mtpjax.layers.decoder import DecoderLayerParams
from mtpjax.layers.mla import MlaParams
from mtpjax.weights import (
    Precision,
    Projection,
    Weight,
    WeightFormat,
    parse_precision,
    supports_drafter_prefill,
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "fc",
        "pre_fc_norm_embedding",
        "pre_fc_norm_hidden",
        "layer",
        "norm",
        "embed_tokens",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterParams:
    """One MTP head (checkpoint names in brackets: Qwen; NextN (DeepSeek-V3, GLM-4.5); MiMo).

    Attributes:
      fc: [H, 2H] over the two normed inputs, concatenated in ``cfg.input_order`` (mtp.fc;
        eh_proj; input_proj).
      pre_fc_norm_embedding: [H] (mtp.pre_fc_norm_embedding; enorm; token_layernorm).
      pre_fc_norm_hidden: [H] (mtp.pre_fc_norm_hidden; hnorm; hidden_layernorm).
      layer: the decoder layer (mtp.layers.{i}.*; the module's own prefix).
      norm: [H] final norm producing h_out (mtp.norm; shared_head.norm; final_layernorm).
      embed_tokens: bf16[V, H] dedicated MTP embedding, or None to use the target's
        (``mtp_use_dedicated_embeddings``).
    """

    fc: Weight
    pre_fc_norm_embedding: jax.Array
    pre_fc_norm_hidden: jax.Array
    layer: DecoderLayerParams
    norm: jax.Array
    embed_tokens: jax.Array | None = None


def check_runnable(cfg: DrafterConfig) -> None:
    """Raises ValueError when the drafter does not implement ``cfg`` (names the reason)."""
    if not isinstance(cfg, DrafterConfig):
        raise TypeError(f"cfg must be a DrafterConfig, got {type(cfg).__name__}")
    if not cfg.runnable:
        raise ValueError(f"cannot run a {cfg.architecture.value} drafter: {cfg.unsupported_reason}")


def init(
    cfg: DrafterConfig, *, key: jax.Array, precision: Precision | str = Precision.BF16
) -> DrafterParams:
    """Random head weights for ``cfg``, each projection stored per ``projection_format``.

    Projections have std ``1/sqrt(fan_in)`` and read normed inputs, so activations stay O(1);
    norm weights are small (zero-centred: ``1 + w`` near 1). ``precision`` is
    ``nvfp4 | fp4 | fp8 | bf16`` (a dense head asked for NVFP4 keeps fc/k/v BF16). Runs as one
    jitted program (weights are generated and quantised on device).
    """
    check_runnable(cfg)
    return _init(cfg, key, parse_precision(precision))


# Each family's names for the module-level leaves (the fields of DrafterParams), relative to
# where they live: Qwen's ``mtp.`` (shared by every module), a NextN or MiMo module's prefix.
_MODULE_NAMES = {
    "qwen": dict(
        fc="fc",
        pre_fc_norm_embedding="pre_fc_norm_embedding",
        pre_fc_norm_hidden="pre_fc_norm_hidden",
        norm="norm",
    ),
    "nextn": dict(
        fc="eh_proj",
        pre_fc_norm_embedding="enorm",
        pre_fc_norm_hidden="hnorm",
        norm="shared_head.norm",
    ),
    "mimo": dict(
        fc="input_proj",
        pre_fc_norm_embedding="token_layernorm",
        pre_fc_norm_hidden="hidden_layernorm",
        norm="final_layernorm",
    ),
}


def _naming(cfg: DrafterConfig) -> str:
    if cfg.first_mtp_layer is not None:
        return "nextn"
    return "mimo" if cfg.architecture is Architecture.MIMO else "qwen"


def module_prefix(cfg: DrafterConfig, index: int) -> str:
    """Where MTP module ``index``'s decoder layer lives, and its module-level leaves but for
    Qwen's (shared under ``mtp.``): ``mtp.layers.{i}.`` (Qwen),
    ``model.layers.{first_mtp_layer + i}.`` (NextN: DeepSeek-V3, GLM),
    ``model.mtp_layers.{i}.`` (MiMo). The converter records the same in the manifest's
    ``mtp_prefixes``."""
    naming = _naming(cfg)
    if naming == "nextn":
        return f"model.layers.{cfg.first_mtp_layer + index}."
    return f"model.mtp_layers.{index}." if naming == "mimo" else f"mtp.layers.{index}."


def _module_base(cfg: DrafterConfig, index: int) -> str:
    """Where module ``index``'s module-level leaves live."""
    return "mtp." if _naming(cfg) == "qwen" else module_prefix(cfg, index)


def shared_leaves(cfg: DrafterConfig) -> tuple[Leaf, ...]:
    """The module-level leaves (input projection, its two norms, the final norm, a dedicated
    embedding), named as the family's checkpoint names them, in the initialiser's draw order;
    Qwen's are shared by every module (under ``mtp.``), a NextN / MiMo module owns its own. A
    module's layer is ``layer_leaves(cfg)``."""
    H = cfg.hidden_size
    names = _MODULE_NAMES[_naming(cfg)]
    fc_what = "[hidden_size, 2 * hidden_size]"
    fc = Leaf(
        name=names["fc"],
        shape=(H, 2 * H),
        what=fc_what,
        axes=("embed", "fc_in"),
        role=Projection.FC,
    )
    norms = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    leaves = [
        fc,
        *(Leaf(name=names[n], shape=(H,), what="[hidden_size]", axes=("embed",)) for n in norms),
    ]
    if cfg.mtp_use_dedicated_embeddings:
        what = "[vocab_size, hidden_size] (mtp_use_dedicated_embeddings)"
        axes = ("vocab_in", "embed")
        leaves.append(
            Leaf(
                name="embed_tokens", shape=(cfg.vocab_size, H), what=what, axes=axes, embedding=True
            )
        )
    return tuple(leaves)


def module_leaves(cfg: DrafterConfig, index: int) -> tuple[tuple[str, Leaf], ...]:
    """``(checkpoint name, leaf)`` for every leaf of MTP module ``index``: the module-level
    leaves (Qwen's shared ``mtp.*``) and its decoder layer, under ``module_prefix``."""
    base, prefix = _module_base(cfg, index), module_prefix(cfg, index)
    return (
        *((base + leaf.name, leaf) for leaf in shared_leaves(cfg)),
        *((prefix + leaf.name, leaf) for leaf in layer_leaves(cfg)),
    )


def from_named(named: Mapping[str, Any], cfg: DrafterConfig, index: int = 0) -> DrafterParams:
    """MTP module ``index`` (named as in ``module_leaves``) from ``named[checkpoint name]``
    (weights, arrays, or stand-ins such as ``jax.ShapeDtypeStruct`` or PartitionSpecs); a
    missing required leaf raises KeyError."""
    base, names = _module_base(cfg, index), _MODULE_NAMES[_naming(cfg)]
    return DrafterParams(
        **{field: named[base + name] for field, name in names.items()},
        layer=layer_from_named(named, module_prefix(cfg, index), cfg=cfg),
        embed_tokens=named.get(base + "embed_tokens") if cfg.mtp_use_dedicated_embeddings else None,
    )


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init(cfg: DrafterConfig, key: jax.Array, precision: Precision) -> DrafterParams:
    dense = cfg.ffn is FfnKind.DENSE
    leaves = module_leaves(cfg, 0)
    offset = 0.0 if cfg.zero_centered_norm else 1.0

    def build(draw) -> DrafterParams:
        named = {
            n: init_leaf(leaf, draw, precision, dense_ffn=dense, norm_offset=offset)
            for n, leaf in leaves
        }
        return from_named(named, cfg)

    return with_normal_draws(key, build)


def partition_specs(params: DrafterParams, cfg: DrafterConfig, rules: Rules) -> DrafterParams:
    """``params``' PartitionSpecs (same structure) from its leaves' logical axes under ``rules``,
    e.g. ``{"heads": "tp", "kv_heads": "tp", "mlp": "tp", "experts": "ep"}``; place with
    ``jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))``."""
    axes = from_named({n: _Axes(leaf.axes) for n, leaf in module_leaves(cfg, 0)}, cfg)
    return jax.tree.map(
        lambda a, value: partition_spec(value, a.axes, rules),
        axes,
        params,
        is_leaf=lambda x: isinstance(x, _Axes),
    )


@dataclasses.dataclass(frozen=True)
class _Axes:
    """A leaf's logical axes standing in for its value (a pytree leaf, unlike a tuple)."""

    axes: tuple[str | None, ...]


def projection_formats(params: DrafterParams) -> dict[str, WeightFormat]:
    """Storage format of the head's attention and input projections, by checkpoint name (MLA:
    ``q_proj`` is the one that emits the queries, and ``kv_a_proj_with_mqa``, which makes a
    whole cache row, stands for ``k_proj`` and ``v_proj``)."""
    attn = params.layer.attention
    if isinstance(attn, MlaParams):
        row = attn.kv_a_proj_with_mqa.format
        return {
            "fc": params.fc.format,
            "q_proj": attn.query_projection.format,
            "k_proj": row,
            "v_proj": row,
            "o_proj": attn.o_proj.format,
        }
    return {
        "fc": params.fc.format,
        "q_proj": attn.q_proj.format,
        "k_proj": attn.k_proj.format,
        "v_proj": attn.v_proj.format,
        "o_proj": attn.o_proj.format,
    }


def supports_prefill(params: DrafterParams) -> bool:
    """True iff the drafter prefill can run on these weights (fc, k_proj, v_proj all BF16)."""
    return supports_drafter_prefill(projection_formats(params))


def check_prefill_support(params: DrafterParams) -> None:
    """Raises ValueError naming the offending formats unless fc, k_proj and v_proj are BF16."""
    formats = projection_formats(params)
    if not supports_drafter_prefill(formats):
        found = ", ".join(f"{n}={formats[n].value}" for n in ("fc", "k_proj", "v_proj"))
        raise ValueError(
            "the drafter prefill needs fc, k_proj and v_proj stored BF16; this head has "
            f"{found}. Load the head at bf16 (or a dense head at nvfp4, which keeps them BF16), "
            "or write the prompt's pairs through propose instead"
        )


class ModuleSchedule(enum.Enum):
    """Which module runs draft step ``s`` of a round (N modules)."""

    CLAMP = "clamp"  # module s; more drafts than modules are clamped to N (the seed engine)
    CYCLE = "cycle"  # module s mod N (vLLM's rule); num_drafts must be a multiple of N


def effective_num_drafts(num_modules: int, num_drafts: int, schedule: ModuleSchedule) -> int:
    """K, the drafts a round produces: ``min(num_drafts, N)`` for CLAMP, ``num_drafts`` (a
    multiple of N, else ValueError) for CYCLE. All static Python ints."""
    if not isinstance(num_drafts, int) or isinstance(num_drafts, bool) or num_drafts < 1:
        raise ValueError(
            f"num_drafts must be an int >= 1, got {num_drafts!r}"
        )  # a bool is no count
    if schedule is ModuleSchedule.CLAMP:
        return min(num_drafts, num_modules)
    if num_drafts % num_modules:
        raise ValueError(
            f"the CYCLE schedule runs module s mod N, so num_drafts must be a multiple of "
            f"N={num_modules} modules (got {num_drafts}); ask for "
            f"{num_modules * max(num_drafts // num_modules, 1)} or use ModuleSchedule.CLAMP"
        )
    return num_drafts


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["modules"], meta_fields=["schedule"]
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterModules:
    """The weights of N MTP modules and the (static) schedule that runs them.

    Attributes:
      modules: one ``DrafterParams`` per module, in step order (non-empty; a list is taken as a
        tuple). All share one ``DrafterConfig``.
      schedule: static ``ModuleSchedule`` (part of the pytree structure, like a config).

    The steps take a bare ``DrafterParams`` too: it is the one-module drafter under CYCLE (the
    single head chains itself for every draft).
    """

    modules: tuple[DrafterParams, ...]
    schedule: ModuleSchedule = ModuleSchedule.CLAMP

    def __post_init__(self) -> None:
        # Pytree prefixes (sharding specs, vmap axes) hold other leaves: types are checked later.
        if isinstance(self.modules, list):
            object.__setattr__(self, "modules", tuple(self.modules))
        if isinstance(self.modules, tuple) and not self.modules:
            raise ValueError(
                "DrafterModules needs at least one module (got 0); a checkpoint without MTP "
                "weights cannot make a drafter"
            )
        if not isinstance(self.schedule, ModuleSchedule):
            raise TypeError(f"schedule must be a ModuleSchedule, got {self.schedule!r}")

    @property
    def num_modules(self) -> int:
        return len(self.modules)

    @classmethod
    def from_checkpoint(
        cls, checkpoint, *, schedule: ModuleSchedule = ModuleSchedule.CLAMP
    ) -> DrafterModules:
        """The modules of a loaded ``DrafterCheckpoint`` (its ``head`` is passed separately)."""
        return cls(modules=tuple(checkpoint.modules), schedule=schedule)


def as_modules(params: DrafterParams | DrafterModules, cfg: DrafterConfig) -> DrafterModules:
    """The steps' input as ``DrafterModules`` (a bare ``DrafterParams`` is one CYCLE module),
    checked against ``cfg``: an explicit module tuple must hold ``cfg.num_mtp_modules``."""
    check_runnable(cfg)
    if isinstance(params, DrafterParams):
        return DrafterModules(modules=(params,), schedule=ModuleSchedule.CYCLE)
    if not isinstance(params, DrafterModules):
        raise TypeError(
            f"params must be DrafterParams or DrafterModules, got {type(params).__name__}"
        )
    for i, module in enumerate(params.modules):
        if not isinstance(module, DrafterParams):
            raise TypeError(f"module {i} must be DrafterParams, got {type(module).__name__}")
    if params.num_modules != cfg.num_mtp_modules:
        raise ValueError(
            f"DrafterModules holds {params.num_modules} modules but cfg.num_mtp_modules="
            f"{cfg.num_mtp_modules}; pass dataclasses.replace(cfg, num_mtp_modules="
            f"{params.num_modules}) to run a subset of a checkpoint's modules"
        )
    return params


def init_modules(
    cfg: DrafterConfig,
    *,
    key: jax.Array,
    precision: Precision | str = Precision.BF16,
    schedule: ModuleSchedule = ModuleSchedule.CLAMP,
) -> DrafterModules:
    """Random weights for ``cfg.num_mtp_modules`` independent modules (one key split each),
    each as ``init`` makes them."""
    check_runnable(cfg)
    keys = jax.random.split(key, cfg.num_mtp_modules)
    # A module's weights do not depend on the module count: share the single head's program.
    module_cfg = dataclasses.replace(cfg, num_mtp_modules=1)
    return DrafterModules(
        modules=tuple(init(module_cfg, key=k, precision=precision) for k in keys),
        schedule=schedule,
    )


def pool_config(
    cfg: DrafterConfig,
    *,
    precision: Precision | str,
    max_seq_len: int,
    max_seqs: int,
    block_size: int = 16,
    main_kv_blocks: int | None = None,
    kv_dtype: KVDtype | None = None,
) -> PoolConfig:
    """The drafter's paged KV pool: BF16 rows for BF16/FP8 heads, FP8 for NVFP4 heads.

    Sized by the pool rule (``PoolConfig.for_sequences``); ``kv_dtype`` overrides the default.
    Rows per ``kv_row_spec``: GQA keys and values, or MLA's latent rows.
    """
    if kv_dtype is None:
        nvfp4 = parse_precision(precision) is Precision.NVFP4
        kv_dtype = KVDtype.FP8 if nvfp4 else KVDtype.BF16
    heads, width, value_dim = kv_row_spec(cfg)
    return PoolConfig.for_sequences(
        num_kv_heads=heads,
        head_dim=width,
        value_dim=value_dim,
        max_seq_len=max_seq_len,
        max_seqs=max_seqs,
        block_size=block_size,
        kv_dtype=kv_dtype,
        main_kv_blocks=main_kv_blocks,
    )


def kv_row_spec(cfg: DrafterConfig) -> tuple[int, int, int | None]:
    """``(heads, key width, value_dim)`` of a cache row: GQA ``(Nkv, D, None)`` (separate K and
    V rows); MLA ``(1, kv_lora_rank + qk_rope_head_dim, kv_lora_rank)``, the latent and the RoPE
    key in one row whose latent is also the value (DeepSeek-V3: 576 values per token, 1152 bytes
    in BF16, against 128 heads * (192 + 128) = 40960 values expanded)."""
    if cfg.mla is not None:
        return 1, cfg.mla.latent_width, cfg.mla.kv_lora_rank
    return cfg.num_key_value_heads, cfg.head_dim, None
