"""Configs parsed from realistic Hugging Face config.json files of every MTP family."""

import copy
import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpjax.config import (
    Architecture,
    DrafterConfig,
    FfnKind,
    HiddenContract,
    InputOrder,
    LMHeadConfig,
    MlaConfig,
    MoeConfig,
    RouterScoring,
    YarnScaling,
    load_hf_config,
)
from mtpjax.layers._spec import shared_expert_name

# ---- realistic config.json contents (real key names, published sizes) -----------------------

QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_QWEN35_ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
}

QWEN35_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17408,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mamba_ssm_dtype": "float32",
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _QWEN35_ROPE,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 248057,
    "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152},
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}

# Qwen3.6-35B-A3B-FP8 style: MoE text config, packed experts, FP8 block-128 declared at top level.
QWEN36_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "text_config": {
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _QWEN35_ROPE,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27},
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

GLM45 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0",
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 151552,
}

MIMO_7B = {
    "architectures": ["MiMoForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 32768,
    "max_window_layers": 36,
    "model_type": "mimo",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 640000,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151680,
}

MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "model_type": "minimax_m2",
    "mtp_transformer_layers": 1,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "transformers_version": "4.46.1",
    "use_cache": True,
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}

ALL = {
    "qwen3_next": QWEN3_NEXT_80B,
    "qwen3_5": QWEN35_27B,
    "qwen3_6_moe": QWEN36_35B_A3B,
    "deepseek_v3": DEEPSEEK_V3,
    "glm4_moe": GLM45,
    "mimo": MIMO_7B,
    "minimax_m2": MINIMAX_M2,
}


def edited(base, path, value=..., *, delete=False):
    """A deep copy of `base` with the dotted `path` set to `value` (or deleted)."""
    out = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    if delete:
        del node[leaf]
    else:
        node[leaf] = value
    return out


def write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


# ---- parsed fields per family ------------------------------------------------------------


def test_qwen3_next_80b():
    c = DrafterConfig.from_hf_config(QWEN3_NEXT_80B)
    assert c.architecture is Architecture.QWEN3_NEXT
    assert (c.hidden_size, c.vocab_size) == (2048, 151936)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)
    assert c.rotary_dim == 64
    assert c.rope_theta == 1e7 and c.rope_type == "default"
    assert c.zero_centered_norm and c.attn_output_gate and c.qk_norm
    assert c.q_proj_width == 16 * 256 * 2
    assert c.kv_width == 2 * 256
    assert c.num_kv_groups == 8
    # Every Qwen3-Next layer is MoE; absent num_nextn_predict_layers means the one shipped layer.
    assert c.ffn is FfnKind.MOE and c.intermediate_size == 0
    assert c.moe == MoeConfig(
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        shared_expert_gate=True,
        norm_topk_prob=True,
        scoring=RouterScoring.SOFTMAX,
    )
    assert c.num_mtp_modules == 1 and not c.mtp_use_dedicated_embeddings
    assert c.input_order is InputOrder.EMBED_FIRST and not c.zero_embedding_at_position_0
    assert c.mla is None and c.fp8_block_size is None
    assert c.max_position_embeddings == 262144
    assert c.runnable and c.unsupported_reason is None


def test_qwen3_next_explicit_mtp_count_is_read():
    c = DrafterConfig.from_hf_config(edited(QWEN3_NEXT_80B, "num_nextn_predict_layers", 2))
    assert c.num_mtp_modules == 2


def test_qwen35_dense_27b():
    c = DrafterConfig.from_hf_config(QWEN35_27B)
    assert c.architecture is Architecture.QWEN3_5
    assert (c.hidden_size, c.vocab_size) == (5120, 248320)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    assert c.partial_rotary_factor == 0.25 and c.rotary_dim == 64
    assert c.rope_theta == 1e7  # read from text_config.rope_parameters
    assert c.ffn is FfnKind.DENSE and c.intermediate_size == 17408 and c.moe is None
    assert c.q_proj_width == 24 * 256 * 2 == 12288
    assert c.kv_width == 1024
    assert c.num_mtp_modules == 1
    assert c.zero_centered_norm and c.attn_output_gate and c.qk_norm
    assert not c.tie_word_embeddings
    assert c.runnable


