"""LM head: every tier and format against a float64 numpy reference built straight from the
weight's leaves, bit-equality of a row's logits across row counts and tiers (the verify pass
must score a row exactly as the single-row decode does), the transposed verify copy's layout and
its padding, soft-cap, BF16 logits, the reduced draft vocab, the embedding and the factories.

Tolerance. With F32 accumulation, a computed logit differs from the exact one by at most
``gamma_n * sum_k |x_k w_nk|`` (``gamma_n = n u / (1 - n u)``, ``u = 2^-24``), n counting the
roundings on the way: H - 1 additions, one per product (F32 activations), and for quantised
heads one scale multiply per K-tile plus the tile additions. ``n = H + 2 KB + 2`` covers every
format; it is a bound, not a fitted number, so a real defect (a wrong scale, a swapped nibble, a
padded column) lands orders of magnitude outside it.
"""

import functools
import importlib

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mtpjax.config import LMHeadConfig
from mtpjax.head import (
    Bf16VerifyWeight,
    Fp8BlockVerifyWeight,
    Fp8RowVerifyWeight,
    HeadTier,
    LMHeadParams,
    Nvfp4VerifyWeight,
    build_verify_copy,
    embed,
    from_arrays,
    head_tier,
    init_lm_head,
    lm_head,
    registered_verify_kernels,
    verify_matmul_reference,
    with_verify_copy,
)
from mtpjax.weights import (
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Nvfp4Weight,
    WeightFormat,
    quantize,
)

H = 208  # two K-tiles for block-128 FP8 (the second ragged), 13 NVFP4 blocks
V = 1021  # prime: ragged 128-row tiles, a padded verify copy (Vp = 1024)
V_DRAFT = 300
KB = -(-H // 128)
FORMATS = ("bf16", "fp8", "fp8_block", "nvfp4")
CFG = LMHeadConfig(vocab_size=V, hidden_size=H)
# The module, not the function of the same name that mtpjax.head exports.
lm_head_module = importlib.import_module("mtpjax.head.lm_head")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


# ---------------------------------------------------------------------------------------------
# Independent references.


def _dequant64(w):
    """Float64 [N, K] straight from the leaves, per DESIGN §3 (no library code)."""
    if isinstance(w, Bf16Weight):
        return np.asarray(w.w).astype(np.float64)
    if isinstance(w, Fp8RowWeight):
        return np.asarray(w.q).astype(np.float64) * np.asarray(w.scale, np.float64)[:, None]
    if isinstance(w, Fp8BlockWeight):
        n, k = w.shape
        s = np.repeat(np.repeat(np.asarray(w.scale_inv, np.float64), 128, 0), 128, 1)
        return np.asarray(w.q).astype(np.float64) * s[:n, :k]
    packed = np.asarray(w.packed)
    codes = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
    s = np.repeat(np.asarray(w.scale).astype(np.float64), 16, axis=1)
    return E2M1[codes] * s * float(w.scale_2)


def _reference(hidden, w):
    """(logits, error bound) in float64 for hidden [M, H] (rounded to its own dtype)."""
    x = np.asarray(hidden).astype(np.float64)
    w64 = _dequant64(w)
    n = H + 2 * KB + 2
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    return x @ w64.T, gamma * (np.abs(x) @ np.abs(w64).T)


def _assert_within(got, ref, bound):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    excess = np.abs(got - ref) - bound
    assert excess.max() <= 0, f"error exceeds the bound by {excess.max():.3g}"


# ---------------------------------------------------------------------------------------------
# Fixtures.


@functools.cache
def _params(fmt: str, copy: bool = True) -> LMHeadParams:
    rng = np.random.default_rng(sum(map(ord, fmt)))
    w = rng.standard_normal((V, H)).astype(np.float32) * (2.0 / np.sqrt(H))
    e = rng.standard_normal((V, H)).astype(np.float32)
    params = from_arrays(CFG, lm_head=w, embedding=e, precision=fmt)
    return with_verify_copy(params) if copy else params


@functools.cache
def _hidden(dtype: str, rows: int = 100, seed: int = 0) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal((rows, H)).astype(np.float32)
    return jnp.asarray(x, dtype)


def _walk_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _walk_eqns(sub)


# ---------------------------------------------------------------------------------------------
# Tiers.


@pytest.mark.parametrize(
    "rows, tier",
    [
        (0, HeadTier.GEMV),
        (1, HeadTier.GEMV),
        (2, HeadTier.BATCHED_GEMV),
        (8, HeadTier.BATCHED_GEMV),
        (9, HeadTier.VERIFY_GEMM),
        (96, HeadTier.VERIFY_GEMM),
        (97, HeadTier.GEMM),
        (4096, HeadTier.GEMM),
    ],
)
def test_head_tier_boundaries(rows, tier):
    assert head_tier(rows) is tier


@pytest.mark.parametrize("rows", [-1, 2.0, True])
def test_head_tier_rejects_bad_rows(rows):
    with pytest.raises(ValueError, match="non-negative integer"):
        head_tier(rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 40, 100])  # one per tier: gemv, batched, verify, gemm
