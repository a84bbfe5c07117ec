"""Which source tensors make which converted tensor, per checkpoint family, and how converted
tensors assemble into the drafter's params.

A conversion ``Plan`` is a list of ``Entry``: one converted tensor each, with its canonical name,
the source tensor(s) it is read from, its expected logical shape, and its projection role (which
decides its storage format under a requested precision). Converted names are the source names
without ``.weight``, per-expert tensors stacked under ``...mlp.experts.{gate,up,down}_proj``, and
the target's tensors under ``head.*``:

  head.embedding       {text}embed_tokens.weight     bf16[V, H]
  head.weight          lm_head.weight                [V, H] (the embedding when tied: no lm_head)
  head.final_norm      {text}norm.weight             [H] (when present)

where ``{text}`` is ``model.language_model.`` (Qwen3.5/3.6) or ``model.`` (everything else).

Families:
  Qwen3-Next, Qwen3.5   ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}`` shared by
                        every module; module ``i`` is ``mtp.layers.{i}.*``; experts per expert
                        (``mlp.experts.{e}.{gate,up,down}_proj``) or packed (Qwen3.6:
                        ``mlp.experts.gate_up_proj [E, 2I, H]`` gate rows first,
                        ``mlp.experts.down_proj [E, H, I]``); runnable.
  DeepSeek-V3, GLM-4.5  module ``i`` is ``model.layers.{num_hidden_layers + i}.*`` (``enorm``,
  GLM-4.7-Flash         ``hnorm``, ``eh_proj``, a full layer, ``shared_head.{norm, head}``);
                        converted as a named tensor tree under the source names (experts
                        stacked), which assembles into the drafter (DeepSeek-V3's and
                        GLM-4.7-Flash's MLA + MoE layer, GLM-4.5's GQA + MoE layer;
                        ``shared_head.head`` and a module's own ``embed_tokens`` are kept but
                        unused: the target's head serves); runnable but for DeepSeek-V3.2.
  MiMo                  ``model.mtp_layers.{i}.*`` (``token_layernorm``, ``hidden_layernorm``,
                        ``input_proj``, ``final_layernorm``, a Qwen2 layer); named tree,
                        runnable.
  MiniMax-M2            its published weights hold no MTP tensors: converting fails, naming the
                        prefixes searched.

Shapes: ``H`` hidden, ``V`` vocab, ``E`` experts, ``I`` expert width, ``D`` head dim.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from mtpjax.checkpoint._formats import companion_names
from mtpjax.checkpoint._safetensors_io import CheckpointError, SafetensorsCheckpoint
from mtpjax.config import Architecture, DrafterConfig
from mtpjax.drafter import DrafterParams, from_named, module_leaves, module_prefix
from mtpjax.head import LMHeadParams
from mtpjax.layers import Leaf
from mtpjax.weights import Projection, parse_projection

__all__ = [
    "Assembly",
    "DrafterCheckpoint",
    "Entry",
    "EntryKind",
    "Plan",
    "assemble",
    "plan",
]

HEAD_EMBEDDING = "head.embedding"
HEAD_WEIGHT = "head.weight"
HEAD_FINAL_NORM = "head.final_norm"


class EntryKind(enum.Enum):
    """What a converted tensor is."""

    WEIGHT = "weight"  # a projection, stored as a weight pytree (Bf16Weight, Nvfp4Weight...)
    ARRAY = "array"  # kept as an array in its own dtype: norm weights, biases, routing bias
    EMBEDDING = "embedding"  # an embedding table, stored bf16[V, H]


class Assembly(enum.Enum):
    """How an entry's source tensors become one converted tensor."""

    SINGLE = "single"  # one source tensor
    STACK = "stack"  # per-expert sources [N, K], stacked into [E, N, K]
    PACKED_GATE = "packed_gate"  # rows [0, I) of each expert of a packed [E, 2I, H] source
    PACKED_UP = "packed_up"  # rows [I, 2I) of the same
    PACKED = "packed"  # a packed [E, N, K] source taken whole


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One converted tensor.

    Attributes:
      name: its name in the converted checkpoint.
      kind: weight pytree, plain array or embedding table.
      sources: the source tensors read (full names; a projection's ``....weight``, whose
        companions are found beside it).
      shape: expected logical shape (``[E, N, K]`` when stacked), or None to take the source's.
      what: how the expected shape follows from the config, for error messages.
      role: projection role deciding the storage format (weights only).
      head: the LM head, stored at the head precision rather than by ``projection_format``.
      assembly: how the sources combine.
    """

    name: str
    kind: EntryKind
    sources: tuple[str, ...]
    shape: tuple[int, ...] | None = None
    what: str = ""
    role: Projection | None = None
    head: bool = False
    assembly: Assembly = Assembly.SINGLE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything a conversion reads and writes, decided from names (and headers) alone."""

    layout: str  # qwen | qwen_packed_experts | nextn | mimo | generic
    entries: tuple[Entry, ...]
    mtp_prefixes: tuple[str, ...]  # where each MTP module's tensors were found
    tied_embeddings: bool  # no lm_head tensor: the embedding serves as the head


