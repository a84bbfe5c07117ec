"""The reference target: cached prefill/steps against the full causal forward, rollback by
overwrite, one trace per shape, and the Hugging Face safetensors round trip."""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trace_helpers import count_calls

from mtpjax import drafter as drafter_lib
from mtpjax.config import DrafterConfig, FfnKind
from mtpjax.head import init_lm_head
from mtpjax.layers.decoder import decoder_layer
from mtpjax.layers.norms import rms_norm
from mtpjax.reference import (
    TargetConfig,
    init,
    init_cache,
    load_hf,
    load_target,
    save_hf,
    target_forward,
    target_prefill,
    target_step,
)
from mtpjax.reference import target as target_lib
from pallas_kernels.implementation import Implementation

CFG = TargetConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
)
TOL = dict(rtol=2e-5, atol=2e-5)
B, P, T, MAX_LEN = 2, 5, 12, 16  # shared shapes keep the number of compilations down


def _randomize(a, key):
    return (a.astype(jnp.float32) + 0.2 * jax.random.normal(key, a.shape)).astype(a.dtype)


@pytest.fixture(scope="module")
def model():
    target = init(CFG, key=jax.random.key(0), std=0.1)
    k = iter(jax.random.split(jax.random.key(1), 8))
    layers, attn = target.layers, target.layers.attention
    # Non-zero norm weights: a zero-centred norm with w = 0 is the identity and would hide a
    # (1 + w) vs w mix-up.
    target = dataclasses.replace(
        target,
        final_norm=_randomize(target.final_norm, next(k)),
        layers=dataclasses.replace(
            layers,
            input_layernorm=_randomize(layers.input_layernorm, next(k)),
            post_attention_layernorm=_randomize(layers.post_attention_layernorm, next(k)),
            attention=dataclasses.replace(
                attn,
                q_norm=_randomize(attn.q_norm, next(k)),
                k_norm=_randomize(attn.k_norm, next(k)),
            ),
        ),
    )
    head = init_lm_head(CFG.lm_head_config(), key=next(k))
    # Embedding rows of O(1) so attention is far from uniform.
    return target, dataclasses.replace(head, embedding=(head.embedding * 50).astype(jnp.bfloat16))


def _tokens(shape, seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, CFG.vocab_size, jnp.int32)


def test_forward_matches_decoder_layer_stack(model):
    """The scanned forward against the library's dense decoder layer applied layer by layer."""
    target, head = model
    tokens = _tokens((B, T))
    got = target_forward(target, head, tokens, cfg=CFG)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = head.embedding[tokens].astype(jnp.float32)
    for i in range(CFG.num_hidden_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], target.layers)
        x = decoder_layer(layer, x, positions, cfg=CFG)
    want = rms_norm(x, target.final_norm, eps=CFG.rms_norm_eps, zero_centered=True)
    np.testing.assert_allclose(got, want, **TOL)
    assert got.shape == (B, T, CFG.hidden_size) and got.dtype == jnp.float32


def test_prefill_then_steps_match_full_forward(model):
    target, head = model
    tokens = _tokens((B, T), seed=1)
    full = target_forward(target, head, tokens, cfg=CFG)
    cache = init_cache(CFG, batch=B, max_len=MAX_LEN)
    hidden, cache = target_prefill(target, head, cache, tokens[:, :P], jnp.full((B,), P), cfg=CFG)
    pieces, pos = [hidden], P
    for s in (1, 4, 2):
        h, cache = target_step(
            target, head, cache, tokens[:, pos : pos + s], jnp.full((B,), pos), cfg=CFG
        )
        pieces.append(h)
        pos += s
    assert pos == T
    np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, **TOL)
    # The cache rows equal the K/V one prefill over the whole sequence writes.
    ref = init_cache(CFG, batch=B, max_len=MAX_LEN)
    _, ref = target_prefill(target, head, ref, tokens, jnp.full((B,), T), cfg=CFG)
    np.testing.assert_allclose(cache.k[:, :, :T], ref.k[:, :, :T], **TOL)
    np.testing.assert_allclose(cache.v[:, :, :T], ref.v[:, :, :T], **TOL)


def test_ragged_batch_lengths(model):
    """Right-padded prompts of different lengths, then steps at each sequence's own start."""
    target, head = model
    lengths = jnp.asarray([2, P], jnp.int32)
    seqs = _tokens((B, T), seed=2)
    prompts = jnp.where(jnp.arange(P)[None] < lengths[:, None], seqs[:, :P], 7)
    cache = init_cache(CFG, batch=B, max_len=MAX_LEN)
    hidden, cache = target_prefill(target, head, cache, prompts, lengths, cfg=CFG)
    steps = []
    for r in range(2):
        start = lengths + 2 * r
        new = jnp.stack([jax.lax.dynamic_slice_in_dim(seqs[b], start[b], 2) for b in range(B)])
        h, cache = target_step(target, head, cache, new, start, cfg=CFG)
        steps.append(h)
    steps = jnp.concatenate(steps, 1)
    # Causal: each sequence's rows are unaffected by what follows, so one batched call serves.
    want = target_forward(target, head, seqs, cfg=CFG)
    for b in range(B):
        n = int(lengths[b])
        np.testing.assert_allclose(hidden[b, :n], want[b, :n], **TOL)
        assert not np.any(np.asarray(hidden[b, n:])), "padded prompt rows must be zero"
        np.testing.assert_allclose(steps[b], want[b, n : n + 4], **TOL)


