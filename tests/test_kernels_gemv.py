"""Triton GEMV / batched-GEMV kernels against ``linear``'s reference and a float64 oracle
(interpret mode on the CPU, compiled on a GPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import E2M1, INTERPRET, leaves, numpy_dequant, rel_err, run_ptx, weight

from pallas_kernels import _common as C
from pallas_kernels import linear_reference
from pallas_kernels._linear import triton as G


def _kern(fmt, x, *lv, **kw):
    return G.gemv(x, weight(fmt, *lv), interpret=INTERPRET, **kw)


def _ref(fmt, x, *lv):
    """The F32 reference (x widened to F32, HIGHEST precision)."""
    return linear_reference(x.astype(jnp.float32), weight(fmt, *lv))


FORMATS = ("bf16", "fp8_row", "fp8_block", "nvfp4")


def _small_cfg(fmt: str, compute: str, **kw) -> G.GemvConfig:
    base = dict(
        block_n=32 if compute == "fma" else 64,
        block_k=128 if fmt == "fp8_block" else 64,
        compute=compute,
        decode="arith",
    )
    base.update(kw)
    return G.GemvConfig(**base)


@pytest.mark.parametrize("compute", ["fma", "dot"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_one_row_odd_n_k_tail(fmt, compute):
    """M=1, odd N (1021, row tail), K with a tail (272 = 4*64 + 16), split-K over 3 slices."""
    rng = np.random.default_rng(hash((fmt, compute)) % 2**32)
    n, k = 1021, 272
    lv = leaves(fmt, n, k, rng)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    out = _kern(fmt, x, *lv, config=_small_cfg(fmt, compute, split_k=3))
    want = _ref(fmt, x, *lv)
    oracle = np.asarray(x, np.float64) @ numpy_dequant(fmt, *lv).T
    assert out.shape == (1, n) and out.dtype == jnp.float32
    assert rel_err(out, want) < 2e-6
    assert rel_err(want, oracle) < 2e-6


@pytest.mark.parametrize(
    ("fmt", "m", "compute"),
    [
        ("nvfp4", 2, "fma"),
        ("nvfp4", 5, "dot"),
        ("nvfp4", 8, "dot"),
        ("nvfp4", 16, "dot"),
        ("nvfp4", 32, "dot"),
        ("fp8_row", 3, "fma"),
        ("fp8_row", 8, "dot"),
        ("fp8_block", 7, "dot"),
        ("bf16", 6, "dot"),
        ("bf16", 32, "fma"),
        # BF16 and FP8 per-row take up to 128 rows a pass on the tensor cores.
        ("bf16", 100, "dot"),
        ("fp8_row", 64, "dot"),
    ],
)
def test_batched_gemv_rows(fmt, m, compute):
    """Rows 2..8, 16, 32 (BF16 and FP8 per-row: up to 128) stream the weight once; every row
    matches the reference."""
    rng = np.random.default_rng(m * 7 + len(fmt))
    n, k = 96, 256
    lv = leaves(fmt, n, k, rng)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    out = _kern(fmt, x, *lv, config=_small_cfg(fmt, compute, block_k=128))
    assert out.shape == (m, n)
    assert rel_err(out, _ref(fmt, x, *lv)) < 2e-6
    # Each row on its own gives the same numbers as in the batch.
    single = _kern(fmt, x[m - 1 :], *lv, config=_small_cfg(fmt, "fma", block_k=128))
    assert rel_err(out[m - 1 :], single) < 2e-6


def test_bf16_rows_reach_the_kernel_unpadded():
    """BF16 activations go to the tensor-core kernel as they are, the rows past M masked in the
    kernel: no pad op (one more kernel launch per GEMV on the GPU) runs outside it, and the
    masked rows change no result (the batched test above checks the values)."""
    rng = np.random.default_rng(8)
    lv = leaves("bf16", 96, 256, rng)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    cfg = _small_cfg("bf16", "dot")
    jaxpr = jax.make_jaxpr(lambda x: _kern("bf16", x, *lv, config=cfg))(x)

    def outside_kernels(jx):
        for eqn in jx.eqns:
            yield eqn
            if eqn.primitive.name != "pallas_call":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    yield from outside_kernels(sub)

    eqns = list(outside_kernels(jaxpr.jaxpr))
    assert not [e for e in eqns if e.primitive.name == "pad"]
    (call,) = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert call.invars[0].aval.shape == (3, 256)


def test_dot_path_handles_large_activations():
    """The float16 row scaling keeps activations far outside float16 range exact."""
    rng = np.random.default_rng(3)
    lv = leaves("nvfp4", 64, 128, rng)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    x = (x * jnp.asarray([[1e6], [1e-6], [1.0]])).astype(jnp.bfloat16)
    out = _kern("nvfp4", x, *lv, config=_small_cfg("nvfp4", "dot"))
    want = _ref("nvfp4", x, *lv)
    for r in range(3):
        assert rel_err(out[r], want[r]) < 2e-6


def test_no_prefetch_matches():
    rng = np.random.default_rng(5)
    lv = leaves("fp8_row", 100, 320, rng)
    x = jnp.asarray(rng.standard_normal((2, 320)), jnp.bfloat16)
    a = _kern("fp8_row", x, *lv, config=_small_cfg("fp8_row", "fma", prefetch=False))
    b = _kern("fp8_row", x, *lv, config=_small_cfg("fp8_row", "fma"))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_default_config_runs():
    rng = np.random.default_rng(6)
    lv = leaves("nvfp4", 128, 256, rng)
    x = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
    cfg = G.default_config("nvfp4", 1, 128, 256)
    assert cfg.split_k >= 1 and C.is_pow2(cfg.block_n)
    out = _kern("nvfp4", x, *lv)
    assert rel_err(out, _ref("nvfp4", x, *lv)) < 2e-6


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_n=48),
        dict(block_k=32),
        dict(compute="mma"),
        dict(decode="lut"),
        dict(split_k=0),
    ],
)
def test_config_validation(kw):
    with pytest.raises(ValueError):
        G.GemvConfig(**kw)


def test_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    lv = leaves("bf16", 32, 64, rng)
    with pytest.raises(ValueError, match=r"bf16 GEMV kernels take 1\.\.128 rows, got 129"):
        _kern("bf16", jnp.zeros((129, 64), jnp.bfloat16), *lv)
    with pytest.raises(ValueError, match=r"compute='fma' takes 1\.\.32 rows, got 33"):
        _kern("bf16", jnp.zeros((33, 64), jnp.bfloat16), *lv, config=G.GemvConfig(compute="fma"))
    nv = leaves("nvfp4", 32, 64, rng)
    with pytest.raises(ValueError, match=r"nvfp4 GEMV kernels take 1\.\.32 rows, got 33"):
        _kern("nvfp4", jnp.zeros((33, 64), jnp.bfloat16), *nv)
    with pytest.raises(ValueError, match="x must be"):
        _kern("bf16", jnp.zeros((1, 65), jnp.bfloat16), *lv)
    q, s = leaves("fp8_block", 200, 256, rng)
    with pytest.raises(ValueError, match="block_n"):
        cfg = G.GemvConfig(block_n=256, block_k=128)
        _kern("fp8_block", jnp.zeros((1, 256), jnp.bfloat16), q, s, config=cfg)


# ---------------------------------------------------------------------------------------------
# The nibble decoders.
# ---------------------------------------------------------------------------------------------


def test_arith_decoder_all_bytes():
    """Every byte, both nibbles, times a range of scales (E4M3 subnormals included) is exact."""
    codes = jnp.arange(256, dtype=jnp.uint8)[:, None].repeat(8, 1)
    scales = np.array([2.0**-9, 2.0**-7, 0.375, 1.0, 3.5, 96.0, 240.0, 448.0])
    s16 = jnp.asarray(np.broadcast_to(scales, (256, 8)), jnp.float16)
    lo, hi = C.decode_e2m1_scaled(codes, s16, use_asm=False)
    b = np.arange(256)
    want_lo = E2M1[b & 0xF][:, None] * scales * C.E2M1_F16_BIAS
    want_hi = E2M1[b >> 4][:, None] * scales * C.E2M1_F16_BIAS
    np.testing.assert_array_equal(np.asarray(lo, np.float64), want_lo)
    np.testing.assert_array_equal(np.asarray(hi, np.float64), want_hi)


@pytest.mark.parametrize("high", [False, True])
def test_inline_asm_decoder_bit_exact(high):
    """Interpret the PTX of the GPU decoder and compare it with the oracle on random words."""
    rng = np.random.default_rng(int(high))
    asm = C._e2m1_asm(high)
    for _ in range(300):
        b = rng.integers(0, 256, 4)
        s = np.asarray(rng.choice([2.0**-9, 0.5, 1.0, 6.0, 448.0], 4), np.float16)
        s_bits = s.view(np.uint16).astype(np.int64)
        word = int(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24))
        regs = run_ptx(
            asm,
            {
                "$2": word,
                "$3": int(s_bits[0] | (s_bits[1] << 16)),
                "$4": int(s_bits[2] | (s_bits[3] << 16)),
            },
        )
        halves = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        got = np.array(halves, np.uint16).view(np.float16).astype(np.float64)
        nib = (b >> 4) if high else (b & 0xF)
        want = E2M1[nib] * s.astype(np.float64) * C.E2M1_F16_BIAS
        np.testing.assert_array_equal(got, want)


def test_references_agree_with_float64_oracle():
    rng = np.random.default_rng(11)
    for fmt in FORMATS:
        lv = leaves(fmt, 130, 272 if fmt != "fp8_block" else 300, rng)
        x = jnp.asarray(rng.standard_normal((4, lv[0].shape[1] * (2 if fmt == "nvfp4" else 1))))
        x = x.astype(jnp.bfloat16)
        want = np.asarray(x, np.float64) @ numpy_dequant(fmt, *lv).T
        assert rel_err(_ref(fmt, x, *lv), want) < 1e-6, fmt


def test_to_f16_rowscaled_is_exact_for_bf16():
    x = jnp.asarray([[3e4, -1.5, 2.0**-20], [1e-3, 7.0, -2.5e-2]], jnp.float32).astype(jnp.bfloat16)
    x16, inv = C.to_f16_rowscaled(x, 16)
    assert x16.shape == (16, 3) and x16.dtype == jnp.float16
    back = np.asarray(x16[:2], np.float64) * np.asarray(inv, np.float64)[:, None]
    np.testing.assert_array_equal(back, np.asarray(x, np.float64))


def test_config_is_hashable_static():
    cfg = G.GemvConfig()
    assert hash(cfg) == hash(dataclasses.replace(cfg))