def test_logits_match_float64_reference(fmt, rows):
    params = _params(fmt)
    x = _hidden("bfloat16")[:rows]
    got = lm_head(params, x, cfg=CFG)
    assert got.dtype == jnp.float32 and got.shape == (rows, V)
    _assert_within(got, *_reference(x, params.weight))


@pytest.mark.parametrize("fmt", FORMATS)
def test_f32_hidden_is_projected_in_f32(fmt):
    # F32 activations are not rounded to BF16 first: the bound holds against the F32 values,
    # and would fail by ~1e-3 if they were rounded.
    params = _params(fmt)
    x = _hidden("float32")[:17]
    _assert_within(lm_head(params, x, cfg=CFG), *_reference(x, params.weight))  # shares a trace


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_row_logits_do_not_depend_on_row_count(fmt, dtype):
    params = _params(fmt)
    x = _hidden(dtype)
    full = np.asarray(lm_head(params, x, cfg=CFG))  # 100 rows: GEMM
    for rows in (2, 17, 40):  # batched GEMV, ragged and whole verify-sized row counts
        np.testing.assert_array_equal(np.asarray(lm_head(params, x[:rows], cfg=CFG)), full[:rows])
    for r in (0, 13, 57, 99):  # every row as the single-row decode head scores it
        np.testing.assert_array_equal(
            np.asarray(lm_head(params, x[r : r + 1], cfg=CFG))[0], full[r]
        )


@pytest.mark.parametrize("tier", list(HeadTier))
def test_forced_tiers_agree_bitwise(tier):
    params = _params("nvfp4")
    x = _hidden("float32")
    forced = lm_head(params, x[:40], cfg=CFG, tier=tier)
    np.testing.assert_array_equal(np.asarray(forced), np.asarray(lm_head(params, x, cfg=CFG))[:40])


def test_verify_tier_without_copy_falls_back_to_gemm():
    x = _hidden("bfloat16")[:40]
    with_copy = lm_head(_params("nvfp4"), x, cfg=CFG)
    without = lm_head(_params("nvfp4", copy=False), x, cfg=CFG)
    np.testing.assert_array_equal(np.asarray(with_copy), np.asarray(without))
    with pytest.raises(ValueError, match="with_verify_copy"):
        lm_head(_params("nvfp4", copy=False), x, cfg=CFG, tier="verify_gemm")


def test_leading_dims_and_zero_rows():
    params = _params("bf16")
    x = _hidden("bfloat16")[:6]
    flat = np.asarray(lm_head(params, x, cfg=CFG))
    nested = lm_head(params, x.reshape(2, 3, H), cfg=CFG)
    assert nested.shape == (2, 3, V)
    np.testing.assert_array_equal(np.asarray(nested).reshape(6, V), flat)
    assert lm_head(params, x[:0], cfg=CFG).shape == (0, V)


def test_bad_inputs_raise_clear_errors():
    params = _params("bf16")
    with pytest.raises(ValueError, match="does not end in H"):
        lm_head(params, jnp.zeros((2, H + 1)), cfg=CFG)
    with pytest.raises(TypeError, match="floating-point"):
        lm_head(params, jnp.zeros((2, H), jnp.int32), cfg=CFG)
    with pytest.raises(ValueError, match=r"expected \[V, H\]"):
        lm_head(params, jnp.zeros((2, H)), cfg=LMHeadConfig(vocab_size=V + 1, hidden_size=H))
    with pytest.raises(ValueError, match="unknown implementation"):
        lm_head(params, jnp.zeros((2, H)), cfg=CFG, implementation="cuda")
    with pytest.raises(ValueError, match="unknown tier"):
        lm_head(params, jnp.zeros((2, H)), cfg=CFG, tier="fast")


# ---------------------------------------------------------------------------------------------
# Options: soft-cap, BF16 logits, the reduced draft vocab.


