"""Mosaic GPU NVFP4, FP8 per-row and FP8 block-128 GEMVs (1 to 128 rows): interpret mode against
the references and a float64 oracle, the register-level decode plans simulated thread by thread,
and the CUDA lowering (with its shared-memory count) built on the CPU."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_helpers import E2M1, INTERPRET, leaves, numpy_dequant, rel_err, weight

from pallas_kernels import _common as C
from pallas_kernels import linear_reference
from pallas_kernels._linear import mosaic_gpu as GM


def _ref(fmt, x, *lv):
    """The F32 reference (x widened to F32, HIGHEST precision)."""
    return linear_reference(x.astype(jnp.float32), weight(fmt, *lv))


def _pad(a, rows, cols=None):
    """Zero-pads a weight leaf to ``rows`` (and ``cols``) for the kernel's TMA granularity."""
    widths = [(0, rows - a.shape[0])]
    if a.ndim == 2:
        widths.append((0, (cols or a.shape[1]) - a.shape[1]))
    return jnp.pad(a, widths)


def _prepare_nvfp4(packed, scale):
    """N padded to a multiple of 8, K of 256, with zero codes and scales."""
    n, kh = packed.shape
    np_, kp = C.round_up(n, 8), C.round_up(kh * 2, 256)
    return _pad(packed, np_, kp // 2), _pad(scale, np_, kp // 16)


def _prepare_fp8_row(q, scale):
    n, k = q.shape
    np_ = C.round_up(n, 8)
    return _pad(q, np_, C.round_up(k, 128)), _pad(scale.astype(jnp.float32), np_)


def _prepare_fp8_block(q, scale_inv):
    n, k = q.shape
    return _pad(q, C.round_up(n, 8), C.round_up(k, 128)), scale_inv


def _sliced(kernel):
    """``kernel`` with its output cut to the weight's first ``n`` rows (padded weights)."""

    def call(x, *w, n=None, interpret=INTERPRET, **kw):
        out = kernel(x, *w, interpret=interpret, **kw)
        return out if n is None else out[:, :n]

    return call


_nvfp4 = _sliced(GM.nvfp4_gemv_mosaic)
_fp8_row = _sliced(GM.fp8_row_gemv_mosaic)
_fp8_block = _sliced(GM.fp8_block_gemv_mosaic)


def _run(m, n, k, cfg, *, seed=0):
    rng = np.random.default_rng(seed)
    lv = leaves("nvfp4", n, k, rng)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    packed, scale = _prepare_nvfp4(lv[0], lv[1])
    return x, lv, _nvfp4(x, packed, scale, lv[2], n=n, config=cfg)


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        # M=1, odd N (1021: row tail inside a tile and N padded to 1024), K=272 padded to 512.
        (1, 1021, 272, GM.MosaicGemvConfig(block_n=64, block_k=256, stages=2)),
        # M=3, two 64-row M groups per warpgroup, K tail inside the last step (768 = 512 + 256).
        (3, 200, 768, GM.MosaicGemvConfig(block_n=128, block_k=512, stages=3)),
        # M=8 (one full N=8 MMA), N below one tile.
        (8, 40, 512, GM.MosaicGemvConfig(block_n=64, block_k=256, stages=4)),
        # M=13 pads to N=16; 256 rows per CTA.
        (13, 264, 256, GM.MosaicGemvConfig(block_n=256, block_k=256, stages=2)),
        # N and K padded (200 -> 208 rows, 1008 -> 1024).
        (2, 200, 1008, GM.MosaicGemvConfig(block_n=64, block_k=512, stages=2)),
        (5, 130, 512, GM.MosaicGemvConfig(block_n=128, block_k=256, stages=3)),
    ],
)
def test_matches_reference(m, n, k, cfg):
    x, lv, out = _run(m, n, k, cfg, seed=m * 1000 + n)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, _ref("nvfp4", x, *lv)) < 2e-6
    oracle = np.asarray(x, np.float64) @ numpy_dequant("nvfp4", *lv).T
    assert rel_err(out, oracle) < 2e-6


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_rows_are_independent_and_scaled_per_row(fmt):
    """Rows of very different magnitude (float16 row scaling) each match the reference."""
    rng = np.random.default_rng(7)
    lv = leaves(fmt, 64, 256, rng)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    x = (x * jnp.asarray([[1e6], [1e-6], [1.0]])).astype(jnp.bfloat16)
    kernel = GM.nvfp4_gemv_mosaic if fmt == "nvfp4" else GM.fp8_row_gemv_mosaic
    cfg = GM.MosaicGemvConfig(block_n=64, block_k=256, stages=2)
    out = kernel(x, *lv, config=cfg, interpret=INTERPRET)
    want = _ref(fmt, x, *lv)
    for r in range(3):
        assert rel_err(out[r], want[r]) < 2e-6
    single = kernel(x[2:], *lv, config=cfg, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(single), np.asarray(out[2:]))


def test_default_config_runs():
    x, lv, out = _run(2, 256, 512, None, seed=3)
    assert rel_err(out, _ref("nvfp4", x, *lv)) < 2e-6


