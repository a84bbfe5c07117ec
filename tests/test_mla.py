"""The DeepSeek-V3 MTP drafter (MLA attention, DeepSeek MoE, NextN layout) against transformers'
float32 modules (``tests/fixtures/deepseek_v3_mtp``, written by ``scripts/make_mla_fixtures.py``),
and its paged latent-KV propose path against the teacher-forced forward."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import np_tree, pairs

import pallas_kernels as pk
from mtpjax import drafter, kv, reference
from mtpjax import generation as gen
from mtpjax.checkpoint import CheckpointError, convert, load_drafter
from mtpjax.config import Architecture, DrafterConfig, HiddenContract, RouterScoring
from mtpjax.head import from_arrays
from mtpjax.layers import attend, mla, route
from mtpjax.layers.decoder import input_norm
from mtpjax.weights import Fp8BlockWeight, WeightFormat

FIXTURE = Path(__file__).parent / "fixtures" / "deepseek_v3_mtp"
GOLDEN = dict(np.load(FIXTURE / "golden.npz"))
CFG = DrafterConfig.from_hf_config(FIXTURE)
K = 4
CONTRACTS = {"post_norm": HiddenContract.POST_NORM, "pre_norm": HiddenContract.PRE_NORM,
             "pinned": HiddenContract.PINNED}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The fixture converted keeping its FP8 block-128 weights as stored, and loaded."""
    out = tmp_path_factory.mktemp("ds") / "keep"
    convert(FIXTURE, out, precision="keep", progress=False)
    return load_drafter(out)


@functools.cache
def random_drafter(precision: str = "bf16"):
    """Random weights of the fixture's shapes and a random BF16 head (keys 0 and 1)."""
    params = drafter.init(CFG, key=jax.random.PRNGKey(0), precision=precision)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    H, V = CFG.hidden_size, CFG.vocab_size
    head = from_arrays(
        CFG.lm_head_config(),
        lm_head=3.0 * jax.random.normal(k1, (V, H)) * H**-0.5,
        embedding=jax.random.normal(k2, (V, H)),
        precision="bf16",
    )
    return params, head


# --------------------------------------------------------------------------------------------
# Config and checkpoint.


def test_fixture_config_parses_into_a_runnable_mla_drafter():
    c = CFG
    assert c.architecture is Architecture.DEEPSEEK_V3 and c.runnable, c.unsupported_reason
    assert (c.mla.q_lora_rank, c.mla.kv_lora_rank, c.mla.qk_nope_head_dim) == (48, 32, 16)
    assert (c.mla.qk_rope_head_dim, c.mla.v_head_dim, c.rotary_dim) == (8, 24, 8)
    assert c.rope_type == "yarn" and c.rope_scaling.factor == 4.0
    assert c.rope_scaling.cos_sin_scale != 1.0 and c.rope_scaling.softmax_scale_factor != 1.0
    assert c.moe.scoring is RouterScoring.SIGMOID and c.moe.score_correction_bias
    assert (c.moe.n_group, c.moe.topk_group, c.moe.num_experts_per_tok) == (4, 2, 2)
    assert c.moe.shared_expert_intermediate_size == 32 and c.moe.routed_scaling_factor == 2.5
    assert c.first_mtp_layer == 2 and c.default_hidden_contract is HiddenContract.POST_NORM
    # The cache row: latent + RoPE key (40 values) against 4 heads * (24 + 24) expanded.
    pool = drafter.pool_config(c, precision="bf16", max_seq_len=32, max_seqs=1)
    assert (pool.num_kv_heads, pool.head_dim, pool.value_dim) == (1, 40, 32)
    assert pool.row_bytes == 2 * 40


def test_deepseek_v3_shapes_row_bytes():
    # DeepSeek-V3's latent row: (512 + 64) BF16 values, 71x fewer than the expanded K/V.
    cfg = dataclasses.replace(
        CFG,
        mla=dataclasses.replace(
            CFG.mla, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
        ),
        head_dim=192,
        num_attention_heads=128,
        num_key_value_heads=128,
    )
    pool = drafter.pool_config(cfg, precision="bf16", max_seq_len=4096, max_seqs=1)
    assert pool.row_bytes == 576 * 2 == 1152
    expanded = 128 * (192 + 128) * 2
    assert expanded / pool.row_bytes == pytest.approx(71.1, abs=0.1)


