"""The kernels the target models' steps run for row invariance: the row norms, the cache
attention, and the GEMV's split-K slices. Each against its reference (and a float64 oracle),
and each row's result bit for bit the same whatever the rows around it: the Pallas kernels in
interpret mode on the CPU, compiled on a GPU (same bodies; the `gpu` ones at real shapes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from mtpjax.layers import attend, attend_cache, rms_norm
from pallas_kernels._cache_attention import triton as CA
from pallas_kernels._linear import triton as T

ON_GPU = jax.default_backend() == "gpu"
KERNEL = "pallas"


# ---- row norms ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [96, 256, 5120])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_kernel_matches_the_reference_and_float64(n, zero_centered):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, 5, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32) * 0.2
    got = pk.rms_norm(x, w, eps=1e-6, zero_centered=zero_centered, implementation=KERNEL)
    ref = pk.rms_norm(x, w, eps=1e-6, zero_centered=zero_centered, implementation="xla")
    x64 = x.astype(np.float64)
    y64 = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6)
    y64 = y64 * ((1 + w) if zero_centered else w)
    np.testing.assert_allclose(got, y64, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(ref, y64, rtol=2e-6, atol=2e-6)


def test_l2_normalize_kernel_matches_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6, 128)).astype(np.float32)
    got = pk.l2_normalize(x, eps=1e-6, implementation=KERNEL)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, x64 / np.sqrt((x64 * x64).sum(-1, keepdims=True) + 1e-6), 2e-6)


@pytest.mark.parametrize("n", [64, 5120])
def test_a_norm_row_is_the_same_alone_and_among_others(n):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((37, n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(n), jnp.float32)
    together = pk.rms_norm(x, w, eps=1e-6, zero_centered=True, implementation=KERNEL)
    for r in (0, 17, 36):
        alone = pk.rms_norm(x[r : r + 1], w, eps=1e-6, zero_centered=True, implementation=KERNEL)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(together[r]))


def test_the_layers_norm_is_xla_unless_asked():
    x = jnp.ones((2, 8))
    jaxpr = str(
        jax.make_jaxpr(lambda v: rms_norm(v, jnp.zeros(8), eps=1e-6, zero_centered=True))(x)
    )
    assert "pallas_call" not in jaxpr
    kernel = jax.make_jaxpr(
        lambda v: rms_norm(v, jnp.zeros(8), eps=1e-6, zero_centered=True, implementation=KERNEL)
    )(x)
    assert "pallas_call" in str(kernel)


def test_a_mismatched_weight_is_refused():
    with pytest.raises(ValueError, match=r"weight of shape \(7,\) does not match x's last axis 8"):
        pk.rms_norm(jnp.ones((2, 8)), jnp.ones(7), eps=1e-6, zero_centered=True)


# ---- cache attention ------------------------------------------------------------------------

CFG = CA.CacheAttentionConfig(block_keys=16, split_keys=32)


def _attention_inputs(seed, B=2, S=3, n_q=6, n_kv=2, d=32, L=70, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, S, n_q, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, L, n_kv, d)) * 2, dtype)
    v = jnp.asarray(rng.standard_normal((B, L, n_kv, d)), dtype)
    lengths = jnp.asarray(rng.integers(1, L + 1, (B, S)), jnp.int32)
    return q, k, v, lengths


def _oracle(q, k, v, lengths, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, S, n_q, _ = q.shape
    g = n_q // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        for s in range(S):
            n = int(lengths[b, s])
            for h in range(n_q):
                sc = k[b, :n, h // g] @ q[b, s, h] * scale
                p = np.exp(sc - sc.max())
                out[b, s, h] = (p / p.sum()) @ v[b, :n, h // g]
    return out


@pytest.mark.parametrize("products", sorted(CA.PRODUCTS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cache_attention_matches_the_reference_and_float64(dtype, products):
    q, k, v, lengths = _attention_inputs(0, dtype=dtype)
    cfg = dataclasses.replace(CFG, products=products)
    got = pk.cache_attention(q, k, v, lengths, scale=0.2, implementation=KERNEL, config=cfg)
    ref = pk.cache_attention(q, k, v, lengths, scale=0.2, implementation="xla")
    oracle = _oracle(q, k, v, lengths, 0.2)
    np.testing.assert_allclose(got, oracle, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref, oracle, rtol=1e-5, atol=1e-5)


def test_a_row_with_nothing_to_attend_gives_zeros():
    q, k, v, lengths = _attention_inputs(1)
    lengths = lengths.at[0, 1].set(0)
    got = pk.cache_attention(q, k, v, lengths, scale=0.2, implementation=KERNEL, config=CFG)
    np.testing.assert_array_equal(np.asarray(got[0, 1]), 0.0)


def _check_rows_alone_and_over_a_longer_cache(q, k, v, lengths, **kw):
    together = np.asarray(pk.cache_attention(q, k, v, lengths, **kw))
    for s in range(q.shape[1]):
        alone = pk.cache_attention(q[:, s : s + 1], k, v, lengths[:, s : s + 1], **kw)
        np.testing.assert_array_equal(np.asarray(alone[:, 0]), together[:, s])
    # A longer cache adds splits past every row's length: exact zeros in the merge.
    pad = ((0, 0), (0, 77), (0, 0), (0, 0))
    longer = pk.cache_attention(q, jnp.pad(k, pad), jnp.pad(v, pad), lengths, **kw)
    np.testing.assert_array_equal(np.asarray(longer), together)


@pytest.mark.parametrize(
    ("products", "rows_per_dot"), [(p, 16) for p in sorted(CA.PRODUCTS)] + [("bf16x6", 32)]
)
def test_an_attention_row_is_the_same_alone_among_others_and_over_a_longer_cache(
    products, rows_per_dot
):
    # 4 rows x 6 query heads per KV head: 24 rows, two 16-row chunks or one of 32; a row alone
    # is in the first chunk, padded.
    q, k, v, lengths = _attention_inputs(2, S=4, n_q=12, L=90)
    cfg = dataclasses.replace(CFG, products=products, rows_per_dot=rows_per_dot)
    _check_rows_alone_and_over_a_longer_cache(
        q, k, v, lengths, scale=0.2, implementation=KERNEL, config=cfg
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("rows_per_dot", CA.ROWS_PER_DOT)
@pytest.mark.parametrize("products", sorted(CA.PRODUCTS))
def test_gpu_an_attention_row_is_the_same_alone_at_27b_shapes(products, rows_per_dot):
    # 5 rows x 6 query heads: 30 rows, in two or one chunks; tensor-core dots of 16 to 64 rows.
    q, k, v, lengths = _attention_inputs(4, B=8, S=5, n_q=24, n_kv=4, d=256, L=400)
    cfg = CA.CacheAttentionConfig(products=products, rows_per_dot=rows_per_dot)
    _check_rows_alone_and_over_a_longer_cache(q, k, v, lengths, scale=256**-0.5, config=cfg)


def test_a_stacked_entry_is_read_as_the_entry_alone():
    q, k, v, lengths = _attention_inputs(3)
    ks, vs = jnp.stack([k * 0.5, k, k * 2]), jnp.stack([v, v * 3, v])
    kw = dict(scale=0.3, config=CFG)
    for layer in range(3):
        got = pk.cache_attention(
            q, ks, vs, lengths, layer=jnp.int32(layer), implementation=KERNEL, **kw
        )
        alone = pk.cache_attention(q, ks[layer], vs[layer], lengths, implementation=KERNEL, **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))


def test_attend_cache_off_the_kernel_is_attend_under_the_mask():
    q, k, v, lengths = _attention_inputs(4)
    mask = jnp.arange(k.shape[1])[None, None, :] < lengths[:, :, None]
    got = attend_cache(q, k, v, lengths, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attend(q, k, v, mask)))


def test_cache_attention_errors_name_the_problem():
    q, k, v, lengths = _attention_inputs(5)
    with pytest.raises(ValueError, match=r"lengths must be int32\[B, S\] = \[2, 3\]"):
        pk.cache_attention(q, k, v, lengths[:, :2], scale=1.0)
    with pytest.raises(ValueError, match=r"caches \[layers, B, L, Nkv, D\]"):
        pk.cache_attention(q, k, v, lengths, scale=1.0, layer=jnp.int32(0))
    with pytest.raises(NotImplementedError, match="power-of-two head_dim"):
        q2, k2, v2, l2 = _attention_inputs(5, d=24)
        pk.cache_attention(q2, k2, v2, l2, scale=1.0, implementation=KERNEL)
    with pytest.raises(ValueError, match="split_keys must be a multiple of block_keys=16"):
        CA.CacheAttentionConfig(block_keys=16, split_keys=40)
    with pytest.raises(
        ValueError, match=r"products must be one of \['bf16x6', 'ieee'\], got 'tf32'"
    ):
        CA.CacheAttentionConfig(products="tf32")
    with pytest.raises(ValueError, match=r"rows_per_dot must be one of \(16, 32, 64\), got 8"):
        CA.CacheAttentionConfig(rows_per_dot=8)


# ---- the recurrent delta rule ---------------------------------------------------------------


def _delta_inputs(seed, B=2, T=4, Hv=3, dk=32, dv=16):
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    f32 = jnp.float32
    return (
        jnp.asarray(unit((B, T, Hv, dk)) * dk**-0.5, f32),
        jnp.asarray(unit((B, T, Hv, dk)), f32),
        jnp.asarray(rng.standard_normal((B, T, Hv, dv)), f32),
        jnp.asarray(-np.abs(rng.standard_normal((B, T, Hv))), f32),
        jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((B, T, Hv)))), f32),
        jnp.asarray(rng.standard_normal((B, Hv, dk, dv)) * 0.1, f32),
    )


def _delta_oracle(q, k, v, g, beta, s0):
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    T = q.shape[1]
    outs, states = [], []
    for t in range(T):
        s = s * np.exp(g[:, t])[..., None, None]
        u = (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t][..., None]
        s = s + k[:, t][..., :, None] * u[..., None, :]
        outs.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
        states.append(s)
    return np.stack(outs, 1), np.stack(states, 1)


def test_delta_rule_kernel_matches_the_reference_and_float64():
    args = _delta_inputs(0)
    o, st = pk.recurrent_delta_rule(*args, implementation=KERNEL)
    o_ref, st_ref = pk.recurrent_delta_rule(*args, implementation="xla")
    o64, st64 = _delta_oracle(*args)
    for got in ((o, st), (o_ref, st_ref)):
        np.testing.assert_allclose(got[0], o64, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], st64, rtol=1e-5, atol=1e-6)


def test_a_delta_rule_row_does_not_depend_on_the_rows_after_it():
    """Row 0 (and 1) of a 4-row step as a 2-row step computes them. The one-row step is the
    GPU's to check (``test_gpu_...``): off a GPU the interpreter hands the kernel's loop to XLA,
    which unrolls a loop of one trip."""
    args = _delta_inputs(1)
    o4, st4 = pk.recurrent_delta_rule(*args, implementation=KERNEL)
    o2, st2 = pk.recurrent_delta_rule(*(a[:, :2] for a in args[:5]), args[5], implementation=KERNEL)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o4[:, :2]))
    np.testing.assert_array_equal(np.asarray(st2), np.asarray(st4[:, :2]))


def test_delta_rule_errors_name_the_problem():
    q, k, v, g, beta, s0 = _delta_inputs(2)
    with pytest.raises(ValueError, match=r"beta must be \[2, 4, 3\] for q \[2, 4, 3, 32\]"):
        pk.recurrent_delta_rule(q, k, v, g, beta[:, :3], s0)
    q2, k2, v2, g2, b2, s2 = _delta_inputs(2, dk=24)
    with pytest.raises(NotImplementedError, match="power-of-two head dims >= 16, got dk=24"):
        pk.recurrent_delta_rule(q2, k2, v2, g2, b2, s2, implementation=KERNEL)


def _stack_inputs(seed, layers=3, W=4, **kw):
    """The delta rule's operands with a stack of snapshots f32[layers, B, W, Hv, dk, dv] and a
    start snapshot per sequence, in place of the state."""
    q, k, v, g, beta, _ = _delta_inputs(seed, **kw)
    B, _, Hv, dk = q.shape
    rng = np.random.default_rng(seed + 100)
    snaps = rng.standard_normal((layers, B, W, Hv, dk, v.shape[-1])) * 0.1
    select = jnp.asarray(rng.integers(0, W, B), jnp.int32)
    return (q, k, v, g, beta), jnp.asarray(snaps, jnp.float32), select


def _check_stacked_is_the_rule_from_the_selected_snapshot(rows, snaps, select, layer, impl):
    """The stacked op against the plain op from the gathered snapshots, bit for bit: its
    output, the layer's first T snapshots replaced by the states, every other entry kept."""
    T = rows[0].shape[1]
    B = snaps.shape[1]
    o, new = pk.recurrent_delta_rule_stacked(
        *rows, snaps, layer=jnp.int32(layer), select=select, implementation=impl
    )
    s0 = snaps[layer, jnp.arange(B), select]
    o_plain, states = pk.recurrent_delta_rule(*rows, s0, implementation=impl)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_plain))
    want = np.array(snaps)
    want[layer, :, :T] = np.asarray(states)
    np.testing.assert_array_equal(np.asarray(new), want)


