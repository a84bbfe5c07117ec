"""drafter_forward and kv_rows against the independent float64 numpy reference; params and init."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
import reference_numpy as ref
from drafter_helpers import make, make_head, np_tree, numpy_weights, random_pairs, tiny_cfg
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mtpjax import drafter
from mtpjax.config import Architecture, FfnKind
from mtpjax.weights import WeightFormat

# Every weight is exactly representable in F32 and `linear` expands each format exactly, so the
# reference on the dequantised weights sees the very same numbers; activations stay F32, so the
# gap is F32 rounding through ~10 chained reductions of width <= 128 (measured ~6e-7 of the
# output's scale). 1e-5 leaves 15x headroom and still catches any convention slip (a wrong norm,
# rotary split, gate layout or routing changes outputs at the 1e-2..1 level).
RTOL_F32 = 1e-5


def _close(got, want, rtol=RTOL_F32):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("ffn", [FfnKind.DENSE, FfnKind.MOE])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
def test_forward_matches_numpy_reference(ffn, precision):
    cfg = tiny_cfg(ffn)
    params, head = make(cfg, precision)
    w = numpy_weights(params, head)
    tokens, hidden = random_pairs(np.random.default_rng(1), (2, 7))
    out = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg))
    for b in range(2):
        want = ref.forward(w, cfg, tokens[b], np.asarray(hidden[b], np.float32))
        _close(out.h_out[b], want["h_out"])
        _close(out.residual[b], want["residual"])
        _close(out.logits[b], want["logits"])


@pytest.mark.parametrize("ffn, precision", [(FfnKind.DENSE, "bf16"), (FfnKind.MOE, "nvfp4")])
def test_kv_rows_match_numpy_reference(ffn, precision):
    # The rows a paged write stores; k is normed and rotated at its pair key.
    cfg = tiny_cfg(ffn)
    params, head = make(cfg, precision)
    w = numpy_weights(params, head)
    tokens, hidden = random_pairs(np.random.default_rng(8), (2, 7))
    positions = np.asarray([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14, 15]], np.int32)
    k, v = np_tree(drafter.kv_rows(params, head, tokens, hidden, positions, cfg=cfg))
    for b in range(2):
        x = ref.pair_inputs(w, cfg, tokens[b], np.asarray(hidden[b], np.float32))
        _, _, want_k, want_v = ref.qkv(w, cfg, x, positions[b])
        _close(k[b], want_k)
        _close(v[b], want_v)


def test_quantized_head_is_not_the_bf16_head():
    # Guards the test above: the quantised formats really change the weights it compares.
    cfg = tiny_cfg()
    tokens, hidden = random_pairs(np.random.default_rng(2), (2, 7))
    outs = [
        np.asarray(drafter.drafter_forward(*make(cfg, p), tokens, hidden, cfg=cfg).logits)
        for p in ("bf16", "fp8", "nvfp4")
    ]
    assert np.abs(outs[0] - outs[1]).max() > 1e-3
    assert np.abs(outs[0] - outs[2]).max() > 1e-2


def test_unbatched_input_and_relative_positions():
    cfg = tiny_cfg()
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(3), (2, 7))
    batched = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg))
    single = np_tree(drafter.drafter_forward(params, head, tokens[1], hidden[1], cfg=cfg))
    assert single.logits.shape == (7, cfg.vocab_size)
    for got, want in zip(single, batched):
        np.testing.assert_allclose(got, want[1], rtol=1e-5, atol=1e-5)
    # RoPE is relative: shifting every position by a constant leaves the outputs unchanged.
    positions = np.arange(7, dtype=np.int32)[None].repeat(2, 0)
    shifted = np_tree(
        drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg, positions=positions + 300)
    )
    np.testing.assert_allclose(shifted.h_out, batched.h_out, rtol=1e-4, atol=1e-4)
    # Causality: changing the last pairs leaves the earlier rows alone.
    tokens, hidden = tokens.copy(), hidden.copy()
    tokens[:, 4:], hidden[:, 4:] = 3, 1.0
    later = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg))
    np.testing.assert_allclose(later.logits[:, :4], batched.logits[:, :4], rtol=1e-6, atol=1e-6)
    assert np.abs(later.logits[:, 4:] - batched.logits[:, 4:]).max() > 0.1


def test_reduced_vocab_scores_the_first_rows():
    full_cfg = tiny_cfg()
    cfg = tiny_cfg(mtp_vocab_size=48)
    params, head = make(full_cfg)
    tokens, hidden = random_pairs(np.random.default_rng(4), (2, 7))
    full = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=full_cfg))
    reduced = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg))
    assert reduced.logits.shape == (2, 7, 48)
    np.testing.assert_allclose(reduced.logits, full.logits[..., :48], rtol=1e-6, atol=1e-5)


def test_dedicated_embeddings():
    cfg = tiny_cfg(mtp_use_dedicated_embeddings=True)
    params, head = make(cfg)
    assert params.embed_tokens is not None
    w = numpy_weights(params, head)
    w["embedding"] = np.asarray(params.embed_tokens).astype(np.float64)
    tokens, hidden = random_pairs(np.random.default_rng(5), (2, 7))
    out = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg))
    want = ref.forward(w, cfg, tokens[0], np.asarray(hidden[0], np.float32))
    _close(out.logits[0], want["logits"])
    missing = drafter.DrafterParams(**{**vars(params), "embed_tokens": None})
    with pytest.raises(ValueError, match="embed_tokens is None"):
        drafter.drafter_forward(missing, head, tokens, hidden, cfg=cfg)


BF, F8, F4 = WeightFormat.BF16, WeightFormat.FP8, WeightFormat.NVFP4


@pytest.mark.parametrize(
    "ffn, precision, formats, prefill",
    [
        (FfnKind.DENSE, "bf16", (BF, BF, BF, BF, BF), True),
        (FfnKind.DENSE, "fp8", (F8, F8, F8, F8, F8), False),
        # Dense NVFP4: q/o (and the FFN) NVFP4, fc/k/v BF16 so the prefill can run.
        (FfnKind.DENSE, "nvfp4", (BF, F4, BF, BF, F4), True),
        (FfnKind.MOE, "bf16", (BF, BF, BF, BF, BF), True),
        (FfnKind.MOE, "FP4", (F4, F4, F4, F4, F4), False),
    ],
)
def test_init_formats_and_prefill_support(ffn, precision, formats, prefill):
    cfg = tiny_cfg(ffn)
    params = drafter.init(cfg, key=jax.random.PRNGKey(0), precision=precision)
    got = drafter.projection_formats(params)
    assert tuple(got[n] for n in ("fc", "q_proj", "k_proj", "v_proj", "o_proj")) == formats
    assert drafter.supports_prefill(params) is prefill
    ffn_params = params.layer.ffn
    if ffn is FfnKind.DENSE:
        assert ffn_params.gate_proj.format is formats[1]
    else:
        assert ffn_params.router.format is BF  # the router is always BF16
        assert ffn_params.experts.gate_proj.shape == (4, 32, cfg.hidden_size)
        assert ffn_params.shared_expert_gate.shape == (1, cfg.hidden_size)


@pytest.mark.parametrize("ffn", [FfnKind.DENSE, FfnKind.MOE])
def test_the_description_names_every_leaf_at_its_shape(ffn):
    # init, the converter's plan and the loader's checks all read module_leaves: it must name
    # every leaf the params hold, at the logical shape init gives it.
    cfg = tiny_cfg(ffn, mtp_use_dedicated_embeddings=True)
    params = drafter.init(cfg, key=jax.random.PRNGKey(0), precision="nvfp4")
    described = dict(drafter.module_leaves(cfg, 0))
    named = {n: jax.ShapeDtypeStruct(leaf.shape, np.float32) for n, leaf in described.items()}
    shapes = jax.tree.map(lambda a: a.shape, drafter.from_named(named, cfg))
    want = jax.tree.map(lambda w: tuple(w.shape), params, is_leaf=lambda x: hasattr(x, "format"))
    assert shapes == want
    assert len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))) == len(described)


def test_partition_specs_place_the_drafter_on_a_mesh():
    cfg = tiny_cfg(FfnKind.MOE)
    params, head = make(cfg, "nvfp4")
    mesh = jax.make_mesh(
        (2, 2), ("ep", "tp"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2
    )
    rules = {"heads": "tp", "kv_heads": "tp", "mlp": "tp", "experts": "ep"}
    specs = drafter.partition_specs(params, cfg, rules)
    attn, experts = specs.layer.attention, specs.layer.ffn.experts
    assert attn.q_proj.packed == P("tp", None) and attn.q_proj.scale_2 == P()
    assert attn.o_proj.packed == P(None, "tp") and specs.fc.packed == P(None, None)
    assert experts.down_proj.packed == P("ep", None, "tp")
    assert experts.down_proj.scale_2 == P("ep") and specs.norm == P(None)
    # The NVFP4 scales of a 48-wide down_proj (3 blocks of 16) cannot split K in two: place BF16.
    params, head = make(cfg, "bf16")
    specs = drafter.partition_specs(params, cfg, rules)
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    assert placed.layer.attention.k_proj.w.sharding.spec == P("tp", None)
    tokens, hidden = random_pairs(np.random.default_rng(3), (2, 5))
    want = drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg)
    got = drafter.drafter_forward(placed, head, tokens, hidden, cfg=cfg)
    _close(got.h_out, want.h_out)
    _close(got.logits, want.logits)


def test_init_keeps_activations_order_one():
    cfg = tiny_cfg(FfnKind.MOE)
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(6), (2, 7))
    out = np_tree(drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg))
    assert 0.3 < out.residual.std() < 3.0
    assert 0.5 < out.h_out.std() < 2.0


def test_unsupported_config_and_bad_inputs_raise():
    cfg = tiny_cfg(architecture=Architecture.MINIMAX_M2)
    with pytest.raises(ValueError, match="MiniMax-M2"):
        drafter.init(cfg, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="unknown precision"):
        drafter.init(tiny_cfg(), key=jax.random.PRNGKey(0), precision="int4")
    cfg = tiny_cfg()
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(0), (2, 3))
    with pytest.raises(AssertionError):
        drafter.drafter_forward(params, head, tokens, hidden[:, :2], cfg=cfg)
    with pytest.raises(TypeError, match="integer token ids"):
        drafter.drafter_forward(params, head, hidden[..., 0], hidden, cfg=cfg)


def test_forward_traces_once():
    cfg = tiny_cfg()
    params, head = make(cfg)
    counted = jax.jit(
        chex.assert_max_traces(drafter.drafter_forward.__wrapped__, n=1),
        static_argnames=("cfg", "head_cfg", "implementation"),
    )
    before = drafter.drafter_forward._cache_size()
    rng = np.random.default_rng(7)
    for i in range(3):
        tokens, hidden = random_pairs(rng, (2, 7))
        positions = np.arange(7, dtype=np.int32)[None].repeat(2, 0) + 5 * i
        counted(params, head, tokens, hidden, cfg=cfg, positions=positions)
        drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg, positions=positions)
    assert drafter.drafter_forward._cache_size() - before <= 1
    chex.clear_trace_counter()


def test_head_hidden_size_mismatch_is_named():
    cfg = tiny_cfg()
    params, head = make(cfg)
    other = cfg.lm_head_config()
    bad = type(other)(vocab_size=other.vocab_size, hidden_size=32)
    tokens, hidden = random_pairs(np.random.default_rng(0), (1, 2))
    with pytest.raises(ValueError, match="hidden_size=32"):
        drafter.drafter_forward(params, head, tokens, hidden, cfg=cfg, head_cfg=bad)
    assert make_head(cfg).embedding.shape == (cfg.vocab_size, cfg.hidden_size)