def test_qwen36_moe_nested_under_text_config():
    c = DrafterConfig.from_hf_config(QWEN36_35B_A3B)
    assert c.architecture is Architecture.QWEN3_5
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 2)
    assert c.ffn is FfnKind.MOE
    assert c.moe.num_experts == 256 and c.moe.num_experts_per_tok == 8
    assert c.moe.moe_intermediate_size == 512
    assert c.moe.shared_expert_intermediate_size == 512 and c.moe.shared_expert_gate
    assert c.moe.norm_topk_prob and c.moe.scoring is RouterScoring.SOFTMAX
    # quantization_config lives at the top level, beside text_config.
    assert c.fp8_block_size == (128, 128)
    assert c.runnable


def test_qwen35_text_only_config_is_accepted():
    text = dict(QWEN35_27B["text_config"])
    assert DrafterConfig.from_hf_config(text) == DrafterConfig.from_hf_config(QWEN35_27B)


def test_qwen35_top_level_keys_back_up_text_config():
    cfg = edited(QWEN35_27B, "tie_word_embeddings", True)
    assert DrafterConfig.from_hf_config(cfg).tie_word_embeddings
    cfg = edited(cfg, "text_config.tie_word_embeddings", False)
    assert not DrafterConfig.from_hf_config(cfg).tie_word_embeddings  # nested value wins


def test_qwen35_dedicated_embeddings_flag():
    cfg = edited(QWEN35_27B, "text_config.mtp_use_dedicated_embeddings", True)
    assert DrafterConfig.from_hf_config(cfg).mtp_use_dedicated_embeddings


def test_deepseek_v3():
    c = DrafterConfig.from_hf_config(DEEPSEEK_V3)
    assert c.architecture is Architecture.DEEPSEEK_V3
    assert c.mla == MlaConfig(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )
    assert c.head_dim == 192 and c.rotary_dim == 64
    assert c.mla.latent_width == 576
    assert c.rope_type == "yarn"
    assert c.ffn is FfnKind.MOE
    m = c.moe
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (256, 8, 2048)
    assert m.shared_expert_intermediate_size == 2048 and not m.shared_expert_gate
    assert m.scoring is RouterScoring.SIGMOID and m.score_correction_bias
    assert (m.n_group, m.topk_group, m.routed_scaling_factor) == (8, 4, 2.5)
    assert c.num_mtp_modules == 1
    assert c.zero_embedding_at_position_0 and c.input_order is InputOrder.EMBED_FIRST
    assert not c.zero_centered_norm
    assert c.fp8_block_size == (128, 128)
    assert c.rope_scaling == YarnScaling(
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert c.rope_scaling.cos_sin_scale == 1.0  # mscale == mscale_all_dim
    assert c.rope_scaling.softmax_scale_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    # The post-norm hidden (after shared_head.norm), as for every family.
    assert c.default_hidden_contract is HiddenContract.POST_NORM
    assert c.first_mtp_layer == 61 and c.mla.rope_interleave
    assert c.runnable and c.unsupported_reason is None


def test_glm45():
    c = DrafterConfig.from_hf_config(GLM45)
    assert c.architecture is Architecture.GLM4_MOE
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (96, 8, 128)
    assert c.rotary_dim == 64  # partial_rotary_factor 0.5
    assert c.qk_norm and c.attention_bias and not c.attn_output_gate
    assert c.q_proj_width == 96 * 128
    m = c.moe
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (160, 8, 1536)
    assert m.shared_expert_intermediate_size == 1536
    assert m.scoring is RouterScoring.SIGMOID and m.score_correction_bias
    assert m.routed_scaling_factor == 2.5
    assert c.zero_embedding_at_position_0 and not c.zero_centered_norm
    assert c.rms_norm_eps == 1e-5
    assert c.first_mtp_layer == 92  # model.layers.92 after 92 decoder layers
    assert shared_expert_name(c) == "mlp.shared_experts"
    assert c.runnable and c.unsupported_reason is None
    assert c.default_hidden_contract is HiddenContract.POST_NORM


def test_glm45_air_without_qk_norm():
    c = DrafterConfig.from_hf_config(edited(GLM45, "use_qk_norm", False))
    assert not c.qk_norm


def test_mimo_7b():
    c = DrafterConfig.from_hf_config(MIMO_7B)
    assert c.architecture is Architecture.MIMO
    assert c.head_dim == 4096 // 32 == 128  # no head_dim key: H / Nq
    assert c.rotary_dim == 128  # full-width RoPE
    assert c.ffn is FfnKind.DENSE and c.intermediate_size == 11008
    assert c.attention_bias and not c.qk_norm and not c.zero_centered_norm
    assert c.input_order is InputOrder.HIDDEN_FIRST
    assert c.zero_embedding_at_position_0
    assert c.rope_theta == 640000.0
    assert c.runnable and c.unsupported_reason is None
    assert c.default_hidden_contract is HiddenContract.POST_NORM


def test_minimax_m2():
    c = DrafterConfig.from_hf_config(MINIMAX_M2)
    assert c.architecture is Architecture.MINIMAX_M2
    assert c.num_mtp_modules == 3 and c.mtp_layers_per_module == 1
    assert c.head_dim == 128 and c.rotary_dim == 64
    assert c.qk_norm
    m = c.moe
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (256, 8, 1536)
    assert not m.has_shared_expert
    assert m.scoring is RouterScoring.SIGMOID and m.score_correction_bias
    assert c.ffn is FfnKind.MOE and c.intermediate_size == 0
    assert not c.runnable and "MiniMax" in c.unsupported_reason


# ---- sources: dict, file, directory --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL))
def test_dict_file_and_directory_agree(tmp_path, name):
    cfg = ALL[name]
    path = write(tmp_path, cfg)
    from_dict = DrafterConfig.from_hf_config(cfg)
    assert DrafterConfig.from_hf_config(path) == from_dict
    assert DrafterConfig.from_hf_config(str(path)) == from_dict
    assert DrafterConfig.from_hf_config(tmp_path) == from_dict
    assert DrafterConfig.from_hf_config(str(tmp_path)) == from_dict


def test_parsing_does_not_mutate_the_input():
    cfg = copy.deepcopy(QWEN36_35B_A3B)
    DrafterConfig.from_hf_config(cfg)
    assert cfg == QWEN36_35B_A3B


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        DrafterConfig.from_hf_config(tmp_path)


def test_invalid_json_is_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)


