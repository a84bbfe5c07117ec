"""Batched argmax + top-1 log-probability kernel (interpret mode)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import argmax as A


def _oracle(x: np.ndarray):
    x = x.astype(np.float64)
    idx = np.argmax(x, axis=1)
    mx = x.max(axis=1)
    lse = mx + np.log(np.exp(x - mx[:, None]).sum(axis=1))
    return idx, mx - lse


@pytest.mark.parametrize(
    ("m", "v", "cfg"),
    [
        (1, 5003, A.ArgmaxConfig(block_v=256)),
        (7, 1021, A.ArgmaxConfig(block_v=128, splits=3)),
        (96, 2000, A.ArgmaxConfig(block_v=512, splits=2, prefetch=False)),
        (3, 100, None),
    ],
)
def test_argmax_logprob_matches_oracle(m, v, cfg):
    rng = np.random.default_rng(m + v)
    x = rng.standard_normal((m, v)).astype(np.float32) * 5
    idx, lp = A.argmax_logprob(jnp.asarray(x), config=cfg, interpret=True)
    want_idx, want_lp = _oracle(x)
    assert idx.dtype == jnp.int32 and lp.dtype == jnp.float32 and idx.shape == (m,)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=0, atol=2e-5)
    ri, rl = A.argmax_logprob_reference(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(ri), want_idx)
    np.testing.assert_allclose(np.asarray(rl), want_lp, atol=2e-5)


def test_ties_resolve_to_lowest_index_across_splits_and_lanes():
    v = 4096
    x = np.full((4, v), -3.0, np.float32)
    x[0, [5, 900, 4000]] = 9.0  # different splits
    x[1, [130, 2]] = 9.0  # same lane position in different steps
    x[2, :] = 1.0  # all equal -> 0
    x[3, [v - 1, v - 2]] = 9.0
    idx, lp = A.argmax_logprob(
        jnp.asarray(x), config=A.ArgmaxConfig(block_v=128, splits=4), interpret=True
    )
    np.testing.assert_array_equal(np.asarray(idx), [5, 2, 0, v - 2])
    np.testing.assert_array_equal(np.asarray(idx), np.argmax(x, axis=1))
    np.testing.assert_allclose(np.asarray(lp)[2], -np.log(v), rtol=1e-6)


def test_bf16_logits_and_neg_inf_entries():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 777)).astype(np.float32) * 3
    x[:, ::3] = -np.inf  # masked vocabulary entries
    xb = jnp.asarray(x, jnp.bfloat16)
    idx, lp = A.argmax_logprob(xb, config=A.ArgmaxConfig(block_v=64, splits=5), interpret=True)
    want_idx, want_lp = _oracle(np.asarray(xb, np.float32))
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(lp), want_lp, atol=2e-5)


def test_config_validation():
    with pytest.raises(ValueError):
        A.ArgmaxConfig(block_v=100)
    with pytest.raises(ValueError):
        A.ArgmaxConfig(splits=0)
    with pytest.raises(ValueError):
        A.argmax_logprob(jnp.zeros((3,)), interpret=True)
