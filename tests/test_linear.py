"""``linear``: every format against a float64 numpy product, dispatch, errors, trace counts."""

import importlib

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
    RowsRegime,
    WeightFormat,
    dequantize,
    linear,
    linear_reference,
    quantize,
    register_kernel,
    rows_regime,
)

linear_module = importlib.import_module("mtpjax.weights.linear")

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


@pytest.fixture
def empty_kernel_table(monkeypatch):
    """Run with no Pallas kernels registered, whatever other modules registered."""
    monkeypatch.setattr(linear_module, "_KERNELS", {})


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


@pytest.mark.usefixtures("empty_kernel_table")
def test_pallas_without_kernel_raises():
    w = _weight("nvfp4")
    with pytest.raises(NotImplementedError, match=r"nvfp4.*gemv"):
        linear(jnp.ones((1, 48)), w, implementation="pallas")
    # auto falls back to XLA when nothing is registered.
    np.testing.assert_array_equal(
        np.asarray(linear(jnp.ones((1, 48)), w)), np.asarray(linear_reference(jnp.ones((1, 48)), w))
    )


def test_rows_regime_boundaries():
    got = [rows_regime(m) for m in (1, 2, 8, 9, 96, 97, 4096)]
    r = RowsRegime
    assert got == [r.GEMV, r.BATCHED_GEMV, r.BATCHED_GEMV, r.TILE_GEMM, r.TILE_GEMM, r.GEMM, r.GEMM]


@pytest.mark.usefixtures("empty_kernel_table")
def test_registered_kernel_dispatch():
    calls = []

    def fake(x, w, *, out_dtype, interpret):
        calls.append((x.shape, interpret, jnp.dtype(out_dtype)))
        return linear_reference(x, w, out_dtype=out_dtype) + 1.0

    for regime in RowsRegime:
        register_kernel(WeightFormat.FP8, regime, fake)
    with pytest.raises(ValueError, match="already registered"):
        register_kernel("fp8", "gemv", fake)
    register_kernel("fp8", "gemv", fake, replace=True)

    w = _weight("fp8")
    for lead, regime_rows in [((1,), 1), ((5,), 5), ((4, 5), 20), ((200,), 200)]:
        x = _x(lead, w.in_features, jnp.float32)
        y = linear(x, w, implementation="pallas")
        # The kernel sees x flattened to [M, K]; off-GPU it is asked for interpret mode.
        assert calls[-1] == ((regime_rows, w.in_features), True, jnp.dtype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(linear_reference(x, w)) + 1.0)
    # auto stays on XLA off-GPU even with a kernel registered.
    n_calls = len(calls)
    linear(_x((1,), w.in_features, jnp.float32), w)
    assert len(calls) == n_calls
    # Other formats still have no kernel.
    with pytest.raises(NotImplementedError, match="bf16"):
        linear(jnp.ones((1, 45)), _weight("bf16"), implementation="pallas")


@pytest.mark.usefixtures("empty_kernel_table")
def test_kernel_with_wrong_output_is_rejected():
    register_kernel("bf16", "gemv", lambda x, w, *, out_dtype, interpret: x[:, :3])
    with pytest.raises(ValueError, match="returned"):
        linear(jnp.ones((1, 45)), _weight("bf16"), implementation="pallas")


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