def test_softcap_is_applied_in_f32_before_the_cast():
    params = _params("bf16")
    x = _hidden("bfloat16")[:9]
    cap = 3.0
    cfg = LMHeadConfig(vocab_size=V, hidden_size=H, logit_softcap=cap)
    got = np.asarray(lm_head(params, x, cfg=cfg), np.float64)
    ref, bound = _reference(x, params.weight)
    # tanh has slope <= 1, so the pre-cap bound carries over; a few ulps of cap for tanh itself.
    _assert_within(got, cap * np.tanh(ref / cap), bound + 8 * 2.0**-24 * cap)
    assert np.abs(got).max() <= cap and np.abs(ref).max() > 2 * cap  # the cap really bites
    bf16_cfg = LMHeadConfig(vocab_size=V, hidden_size=H, logit_softcap=cap, f32_logits=False)
    got_bf16 = lm_head(params, x, cfg=bf16_cfg)
    assert got_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(got_bf16), np.asarray(lm_head(params, x, cfg=cfg)).astype(ml_dtypes.bfloat16)
    )


@pytest.mark.parametrize("rows", [1, 40])
def test_bf16_logits_are_the_f32_logits_rounded(rows):
    params = _params("fp8")
    x = _hidden("bfloat16")[:rows]
    cfg = LMHeadConfig(vocab_size=V, hidden_size=H, f32_logits=False)
    got = lm_head(params, x, cfg=cfg)
    assert got.dtype == jnp.bfloat16
    f32 = np.asarray(lm_head(params, x, cfg=CFG))
    np.testing.assert_array_equal(np.asarray(got), f32.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 40])
def test_draft_vocab_computes_only_the_first_rows(fmt, rows):
    params = _params(fmt)
    cfg = LMHeadConfig(vocab_size=V, hidden_size=H, draft_vocab_size=V_DRAFT)
    x = _hidden("bfloat16")[:rows]
    draft = lm_head(params, x, cfg=cfg, draft=True)
    assert draft.shape == (rows, V_DRAFT)
    np.testing.assert_array_equal(
        np.asarray(draft), np.asarray(lm_head(params, x, cfg=CFG))[:, :V_DRAFT]
    )
    assert lm_head(params, x, cfg=cfg).shape == (rows, V)  # the target's head stays full
    # Not computed-then-sliced: every dot in the program produces V' columns.
    jaxpr = jax.make_jaxpr(lambda p, h: lm_head(p, h, cfg=cfg, draft=True))(params, x)
    dots = [e for e in _walk_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.shape[-1] == V_DRAFT for e in dots)


