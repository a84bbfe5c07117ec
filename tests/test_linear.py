"""``linear``: every format against a float64 numpy product, dispatch, errors, trace counts."""

import types

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mtpjax.weights import (
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    dequantize,
    linear,
    linear_reference,
    quantize,
)
from pallas_kernels import MOSAIC_GPU, TRITON, linear_backend

F32_U = 2.0**-24  # unit roundoff of F32 accumulation
BF16_U = 2.0**-8  # relative bound of one round-to-nearest into BF16 (8 significant bits)

# (N, K) per format: odd sizes; NVFP4 needs K % 16 == 0; block-128 gets ragged edge tiles.
SHAPES = {"bf16": (37, 45), "fp8": (37, 45), "fp8_block": (130, 200), "nvfp4": (37, 48)}


def _dequant64(w):
    """Float64 dequantisation straight from the leaves (independent of the library)."""
    if isinstance(w, Bf16Weight):
        return np.asarray(w.w).astype(np.float64)
    if isinstance(w, Fp8RowWeight):
        return np.asarray(w.q).astype(np.float64) * np.asarray(w.scale, np.float64)[:, None]
    if isinstance(w, Fp8BlockWeight):
        n, k = w.shape
        s = np.asarray(w.scale_inv, np.float64)
        s = np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]
        return np.asarray(w.q).astype(np.float64) * s
    p = np.asarray(w.packed)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = np.repeat(np.asarray(w.scale).astype(np.float64), 16, axis=-1)
    return values * s * float(w.scale_2)


def _weight(fmt, seed=0):
    n, k = SHAPES[fmt]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quantize(w, fmt)


def _x(lead, k, dtype, seed=1):
    x = np.random.default_rng(seed).standard_normal((*lead, k)).astype(np.float32)
    return jnp.asarray(x, dtype)