# ---------------------------------------------------------------------------------------------
# More rows (up to MAX_ROWS = 128), and the FP8 per-row kernel.
# ---------------------------------------------------------------------------------------------

_CFG = GM.MosaicGemvConfig


def _assert_matches(fmt, x, lv, out):
    """``out`` against the format's reference and a float64 oracle, and row by row (no row
    mixing or reordering)."""
    m, n = x.shape[0], lv[0].shape[0]
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, _ref(fmt, x, *lv)) < 2e-6
    oracle = np.asarray(x, np.float64) @ numpy_dequant(fmt, *lv).T
    assert rel_err(out, oracle) < 2e-6
    row_err = np.linalg.norm(np.asarray(out, np.float64) - oracle, axis=1)
    assert np.all(row_err <= 1e-5 * np.linalg.norm(oracle, axis=1))


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        # M=9 pads to N=16; one 128-row CTA wider than the weight (72 rows).
        (9, 72, 256, _CFG(block_n=128, block_k=256, stages=2)),
        # M=33 (pads to 40), odd N (130 -> 136), default config (128 x 256), K tail in a step.
        (33, 130, 768, None),
        # M=96, two 64-row M groups per warpgroup.
        (96, 128, 512, _CFG(block_n=128, block_k=256, stages=3)),
        # M=128 (the MMA's N = 128), default config (64 x 256).
        (128, 64, 512, None),
    ],
)
def test_nvfp4_more_rows_match_reference(m, n, k, cfg):
    x, lv, out = _run(m, n, k, cfg, seed=m)
    _assert_matches("nvfp4", x, lv, out)


def test_default_configs_keep_the_measured_small_m_tiles():
    for m in range(1, 9):
        assert GM.default_config(m, 248320, 5120) == _CFG(block_n=64, block_k=512, stages=2)
        want = _CFG(block_n=64, block_k=256, stages=2)
        assert GM.default_config(m, 248320, 5120, fmt="fp8") == want
    for m in (9, 32, 96, 128):
        for fmt in ("nvfp4", "fp8"):
            cfg = GM.default_config(m, 248320, 5120, fmt=fmt)
            assert cfg.block_n * C.round_up(m, 8) // 128 <= 128  # accumulator registers
    # FP8 block-128: 64-row CTAs (two accumulators); both FP8 formats take 128-wide K steps
    # above 32 rows (two or three CTAs per SM), per-row with 128-row CTAs.
    for m in (1, 8, 9, 32, 33, 64, 65, 96, 97, 128):
        cfg = GM.default_config(m, 248320, 5120, fmt="fp8_block")
        assert cfg == _CFG(block_n=64, block_k=256 if m <= 32 else 128, stages=2), m
        assert 2 * cfg.block_n * C.round_up(m, 8) // 128 <= 128  # both accumulators
        row = GM.default_config(m, 248320, 5120, fmt="fp8")
        want = _CFG(block_n=64, block_k=256) if m <= 32 else _CFG(block_n=128, block_k=128)
        assert row == dataclasses.replace(want, stages=2), m
    with pytest.raises(ValueError, match="fp4"):
        GM.default_config(1, 8, 256, fmt="fp4")


def _run_fp8(m, n, k, cfg, *, seed=0):
    rng = np.random.default_rng(seed)
    q, scale = leaves("fp8", n, k, rng)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    qp, sp = _prepare_fp8_row(q, scale)
    return x, (q, scale), _fp8_row(x, qp, sp, n=n, config=cfg)


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        # Odd N (1021 -> 1024) and K (200 -> 256: zero-padded codes and activations).
        (1, 1021, 200, _CFG(block_n=64, block_k=256, stages=2)),
        # Two 128-byte code slabs per step, K tail inside the last step (640 = 512 + 128).
        (3, 136, 640, _CFG(block_n=64, block_k=512, stages=3)),
        (8, 64, 512, None),
        # 128-row CTA over 72 rows, default-width K steps.
        (40, 72, 384, _CFG(block_n=128, block_k=256, stages=2)),
        (96, 131, 256, None),
    ],
)
def test_fp8_row_matches_reference(m, n, k, cfg):
    x, lv, out = _run_fp8(m, n, k, cfg, seed=m * 100 + n)
    _assert_matches("fp8", x, lv, out)


def test_decode_tile_fp8_is_exact_and_permuted():
    codes = _random_fp8_tile(np.random.default_rng(5), 8, 64)
    got = np.asarray(GM.decode_tile_fp8(jnp.asarray(codes)), np.float64)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    perm = GM._k_permutation("fp8")
    np.testing.assert_array_equal(got, want.reshape(8, -1, 16)[:, :, perm].reshape(8, -1))
    xs = jnp.arange(64, dtype=jnp.float32)[None]
    np.testing.assert_array_equal(
        np.asarray(GM.permute_k(xs, "fp8"))[0], np.arange(64).reshape(-1, 16)[:, perm].ravel()
    )


