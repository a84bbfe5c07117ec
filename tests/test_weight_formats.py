"""Weight formats: E2M1 tables and packing, quantise/dequantise against independent numpy
references (ml_dtypes casts, float64), pytree behaviour, and the precision rules."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpjax.weights import (
    E2M1_VALUES,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Nvfp4Weight,
    Precision,
    Projection,
    WeightFormat,
    decode_e2m1,
    dequantize,
    encode_e2m1,
    pack_e2m1,
    parse_precision,
    parse_projection,
    projection_format,
    quantize,
    supports_drafter_prefill,
    unpack_e2m1,
)

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
FORMATS = ("bf16", "fp8", "fp8_block", "nvfp4")


def _bits(a):
    """Raw bytes of an array (bit-exact comparison, -0 != 0, NaN == NaN)."""
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


def _normal(seed, shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(F32)


# ---------------------------------------------------------------------------------------------
# Independent numpy references.


def _e2m1_codes_np(x):
    """ModelOpt's E2M1 encoding via ml_dtypes: magnitude bits from an RNE, saturating cast."""
    mag = np.abs(x).astype(E2M1).view(np.uint8) & 0x7
    return (mag | ((x < 0).astype(np.uint8) << 3)).astype(np.uint8)


def _unpack_np(packed):
    packed = np.asarray(packed)
    out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def _nvfp4_np(w):
    """ModelOpt NVFP4 weight quantisation in numpy f32 + ml_dtypes (per matrix)."""
    w = np.asarray(w, F32)
    *lead, n, k = w.shape
    amax = np.abs(w).max(axis=(-2, -1))
    scale_2 = (amax / F32(6.0 * 448.0)).astype(F32)
    scale_2 = np.where(scale_2 > 0, scale_2, F32(1)).astype(F32)
    blocks = w.reshape(*lead, n, k // 16, 16)
    per_block = (np.abs(blocks).max(-1) / (F32(6) * scale_2[..., None, None])).astype(F32)
    per_block[per_block == 0] = 1.0
    scale = per_block.astype(E4M3)
    eff = (scale.astype(F32) * scale_2[..., None, None]).astype(F32)
    scaled = (blocks / eff[..., None]).astype(F32).reshape(*lead, n, k)
    codes = _e2m1_codes_np(scaled)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale, scale_2


def _fp8_row_np(w):
    amax = np.abs(w).max(-1)
    scale = (amax / F32(448)).astype(F32)
    scale = np.where(scale > 0, scale, F32(1)).astype(F32)
    return (w / scale[..., None]).astype(E4M3), scale


def _fp8_block_np(w):
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    scale = np.ones((nb, kb), F32)
    q = np.zeros((n, k), E4M3)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = F32(np.abs(tile).max() / F32(448))
            s = s if s > 0 else F32(1)
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (tile / s).astype(E4M3)
    return q, scale


def _dequant64(qw):
    """Float64 dequantisation straight from the leaves."""
    if isinstance(qw, Bf16Weight):
        return np.asarray(qw.w).astype(np.float64)
    if isinstance(qw, Fp8RowWeight):
        return np.asarray(qw.q).astype(np.float64) * np.asarray(qw.scale, np.float64)[..., None]
    if isinstance(qw, Fp8BlockWeight):
        n, k = qw.shape[-2:]
        s = np.asarray(qw.scale_inv, np.float64)
        s = np.repeat(np.repeat(s, 128, axis=-2), 128, axis=-1)[..., :n, :k]
        return np.asarray(qw.q).astype(np.float64) * s
    values = _unpack_np(qw.packed).view(E2M1).astype(np.float64)
    s = np.repeat(np.asarray(qw.scale).astype(np.float64), 16, axis=-1)
    return values * s * np.asarray(qw.scale_2, np.float64)[..., None, None]


def _e4m3_half_ulp(v):
    """Half the E4M3 spacing at |v| (3 mantissa bits; subnormal spacing 2^-9 below 2^-6)."""
    v = np.abs(v)
    exp = np.floor(np.log2(np.maximum(v, 2.0**-6)))
    return 2.0 ** (exp - 3) / 2


def _e2m1_half_spacing(v):
    """Half the E2M1 spacing at |v|: 0.25 below 2, 0.5 in [2, 4), 1 from 4 (incl. clipping)."""
    v = np.abs(v)
    return np.where(v < 2, 0.25, np.where(v < 4, 0.5, 1.0))


# One f32 rounding of the scaled value (w / scale) before the narrow cast.
F32_REL = 2.0**-24


# ---------------------------------------------------------------------------------------------
# E2M1 codes and nibble packing.


def test_e2m1_table_matches_ml_dtypes():
    want = np.arange(16, dtype=np.uint8).view(E2M1).astype(F32)
    np.testing.assert_array_equal(E2M1_VALUES, want)
    np.testing.assert_array_equal(np.signbit(E2M1_VALUES), np.signbit(want))
    got = np.asarray(decode_e2m1(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(got, want)
    got_bf16 = np.asarray(decode_e2m1(jnp.arange(16, dtype=jnp.uint8), jnp.bfloat16))
    np.testing.assert_array_equal(got_bf16.astype(F32), want)


def test_encode_e2m1_matches_ml_dtypes_rounding():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    x = np.concatenate(
        [
            np.linspace(-8, 8, 4097, dtype=F32),
            ties,
            -ties,
            np.nextafter(ties, F32(0)),
            np.nextafter(ties, F32(10)),
            np.array([6.0, 6.5, 100.0, -1e9, 1e-30, -1e-30], F32),
            _normal(0, 1000, 3.0),
        ]
    )
    got = np.asarray(encode_e2m1(jnp.asarray(x)))
    np.testing.assert_array_equal(got, _e2m1_codes_np(x))
    # Ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    np.testing.assert_array_equal(
        E2M1_VALUES[np.asarray(encode_e2m1(jnp.asarray(ties)))], [0, 1, 1, 2, 2, 4, 4]
    )


def test_nibble_order_low_nibble_first():
    codes = jnp.array([[1, 7, 9, 15]], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(pack_e2m1(codes)), [[0x71, 0xF9]])
    # A hand-built weight: byte 0x71 -> element 0 is code 1 (0.5), element 1 is code 7 (6).
    packed = np.zeros((1, 8), np.uint8)
    packed[0, 0] = 0x71
    w = Nvfp4Weight(
        packed=jnp.asarray(packed),
        scale=jnp.ones((1, 1), jnp.float8_e4m3fn),
        scale_2=jnp.float32(1.0),
    )
    deq = np.asarray(dequantize(w))
    np.testing.assert_array_equal(deq[0, :3], [0.5, 6.0, 0.0])


@settings(max_examples=20, deadline=None)
@given(
    lead=st.sampled_from([(), (3,), (2, 3)]),
    half_k=st.sampled_from([1, 8, 13]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(lead, half_k, seed):
    codes = np.random.default_rng(seed).integers(0, 16, (*lead, 2 * half_k), dtype=np.uint8)
    packed = pack_e2m1(jnp.asarray(codes))
    assert packed.shape == (*lead, half_k)
    np.testing.assert_array_equal(np.asarray(unpack_e2m1(packed)), codes)
    np.testing.assert_array_equal(_unpack_np(packed), codes)


def test_unpack_pack_every_byte():
    every = jnp.arange(256, dtype=jnp.uint8).reshape(4, 64)
    np.testing.assert_array_equal(np.asarray(pack_e2m1(unpack_e2m1(every))), np.asarray(every))


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="even last dim"):
        pack_e2m1(jnp.zeros((2, 3), jnp.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_e2m1(jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="uint8"):
        unpack_e2m1(jnp.zeros((2, 4), jnp.int8))


# ---------------------------------------------------------------------------------------------
# Quantisation against references and format-derived error bounds.


def test_bf16_round_trip():
    w = _normal(1, (33, 70))
    qw = quantize(w, "bf16")
    np.testing.assert_array_equal(
        np.asarray(qw.w).view(np.uint16), w.astype(ml_dtypes.bfloat16).view(np.uint16)
    )
    rel = np.abs(np.asarray(dequantize(qw)) - w) / np.abs(w)
    assert rel.max() <= 2.0**-8


@pytest.mark.parametrize("magnitude", [1.0, 1e6, 1e-6])
def test_fp8_row_matches_ml_dtypes_and_bound(magnitude):
    w = _normal(2, (37, 50), magnitude)
    w[3] = 0.0  # a zero row
    qw = quantize(w, "fp8")
    q_ref, s_ref = _fp8_row_np(w)
    np.testing.assert_array_equal(np.asarray(qw.scale), s_ref)
    np.testing.assert_array_equal(np.asarray(qw.q).view(np.uint8), q_ref.view(np.uint8))
    assert np.asarray(qw.scale)[3] == 1.0 and not np.asarray(qw.q).astype(F32)[3].any()
    scale = np.asarray(qw.scale, np.float64)[:, None]
    v = w / scale
    err = np.abs(_dequant64(qw) - w)
    assert np.all(err <= scale * (_e4m3_half_ulp(v) + np.abs(v) * F32_REL))
    # Relative error of the largest element in each row: E4M3 half-ulp at 448 is 2^-4 relative.
    i = np.argmax(np.abs(w), axis=1)
    big = np.abs(w[np.arange(37), i])
    rel = err[np.arange(37), i][big > 0] / big[big > 0]
    assert rel.max() <= 2.0**-4


def test_fp8_block_ragged_edges_match_reference():
    w = _normal(3, (200, 300))
    w[128:, 256:] *= 1e-3  # the ragged corner tile must see only its own values
    w[:128, 128:256] = 0.0  # a zero tile
    w[128:, :128] = 3.7  # an all-equal tile
    qw = quantize(w, "fp8_block")
    assert qw.scale_inv.shape == (2, 3)
    q_ref, s_ref = _fp8_block_np(w)
    np.testing.assert_array_equal(np.asarray(qw.scale_inv), s_ref)
    np.testing.assert_array_equal(np.asarray(qw.q).view(np.uint8), q_ref.view(np.uint8))
    s = np.asarray(qw.scale_inv)
    assert s[1, 2] == F32(np.abs(w[128:, 256:]).max() / F32(448))
    assert s[0, 1] == 1.0 and not np.asarray(qw.q).astype(F32)[:128, 128:256].any()
    np.testing.assert_array_equal(np.asarray(qw.q).astype(F32)[128:, :128], 448.0)
    assert s[1, 0] == F32(F32(3.7) / F32(448))
    full = np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)[:200, :300]
    v = w / full
    err = np.abs(_dequant64(qw) - w)
    assert np.all(err <= full * (_e4m3_half_ulp(v) + np.abs(v) * F32_REL))


@pytest.mark.parametrize("magnitude", [1.0, 1e6, 1e-6])
def test_fp8_block_far_beyond_e4m3_range(magnitude):
    w = _normal(4, (130, 140), magnitude)
    qw = quantize(w, "fp8_block")
    deq = _dequant64(qw)
    assert np.isfinite(deq).all()
    q_ref, s_ref = _fp8_block_np(w)
    np.testing.assert_array_equal(np.asarray(qw.q).view(np.uint8), q_ref.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qw.scale_inv), s_ref)


@pytest.mark.parametrize("shape", [(16, 64), (3, 32, 48), (2, 2, 8, 32)])
def test_nvfp4_matches_modelopt_reference_bit_for_bit(shape):
    w = _normal(5, shape)
    qw = quantize(w, "nvfp4")
    packed, scale, scale_2 = _nvfp4_np(w)
    np.testing.assert_array_equal(np.asarray(qw.scale_2), scale_2)
    np.testing.assert_array_equal(np.asarray(qw.scale).view(np.uint8), scale.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qw.packed), packed)


@pytest.mark.parametrize("magnitude", [1.0, 1e6, 1e-6])
def test_nvfp4_error_bound(magnitude):
    w = _normal(6, (24, 96), magnitude)
    w[:, :16] *= 1e-2  # blocks well below the tensor amax still get a normal E4M3 scale
    qw = quantize(w, "nvfp4")
    packed, scale, scale_2 = _nvfp4_np(w)
    np.testing.assert_array_equal(np.asarray(qw.packed), packed)
    np.testing.assert_array_equal(np.asarray(qw.scale).view(np.uint8), scale.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qw.scale_2), scale_2)
    eff = np.asarray(qw.scale).astype(np.float64) * np.asarray(qw.scale_2, np.float64)
    eff = np.repeat(eff, 16, axis=-1)
    v = w / eff
    err = np.abs(_dequant64(qw) - w)
    assert np.isfinite(err).all()
    assert np.all(err <= eff * (_e2m1_half_spacing(v) + np.abs(v) * F32_REL))
    # The global scale maps the tensor's amax to E2M1 6 x E4M3 448.
    assert math.isclose(float(qw.scale_2), np.abs(w).max() / 2688.0, rel_tol=2.0**-23)


def test_nvfp4_zero_and_equal_blocks():
    w = _normal(7, (4, 64))
    w[0, :16] = 0.0  # zero block
    w[1, 16:32] = -2.5  # all-equal block
    w[2, 32:48] = 1e-9  # its scale underflows E4M3: stored as zero codes, never inf/NaN
    qw = quantize(w, "nvfp4")
    codes = _unpack_np(qw.packed)
    scale = np.asarray(qw.scale).astype(F32)
    assert scale[0, 0] == 1.0 and not codes[0, :16].any()
    np.testing.assert_array_equal(codes[1, 16:32], 0xF)  # -6: the block maps its amax to 6
    assert scale[2, 2] == 0.0 and not (codes[2, 32:48] & 0x7).any()
    deq = np.asarray(dequantize(qw))
    assert np.isfinite(deq).all()
    np.testing.assert_array_equal(deq[0, :16], 0.0)
    np.testing.assert_array_equal(deq[2, 32:48], 0.0)
    eff = float(scale[1, 1]) * float(qw.scale_2)
    assert np.all(np.abs(deq[1, 16:32] + 2.5) <= eff * (1.0 + 2.5 / eff * F32_REL))


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_tensor(fmt):
    qw = quantize(jnp.zeros((2, 130, 160)), fmt)
    deq = np.asarray(dequantize(qw))
    assert np.isfinite(deq).all() and not deq.any()
    for leaf in jax.tree.leaves(qw):
        assert np.isfinite(np.asarray(leaf).astype(F32)).all()


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4"])
def test_power_of_two_scaling_is_exact(fmt):
    # Scaling the weight by 2^±20 (far outside E4M3) must only move the F32 scales.
    w = _normal(8, (40, 160))
    base = quantize(w, fmt)
    for p in (20, -20):
        scaled = quantize(w * F32(2.0**p), fmt)
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(scaled)):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype == F32:
                np.testing.assert_array_equal(b, a * F32(2.0**p))
            else:
                np.testing.assert_array_equal(_bits(b), _bits(a))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_f32_rounding_of_exact_value(fmt):
    w = _normal(9, (2, 136, 144))
    qw = quantize(w, fmt)
    got = dequantize(qw)
    assert got.dtype == jnp.float32 and got.shape == w.shape
    np.testing.assert_array_equal(np.asarray(got), _dequant64(qw).astype(F32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_equals_per_matrix(fmt):
    w = _normal(10, (3, 136, 160))
    w[1] *= 50.0  # experts with different ranges get their own scales
    stacked = quantize(w, fmt)
    assert stacked.shape == (3, 136, 160)
    assert (stacked.out_features, stacked.in_features) == (136, 160)
    for e in range(3):
        one = quantize(w[e], fmt)
        for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(one)):
            np.testing.assert_array_equal(_bits(a[e]), _bits(b))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_jit_matches_eager(fmt):
    w = _normal(11, (130, 144))
    eager = quantize(w, fmt)
    jitted = jax.jit(quantize, static_argnames="fmt")(w, fmt=fmt)
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_quantize_accepts_bf16_input():
    w = _normal(12, (8, 32)).astype(ml_dtypes.bfloat16)
    qw = quantize(jnp.asarray(w), "NVFP4")
    packed, _, _ = _nvfp4_np(w.astype(F32))
    np.testing.assert_array_equal(np.asarray(qw.packed), packed)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match=r"K = 40"):
        quantize(jnp.ones((4, 40)), "nvfp4")
    with pytest.raises(ValueError, match="bf16, fp8, fp8_block, nvfp4"):
        quantize(jnp.ones((4, 32)), "int4")
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        quantize(jnp.ones((32,)), "fp8")
    with pytest.raises(TypeError, match="floating"):
        quantize(jnp.ones((4, 32), jnp.int32), "fp8")
    assert isinstance(quantize(jnp.ones((4, 32)), WeightFormat.FP8_BLOCK), Fp8BlockWeight)
    assert isinstance(quantize(jnp.ones((4, 32)), "Fp8"), Fp8RowWeight)