def test_glm47_flash_routes_through_the_same_mla_drafter():
    raw = dict(
        model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048,
        num_attention_heads=20, num_key_value_heads=20, num_hidden_layers=47,
        num_nextn_predict_layers=1, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=64, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=1536, routed_scaling_factor=1.8, n_group=1,
        topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=202752, partial_rotary_factor=1.0,
    )  # fmt: skip
    c = DrafterConfig.from_hf_config(raw)
    assert c.architecture is Architecture.GLM4_MOE_LITE and c.runnable, c.unsupported_reason
    assert c.mla.qk_head_dim == 256 and c.head_dim == 256 and c.rotary_dim == 64
    assert c.moe.score_correction_bias and c.moe.scoring is RouterScoring.SIGMOID
    assert c.first_mtp_layer == 47 and c.default_hidden_contract is HiddenContract.POST_NORM
    assert drafter.kv_row_spec(c) == (1, 576, 512)


def test_deepseek_v32_is_reported_as_not_runnable():
    raw = dict(CFG_RAW, model_type="deepseek_v32", index_topk=2048)
    c = DrafterConfig.from_hf_config(raw)
    assert not c.runnable and "index_topk=2048" in c.unsupported_reason


CFG_RAW = __import__("json").loads((FIXTURE / "config.json").read_text())


def test_converted_checkpoint_keeps_fp8_blocks_and_loads_runnable(ckpt):
    cfg, loaded = ckpt
    assert cfg == CFG and len(loaded.modules) == 1
    module = loaded.modules[0]
    attn = module.layer.attention
    assert isinstance(attn, mla.MlaParams) and attn.q_proj is None
    for w in (module.fc, attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj,
              attn.o_proj, module.layer.ffn.experts.gate_proj, module.layer.ffn.shared_expert.up_proj):  # fmt: skip
        assert isinstance(w, Fp8BlockWeight)
    assert attn.kv_b_proj.scale_inv.shape == (2, 1)  # 160 rows: one full tile, one ragged
    assert module.layer.ffn.score_correction_bias.dtype == jnp.float32
    assert module.layer.ffn.router.format is WeightFormat.BF16
    assert not drafter.supports_prefill(module)  # FP8 eh_proj / kv_a: prompts go through propose


def test_unrunnable_families_still_say_what_is_missing(tmp_path):
    raw = dict(CFG_RAW, model_type="deepseek_v32", index_topk=8)
    src = tmp_path / "v32"
    src.mkdir()
    (src / "config.json").write_text(__import__("json").dumps(raw))
    (src / "model.safetensors").symlink_to((FIXTURE / "model.safetensors").resolve())
    convert(src, tmp_path / "out", precision="keep", progress=False)
    with pytest.raises(CheckpointError, match="sparse attention"):
        load_drafter(tmp_path / "out")
    cfg, named = load_drafter(tmp_path / "out", allow_unrunnable=True)
    assert "model.layers.2.eh_proj" in named and not cfg.runnable


# --------------------------------------------------------------------------------------------
# Numerics against transformers.


def test_router_matches_transformers(ckpt):
    _, loaded = ckpt
    bias = loaded.modules[0].layer.ffn.score_correction_bias
    m = CFG.moe
    weights, ids = jax.jit(
        functools.partial(
            route, top_k=m.num_experts_per_tok, normalize=True, scoring=m.scoring,
            n_group=m.n_group, topk_group=m.topk_group,
            routed_scaling_factor=m.routed_scaling_factor,
        )
    )(GOLDEN["router_logits"], correction_bias=bias)  # fmt: skip
    order = np.argsort(np.asarray(ids), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1),
                                  GOLDEN["router_ids"])  # fmt: skip
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1), GOLDEN["router_weights"], rtol=1e-6
    )
    # The bias and the groups matter: without them other experts win for some rows.
    _, plain = jax.jit(functools.partial(route, top_k=2, normalize=True, scoring=m.scoring))(
        GOLDEN["router_logits"]
    )
    assert not np.array_equal(np.sort(np.asarray(plain), -1), GOLDEN["router_ids"])


