"""indexed_scan: a scan over an index it carries. It equals ``lax.scan`` over the indices, its
index is no slice of an array (XLA:GPU keeps a loop with such a slice out of a CUDA graph, and
every loop around it), and the loops that run every decode round use it: the reference and
hybrid targets' layer loops and the draft chain's cycles take no ``arange`` as scanned input."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import make, new_state, pairs, random_pairs, tiny_cfg

from mtpjax import drafter, hybrid
from mtpjax.head import init_lm_head
from mtpjax.indexed_scan import indexed_scan
from mtpjax.reference import TargetConfig, init, init_cache, target_step


def _body(carry, i):
    acc, prod = carry
    return (acc + i, prod * (i + 1)), acc * 10 + i


@pytest.mark.parametrize("start, length", [(0, 4), (1, 3), (5, 1)])
def test_equals_a_scan_over_the_indices(start, length):
    init = (jnp.int32(0), jnp.int32(1))
    got = jax.jit(lambda c: indexed_scan(_body, c, length, start=start))(init)
    want = jax.lax.scan(_body, init, jnp.arange(start, start + length, dtype=jnp.int32))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def _dynamic_slices(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count("stablehlo.dynamic_slice")


def test_the_index_is_carried_not_sliced():
    init = (jnp.int32(0), jnp.int32(1))
    assert _dynamic_slices(lambda c: indexed_scan(_body, c, 4), init) == 0
    # The pattern it replaces slices its index out of the scanned arange on every iteration.
    scanned = lambda c: jax.lax.scan(_body, c, jnp.arange(4, dtype=jnp.int32))  # noqa: E731
    assert _dynamic_slices(scanned, init) > 0


def _iota_scans(jaxpr, inherited: frozenset = frozenset()) -> int:
    """Scans (at any depth) given an int32 vector of their own length that is an iota or a
    constant: what ``jnp.arange`` as the scanned input traces to (a constant may be
    hoisted out of a jit and passed in). The shapes in the tests below keep every other int32
    vector at another length."""
    found = 0
    iotas = set(inherited) | {id(v) for v in jaxpr.constvars}
    for eqn in jaxpr.eqns:
        # An iota, shifted or scaled by a scalar (``jnp.arange(1, n)``), is still one.
        shifted = eqn.primitive.name in ("add", "sub", "mul") and any(
            id(v) in iotas for v in eqn.invars
        )
        if eqn.primitive.name == "iota" or shifted:
            iotas |= {id(v) for v in eqn.outvars}
        if eqn.primitive.name == "scan":
            n = eqn.params["length"]
            found += any(
                id(v) in iotas and v.aval.dtype == jnp.int32 and v.aval.shape == (n,)
                for v in eqn.invars
            )
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            passed = frozenset()
            if len(sub.invars) == len(eqn.invars):  # a jit: its operands are its inputs
                passed = frozenset(id(i) for o, i in zip(eqn.invars, sub.invars) if id(o) in iotas)
            found += _iota_scans(sub, passed)
    return found


def test_control_the_census_finds_a_scanned_arange():
    init = (jnp.int32(0), jnp.int32(1))
    scanned = lambda c: jax.lax.scan(_body, c, jnp.arange(4, dtype=jnp.int32))  # noqa: E731
    assert _iota_scans(jax.make_jaxpr(scanned)(init).jaxpr) == 1


def test_reference_target_step_scans_no_arange():
    cfg = TargetConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.5, intermediate_size=96, vocab_size=128,
        max_position_embeddings=64,
    )  # fmt: skip
    params = init(cfg, key=jax.random.key(0))
    head = init_lm_head(cfg.lm_head_config(), key=jax.random.key(1), precision="bf16")
    cache = init_cache(cfg, batch=2, max_len=16)
    tokens, start = jnp.zeros((2, 4), jnp.int32), jnp.full((2,), 3, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda *a: target_step(*a, cfg=cfg))(params, head, cache, tokens, start)
    assert _iota_scans(jaxpr.jaxpr) == 0


def test_hybrid_step_scans_no_arange():
    cfg = hybrid.HybridConfig.tiny(num_hidden_layers=6, full_attention_interval=2)  # 3 groups
    params, head = hybrid.init(cfg, key=jax.random.key(0))
    state = hybrid.init_state(cfg, batch=2, max_len=16, max_step=4)
    tokens, start = jnp.zeros((2, 4), jnp.int32), jnp.full((2,), 3, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda *a: hybrid.step(*a, cfg=cfg))(params, head, state, tokens, start)
    assert _iota_scans(jaxpr.jaxpr) == 0


def test_propose_chain_scans_no_arange():
    cfg = tiny_cfg()  # one module: K = 5 drafts run the anchor cycle and 4 scanned cycles
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(0), (2, 4))
    window = pairs(tokens, hidden, [4, 4], [0, 0])
    state = new_state(cfg, 2)
    jaxpr = jax.make_jaxpr(lambda *a: drafter.propose(*a, cfg=cfg, num_drafts=5))(
        params, head, state, window
    )
    assert _iota_scans(jaxpr.jaxpr) == 0