@pytest.mark.parametrize("impl", [KERNEL, "xla"])
@pytest.mark.parametrize("T, layer", [(4, 0), (2, 2)])
def test_the_stacked_delta_rule_starts_from_the_selected_snapshot_and_writes_the_layer(
    T, layer, impl
):
    rows, snaps, select = _stack_inputs(4, T=T)
    _check_stacked_is_the_rule_from_the_selected_snapshot(rows, snaps, select, layer, impl)


def test_stacked_delta_rule_errors_name_the_problem():
    rows, snaps, select = _stack_inputs(5)
    kw = dict(layer=jnp.int32(0), select=select)
    with pytest.raises(ValueError, match=r"snapshots must be \[layers, 2, W, 3, 32, 16\]"):
        pk.recurrent_delta_rule_stacked(*rows, snaps[0], **kw)
    with pytest.raises(ValueError, match="keep W=2 states a sequence, fewer than the step's T=4"):
        pk.recurrent_delta_rule_stacked(*rows, snaps[:, :, :2], **kw)
    with pytest.raises(ValueError, match=r"select must be int32\[2\], got int32\[3\]"):
        pk.recurrent_delta_rule_stacked(
            *rows, snaps, layer=jnp.int32(0), select=select[jnp.array([0, 1, 1])]
        )
    with pytest.raises(ValueError, match="snapshots must be float32, got bfloat16"):
        pk.recurrent_delta_rule_stacked(*rows, snaps.astype(jnp.bfloat16), **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_the_stacked_delta_rule_updates_the_stack_in_place():
    """At the 27B GDN layer's heads (48 of 128 x 128): the compiled op, its stack donated, needs
    no temporary of a layer's snapshots (the kernel writes into the stack), and computes what
    the plain kernel computes from the gathered snapshots."""
    rows, snaps, select = _stack_inputs(6, B=8, T=4, Hv=48, dk=128, dv=128)
    _check_stacked_is_the_rule_from_the_selected_snapshot(rows, snaps, select, 1, "auto")
    run = jax.jit(
        lambda snaps, *rows: pk.recurrent_delta_rule_stacked(
            *rows, snaps, layer=jnp.int32(1), select=select
        ),
        donate_argnums=0,
    )
    temp = run.lower(snaps, *rows).compile().memory_analysis().temp_size_in_bytes
    layer_bytes = snaps[0].nbytes
    assert temp < layer_bytes / 4, (temp, layer_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dk, dv", [(64, 64), (128, 128)])
def test_gpu_a_delta_rule_row_alone_is_the_row_among_others(dk, dv):
    args = _delta_inputs(3, B=8, T=5, Hv=8, dk=dk, dv=dv)
    o5, st5 = pk.recurrent_delta_rule(*args)
    o1, st1 = pk.recurrent_delta_rule(*(a[:, :1] for a in args[:5]), args[5])
    np.testing.assert_array_equal(np.asarray(o1[:, 0]), np.asarray(o5[:, 0]))
    np.testing.assert_array_equal(np.asarray(st1[:, 0]), np.asarray(st5[:, 0]))


# ---- the GEMV's split-K slices --------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(1024, 5120), (5120, 17408), (12288, 5120), (5120, 6144)])
def test_every_row_count_cuts_k_at_the_same_places(n, k):
    """The BF16 GEMV's heuristic tiles differ past 32 rows (64-wide K steps): its split-K slices
    must not, or a row's partial sums would change with the number of rows."""
    cuts = set()
    for m in (1, 8, 16, 33, 40, 64, 128):
        cfg = T.default_config("bf16", m, n, k)
        cuts.add(T.split_slices(k, cfg.block_k, cfg.split_k)[1] * cfg.block_k)
    assert len(cuts) == 1, cuts


def test_partial_sums_are_added_in_order():
    rng = np.random.default_rng(0)
    parts = rng.standard_normal((7, 3, 5)).astype(np.float32) * 1e4
    expected = parts[0].copy()
    for p in parts[1:]:
        expected = expected + p
    np.testing.assert_array_equal(np.asarray(T.sum_in_order(jnp.asarray(parts))), expected)


# ---- on the GPU: the real shapes ------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(1024, 5120), (5120, 17408), (12288, 5120)])
@pytest.mark.parametrize("rows", [16, 40, 128])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_a_projection_row_is_the_same_at_every_row_count(n, k, rows):
    rng = np.random.default_rng(rows)
    w = pk.Bf16Weight(w=jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    together = np.asarray(pk.linear(x, w, out_dtype=jnp.float32))
    one = np.asarray(pk.linear(x[:8], w, out_dtype=jnp.float32))
    np.testing.assert_array_equal(together[:8], one)


# ---- the target steps run them --------------------------------------------------------------


def test_the_reference_target_step_runs_the_row_invariant_kernels():
    from mtpjax import reference
    from mtpjax.head import init_lm_head

    cfg = reference.TargetConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=512,
    )  # fmt: skip
    params = reference.init(cfg, key=jax.random.key(0))
    head = init_lm_head(cfg.lm_head_config(), key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 256)
    lengths = jnp.full((2,), 9, jnp.int32)
    step = jax.random.randint(jax.random.key(3), (2, 3), 0, 256)
    hidden = {}
    for impl in ("xla", KERNEL):
        cache = reference.init_cache(cfg, batch=2, max_len=16)
        _, cache = reference.target_prefill(
            params, head, cache, tokens, lengths, cfg=cfg, implementation=impl
        )
        args = (params, head, cache, step, lengths)
        text = str(
            jax.make_jaxpr(lambda *a, i=impl: reference.target_step(*a, cfg=cfg, implementation=i))(
                *args
            )
        )
        assert ("cache_attention" in text and "row_norm" in text) == (impl == KERNEL)
        hidden[impl] = np.asarray(
            reference.target_step(*args, cfg=cfg, implementation=impl)[0], np.float64
        )
    # The kernels take BF16 activations into the projections (the XLA path F32 here): BF16-level
    # agreement on hidden values of magnitude ~3 (2.3e-3 measured).
    np.testing.assert_allclose(hidden[KERNEL], hidden["xla"], rtol=0, atol=1e-2)
