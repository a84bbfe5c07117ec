"""Configs for the MTP drafter and the target LM head, built from Hugging Face ``config.json``.

Every config here is a frozen, keyword-only dataclass validated in ``__post_init__``; all fields
are hashable, so a config is passed to ``jax.jit`` as a static argument by name (``cfg=``) and
two equal configs share one compilation.

Glossary (names used in shapes across the library):
  H   hidden_size                  V   vocab_size (rows of the LM head)
  Nq  num_attention_heads          V'  draft vocab (first V' rows; ``mtp_vocab_size``)
  Nkv num_key_value_heads          D   head_dim
  R   rotary_dim (= int(D * partial_rotary_factor), RoPE on the first R dims of each head)
  E   num_experts                  K   num_experts_per_tok
  I   dense FFN width              Ie  routed-expert width (moe_intermediate_size)

Families and where their MTP settings live in ``config.json``:
  Qwen3-Next   ``qwen3_next``                     ``num_nextn_predict_layers`` (absent = 1)
  Qwen3.5/3.6  ``qwen3_5`` / ``qwen3_5_moe``      ``text_config.mtp_num_hidden_layers``
  DeepSeek-V3  ``deepseek_v3`` (V3.2: ``deepseek_v32``) ``num_nextn_predict_layers``
  GLM-4.5      ``glm4_moe``                       ``num_nextn_predict_layers``
  GLM-4.7-Flash ``glm4_moe_lite`` (MLA + MoE)     ``num_nextn_predict_layers``
  MiMo         ``mimo``                           ``num_nextn_predict_layers``
  MiniMax-M2   ``minimax_m2``                     ``use_mtp``, ``num_mtp_modules``,
                                                  ``mtp_transformer_layers``
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "Architecture",
    "DrafterConfig",
    "FfnKind",
    "HiddenContract",
    "InputOrder",
    "KeywordOnly",
    "LMHeadConfig",
    "MlaConfig",
    "MoeConfig",
    "RouterScoring",
    "YarnScaling",
    "configs_by_name",
    "load_hf_config",
]


class Architecture(enum.Enum):
    """Model family whose MTP module a ``DrafterConfig`` describes."""

    QWEN3_NEXT = "qwen3_next"
    QWEN3_5 = "qwen3_5"
    DEEPSEEK_V3 = "deepseek_v3"
    GLM4_MOE = "glm4_moe"
    GLM4_MOE_LITE = "glm4_moe_lite"  # GLM-4.7-Flash: DeepSeek's MLA with GLM's router
    MIMO = "mimo"
    MINIMAX_M2 = "minimax_m2"


class HiddenContract(enum.Enum):
    """Which hidden vector draft steps 1.. consume (step 0 always takes the target's hidden).

    POST_NORM is what the reference models train with; feeding PRE_NORM silently costs 5-50% of
    acceptance, which is why the choice is explicit rather than an implementation detail.
    """

    POST_NORM = "post_norm"  # chain the drafter's own h_out = mtp.norm(x)
    PRE_NORM = "pre_norm"  # chain the residual x before the final norm
    PINNED = "pinned"  # reuse the target's hidden for every step


class FfnKind(enum.Enum):
    """Feed-forward block of the MTP decoder layer."""

    DENSE = "dense"
    MOE = "moe"


class InputOrder(enum.Enum):
    """Concatenation order of the two normed inputs of the MTP input projection."""

    EMBED_FIRST = "embed_first"  # concat[norm(e), norm(h)]: Qwen, DeepSeek, GLM
    HIDDEN_FIRST = "hidden_first"  # concat[norm(h), norm(e)]: MiMo


class RouterScoring(enum.Enum):
    """Function turning router logits into expert scores."""

    SOFTMAX = "softmax"  # Qwen: softmax over all experts in F32, then top-k
    SIGMOID = "sigmoid"  # DeepSeek, GLM, MiniMax: per-expert sigmoid, then top-k


# --------------------------------------------------------------------------------------------
# Validation shared by the library's configs: every failure names the field, the value found and
# what was expected.


def fail(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{key}={value!r}: expected {expected}")


def check_int(key: str, value: Any, *, minimum: int) -> None:
    # bool is an int subclass; a JSON `true` where a size belongs is a broken config.
    if not isinstance(value, int) or isinstance(value, bool):
        raise fail(key, value, "an integer")
    if value < minimum:
        raise fail(key, value, f"an integer >= {minimum}")


def check_float(key: str, value: Any, *, positive: bool = True) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise fail(key, value, "a finite number")
    if positive and value <= 0:
        raise fail(key, value, "a number > 0")


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise fail(key, value, "a bool")


def check_enum(key: str, value: Any, kind: type[enum.Enum]) -> None:
    if not isinstance(value, kind):
        raise fail(key, value, f"a {kind.__name__} member")


def check_at_most(cfg: Any, key: str, bound: str) -> None:
    """``cfg.<key> <= cfg.<bound>`` (a ``key`` of None passes)."""
    value, limit = getattr(cfg, key), getattr(cfg, bound)
    if value is not None and value > limit:
        raise fail(key, value, f"at most {bound}={limit}")


def check_divides(cfg: Any, key: str, total: str) -> None:
    """``cfg.<key>`` divides ``cfg.<total>``."""
    value, whole = getattr(cfg, key), getattr(cfg, total)
    if whole % value:
        raise fail(key, value, f"a divisor of {total}={whole}")


# --------------------------------------------------------------------------------------------
# Keyword-only construction and passing.


class KeywordOnly:
    """Base of the keyword-only config dataclasses: a positional field gets one clear line
    instead of the interpreter's count of ``__init__`` arguments."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any):
        if args:
            raise TypeError(
                f"{cls.__name__} takes keyword arguments only; got {len(args)} positional"
            )
        return super().__new__(cls)


def configs_by_name[F: Callable[..., Any]](step: F) -> F:
    """Wraps a step ``f(a, b, *, cfg, ...)`` whose configs are keyword-only: a call with more
    positional arguments than it takes says that the config goes by name."""
    params = inspect.signature(step).parameters.values()
    positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    names = " and ".join(p.name for p in params if p.kind is p.KEYWORD_ONLY and "cfg" in p.name)

    @functools.wraps(step)
    def call(*args: Any, **kwargs: Any):
        if len(args) > positional:
            raise TypeError(
                f"{step.__name__}: {names} must be passed by name ({names.split()[0]}=...); "
                f"got {len(args)} positional arguments, {positional} allowed"
            )
        return step(*args, **kwargs)

    return call


# --------------------------------------------------------------------------------------------
# Configs.


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig(KeywordOnly):
    """Routed mixture-of-experts FFN (plus an optional always-on shared expert).

    ``y = sum_k w_k * expert_k(x) * routed_scaling_factor + [sigmoid(g(x))] * shared(x)`` where
    the top-k is taken over ``scoring(router(x))`` (plus the score-correction bias for selection
    only, when present), restricted to the best ``topk_group`` of ``n_group`` expert groups, and
    ``w`` is renormalised to sum 1 when ``norm_topk_prob``.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen: sigmoid(shared_expert_gate(x)) scales the shared one
    norm_topk_prob: bool = True
    scoring: RouterScoring = RouterScoring.SOFTMAX
    score_correction_bias: bool = False  # DeepSeek/GLM `e_score_correction_bias` ("noaux_tc")
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        check_int("num_experts", self.num_experts, minimum=1)
        check_int("num_experts_per_tok", self.num_experts_per_tok, minimum=1)
        check_at_most(self, "num_experts_per_tok", "num_experts")
        check_int("moe_intermediate_size", self.moe_intermediate_size, minimum=1)
        check_int(
            "shared_expert_intermediate_size", self.shared_expert_intermediate_size, minimum=0
        )
        check_bool("shared_expert_gate", self.shared_expert_gate)
        if self.shared_expert_gate and self.shared_expert_intermediate_size == 0:
            raise fail(
                "shared_expert_gate",
                self.shared_expert_gate,
                "False when shared_expert_intermediate_size is 0 (no shared expert to gate)",
            )
        check_bool("norm_topk_prob", self.norm_topk_prob)
        check_enum("scoring", self.scoring, RouterScoring)
        check_bool("score_correction_bias", self.score_correction_bias)
        check_float("routed_scaling_factor", self.routed_scaling_factor)
        check_int("n_group", self.n_group, minimum=1)
        check_divides(self, "n_group", "num_experts")
        check_int("topk_group", self.topk_group, minimum=1)
        check_at_most(self, "topk_group", "n_group")
        if self.score_correction_bias and self.n_group > 1 and self.num_experts < 2 * self.n_group:
            # Such a group's value is the sum of its two best biased scores.
            raise fail("n_group", self.n_group, "at most num_experts / 2 with a correction bias")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise fail(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"at most topk_group * num_experts / n_group = {reachable}",
            )

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaConfig(KeywordOnly):
    """DeepSeek multi-head latent attention (``mtpjax.layers.mla``).

    ``rope_interleave``: the RoPE'd dims hold interleaved pairs ``(x0, x1), (x2, x3), ...``
    (DeepSeek's checkpoints; transformers' ``rope_interleave``, default True) rather than NeoX
    halves. ``latent_norm_eps``: the q_a / kv_a layernorms' epsilon, which DeepSeek's reference
    and transformers leave at 1e-6 whatever the config's ``rms_norm_eps``.
    """

    q_lora_rank: int | None  # None: q is projected directly from H (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    latent_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.q_lora_rank is not None:
            check_int("q_lora_rank", self.q_lora_rank, minimum=1)
        check_int("kv_lora_rank", self.kv_lora_rank, minimum=1)
        check_int("qk_nope_head_dim", self.qk_nope_head_dim, minimum=1)
        check_int("qk_rope_head_dim", self.qk_rope_head_dim, minimum=2)
        if self.qk_rope_head_dim % 2:
            raise fail("qk_rope_head_dim", self.qk_rope_head_dim, "an even number")
        check_int("v_head_dim", self.v_head_dim, minimum=1)
        check_bool("rope_interleave", self.rope_interleave)
        check_float("latent_norm_eps", self.latent_norm_eps)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Per-token width of the compressed KV cache: latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling(KeywordOnly):
    """YaRN rope scaling (``rope_scaling`` / ``rope_parameters`` with ``rope_type: yarn``).

    The inverse frequencies blend interpolation (``/ factor``) and extrapolation over the
    dimensions between the ``beta_fast`` / ``beta_slow`` correction range;
    ``cos_sin_scale`` multiplies cos and sin (transformers' ``attention_factor``) and
    ``softmax_scale_factor`` the MLA softmax scale (DeepSeek's ``mscale_all_dim`` correction).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        check_float("rope_scaling.factor", self.factor)
        check_int(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
            minimum=1,
        )
        check_float("rope_scaling.beta_fast", self.beta_fast)
        check_float("rope_scaling.beta_slow", self.beta_slow)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, key) is not None:
                check_float(f"rope_scaling.{key}", getattr(self, key), positive=False)
        check_bool("rope_scaling.truncate", self.truncate)

    @property
    def cos_sin_scale(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor, 1.0)

    @property
    def softmax_scale_factor(self) -> float:
        if not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


_QWEN_FAMILY = (Architecture.QWEN3_NEXT, Architecture.QWEN3_5)

# NextN families: MTP module i is decoder layer `model.layers.{num_hidden_layers + i}`.
_NEXTN_FAMILY = (Architecture.DEEPSEEK_V3, Architecture.GLM4_MOE, Architecture.GLM4_MOE_LITE)

_NOT_IMPLEMENTED = {
    Architecture.MINIMAX_M2: (
        "the MiniMax-M2 MTP modules are not implemented by the drafter, and the published "
        "MiniMax-M2 checkpoints carry no MTP tensors"
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig(KeywordOnly):
    """Static description of a checkpoint's MTP drafter (one or more MTP modules).

    ``head_dim`` is the q/k head width; for MLA configs it is ``qk_nope + qk_rope`` and the MLA
    details live in ``mla``. ``intermediate_size`` is the dense FFN width and is 0 when the MTP
    layer's FFN is a MoE. Qwen's ``mtp.layers.{i}`` count as ``num_mtp_modules`` (step ``i`` runs
    layer ``i``); they share ``fc`` and the norms, unlike DeepSeek-style independent modules.

    ``default_hidden_contract`` is what draft steps 1.. chain when a call names none: POST_NORM
    for every family, the hidden after the module's final norm (``mtp.norm``,
    ``shared_head.norm``, ``final_layernorm``), which is what its ``hnorm`` was trained on and
    what draft step 0 reads too (the target's final-norm output). Serving engines that chained
    the pre-norm residual lost acceptance and switched: SGLang's ``deepseek_nextn`` always
    chained the post-norm hidden, vLLM changed its DeepSeek / GLM MTP to it.
    """

    architecture: Architecture
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    rope_type: str = "default"
    rope_scaling: YarnScaling | None = None  # the YaRN parameters when rope_type is "yarn"
    rms_norm_eps: float
    zero_centered_norm: bool  # Qwen3-Next/3.5: x/rms*(1+w); others x/rms*w
    attn_output_gate: bool  # Qwen3-Next/3.5: q_proj emits [q_h, gate_h] per head
    qk_norm: bool
    attention_bias: bool = False  # bias on q/k/v projections (GLM, Qwen2/MiMo)
    ffn: FfnKind
    intermediate_size: int = 0
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None
    default_hidden_contract: HiddenContract = HiddenContract.POST_NORM  # see the docstring
    # NextN families: the index in `model.layers` of MTP module 0's layer (num_hidden_layers).
    first_mtp_layer: int | None = None
    # DeepSeek-V3.2's DSA: its lightning indexer keeps the top `index_topk` rows per query.
    sparse_attention_topk: int | None = None
    num_mtp_modules: int = 1
    mtp_layers_per_module: int = 1
    mtp_use_dedicated_embeddings: bool = False
    input_order: InputOrder = InputOrder.EMBED_FIRST
    zero_embedding_at_position_0: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int
    mtp_vocab_size: int | None = None
    # The checkpoint's declared FP8 block shape, for checking scale shapes; each tensor's format
    # is still decided from its own dtype and companions, never from this.
    fp8_block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_enum("architecture", self.architecture, Architecture)
        check_int("hidden_size", self.hidden_size, minimum=1)
        check_int("vocab_size", self.vocab_size, minimum=1)
        check_int("num_attention_heads", self.num_attention_heads, minimum=1)
        check_int("num_key_value_heads", self.num_key_value_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        check_int("num_mtp_modules", self.num_mtp_modules, minimum=1)
        check_int("mtp_layers_per_module", self.mtp_layers_per_module, minimum=1)
        check_int("max_position_embeddings", self.max_position_embeddings, minimum=1)
        check_divides(self, "num_key_value_heads", "num_attention_heads")
        check_float("partial_rotary_factor", self.partial_rotary_factor)
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise fail("partial_rotary_factor", self.partial_rotary_factor, "a value in (0, 1]")
        check_float("rope_theta", self.rope_theta)
        if not isinstance(self.rope_type, str) or not self.rope_type:
            raise fail("rope_type", self.rope_type, "a non-empty string")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise fail("rope_scaling", self.rope_scaling, "a YarnScaling or None")
        if self.rope_scaling is not None and self.rope_type != "yarn":
            raise fail(
                "rope_scaling",
                self.rope_scaling,
                f"None for rope_type={self.rope_type!r} "
                "(YarnScaling is the parameters of rope_type 'yarn')",
            )
        check_enum("default_hidden_contract", self.default_hidden_contract, HiddenContract)
        if self.first_mtp_layer is not None:
            check_int("first_mtp_layer", self.first_mtp_layer, minimum=0)
        if self.sparse_attention_topk is not None:
            check_int("sparse_attention_topk", self.sparse_attention_topk, minimum=1)
        check_float("rms_norm_eps", self.rms_norm_eps)
        for key in (
            "zero_centered_norm",
            "attn_output_gate",
            "qk_norm",
            "attention_bias",
            "mtp_use_dedicated_embeddings",
            "zero_embedding_at_position_0",
            "tie_word_embeddings",
        ):
            check_bool(key, getattr(self, key))
        check_enum("ffn", self.ffn, FfnKind)
        check_int("intermediate_size", self.intermediate_size, minimum=0)
        if self.moe is not None and not isinstance(self.moe, MoeConfig):
            raise fail("moe", self.moe, "a MoeConfig or None")
        if self.ffn is FfnKind.DENSE:
            if self.intermediate_size == 0:
                raise fail("intermediate_size", 0, "> 0 for a dense FFN")
            if self.moe is not None:
                raise fail("moe", self.moe, "None for a dense FFN (ffn=FfnKind.DENSE)")
        elif self.moe is None:
            raise fail("moe", None, "a MoeConfig for a MoE FFN (ffn=FfnKind.MOE)")
        if self.mla is not None:
            if not isinstance(self.mla, MlaConfig):
                raise fail("mla", self.mla, "an MlaConfig or None")
            if self.head_dim != self.mla.qk_head_dim:
                raise fail(
                    "head_dim",
                    self.head_dim,
                    f"qk_nope_head_dim + qk_rope_head_dim = {self.mla.qk_head_dim} with MLA",
                )
        rotary = self.rotary_dim
        if rotary < 2 or rotary % 2:
            raise fail(
                "partial_rotary_factor",
                self.partial_rotary_factor,
                f"a factor giving an even rotary dim >= 2 for head_dim={self.head_dim} "
                f"(got int(head_dim * partial_rotary_factor) = {rotary})",
            )
        check_enum("input_order", self.input_order, InputOrder)
        if self.mtp_vocab_size is not None:
            check_int("mtp_vocab_size", self.mtp_vocab_size, minimum=1)
        check_at_most(self, "mtp_vocab_size", "vocab_size")
        if self.fp8_block_size is not None:
            block = self.fp8_block_size
            if not isinstance(block, tuple) or len(block) != 2:
                raise fail("fp8_block_size", block, "a (rows, cols) tuple or None")
            for size in block:
                check_int("fp8_block_size", size, minimum=1)

    # ---- derived sizes -------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        """R: leading dims of each q/k head that RoPE rotates (NeoX halves)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_proj_width(self) -> int:
        """Output width of q_proj: Nq * D, doubled by the per-head output gate."""
        return self.num_attention_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    @property
    def kv_width(self) -> int:
        """Output width of k_proj (= v_proj) in the GQA layout: Nkv * D (see ``mla`` for MLA)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def draft_vocab_size(self) -> int:
        """V': LM-head rows the drafter scores (all V unless ``mtp_vocab_size`` reduces it)."""
        return self.vocab_size if self.mtp_vocab_size is None else self.mtp_vocab_size

    # ---- support -------------------------------------------------------------------------

    @property
    def unsupported_reason(self) -> str | None:
        """Why the drafter cannot run this config, or None when it can."""
        if self.architecture in _NOT_IMPLEMENTED:
            return _NOT_IMPLEMENTED[self.architecture]
        problems = []
        if self.sparse_attention_topk is not None:
            problems.append(
                "DeepSeek-V3.2's sparse attention (DSA: a lightning indexer picks the top "
                f"index_topk={self.sparse_attention_topk} rows each query attends to)"
            )
        yarn = self.rope_type == "yarn" and self.mla is not None and self.rope_scaling is not None
        if self.rope_type != "default" and not yarn:
            problems.append(
                f"rope_type {self.rope_type!r} (only 'default' RoPE, or YaRN with its "
                "parameters (rope_scaling) and MLA)"
            )
        if self.mla is not None and self.attn_output_gate:
            problems.append("an output-gated MLA attention")
        if self.mla is not None and self.attention_bias:
            problems.append("q/k/v bias on MLA projections")
        if self.mtp_layers_per_module != 1:
            problems.append(f"{self.mtp_layers_per_module} layers per MTP module")
        nextn = self.architecture in _NEXTN_FAMILY
        if nextn and self.first_mtp_layer is None:
            problems.append("NextN modules without their layer index (first_mtp_layer)")
        if not nextn and self.first_mtp_layer is not None:
            problems.append(f"the NextN layout (first_mtp_layer) for {self.architecture.value}")
        if not problems:
            return None
        return "the drafter does not implement " + ", ".join(problems)

    @property
    def runnable(self) -> bool:
        """True when the drafter implements this config (Qwen3-Next/3.5, DeepSeek-V3, GLM-4.5,
        GLM-4.7-Flash, MiMo)."""
        return self.unsupported_reason is None

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any] | str | os.PathLike,
        *,
        mtp_vocab_size: int | None = None,
    ) -> DrafterConfig:
        """Build from a HF ``config.json`` (a dict, the file, or the directory holding it).

        Raises ValueError naming the key for an unknown ``model_type``, a missing or mistyped
        key, inconsistent values, or a config that declares no MTP module.
        """
        view = ConfigView(load_hf_config(config))
        model_type = view.model_type()
        parse = _DRAFTER_PARSERS.get(model_type)
        if model_type in _KNOWN_UNPARSED:
            raise ValueError(f"model_type {model_type!r}: {_KNOWN_UNPARSED[model_type]}")
        if parse is None:
            raise fail("model_type", model_type, "one of " + ", ".join(sorted(_DRAFTER_PARSERS)))
        fields = parse(view, model_type)
        fields["fp8_block_size"] = _fp8_block_size(view)
        return cls(mtp_vocab_size=mtp_vocab_size, **fields)

    @classmethod
    def tiny(cls, *, ffn: FfnKind = FfnKind.DENSE, **overrides: Any) -> DrafterConfig:
        """A small Qwen3.5-style config for tests; ``overrides`` replace any field."""
        moe = None
        intermediate = 96
        if ffn is FfnKind.MOE:
            intermediate = 0
            moe = MoeConfig(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                shared_expert_gate=True,
            )
        fields: dict[str, Any] = dict(
            architecture=Architecture.QWEN3_5,
            hidden_size=64,
            vocab_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            rope_theta=10_000.0,
            rms_norm_eps=1e-6,
            zero_centered_norm=True,
            attn_output_gate=True,
            qk_norm=True,
            ffn=ffn,
            intermediate_size=intermediate,
            moe=moe,
            max_position_embeddings=512,
        )
        fields.update(overrides)
        return cls(**fields)

    def lm_head_config(self, *, f32_logits: bool = True) -> LMHeadConfig:
        """The target LM head this drafter projects through (MTP families have no softcap)."""
        return LMHeadConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            f32_logits=f32_logits,
            draft_vocab_size=self.mtp_vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMHeadConfig(KeywordOnly):
    """The target's output projection ``[V, H]`` and what is applied around it.

    ``logits = cap * tanh((h @ W.T) / cap)`` when ``logit_softcap`` is set; ``embedding_scale``
    multiplies embedding rows at lookup (Gemma: sqrt(H)); ``draft_vocab_size`` restricts drafter
    logits to the first V' rows.
    """

    vocab_size: int
    hidden_size: int
    logit_softcap: float | None = None
    embedding_scale: float | None = None
    f32_logits: bool = True
    draft_vocab_size: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, minimum=1)
        check_int("hidden_size", self.hidden_size, minimum=1)
        if self.logit_softcap is not None:
            check_float("logit_softcap", self.logit_softcap)
        if self.embedding_scale is not None:
            check_float("embedding_scale", self.embedding_scale)
        check_bool("f32_logits", self.f32_logits)
        if self.draft_vocab_size is not None:
            check_int("draft_vocab_size", self.draft_vocab_size, minimum=1)
        check_at_most(self, "draft_vocab_size", "vocab_size")
        check_bool("tie_word_embeddings", self.tie_word_embeddings)

    @property
    def draft_rows(self) -> int:
        """Rows of the head the drafter scores: V' when reduced, else V."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any] | str | os.PathLike,
        *,
        mtp_vocab_size: int | None = None,
        f32_logits: bool = True,
    ) -> LMHeadConfig:
        """Build from any causal-LM ``config.json`` (nested ``text_config`` is followed)."""
        view = ConfigView(load_hf_config(config))
        hidden = view.get_int("hidden_size", minimum=1)
        softcap = view.optional_float("final_logit_softcapping")
        scale = view.optional_float("embedding_multiplier")
        if scale is None and view.model_type() in _SQRT_H_EMBEDDING_SCALE:
            # Gemma scales embeddings by sqrt(H); its reference casts that factor to the
            # activation dtype, so a BF16 comparison must round it the same way.
            scale = math.sqrt(hidden)
        return cls(
            vocab_size=view.get_int("vocab_size", minimum=1),
            hidden_size=hidden,
            logit_softcap=softcap,
            embedding_scale=scale,
            f32_logits=f32_logits,
            draft_vocab_size=mtp_vocab_size,
            tie_word_embeddings=view.get_bool("tie_word_embeddings", default=False),
        )


_SQRT_H_EMBEDDING_SCALE = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})


# --------------------------------------------------------------------------------------------
# Reading config.json.


def load_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """Return the ``config.json`` dict from a mapping, a JSON file, or a directory holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise fail("config", config, "a dict, or a path to config.json or its directory")
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {str(path)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise fail(str(path), type(data).__name__, "a JSON object at the top level")
    return data


def _check_str(key: str, value: Any) -> None:
    if not isinstance(value, str):
        raise fail(key, value, "a string")


class ConfigView:
    """Typed look-ups over a HF config; multimodal configs nest the LM under ``text_config``.

    Keys are looked up in ``text_config`` first, then at the top level (where Qwen3.5 keeps
    ``tie_word_embeddings`` and ``quantization_config``); errors name the key by its path.
    """

    def __init__(self, raw: dict[str, Any]) -> None:
        self._top = raw
        text = raw.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise fail("text_config", text, "a JSON object")
        self._text = text

    def _where(self, key: str) -> tuple[bool, Any, str]:
        if self._text is not None and key in self._text:
            return True, self._text[key], f"text_config.{key}"
        if key in self._top:
            return True, self._top[key], key
        path = f"text_config.{key}" if self._text is not None else key
        return False, None, path

    def model_type(self) -> str:
        # The outer model_type names the checkpoint (qwen3_5_moe); a nested one only its text part.
        if "model_type" in self._top:
            value, path = self._top["model_type"], "model_type"
        elif self._text is not None and "model_type" in self._text:
            value, path = self._text["model_type"], "text_config.model_type"
        else:
            raise ValueError("config key 'model_type' is missing: cannot tell the architecture")
        _check_str(path, value)
        return value

    def has(self, key: str) -> bool:
        found, value, _ = self._where(key)
        return found and value is not None

    def raw(self, key: str, default: Any = None) -> Any:
        found, value, _ = self._where(key)
        return value if found and value is not None else default

    def _get(self, key: str, default: Any, expected: str, check: Callable[[str, Any], None]):
        """The value at ``key`` (``default`` when absent and not None), checked by ``check``."""
        if default is not None and not self.has(key):
            return default
        found, value, path = self._where(key)
        if not found or value is None:
            raise ValueError(f"config key {path!r} is missing: expected {expected}")
        check(path, value)
        return value

    def get_int(self, key: str, *, minimum: int = 0, default: int | None = None) -> int:
        return self._get(key, default, "an integer", functools.partial(check_int, minimum=minimum))

    def get_float(self, key: str, *, default: float | None = None) -> float:
        check = functools.partial(check_float, positive=False)
        return float(self._get(key, default, "a number", check))

    def optional_float(self, key: str) -> float | None:
        return self.get_float(key) if self.has(key) else None

    def get_bool(self, key: str, *, default: bool | None = None) -> bool:
        return self._get(key, default, "a bool", check_bool)

    def get_str(self, key: str, *, default: str | None = None) -> str:
        return self._get(key, default, "a string", _check_str)

    def rope(self, key: str, *, default: float | None = None) -> float:
        """``rope_theta``/``partial_rotary_factor``: top level, or in ``rope_parameters``."""
        if self.has(key):
            return self.get_float(key)
        params = self.raw("rope_parameters")
        if isinstance(params, dict) and params.get(key) is not None:
            value = params[key]
            check_float(f"rope_parameters.{key}", value, positive=False)
            return float(value)
        if default is not None:
            return default
        return self.get_float(key)  # raises, naming the key

    def rope_type(self) -> str:
        for container in ("rope_scaling", "rope_parameters"):
            params = self.raw(container)
            if params is None:
                continue
            if not isinstance(params, dict):
                raise fail(container, params, "a JSON object or null")
            kind = params.get("rope_type", params.get("type"))
            if kind is not None:
                if not isinstance(kind, str):
                    raise fail(f"{container}.rope_type", kind, "a string")
                return kind
        return "default"


def _fp8_block_size(view: ConfigView) -> tuple[int, int] | None:
    quant = view.raw("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if block is None:
        return None
    if not isinstance(block, list) or len(block) != 2:
        raise fail("quantization_config.weight_block_size", block, "[rows, cols]")
    for size in block:
        check_int("quantization_config.weight_block_size", size, minimum=1)
    return (block[0], block[1])


def _mtp_count(view: ConfigView, key: str, *, default: int | None = None) -> int:
    count = view.get_int(key, minimum=0, default=default)
    if count < 1:
        raise fail(key, count, "at least 1 MTP module to build a drafter from")
    return count


def _attention(
    view: ConfigView, *, rotary_default: float, head_dim: int | None = None
) -> dict[str, Any]:
    """Fields every family reads alike, with the plain layer (non-zero-centred norms, no output
    gate, ``concat[norm(e), norm(h)]``) that all but the Qwen family keep; ``head_dim`` when
    the family derives it (MLA: qk_nope + qk_rope)."""
    hidden = view.get_int("hidden_size", minimum=1)
    heads = view.get_int("num_attention_heads", minimum=1)
    if head_dim is not None:
        pass
    elif view.has("head_dim"):
        head_dim = view.get_int("head_dim", minimum=1)
    else:
        if hidden % heads:
            raise fail(
                "num_attention_heads",
                heads,
                f"a divisor of hidden_size={hidden} when head_dim is absent",
            )
        head_dim = hidden // heads
    return dict(
        hidden_size=hidden,
        vocab_size=view.get_int("vocab_size", minimum=1),
        num_attention_heads=heads,
        # HF convention: absent means multi-head attention.
        num_key_value_heads=view.get_int("num_key_value_heads", minimum=1, default=heads),
        head_dim=head_dim,
        partial_rotary_factor=view.rope("partial_rotary_factor", default=rotary_default),
        rope_theta=view.rope("rope_theta"),
        rope_type=view.rope_type(),
        rms_norm_eps=view.get_float("rms_norm_eps"),
        max_position_embeddings=view.get_int("max_position_embeddings", minimum=1),
        tie_word_embeddings=view.get_bool("tie_word_embeddings", default=False),
        zero_centered_norm=False,
        attn_output_gate=False,
        input_order=InputOrder.EMBED_FIRST,
    )


def qwen_moe_config(view: ConfigView, *, norm_topk_prob: bool) -> MoeConfig:
    return MoeConfig(
        num_experts=view.get_int("num_experts", minimum=1),
        num_experts_per_tok=view.get_int("num_experts_per_tok", minimum=1),
        moe_intermediate_size=view.get_int("moe_intermediate_size", minimum=1),
        shared_expert_intermediate_size=view.get_int("shared_expert_intermediate_size"),
        shared_expert_gate=view.get_int("shared_expert_intermediate_size") > 0,
        norm_topk_prob=norm_topk_prob,
        scoring=RouterScoring.SOFTMAX,
    )


def _qwen_common(view: ConfigView) -> dict[str, Any]:
    # Qwen3-Next's config has no attn_output_gate key but its attention is always gated;
    # Qwen3.5 states it. HF defaults partial_rotary_factor to 0.25 for both.
    return dict(
        _attention(view, rotary_default=0.25),
        zero_centered_norm=True,
        attn_output_gate=view.get_bool("attn_output_gate", default=True),
        qk_norm=True,
        mtp_use_dedicated_embeddings=view.get_bool("mtp_use_dedicated_embeddings", default=False),
    )


def _parse_qwen3_next(view: ConfigView, model_type: str) -> dict[str, Any]:
    # Every published Qwen3-Next layer, the MTP one included, is MoE (decoder_sparse_step=1).
    # As in the HF decoder layer, `num_experts: 0` makes every layer a dense SwiGLU MLP (the
    # project's own tiny pair uses that). The published configs omit num_nextn_predict_layers
    # while shipping one MTP layer, so absent means 1 (as in vLLM); an explicit 0 still means
    # "no MTP".
    fields = dict(
        _qwen_common(view),
        architecture=Architecture.QWEN3_NEXT,
        num_mtp_modules=_mtp_count(view, "num_nextn_predict_layers", default=1),
    )
    if view.has("num_experts") and view.get_int("num_experts") == 0:
        fields.update(
            ffn=FfnKind.DENSE, intermediate_size=view.get_int("intermediate_size", minimum=1)
        )
    else:
        fields.update(
            ffn=FfnKind.MOE,
            moe=qwen_moe_config(view, norm_topk_prob=view.get_bool("norm_topk_prob", default=True)),
        )
    return fields


def _parse_qwen3_5(view: ConfigView, model_type: str) -> dict[str, Any]:
    fields = dict(
        _qwen_common(view),
        architecture=Architecture.QWEN3_5,
        num_mtp_modules=_mtp_count(view, "mtp_num_hidden_layers"),
    )
    if "moe" in model_type:
        # The Qwen3.5 MoE router always renormalises its top-k; the config has no switch.
        fields.update(ffn=FfnKind.MOE, moe=qwen_moe_config(view, norm_topk_prob=True))
    else:
        fields.update(
            ffn=FfnKind.DENSE, intermediate_size=view.get_int("intermediate_size", minimum=1)
        )
    return fields


def _scoring(view: ConfigView, *, default: str) -> RouterScoring:
    name = view.get_str("scoring_func", default=default)
    try:
        return RouterScoring(name)
    except ValueError:
        raise fail("scoring_func", name, "'softmax' or 'sigmoid'") from None


def _sigmoid_moe(view: ConfigView, *, experts_key: str, correction_bias: bool) -> MoeConfig:
    intermediate = view.get_int("moe_intermediate_size", minimum=1)
    return MoeConfig(
        num_experts=view.get_int(experts_key, minimum=1),
        num_experts_per_tok=view.get_int("num_experts_per_tok", minimum=1),
        moe_intermediate_size=intermediate,
        shared_expert_intermediate_size=view.get_int("n_shared_experts", default=0) * intermediate,
        norm_topk_prob=view.get_bool("norm_topk_prob", default=True),
        scoring=_scoring(view, default="sigmoid"),
        score_correction_bias=correction_bias,
        routed_scaling_factor=view.get_float("routed_scaling_factor", default=1.0),
        n_group=view.get_int("n_group", minimum=1, default=1),
        topk_group=view.get_int("topk_group", minimum=1, default=1),
    )


def _yarn(view: ConfigView) -> YarnScaling | None:
    """The YaRN parameters of ``rope_scaling`` (or ``rope_parameters``), None for other RoPE."""
    if view.rope_type() != "yarn":
        return None
    params = view.raw("rope_scaling") or view.raw("rope_parameters")
    name = "rope_scaling" if view.has("rope_scaling") else "rope_parameters"
    if "factor" not in params:
        raise ValueError(f"config key '{name}.factor' is missing: expected a number for YaRN")
    optional = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
    return YarnScaling(
        factor=params["factor"],
        original_max_position_embeddings=params.get(
            "original_max_position_embeddings", view.get_int("max_position_embeddings")
        ),
        truncate=params.get("truncate", True),
        **{k: params[k] for k in optional if params.get(k) is not None},
    )


def _mla(view: ConfigView) -> MlaConfig:
    q_lora = view.raw("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_lora is None else view.get_int("q_lora_rank", minimum=1),
        kv_lora_rank=view.get_int("kv_lora_rank", minimum=1),
        qk_nope_head_dim=view.get_int("qk_nope_head_dim", minimum=1),
        qk_rope_head_dim=view.get_int("qk_rope_head_dim", minimum=1),
        v_head_dim=view.get_int("v_head_dim", minimum=1),
        rope_interleave=view.get_bool("rope_interleave", default=True),
    )


def _mla_nextn(view: ConfigView, mla: MlaConfig, moe: MoeConfig) -> dict[str, Any]:
    """The MLA + MoE NextN layer of DeepSeek-V3 and GLM-4.7-Flash."""
    # transformers rotates int(qk_rope_head_dim * partial_rotary_factor) dims but splits q and k
    # at qk_rope_head_dim, so only a factor of 1 is a model it can run.
    factor = view.rope("partial_rotary_factor", default=1.0)
    if factor != 1.0:
        raise fail("partial_rotary_factor", factor, "1.0 with MLA (RoPE on all qk_rope_head_dim)")
    return dict(
        _attention(view, rotary_default=1.0, head_dim=mla.qk_head_dim),
        partial_rotary_factor=mla.qk_rope_head_dim / mla.qk_head_dim,
        rope_scaling=_yarn(view),
        qk_norm=False,  # MLA normalises its latents (q_a/kv_a layernorms) instead
        attention_bias=view.get_bool("attention_bias", default=False),
        ffn=FfnKind.MOE,
        moe=moe,
        mla=mla,
        num_mtp_modules=_mtp_count(view, "num_nextn_predict_layers"),
        first_mtp_layer=view.get_int("num_hidden_layers", minimum=1),
        zero_embedding_at_position_0=True,
    )


def _parse_deepseek_v3(view: ConfigView, model_type: str) -> dict[str, Any]:
    # The MTP layer sits past first_k_dense_replace, so its FFN is the routed MoE.
    moe = _sigmoid_moe(
        view,
        experts_key="n_routed_experts",
        correction_bias=view.get_str("topk_method", default="greedy") == "noaux_tc",
    )
    fields = dict(_mla_nextn(view, _mla(view), moe), architecture=Architecture.DEEPSEEK_V3)
    if model_type == "deepseek_v32":
        fields["sparse_attention_topk"] = view.get_int("index_topk", minimum=1, default=2048)
    return fields


def _parse_glm4_moe_lite(view: ConfigView, model_type: str) -> dict[str, Any]:
    # GLM-4.7-Flash: transformers' Glm4MoeLiteAttention is DeepseekV3Attention and its router
    # GLM's (sigmoid, e_score_correction_bias, groups), with no topk_method key.
    moe = _sigmoid_moe(view, experts_key="n_routed_experts", correction_bias=True)
    return dict(_mla_nextn(view, _mla(view), moe), architecture=Architecture.GLM4_MOE_LITE)


def _parse_glm4_moe(view: ConfigView, model_type: str) -> dict[str, Any]:
    # GLM-4.5 routes like DeepSeek-V3 (sigmoid, e_score_correction_bias) without saying so in
    # its config. Its HF class default for partial_rotary_factor is 0.5.
    experts_key = "n_routed_experts" if view.has("n_routed_experts") else "num_experts"
    return dict(
        _attention(view, rotary_default=0.5),
        architecture=Architecture.GLM4_MOE,
        qk_norm=view.get_bool("use_qk_norm", default=False),
        attention_bias=view.get_bool("attention_bias", default=False),
        ffn=FfnKind.MOE,
        moe=_sigmoid_moe(view, experts_key=experts_key, correction_bias=True),
        num_mtp_modules=_mtp_count(view, "num_nextn_predict_layers"),
        first_mtp_layer=view.get_int("num_hidden_layers", minimum=1),
        zero_embedding_at_position_0=True,
    )


def _parse_mimo(view: ConfigView, model_type: str) -> dict[str, Any]:
    # A Qwen2 decoder layer: dense SwiGLU, q/k/v bias always on, full-width RoPE.
    return dict(
        _attention(view, rotary_default=1.0),
        architecture=Architecture.MIMO,
        qk_norm=False,
        attention_bias=True,
        ffn=FfnKind.DENSE,
        intermediate_size=view.get_int("intermediate_size", minimum=1),
        num_mtp_modules=_mtp_count(view, "num_nextn_predict_layers"),
        input_order=InputOrder.HIDDEN_FIRST,
        zero_embedding_at_position_0=True,
    )


def _parse_minimax_m2(view: ConfigView, model_type: str) -> dict[str, Any]:
    if not view.get_bool("use_mtp", default=False):
        raise fail("use_mtp", view.raw("use_mtp"), "true to build a drafter (no MTP declared)")
    fields = _attention(view, rotary_default=1.0)
    if view.has("rotary_dim"):
        rotary = view.get_int("rotary_dim", minimum=1)
        fields["partial_rotary_factor"] = rotary / fields["head_dim"]
    # MiniMax-M2's `intermediate_size` is the routed-expert width; every layer is MoE.
    moe = MoeConfig(
        num_experts=view.get_int("num_local_experts", minimum=1),
        num_experts_per_tok=view.get_int("num_experts_per_tok", minimum=1),
        moe_intermediate_size=view.get_int("intermediate_size", minimum=1),
        shared_expert_intermediate_size=view.get_int("shared_intermediate_size", default=0),
        norm_topk_prob=view.get_bool("norm_topk_prob", default=True),
        scoring=_scoring(view, default="softmax"),
        score_correction_bias=view.get_bool("use_routing_bias", default=False),
        routed_scaling_factor=view.get_float("routed_scaling_factor", default=1.0),
    )
    # The MTP modules' input layout is unpublished (no weights ship); DeepSeek-style is assumed.
    return dict(
        fields,
        architecture=Architecture.MINIMAX_M2,
        qk_norm=view.get_bool("use_qk_norm", default=False),
        ffn=FfnKind.MOE,
        moe=moe,
        num_mtp_modules=_mtp_count(view, "num_mtp_modules"),
        mtp_layers_per_module=view.get_int("mtp_transformer_layers", minimum=1, default=1),
    )


#: MTP-bearing model types whose configs are recognised but not described by ``DrafterConfig``
#: yet, with what is missing.
_KNOWN_UNPARSED = {
    "mimo_v2_flash": (
        "MiMo-V2-Flash's MTP modules (model.mtp.*) use sliding-window attention with attention "
        "sinks and separate k/v head dims (192/128), which the drafter does not implement"
    ),
}

_DRAFTER_PARSERS = {
    "qwen3_next": _parse_qwen3_next,
    "qwen3_5": _parse_qwen3_5,
    "qwen3_5_text": _parse_qwen3_5,
    "qwen3_5_moe": _parse_qwen3_5,
    "qwen3_5_moe_text": _parse_qwen3_5,
    "deepseek_v3": _parse_deepseek_v3,
    "deepseek_v32": _parse_deepseek_v3,
    "glm4_moe": _parse_glm4_moe,
    "glm4_moe_lite": _parse_glm4_moe_lite,
    "mimo": _parse_mimo,
    "minimax_m2": _parse_minimax_m2,
}