# --------------------------------------------------------------------------------------------
# Where each family states its number of MTP modules (for messages).

_COUNT_KEYS = {
    Architecture.QWEN3_NEXT: "num_nextn_predict_layers",
    Architecture.QWEN3_5: "text_config.mtp_num_hidden_layers",
    Architecture.DEEPSEEK_V3: "num_nextn_predict_layers",
    Architecture.GLM4_MOE: "num_nextn_predict_layers",
    Architecture.GLM4_MOE_LITE: "num_nextn_predict_layers",
    Architecture.MIMO: "num_nextn_predict_layers",
    Architecture.MINIMAX_M2: "num_mtp_modules",
}


def _modules(n: int) -> str:
    return f"{n} MTP module{'s' if n != 1 else ''}"


def _quoted(prefixes: Sequence[str]) -> str:
    quoted = [repr(p + (".." if p.endswith(".") else "...")) for p in prefixes]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _no_mtp(
    cfg: DrafterConfig, source: str, prefixes: Sequence[str], index: int | None = None
) -> CheckpointError:
    """No tensor under ``prefixes``: of any MTP module, or (``index``) of module ``index``."""
    key = _COUNT_KEYS[cfg.architecture]
    what = ": this checkpoint ships no MTP weights" if index is None else f" (MTP module {index})"
    return CheckpointError(
        f"config.json declares {_modules(cfg.num_mtp_modules)} ({key}) but {source} has no "
        f"tensor under {_quoted(prefixes)}{what}"
    )


def _has_prefix(names: Sequence[str], prefix: str) -> bool:
    return any(n.startswith(prefix) for n in names)


def _check_present(entries: Sequence[Entry], names: set[str], source: str) -> None:
    missing = [s for e in entries for s in e.sources if s not in names]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise CheckpointError(
            f"{source} lacks {len(missing)} tensor{'s' if len(missing) != 1 else ''} the "
            f"conversion needs: {shown}{more}"
        )


# --------------------------------------------------------------------------------------------
# The target's embedding, LM head and final norm.


def text_prefix(names: set[str]) -> str:
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in names:
            return prefix
    raise CheckpointError(
        "the checkpoint has no embedding: neither 'model.language_model.embed_tokens.weight' "
        "nor 'model.embed_tokens.weight'"
    )


def _head_entries(cfg: DrafterConfig, names: set[str], source: str) -> tuple[list[Entry], bool]:
    text = text_prefix(names)
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = text + "embed_tokens.weight"
    lm_head = "lm_head.weight"
    tied = lm_head not in names
    if tied and not cfg.tie_word_embeddings:
        # Using the embedding as an untied model's head would run, and draft garbage.
        raise CheckpointError(
            f"{source} has no {lm_head!r}, but config.json sets tie_word_embeddings: false "
            "(the LM head is its own tensor); refusing to use the embedding as the head"
        )
    entries = [
        Entry(
            name=HEAD_EMBEDDING,
            kind=EntryKind.EMBEDDING,
            sources=(embed,),
            shape=(V, H),
            what="[vocab_size, hidden_size]",
        ),
        Entry(
            name=HEAD_WEIGHT,
            kind=EntryKind.WEIGHT,
            sources=(embed if tied else lm_head,),
            shape=(V, H),
            what="[vocab_size, hidden_size]",
            head=True,
        ),
    ]
    if text + "norm.weight" in names:
        entries.append(
            Entry(
                name=HEAD_FINAL_NORM,
                kind=EntryKind.ARRAY,
                sources=(text + "norm.weight",),
                shape=(H,),
                what="[hidden_size]",
            )
        )
    return entries, tied


