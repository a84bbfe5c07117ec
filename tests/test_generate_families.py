"""``generate`` with GLM-4.5 and MiMo drafters, one module or several (``DrafterModules``):
greedy speculation equals plain greedy decoding token for token on the full-attention reference
target (CPU; tiny random pairs, few tokens, and the converted GLM fixture; the loop's other
properties are in test_generate.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import drafter as drafter_lib
from mtpjax import reference
from mtpjax.checkpoint import convert, load_drafter
from mtpjax.config import Architecture, DrafterConfig, FfnKind, InputOrder, MoeConfig, RouterScoring
from mtpjax.head import from_arrays
from mtpjax.weights import Bf16Weight

FIXTURES = Path(__file__).parent / "fixtures" / "nextn"
H, V, N_NEW = 64, 128, 10
TARGET_STD = 0.1
TARGET = reference.TargetConfig(
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=V,
    max_position_embeddings=256,
)
GLM = DrafterConfig.tiny(
    architecture=Architecture.GLM4_MOE,
    vocab_size=V,
    ffn=FfnKind.MOE,
    zero_centered_norm=False,
    attn_output_gate=False,
    attention_bias=True,
    zero_embedding_at_position_0=True,
    first_mtp_layer=2,  # NextN: module i is model.layers.{2 + i}
    num_mtp_modules=2,
    moe=MoeConfig(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        scoring=RouterScoring.SIGMOID,
        score_correction_bias=True,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
    ),
)
MIMO = DrafterConfig.tiny(
    architecture=Architecture.MIMO,
    vocab_size=V,
    zero_centered_norm=False,
    attn_output_gate=False,
    qk_norm=False,
    attention_bias=True,
    partial_rotary_factor=1.0,
    input_order=InputOrder.HIDDEN_FIRST,
    zero_embedding_at_position_0=True,
)


@pytest.fixture(scope="module")
def target():
    """The reference target with modest residual writes (its next token is mostly, not only, a
    function of the current one) and a head peaked enough to decide."""
    params = reference.init(TARGET, key=jax.random.key(0), std=TARGET_STD)
    k_embed, k_head = jax.random.split(jax.random.key(1))
    head = from_arrays(
        TARGET.lm_head_config(),
        lm_head=4.0 * jax.random.normal(k_head, (V, H)) * H**-0.5,
        embedding=jax.random.normal(k_embed, (V, H)),
    )
    return params, head


def _predictive(cfg: DrafterConfig, key) -> drafter_lib.DrafterModules:
    """Random modules of ``cfg`` made to predict the target's function of the token: the input
    projection passes the normed embedding through (from either half of the concatenation),
    the layer's writes are scaled down (they still move the logits, so drafts are often, not
    always, right) and the norms are the identity's plain weights."""
    modules = drafter_lib.init_modules(cfg, key=key).modules
    eye, zero = jnp.eye(H), jnp.zeros((H, H))
    halves = [zero, eye] if cfg.input_order is InputOrder.HIDDEN_FIRST else [eye, zero]
    fc = Bf16Weight(w=jnp.concatenate(halves, axis=1).astype(jnp.bfloat16))
    ones = jnp.ones((H,), jnp.bfloat16)

    def scaled(w):
        return Bf16Weight(w=(w.w * 0.3).astype(jnp.bfloat16))

    def quiet(m):
        ffn = m.layer.ffn
        if cfg.ffn is FfnKind.MOE:
            experts = dataclasses.replace(ffn.experts, down_proj=scaled(ffn.experts.down_proj))
            shared = dataclasses.replace(
                ffn.shared_expert, down_proj=scaled(ffn.shared_expert.down_proj)
            )
            ffn = dataclasses.replace(ffn, experts=experts, shared_expert=shared)
        else:
            ffn = dataclasses.replace(ffn, down_proj=scaled(ffn.down_proj))
        attn = dataclasses.replace(m.layer.attention, o_proj=scaled(m.layer.attention.o_proj))
        layer = dataclasses.replace(m.layer, attention=attn, ffn=ffn)
        return dataclasses.replace(m, fc=fc, pre_fc_norm_embedding=ones, norm=ones, layer=layer)

    return drafter_lib.DrafterModules(modules=tuple(quiet(m) for m in modules))


