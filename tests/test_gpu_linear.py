"""`linear` and the LM head as ``benchmarks.linear`` times them, checked: every format and row
count against an F32 dot of the dequantised weight, and a row's logits the same bits at every row
count. Each body runs on small shapes on the CPU (the Pallas kernels in interpret mode) and, marked
``gpu``, at the real shapes on the GPU (``pytest -m gpu``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.config import LMHeadConfig
from mtpjax.head import init_lm_head, lm_head

FORMATS = ("bf16", "fp8", "fp8_block", "nvfp4")
ON_GPU = jax.default_backend() == "gpu"
GPU = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]

#: (N, K, rows): the benchmark's shapes (LM head, MoE head, drafter projections) on the GPU.
LINEAR_CASES = [
    pytest.param(256, 256, (1, 3, 12), id="small"),
    pytest.param(248320, 5120, (1, 2, 4, 8, 32, 96), id="gpu-lm_head", marks=GPU),
    pytest.param(151936, 2048, (1, 8, 96), id="gpu-moe_lm_head", marks=GPU),
    pytest.param(12288, 5120, (1, 8), id="gpu-qkv", marks=GPU),
    pytest.param(17408, 5120, (1, 8), id="gpu-up", marks=GPU),
    pytest.param(5120, 17408, (1, 8), id="gpu-down", marks=GPU),
    pytest.param(512, 2048, (1, 8), id="gpu-moe_expert", marks=GPU),
]
#: (N, K, rows): rows 0..3 of the last (largest) call against every smaller one.
HEAD_CASES = [
    pytest.param(1024, 512, (1, 3, 12), id="small"),
    pytest.param(248320, 5120, (1, 4, 32, 96, 256), id="gpu-lm_head", marks=GPU),
]
#: Relative (Frobenius) error against the F32 oracle: F32 accumulation in every kernel.
TOL = 1e-4


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k", "rows"), LINEAR_CASES)
def test_linear_matches_the_f32_dequantised_dot(fmt, n, k, rows):
    kw, kx = jax.random.split(jax.random.key(n + k))
    w = mtpjax.quantize(jax.random.normal(kw, (n, k), jnp.bfloat16) * 0.02, fmt)
    wf = mtpjax.dequantize(w).astype(jnp.float32)
    for m in rows:
        x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
        got = mtpjax.linear(x, w, out_dtype=jnp.float32, implementation="pallas")
        want = jnp.dot(x.astype(jnp.float32), wf.T, precision="highest")
        assert got.shape == (m, n) and got.dtype == jnp.float32
        err = _rel_err(got, want)
        assert err < TOL, f"{fmt} [{n}, {k}] at {m} rows: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k", "rows"), HEAD_CASES)
def test_lm_head_scores_a_row_alike_at_every_row_count(fmt, n, k, rows):
    """Decode, a verify window and a batch must score a row to the same bits, or greedy
    speculative decoding stops reproducing the target alone."""
    cfg = LMHeadConfig(vocab_size=n, hidden_size=k)
    params = init_lm_head(cfg, key=jax.random.key(0), precision=fmt)
    head = jax.jit(lambda p, h: lm_head(p, h, cfg=cfg))
    hidden = jax.random.normal(jax.random.key(1), (max(rows), k), jnp.bfloat16)
    full = np.asarray(head(params, hidden))
    for m in rows[:-1]:
        part = np.asarray(head(params, hidden[:m]))
        r = min(m, 4)
        diff = float(np.abs(part[:r] - full[:r]).max())
        assert np.array_equal(part[:r], full[:r]), f"{fmt} {m} rows vs {max(rows)}: {diff:.3g}"