# --------------------------------------------------------------------------------------------
# Qwen3-Next / Qwen3.5 / Qwen3.6.


def _described(name: str, leaf: Leaf, **kw: Any) -> Entry:
    """The entry of a described leaf stored under ``name``."""
    kind = EntryKind.ARRAY if leaf.role is None else EntryKind.WEIGHT
    return Entry(
        name=name,
        kind=EntryKind.EMBEDDING if leaf.embedding else kind,
        sources=kw.pop("sources", (name + ".weight",)),
        shape=leaf.shape,
        what=leaf.what,
        role=leaf.role,
        **kw,
    )


def _qwen_module(cfg: DrafterConfig, names: set[str], index: int, shared: bool) -> list[Entry]:
    """Module ``index``'s entries from its description (with the shared ``mtp.*`` leaves when
    ``shared``); routed experts are stacked per expert or taken from a packed
    ``gate_up_proj [E, 2I, H]`` (gate rows first) / ``down_proj [E, H, I]``."""
    entries = []
    for name, leaf in module_leaves(cfg, index):
        if not name.startswith("mtp.layers.") and not shared:
            continue
        base, _, proj = name.rpartition(".")
        if not base.endswith(".mlp.experts"):
            entries.append(_described(name, leaf))
            continue
        packed = next(
            (n for n in (f"{base}.gate_up_proj", f"{base}.gate_up_proj.weight") if n in names), None
        )
        if packed is None:
            E = cfg.moe.num_experts
            sources = tuple(f"{base}.{e}.{proj}.weight" for e in range(E))
            entries.append(_described(name, leaf, sources=sources, assembly=Assembly.STACK))
        elif proj == "down_proj":
            sources = (packed.replace("gate_up_proj", "down_proj"),)
            entries.append(_described(name, leaf, sources=sources, assembly=Assembly.PACKED))
        else:
            assembly = Assembly.PACKED_GATE if proj == "gate_proj" else Assembly.PACKED_UP
            entries.append(_described(name, leaf, sources=(packed,), assembly=assembly))
    return entries


def _qwen_plan(cfg: DrafterConfig, names: set[str], source: str) -> Plan:
    if not _has_prefix(names, "mtp."):
        raise _no_mtp(cfg, source, ["mtp."])
    entries, tied = _head_entries(cfg, names, source)
    prefixes = []
    for i in range(cfg.num_mtp_modules):
        L = f"mtp.layers.{i}."
        if not _has_prefix(names, L):
            raise _no_mtp(cfg, source, [L], i)
        prefixes.append(L)
        entries += _qwen_module(cfg, names, i, shared=i == 0)
    packed_any = any(e.assembly is Assembly.PACKED for e in entries)
    _check_present(entries, names, source)
    return Plan(
        layout="qwen_packed_experts" if packed_any else "qwen",
        entries=tuple(entries),
        mtp_prefixes=tuple(prefixes),
        tied_embeddings=tied,
    )


# --------------------------------------------------------------------------------------------
# DeepSeek-V3, GLM-4.5, MiMo, MiniMax-M2: a named tensor tree of everything under each module.

_EXPERT = re.compile(r"^(?P<container>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)\.weight$")