def _reference_and_bound(x, w):
    """float64 ``x @ W.T`` and a worst-case bound of F32 accumulation over K (and K-tiles)."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = _dequant64(w)
    k = w.in_features
    # K products + K additions + the scale multiply; block-128 adds one multiply and one add per
    # K-tile when its partial dots are combined.
    steps = k + 2 + (2 * w.scale_inv.shape[-1] if isinstance(w, Fp8BlockWeight) else 0)
    bound = steps * F32_U * (np.abs(x64) @ np.abs(w64).T)
    return x64 @ w64.T, bound


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "nvfp4"])
def test_linear_matches_float64(fmt, x_dtype, lead):
    w = _weight(fmt)
    n, k = SHAPES[fmt]
    x = _x(lead, k, x_dtype)
    y = linear(x, w)
    assert y.shape == (*lead, n) and y.dtype == x_dtype
    ref, acc = _reference_and_bound(x, w)
    out_round = BF16_U * (np.abs(ref) + acc) if x_dtype == jnp.bfloat16 else 0.0
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= acc + out_round)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "nvfp4"])
def test_out_dtype(fmt):
    w = _weight(fmt)
    x = _x((4,), w.in_features, jnp.bfloat16)
    y = linear(x, w, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32
    ref, acc = _reference_and_bound(x, w)
    # F32 out: no BF16 rounding of the result.
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= acc)
    y16 = linear(x.astype(jnp.float32), w, out_dtype=jnp.bfloat16)
    assert y16.dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "nvfp4"])
def test_auto_is_xla_on_cpu_and_matches_reference(fmt):
    w = _weight(fmt)
    x = _x((2, 3), w.in_features, jnp.float32)
    auto = np.asarray(linear(x, w))
    np.testing.assert_array_equal(auto, np.asarray(linear(x, w, implementation="XLA")))
    np.testing.assert_array_equal(auto, np.asarray(linear_reference(x, w)))
    # The dequantise-then-matmul formulation agrees to F32 accumulation accuracy.
    ref, acc = _reference_and_bound(x, w)
    alt = np.asarray(x, np.float64) @ np.asarray(dequantize(w), np.float64).T
    assert np.all(np.abs(alt - ref) <= acc + np.abs(ref) * F32_U)


def test_stacked_experts_via_vmap():
    e, t, n, k = 3, 4, 24, 32
    rng = np.random.default_rng(2)
    w = quantize(rng.standard_normal((e, n, k)).astype(np.float32), "nvfp4")
    x = jnp.asarray(rng.standard_normal((e, t, k)), jnp.float32)
    y = jax.vmap(linear)(x, w)
    assert y.shape == (e, t, n)
    for i in range(e):
        one = jax.tree.map(lambda a, i=i: a[i], w)
        np.testing.assert_allclose(np.asarray(y[i]), np.asarray(linear(x[i], one)), rtol=0, atol=0)


def test_input_errors():
    w = _weight("nvfp4")
    with pytest.raises(ValueError, match=r"\(2, 40\).*\(37, 48\)"):
        linear(jnp.ones((2, 40)), w)
    with pytest.raises(ValueError, match="vmap"):
        linear(jnp.ones((2, 32)), quantize(jnp.ones((3, 8, 32)), "fp8"))
    with pytest.raises(TypeError, match="weight pytree"):
        linear(jnp.ones((2, 48)), jnp.ones((37, 48)))
    with pytest.raises(TypeError, match="floating"):
        linear(jnp.ones((2, 48), jnp.int32), w)
    with pytest.raises(ValueError, match="auto, xla, pallas"):
        linear(jnp.ones((2, 48)), w, implementation="cuda")


def _gpu(cc: str):
    """A stand-in CUDA device of compute capability ``cc``."""
    return types.SimpleNamespace(platform="gpu", compute_capability=cc)


def test_mosaic_needs_sm90_and_auto_falls_back_to_the_reference(monkeypatch):
    w = quantize(np.ones((64, 256), np.float32), "nvfp4")
    assert not MOSAIC_GPU.supported_on(_gpu("8.0"))
    assert MOSAIC_GPU.supported_on(_gpu("9.0"))
    assert not MOSAIC_GPU.supported_on(_gpu("10.0"))
    assert not MOSAIC_GPU.supported_on(types.SimpleNamespace(platform="cpu"))
    assert not TRITON.supported_on(_gpu("8.0")) and TRITON.supported_on(_gpu("9.0"))
    assert linear_backend(4, w, "auto", device=_gpu("9.0")) is MOSAIC_GPU
    assert linear_backend(4, w, "auto", device=_gpu("8.0")) is None
    with pytest.raises(NotImplementedError, match=r"mosaic_gpu.*triton"):
        linear_backend(4, w, "pallas", device=_gpu("8.0"))
    # linear itself on the sm_80 stand-in: AUTO runs the reference.
    import pallas_kernels._common as common

    monkeypatch.setattr(common, "default_device", lambda: _gpu("8.0"))
    x = jnp.ones((4, 256), jnp.float32)
    np.testing.assert_array_equal(np.asarray(linear(x, w)), np.asarray(linear_reference(x, w)))


def test_dispatch_keeps_the_measured_backend_per_shape():
    """Mosaic for aligned quantised weights at every row count; Triton for the rest."""
    h100 = _gpu("9.0")
    for fmt in ("nvfp4", "fp8", "fp8_block"):
        w = quantize(np.ones((200, 256), np.float32), fmt)
        for rows in (1, 9, 96, 500):
            assert linear_backend(rows, w, device=h100) is MOSAIC_GPU
        odd = quantize(np.ones((203, 384 if fmt != "nvfp4" else 400), np.float32), fmt)
        assert linear_backend(5, odd, device=h100) is TRITON
        assert "N % 8" in MOSAIC_GPU.supports(5, odd)
    bf16 = quantize(np.ones((200, 256), np.float32), "bf16")
    assert linear_backend(3, bf16, device=h100) is TRITON
    assert linear_backend(3, bf16, "xla", device=h100) is None
    # Off a GPU AUTO is the reference and PALLAS the interpret-mode backend.
    assert linear_backend(3, bf16) is None or jax.default_backend() == "gpu"
    # TRITON / MOSAIC_GPU force one backend.
    nvfp4 = quantize(np.ones((200, 256), np.float32), "nvfp4")
    assert linear_backend(3, nvfp4, "triton", device=h100) is TRITON
    assert linear_backend(3, nvfp4, "MOSAIC_GPU", device=h100) is MOSAIC_GPU
    with pytest.raises(NotImplementedError, match="no Mosaic GEMV for bf16"):
        linear_backend(3, bf16, "mosaic_gpu", device=h100)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "nvfp4"])
def test_traces_once_for_new_values(fmt):
    chex.clear_trace_counter()  # the counter is keyed by the function's code, shared by params

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(x, w):
        return linear(x, w)

    for seed in range(3):
        w = _weight(fmt, seed=seed)
        step(_x((2,), w.in_features, jnp.bfloat16, seed=seed), w)