def test_forward_matches_transformers(ckpt):
    # Float32 against float32 on the same stored values: only summation order differs (the
    # logits are O(10)).
    cfg, loaded = ckpt
    out = np_tree(
        drafter.drafter_forward(
            loaded.modules[0], loaded.head, GOLDEN["tokens"], GOLDEN["hidden"], cfg=cfg
        )
    )
    np.testing.assert_allclose(out.logits, GOLDEN["forward_logits"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(out.h_out, GOLDEN["forward_h_out"], rtol=0, atol=2e-5)
    np.testing.assert_allclose(out.residual, GOLDEN["forward_residual"], rtol=0, atol=5e-5)


def _catch_up_window(width: int):
    """One window per sequence holding its committed rows 0..n-1 (the last is the anchor)."""
    n = GOLDEN["prompt_rows"]
    tok = np.zeros((len(n), width), np.int32)
    hid = np.zeros((len(n), width, CFG.hidden_size), np.float32)
    for b, rows in enumerate(n):
        tok[b, :rows] = GOLDEN["tokens"][b, :rows]
        hid[b, :rows] = GOLDEN["hidden"][b, :rows]
    return pairs(tok, hid, n, [0] * len(n))


@pytest.mark.parametrize("contract", [None, *CONTRACTS])
def test_chained_drafts_match_transformers(ckpt, contract):
    # propose over the paged latent cache (BF16 rows: relative 2^-9 per element, which moves
    # these O(10) logits by < 0.05) against transformers' full recompute of each chain; None is
    # the default contract, the post-norm chain.
    cfg, loaded = ckpt
    B = len(GOLDEN["prompt_rows"])
    state = drafter.init_state(
        drafter.pool_config(cfg, precision="bf16", max_seq_len=32, max_seqs=B, block_size=4),
        num_seqs=B,
    )
    kw = {} if contract is None else dict(hidden_contract=CONTRACTS[contract])
    out, state = drafter.propose(
        loaded.modules[0], loaded.head, state, _catch_up_window(8), cfg=cfg, num_drafts=K,
        return_logits=True, **kw,
    )  # fmt: skip
    drafter.raise_on_state_error(state)
    name = "post_norm" if contract is None else contract
    np.testing.assert_array_equal(out.tokens, GOLDEN[f"chain_{name}_tokens"])
    np.testing.assert_allclose(out.logits, GOLDEN[f"chain_{name}_logits"], rtol=0, atol=5e-2)


def test_one_draft_is_the_chains_first(ckpt):
    cfg, loaded = ckpt
    state = drafter.init_state(
        drafter.pool_config(cfg, precision="bf16", max_seq_len=32, max_seqs=2), num_seqs=2
    )
    out, _ = drafter.propose(
        loaded.modules[0], loaded.head, state, _catch_up_window(8), cfg=cfg, num_drafts=1
    )
    np.testing.assert_array_equal(out.tokens[:, 0], GOLDEN["chain_post_norm_tokens"][:, 0])


# --------------------------------------------------------------------------------------------
# Properties of the latent path.


@pytest.mark.parametrize("q_lora", [True, False])
def test_absorbed_decode_equals_expanded_attention(q_lora):
    # Over f32 latent rows (no pool rounding): [q_nope @ W_UK, q_rope] . [c, k_rope], values c,
    # then @ W_UV and o_proj, equals transformers' expanded form at every causal row; with
    # q_lora_rank (q_a / q_b) and without (one q_proj, as DeepSeek-V2-Lite).
    cfg = (
        CFG
        if q_lora
        else dataclasses.replace(CFG, mla=dataclasses.replace(CFG.mla, q_lora_rank=None))
    )
    params = random_drafter()[0] if q_lora else drafter.init(cfg, key=jax.random.PRNGKey(5))
    attn = params.layer.attention
    assert (attn.q_proj is None) == q_lora
    rng = np.random.default_rng(0)
    B, T = 2, 7
    x = jnp.asarray(rng.standard_normal((B, T, CFG.hidden_size)), jnp.float32)
    a = input_norm(params.layer, x, cfg=cfg)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 3, (B, T))

    @jax.jit
    def both(attn, a, positions):
        want = mla.mla_causal_attention(attn, a, positions, cfg)
        q = mla.absorbed_query(attn, a, positions, cfg)  # [B, T, Nq, L+R]
        rows = mla.latent_rows(attn, a, positions, cfg)  # [B, T, 1, L+R]
        mask = positions[:, None, :] <= positions[:, :, None]
        values = rows[..., : cfg.mla.kv_lora_rank]
        ctx = attend(q, rows, values, mask, scale=mla.softmax_scale(cfg))
        return want, mla.absorbed_output(attn, ctx, cfg)

    want, got = np_tree(both(attn, a, positions))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_latent_paged_attention_dispatch():
    rng = np.random.default_rng(1)
    cfg = kv.PoolConfig(
        num_kv_heads=1, head_dim=40, num_blocks=8, max_blocks_per_seq=4, block_size=4, value_dim=32
    )
    cache = kv.init_cache(cfg, num_seqs=2)
    rows = rng.standard_normal((2, 9, 1, 40)).astype(np.float32)
    cache, ok = jax.jit(kv.append)(cache, rows, None, np.asarray([9, 5], np.int32))
    assert bool(ok.all()) and cache.pool.v is None
    q = jnp.asarray(rng.standard_normal((2, 4, 40)), jnp.float32)
    got = np.asarray(drafter.paged_attention(q, cache, scale=0.3))  # AUTO: the reference
    k, v, valid = np_tree(jax.jit(kv.gather, static_argnums=1)(cache, 9))
    np.testing.assert_array_equal(v, k[..., :32])
    want = np.asarray(
        jax.jit(attend, static_argnames="scale")(q[:, None], k, v, valid[:, None], scale=0.3)
    )[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got.shape == (2, 4, 32)
    with pytest.raises(NotImplementedError, match="latent rows"):
        drafter.paged_attention(q, cache, scale=0.3, implementation="pallas")
    # An FP8 latent pool: one scale per row, the value dequantised with the key's scale.
    fp8 = kv.init_cache(dataclasses.replace(cfg, kv_dtype=kv.KVDtype.FP8), num_seqs=2)
    fp8, _ = jax.jit(kv.append)(fp8, rows, None, np.asarray([9, 5], np.int32))
    assert fp8.pool.v_scale is None and fp8.pool.k_scale.shape == (8, 4, 1)
    k8, v8, _ = np_tree(jax.jit(kv.gather, static_argnums=1)(fp8, 9))
    np.testing.assert_array_equal(v8, k8[..., :32])
    np.testing.assert_allclose(k8[valid], k[valid], rtol=0, atol=2**-3 * np.abs(k).max())
    want8 = jax.jit(attend, static_argnames="scale")(q[:, None], k8, v8, valid[:, None], scale=0.3)
    got8 = drafter.paged_attention(q, fp8, scale=0.3)
    np.testing.assert_allclose(got8, np.asarray(want8)[:, 0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="value_dim"):
        pk.paged_attention(q, cache.pool.k, None, cache.block_table, cache.seq_len, scale=0.3)


def test_paged_chain_equals_teacher_forced_forward():
    # A BF16 random drafter: prefill the prompt rows (fc and kv_a are BF16), propose K from the
    # anchor, and compare with drafter_forward over committed + chain pairs (BF16 latent rows in
    # the pool against f32: logits O(5) within 5e-2).
    params, head = random_drafter()
    assert drafter.supports_prefill(params)
    rng = np.random.default_rng(2)
    B, n = 2, np.asarray([5, 3])
    tokens = rng.integers(0, CFG.vocab_size, (B, 8)).astype(np.int32)
    hidden = rng.standard_normal((B, 8, CFG.hidden_size)).astype(np.float32)
    state = drafter.init_state(
        drafter.pool_config(CFG, precision="bf16", max_seq_len=32, max_seqs=B, block_size=4),
        num_seqs=B,
    )
    state = drafter.prefill(params, head, state, pairs(tokens, hidden, n - 1, [0, 0]), cfg=CFG)
    idx = np.arange(B)
    window = pairs(np.pad(tokens[idx, n - 1][:, None], ((0, 0), (0, 3))),
                   np.pad(hidden[idx, n - 1][:, None], ((0, 0), (0, 3), (0, 0))), [1, 1], n - 1)  # fmt: skip
    out, state = drafter.propose(
        params, head, state, window, cfg=CFG, num_drafts=K, return_logits=True
    )
    seq_t = np.zeros((B, 8), np.int32)
    seq_h = np.zeros((B, 8, CFG.hidden_size), np.float32)
    for b in range(B):
        seq_t[b, : n[b]], seq_h[b, : n[b]] = tokens[b, : n[b]], hidden[b, : n[b]]
        seq_t[b, n[b] : n[b] + K - 1] = out.tokens[b, : K - 1]
        seq_h[b, n[b] : n[b] + K - 1] = out.hidden[b, : K - 1]
    ref = np_tree(drafter.drafter_forward(params, head, seq_t, seq_h, cfg=CFG))
    for b in range(B):
        rows = slice(n[b] - 1, n[b] - 1 + K)
        np.testing.assert_allclose(out.logits[b], ref.logits[b, rows], rtol=0, atol=5e-2)
        np.testing.assert_array_equal(out.tokens[b], ref.logits[b, rows].argmax(-1))
        # The default contract chains the post-norm hidden.
        np.testing.assert_allclose(out.hidden[b], ref.h_out[b, rows], rtol=0, atol=5e-2)


def test_after_verify_leaves_the_rows_of_a_rebuild():
    # Rounds of propose / verify / after_verify(refeed): module 0's latent rows equal kv_rows of
    # the committed pairs with the target's hidden, recomputed from scratch.
    params, head = random_drafter()
    rng = np.random.default_rng(3)
    B, kd = 2, 3
    committed = [list(rng.integers(0, CFG.vocab_size, 4)), list(rng.integers(0, CFG.vocab_size, 6))]
    target = rng.standard_normal((B, 40, CFG.hidden_size)).astype(np.float32)
    state = drafter.init_state(
        drafter.pool_config(CFG, precision="bf16", max_seq_len=40, max_seqs=B, block_size=4),
        num_seqs=B,
    )
    starts = [0, 0]
    rebuild = jax.jit(functools.partial(drafter.kv_rows, cfg=CFG))
    for accepted in ([2, 0], [3, 1], [0, 3]):
        tok = np.zeros((B, 8), np.int32)
        hid = np.zeros((B, 8, CFG.hidden_size), np.float32)
        count = []
        for b, c in enumerate(committed):
            keys = list(range(starts[b], len(c) - 1))
            count.append(len(keys))
            tok[b, : len(keys)] = [c[i + 1] for i in keys]
            hid[b, : len(keys)] = target[b, keys[0] : keys[-1] + 1]
        out, state = drafter.propose(
            params, head, state, pairs(tok, hid, count, starts), cfg=CFG, num_drafts=kd
        )
        _, state = drafter.after_verify(state, np.asarray(accepted, np.int32), refeed=True)
        drafter.raise_on_state_error(state)
        lat = np_tree(jax.jit(kv.gather, static_argnums=1)(state.kv[0], 40))[0]
        for b, c in enumerate(committed):
            a = accepted[b]
            n = len(c) - 1  # pairs committed before this round's verify
            held = int(np.asarray(state.seq_len)[0, b])
            assert held == n  # the anchor's row stays, every drafter-hidden row goes
            t = np.asarray([c[i + 1] for i in range(n)], np.int32)
            positions = np.arange(n, dtype=np.int32)
            want, none = rebuild(params, head, t, target[b, :n], positions)
            assert none is None
            np.testing.assert_allclose(lat[b, :n], np.asarray(want), rtol=2**-8,
                                       atol=2**-8 * float(np.abs(want).max()))  # fmt: skip
            starts[b] = n
            c += [*np.asarray(out.tokens[b, :a]).tolist(), int(rng.integers(0, CFG.vocab_size))]


def test_greedy_speculative_equals_plain_greedy(ckpt):
    # The converted FP8 drafter against a small reference target of its hidden width and head.
    cfg, loaded = ckpt
    tcfg = reference.TargetConfig(
        hidden_size=cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=cfg.vocab_size,
        max_position_embeddings=128,
    )  # fmt: skip
    head = loaded.head
    target = gen.reference_target(
        tcfg, reference.init(tcfg, key=jax.random.PRNGKey(4), std=0.2), head
    )
    rng = np.random.default_rng(4)
    prompts = rng.integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
    lengths = np.asarray([6, 4], np.int32)
    kw = dict(head_cfg=cfg.lm_head_config(), max_new_tokens=10)
    spec = gen.generate(target, loaded.modules[0], head, prompts, lengths, drafter_cfg=cfg,
                        num_drafts=2, **kw)  # fmt: skip
    plain = gen.generate_baseline(target, head, prompts, lengths, step_width=3, **kw)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    assert int(spec.kv_error.max()) == 0


def test_bf16_conversion_takes_the_prefill(tmp_path):
    # Requantised to BF16, the head takes the attention-free prefill; its forward stays within
    # BF16's rounding of the FP8 values (relative 2^-9 per weight) of transformers'.
    convert(FIXTURE, tmp_path / "bf16", precision="bf16", progress=False)
    cfg, loaded = load_drafter(tmp_path / "bf16")
    module = loaded.modules[0]
    assert drafter.supports_prefill(module)
    out = drafter.drafter_forward(module, loaded.head, GOLDEN["tokens"], GOLDEN["hidden"], cfg=cfg)
    np.testing.assert_allclose(out.logits, GOLDEN["forward_logits"], rtol=0, atol=5e-2)


def test_two_nextn_modules_load_and_chain(tmp_path):
    # DeepSeek's layout with num_nextn_predict_layers = 2: module i is model.layers.{3 + i}, with
    # its own eh_proj, norms and layer; step 1 runs module 1 on the row (d_1, g_0) at key e + 1,
    # the only row it holds.
    import checkpoint_fixtures as fx

    rng = np.random.default_rng(5)
    tensors = fx.target_tensors(rng, layers=2)
    for p in ("model.layers.3.", "model.layers.4."):
        tensors |= fx.deepseek_module_tensors(p, rng)
    fx.write_checkpoint(tmp_path / "src", fx.deepseek_v3_config(num_mtp=2), tensors)
    convert(tmp_path / "src", tmp_path / "out", precision="keep", progress=False)
    cfg, loaded = load_drafter(tmp_path / "out")
    assert cfg.runnable and loaded.num_modules == 2
    second = loaded.modules[1].fc
    np.testing.assert_array_equal(
        np.asarray(second.q).view(np.uint8), tensors["model.layers.4.eh_proj.weight"].view(np.uint8)
    )
    modules = drafter.DrafterModules.from_checkpoint(loaded)
    B, e = 2, 4
    pool = drafter.pool_config(cfg, precision="bf16", max_seq_len=16, max_seqs=B, block_size=4)
    state = drafter.init_state(pool, num_seqs=B, num_modules=2)
    tok = rng.integers(0, cfg.vocab_size, (B, 6)).astype(np.int32)
    hid = rng.standard_normal((B, 6, cfg.hidden_size)).astype(np.float32)
    out, state = drafter.propose(
        modules, loaded.head, state, pairs(tok, hid, [e + 1] * B, [0] * B), cfg=cfg,
        num_drafts=2, return_logits=True,
    )  # fmt: skip
    drafter.raise_on_state_error(state)
    np.testing.assert_array_equal(np.asarray(state.seq_len), [[e + 1] * B, [1] * B])
    ref0 = np_tree(drafter.drafter_forward(loaded.modules[0], loaded.head, tok, hid, cfg=cfg))
    np.testing.assert_allclose(out.logits[:, 0], ref0.logits[:, e], rtol=0, atol=5e-2)
    np.testing.assert_allclose(out.hidden[:, 0], ref0.h_out[:, e], rtol=0, atol=5e-2)
    ref1 = np_tree(
        drafter.drafter_forward(
            loaded.modules[1], loaded.head, np.asarray(out.tokens[:, :1]),
            np.asarray(out.hidden[:, :1]), cfg=cfg, positions=np.full((B, 1), e + 1, np.int32),
        )
    )  # fmt: skip
    np.testing.assert_allclose(out.logits[:, 1], ref1.logits[:, 0], rtol=0, atol=5e-2)
