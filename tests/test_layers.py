"""Layer math against float64 numpy written independently of the JAX code."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax import layers
from mtpjax.config import RouterScoring
from mtpjax.weights import quantize


def _rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm(zero_centered):
    rng = _rng()
    x, w = rng.standard_normal((3, 5, 32)), rng.standard_normal(32) * 0.1
    got = np.asarray(layers.rms_norm(x, w, eps=1e-6, zero_centered=zero_centered))
    ref = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * ((1 + w) if zero_centered else w)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)


def test_partial_neox_rope_is_a_complex_rotation():
    rng = _rng(1)
    D, rd, theta = 16, 8, 10_000.0
    x = rng.standard_normal((2, 7, 3, D))
    pos = rng.integers(0, 5000, (2, 7))
    got = np.asarray(layers.apply_rope(x, pos, rotary_dim=rd, theta=theta))
    half = rd // 2
    freq = theta ** (-np.arange(half) * 2.0 / rd)
    z = (x[..., :half] + 1j * x[..., half:rd]) * np.exp(1j * pos[..., None, None] * freq)
    ref = np.concatenate([z.real, z.imag, x[..., rd:]], -1)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # Relative positions: <rope(q, m), rope(k, n)> depends on m - n only.
    q, k = rng.standard_normal((1, 1, 1, D)), rng.standard_normal((1, 1, 1, D))

    def dot(m, n):
        qm = np.asarray(layers.apply_rope(q, np.array([[m]]), rotary_dim=rd, theta=theta))
        kn = np.asarray(layers.apply_rope(k, np.array([[n]]), rotary_dim=rd, theta=theta))
        return float((qm * kn).sum())

    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-4)


def test_attend_gqa_matches_loop():
    rng = _rng(2)
    B, Tq, Tk, Nq, Nkv, D = 2, 3, 5, 4, 2, 8
    q, k, v = (rng.standard_normal(s) for s in [(B, Tq, Nq, D), (B, Tk, Nkv, D), (B, Tk, Nkv, D)])
    mask = rng.random((B, Tq, Tk)) < 0.7
    mask[0, 0] = False  # a row with nothing to attend
    got = np.asarray(layers.attend(q, k, v, mask))
    ref = np.zeros((B, Tq, Nq, D))
    for b in range(B):
        for t in range(Tq):
            for h in range(Nq):
                idx = np.flatnonzero(mask[b, t])
                if idx.size == 0:
                    continue
                s = k[b, idx, h // (Nq // Nkv)] @ q[b, t, h] / np.sqrt(D)
                p = np.exp(s - s.max())
                ref[b, t, h] = (p / p.sum()) @ v[b, idx, h // (Nq // Nkv)]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _moe_params(rng, E=6, H=16, I=8, shared=True):
    def w(*shape):
        return quantize(rng.standard_normal(shape).astype(np.float32) * 0.3, "bf16")

    experts = layers.DenseFfnParams(gate_proj=w(E, I, H), up_proj=w(E, I, H), down_proj=w(E, H, I))
    return layers.MoeFfnParams(
        router=w(E, H),
        experts=experts,
        shared_expert=layers.DenseFfnParams(gate_proj=w(I, H), up_proj=w(I, H), down_proj=w(H, I))
        if shared
        else None,
        shared_expert_gate=w(1, H) if shared else None,
    )


def _np_moe(params, y, top_k, normalize):
    f = lambda a: np.asarray(a.w, np.float64)  # noqa: E731
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731

    def expert(p, x, e=None):
        sel = (lambda a: f(a)[e]) if e is not None else f
        return sel(p.down_proj) @ (silu(sel(p.gate_proj) @ x) * (sel(p.up_proj) @ x))

    out = []
    for x in y.reshape(-1, y.shape[-1]):
        logits = f(params.router) @ x
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:top_k]
        w = p[top] / (p[top].sum() if normalize else 1.0)
        acc = sum(wi * expert(params.experts, x, e) for wi, e in zip(w, top))
        if params.shared_expert is not None:
            g = 1 / (1 + np.exp(-(f(params.shared_expert_gate) @ x)))
            acc = acc + g * expert(params.shared_expert, x)
        out.append(acc)
    return np.stack(out).reshape(y.shape)


@pytest.mark.parametrize("rows", [1, 2, 5])  # 1, 2 rows gather chosen experts; 5 runs all of them
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_matches_numpy(rows, normalize):
    rng = _rng(3)
    params = _moe_params(rng)
    y = rng.standard_normal((rows, 16)).astype(np.float32)
    got = np.asarray(layers.moe_ffn(params, y, top_k=3, normalize=normalize, implementation="xla"))
    np.testing.assert_allclose(got, _np_moe(params, y, 3, normalize), rtol=1e-4, atol=1e-4)


def test_moe_without_shared_expert():
    rng = _rng(4)
    params = _moe_params(rng, shared=False)
    y = rng.standard_normal((2, 3, 16)).astype(np.float32)
    got = np.asarray(layers.moe_ffn(params, y, top_k=2, normalize=True, implementation="xla"))
    np.testing.assert_allclose(got, _np_moe(params, y, 2, True), rtol=1e-4, atol=1e-4)


def _np_grouped_sigmoid_route(
    logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, normalize
):
    """DeepSeek-V3 / GLM-4.5 ``noaux_tc`` per row, written as loops: sigmoid scores; biased
    scores choose the groups (value: the sum of a group's two best) and the experts; the
    weights are the unbiased scores, renormalised, times ``routed_scaling_factor``."""
    E = logits.shape[-1]
    per = E // n_group
    weights, ids = [], []
    for row in np.asarray(logits, np.float64):
        scores = 1 / (1 + np.exp(-row))
        choice = scores + bias
        value = [np.sort(choice[g * per : (g + 1) * per])[-2:].sum() for g in range(n_group)]
        groups = np.argsort(value, kind="stable")[::-1][:topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        w = scores[chosen]
        if normalize:
            w = w / w.sum()
        weights.append(w * routed_scaling_factor)
        ids.append(chosen)
    return np.array(weights), np.array(ids)


@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_sigmoid_routing_with_correction_bias_matches_numpy(normalize):
    rng = _rng(9)
    E, T = 12, 20
    logits = rng.standard_normal((T, E)).astype(np.float32) * 2
    # A bias large enough to change choices: selection must read it, the weights must not.
    bias = (rng.standard_normal(E) * 0.5).astype(np.float32)
    kw = dict(top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    w, ids = layers.route(
        jnp.asarray(logits),
        normalize=normalize,
        scoring=RouterScoring.SIGMOID,
        correction_bias=jnp.asarray(bias),
        **kw,
    )
    ref_w, ref_ids = _np_grouped_sigmoid_route(logits, bias, normalize=normalize, **kw)
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(ref_ids, axis=1))
    order = np.argsort(ids, axis=1)
    ref_order = np.argsort(ref_ids, axis=1)
    got = np.take_along_axis(np.asarray(w), order, 1)
    np.testing.assert_allclose(got, np.take_along_axis(ref_w, ref_order, 1), rtol=1e-6)
    unbiased, _ = layers.route(
        jnp.asarray(logits), normalize=normalize, scoring=RouterScoring.SIGMOID, **kw
    )
    assert not np.array_equal(np.asarray(unbiased), np.asarray(w))  # the bias changed choices


def test_group_limit_without_bias_ranks_groups_by_their_best_expert():
    logits = np.array([[0.0, 5.0, 1.0, 1.0, 4.5, 4.5]], np.float32)  # groups of 2
    _, ids = layers.route(jnp.asarray(logits), top_k=2, normalize=True, n_group=3, topk_group=1)
    # By its best member, group 0 (expert 1) wins; by the sum of two, group 2 would.
    np.testing.assert_array_equal(np.sort(np.asarray(ids)[0]), [0, 1])
