"""The hybrid (Gated DeltaNet + full attention) target: the delta rule's two forms against a
naive loop, prefill and steps against the full forward, the rollback property after random
rounds of partial accepts, and greedy speculation equal to plain greedy decoding."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trace_helpers import count_calls

import mtpjax
from mtpjax import drafter as drafter_lib
from mtpjax import hybrid
from mtpjax.config import DrafterConfig
from mtpjax.head import from_arrays
from mtpjax.hybrid import _model as model_lib
from mtpjax.weights import Bf16Weight, WeightFormat
from pallas_kernels.implementation import Implementation

# [linear, full] * 2: two groups of two slots, so both the group scan and both mixers run; a
# chunk of 8 so that prompts span several chunks of the prefill's delta rule. (Qwen3-Next's
# packed projections and MoE FFNs run against transformers in test_hybrid_fixtures.py.)
CFG = hybrid.HybridConfig.tiny(num_hidden_layers=4, full_attention_interval=2, gdn_chunk_size=8)
B, T, MAX_LEN, W = 3, 20, 32, 4  # shared shapes keep the number of compilations down
EPS = float(np.finfo(np.float32).eps)


def tol(cfg: hybrid.HybridConfig, length: int) -> float:
    """F32 rounding through the stack: ~eps * sqrt(reduction length) per layer (dots over H,
    sums over the ``length`` positions of the delta rule and attention), twice for the norms
    that rescale each layer's input."""
    return 2 * cfg.num_hidden_layers * math.sqrt(length * cfg.hidden_size) * EPS