def _run(model, head, drafter, cfg, k):
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, V, (3, 6)).astype(np.int32)
    lengths = np.array([2, 6, 4], np.int32)
    kw = dict(head_cfg=TARGET.lm_head_config(), max_new_tokens=N_NEW)
    spec = mtpjax.generate(
        model, drafter, head, prompts, lengths, drafter_cfg=cfg, num_drafts=k, **kw
    )
    width = spec.metrics.num_accepted_tokens_per_pos.shape[0] + 1
    base = mtpjax.generate_baseline(model, head, prompts, lengths, step_width=width, **kw)
    return jax.device_get(spec), jax.device_get(base)


@pytest.mark.parametrize(
    "family, modules, k",
    [
        ("glm4_moe", 2, 2),  # draft s from module s (CLAMP)
        ("glm4_moe", 2, 4),  # clamped to the two modules
        ("glm4_moe", 1, 3),  # module 0 chaining itself, as a bare DrafterParams
        ("mimo", 1, 3),
    ],
)
def test_greedy_speculation_equals_plain_greedy(target, family, modules, k):
    params, head = target
    cfg = GLM if family == "glm4_moe" else MIMO
    drafter = _predictive(cfg, jax.random.key(2))
    if modules == 1:
        drafter, cfg = drafter.modules[0], dataclasses.replace(cfg, num_mtp_modules=1)
    K = min(k, modules) if modules > 1 else k
    model = mtpjax.reference_target(TARGET, params, head)
    spec, base = _run(model, head, drafter, cfg, k)
    np.testing.assert_array_equal(spec.tokens, base.tokens)
    np.testing.assert_array_equal(spec.lengths, base.lengths)
    np.testing.assert_array_equal(spec.kv_error, 0)
    m = spec.metrics
    assert int(m.num_draft_tokens) == K * int(m.num_drafts)  # K drafts a round
    assert 0 < int(m.num_accepted_tokens) < int(m.num_draft_tokens)  # partial accepts
    assert int(spec.target_steps) < int(base.target_steps)


def test_generate_checks_the_module_count(target):
    params, head = target
    model = mtpjax.reference_target(TARGET, params, head)
    drafter = _predictive(GLM, jax.random.key(2))

    def run(drafter, cfg):
        prompt, length = np.zeros((1, 3), np.int32), np.array([3], np.int32)
        kw = dict(head_cfg=TARGET.lm_head_config(), max_new_tokens=2, num_drafts=2)
        mtpjax.generate(model, drafter, head, prompt, length, drafter_cfg=cfg, **kw)

    three = dataclasses.replace(GLM, num_mtp_modules=3)
    with pytest.raises(
        ValueError, match=r"DrafterModules holds 2 modules but cfg\.num_mtp_modules=3"
    ):
        run(drafter, three)
    with pytest.raises(TypeError, match=r"DrafterParams .* or DrafterModules"):
        run(drafter.modules, GLM)


def test_converted_glm_checkpoint_generates_exactly(tmp_path):
    """The GLM fixture (two NextN modules, tests/fixtures/nextn) through convert and
    load_drafter, as ``DrafterModules.from_checkpoint``, on a reference target of its widths."""
    convert(FIXTURES / "glm4_moe", tmp_path / "glm", precision="keep", progress=False)
    cfg, ckpt = load_drafter(tmp_path / "glm")
    tcfg = dataclasses.replace(
        TARGET,
        hidden_size=cfg.hidden_size,
        head_dim=12,
        partial_rotary_factor=0.5,
        vocab_size=cfg.vocab_size,
    )
    params = reference.init(tcfg, key=jax.random.key(4), std=TARGET_STD)
    model = mtpjax.reference_target(tcfg, params, ckpt.head)
    drafter = drafter_lib.DrafterModules.from_checkpoint(ckpt)
    prompts = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
    lengths = np.array([5, 2], np.int32)
    kw = dict(head_cfg=tcfg.lm_head_config(), max_new_tokens=6)
    spec = mtpjax.generate(
        model, drafter, ckpt.head, prompts, lengths, drafter_cfg=cfg, num_drafts=2, **kw
    )
    base = mtpjax.generate_baseline(model, ckpt.head, prompts, lengths, step_width=3, **kw)
    spec, base = jax.device_get((spec, base))
    np.testing.assert_array_equal(spec.tokens, base.tokens)
    np.testing.assert_array_equal(spec.kv_error, 0)
    assert int(spec.metrics.num_draft_tokens) == 2 * int(spec.metrics.num_drafts) > 0