# Tensors each family's module must have, with expected shapes (H = hidden, V = vocab).
_NEXTN_REQUIRED = {
    "enorm.weight": ("H", "[hidden_size]"),
    "hnorm.weight": ("H", "[hidden_size]"),
    "eh_proj.weight": ("H,2H", "[hidden_size, 2 * hidden_size]"),
    "shared_head.norm.weight": ("H", "[hidden_size]"),
}
_MIMO_REQUIRED = {
    "token_layernorm.weight": ("H", "[hidden_size]"),
    "hidden_layernorm.weight": ("H", "[hidden_size]"),
    "input_proj.weight": ("H,2H", "[hidden_size, 2 * hidden_size]"),
    "final_layernorm.weight": ("H", "[hidden_size]"),
}
# Each family's layout name and the tensors its modules must have (others: "generic", none).
_GENERIC_LAYOUTS = {
    Architecture.DEEPSEEK_V3: ("nextn", _NEXTN_REQUIRED),
    Architecture.GLM4_MOE: ("nextn", _NEXTN_REQUIRED),
    Architecture.GLM4_MOE_LITE: ("nextn", _NEXTN_REQUIRED),
    Architecture.MIMO: ("mimo", _MIMO_REQUIRED),
}
_KNOWN_SHAPES = {
    **_NEXTN_REQUIRED,
    **_MIMO_REQUIRED,
    "shared_head.head.weight": ("V,H", "[vocab_size, hidden_size]"),
    "embed_tokens.weight": ("V,H", "[vocab_size, hidden_size]"),
    "input_layernorm.weight": ("H", "[hidden_size]"),
    "post_attention_layernorm.weight": ("H", "[hidden_size]"),
}


def _dims(spec: str, cfg: DrafterConfig) -> tuple[int, ...]:
    H, V = cfg.hidden_size, cfg.vocab_size
    table = {"H": H, "2H": 2 * H, "V": V}
    return tuple(table[d] for d in spec.split(","))


def _generic_role(base: str) -> Projection:
    try:
        return parse_projection(base)
    except ValueError:
        # MLA's q_a/q_b/kv_a/kv_b projections and anything else unnamed: an ordinary projection
        # stored at the requested precision.
        return Projection.O_PROJ


def _module_prefixes(cfg: DrafterConfig, raw: Mapping[str, Any]) -> list[list[str]]:
    """Candidate prefix schemes; scheme ``s`` gives module ``i`` the prefix ``s[i]``."""
    n = cfg.num_mtp_modules
    if cfg.first_mtp_layer is not None or cfg.architecture is Architecture.MIMO:
        return [[module_prefix(cfg, i) for i in range(n)]]  # the drafter's own description
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    layers = text.get("num_hidden_layers", raw.get("num_hidden_layers"))
    by_layer = [f"model.layers.{layers + i}." for i in range(n)] if isinstance(layers, int) else []
    schemes = [
        [f"mtp.layers.{i}." for i in range(n)],
        [f"model.mtp.layers.{i}." for i in range(n)],
        [f"model.mtp_layers.{i}." for i in range(n)],
    ]
    return [*schemes, by_layer] if by_layer else schemes


def _generic_module(
    cfg: DrafterConfig, ckpt: SafetensorsCheckpoint, names: Sequence[str], prefix: str, index: int
) -> list[Entry]:
    """Every tensor under ``prefix`` (module ``index``), experts stacked; a runnable family's
    projections take their roles from ``module_leaves``, others one from their names."""
    mine = sorted(n for n in names if n.startswith(prefix))
    described = dict(module_leaves(cfg, index)) if cfg.runnable else {}
    consumed = {c for n in mine if n.endswith(".weight") for c in companion_names(n)}
    experts: dict[tuple[str, str], dict[int, str]] = {}
    entries = []
    for name in mine:
        if name in consumed:
            continue
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m["container"], m["proj"]), {})[int(m["e"])] = name
            continue
        local = name[len(prefix) :]
        spec = _KNOWN_SHAPES.get(local)
        shape, what = (_dims(spec[0], cfg), spec[1]) if spec else (None, "")
        base = name.removesuffix(".weight")
        if local == "embed_tokens.weight":
            kind = EntryKind.EMBEDDING
        elif name.endswith(".weight") and len(ckpt.info(name).shape) == 2:
            kind = EntryKind.WEIGHT
        else:
            kind = EntryKind.ARRAY
        head = kind is EntryKind.WEIGHT and local == "shared_head.head.weight"
        role = _generic_role(base) if kind is EntryKind.WEIGHT and not head else None
        if role is not None and base in described:  # a runnable family's own description
            role = described[base].role
        entries.append(
            Entry(
                name=base, kind=kind, sources=(name,), shape=shape, what=what, role=role, head=head
            )
        )
    for (container, proj), by_index in sorted(experts.items()):
        count = len(by_index)
        if sorted(by_index) != list(range(count)):
            gaps = sorted(set(range(max(by_index) + 1)) - set(by_index))
            raise CheckpointError(f"{container}.*.{proj}: experts {gaps[:6]} are missing")
        if cfg.moe is not None and count != cfg.moe.num_experts:
            raise CheckpointError(
                f"{container}.*.{proj}: found {count} experts, config.json says "
                f"{cfg.moe.num_experts} (num_experts)"
            )
        entries.append(
            Entry(
                name=f"{container}.{proj}",
                kind=EntryKind.WEIGHT,
                sources=tuple(by_index[e] for e in range(count)),
                role=Projection.EXPERTS,
                assembly=Assembly.STACK,
            )
        )
    return entries