def test_non_object_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="JSON object"):
        load_hf_config(tmp_path)


def test_bad_source_type_is_refused():
    with pytest.raises(ValueError, match="config=42"):
        DrafterConfig.from_hf_config(42)


# ---- errors name the key -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "path", "key"),
    [
        (QWEN3_NEXT_80B, "hidden_size", "hidden_size"),
        (QWEN3_NEXT_80B, "vocab_size", "vocab_size"),
        (QWEN3_NEXT_80B, "num_attention_heads", "num_attention_heads"),
        (QWEN3_NEXT_80B, "rms_norm_eps", "rms_norm_eps"),
        (QWEN3_NEXT_80B, "rope_theta", "rope_theta"),
        (QWEN3_NEXT_80B, "max_position_embeddings", "max_position_embeddings"),
        (QWEN3_NEXT_80B, "num_experts", "num_experts"),
        (QWEN3_NEXT_80B, "shared_expert_intermediate_size", "shared_expert_intermediate_size"),
        (QWEN35_27B, "text_config.mtp_num_hidden_layers", "text_config.mtp_num_hidden_layers"),
        (QWEN35_27B, "text_config.intermediate_size", "text_config.intermediate_size"),
        (QWEN36_35B_A3B, "text_config.moe_intermediate_size", "text_config.moe_intermediate_size"),
        (DEEPSEEK_V3, "kv_lora_rank", "kv_lora_rank"),
        (DEEPSEEK_V3, "n_routed_experts", "n_routed_experts"),
        (DEEPSEEK_V3, "num_nextn_predict_layers", "num_nextn_predict_layers"),
        (GLM45, "num_nextn_predict_layers", "num_nextn_predict_layers"),
        (MIMO_7B, "num_nextn_predict_layers", "num_nextn_predict_layers"),
        (MIMO_7B, "intermediate_size", "intermediate_size"),
        (MINIMAX_M2, "num_mtp_modules", "num_mtp_modules"),
        (MINIMAX_M2, "num_local_experts", "num_local_experts"),
        (QWEN3_NEXT_80B, "model_type", "model_type"),
    ],
)
def test_missing_key_is_named(base, path, key):
    with pytest.raises(ValueError, match=f"'{key}'.*missing"):
        DrafterConfig.from_hf_config(edited(base, path, delete=True))