def test_fp8_rejects_unaligned_and_bad_shapes():
    rng = np.random.default_rng(0)
    q, scale = leaves("fp8", 100, 200, rng)
    x = jnp.zeros((1, 200), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"TMA copies, got N=100, K=200"):
        GM.fp8_row_gemv_mosaic(x, q, scale, interpret=INTERPRET)
    qp, sp = _prepare_fp8_row(q, scale)
    with pytest.raises(ValueError, match="1 <= M <= 128"):
        GM.fp8_row_gemv_mosaic(jnp.zeros((129, 200), jnp.bfloat16), qp, sp, interpret=INTERPRET)
    with pytest.raises(ValueError, match="K=100"):
        GM.fp8_row_gemv_mosaic(jnp.zeros((1, 100), jnp.bfloat16), qp, sp, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"scale must be \[104\]"):
        GM.fp8_row_gemv_mosaic(x, qp, sp[:100], interpret=INTERPRET)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        GM.fp8_row_gemv_mosaic(x, qp.astype(jnp.bfloat16), sp, interpret=INTERPRET)


# ---------------------------------------------------------------------------------------------
# FP8 block-128 (DeepSeek-V3 ``weight_scale_inv``): one scale per 128 x 128 block.
# ---------------------------------------------------------------------------------------------


def _spread_block_scales(rng, n, k, lo=-24, hi=24):
    """f32[ceil(n/128), ceil(k/128)] block scales over many binades (and random mantissas), so a
    scale applied to the wrong block or row shows as a large error."""
    shape = (C.cdiv(n, 128), C.cdiv(k, 128))
    s = rng.uniform(1.0, 2.0, shape) * 2.0 ** rng.integers(lo, hi, shape)
    return jnp.asarray(s, jnp.float32)


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        # Odd N (1021 -> 1024: last scale row covers 125 rows) and K (200 -> 256: the last
        # scale block is 72 columns wide, zero-padded to 128).
        (1, 1021, 200, _CFG(block_n=64, block_k=256, stages=2)),
        # K = 640: 2.5 steps of 256, the last step half past K (its block reads the last scale
        # column, times zeros); N = 200: CTA 3 starts at row 192, in scale row 1.
        (5, 200, 640, _CFG(block_n=64, block_k=256, stages=3)),
        # 128-row CTAs, one scale row each; K = 384 (three scale blocks, 1.5 steps).
        (8, 264, 384, _CFG(block_n=128, block_k=256, stages=2)),
        # Four scale blocks per 512-wide step; odd K (900 -> 1024 in two steps).
        (13, 131, 900, _CFG(block_n=64, block_k=512, stages=2)),
        (40, 72, 384, None),
        (96, 136, 256, None),
        (128, 64, 384, None),
    ],
)
def test_fp8_block_matches_reference(m, n, k, cfg):
    rng = np.random.default_rng(m * 1000 + n)
    q, _ = leaves("fp8_block", n, k, rng)
    s = _spread_block_scales(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)) * 2.0 ** rng.integers(-20, 20, (m, 1)))
    x = x.astype(jnp.bfloat16)
    qp, sp = _prepare_fp8_block(q, s)
    out = _fp8_block(x, qp, sp, n=n, config=cfg)
    _assert_matches("fp8_block", x, (q, s), out)


def test_fp8_block_scale_applies_per_block_in_f32():
    """Row b of x is one on K block b only, so out[b, j] is block (j // 128, b) alone: its
    partial sum (448s and E4M3's smallest subnormal 2**-9) times its scale, 2**-20 .. 2**25.
    Scaling in F32 keeps both; a scale folded into the float16 operand would flush the
    subnormals under 2**-20 and overflow at 2**25."""
    n, k = 200, 384
    q = np.zeros((n, k), np.float32)
    q[:, ::3] = 448.0
    q[:, 1::3] = 2.0**-9
    q = jnp.asarray(q, jnp.float8_e4m3fn)
    s = jnp.asarray([[2.0**-20, 1.0, 2.0**25], [2.0**-10, 3.0, 2.0**-24]], jnp.float32)
    x = np.kron(np.eye(3), np.ones((1, 128)))
    qp, sp = _prepare_fp8_block(q, s)
    out = _fp8_block(jnp.asarray(x, jnp.bfloat16), qp, sp, n=n)
    oracle = x @ numpy_dequant("fp8_block", q, s).T
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle, rtol=1e-7)


def test_fp8_block_row_alone_equals_row_of_96():
    """A row of a 96-row call is bit for bit that row computed alone. Small integers and
    power-of-two scales keep every product and sum exact, so the interpreter's summation order
    (an XLA:CPU dot over the MMA's N) cannot differ; a row mix-up still shows."""
    rng = np.random.default_rng(3)
    m, n, k = 96, 136, 256
    q = jnp.asarray(rng.integers(-16, 17, (n, k)), jnp.float8_e4m3fn)
    s = jnp.asarray(2.0 ** rng.integers(-3, 4, (2, 2)), jnp.float32)
    x = jnp.asarray(rng.integers(-8, 9, (m, k)) * 2.0 ** rng.integers(-6, 6, (m, 1)))
    x = x.astype(jnp.bfloat16)
    qp, sp = _prepare_fp8_block(q, s)
    full = np.asarray(_fp8_block(x, qp, sp))
    np.testing.assert_array_equal(
        full, np.asarray(x, np.float64) @ numpy_dequant("fp8_block", q, s).T
    )
    for r in (0, 37, 95):
        one = _fp8_block(x[r : r + 1], qp, sp)
        np.testing.assert_array_equal(np.asarray(one)[0], full[r])


