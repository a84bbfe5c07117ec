"""``HybridConfig``: the static description of a Qwen3.5 / Qwen3-Next hybrid target.

Built from a Hugging Face ``config.json`` (``qwen3_next``, ``qwen3_5``, ``qwen3_5_text``,
``qwen3_5_moe``, ``qwen3_5_moe_text``; Qwen3.5 nests the text model under ``text_config``). Layer
``i`` mixes tokens with Gated DeltaNet (``layer_types[i] == linear_attention``) or with gated
full attention, then runs a dense SwiGLU FFN or the routed MoE with its gated shared expert
(``ffn_kinds[i]``). Qwen3-Next makes a layer MoE when ``num_experts > 0``, the layer is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; Qwen3.5 dense models have dense
FFNs everywhere and Qwen3.5 MoE models MoE everywhere.

Glossary (shapes across the package):
  H    hidden_size                  L    num_hidden_layers
  Nq / Nkv  full-attention query / KV heads, D head_dim, R rotary_dim
  Hk / Hv   GDN key / value heads (linear_num_key_heads / linear_num_value_heads)
  dk / dv   GDN key / value head dims (linear_key_head_dim / linear_value_head_dim)
  K    linear_conv_kernel_dim       C    conv_dim = 2 * Hk * dk + Hv * dv
  P    period (slots of the repeating layer pattern), G = L / P groups
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any

from mtpjax.config import (
    ConfigView,
    FfnKind,
    KeywordOnly,
    LMHeadConfig,
    MoeConfig,
    check_bool,
    check_enum,
    check_float,
    check_int,
    fail,
    load_hf_config,
    qwen_moe_config,
)

__all__ = ["GdnLayout", "HybridConfig", "LayerType"]

_COMPUTE_DTYPES = ("float32", "bfloat16")


class LayerType(enum.Enum):
    """Token mixer of one decoder layer (the values are ``config.json``'s ``layer_types``)."""

    LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet
    FULL_ATTENTION = "full_attention"  # gated GQA attention with its own KV cache


class GdnLayout(enum.Enum):
    """How a checkpoint stores the GDN input projections."""

    # Qwen3-Next: in_proj_qkvz [2*Hk*dk + 2*Hv*dv, H] and in_proj_ba [2*Hv, H], each grouped per
    # key head: [q_h (dk), k_h (dk), v_h (r*dv), z_h (r*dv)] and [b_h (r), a_h (r)], r = Hv / Hk.
    PACKED = "packed"
    # Qwen3.5: in_proj_qkv [2*Hk*dk + Hv*dv, H] (q | k | v), in_proj_z [Hv*dv, H],
    # in_proj_b [Hv, H], in_proj_a [Hv, H].
    SPLIT = "split"


_LAYOUTS = {
    "qwen3_next": GdnLayout.PACKED,
    "qwen3_5": GdnLayout.SPLIT,
    "qwen3_5_text": GdnLayout.SPLIT,
    "qwen3_5_moe": GdnLayout.SPLIT,
    "qwen3_5_moe_text": GdnLayout.SPLIT,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig(KeywordOnly):
    """Static description of a hybrid target; a static jit argument (``cfg=``).

    Attribute names match what ``mtpjax.layers`` reads from a config (the full-attention layers
    and the FFNs are the library's). ``compute_dtype`` is the dtype activations are cast to
    before each projection (``"float32"``: exact, what the tests compare; ``"bfloat16"``: BF16
    matmuls with F32 accumulation); residuals, norms, the conv, the delta rule and softmax stay
    F32. ``gdn_chunk_size`` is the chunk of the prefill's chunked delta rule (it changes only the
    rounding, never the result's meaning).
    """

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    layer_types: tuple[LayerType, ...]
    ffn_kinds: tuple[FfnKind, ...]
    # Full attention.
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000.0
    attn_output_gate: bool = True
    # Gated DeltaNet.
    gdn_layout: GdnLayout
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    gdn_chunk_size: int = 64
    # FFN.
    intermediate_size: int = 0  # dense FFN width (0 when every layer is MoE)
    moe: MoeConfig | None = None
    compute_dtype: str = "float32"

    # Fixed by the family; the attribute names are what mtpjax.layers reads.
    zero_centered_norm = True
    qk_norm = True

    def __post_init__(self) -> None:
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
            "max_position_embeddings",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "gdn_chunk_size",
        ):
            check_int(key, getattr(self, key), minimum=1)
        check_int("intermediate_size", self.intermediate_size, minimum=0)
        check_float("rms_norm_eps", self.rms_norm_eps)
        check_float("rope_theta", self.rope_theta)
        check_float("partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor > 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise fail(
                "partial_rotary_factor",
                self.partial_rotary_factor,
                f"a factor in (0, 1] giving an even rotary dim >= 2 for head_dim={self.head_dim}",
            )
        for key in ("tie_word_embeddings", "attn_output_gate"):
            check_bool(key, getattr(self, key))
        check_enum("gdn_layout", self.gdn_layout, GdnLayout)
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise fail(
                "linear_num_key_heads",
                self.linear_num_key_heads,
                f"a divisor of linear_num_value_heads={self.linear_num_value_heads}",
            )
        L = self.num_hidden_layers
        for key, kind in (("layer_types", LayerType), ("ffn_kinds", FfnKind)):
            value = getattr(self, key)
            if not isinstance(value, tuple) or len(value) != L:
                raise fail(key, value, f"a tuple of {L} (num_hidden_layers) {kind.__name__}s")
            for i, item in enumerate(value):
                check_enum(f"{key}[{i}]", item, kind)
        if FfnKind.DENSE in self.ffn_kinds and self.intermediate_size < 1:
            raise fail("intermediate_size", self.intermediate_size, ">= 1 (a layer is dense)")
        has_moe = FfnKind.MOE in self.ffn_kinds
        if has_moe and not isinstance(self.moe, MoeConfig):
            raise fail("moe", self.moe, "a MoeConfig (a layer is MoE)")
        if not has_moe and self.moe is not None:
            raise fail("moe", self.moe, "None (no layer is MoE)")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise fail("compute_dtype", self.compute_dtype, f"one of {_COMPUTE_DTYPES}")

    # ---- derived sizes -------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        """R: leading dims of each full-attention q/k head that RoPE rotates (NeoX halves)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_proj_width(self) -> int:
        return self.num_attention_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def key_dim(self) -> int:
        """Hk * dk: width of the GDN queries (and keys) before the heads are repeated."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Hv * dv: width of the GDN values, of the gate z and of out_proj's input."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """C: channels of the causal conv (q | k | v)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def period(self) -> int:
        """P: the shortest repeat of (layer type, FFN kind) that tiles the L layers.

        The layers are stored and scanned as G = L / P groups of P slots (Qwen3.5's
        ``[linear, linear, linear, full] * 16`` is 16 groups of 4 slots); a pattern with no
        repeat is one group of L slots.
        """
        kinds = list(zip(self.layer_types, self.ffn_kinds))
        L = len(kinds)
        return next(p for p in range(1, L + 1) if L % p == 0 and kinds == kinds[:p] * (L // p))

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // self.period

    def lm_head_config(self, *, f32_logits: bool = True) -> LMHeadConfig:
        """The embedding / LM head config (shared with the MTP drafter)."""
        return LMHeadConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            f32_logits=f32_logits,
            tie_word_embeddings=self.tie_word_embeddings,
        )

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def from_hf(
        cls, config: Mapping[str, Any] | str | os.PathLike, *, compute_dtype: str = "float32"
    ) -> HybridConfig:
        """Build from a HF ``config.json`` (a dict, the file, or its directory).

        ``layer_types`` is read when present, else derived from ``full_attention_interval``
        (default 4: every fourth layer full attention), as transformers does. The GDN sizes
        default to transformers' (kernel 4, 16 key / 32 value heads of 128) when absent.
        Raises ValueError naming the key for anything this model does not run.
        """
        view = ConfigView(load_hf_config(config))
        model_type = view.model_type()
        layout = _LAYOUTS.get(model_type)
        if layout is None:
            raise fail("model_type", model_type, "one of " + ", ".join(sorted(_LAYOUTS)))
        if view.get_str("hidden_act", default="silu") != "silu":
            raise fail("hidden_act", view.raw("hidden_act"), "'silu'")
        if view.get_bool("attention_bias", default=False):
            raise fail("attention_bias", True, "false (no q/k/v/o bias)")
        rope_type = view.rope_type()
        if rope_type != "default":
            raise fail("rope_type", rope_type, "'default' RoPE")
        hidden = view.get_int("hidden_size", minimum=1)
        heads = view.get_int("num_attention_heads", minimum=1)
        L = view.get_int("num_hidden_layers", minimum=1)
        fields: dict[str, Any] = dict(
            hidden_size=hidden,
            num_hidden_layers=L,
            vocab_size=view.get_int("vocab_size", minimum=1),
            max_position_embeddings=view.get_int("max_position_embeddings", minimum=1),
            rms_norm_eps=view.get_float("rms_norm_eps"),
            tie_word_embeddings=view.get_bool("tie_word_embeddings", default=False),
            layer_types=_layer_types(view, L),
            num_attention_heads=heads,
            num_key_value_heads=view.get_int("num_key_value_heads", minimum=1, default=heads),
            head_dim=view.get_int("head_dim", minimum=1, default=256),  # transformers' default
            partial_rotary_factor=view.rope("partial_rotary_factor", default=0.25),
            rope_theta=view.rope("rope_theta"),
            attn_output_gate=view.get_bool("attn_output_gate", default=True),
            gdn_layout=layout,
            linear_num_key_heads=view.get_int("linear_num_key_heads", minimum=1, default=16),
            linear_num_value_heads=view.get_int("linear_num_value_heads", minimum=1, default=32),
            linear_key_head_dim=view.get_int("linear_key_head_dim", minimum=1, default=128),
            linear_value_head_dim=view.get_int("linear_value_head_dim", minimum=1, default=128),
            linear_conv_kernel_dim=view.get_int("linear_conv_kernel_dim", minimum=1, default=4),
            compute_dtype=compute_dtype,
        )
        fields.update(_ffns(view, model_type, L))
        return cls(**fields)

    @classmethod
    def tiny(
        cls,
        *,
        layout: GdnLayout = GdnLayout.SPLIT,
        ffn: FfnKind = FfnKind.DENSE,
        num_hidden_layers: int = 4,
        full_attention_interval: int = 4,
        **overrides: Any,
    ) -> HybridConfig:
        """A small config for tests: hidden 64, vocab 128; full attention 4 q / 2 KV heads of 16
        (rotary 8); GDN 2 key heads of 16, 4 value heads of 8 (more value than key heads),
        kernel 4; dense width 96 or 4 experts (top 2) of 32 with a gated shared expert of 48.
        ``overrides`` replace any field."""
        L = num_hidden_layers
        layer_types = tuple(
            LayerType.FULL_ATTENTION if (i + 1) % full_attention_interval == 0 else
            LayerType.LINEAR_ATTENTION
            for i in range(L)
        )  # fmt: skip
        moe = None
        if ffn is FfnKind.MOE:
            moe = MoeConfig(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                shared_expert_gate=True,
            )
        fields: dict[str, Any] = dict(
            hidden_size=64,
            num_hidden_layers=L,
            vocab_size=128,
            max_position_embeddings=512,
            layer_types=layer_types,
            ffn_kinds=(ffn,) * L,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            gdn_layout=layout,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            intermediate_size=96 if ffn is FfnKind.DENSE else 0,
            moe=moe,
        )
        fields.update(overrides)
        return cls(**fields)


def _layer_types(view: ConfigView, L: int) -> tuple[LayerType, ...]:
    raw = view.raw("layer_types")
    if raw is None:
        interval = view.get_int("full_attention_interval", minimum=1, default=4)
        return tuple(
            LayerType.LINEAR_ATTENTION if (i + 1) % interval else LayerType.FULL_ATTENTION
            for i in range(L)
        )
    accepted = ", ".join(repr(t.value) for t in LayerType)
    if not isinstance(raw, list) or len(raw) != L:
        raise fail("layer_types", raw, f"a list of {L} (num_hidden_layers) of {accepted}")
    out = []
    for i, name in enumerate(raw):
        try:
            out.append(LayerType(name))
        except ValueError:
            raise fail(f"layer_types[{i}]", name, f"one of {accepted}") from None
    return tuple(out)


def _ffns(view: ConfigView, model_type: str, L: int) -> dict[str, Any]:
    """ffn_kinds, intermediate_size and moe, as transformers decides each layer's FFN."""

    def dense() -> dict[str, Any]:
        return dict(intermediate_size=view.get_int("intermediate_size", minimum=1))

    if model_type.startswith("qwen3_5"):
        if "moe" not in model_type:
            return dict(dense(), ffn_kinds=(FfnKind.DENSE,) * L)
        # The Qwen3.5 MoE router always renormalises its top-k; the config has no switch.
        return dict(ffn_kinds=(FfnKind.MOE,) * L, moe=qwen_moe_config(view, norm_topk_prob=True))
    experts = view.get_int("num_experts", default=512)  # transformers' Qwen3-Next default
    step = view.get_int("decoder_sparse_step", minimum=1, default=1)
    only = view.raw("mlp_only_layers", [])
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise fail("mlp_only_layers", only, "a list of layer indices")
    kinds = tuple(
        FfnKind.MOE if experts > 0 and i not in only and (i + 1) % step == 0 else FfnKind.DENSE
        for i in range(L)
    )
    fields: dict[str, Any] = dict(ffn_kinds=kinds)
    if FfnKind.DENSE in kinds:
        fields.update(dense())
    if FfnKind.MOE in kinds:
        norm = view.get_bool("norm_topk_prob", default=True)
        fields["moe"] = qwen_moe_config(view, norm_topk_prob=norm)
    return fields