# ---------------------------------------------------------------------------------------------
# Pytree behaviour and metadata.


def test_shapes_formats_and_nbytes():
    n, k = 48, 256
    w = _normal(13, (n, k))
    b, r, blk, f4 = (quantize(w, f) for f in FORMATS)
    assert [x.format for x in (b, r, blk, f4)] == list(WeightFormat)
    for x in (b, r, blk, f4):
        assert x.shape == (n, k) and x.out_features == n and x.in_features == k
    assert b.nbytes == n * k * 2
    assert r.nbytes == n * k + 4 * n
    assert blk.nbytes == n * k + 4 * 1 * 2
    assert f4.nbytes == n * k // 2 + n * k // 16 + 4
    stacked = quantize(np.stack([w] * 5), "nvfp4")
    assert stacked.shape == (5, n, k) and stacked.nbytes == 5 * f4.nbytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_pytree_through_jit_vmap_tree_map(fmt):
    w = _normal(14, (4, 16, 32))
    qw = quantize(w, fmt)
    same = jax.jit(lambda t: t)(qw)
    assert type(same) is type(qw)
    np.testing.assert_array_equal(np.asarray(dequantize(same)), np.asarray(dequantize(qw)))
    per_expert = jax.vmap(dequantize)(qw)
    np.testing.assert_array_equal(np.asarray(per_expert), np.asarray(dequantize(qw)))
    first = jax.tree.map(lambda a: a[0], qw)
    assert first.shape == (16, 32)
    shapes = jax.eval_shape(lambda t: t, qw)
    assert shapes.shape == qw.shape
    assert len(jax.tree.leaves(qw)) == {"bf16": 1, "fp8": 2, "fp8_block": 2, "nvfp4": 3}[fmt]