def test_fp8_block_rejects_unaligned_and_bad_shapes():
    rng = np.random.default_rng(0)
    q, s = leaves("fp8_block", 100, 200, rng)
    x = jnp.zeros((1, 200), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"TMA copies, got N=100, K=200"):
        GM.fp8_block_gemv_mosaic(x, q, s, interpret=INTERPRET)
    qp, sp = _prepare_fp8_block(q, s)
    with pytest.raises(ValueError, match="1 <= M <= 128"):
        GM.fp8_block_gemv_mosaic(jnp.zeros((129, 200), jnp.bfloat16), qp, sp, interpret=INTERPRET)
    with pytest.raises(ValueError, match="K=100"):
        GM.fp8_block_gemv_mosaic(jnp.zeros((1, 100), jnp.bfloat16), qp, sp, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"scale_inv must be \[1, 2\]"):
        GM.fp8_block_gemv_mosaic(x, qp, sp[:, :1], interpret=INTERPRET)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        GM.fp8_block_gemv_mosaic(x, qp.astype(jnp.bfloat16), sp, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_n <= 128, got 256"):
        cfg = _CFG(block_n=256, block_k=256)
        GM.fp8_block_gemv_mosaic(x, qp, sp, config=cfg, interpret=INTERPRET)


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        (1, 248320, 5120, None),
        (96, 248320, 5120, None),
        (8, 12288, 5120, None),
        (1, 5120, 17408, None),
        # 128-row CTAs, 512-wide steps (four scale blocks per step).
        (32, 12288, 5120, _CFG(block_n=128, block_k=512, stages=2)),
    ],
)
def test_fp8_block_lowers_for_cuda_on_cpu(m, n, k, cfg):
    assert "mosaic_gpu" in _lower_cuda(m, n, k, cfg, fmt="fp8_block")


# ---------------------------------------------------------------------------------------------
# The epilogue: final [M, N] orientation, factors applied in the kernel.
# ---------------------------------------------------------------------------------------------


def _weights_for(fmt, n, k, rng):
    """(reference leaves, kernel operands) for one random weight of ``fmt``."""
    lv = leaves(fmt, n, k, rng)
    if fmt == "fp8":
        return lv, _prepare_fp8_row(*lv)
    if fmt == "fp8_block":
        return lv, _prepare_fp8_block(*lv)
    return lv, (*_prepare_nvfp4(lv[0], lv[1]), lv[2])


def _call(fmt, x, w, *, n, cfg):
    kernel = {"fp8": _fp8_row, "fp8_block": _fp8_block}.get(fmt, _nvfp4)
    return kernel(x, *w, n=n, config=cfg)


#: Warp-specialised CTAs: (block_n, block_k, stages, consumers); each consumer takes 64 or 128
#: rows.
_WS_TILES = [(128, 256, 2, 2), (256, 256, 2, 2)]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("tiles", _WS_TILES, ids=lambda t: f"{t[0]}x{t[1]}x{t[2]}/{t[3]}")
@pytest.mark.parametrize("m", [3, 17])
def test_warp_specialized_ctas_match_one_warpgroup(fmt, tiles, m):
    """Consumers sharing one activation tile: every output column (N = 264 spans a partial
    CTA, and a consumer whose rows lie past N) matches the reference, and the sums are those
    of one warpgroup over the same rows bit for bit (the same 64-wide K chunks in the same
    order; the interpreter's dot is an XLA:CPU dot, whose bits follow its operand shapes)."""
    bn, bk, stages, consumers = tiles
    rng = np.random.default_rng(m + consumers)
    n, k = 264, 768
    lv, w = _weights_for(fmt, n, k, rng)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    ws = _call(fmt, x, w, n=n, cfg=_CFG(block_n=bn, block_k=bk, stages=stages, consumers=consumers))
    _assert_matches(fmt, x, lv, ws)
    one = _call(fmt, x, w, n=n, cfg=_CFG(block_n=bn // consumers, block_k=bk, stages=2))
    np.testing.assert_array_equal(np.asarray(ws), np.asarray(one))


@functools.cache
def _lm_head_nvfp4():
    """The kernel operands of one random NVFP4 [248320, 5120] weight, made once."""
    return _weights_for("nvfp4", 248320, 5120, np.random.default_rng(0))[1]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tiles", "m"),
    [(_WS_TILES[0], m) for m in (1, 16, 32, 96)] + [(_WS_TILES[1], m) for m in (1, 32)],
)
def test_warp_specialized_ctas_match_one_warpgroup_on_the_lm_head(tiles, m):
    """Compiled at the LM head's shape (register decode, producer and consumer warpgroups):
    the default tiles' bits."""
    bn, bk, stages, consumers = tiles
    w = _lm_head_nvfp4()
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 5120)), jnp.bfloat16)
    cfg = _CFG(block_n=bn, block_k=bk, stages=stages, consumers=consumers)
    ws = np.asarray(_call("nvfp4", x, w, n=None, cfg=cfg))
    np.testing.assert_array_equal(ws, np.asarray(_call("nvfp4", x, w, n=None, cfg=None)))


