"""The hybrid target's config from config.json and its loader: Qwen3.5 and Qwen3-Next
directories written here round-trip to the params they were written from, and broken ones fail
naming the tensor."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_fixtures import weight_tensors, write_checkpoint

from mtpjax import hybrid
from mtpjax.checkpoint import CheckpointError
from mtpjax.config import FfnKind
from mtpjax.hybrid import _model as model_lib
from mtpjax.layers import DecoderLayerParams, DenseFfnParams, MoeFfnParams
from mtpjax.weights import Fp8RowWeight, WeightFormat, quantize

LIN, FULL = "linear_attention", "full_attention"


def _common(**extra):
    return dict(
        hidden_size=64,
        num_hidden_layers=4,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        **extra,
    )


def qwen3_5_config(*, tied: bool = True) -> dict:
    """A Qwen3.5 (dense) config.json: the text model nested, RoPE in rope_parameters (with the
    multimodal sections text-only inputs ignore), tie_word_embeddings at the top."""
    text = _common(
        model_type="qwen3_5_text",
        layer_types=[LIN, FULL, LIN, FULL],
        intermediate_size=96,
        attn_output_gate=True,
        mtp_num_hidden_layers=1,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10_000.0,
            partial_rotary_factor=0.5,
            mrope_section=[1, 1, 2],
            mrope_interleaved=True,
        ),
    )
    return dict(model_type="qwen3_5", tie_word_embeddings=tied, text_config=text)


def qwen3_next_config(*, tied: bool = False, **extra) -> dict:
    """A Qwen3-Next (MoE) config.json: flat, layer_types from full_attention_interval."""
    return dict(
        _common(
            model_type="qwen3_next",
            full_attention_interval=2,
            rope_theta=10_000.0,
            partial_rotary_factor=0.5,
            intermediate_size=96,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_nextn_predict_layers=1,
        ),
        tie_word_embeddings=tied,
        **extra,
    )


DENSE = dataclasses.replace(
    hybrid.HybridConfig.tiny(num_hidden_layers=4, full_attention_interval=2),
    tie_word_embeddings=True,
)
MOE = hybrid.HybridConfig.tiny(
    layout=hybrid.GdnLayout.PACKED, ffn=FfnKind.MOE, num_hidden_layers=4, full_attention_interval=2
)


# --------------------------------------------------------------------------------------------
# Config.


def test_from_hf_reads_both_families():
    assert hybrid.HybridConfig.from_hf(qwen3_5_config()) == DENSE
    assert hybrid.HybridConfig.from_hf(qwen3_next_config()) == MOE
    # transformers' rule for Qwen3-Next's FFNs: mlp_only_layers and decoder_sparse_step.
    mixed = hybrid.HybridConfig.from_hf(qwen3_next_config() | dict(mlp_only_layers=[1]))
    assert mixed.ffn_kinds == (FfnKind.MOE, FfnKind.DENSE, FfnKind.MOE, FfnKind.MOE)
    assert mixed.intermediate_size == 96 and mixed.period == 4
    sparse = hybrid.HybridConfig.from_hf(qwen3_next_config() | dict(decoder_sparse_step=2))
    assert sparse.ffn_kinds == (FfnKind.DENSE, FfnKind.MOE) * 2 and sparse.period == 2
    moe35 = qwen3_5_config() | dict(model_type="qwen3_5_moe")
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    moe35["text_config"] = moe35["text_config"] | {
        k: qwen3_next_config()[k] for k in (*moe_keys, "shared_expert_intermediate_size")
    }
    cfg = hybrid.HybridConfig.from_hf(moe35)
    assert cfg.ffn_kinds == (FfnKind.MOE,) * 4 and cfg.moe.norm_topk_prob
    assert cfg.gdn_layout is hybrid.GdnLayout.SPLIT
    # Every fourth layer is full attention when neither key is given.
    default = qwen3_next_config()
    del default["full_attention_interval"]
    layer_types = hybrid.HybridConfig.from_hf(default | dict(num_hidden_layers=8)).layer_types
    assert [t.value for t in layer_types] == [LIN, LIN, LIN, FULL] * 2


@pytest.mark.parametrize(
    "patch, match",
    [
        (dict(model_type="llama"), r"model_type='llama': expected one of qwen3_5"),
        (dict(layer_types=[LIN, "mamba", LIN, FULL]), r"layer_types\[1\]='mamba': expected one"),
        (dict(layer_types=[LIN, FULL]), r"layer_types=.*expected a list of 4"),
        (dict(linear_num_key_heads=3), r"linear_num_key_heads=3: expected a divisor of"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu': expected 'silu'"),
        (dict(rope_scaling=dict(rope_type="yarn")), r"rope_type='yarn'"),
        (dict(num_experts_per_tok=None), r"'num_experts_per_tok' is missing"),
    ],
)
def test_from_hf_names_what_it_cannot_run(patch, match):
    with pytest.raises(ValueError, match=match):
        hybrid.HybridConfig.from_hf(qwen3_next_config() | patch)


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match=r"ffn_kinds=.*expected a tuple of 4"):
        dataclasses.replace(DENSE, ffn_kinds=(FfnKind.DENSE,))
    with pytest.raises(ValueError, match=r"moe=None: expected a MoeConfig"):
        dataclasses.replace(MOE, moe=None)
    with pytest.raises(TypeError, match="keyword arguments only"):
        hybrid.HybridConfig(64)


# The shapes the state's docstring states its size at: Qwen3.5-27B.
QWEN3_5_27B = dict(
    model_type="qwen3_5",
    text_config=dict(
        model_type="qwen3_5_text",
        hidden_size=5120,
        num_hidden_layers=64,
        full_attention_interval=4,
        vocab_size=248320,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
    ),
)


def test_state_bytes_per_sequence_at_qwen3_5_27b_are_the_documented_ones():
    cfg = hybrid.HybridConfig.from_hf(QWEN3_5_27B)
    assert (cfg.period, cfg.num_groups, cfg.conv_dim) == (4, 16, 10240)

    def nbytes(kv_dtype):
        state = jax.eval_shape(
            lambda: hybrid.init_state(cfg, batch=1, max_len=4096, max_step=3 + 1, kv_dtype=kv_dtype)
        )
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(state)) - 4

    assert nbytes(jnp.bfloat16) == 886_177_792
    assert nbytes(jnp.float32) == 1_154_613_248
    for number in ("603,979,776", "13,762,560", "65,536", "886,177,792", "1,154,613,248"):
        assert number in model_lib.__doc__


# --------------------------------------------------------------------------------------------
# Writing a directory from params (the inverse of the loader), and loading it back.


def _layer_tensors(lp, base: str, *, packed_experts: bool) -> dict[str, np.ndarray]:
    out = {
        f"{base}.input_layernorm.weight": np.asarray(lp.input_layernorm),
        f"{base}.post_attention_layernorm.weight": np.asarray(lp.post_attention_layernorm),
    }
    if isinstance(lp, DecoderLayerParams):
        attn = lp.attention
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out |= weight_tensors(f"{base}.self_attn.{p}", getattr(attn, p))
        for p in ("q_norm", "k_norm"):
            out[f"{base}.self_attn.{p}.weight"] = np.asarray(getattr(attn, p))
    else:
        gdn = lp.linear_attn
        for f in dataclasses.fields(gdn):
            value = getattr(gdn, f.name)
            name = f"{base}.linear_attn.{f.name}"
            if value is None:
                continue
            if f.name in ("A_log", "dt_bias"):
                out[name] = np.asarray(value)
            elif isinstance(value, jax.Array):
                out[name + ".weight"] = np.asarray(value)
            else:
                out |= weight_tensors(name, value)
    ffn, mlp = lp.ffn, f"{base}.mlp"
    if isinstance(ffn, DenseFfnParams):
        for p in ("gate_proj", "up_proj", "down_proj"):
            out |= weight_tensors(f"{mlp}.{p}", getattr(ffn, p))
        return out
    assert isinstance(ffn, MoeFfnParams)
    out |= weight_tensors(f"{mlp}.gate", ffn.router)
    out |= weight_tensors(f"{mlp}.shared_expert_gate", ffn.shared_expert_gate)
    for p in ("gate_proj", "up_proj", "down_proj"):
        out |= weight_tensors(f"{mlp}.shared_expert.{p}", getattr(ffn.shared_expert, p))
    experts = ffn.experts
    if packed_experts:
        out[f"{mlp}.experts.gate_up_proj"] = np.concatenate(
            [np.asarray(experts.gate_proj.w), np.asarray(experts.up_proj.w)], axis=1
        )
        out[f"{mlp}.experts.down_proj"] = np.asarray(experts.down_proj.w)
    else:
        for e in range(experts.gate_proj.shape[0]):
            for p in ("gate_proj", "up_proj", "down_proj"):
                w = jax.tree.map(lambda a, e=e: a[e], getattr(experts, p))
                out |= weight_tensors(f"{mlp}.experts.{e}.{p}", w)
    return out


def hf_tensors(cfg, params, head, *, text: str, packed_experts: bool = False) -> dict:
    """The checkpoint tensors of ``(params, head)`` under the text prefix ``text``."""
    P = cfg.period
    out = {
        f"{text}embed_tokens.weight": np.asarray(head.embedding),
        f"{text}norm.weight": np.asarray(params.final_norm),
    }
    if not cfg.tie_word_embeddings:
        out |= weight_tensors("lm_head", head.weight)
    for i in range(cfg.num_hidden_layers):
        lp = jax.tree.map(lambda a, i=i: a[i // P], params.layers[i % P])
        out |= _layer_tensors(lp, f"{text}layers.{i}", packed_experts=packed_experts)
    return out


def _assert_same(got, want):
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree
    for a, b in zip(got_leaves, want_leaves):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A Qwen3.5 directory: one file, model.language_model.*, tied head, with MTP and vision
    tensors the loader skips."""
    params, head = hybrid.init(DENSE, key=jax.random.key(0))
    tensors = hf_tensors(DENSE, params, head, text="model.language_model.")
    tensors["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    tensors["model.visual.patch_embed.weight"] = np.zeros((3, 4), np.float32)
    path = tmp_path_factory.mktemp("qwen3_5")
    write_checkpoint(path, qwen3_5_config(), tensors, shards=1)
    return path, params, head


@pytest.fixture(scope="module")
def moe_params():
    params, head = hybrid.init(MOE, key=jax.random.key(1))
    # One projection stored FP8 per row, as quantised checkpoints do: kept as stored.
    gdn = params.layers[0].linear_attn
    fp8 = quantize(gdn.out_proj.w.astype(jnp.float32), WeightFormat.FP8)
    layers = (
        dataclasses.replace(params.layers[0], linear_attn=dataclasses.replace(gdn, out_proj=fp8)),
        *params.layers[1:],
    )
    # F32 norms keep their dtype.
    return dataclasses.replace(
        params, layers=layers, final_norm=params.final_norm.astype(jnp.float32)
    ), head


def test_a_qwen3_5_directory_loads_to_the_params_it_was_written_from(dense_dir):
    path, params, head = dense_dir
    assert hybrid.HybridConfig.from_hf(path) == DENSE
    got_params, got_head = hybrid.load(path)
    _assert_same(got_params, params)
    _assert_same(got_head.embedding, head.embedding)
    _assert_same(got_head.weight, head.weight)  # tied: the embedding
    _assert_same(got_head.final_norm, params.final_norm)


@pytest.mark.parametrize("packed_experts", [False, True])
def test_a_sharded_qwen3_next_directory_loads_to_its_params(tmp_path, moe_params, packed_experts):
    params, head = moe_params
    tensors = hf_tensors(MOE, params, head, text="model.", packed_experts=packed_experts)
    write_checkpoint(tmp_path, qwen3_next_config(), tensors, shards=3)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    got_params, got_head = hybrid.load(tmp_path)
    assert isinstance(got_params.layers[0].linear_attn.out_proj, Fp8RowWeight)
    assert got_params.final_norm.dtype == jnp.float32
    _assert_same(got_params, params)
    _assert_same(got_head.weight, head.weight)
    _assert_same(got_head.embedding, head.embedding)


def _rewrite(src, dst, edit):
    """Copies the single-file directory ``src`` to ``dst`` with ``edit(tensors)`` applied."""
    from safetensors.numpy import load_file

    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    config = json.loads((src / "config.json").read_text())
    write_checkpoint(dst, config, tensors, shards=1)
    return dst


def test_missing_or_misshapen_gdn_tensors_fail_naming_them(dense_dir, tmp_path):
    path = dense_dir[0]
    L0 = "model.language_model.layers.0.linear_attn."

    missing = _rewrite(path, tmp_path / "missing", lambda t: t.pop(L0 + "in_proj_a.weight"))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor '{L0}in_proj_a.weight' is missing, expected \[4, 64\] "
        r"\[linear_num_value_heads, hidden_size\]",
    ):
        hybrid.load(missing)

    def short_kernel(t):
        t[L0 + "conv1d.weight"] = t[L0 + "conv1d.weight"][..., :3]

    bad = _rewrite(path, tmp_path / "conv", short_kernel)
    with pytest.raises(
        CheckpointError,
        match=rf"tensor '{L0}conv1d.weight' is of shape \[96, 1, 3\], expected \[96, 1, 4\] "
        r"\[2 \* linear_num_key_heads \* linear_key_head_dim \+ linear_num_value_heads",
    ):
        hybrid.load(bad)

    def wide_qkv(t):
        t[L0 + "in_proj_qkv.weight"] = np.concatenate([t[L0 + "in_proj_qkv.weight"]] * 2)

    with pytest.raises(CheckpointError, match=rf"'{L0}in_proj_qkv.weight' is of shape \[192, 64\]"):
        hybrid.load(_rewrite(path, tmp_path / "qkv", wide_qkv))


def test_an_untied_config_without_lm_head_fails(dense_dir, tmp_path):
    path = dense_dir[0]
    untied = _rewrite(path, tmp_path / "untied", lambda t: None)
    (untied / "config.json").write_text(json.dumps(qwen3_5_config(tied=False)))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' is missing and config.json"):
        hybrid.load(untied)
