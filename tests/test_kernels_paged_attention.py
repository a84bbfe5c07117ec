"""Paged decode attention against the reference and a dense float64 oracle: the Triton kernel in
interpret mode on the CPU, compiled on a GPU (same test bodies)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from mtpjax.layers.attention import attend
from pallas_kernels._paged_attention import triton as P

INTERPRET = jax.default_backend() != "gpu"


def _inputs(rng, b, n_q, n_kv, d, bs, max_blocks, kv):
    nb = b * max_blocks + 3
    q = rng.standard_normal((b, n_q, d)).astype(np.float32)
    k = rng.standard_normal((nb, bs, n_kv, d)).astype(np.float32) * 2
    v = rng.standard_normal((nb, bs, n_kv, d)).astype(np.float32) * 2
    bt = rng.permutation(nb)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    kw = {}
    if kv == "bf16":
        k, v = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    else:
        k, v = k.astype(ml_dtypes.float8_e4m3fn), v.astype(ml_dtypes.float8_e4m3fn)
        if kv in ("fp8_block", "fp8_row"):
            shape = (nb, n_kv) if kv == "fp8_block" else (nb, bs, n_kv)
            kw = dict(
                k_scale=jnp.asarray(rng.uniform(0.2, 2.0, shape), jnp.float32),
                v_scale=jnp.asarray(rng.uniform(0.2, 2.0, shape), jnp.float32),
            )
        else:
            kw = dict(k_scale=jnp.float32(0.6), v_scale=jnp.float32(1.7))
    return jnp.asarray(q, jnp.bfloat16), jnp.asarray(k), jnp.asarray(v), jnp.asarray(bt), kw


def _dense_oracle(q, k, v, bt, lengths, scale, kw):
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    nb, bs, n_kv, d = k.shape
    if kw:

        def per_row(sc):  # scalar, [nb, n_kv] or [nb, bs, n_kv] -> [nb, bs, n_kv, 1]
            sc = np.asarray(sc, np.float64)
            sc = sc if sc.ndim == 3 else np.broadcast_to(sc, (nb, n_kv))[:, None, :]
            return np.broadcast_to(sc, (nb, bs, n_kv))[..., None]

        k = k * per_row(kw["k_scale"])
        v = v * per_row(kw["v_scale"])
    b, n_q, _ = q.shape
    g = n_q // n_kv
    out = np.zeros((b, n_q, d))
    for s in range(b):
        length = int(lengths[s])
        if length == 0:
            continue
        rows = [(int(bt[s, t // bs]), t % bs) for t in range(length)]
        ks_ = np.stack([k[p, r] for p, r in rows])  # [T, n_kv, D]
        vs_ = np.stack([v[p, r] for p, r in rows])
        for h in range(n_q):
            logits = ks_[:, h // g] @ q[s, h] * scale
            p = np.exp(logits - logits.max())
            out[s, h] = (p / p.sum()) @ vs_[:, h // g]
    return out


@pytest.mark.parametrize(
    ("kv", "n_q", "n_kv", "cfg"),
    [
        ("bf16", 8, 2, pk.PagedAttentionConfig(pages_per_step=2, splits=3)),
        ("fp8_block", 4, 4, pk.PagedAttentionConfig(pages_per_step=4, splits=1)),
        ("fp8_tensor", 16, 2, None),
        ("fp8_row", 8, 2, pk.PagedAttentionConfig(pages_per_step=2, splits=2)),
    ],
)
def test_paged_attention_matches_oracle(kv, n_q, n_kv, cfg):
    rng = np.random.default_rng(n_q + n_kv)
    b, d, bs, max_blocks = 4, 32, 16, 6
    q, k, v, bt, kw = _inputs(rng, b, n_q, n_kv, d, bs, max_blocks, kv)
    # Full, block-boundary, partial and empty sequences.
    lengths = jnp.asarray([max_blocks * bs, 2 * bs, 37, 0], jnp.int32)
    scale = d**-0.5
    out = P.paged_attention(
        q, k, v, bt, lengths, scale=scale, config=cfg, interpret=INTERPRET, **kw
    )
    ref = pk.paged_attention_reference(q, k, v, bt, lengths, scale=scale, **kw)
    oracle = _dense_oracle(q, k, v, np.asarray(bt), np.asarray(lengths), scale, kw)
    assert out.shape == (b, n_q, d) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ref), oracle, atol=1e-5, rtol=1e-5)
    # Probabilities meet V in 16-bit floats on the tensor cores: bf16-level tolerance.
    np.testing.assert_allclose(np.asarray(out), oracle, atol=3e-2, rtol=0)
    assert np.linalg.norm(np.asarray(out) - oracle) / np.linalg.norm(oracle) < 5e-3
    np.testing.assert_array_equal(np.asarray(out[3]), 0.0)


def test_out_dtype_and_unused_table_entries():
    rng = np.random.default_rng(2)
    q, k, v, bt, _ = _inputs(rng, 2, 4, 2, 16, 8, 5, "bf16")
    bt = bt.at[:, 3:].set(-1)  # entries past the length are never read
    lengths = jnp.asarray([20, 24], jnp.int32)
    out = P.paged_attention(
        q, k, v, bt, lengths, scale=0.25, out_dtype=jnp.bfloat16, interpret=INTERPRET
    )
    assert out.dtype == jnp.bfloat16
    oracle = _dense_oracle(q, k, v, np.asarray(bt), np.asarray(lengths), 0.25, {})
    np.testing.assert_allclose(np.asarray(out, np.float32), oracle, atol=5e-2)


def test_rejects_bad_inputs():
    rng = np.random.default_rng(3)
    q, k, v, bt, _ = _inputs(rng, 2, 4, 2, 16, 8, 3, "fp8_tensor")
    lengths = jnp.asarray([5, 5], jnp.int32)
    with pytest.raises(ValueError, match="FP8"):
        P.paged_attention(q, k, v, bt, lengths, scale=1.0, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_size"):  # per-row scales of the wrong shape
        bad = jnp.ones((k.shape[0], 4, 2), jnp.float32)
        P.paged_attention(
            q, k, v, bt, lengths, scale=1.0, k_scale=bad, v_scale=bad, interpret=INTERPRET
        )
    q3, k3, v3, bt3, _ = _inputs(rng, 2, 6, 4, 16, 8, 3, "bf16")
    with pytest.raises(ValueError, match="multiple"):
        P.paged_attention(q3, k3, v3, bt3, lengths, scale=1.0, interpret=INTERPRET)


def test_reference_is_attend_on_the_gathered_context():
    """The drafter's XLA path: the reference equals ``attend`` over the gathered rows bit for bit."""
    rng = np.random.default_rng(4)
    b, n_q, n_kv, d, bs, max_blocks = 3, 8, 2, 32, 8, 4
    for kv in ("bf16", "fp8_row"):
        q, k, v, bt, kw = _inputs(rng, b, n_q, n_kv, d, bs, max_blocks, kv)
        lengths = jnp.asarray([max_blocks * bs, 13, 0], jnp.int32)
        bt = jnp.where(jnp.arange(max_blocks)[None] * bs < lengths[:, None], bt, -1)
        out = pk.paged_attention_reference(q, k, v, bt, lengths, scale=d**-0.5, **kw)
        blk = jnp.maximum(bt, 0)
        kf, vf = k[blk].astype(jnp.float32), v[blk].astype(jnp.float32)
        if kw:
            kf = kf * kw["k_scale"][blk][..., None]
            vf = vf * kw["v_scale"][blk][..., None]
        kf, vf = (a.reshape(b, max_blocks * bs, n_kv, d) for a in (kf, vf))
        valid = jnp.arange(max_blocks * bs)[None] < lengths[:, None]
        want = attend(q[:, None], kf, vf, valid[:, None, :])[:, 0]
        assert out.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_dispatch():
    rng = np.random.default_rng(5)
    q, k, v, bt, _ = _inputs(rng, 2, 4, 2, 16, 8, 3, "bf16")
    lengths = jnp.asarray([20, 9], jnp.int32)
    ref = pk.paged_attention_reference(q, k, v, bt, lengths, scale=0.25)
    xla = pk.paged_attention(q, k, v, bt, lengths, scale=0.25, implementation="XLA")
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(ref))
    auto = pk.paged_attention(q, k, v, bt, lengths, scale=0.25)
    if INTERPRET:  # no GPU: AUTO is the reference
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))
    kernel = P.paged_attention(q, k, v, bt, lengths, scale=0.25, interpret=INTERPRET)
    for impl in ("pallas", "triton"):
        forced = pk.paged_attention(q, k, v, bt, lengths, scale=0.25, implementation=impl)
        np.testing.assert_array_equal(np.asarray(forced), np.asarray(kernel))
    with pytest.raises(NotImplementedError, match="no Mosaic GPU backend"):
        pk.paged_attention(q, k, v, bt, lengths, scale=0.25, implementation="mosaic_gpu")
    q12, k12, v12, bt12, _ = _inputs(rng, 2, 4, 2, 12, 8, 3, "bf16")
    with pytest.raises(NotImplementedError, match="head_dim >= 16"):
        pk.paged_attention(q12, k12, v12, bt12, lengths, scale=0.25, implementation="pallas")
    auto12 = pk.paged_attention(q12, k12, v12, bt12, lengths, scale=0.25)  # the reference
    want12 = pk.paged_attention_reference(q12, k12, v12, bt12, lengths, scale=0.25)
    np.testing.assert_array_equal(np.asarray(auto12), np.asarray(want12))
    with pytest.raises(ValueError, match="seq_len"):
        pk.paged_attention(q, k, v, bt, lengths[:1], scale=0.25)