def test_missing_rope_theta_in_rope_parameters_is_named():
    cfg = edited(QWEN35_27B, "text_config.rope_parameters.rope_theta", delete=True)
    with pytest.raises(ValueError, match="rope_theta"):
        DrafterConfig.from_hf_config(cfg)


def test_unknown_model_type_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"model_type='llama'.*qwen3_next"):
        DrafterConfig.from_hf_config(edited(QWEN3_NEXT_80B, "model_type", "llama"))


def test_a_known_mtp_model_not_yet_described_says_what_is_missing():
    with pytest.raises(ValueError, match=r"'mimo_v2_flash': .*sliding-window attention"):
        DrafterConfig.from_hf_config(edited(QWEN3_NEXT_80B, "model_type", "mimo_v2_flash"))


@pytest.mark.parametrize(
    ("base", "path", "value", "match"),
    [
        (QWEN3_NEXT_80B, "hidden_size", "2048", r"hidden_size='2048'.*integer"),
        (QWEN3_NEXT_80B, "hidden_size", True, r"hidden_size=True.*integer"),
        (QWEN3_NEXT_80B, "hidden_size", 0, r"hidden_size=0.*>= 1"),
        (QWEN3_NEXT_80B, "rope_theta", "big", r"rope_theta='big'.*number"),
        (QWEN3_NEXT_80B, "norm_topk_prob", 1, r"norm_topk_prob=1.*bool"),
        (QWEN3_NEXT_80B, "num_key_value_heads", 3, r"num_key_value_heads=3.*divisor"),
        (QWEN3_NEXT_80B, "num_experts_per_tok", 513, r"num_experts_per_tok=513.*num_experts=512"),
        (QWEN3_NEXT_80B, "partial_rotary_factor", 0.0, r"partial_rotary_factor=0.0"),
        (QWEN3_NEXT_80B, "partial_rotary_factor", 1.5, r"partial_rotary_factor=1.5.*\(0, 1\]"),
        # int(256 * 3/256) = 3: an odd rotary dim cannot be split into NeoX halves.
        (QWEN3_NEXT_80B, "partial_rotary_factor", 3 / 256, r"partial_rotary_factor=.*even"),
        (QWEN3_NEXT_80B, "rms_norm_eps", 0, r"rms_norm_eps=0.*> 0"),
        (QWEN3_NEXT_80B, "num_nextn_predict_layers", 0, r"num_nextn_predict_layers=0.*at least 1"),
        (QWEN35_27B, "text_config.mtp_num_hidden_layers", 0, r"mtp_num_hidden_layers=0"),
        (QWEN35_27B, "text_config", [1], r"text_config=\[1\].*JSON object"),
        (GLM45, "num_nextn_predict_layers", 0, r"num_nextn_predict_layers=0.*at least 1"),
        (GLM45, "topk_group", 2, r"topk_group=2.*n_group=1"),
        (DEEPSEEK_V3, "n_group", 7, r"n_group=7.*divisor of num_experts=256"),
        (DEEPSEEK_V3, "scoring_func", "relu", r"scoring_func='relu'"),
        (DEEPSEEK_V3, "qk_rope_head_dim", 63, r"qk_rope_head_dim=63.*even"),
        (DEEPSEEK_V3, "quantization_config.weight_block_size", [128], r"weight_block_size"),
        (MINIMAX_M2, "use_mtp", False, r"use_mtp=False"),
        (MINIMAX_M2, "num_mtp_modules", 0, r"num_mtp_modules=0.*at least 1"),
        (MIMO_7B, "num_attention_heads", 30, r"num_attention_heads=30.*hidden_size=4096"),
    ],
)
def test_inconsistent_value_is_named(base, path, value, match):
    with pytest.raises(ValueError, match=match):
        DrafterConfig.from_hf_config(edited(base, path, value))


def test_mtp_vocab_size_above_vocab_is_refused():
    with pytest.raises(ValueError, match=r"mtp_vocab_size=151937.*vocab_size=151936"):
        DrafterConfig.from_hf_config(QWEN3_NEXT_80B, mtp_vocab_size=151937)