def test_rejected_rows_are_overwritten(model):
    """Verify 4 tokens, accept 1 draft (+ the bonus), then continue from the committed length:
    the stale rows of the rejected drafts must not leak into any later hidden state."""
    target, head = model
    seq = _tokens((B, T), seed=3)  # the tokens finally committed
    drafts = _tokens((B, 4), seed=4)
    cache = init_cache(CFG, batch=B, max_len=MAX_LEN)
    _, cache = target_prefill(target, head, cache, seq[:, :P], jnp.full((B,), P), cfg=CFG)
    verify = jnp.concatenate([seq[:, P : P + 2], drafts[:, 2:]], 1)  # 2 right, 2 rejected
    _, cache = target_step(target, head, cache, verify, jnp.full((B,), P), cfg=CFG)
    stale = cache.k[:, :, P + 2]
    full = target_forward(target, head, seq, cfg=CFG)
    # Resume at P + 2 with one token first (the stale row P + 3 is then ahead of the query).
    h1, cache = target_step(
        target, head, cache, seq[:, P + 2 : P + 3], jnp.full((B,), P + 2), cfg=CFG
    )
    np.testing.assert_allclose(h1[:, 0], full[:, P + 2], **TOL)
    assert not np.allclose(stale, cache.k[:, :, P + 2]), "the test must exercise a stale row"
    h2, cache = target_step(
        target, head, cache, seq[:, P + 3 : P + 7], jnp.full((B,), P + 3), cfg=CFG
    )
    np.testing.assert_allclose(h2, full[:, P + 3 : P + 7], **TOL)


def test_per_sequence_rollback(model):
    """Sequences of one batch accept different numbers of drafts and resume at different starts."""
    target, head = model
    seq = _tokens((B, T), seed=5)
    cache = init_cache(CFG, batch=B, max_len=MAX_LEN)
    _, cache = target_prefill(target, head, cache, seq[:, :P], jnp.full((B,), P), cfg=CFG)
    _, cache = target_step(target, head, cache, _tokens((B, 4), seed=6), jnp.full((B,), P), cfg=CFG)
    # Sequence 1 then commits two real tokens (rows P, P + 1); sequence 0 commits none.
    _, cache = target_step(target, head, cache, seq[:, P : P + 2], jnp.full((B,), P), cfg=CFG)
    start = jnp.asarray([P, P + 2], jnp.int32)
    new = jnp.stack([jax.lax.dynamic_slice_in_dim(seq[b], start[b], 4) for b in range(B)])
    h, _ = target_step(target, head, cache, new, start, cfg=CFG)
    full = target_forward(target, head, seq, cfg=CFG)
    for b in range(B):
        s = int(start[b])
        np.testing.assert_allclose(h[b], full[b, s : s + 4], **TOL)


def test_step_traces_once_for_new_values_and_spellings(model, monkeypatch):
    """New start values, and ``implementation`` by enum or name in any case, share one trace
    of each step (``_layer`` runs once per trace: it is the scan body)."""
    target, head = model
    traces = count_calls(monkeypatch, target_lib, "_layer")
    target_lib._target_step.clear_cache()
    cache = init_cache(CFG, batch=B, max_len=MAX_LEN)
    spellings = [{}, dict(implementation="AUTO"), dict(implementation=Implementation.AUTO)]
    for i, start in enumerate([[0, 0], [3, 5], [9, 1]]):
        _, cache = target_step(
            target,
            head,
            cache,
            _tokens((B, 4), seed=20 + i),
            jnp.asarray(start, jnp.int32),
            cfg=CFG,
            **spellings[i],
        )
    assert len(traces) == 1
    target_lib._target_forward.clear_cache()
    for spelling in spellings:
        target_forward(target, head, _tokens((B, 3)), cfg=CFG, **spelling)
    assert len(traces) == 2