def test_fp8_block_takes_one_consumer():
    q = jnp.zeros((128, 256), jnp.float8_e4m3fn)
    s = jnp.ones((1, 2), jnp.float32)
    cfg = _CFG(block_n=128, block_k=128, consumers=2)
    with pytest.raises(ValueError, match="fp8_block takes one consumer warpgroup, got consumers=2"):
        GM.fp8_block_gemv_mosaic(jnp.zeros((1, 256), jnp.bfloat16), q, s, config=cfg)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_block"])
def test_output_orientation_with_one_hot_rows(fmt):
    """Row r of x picks column c_r of the weight: out[r, j] is exactly W[j, c_r] (power-of-two
    scales keep every product exact), so a transposed or shifted store cannot pass. Each row's
    one is 1.0: its row factor 2**-14 is exact, where XLA:CPU's ``exp2`` is not for some other
    exponents (``exp2(-13.0)`` is off by 5e-7)."""
    rng = np.random.default_rng(11)
    m, n, k = 5, 131, 256
    lv, w = _weights_for(fmt, n, k, rng)
    if fmt == "fp8":
        s = jnp.asarray(2.0 ** rng.integers(-8, 8, w[1].shape), jnp.float32)
        w, lv = (w[0], s), (lv[0], s[:n])
    elif fmt == "fp8_block":  # [2, 2] block scales: each (row, column) block its own binade
        s = jnp.asarray(2.0 ** rng.permutation(np.arange(-8, 8, 4)).reshape(2, 2), jnp.float32)
        w, lv = (w[0], s), (lv[0], s)
    else:
        w, lv = (*w[:2], jnp.float32(0.25)), (*lv[:2], jnp.float32(0.25))
    cols = np.array([0, 1, 17, 100, 255])
    x = np.zeros((m, k), np.float32)
    x[np.arange(m), cols] = 1.0
    out = np.asarray(_call(fmt, jnp.asarray(x, jnp.bfloat16), w, n=n, cfg=None))
    want = numpy_dequant(fmt, *lv)[:, cols].T
    np.testing.assert_array_equal(out, want.astype(np.float32))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_block"])
def test_a_row_depends_only_on_its_own_values(fmt):
    """At M=96 a row's bits do not change when every other row does (to other magnitudes).

    (A row alone vs inside 96 rows is not compared here: the interpreter's wgmma is an XLA:CPU
    dot whose summation order depends on the MMA's N; the compiled kernel is checked on the GPU
    by ``test_row_alone_equals_row_of_many_on_gpu``.)"""
    rng = np.random.default_rng(5)
    m, n, k = 96, 72, 256
    _, w = _weights_for(fmt, n, k, rng)
    x = rng.standard_normal((m, k))
    y = rng.standard_normal((m, k)) * 2.0 ** rng.integers(-40, 40, (m, 1))
    y[37] = x[37]
    out_x = np.asarray(_call(fmt, jnp.asarray(x, jnp.bfloat16), w, n=n, cfg=None))
    out_y = np.asarray(_call(fmt, jnp.asarray(y, jnp.bfloat16), w, n=n, cfg=None))
    np.testing.assert_array_equal(out_x[37], out_y[37])
    assert not np.array_equal(out_x[36], out_y[36])


# ---------------------------------------------------------------------------------------------
# Decode and layout.
# ---------------------------------------------------------------------------------------------


def _f16_oracle(codes: np.ndarray, scale_u8: np.ndarray) -> np.ndarray:
    """float64[R, 2B] ``e2m1 * scale * 2**-14`` in the original K order."""
    r, b = codes.shape
    nib = np.empty((r, 2 * b), np.int64)
    nib[:, 0::2] = codes & 0xF
    nib[:, 1::2] = codes >> 4
    s = scale_u8.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return E2M1[nib] * np.repeat(s, 16, axis=1) * C.E2M1_F16_BIAS