def test_mtp_vocab_size_reduces_draft_vocab():
    c = DrafterConfig.from_hf_config(QWEN3_NEXT_80B, mtp_vocab_size=32000)
    assert c.draft_vocab_size == 32000 and c.vocab_size == 151936
    assert DrafterConfig.from_hf_config(QWEN3_NEXT_80B).draft_vocab_size == 151936


# ---- direct construction and validation ---------------------------------------------------


def test_dense_ffn_with_moe_is_refused():
    moe = DrafterConfig.tiny(ffn=FfnKind.MOE).moe
    with pytest.raises(ValueError, match=r"moe=.*None for a dense FFN"):
        DrafterConfig.tiny(moe=moe)


def test_moe_ffn_without_moe_is_refused():
    with pytest.raises(ValueError, match=r"moe=None.*MoE"):
        DrafterConfig.tiny(ffn=FfnKind.MOE, moe=None)


def test_dense_ffn_needs_a_width():
    with pytest.raises(ValueError, match=r"intermediate_size=0"):
        DrafterConfig.tiny(intermediate_size=0)


def test_mla_head_dim_must_match():
    mla = MlaConfig(
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8
    )
    with pytest.raises(ValueError, match=r"head_dim=32.*qk_nope_head_dim \+ qk_rope_head_dim"):
        DrafterConfig.tiny(mla=mla, head_dim=32)
    c = DrafterConfig.tiny(mla=mla, head_dim=16)
    assert c.rotary_dim == 8  # taken from the MLA rope dim, not head_dim * factor
    assert "MLA" in c.unsupported_reason


def test_enum_fields_are_type_checked():
    with pytest.raises(ValueError, match=r"ffn='dense'.*FfnKind"):
        DrafterConfig.tiny(ffn="dense")
    with pytest.raises(ValueError, match=r"architecture='qwen3_5'.*Architecture"):
        DrafterConfig.tiny(architecture="qwen3_5")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_experts_per_tok=5), r"num_experts_per_tok=5.*num_experts=4"),
        (dict(shared_expert_intermediate_size=0), r"shared_expert_gate=True"),
        (dict(n_group=3), r"n_group=3.*divisor"),
        (dict(n_group=2, topk_group=1, num_experts_per_tok=3), r"num_experts_per_tok=3.*= 2"),
        (dict(routed_scaling_factor=0.0), r"routed_scaling_factor=0.0"),
        (dict(scoring="softmax"), r"scoring='softmax'.*RouterScoring"),
    ],
)
def test_moe_validation(kwargs, match):
    base = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        shared_expert_gate=True,
    )
    with pytest.raises(ValueError, match=match):
        MoeConfig(**(base | kwargs))


def test_tiny_configs_are_valid_and_runnable():
    dense = DrafterConfig.tiny()
    moe = DrafterConfig.tiny(ffn=FfnKind.MOE)
    assert dense.ffn is FfnKind.DENSE and dense.intermediate_size > 0 and dense.moe is None
    assert moe.ffn is FfnKind.MOE and moe.moe is not None and moe.moe.shared_expert_gate
    assert dense.runnable and moe.runnable
    assert dense.rotary_dim == 8 and dense.rotary_dim % 2 == 0
    assert DrafterConfig.tiny(hidden_size=32).hidden_size == 32


# ---- runnable / unsupported_reason ---------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (dict(rope_type="yarn"), "rope_type 'yarn'"),
        (dict(mtp_layers_per_module=2), "layers per MTP module"),
        (dict(first_mtp_layer=4), "the NextN layout (first_mtp_layer) for qwen3_5"),
        (
            dict(architecture=Architecture.GLM4_MOE, zero_centered_norm=False),
            "NextN modules without their layer index (first_mtp_layer)",
        ),
    ],
)
def test_qwen_family_features_outside_the_drafter_are_reported(overrides, needle):
    c = DrafterConfig.tiny(**overrides)
    assert not c.runnable
    assert needle in c.unsupported_reason


