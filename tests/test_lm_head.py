"""LM head: every format against a float64 numpy reference built straight from the weight's
leaves, bit-equality of a row's logits across row counts (the verify pass must score a row
exactly as the single-row decode does), soft-cap, BF16 logits, the reduced draft vocab, the
embedding and the factories.

Tolerance. With F32 accumulation, a computed logit differs from the exact one by at most
``gamma_n * sum_k |x_k w_nk|`` (``gamma_n = n u / (1 - n u)``, ``u = 2^-24``), n counting the
roundings on the way: H - 1 additions, one per product (F32 activations), and for quantised
heads one scale multiply per K-tile plus the tile additions. ``n = H + 2 KB + 2`` covers every
format; it is a bound, not a fitted number, so a real defect (a wrong scale, a swapped nibble, a
padded column) lands orders of magnitude outside it.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mtpjax.config import LMHeadConfig
from mtpjax.head import LMHeadParams, embed, from_arrays, init_lm_head, lm_head
from mtpjax.weights import Bf16Weight, Fp8BlockWeight, Fp8RowWeight, Nvfp4Weight, quantize

H = 208  # two K-tiles for block-128 FP8 (the second ragged), 13 NVFP4 blocks
V = 1021  # prime: ragged 128-row tiles
V_DRAFT = 300
KB = -(-H // 128)
FORMATS = ("bf16", "fp8", "fp8_block", "nvfp4")
CFG = LMHeadConfig(vocab_size=V, hidden_size=H)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


# ---------------------------------------------------------------------------------------------
# Independent references.


def _dequant64(w):
    """Float64 [N, K] straight from the leaves (no library code)."""
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
def _params(fmt: str) -> LMHeadParams:
    rng = np.random.default_rng(sum(map(ord, fmt)))
    w = rng.standard_normal((V, H)).astype(np.float32) * (2.0 / np.sqrt(H))
    e = rng.standard_normal((V, H)).astype(np.float32)
    return from_arrays(CFG, lm_head=w, embedding=e, precision=fmt)


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
# Projection.


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 40, 100])  # decode, batch, verify and prefill sizes
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
    full = np.asarray(lm_head(params, x, cfg=CFG))  # 100 rows
    for rows in (2, 17, 40):  # batch, ragged and whole verify-sized row counts
        np.testing.assert_array_equal(np.asarray(lm_head(params, x[:rows], cfg=CFG)), full[:rows])
    for r in (0, 13, 57, 99):  # every row as the single-row decode head scores it
        np.testing.assert_array_equal(
            np.asarray(lm_head(params, x[r : r + 1], cfg=CFG))[0], full[r]
        )


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
    params = init_lm_head(CFG, key=jax.random.PRNGKey(0), precision=precision)
    assert isinstance(params.weight, kind) and params.weight.shape == (V, H)
    assert params.embedding.dtype == jnp.bfloat16 and params.embedding.shape == (V, H)
    leaves, treedef = jax.tree.flatten(params)
    assert jax.tree.unflatten(treedef, leaves).weight.shape == (V, H)


def test_implementation_strings_share_one_program():
    """The implementation is parsed before the jitted body: "AUTO", "auto" and the enum hit the
    same compiled program."""
    from mtpjax.head import _lm_head as module
    from pallas_kernels import Implementation

    params, x = _params("bf16"), _hidden("bfloat16")[:3]
    lm_head(params, x, cfg=CFG, implementation=Implementation.AUTO)
    size = module._lm_head._cache_size()
    lm_head(params, x, cfg=CFG, implementation="AUTO")
    lm_head(params, x, cfg=CFG, implementation="auto")
    assert module._lm_head._cache_size() == size
