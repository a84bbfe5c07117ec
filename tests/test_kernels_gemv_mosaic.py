"""Mosaic GPU NVFP4 GEMV: interpret mode against the reference, the register-level decode plan
simulated thread by thread, and the CUDA lowering built on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_helpers import E2M1, leaves, numpy_dequant, rel_err

from pallas_kernels import _common as C
from pallas_kernels import gemv as G
from pallas_kernels import gemv_mosaic as GM


def _run(m, n, k, cfg, *, seed=0, layout="checkpoint"):
    rng = np.random.default_rng(seed)
    lv = leaves("nvfp4", n, k, rng)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    tile = (
        {} if cfg is None or layout != "tiled" else dict(block_n=cfg.block_n, block_k=cfg.block_k)
    )
    packed, scale = GM.prepare_nvfp4_mosaic(lv[0], lv[1], layout=layout, **tile)
    out = GM.nvfp4_gemv_mosaic(
        x, packed, scale, lv[2], n=n, layout=layout, config=cfg, interpret=True
    )
    return x, lv, out


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg", "layout"),
    [
        # M=1, odd N (1021: row tail inside a tile and N padded to 1024), K=272 padded to 512.
        (1, 1021, 272, GM.MosaicGemvConfig(block_n=64, block_k=256, stages=2), "checkpoint"),
        # M=3, two 64-row M groups per warpgroup, K tail inside the last step (768 = 512 + 256).
        (3, 200, 768, GM.MosaicGemvConfig(block_n=128, block_k=512, stages=3), "relaid"),
        # M=8 (one full N=8 MMA), N below one tile.
        (8, 40, 512, GM.MosaicGemvConfig(block_n=64, block_k=256, stages=4), "checkpoint"),
        # M=13 pads to N=16; 256 rows per CTA.
        (13, 264, 256, GM.MosaicGemvConfig(block_n=256, block_k=256, stages=2), "relaid"),
        # Contiguous tiles: N and K padded to the tile (200 -> 256 rows, 1008 -> 1024).
        (2, 200, 1008, GM.MosaicGemvConfig(block_n=64, block_k=512, stages=2), "tiled"),
        (5, 130, 512, GM.MosaicGemvConfig(block_n=128, block_k=256, stages=3), "tiled"),
    ],
)
def test_matches_reference(m, n, k, cfg, layout):
    x, lv, out = _run(m, n, k, cfg, seed=m * 1000 + n, layout=layout)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, G.nvfp4_gemv_reference(x, *lv)) < 2e-6
    oracle = np.asarray(x, np.float64) @ numpy_dequant("nvfp4", *lv).T
    assert rel_err(out, oracle) < 2e-6


def test_rows_are_independent_and_scaled_per_row():
    """Rows of very different magnitude (float16 row scaling) each match the reference."""
    rng = np.random.default_rng(7)
    lv = leaves("nvfp4", 64, 256, rng)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    x = (x * jnp.asarray([[1e6], [1e-6], [1.0]])).astype(jnp.bfloat16)
    cfg = GM.MosaicGemvConfig(block_n=64, block_k=256, stages=2)
    out = GM.nvfp4_gemv_mosaic(x, *lv, config=cfg, interpret=True)
    want = G.nvfp4_gemv_reference(x, *lv)
    for r in range(3):
        assert rel_err(out[r], want[r]) < 2e-6
    single = GM.nvfp4_gemv_mosaic(x[2:], *lv, config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(single), np.asarray(out[2:]))


@pytest.mark.parametrize("layout", GM.WEIGHT_LAYOUTS)
def test_default_config_runs(layout):
    x, lv, out = _run(2, 256, 512, None, seed=3, layout=layout)
    assert rel_err(out, G.nvfp4_gemv_reference(x, *lv)) < 2e-6


def test_tiled_layout_is_a_relabelling_of_relaid():
    rng = np.random.default_rng(4)
    packed, scale, _ = leaves("nvfp4", 128, 1024, rng)
    rp, rs = GM.prepare_nvfp4_mosaic(packed, scale, layout="relaid")
    tp, ts = GM.prepare_nvfp4_mosaic(packed, scale, layout="tiled", block_n=64, block_k=512)
    assert tp.shape == (2, 2, 64, 256) and ts.shape == (2, 2, 64, 32)
    np.testing.assert_array_equal(np.asarray(tp[1, 0]), np.asarray(rp[64:, :256]))
    np.testing.assert_array_equal(
        np.asarray(ts[0, 1]).view(np.uint8), np.asarray(rs[:64, 32:]).view(np.uint8)
    )


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


@pytest.mark.parametrize("layout", GM.WEIGHT_LAYOUTS)
def test_decode_tile_is_exact_and_permuted(layout):
    rng = np.random.default_rng(0)
    codes, scale = _random_tile(rng, 16, 128)
    stored = codes if layout == "checkpoint" else np.asarray(GM.relayout_words(jnp.asarray(codes)))
    got = GM.decode_tile(jnp.asarray(stored), jnp.asarray(scale), layout=layout)
    got = np.asarray(got, np.float64)
    want = _f16_oracle(codes, scale)
    perm = GM._k_permutation()
    np.testing.assert_array_equal(got, want.reshape(16, -1, 32)[:, :, perm].reshape(16, -1))
    # permute_k is the same permutation, applied to the activations.
    xs = jnp.arange(256, dtype=jnp.float32)[None]
    np.testing.assert_array_equal(
        np.asarray(GM.permute_k(xs))[0], (np.arange(256).reshape(-1, 32)[:, perm]).reshape(-1)
    )


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


@pytest.mark.parametrize(
    ("block_n", "block_k", "layout"), [(64, 256, "checkpoint"), (128, 512, "relaid")]
)
def test_register_decode_plan_thread_by_thread(block_n, block_k, layout):
    """Replay the GPU decode (which registers feed which, the shift/mask terms) for all 128
    threads of a warpgroup in numpy and compare with the float64 oracle."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    rng = np.random.default_rng(block_n)
    half_k = block_k // 2
    orig, scale = _random_tile(rng, block_n, half_k)
    codes = orig if layout == "checkpoint" else np.asarray(GM.relayout_words(jnp.asarray(orig)))
    perm = GM._k_permutation()
    want = _f16_oracle(orig, scale).reshape(block_n, -1, 32)[:, :, perm].reshape(block_n, -1)
    in_origin = GM._register_origins(fa.WGMMA_LAYOUT_8BIT, (block_n, half_k))
    out_origin = GM._register_origins(fa.WGMMA_LAYOUT, (block_n, 64))
    assert fa.WGMMA_LAYOUT_8BIT.vector_length == 4 and fa.WGMMA_LAYOUT.vector_length == 2
    for chunk in range(block_k // 64):
        got = np.full((block_n, 64), np.nan)
        for warp in range(4):
            for lane in range(32):
                off_in = _thread_offset(fa.WGMMA_LAYOUT_8BIT, (block_n, half_k), warp, lane)
                off_out = _thread_offset(fa.WGMMA_LAYOUT, (block_n, 64), warp, lane)
                for reg, slots in GM._chunk_plan(block_n, half_k, chunk):
                    r0, k0 = in_origin[reg]
                    row, col = divmod(r0 * half_k + k0 + off_in, half_k)
                    w = np.uint32(codes[row, col : col + 4].view("<u4")[0])
                    s = scale[row, col // 8 : col // 8 + 1].view(ml_dtypes.float8_e4m3fn)
                    s = s.astype(np.float16)[0]
                    for out_reg, i in slots:
                        bits = np.uint32(0)
                        for shift, mask in GM._DECODE_TERMS[layout][i]:
                            v = (w << np.uint32(shift)) if shift >= 0 else (w >> np.uint32(-shift))
                            bits |= v & np.uint32(mask)
                        pair = np.array([bits], np.uint32).view(np.float16) * s
                        o_r0, o_c0 = out_origin[out_reg]
                        orow, ocol = divmod(o_r0 * 64 + o_c0 + off_out, 64)
                        assert orow == row
                        assert np.all(np.isnan(got[orow, ocol : ocol + 2])), "written twice"
                        got[orow, ocol : ocol + 2] = pair
        np.testing.assert_array_equal(got, want[:, chunk * 64 : (chunk + 1) * 64])


# ---------------------------------------------------------------------------------------------
# API checks and the CUDA lowering.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "bad"),
    [
        (dict(block_n=96), "96"),
        (dict(block_n=512), "512"),
        (dict(block_k=384), "384"),
        (dict(block_k=4096), "4096"),
        (dict(stages=1), "1"),
    ],
)
def test_config_validation_names_the_value(kw, bad):
    with pytest.raises(ValueError, match=rf"{next(iter(kw))} .*{bad}"):
        GM.MosaicGemvConfig(**kw)


def test_rejects_unprepared_and_bad_shapes():
    rng = np.random.default_rng(0)
    packed, scale, s2 = leaves("nvfp4", 100, 272, rng)
    x = jnp.zeros((1, 272), jnp.bfloat16)
    with pytest.raises(ValueError, match="prepare_nvfp4_mosaic"):
        GM.nvfp4_gemv_mosaic(x, packed, scale, s2, interpret=True)
    p, s = GM.prepare_nvfp4_mosaic(packed, scale)
    assert p.shape == (104, 256) and s.shape == (104, 32)
    with pytest.raises(ValueError, match="1 <= M <= 32"):
        GM.nvfp4_gemv_mosaic(jnp.zeros((33, 272), jnp.bfloat16), p, s, s2, interpret=True)
    with pytest.raises(ValueError, match="K=200"):
        GM.nvfp4_gemv_mosaic(jnp.zeros((1, 200), jnp.bfloat16), p, s, s2, interpret=True)
    with pytest.raises(ValueError, match="n=90"):
        GM.nvfp4_gemv_mosaic(x, p, s, s2, n=90, interpret=True)
    with pytest.raises(ValueError, match="layout"):
        GM.nvfp4_gemv_mosaic(x, p, s, s2, layout="swizzled", interpret=True)
    tp, ts = GM.prepare_nvfp4_mosaic(packed, scale, layout="tiled", block_n=64, block_k=512)
    with pytest.raises(ValueError, match="must match the weight's 64x512"):
        cfg = GM.MosaicGemvConfig(block_n=128, block_k=512)
        GM.nvfp4_gemv_mosaic(x, tp, ts, s2, layout="tiled", config=cfg, interpret=True)
    with pytest.raises(ValueError, match="4-D"):
        GM.nvfp4_gemv_mosaic(x, p, s, s2, layout="tiled", interpret=True)


def _lower_cuda(m, n, k, cfg, layout="checkpoint"):
    if layout == "tiled":
        bn, bk = cfg.block_n, cfg.block_k
        w_shapes = ((n // bn, k // bk, bn, bk // 2), (n // bn, k // bk, bn, bk // 16))
    else:
        w_shapes = ((n, k // 2), (n, k // 16))
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct(w_shapes[0], jnp.uint8),
        jax.ShapeDtypeStruct(w_shapes[1], jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )

    def f(*a):
        return GM.nvfp4_gemv_mosaic(*a, layout=layout, config=cfg)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg", "layout"),
    [
        (1, 248320, 5120, GM.MosaicGemvConfig(block_n=64, block_k=512, stages=2), "tiled"),
        (2, 248320, 5120, GM.MosaicGemvConfig(block_n=128, block_k=512, stages=4), "checkpoint"),
        (8, 17408, 5120, GM.MosaicGemvConfig(block_n=64, block_k=256, stages=4), "relaid"),
        (16, 1024, 512, GM.MosaicGemvConfig(block_n=256, block_k=512, stages=2), "checkpoint"),
    ],
)
def test_lowers_for_cuda_on_cpu(m, n, k, cfg, layout):
    """Pallas -> Mosaic GPU (sm_90) lowering incl. the register decode, without a GPU.

    PTX generation and ptxas run only when a GPU compiles the module.
    """
    text = _lower_cuda(m, n, k, cfg, layout)
    assert "mosaic_gpu" in text


def test_lowering_reports_shared_memory_overflow():
    cfg = GM.MosaicGemvConfig(block_n=256, block_k=2048, stages=4)
    with pytest.raises(ValueError, match="shared memory"):
        _lower_cuda(1, 1024, 2048, cfg)