def test_layer_features_of_other_families_run_in_any_family():
    # One layer implements them all: plain norms, q/k/v bias, MiMo's input order, sigmoid
    # group-limited routing with the correction bias.
    moe = dataclasses.replace(
        DrafterConfig.tiny(ffn=FfnKind.MOE).moe,
        scoring=RouterScoring.SIGMOID,
        score_correction_bias=True,
        n_group=2,
        topk_group=1,
    )
    c = DrafterConfig.tiny(
        ffn=FfnKind.MOE,
        moe=moe,
        zero_centered_norm=False,
        attention_bias=True,
        input_order=InputOrder.HIDDEN_FIRST,
    )
    assert c.runnable and c.unsupported_reason is None


def test_grouped_correction_routing_needs_two_experts_per_group():
    base = DrafterConfig.tiny(ffn=FfnKind.MOE).moe
    with pytest.raises(ValueError, match="n_group=4: expected at most num_experts / 2"):
        dataclasses.replace(
            base, score_correction_bias=True, n_group=4, topk_group=2, num_experts_per_tok=1
        )


def test_qwen_with_yarn_rope_from_hf_is_not_runnable():
    cfg = edited(QWEN3_NEXT_80B, "rope_scaling", {"rope_type": "yarn", "factor": 4.0})
    c = DrafterConfig.from_hf_config(cfg)
    assert c.rope_type == "yarn" and not c.runnable


# ---- static-arg behaviour: hashable, frozen, one trace per distinct config ----------------


def test_configs_are_hashable_and_equal_by_value():
    for cfg in ALL.values():
        a = DrafterConfig.from_hf_config(cfg)
        b = DrafterConfig.from_hf_config(copy.deepcopy(cfg))
        assert a == b and hash(a) == hash(b) and a is not b
    head = LMHeadConfig.from_hf_config(QWEN35_27B)
    assert hash(head) == hash(LMHeadConfig.from_hf_config(copy.deepcopy(QWEN35_27B)))


def test_configs_are_frozen():
    c = DrafterConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        DrafterConfig.tiny(ffn=FfnKind.MOE).moe.num_experts = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        LMHeadConfig(vocab_size=8, hidden_size=4).vocab_size = 9


def test_keyword_only():
    with pytest.raises(TypeError):
        LMHeadConfig(8, 4)


@pytest.mark.parametrize("cls", [DrafterConfig, LMHeadConfig, MoeConfig, MlaConfig])
def test_a_positional_field_says_keyword_only(cls):
    with pytest.raises(TypeError, match=rf"^{cls.__name__} takes keyword arguments only; got 2 "):
        cls(8, 4)
    with pytest.raises(TypeError, match="got 1 positional"):
        cls(8, hidden_size=4)


def test_jit_traces_once_per_distinct_config():
    traces = []

    @functools.partial(jax.jit, static_argnames="cfg")
    def scale(x, *, cfg):
        traces.append(cfg)
        return x * cfg.q_proj_width + cfg.rotary_dim

    x = jnp.ones((2,), jnp.float32)
    a = DrafterConfig.from_hf_config(QWEN35_27B)
    b = DrafterConfig.from_hf_config(copy.deepcopy(QWEN35_27B))
    assert float(scale(x, cfg=a)[0]) == 12288 + 64
    scale(x, cfg=b)
    assert len(traces) == 1
    scale(x, cfg=DrafterConfig.from_hf_config(QWEN3_NEXT_80B))
    assert len(traces) == 2
    scale(x, cfg=a)
    assert len(traces) == 2


def test_lm_head_config_is_a_static_jit_arg():
    traces = []

    @functools.partial(jax.jit, static_argnames="cfg")
    def rows(x, *, cfg):
        traces.append(cfg)
        return x + cfg.draft_rows

    head = DrafterConfig.from_hf_config(QWEN35_27B, mtp_vocab_size=7).lm_head_config()
    assert int(rows(jnp.zeros((), jnp.int32), cfg=head)) == 7
    rows(jnp.zeros((), jnp.int32), cfg=LMHeadConfig.from_hf_config(QWEN35_27B, mtp_vocab_size=7))
    assert len(traces) == 1


# ---- LM head -------------------------------------------------------------------------------


def test_lm_head_from_qwen_matches_the_drafter_helper():
    head = LMHeadConfig.from_hf_config(QWEN35_27B, mtp_vocab_size=1000)
    assert head == DrafterConfig.from_hf_config(QWEN35_27B, mtp_vocab_size=1000).lm_head_config()
    assert (head.vocab_size, head.hidden_size) == (248320, 5120)
    assert head.logit_softcap is None and head.embedding_scale is None
    assert head.f32_logits and head.draft_rows == 1000


