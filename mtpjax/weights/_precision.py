"""Drafter precision names and the rule that picks each projection's storage format.

A drafter head is asked to run at one ``Precision``; ``projection_format`` decides what each of
its projections is stored as. BF16 keeps everything BF16; FP8 stores every projection FP8 per-row;
NVFP4 on a dense-FFN head stores ``q_proj``, ``o_proj`` and the dense gate/up/down NVFP4
(weight-only) while ``fc``, ``k_proj``, ``v_proj`` stay BF16, which the drafter prefill needs
(it runs norms + fc + k/v only). An NVFP4 MoE head stores every projection NVFP4. The MoE router
and the shared-expert gate are always BF16: they are tiny, and routing is precision-sensitive.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from pallas_kernels import WeightFormat
from pallas_kernels.implementation import parse_enum

__all__ = [
    "Precision",
    "Projection",
    "parse_precision",
    "parse_projection",
    "projection_format",
    "supports_drafter_prefill",
]


class Precision(enum.Enum):
    """Precision a drafter head is asked to run at."""

    NVFP4 = "nvfp4"
    FP8 = "fp8"
    BF16 = "bf16"


def parse_precision(s: str | Precision) -> Precision:
    """Parses ``nvfp4 | fp4 | fp8 | bf16`` in any case; anything else raises ValueError."""
    return parse_enum(Precision, s, "precision", {"fp4": Precision.NVFP4})


class Projection(enum.Enum):
    """Role of a drafter projection; the value is its checkpoint-style name."""

    FC = "fc"  # [H, 2H] over concat(embedding, hidden)
    Q_PROJ = "q_proj"
    K_PROJ = "k_proj"
    V_PROJ = "v_proj"
    O_PROJ = "o_proj"
    GATE_PROJ = "gate_proj"  # dense FFN
    UP_PROJ = "up_proj"  # dense FFN
    DOWN_PROJ = "down_proj"  # dense FFN
    EXPERTS = "experts"  # every routed expert's gate/up/down
    SHARED_EXPERT = "shared_expert"  # the shared expert's gate/up/down
    ROUTER = "router"  # the MoE gate, checkpoint name `mlp.gate`
    SHARED_EXPERT_GATE = "shared_expert_gate"  # [1, H]


# Other families' names for the same roles: DeepSeek/GLM `eh_proj` and MiMo `input_proj` are the
# fc; a bare `gate` is the MoE router in every supported checkpoint.
_PROJECTION_ALIASES = {
    "eh_proj": Projection.FC,
    "input_proj": Projection.FC,
    "gate": Projection.ROUTER,
}


def parse_projection(name: str | Projection) -> Projection:
    """Maps a projection name to its role.

    Accepts the role names (``"q_proj"``, ``"experts"``, ``"router"``...), the aliases ``eh_proj``,
    ``input_proj`` and ``gate``, and full checkpoint paths such as
    ``"mtp.layers.0.mlp.experts.3.up_proj.weight"`` (anything under ``experts`` or
    ``shared_expert`` / ``shared_experts`` takes that role). Unknown names raise ValueError.
    """
    if isinstance(name, Projection):
        return name
    if not isinstance(name, str):
        raise ValueError(f"projection name must be a string, got {name!r}")
    parts = [p for p in name.lower().split(".") if p]
    if parts and parts[-1] in ("weight", "weight_scale", "weight_scale_2", "weight_scale_inv"):
        parts = parts[:-1]
    if "experts" in parts[:-1] or (parts and parts[-1] == "gate_up_proj"):
        return Projection.EXPERTS
    if "shared_expert" in parts[:-1] or "shared_experts" in parts[:-1]:  # Qwen; DeepSeek, GLM
        return Projection.SHARED_EXPERT
    last = parts[-1] if parts else ""
    if last in _PROJECTION_ALIASES:
        return _PROJECTION_ALIASES[last]
    try:
        return Projection(last)
    except ValueError:
        accepted = ", ".join([p.value for p in Projection] + list(_PROJECTION_ALIASES))
        raise ValueError(
            f"unknown projection {name!r}; expected one of: {accepted} (or a checkpoint path "
            "ending in one of them)"
        ) from None


_ALWAYS_BF16 = frozenset({Projection.ROUTER, Projection.SHARED_EXPERT_GATE})
_PREFILL_PROJECTIONS = (Projection.FC, Projection.K_PROJ, Projection.V_PROJ)


def projection_format(
    projection: str | Projection, precision: str | Precision, *, dense_ffn: bool = True
) -> WeightFormat:
    """Storage format of one projection of a head asked to run at ``precision``.

    ``dense_ffn`` says whether the head has a dense FFN (True) or an MoE FFN (False); it only
    matters for NVFP4, where a dense head keeps fc/k_proj/v_proj in BF16 so prefill can run.
    """
    role = parse_projection(projection)
    precision = parse_precision(precision)
    if role in _ALWAYS_BF16 or precision is Precision.BF16:
        return WeightFormat.BF16
    if precision is Precision.FP8:
        return WeightFormat.FP8
    if dense_ffn and role in _PREFILL_PROJECTIONS:
        return WeightFormat.BF16
    return WeightFormat.NVFP4


def supports_drafter_prefill(formats: Mapping[str | Projection, WeightFormat | str]) -> bool:
    """True iff the head's fc, k_proj and v_proj are all BF16.

    ``formats`` maps projection names (roles, aliases or checkpoint paths) to formats; it must
    name fc, k_proj and v_proj, else ValueError.
    """
    seen: dict[Projection, list[WeightFormat]] = {}
    for name, fmt in formats.items():
        seen.setdefault(parse_projection(name), []).append(WeightFormat.parse(fmt))
    missing = [p.value for p in _PREFILL_PROJECTIONS if p not in seen]
    if missing:
        raise ValueError(
            f"supports_drafter_prefill needs the formats of fc, k_proj and v_proj; missing: "
            f"{', '.join(missing)}"
        )
    return all(f is WeightFormat.BF16 for p in _PREFILL_PROJECTIONS for f in seen[p])