# ---------------------------------------------------------------------------------------------
# The transposed verify copy.


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_copy_layout(fmt):
    w = _params(fmt).weight
    vw = build_verify_copy(w)
    vp = 1024

    def t(a, rows):  # numpy: pad rows with zeros, transpose
        a = np.asarray(a)
        out = np.zeros((rows, *a.shape[1:]), a.dtype)
        out[: a.shape[0]] = a
        return out.T

    if fmt == "bf16":
        assert isinstance(vw, Bf16VerifyWeight) and vw.wt.shape == (H, vp)
        np.testing.assert_array_equal(np.asarray(vw.wt), t(w.w, vp))
    elif fmt == "fp8":
        assert isinstance(vw, Fp8RowVerifyWeight) and vw.qt.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(vw.qt), t(w.q, vp))
        np.testing.assert_array_equal(np.asarray(vw.scale), t(w.scale, vp))
    elif fmt == "fp8_block":
        assert isinstance(vw, Fp8BlockVerifyWeight) and vw.scale_inv_t.shape == (KB, vp // 128)
        np.testing.assert_array_equal(np.asarray(vw.qt), t(w.q, vp))
        np.testing.assert_array_equal(np.asarray(vw.scale_inv_t), t(w.scale_inv, vp // 128))
    else:
        assert isinstance(vw, Nvfp4VerifyWeight) and vw.packed_t.shape == (H // 2, vp)
        np.testing.assert_array_equal(np.asarray(vw.packed_t), t(w.packed, vp))
        np.testing.assert_array_equal(np.asarray(vw.scale_t), t(w.scale, vp))
        assert float(vw.scale_2) == float(w.scale_2)
    assert (vw.hidden_size, vw.padded_vocab) == (H, vp)


@pytest.mark.parametrize(
    "fmt, dtype",
    [(f, "bfloat16") for f in FORMATS] + [("fp8_block", "float32"), ("nvfp4", "float32")],
)
def test_verify_reference_matches_float64(fmt, dtype):
    params = _params(fmt)
    x = _hidden(dtype)[:40]
    ref, bound = _reference(x, params.weight)
    got = verify_matmul_reference(x, params.verify_weight, n_cols=V)
    assert got.dtype == jnp.float32
    _assert_within(got, ref, bound)
    part = verify_matmul_reference(x, params.verify_weight, n_cols=V_DRAFT)
    _assert_within(part, ref[:, :V_DRAFT], bound[:, :V_DRAFT])


def _poison_padding(vw):
    """The copy with every padded column set to huge values (NaN where the dtype has it)."""

    def fill(a, value):
        return a.at[..., V:].set(jnp.asarray(value, a.dtype))

    if isinstance(vw, Bf16VerifyWeight):
        return Bf16VerifyWeight(wt=fill(vw.wt, np.nan))
    if isinstance(vw, Fp8RowVerifyWeight):
        return Fp8RowVerifyWeight(qt=fill(vw.qt, 448.0), scale=fill(vw.scale, np.nan))
    if isinstance(vw, Fp8BlockVerifyWeight):
        return Fp8BlockVerifyWeight(qt=fill(vw.qt, np.nan), scale_inv_t=vw.scale_inv_t)
    return Nvfp4VerifyWeight(
        packed_t=fill(vw.packed_t, 0x77), scale_t=fill(vw.scale_t, 448.0), scale_2=vw.scale_2
    )


@pytest.fixture
def oracle_kernels(monkeypatch):
    """Registers verify_matmul_reference as every format's verify 'kernel', recording calls."""
    calls = []

    def kernel(x, vw, *, n_cols, interpret):
        calls.append((x.shape, type(vw).__name__, n_cols, interpret))
        return verify_matmul_reference(x, vw, n_cols=n_cols)

    for fmt in WeightFormat:
        monkeypatch.setitem(lm_head_module._VERIFY_KERNELS, fmt, kernel)
    return calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_kernel_seam_reads_the_copy_and_never_its_padding(fmt, oracle_kernels):
    params = _params(fmt)
    poisoned = LMHeadParams(
        weight=params.weight,
        embedding=params.embedding,
        verify_weight=_poison_padding(params.verify_weight),
    )
    x = _hidden("bfloat16")[:40]
    got = lm_head(poisoned, x, cfg=CFG, tier="verify_gemm", implementation="pallas")
    assert oracle_kernels == [((40, H), type(params.verify_weight).__name__, V, True)]
    assert got.shape == (40, V) and np.isfinite(np.asarray(got)).all()
    _assert_within(got, *_reference(x, params.weight))
    cfg = LMHeadConfig(vocab_size=V, hidden_size=H, draft_vocab_size=V_DRAFT)
    draft = lm_head(poisoned, x, cfg=cfg, draft=True, tier="verify_gemm", implementation="pallas")
    assert draft.shape == (40, V_DRAFT)
    assert oracle_kernels[-1][2] == V_DRAFT
    # Off-GPU, "auto" keeps the XLA path: the registered kernel is not called.
    lm_head(params, x[:41], cfg=CFG)
    assert len(oracle_kernels) == 2


def test_default_tier_reads_the_copy_only_for_auto_verify_kernels(oracle_kernels, monkeypatch):
    # The registration mtpjax.kernels makes: every format verifies faster from the row-major
    # weight, so no copy is worth building for the default tiers.
    assert not any(lm_head_module.verify_copy_used(f) for f in WeightFormat)
    monkeypatch.setattr(lm_head_module, "_FORCED_ONLY", {WeightFormat.BF16})
    x = _hidden("bfloat16")[:37]
    gemm = lm_head(_params("bf16"), x, cfg=CFG, tier="gemm", implementation="pallas")
    got = lm_head(_params("bf16"), x, cfg=CFG, implementation="pallas")
    assert oracle_kernels == []  # BF16 is forced-only here: the row-major GEMM tier ran
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gemm))
    lm_head(_params("bf16"), x, cfg=CFG, tier="verify_gemm", implementation="pallas")
    lm_head(_params("fp8_block"), x, cfg=CFG, implementation="pallas")
    assert [call[1] for call in oracle_kernels] == ["Bf16VerifyWeight", "Fp8BlockVerifyWeight"]


def test_pallas_without_a_verify_kernel_raises(monkeypatch):
    monkeypatch.delitem(lm_head_module._VERIFY_KERNELS, WeightFormat.BF16, raising=False)
    assert WeightFormat.BF16 not in registered_verify_kernels()
    with pytest.raises(NotImplementedError, match="register_verify_kernel"):
        x = _hidden("bfloat16")[:12]
        lm_head(_params("bf16"), x, cfg=CFG, tier="verify_gemm", implementation="pallas")


def test_verify_copy_validation():
    params = _params("bf16")
    other = build_verify_copy(_params("fp8").weight)
    with pytest.raises(TypeError, match="rebuild it with with_verify_copy"):
        LMHeadParams(weight=params.weight, embedding=params.embedding, verify_weight=other)
    with pytest.raises(ValueError, match="multiple of 128"):
        Bf16VerifyWeight(wt=jnp.zeros((H, 1000), jnp.bfloat16))
    with pytest.raises(ValueError, match="multiple of 128"):
        build_verify_copy(params.weight, padded_vocab=1000)
    with pytest.raises(ValueError, match="n_cols"):
        verify_matmul_reference(_hidden("bfloat16")[:2], params.verify_weight, n_cols=1025)


# ---------------------------------------------------------------------------------------------
# Embedding and factories.


def test_embed_scales_and_clamps():
    params = _params("bf16")
    table = np.asarray(params.embedding).astype(np.float32)
    tokens = np.array([[0, 5, V - 1], [17, -1, V]], np.int32)
    cfg = LMHeadConfig(vocab_size=V, hidden_size=H, embedding_scale=float(np.sqrt(H)))
    got = embed(params, tokens, cfg=cfg)
    assert got.dtype == jnp.float32 and got.shape == (2, 3, H)
    rows = table[np.clip(tokens, 0, V - 1)]
    np.testing.assert_array_equal(np.asarray(got), rows * np.float32(np.sqrt(H)))
    np.testing.assert_array_equal(np.asarray(embed(params, tokens, cfg=CFG)), rows)
    with pytest.raises(TypeError, match="integer token ids"):
        embed(params, jnp.zeros((2,)), cfg=CFG)


def test_tied_head_is_the_embedding():
    cfg = LMHeadConfig(vocab_size=V, hidden_size=H, tie_word_embeddings=True)
    e = np.random.default_rng(3).standard_normal((V, H)).astype(np.float32)
    params = from_arrays(cfg, embedding=e, precision="fp8")
    assert isinstance(params.weight, Fp8RowWeight)
    want = quantize(jnp.asarray(e, jnp.bfloat16), "fp8")
    np.testing.assert_array_equal(np.asarray(params.weight.q), np.asarray(want.q))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        from_arrays(CFG, embedding=e)


def test_from_arrays_keeps_stored_weights_and_checks_them():
    e = np.zeros((V, H), np.float32)
    stored = _params("nvfp4").weight
    params = from_arrays(CFG, lm_head=stored, embedding=e)
    assert params.weight is stored and params.embedding.dtype == jnp.bfloat16
    assert from_arrays(CFG, lm_head=stored, embedding=e, precision="FP4").weight is stored
    with pytest.raises(ValueError, match="re-quantising"):
        from_arrays(CFG, lm_head=stored, embedding=e, precision="bf16")
    with pytest.raises(ValueError, match=r"unknown LM head precision.*fp8_block"):
        from_arrays(CFG, lm_head=e, embedding=e, precision="int4")
    with pytest.raises(ValueError, match=r"expected \[V, H\]"):
        from_arrays(CFG, lm_head=e[:-1], embedding=e)
    with pytest.raises(ValueError, match="final_norm"):
        from_arrays(CFG, lm_head=e, embedding=e, final_norm=np.zeros(H + 1))


@pytest.mark.parametrize(
    "precision, kind",
    [
        ("bf16", Bf16Weight),
        ("fp8", Fp8RowWeight),
        ("fp8_block", Fp8BlockWeight),
        ("nvfp4", Nvfp4Weight),
    ],
)
def test_init_lm_head(precision, kind):
    params = init_lm_head(CFG, key=jax.random.PRNGKey(0), precision=precision, verify_copy=True)
    assert isinstance(params.weight, kind) and params.weight.shape == (V, H)
    assert params.embedding.dtype == jnp.bfloat16 and params.embedding.shape == (V, H)
    assert params.verify_weight.format is params.weight.format
    leaves, treedef = jax.tree.flatten(params)
    assert jax.tree.unflatten(treedef, leaves).weight.shape == (V, H)