def test_steps_name_a_positional_config_and_an_unknown_implementation(model):
    target, head = model
    cache = init_cache(CFG, batch=B, max_len=MAX_LEN)
    tokens, lengths = _tokens((B, P)), jnp.full((B,), P, jnp.int32)
    with pytest.raises(TypeError, match="cfg must be passed by name"):
        target_forward(target, head, tokens, CFG)
    with pytest.raises(TypeError, match="cfg must be passed by name"):
        target_prefill(target, head, cache, tokens, lengths, CFG)
    with pytest.raises(TypeError, match="cfg must be passed by name"):
        target_step(target, head, cache, tokens, lengths, CFG)
    with pytest.raises(ValueError, match="unknown implementation 'cuda'; expected one of"):
        target_forward(target, head, tokens, cfg=CFG, implementation="cuda")
    with pytest.raises(TypeError, match="TargetConfig takes keyword arguments only; got 2"):
        TargetConfig(64, 2)


def test_bf16_compute_tracks_f32(model):
    target, head = model
    tokens = _tokens((B, T), seed=7)
    f32 = target_forward(target, head, tokens, cfg=CFG)
    bf16 = target_forward(
        target, head, tokens, cfg=dataclasses.replace(CFG, compute_dtype="bfloat16")
    )
    rel = float(jnp.linalg.norm(bf16 - f32) / jnp.linalg.norm(f32))
    assert 0 < rel < 3e-2


def test_save_load_round_trip(model, tmp_path):
    target, head = model
    dcfg = CFG.drafter_config()
    assert dcfg.ffn is FfnKind.DENSE and dcfg.runnable
    mtp = drafter_lib.init(dcfg, key=jax.random.key(9))
    save_hf(
        tmp_path, cfg=CFG, target=target, head=head, drafter=mtp, extra_config={"eos_token_id": 0}
    )

    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_next" and raw["num_nextn_predict_layers"] == 1
    assert raw["layer_types"] == ["full_attention"] * CFG.num_hidden_layers
    assert raw["eos_token_id"] == 0 and raw["head_dim"] == CFG.head_dim
    assert DrafterConfig.from_hf_config(tmp_path) == dcfg

    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "flax") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {jnp.dtype(jnp.bfloat16)}
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").shape == (
            CFG.q_proj_width,
            CFG.hidden_size,
        )
        assert f.get_tensor("mtp.fc.weight").shape == (CFG.hidden_size, 2 * CFG.hidden_size)
    layer = [
        "input_layernorm",
        "post_attention_layernorm",
        *(f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
        *(f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")),
    ]
    prefixes = [f"model.layers.{i}" for i in range(CFG.num_hidden_layers)] + ["mtp.layers.0"]
    expected = {f"{p}.{n}.weight" for p in prefixes for n in layer}
    expected |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {
        f"mtp.{n}.weight" for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    }
    assert names == expected

    n_params = sum(f_size for f_size in _sizes(tmp_path / "model.safetensors"))
    assert n_params == CFG.num_parameters(mtp_layers=1)

    cfg2, target2, head2, dcfg2, mtp2 = load_hf(tmp_path)
    assert cfg2 == CFG and dcfg2 == dcfg
    for a, b in zip(
        jax.tree.leaves((target, head.weight, head.embedding, mtp)),
        jax.tree.leaves((target2, head2.weight, head2.embedding, mtp2)),
    ):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(head2.final_norm, target2.final_norm)
    tokens = _tokens((B, T), seed=8)
    np.testing.assert_array_equal(
        target_forward(target2, head2, tokens, cfg=cfg2),
        target_forward(target, head, tokens, cfg=CFG),
    )
    cfg3, target3, _ = load_target(tmp_path)
    assert cfg3 == CFG
    chex.assert_trees_all_equal(target3, target2)


def _sizes(path):
    from safetensors import safe_open

    with safe_open(path, "flax") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return [int(np.prod(f.get_slice(n).get_shape())) for n in names]


def test_load_without_mtp_fails_clearly(model, tmp_path):
    target, head = model
    save_hf(tmp_path, cfg=CFG, target=target, head=head)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 0
    load_target(tmp_path)  # the target alone loads
    with pytest.raises(ValueError, match="MTP"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
        ({"num_experts": 8, "mlp_only_layers": []}, "num_experts"),
        ({"model_type": "llama"}, "model_type"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_from_hf_config_rejects_what_it_cannot_run(patch, match):
    raw = CFG.to_hf_config()
    raw.update(patch)
    with pytest.raises(ValueError, match=match):
        TargetConfig.from_hf_config(raw)


def test_config_round_trip_and_rope_parameters():
    assert TargetConfig.from_hf_config(CFG.to_hf_config()) == CFG
    with pytest.raises(ValueError, match="zero-centred"):
        dataclasses.replace(CFG, zero_centered_norm=False).to_hf_config()
    raw = CFG.to_hf_config()
    theta, factor = raw.pop("rope_theta"), raw.pop("partial_rotary_factor")
    raw["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": theta,
        "partial_rotary_factor": factor,
    }
    assert TargetConfig.from_hf_config(raw) == CFG