def test_constructor_validation():
    q = jnp.zeros((8, 32), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\)"):
        Fp8RowWeight(q=q, scale=jnp.ones((4,), jnp.float32))
    with pytest.raises(TypeError, match="float32"):
        Fp8RowWeight(q=q, scale=jnp.ones((8,), jnp.bfloat16))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        Fp8BlockWeight(q=jnp.zeros((8, 32)), scale_inv=jnp.ones((1, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"\(1, 1\)"):
        Fp8BlockWeight(q=q, scale_inv=jnp.ones((1, 2), jnp.float32))
    with pytest.raises(TypeError, match="bfloat16"):
        Bf16Weight(w=jnp.zeros((2, 2), jnp.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        Nvfp4Weight(
            packed=jnp.zeros((2, 4), jnp.uint8),
            scale=jnp.ones((2, 1), jnp.float8_e4m3fn),
            scale_2=jnp.float32(1),
        )
    with pytest.raises(ValueError, match=r"scale_2 must have shape \(3,\)"):
        Nvfp4Weight(
            packed=jnp.zeros((3, 2, 8), jnp.uint8),
            scale=jnp.ones((3, 2, 1), jnp.float8_e4m3fn),
            scale_2=jnp.float32(1),
        )


# ---------------------------------------------------------------------------------------------
# Precision names and the per-projection format rule.


def test_parse_precision():
    assert parse_precision("NVFP4") is Precision.NVFP4
    assert parse_precision("fp4") is Precision.NVFP4
    assert parse_precision("Fp8") is Precision.FP8
    assert parse_precision("bf16") is Precision.BF16
    assert parse_precision(Precision.FP8) is Precision.FP8
    for bad in ("int8", "fp16", "", "nvfp4 "):
        with pytest.raises(ValueError, match="nvfp4, fp4, fp8, bf16"):
            parse_precision(bad)


DENSE_HEAD = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_projection_format_dense_nvfp4_rule():
    got = {p: projection_format(p, "nvfp4") for p in DENSE_HEAD}
    nv, bf = WeightFormat.NVFP4, WeightFormat.BF16
    assert got == {
        "fc": bf,
        "q_proj": nv,
        "k_proj": bf,
        "v_proj": bf,
        "o_proj": nv,
        "gate_proj": nv,
        "up_proj": nv,
        "down_proj": nv,
    }
    assert supports_drafter_prefill(got)


def test_projection_format_other_precisions_and_moe():
    moe = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "experts", "shared_expert")
    for p in DENSE_HEAD + moe:
        assert projection_format(p, "fp8") is WeightFormat.FP8
        assert projection_format(p, Precision.BF16) is WeightFormat.BF16
    # An NVFP4 MoE head stores every projection NVFP4, so it cannot prefill.
    moe_nvfp4 = {p: projection_format(p, "nvfp4", dense_ffn=False) for p in moe}
    assert set(moe_nvfp4.values()) == {WeightFormat.NVFP4}
    assert not supports_drafter_prefill(moe_nvfp4)
    assert not supports_drafter_prefill({p: projection_format(p, "fp8") for p in moe})
    assert supports_drafter_prefill({p: projection_format(p, "bf16") for p in moe})
    for prec in ("nvfp4", "fp8", "bf16"):
        for dense in (True, False):
            for p in ("router", "gate", "shared_expert_gate", "mlp.shared_expert_gate.weight"):
                assert projection_format(p, prec, dense_ffn=dense) is WeightFormat.BF16


def test_parse_projection_checkpoint_paths():
    cases = {
        "mtp.fc.weight": Projection.FC,
        "model.layers.61.eh_proj.weight": Projection.FC,
        "model.mtp_layers.0.input_proj.weight": Projection.FC,
        "mtp.layers.0.self_attn.Q_PROJ.weight": Projection.Q_PROJ,
        "mtp.layers.0.mlp.gate.weight": Projection.ROUTER,
        "mtp.layers.0.mlp.gate_proj.weight": Projection.GATE_PROJ,
        "mtp.layers.0.mlp.experts.7.down_proj.weight_scale_inv": Projection.EXPERTS,
        "mtp.layers.0.mlp.experts.gate_up_proj": Projection.EXPERTS,
        "mtp.layers.0.mlp.shared_expert.up_proj.weight": Projection.SHARED_EXPERT,
        "model.layers.92.mlp.shared_experts.down_proj.weight": Projection.SHARED_EXPERT,
        "mtp.layers.0.mlp.shared_expert_gate.weight": Projection.SHARED_EXPERT_GATE,
    }
    for name, role in cases.items():
        assert parse_projection(name) is role, name
    with pytest.raises(ValueError, match="q_proj"):
        parse_projection("mtp.layers.0.self_attn.qkv")


def test_supports_drafter_prefill_needs_fc_k_v():
    bf = WeightFormat.BF16
    assert supports_drafter_prefill({"mtp.fc": bf, "k_proj": "bf16", "v_proj": bf})
    assert not supports_drafter_prefill({"fc": bf, "k_proj": bf, "v_proj": WeightFormat.FP8})
    with pytest.raises(ValueError, match="v_proj"):
        supports_drafter_prefill({"fc": bf, "k_proj": bf})