def test_lm_head_gemma_softcap_and_embedding_scale(tmp_path):
    gemma2 = {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 2304,
        "vocab_size": 256000,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    }
    head = LMHeadConfig.from_hf_config(write(tmp_path, gemma2), f32_logits=False)
    assert head.logit_softcap == 30.0
    assert math.isclose(head.embedding_scale, math.sqrt(2304))
    assert head.tie_word_embeddings and not head.f32_logits
    assert head.draft_rows == 256000
    no_cap = LMHeadConfig.from_hf_config(edited(gemma2, "final_logit_softcapping", None))
    assert no_cap.logit_softcap is None


def test_lm_head_embedding_multiplier_key():
    cfg = {
        "model_type": "granite",
        "hidden_size": 64,
        "vocab_size": 100,
        "embedding_multiplier": 12.0,
    }
    assert LMHeadConfig.from_hf_config(cfg).embedding_scale == 12.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(vocab_size=0), r"vocab_size=0"),
        (dict(hidden_size=-1), r"hidden_size=-1"),
        (dict(logit_softcap=0.0), r"logit_softcap=0.0.*> 0"),
        (dict(logit_softcap=float("inf")), r"logit_softcap=inf.*finite"),
        (dict(embedding_scale=-2.0), r"embedding_scale=-2.0"),
        (dict(draft_vocab_size=9), r"draft_vocab_size=9.*vocab_size=8"),
        (dict(f32_logits=1), r"f32_logits=1.*bool"),
    ],
)
def test_lm_head_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LMHeadConfig(**(dict(vocab_size=8, hidden_size=4) | kwargs))


def test_lm_head_missing_vocab_is_named():
    with pytest.raises(ValueError, match=r"'vocab_size'.*missing"):
        LMHeadConfig.from_hf_config(edited(QWEN3_NEXT_80B, "vocab_size", delete=True))


# ---- enums ---------------------------------------------------------------------------------


def test_enums_parse_from_their_values():
    assert HiddenContract("post_norm") is HiddenContract.POST_NORM
    assert HiddenContract("pre_norm") is HiddenContract.PRE_NORM
    assert HiddenContract("pinned") is HiddenContract.PINNED
    assert {a.value for a in Architecture} == {
        "qwen3_next",
        "qwen3_5",
        "deepseek_v3",
        "glm4_moe",
        "glm4_moe_lite",
        "mimo",
        "minimax_m2",
    }


# ---- properties ----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 16), kv=st.integers(1, 16))
def test_kv_heads_valid_iff_they_divide_q_heads(heads, kv):
    if heads % kv == 0:
        c = DrafterConfig.tiny(num_attention_heads=heads, num_key_value_heads=kv)
        assert c.num_kv_groups * kv == heads
        assert c.q_proj_width == heads * c.head_dim * 2
        assert c.kv_width == kv * c.head_dim
    else:
        with pytest.raises(ValueError, match="num_key_value_heads"):
            DrafterConfig.tiny(num_attention_heads=heads, num_key_value_heads=kv)


@settings(max_examples=40, deadline=None)
@given(head_dim=st.integers(1, 64), factor=st.floats(-0.5, 1.5, allow_nan=False))
def test_rotary_dim_valid_iff_even_and_factor_in_range(head_dim, factor):
    rotary = int(head_dim * factor)
    valid = 0 < factor <= 1 and rotary >= 2 and rotary % 2 == 0
    if valid:
        assert (
            DrafterConfig.tiny(head_dim=head_dim, partial_rotary_factor=factor).rotary_dim == rotary
        )
    else:
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            DrafterConfig.tiny(head_dim=head_dim, partial_rotary_factor=factor)


def test_qwen3_next_without_experts_is_a_dense_head():
    """As in the HF decoder layer, num_experts: 0 means a dense SwiGLU MLP everywhere."""
    c = DrafterConfig.from_hf_config(edited(QWEN3_NEXT_80B, "num_experts", 0))
    assert c.ffn is FfnKind.DENSE and c.moe is None
    assert c.intermediate_size == QWEN3_NEXT_80B["intermediate_size"]
    assert c.runnable