def _generic_plan(
    cfg: DrafterConfig, ckpt: SafetensorsCheckpoint, raw: Mapping[str, Any], source: str
) -> Plan:
    names = ckpt.names
    name_set = set(names)
    schemes = _module_prefixes(cfg, raw)
    scheme = next((s for s in schemes if _has_prefix(names, s[0])), None)
    if scheme is None:
        raise _no_mtp(cfg, source, [s[0] for s in schemes])
    entries, tied = _head_entries(cfg, name_set, source)
    layout, required = _GENERIC_LAYOUTS.get(cfg.architecture, ("generic", {}))
    for i, prefix in enumerate(scheme):
        if not _has_prefix(names, prefix):
            raise _no_mtp(cfg, source, [prefix], i)
        _check_present(
            [Entry(name=prefix + r, kind=EntryKind.ARRAY, sources=(prefix + r,)) for r in required],
            name_set,
            source,
        )
        entries += _generic_module(cfg, ckpt, names, prefix, i)
    return Plan(
        layout=layout, entries=tuple(entries), mtp_prefixes=tuple(scheme), tied_embeddings=tied
    )


def plan(cfg: DrafterConfig, ckpt: SafetensorsCheckpoint, raw_config: Mapping[str, Any]) -> Plan:
    """The conversion plan for a checkpoint whose ``config.json`` gave ``cfg``.

    Raises ``CheckpointError`` when the config declares MTP modules the weights do not hold, or a
    tensor a module needs is missing (naming the index file and the tensors).
    """
    source = ckpt.source
    if cfg.architecture in (Architecture.QWEN3_NEXT, Architecture.QWEN3_5):
        return _qwen_plan(cfg, set(ckpt.names), source)
    return _generic_plan(cfg, ckpt, raw_config, source)


# --------------------------------------------------------------------------------------------
# Converted tensors -> drafter params.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterCheckpoint:
    """A converted checkpoint's drafter: one ``DrafterParams`` per MTP module, and the target's
    embedding / LM head / final norm.

    Qwen modules share ``fc``, the pre-fc norms and ``mtp.norm`` (the same arrays appear in
    every module); module ``i`` owns decoder layer ``mtp.layers.{i}``.
    """

    modules: tuple[DrafterParams, ...]
    head: LMHeadParams

    @property
    def num_modules(self) -> int:
        return len(self.modules)


def assemble(named: Mapping[str, Any], cfg: DrafterConfig) -> DrafterCheckpoint:
    """Builds the runnable drafter from converted tensors by name (the names ``module_leaves``
    gives: each module under ``drafter.module_prefix``).

    ``named`` maps converted names to weights / arrays (or to stand-ins such as
    ``jax.ShapeDtypeStruct``, which is how the loader derives shardings and abstract shapes).
    """
    if not cfg.runnable:
        raise ValueError(
            f"no drafter layout for {cfg.architecture.value}: {cfg.unsupported_reason}"
        )
    modules = tuple(from_named(named, cfg, i) for i in range(cfg.num_mtp_modules))
    head = LMHeadParams(
        weight=named[HEAD_WEIGHT],
        embedding=named[HEAD_EMBEDDING],
        final_norm=named.get(HEAD_FINAL_NORM),
    )
    return DrafterCheckpoint(modules=modules, head=head)