def _tokens(shape, seed=0, vocab=CFG.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


@pytest.fixture(scope="module")
def model():
    return hybrid.init(CFG, key=jax.random.key(0))


# --------------------------------------------------------------------------------------------
# The delta rule.


def _naive_delta(q, k, v, g, beta, s0):
    """The recurrence one head and one position at a time, in float64."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    Bn, Tn, H = g.shape
    out = np.zeros(v.shape)
    for b in range(Bn):
        for h in range(H):
            S = s[b, h].copy()
            for t in range(Tn):
                S *= np.exp(g[b, t, h])
                u = beta[b, t, h] * (v[b, t, h] - k[b, t, h] @ S)
                S += np.outer(k[b, t, h], u)
                out[b, t, h] = q[b, t, h] @ S
            s[b, h] = S
    return out, s


def _unit(x):
    return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), jnp.float32)


def test_chunked_and_recurrent_delta_rules_match_a_naive_loop():
    rng = np.random.default_rng(0)
    Bn, Tn, H, dk, dv = 2, 37, 3, 16, 8  # 37 positions: four chunks of 8 and a ragged tail
    q = _unit(rng.standard_normal((Bn, Tn, H, dk))) * dk**-0.5
    k = _unit(rng.standard_normal((Bn, Tn, H, dk)))
    v = jnp.asarray(rng.standard_normal((Bn, Tn, H, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0, 1, (Bn, Tn, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (Bn, Tn, H)), jnp.float32)
    # The second sequence ends at 29: its padding (beta = g = 0) must not touch its state.
    pad = np.arange(Tn)[None, :, None] >= np.array([Tn, 29])[:, None, None]
    g, beta = jnp.where(pad, 0.0, g), jnp.where(pad, 0.0, beta)
    s0 = jnp.asarray(rng.standard_normal((Bn, H, dk, dv)), jnp.float32)

    want_o, want_s = _naive_delta(q, k, v, g, beta, s0)
    recurrent = jax.jit(hybrid.recurrent_delta_rule)
    chunked = jax.jit(hybrid.chunked_delta_rule, static_argnames="chunk_size")
    o_rec, states = recurrent(q, k, v, g, beta, s0)
    o_chunk, s_chunk = chunked(q, k, v, g, beta, s0, chunk_size=8)
    # Sums over up to 37 positions of dk-long dots of O(1) values.
    atol = 4 * math.sqrt(Tn * dk) * EPS * float(np.abs(want_o).max())
    np.testing.assert_allclose(o_rec, want_o, atol=atol, rtol=0)
    np.testing.assert_allclose(o_chunk, want_o, atol=atol, rtol=0)
    np.testing.assert_allclose(s_chunk, want_s, atol=atol, rtol=0)
    np.testing.assert_allclose(states[:, -1], want_s, atol=atol, rtol=0)
    np.testing.assert_array_equal(states[1, 28], states[1, -1])  # padding leaves S as it is
    # A chunk as long as the sequence is the same computation in one piece.
    o_one, _ = chunked(q, k, v, g, beta, s0, chunk_size=64)
    np.testing.assert_allclose(o_one, want_o, atol=atol, rtol=0)


def test_causal_conv_reads_its_history_then_the_new_inputs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3 + 5, 6)).astype(np.float32)  # K - 1 = 3 history rows
    w = rng.standard_normal((6, 1, 4)).astype(np.float32)
    got = np.asarray(hybrid.causal_conv(jnp.asarray(x), jnp.asarray(w)))
    acc = sum(x[:, j : j + 5] * w[:, 0, j] for j in range(4))
    np.testing.assert_allclose(got, acc / (1 + np.exp(-acc)), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Prefill and steps against the full forward.


def _prefill(params, head, tokens, lengths, cfg=CFG):
    state = hybrid.init_state(cfg, batch=B, max_len=MAX_LEN, max_step=W)
    return hybrid.prefill(params, head, state, tokens, jnp.asarray(lengths, jnp.int32), cfg=cfg)


def test_prefill_then_steps_match_the_full_forward(model):
    cfg, (params, head) = CFG, model
    tokens = _tokens((B, T), seed=3)
    full, layers = hybrid.forward(params, head, tokens, cfg=cfg)
    assert layers.shape == (cfg.num_hidden_layers + 1, B, T, cfg.hidden_size)
    atol = tol(cfg, T)

    lengths = np.array([5, 9, 11])
    prompt = jnp.where(jnp.arange(T)[None] < lengths[:, None], tokens, 0)
    hidden, state = _prefill(params, head, prompt, lengths, cfg)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(hidden[b, :n], full[b, :n], atol=atol, rtol=atol)
        np.testing.assert_array_equal(hidden[b, n:], 0.0)

    # Token by token from each sequence's own length, then one 4-row window.
    pos = lengths.copy()
    for _ in range(5):
        row = tokens[np.arange(B), pos][:, None]
        out, state = hybrid.step(params, head, state, row, jnp.asarray(pos), cfg=cfg)
        np.testing.assert_allclose(out[:, 0], full[np.arange(B), pos], atol=atol, rtol=atol)
        pos = pos + 1
    window = tokens[np.arange(B)[:, None], pos[:, None] + np.arange(W)]
    out, state = hybrid.step(params, head, state, window, jnp.asarray(pos), cfg=cfg)
    want = full[np.arange(B)[:, None], pos[:, None] + np.arange(W)]
    np.testing.assert_allclose(out, want, atol=atol, rtol=atol)


def test_packed_projections_are_the_split_ones_regrouped(model):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba hold, per key head h, rows [q_h, k_h, v_h (r value
    heads), z_h (r value heads)] and [b_h, a_h]: packing the split weights that way gives the
    same model."""
    params, head = model
    packed_cfg = dataclasses.replace(CFG, gdn_layout=hybrid.GdnLayout.PACKED)
    Hk, r = CFG.linear_num_key_heads, CFG.value_heads_per_key_head
    dk, dv, kd = CFG.linear_key_head_dim, CFG.linear_value_head_dim, CFG.key_dim

    def pack(gdn: hybrid.GdnParams) -> hybrid.GdnParams:
        qkv, z = gdn.in_proj_qkv.w, gdn.in_proj_z.w  # [G, C, H], [G, Hv*dv, H]
        G, _, H = qkv.shape
        q = qkv[:, :kd].reshape(G, Hk, dk, H)
        k = qkv[:, kd : 2 * kd].reshape(G, Hk, dk, H)
        v = qkv[:, 2 * kd :].reshape(G, Hk, r * dv, H)
        z = z.reshape(G, Hk, r * dv, H)
        qkvz = jnp.concatenate([q, k, v, z], axis=2).reshape(G, -1, H)
        b = gdn.in_proj_b.w.reshape(G, Hk, r, H)
        a = gdn.in_proj_a.w.reshape(G, Hk, r, H)
        ba = jnp.concatenate([b, a], axis=2).reshape(G, -1, H)
        return dataclasses.replace(
            gdn,
            in_proj_qkv=None,
            in_proj_z=None,
            in_proj_b=None,
            in_proj_a=None,
            in_proj_qkvz=Bf16Weight(w=qkvz),
            in_proj_ba=Bf16Weight(w=ba),
        )

    layers = tuple(
        dataclasses.replace(lp, linear_attn=pack(lp.linear_attn))
        if isinstance(lp, hybrid.GdnLayerParams)
        else lp
        for lp in params.layers
    )
    packed = dataclasses.replace(params, layers=layers)
    tokens = _tokens((B, T), seed=3)
    want, _ = hybrid.forward(params, head, tokens, cfg=CFG)
    got, _ = hybrid.forward(packed, head, tokens, cfg=packed_cfg)
    # Only the projections' summation order differs (other output widths).
    np.testing.assert_allclose(got, want, atol=tol(CFG, T), rtol=tol(CFG, T))


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_every_projection_goes_through_linear(precision):
    """A target initialised at FP8 or NVFP4 (the GDN gates b/a stay BF16) traces through the
    forward, prefill and step: no projection reads a weight's BF16 array directly. (Traced
    abstractly: ``linear``'s own tests check each format's numbers.)"""
    params, head = jax.eval_shape(
        lambda: hybrid.init(CFG, key=jax.random.key(0), precision=precision)
    )
    fmt = WeightFormat(precision)
    gdn = params.layers[0].linear_attn
    assert gdn.in_proj_qkv.format is fmt and gdn.out_proj.format is fmt
    assert gdn.in_proj_b.format is WeightFormat.BF16
    assert params.layers[1].attention.k_proj.format is fmt
    assert params.layers[0].ffn.down_proj.format is fmt
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    hidden, _ = jax.eval_shape(
        lambda p, h, t: hybrid.forward(p, h, t, cfg=CFG), params, head, tokens
    )
    assert hidden.shape == (B, T, CFG.hidden_size) and hidden.dtype == jnp.float32

    def prefill_then_step(p, h, t):
        state = hybrid.init_state(CFG, batch=B, max_len=MAX_LEN, max_step=W)
        _, state = hybrid.prefill(p, h, state, t, jnp.full((B,), T, jnp.int32), cfg=CFG)
        return hybrid.step(p, h, state, t[:, :W], jnp.full((B,), T, jnp.int32), cfg=CFG)

    out, _ = jax.eval_shape(prefill_then_step, params, head, tokens)
    assert out.shape == (B, W, CFG.hidden_size)


# --------------------------------------------------------------------------------------------
# Rollback: the committed state after rounds with partial accepts is a fresh prefill's.


def _committed_state(state, lengths):
    """Per GDN slot (conv f32[G, B, K-1, C], recurrent f32[G, B, Hv, dk, dv]) at ``lengths``, and
    per full-attention slot the K/V rows before each length."""
    lengths = jnp.asarray(lengths, jnp.int32)
    out = []
    for s, sel in zip(state.layers, hybrid.commit(state, lengths, cfg=CFG)):
        if sel is None:
            rows = np.arange(MAX_LEN)[None, :] < np.asarray(lengths)[:, None]  # [B, Lmax]
            out.append(tuple(np.where(rows[None, :, :, None, None], a, 0.0) for a in (s.k, s.v)))
        else:
            out.append(tuple(np.asarray(a) for a in sel))
    return out


def test_rollback_after_random_partial_accepts_equals_a_fresh_prefill(model, monkeypatch):
    """Rounds of (k+1)-row steps with random accept counts 0..k: after each, the state the next
    step continues from (conv, recurrent, KV) is the one a prefill over the committed tokens
    gives, and the accepted rows' hidden states are the full forward's. One trace of the step
    serves every round (new start values, ``implementation`` in any spelling)."""
    params, head = model
    traces = count_calls(monkeypatch, model_lib, "recurrent_delta_rule_stacked")
    model_lib._step.clear_cache()
    rng = np.random.default_rng(5)
    lengths = np.array([2, 5, 3])
    committed = [list(np.asarray(_tokens((T,), seed=b))[:n]) for b, n in enumerate(lengths)]
    prompt = np.zeros((B, T), np.int32)
    for b, c in enumerate(committed):
        prompt[b, : len(c)] = c
    _, state = _prefill(params, head, jnp.asarray(prompt), lengths)
    atol = tol(CFG, T)
    accepts_seen = set()
    for round_ in range(4):
        window = rng.integers(0, CFG.vocab_size, (B, W)).astype(np.int32)
        spelling = ("auto", "AUTO", Implementation.AUTO, "Auto")[round_]
        hidden, state = hybrid.step(
            params,
            head,
            state,
            jnp.asarray(window),
            jnp.asarray(lengths),
            cfg=CFG,
            implementation=spelling,
        )
        accepted = rng.integers(0, W, B) if round_ else np.array([0, W - 1, 1])
        accepts_seen.update(accepted.tolist())
        for b in range(B):
            committed[b] += window[b, : accepted[b] + 1].tolist()
        lengths = lengths + accepted + 1

        fresh_tokens = np.zeros((B, T), np.int32)
        for b, c in enumerate(committed):
            fresh_tokens[b, : len(c)] = c
        fresh_hidden, fresh = _prefill(params, head, jnp.asarray(fresh_tokens), lengths)
        for got, want in zip(_committed_state(state, lengths), _committed_state(fresh, lengths)):
            for a, b_ in zip(got, want):
                np.testing.assert_allclose(a, b_, atol=atol, rtol=atol)
        for b in range(B):
            rows = np.arange(accepted[b] + 1)
            n0 = lengths[b] - accepted[b] - 1
            np.testing.assert_allclose(
                hidden[b, rows], fresh_hidden[b, n0 + rows], atol=atol, rtol=atol
            )
    assert {0, W - 1} <= accepts_seen  # nothing and everything accepted both happen
    assert len(traces) == 1  # one trace of the step (CFG has one GDN slot)


def test_step_refuses_more_rows_than_the_state_keeps_snapshots_for(model):
    params, head = model
    state = hybrid.init_state(CFG, batch=B, max_len=MAX_LEN, max_step=2)
    with pytest.raises(ValueError, match=r"S=3 rows.*max_step=2.*max_step=3"):
        hybrid.step(params, head, state, _tokens((B, 3)), jnp.zeros((B,), jnp.int32), cfg=CFG)
    with pytest.raises(TypeError, match="cfg must be passed by name"):
        hybrid.forward(params, head, _tokens((B, T)), CFG)


# --------------------------------------------------------------------------------------------
# Exactness: greedy speculation equals plain greedy decoding.


EXACT = hybrid.HybridConfig.tiny(num_hidden_layers=2, full_attention_interval=2)


@pytest.fixture(scope="module")
def pair():
    """A target whose mixers and FFNs write small residuals (its next token is mostly a function
    of the current one) and a drafter that predicts exactly that function: its fc passes the
    normed embedding through and its layer adds nothing. So drafts are often, not always,
    right, and rounds end in partial accepts."""
    H, V = EXACT.hidden_size, EXACT.vocab_size
    params, _ = hybrid.init(EXACT, key=jax.random.key(0))
    k_embed, k_head = jax.random.split(jax.random.key(1))
    head = from_arrays(
        EXACT.lm_head_config(),
        lm_head=4.0 * jax.random.normal(k_head, (V, H)) * H**-0.5,
        embedding=jax.random.normal(k_embed, (V, H)),
    )

    def scaled(w, s=0.2):
        return Bf16Weight(w=(w.w * s).astype(jnp.bfloat16))

    def quiet(lp):
        if isinstance(lp, hybrid.GdnLayerParams):
            mixer = dataclasses.replace(lp.linear_attn, out_proj=scaled(lp.linear_attn.out_proj))
            lp = dataclasses.replace(lp, linear_attn=mixer)
        else:
            attn = dataclasses.replace(lp.attention, o_proj=scaled(lp.attention.o_proj))
            lp = dataclasses.replace(lp, attention=attn)
        return dataclasses.replace(
            lp, ffn=dataclasses.replace(lp.ffn, down_proj=scaled(lp.ffn.down_proj))
        )

    params = dataclasses.replace(params, layers=tuple(quiet(lp) for lp in params.layers))
    dcfg = DrafterConfig.tiny(vocab_size=V)
    d = drafter_lib.init(dcfg, key=jax.random.key(2))
    zero = lambda w: Bf16Weight(w=jnp.zeros_like(w.w))  # noqa: E731
    layer = dataclasses.replace(
        d.layer,
        attention=dataclasses.replace(d.layer.attention, o_proj=zero(d.layer.attention.o_proj)),
        ffn=dataclasses.replace(d.layer.ffn, down_proj=zero(d.layer.ffn.down_proj)),
    )
    passthrough = jnp.concatenate([jnp.eye(H), jnp.zeros((H, H))], axis=1)
    d = dataclasses.replace(
        d,
        fc=Bf16Weight(w=passthrough.astype(jnp.bfloat16)),
        pre_fc_norm_embedding=params.final_norm,
        layer=layer,
        norm=jnp.zeros((H,), jnp.bfloat16),
    )
    return params, head, dcfg, d


# The narrowest and the widest window here; test_generate runs every k on the trained pair.
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_plain_greedy(pair, k):
    params, head, dcfg, d = pair
    target = hybrid.target_model(EXACT, params, head, max_step=k + 1)
    prompts = np.asarray(_tokens((B, 8), seed=11))
    lengths = np.array([3, 8, 5], np.int32)
    kw = dict(head_cfg=EXACT.lm_head_config(), max_new_tokens=12)
    spec = jax.device_get(
        mtpjax.generate(target, d, head, prompts, lengths, drafter_cfg=dcfg, num_drafts=k, **kw)
    )
    base = jax.device_get(
        mtpjax.generate_baseline(target, head, prompts, lengths, step_width=k + 1, **kw)
    )
    np.testing.assert_array_equal(spec.tokens, base.tokens)
    np.testing.assert_array_equal(spec.lengths, base.lengths)
    m = spec.metrics
    assert 0 < int(m.num_accepted_tokens) < int(m.num_draft_tokens)  # partial accepts
    assert int(spec.target_steps) < int(base.target_steps)


def test_target_model_checks_its_arguments(model):
    params, head = model
    with pytest.raises(TypeError, match="cfg must be a HybridConfig"):
        hybrid.target_model(object(), params, head)
    with pytest.raises(ValueError, match="layer slots"):
        hybrid.target_model(EXACT, dataclasses.replace(params, layers=params.layers * 2), head)
    with pytest.raises(ValueError, match="unknown implementation"):
        hybrid.target_model(CFG, params, head, implementation="cuda")
    by_name = hybrid.target_model(CFG, params, head, implementation="XLA")
    by_enum = hybrid.target_model(CFG, params, head, implementation=Implementation.XLA)
    assert by_name.step == by_enum.step and by_name.init_cache == by_enum.init_cache