def _random_tile(rng, rows, b):
    codes = rng.integers(0, 256, (rows, b)).astype(np.uint8)
    scale = rng.choice([2.0**-9, 2.0**-7, 0.375, 1.0, 3.5, 96.0, 448.0], (rows, b // 8))
    return codes, scale.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def test_decode_tile_is_exact_and_permuted():
    rng = np.random.default_rng(0)
    codes, scale = _random_tile(rng, 16, 128)
    got = GM.decode_tile(jnp.asarray(codes), jnp.asarray(scale))
    got = np.asarray(got, np.float64)
    want = _f16_oracle(codes, scale)
    perm = GM._k_permutation()
    np.testing.assert_array_equal(got, want.reshape(16, -1, 32)[:, :, perm].reshape(16, -1))
    # permute_k is the same permutation, applied to the activations.
    xs = jnp.arange(256, dtype=jnp.float32)[None]
    np.testing.assert_array_equal(
        np.asarray(GM.permute_k(xs))[0], (np.arange(256).reshape(-1, 32)[:, perm]).reshape(-1)
    )


_IDX = 0x0E000E00  # index bits of a float16 pair (9..11 and 25..27)
_SIGN = 0x80008000  # sign bits of a float16 pair (15 and 31)
#: The specification of the four float16 pairs of a code word, as (shift, mask) terms OR-ed
#: together (a positive shift is to the left): pair i is (lo b0, lo b2), (hi b0, hi b2),
#: (lo b1, lo b3), (hi b1, hi b3), each needing a shift for its index bits and one for its sign.
_DECODE_TERMS = (
    ((9, _IDX), (12, _SIGN)),
    ((5, _IDX), (8, _SIGN)),
    ((1, _IDX), (4, _SIGN)),
    ((-3, _IDX), (0, _SIGN)),
)


def test_kernel_decode_words_match_the_decode_terms():
    """The kernel's op sequence (``_pair_words``: nibble bytes and ``prmt``) makes the pairs
    ``_DECODE_TERMS`` define, for random and edge-case words, in 11 integer ops (each OR folds
    into a LOP3 with one of its ANDs)."""
    rng = np.random.default_rng(1)
    w = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    edge = [0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0x0F0F0F0F, 0xF0F0F0F0, 0x80808080]
    w = np.concatenate([w, np.array(edge, np.uint32)])
    want = []
    for terms in _DECODE_TERMS:
        bits = np.zeros_like(w)
        for shift, mask in terms:
            bits |= GM._shift(w, shift) & np.uint32(mask)
        want.append(bits)
    got = GM._pair_words(w)
    for g, wt in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, wt)
    counts = dict(shift=0, band=0, bor=0, even_up=0)

    def counted(name, fn):
        def f(*a):
            counts[name] += 1
            return fn(*a)

        return f

    ops = dict(
        shift=lambda v, s: GM._shift(v, s),
        band=lambda v, m: v & np.uint32(m),
        bor=lambda a, b: a | b,
        even_up=lambda v: (v << 8) & np.uint32(0xFF00FF00),
    )
    GM._pair_words(w[:1], **{k: counted(k, f) for k, f in ops.items()})
    assert counts["shift"] + counts["band"] + counts["even_up"] == 11


def _thread_offset(layout, shape, warp, lane):
    """numpy twin of the per-thread offset in ``TiledLayout.thread_idxs``."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    tiled = layout.tiled_tiling_shape
    strides = tuple(mgpu_utils.get_contiguous_strides(shape))
    tile_strides = layout.tiling.tile_strides(strides)[-layout.tiled_tiling_rank :]

    def delinearize(idx, dims):
        sizes = [d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims]
        full = [0] * len(tiled)
        for d, st, sz in zip(dims, mgpu_utils.get_contiguous_strides(sizes), sizes):
            if not isinstance(d, fa.Replicated):
                full[d] = (idx // st) % sz
        return full

    w = delinearize(warp, layout.warp_dims)
    ln = delinearize(lane, layout.lane_dims)
    return sum((a + b) * s for a, b, s in zip(w, ln, tile_strides))


def _random_fp8_tile(rng, rows, b):
    """uint8[rows, b]: finite E4M3 codes incl. subnormals, zeros and both signs."""
    v = rng.standard_normal((rows, b)) * 32
    v[:, ::5] *= 2.0**-10
    v[:, ::11] = 0.0
    return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _replay_pairs(fmt, w, scale_byte):
    """numpy twin of the GPU decode of one 32-bit code word: its float16 pairs, pair order."""
    if fmt in ("fp8", "fp8_block"):
        b = np.array([w], "<u4").view(np.uint8)
        return [
            b[2 * u : 2 * u + 2].view(ml_dtypes.float8_e4m3fn).astype(np.float16) for u in (0, 1)
        ]
    s = np.array([scale_byte], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)[0]
    return [np.array([bits], np.uint32).view(np.float16) * s for bits in GM._pair_words(w)]


@pytest.mark.parametrize(
    ("fmt", "block_n", "tile_bytes"),
    [
        ("nvfp4", 64, 128),
        ("nvfp4", 128, 256),
        # The FP8 kernel loads its codes one 128-byte swizzle row (two chunks) at a time.
        ("fp8", 64, 128),
        ("fp8", 128, 128),
        ("fp8_block", 64, 128),
    ],
)
def test_register_decode_plan_thread_by_thread(fmt, block_n, tile_bytes):
    """Replay the GPU decode (which registers feed which, the per-word decode) for all 128
    threads of a warpgroup in numpy and compare with the float64 oracle."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    rng = np.random.default_rng(block_n + tile_bytes)
    scale = None
    if fmt == "nvfp4":
        orig, scale = _random_tile(rng, block_n, tile_bytes)
        stored = orig
        want = _f16_oracle(orig, scale)
    else:
        orig = stored = _random_fp8_tile(rng, block_n, tile_bytes)
        want = orig.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    perm = GM._k_permutation(fmt)
    want = want.reshape(block_n, -1, perm.size)[:, :, perm].reshape(block_n, -1)
    in_origin = GM._register_origins(fa.WGMMA_LAYOUT_8BIT, (block_n, tile_bytes))
    out_origin = GM._register_origins(fa.WGMMA_LAYOUT, (block_n, 64))
    assert fa.WGMMA_LAYOUT_8BIT.vector_length == 4 and fa.WGMMA_LAYOUT.vector_length == 2
    for chunk in range(want.shape[1] // 64):
        got = np.full((block_n, 64), np.nan)
        for warp in range(4):
            for lane in range(32):
                off_in = _thread_offset(fa.WGMMA_LAYOUT_8BIT, (block_n, tile_bytes), warp, lane)
                off_out = _thread_offset(fa.WGMMA_LAYOUT, (block_n, 64), warp, lane)
                for reg, slots in GM._chunk_plan(block_n, tile_bytes, chunk, fmt):
                    r0, k0 = in_origin[reg]
                    row, col = divmod(r0 * tile_bytes + k0 + off_in, tile_bytes)
                    w = np.uint32(stored[row, col : col + 4].view("<u4")[0])
                    sb = None if scale is None else scale[row, col // 8]
                    pairs = _replay_pairs(fmt, w, sb)
                    for out_reg, i in slots:
                        o_r0, o_c0 = out_origin[out_reg]
                        orow, ocol = divmod(o_r0 * 64 + o_c0 + off_out, 64)
                        assert orow == row
                        assert np.all(np.isnan(got[orow, ocol : ocol + 2])), "written twice"
                        got[orow, ocol : ocol + 2] = pairs[i]
        np.testing.assert_array_equal(got, want[:, chunk * 64 : (chunk + 1) * 64])


# ---------------------------------------------------------------------------------------------
# API checks and the CUDA lowering.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "bad"),
    [
        (dict(block_n=96), "96"),
        (dict(block_n=512), "512"),
        (dict(block_k=200), "200"),
        (dict(block_k=4096), "4096"),
        (dict(stages=1), "1"),
        (dict(block_n=256, consumers=4), "4"),
        (dict(block_n=64, consumers=2), "2"),
    ],
)
def test_config_validation_names_the_value(kw, bad):
    with pytest.raises(ValueError, match=rf"{next(iter(kw))} .*{bad}"):
        GM.MosaicGemvConfig(**kw)


def test_nvfp4_rejects_the_fp8_only_k_step():
    cfg = GM.MosaicGemvConfig(block_n=64, block_k=384)  # a multiple of 128: FP8 only
    x = jnp.zeros((1, 512), jnp.bfloat16)
    packed, scale = jnp.zeros((64, 256), jnp.uint8), jnp.zeros((64, 32), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="NVFP4 needs block_k a multiple of 256, got 384"):
        GM.nvfp4_gemv_mosaic(x, packed, scale, jnp.float32(1.0), config=cfg)


def test_rejects_unaligned_and_bad_shapes():
    rng = np.random.default_rng(0)
    packed, scale, s2 = leaves("nvfp4", 100, 272, rng)
    x = jnp.zeros((1, 272), jnp.bfloat16)
    with pytest.raises(ValueError, match="TMA copies, got N=100, K=272"):
        GM.nvfp4_gemv_mosaic(x, packed, scale, s2, interpret=INTERPRET)
    p, s = _prepare_nvfp4(packed, scale)
    assert p.shape == (104, 256) and s.shape == (104, 32)
    with pytest.raises(ValueError, match="1 <= M <= 128"):
        GM.nvfp4_gemv_mosaic(jnp.zeros((129, 272), jnp.bfloat16), p, s, s2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="K=200"):
        GM.nvfp4_gemv_mosaic(jnp.zeros((1, 200), jnp.bfloat16), p, s, s2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="scale must be"):
        GM.nvfp4_gemv_mosaic(x, p, s[:, :16], s2, interpret=INTERPRET)


def _lower_cuda(m, n, k, cfg, fmt="nvfp4"):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    if fmt == "fp8_block":
        args = (
            x,
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((-(-n // 128), k // 128), jnp.float32),
        )

        def f(*a):
            return GM.fp8_block_gemv_mosaic(*a, config=cfg)

    elif fmt == "fp8":
        args = (
            x,
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        )

        def f(*a):
            return GM.fp8_row_gemv_mosaic(*a, config=cfg)

    else:
        w_shapes = ((n, k // 2), (n, k // 16))
        args = (
            x,
            jax.ShapeDtypeStruct(w_shapes[0], jnp.uint8),
            jax.ShapeDtypeStruct(w_shapes[1], jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), jnp.float32),
        )

        def f(*a):
            return GM.nvfp4_gemv_mosaic(*a, config=cfg)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _lowered_smem_bytes(m, n, k, cfg, fmt="nvfp4"):
    """Shared memory per CTA as the Mosaic GPU lowering counts it (read off its overflow check
    with the bound set to 0)."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    bound = mgpu_core._SMEM_SIZE_BOUND
    mgpu_core._SMEM_SIZE_BOUND = 0
    try:
        with pytest.raises(ValueError, match=r"smem_bytes=(\d+)") as err:
            _lower_cuda(m, n, k, cfg, fmt=fmt)
    finally:
        mgpu_core._SMEM_SIZE_BOUND = bound
    return int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        (1, 248320, 5120, GM.MosaicGemvConfig(block_n=64, block_k=512, stages=2)),
        (2, 248320, 5120, GM.MosaicGemvConfig(block_n=128, block_k=512, stages=4)),
        (8, 17408, 5120, GM.MosaicGemvConfig(block_n=64, block_k=256, stages=4)),
        (16, 1024, 512, GM.MosaicGemvConfig(block_n=256, block_k=512, stages=2)),
        # Verify-sized and B=64 propose-sized rows on the LM head, default configs.
        (96, 248320, 5120, None),
        (128, 248320, 5120, None),
        (64, 248320, 5120, None),
        (96, 248320, 5120, GM.MosaicGemvConfig(block_n=128, block_k=256, stages=2)),
        # Warp-specialised: a producer and 2 or 4 consumer warpgroups.
        (32, 248320, 5120, GM.MosaicGemvConfig(block_n=128, block_k=256, stages=4, consumers=2)),
        (64, 248320, 5120, GM.MosaicGemvConfig(block_n=256, block_k=256, stages=2, consumers=2)),
    ],
)
def test_lowers_for_cuda_on_cpu(m, n, k, cfg):
    """Pallas -> Mosaic GPU (sm_90) lowering incl. the register decode, without a GPU.

    PTX generation and ptxas run only when a GPU compiles the module.
    """
    text = _lower_cuda(m, n, k, cfg)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 248320, 5120),
        (8, 248320, 5120),
        (96, 248320, 5120),
        # The MoE LM head, where the Triton FP8 GEMV moved only 2.0 TB/s.
        (1, 151936, 2048),
        (8, 151936, 2048),
    ],
)
def test_fp8_lowers_for_cuda_on_cpu(m, n, k):
    assert "mosaic_gpu" in _lower_cuda(m, n, k, None, fmt="fp8")


@pytest.mark.parametrize(
    ("fmt", "m", "want_kb"),
    [
        ("nvfp4", 1, 52),  # 2 x (16 KB codes + 2 KB scales + 8 KB x): 4 CTAs per SM
        ("nvfp4", 32, 50),  # 64 x 256: 2 x (8 + 1 + 16)
        ("nvfp4", 96, 132),  # 128 x 256: 2 x (16 + 2 + 48)
        ("nvfp4", 128, 164),  # 128 x 256: 2 x (16 + 2 + 64)
        ("fp8", 1, 40),  # 2 x (16 KB codes + 4 KB x): 5 CTAs per SM
        ("fp8", 96, 80),  # 128 x 128: 2 x (16 + 24): 2 CTAs per SM
        ("fp8_block", 1, 40),  # 64 x 256: 2 x (16 + 4)
        ("fp8_block", 96, 64),  # 64 x 128: 2 x (8 + 24): 3 CTAs per SM
        ("fp8_block", 128, 80),  # 64 x 128: 2 x (8 + 32)
    ],
)
def test_default_configs_fit_shared_memory(fmt, m, want_kb):
    """The defaults' shared memory per CTA, as the lowering counts it (H100/H200: 227 KB)."""
    cfg = GM.default_config(m, 248320, 5120, fmt=fmt)
    got = _lowered_smem_bytes(m, 248320, 5120, cfg, fmt)
    assert want_kb * 1024 <= got < (want_kb + 1) * 1024


def test_every_tile_the_benchmark_sweeps_fits_shared_memory():
    """A variant of ``benchmarks.kernels``' LM-head sweep that cannot launch times nothing: each
    fits the 227 KB an H100 / H200 CTA may take, as the lowering counts it."""
    from benchmarks.kernels import LINEAR_SWEEP

    for fmt, rows, impl, _, variants in LINEAR_SWEEP:
        if impl != "mosaic_gpu":
            continue
        for fields in variants:
            got = _lowered_smem_bytes(rows, 248320, 5120, GM.MosaicGemvConfig(**fields), fmt)
            assert got <= 227 * 1024, f"{fmt} at {rows} rows {fields}: {got} bytes"


def test_lowering_reports_shared_memory_overflow():
    cfg = GM.MosaicGemvConfig(block_n=256, block_k=2048, stages=4)
    with pytest.raises(ValueError, match="shared memory"):
        _lower_cuda(1, 1024, 2048, cfg)
    cfg = GM.MosaicGemvConfig(block_n=64, block_k=512, stages=2)  # x alone: 2 x 128 KB
    with pytest.raises(ValueError, match="shared memory"):
        _lower_cuda(128, 1024, 2048, cfg, fmt="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_block"])
def test_row_alone_equals_row_of_many_on_gpu(fmt):
    """Compiled, a row's result does not depend on how many rows share the call (decode, verify
    and a batch score it alike); the interpreter's dot cannot show this."""
    rng = np.random.default_rng(9)
    _, w = _weights_for(fmt, 1024, 512, rng)
    x = jnp.asarray(rng.standard_normal((96, 512)), jnp.bfloat16)
    full = np.asarray(_call(fmt, x, w, n=1024, cfg=None))
    for r in (0, 37, 95):
        one = np.asarray(_call(fmt, x[r : r + 1], w, n=1024, cfg=None))
        np.testing.assert_array_equal(one[0], full[r])
