"""Batched argmax + top-1 log-probability kernel (interpret mode)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common as C
from pallas_kernels import argmax as A

IN_KERNEL = A.Merge.IN_KERNEL


def _oracle(x: np.ndarray):
    x = x.astype(np.float64)
    idx = np.argmax(x, axis=1)
    mx = x.max(axis=1)
    lse = mx + np.log(np.exp(x - mx[:, None]).sum(axis=1))
    return idx, mx - lse


def _check(x: np.ndarray, cfg, atol=2e-5):
    idx, lp = A.argmax_logprob(jnp.asarray(x), config=cfg, interpret=True)
    want_idx, want_lp = _oracle(np.asarray(jnp.asarray(x), np.float32))
    assert idx.dtype == jnp.int32 and lp.dtype == jnp.float32 and idx.shape == (x.shape[0],)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=0, atol=atol)
    return np.asarray(idx), np.asarray(lp)


# (m, v, config): chunk = unroll * block_v; full chunks, ragged / whole-load / no tail, one slice
# (tail without a branch) or several (the tail in the last slice), both merges.
CASES = [
    (1, 5003, A.ArgmaxConfig(block_v=256)),  # 4 full chunks of 1024, ragged tail
    (7, 1021, A.ArgmaxConfig(block_v=128, unroll=1, splits=3, merge=A.Merge.XLA)),
    (96, 2000, A.ArgmaxConfig(block_v=64, unroll=3, splits=2)),  # tail of 8 whole loads + 16
    (3, 100, None),  # V < one load: the single partial chunk
    (4, 4096, A.ArgmaxConfig(block_v=128, unroll=4, splits=3, merge=A.Merge.XLA)),  # no tail
    (5, 2560, A.ArgmaxConfig(block_v=128, unroll=4, splits=4)),  # tail of whole loads
    (2, 3000, A.ArgmaxConfig(block_v=64, unroll=2, splits=1)),  # one slice, ragged tail
    (6, 5003, A.ArgmaxConfig(block_v=128, unroll=2, splits=5, merge=IN_KERNEL)),  # S padded to 8
    (1, 777, A.ArgmaxConfig(block_v=64, unroll=2, splits=1, merge=IN_KERNEL)),
    (96, 1500, A.ArgmaxConfig(block_v=32, unroll=8, merge=IN_KERNEL)),  # splits from M
    # Per-element position tracking instead of the re-read.
    (7, 5003, A.ArgmaxConfig(block_v=64, unroll=3, splits=4, reload=False)),
    (5, 5003, A.ArgmaxConfig(block_v=64, unroll=4, splits=3, reload=False, merge=A.Merge.XLA)),
    # The last slice holds only the tail (chunks 0..7 full, 8 partial; 2 per slice).
    (3, 4100, A.ArgmaxConfig(block_v=128, unroll=4, splits=5)),
]


@pytest.mark.parametrize(("m", "v", "cfg"), CASES)
def test_argmax_logprob_matches_oracle(m, v, cfg):
    rng = np.random.default_rng(m + v)
    x = rng.standard_normal((m, v)).astype(np.float32) * 5
    _check(x, cfg)
    ri, rl = A.argmax_logprob_reference(jnp.asarray(x))
    want_idx, want_lp = _oracle(x)
    np.testing.assert_array_equal(np.asarray(ri), want_idx)
    np.testing.assert_allclose(np.asarray(rl), want_lp, atol=2e-5)


TIE_CONFIGS = [
    dict(merge=A.Merge.XLA),
    dict(merge=IN_KERNEL),
    dict(merge=A.Merge.XLA, reload=False),
    dict(merge=IN_KERNEL, reload=False),
]


@pytest.mark.parametrize("kw", TIE_CONFIGS)
def test_ties_resolve_to_lowest_index(kw):
    v = 4096  # block_v 128, unroll 4: chunks of 512, 8 chunks, 4 slices of 2 chunks
    x = np.full((7, v), -3.0, np.float32)
    x[0, [5, 900, 4000]] = 9.0  # different slices
    x[1, [130, 2]] = 9.0  # same lane, different loads of one chunk
    x[2, :] = 1.0  # all equal -> 0
    x[3, [v - 1, v - 2]] = 9.0  # neighbouring lanes
    x[4, [3 + 512, 3 + 128]] = 9.0  # same lane: a later chunk's first load, an earlier's second
    x[5, [1024, 1023]] = 9.0  # either side of the first slice boundary
    x[6, [700, 600, 2000]] = 9.0  # one chunk, different loads and lanes; a later slice
    cfg = A.ArgmaxConfig(block_v=128, unroll=4, splits=4, **kw)
    idx, lp = _check(x, cfg)
    np.testing.assert_array_equal(idx, [5, 2, 0, v - 2, 3 + 128, 1023, 600])
    np.testing.assert_allclose(lp[2], -np.log(v), rtol=1e-6)


@pytest.mark.parametrize("kw", TIE_CONFIGS)
def test_bf16_logits_and_neg_inf_entries(kw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 777)).astype(np.float32) * 3
    x[:, ::3] = -np.inf  # masked vocabulary entries
    x[1, :400] = -np.inf  # whole loads and chunks of -inf before the maximum
    x[2, 300:] = -np.inf  # whole slices of -inf after it
    xb = jnp.asarray(x, jnp.bfloat16)
    cfg = A.ArgmaxConfig(block_v=32, unroll=3, splits=5, **kw)
    _check(np.asarray(xb), cfg)
    _check(np.asarray(xb), dataclasses.replace(cfg, block_v=None, unroll=2, splits=None))


@pytest.mark.parametrize(("m", "dtype"), [(2, jnp.float32), (9, jnp.bfloat16), (64, jnp.float32)])
def test_default_config_path(m, dtype):
    # Large enough for whole default loads (8 warps x 32 lanes x 16 bytes) and several slices;
    # the defaults differ by dtype (re-read or not) and rows (loads per step).
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 40000)) * 4
    x[:, 123] = x[:, 39999] = 30.0  # a tie across slices
    x = np.asarray(jnp.asarray(x, dtype))
    idx, _ = _check(x, None)
    assert (idx == 123).all()


@pytest.mark.parametrize("seed", range(4))
def test_plan_covers_every_logit_once(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        m = int(rng.integers(1, 130))
        v = int(rng.integers(1, 300_000))
        cfg = A.ArgmaxConfig(
            block_v=int(2 ** rng.integers(5, 13)),
            unroll=int(rng.integers(1, 9)),
            splits=None if rng.random() < 0.3 else int(rng.integers(1, 40)),
        )
        p = A._plan(cfg, m, v, 4)
        assert p.chunk == p.bv * p.unroll and C.is_pow2(p.bv)
        assert p.full_chunks * p.chunk + p.tail == v and 0 <= p.tail < p.chunk
        chunks = p.full_chunks + (p.tail > 0)
        # Every chunk lies in exactly one slice; no slice is empty; the tail is in the last one.
        assert (p.splits - 1) * p.cps < chunks <= p.splits * p.cps
        assert p.tail == 0 or p.full_chunks // p.cps == p.splits - 1
        if cfg.splits is not None:
            assert p.splits <= cfg.splits


def test_config_validation():
    with pytest.raises(ValueError):
        A.ArgmaxConfig(block_v=100)
    with pytest.raises(ValueError):
        A.ArgmaxConfig(splits=0)
    with pytest.raises(ValueError):
        A.ArgmaxConfig(unroll=0)
    with pytest.raises(ValueError):
        A.ArgmaxConfig(merge="xla")
    with pytest.raises(ValueError):
        A.argmax_logprob(jnp.zeros((3,)), interpret=True)
