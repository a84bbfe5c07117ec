"""The tensor- and expert-parallel drafter (``drafter.shard_drafter``) on meshes of 2, 4 and 8 host
devices against the same drafter on one device: a prefill, two propose / verify rounds (the
second from the first's verify window, one sequence partly rejected) and their states.

Drafts, accepted counts and every integer leaf of the state must be equal; floats (draft
probabilities, handed-over hidden, KV rows) agree to F32 rounding, since a row-parallel
projection and the expert mix sum their parts in another order (``ATOL``; KV rows compare in
their BF16 storage, within one BF16 ulp of the row's magnitude). Every leaf's placement is
checked against a table written here, before and after the steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import make, tiny_cfg
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_mla import CFG as MLA_CFG
from test_mla import random_drafter

from mtpjax import drafter
from mtpjax.config import FfnKind, MoeConfig
from mtpjax.layers.expert_parallel import ExpertParallelMoeParams
from mtpjax.verify import verify

B, K, PROMPT = 2, 2, 6
ATOL = 2e-5  # F32 sums of O(1) terms reassociated across devices

# 8 query and 8 KV heads, an FFN / experts / vocab all divisible by 8, so every mesh size fits.
DENSE = tiny_cfg(FfnKind.DENSE, num_attention_heads=8, num_key_value_heads=8)
MOE = tiny_cfg(
    FfnKind.MOE,
    num_attention_heads=8,
    num_key_value_heads=8,
    moe=MoeConfig(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        shared_expert_gate=True,
    ),
)


def _mesh(n: int):
    return jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


def _heads(kind: str):
    if kind == "mla":
        params, head = random_drafter()
        return MLA_CFG, params, head
    cfg = DENSE if kind == "dense" else MOE
    return (cfg, *make(cfg))


def _state(cfg):
    pool = drafter.pool_config(cfg, precision="bf16", max_seq_len=24, max_seqs=B, block_size=4)
    return drafter.init_state(pool, num_seqs=B)


@functools.cache
def _inputs(cfg):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, PROMPT)), jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(B, PROMPT, cfg.hidden_size)), jnp.float32)
    noise = jnp.asarray(rng.normal(size=(cfg.hidden_size,)), jnp.float32)
    return tokens, hidden, noise


def _session(cfg, params, head, state):
    """prefill, then two rounds of propose + verify; returns what each step produced."""
    tokens, hidden, noise = _inputs(cfg)
    pad = [(0, 0), (0, K)]
    ones = jnp.ones((B,), jnp.int32)
    prompt = drafter.Pairs(
        tokens=tokens[:, 1:], hidden=hidden[:, :-1], count=ones * (PROMPT - 1), start=0 * ones
    )
    state = drafter.prefill(params, head, state, prompt, cfg=cfg)
    pairs = drafter.Pairs(
        tokens=jnp.pad(tokens[:, -1:], pad),
        hidden=jnp.pad(hidden[:, -1:], [*pad, (0, 0)]),
        count=ones,
        start=ones * (PROMPT - 1),
    )
    position, out = ones * PROMPT, []
    for _ in range(2):
        drafts, state = drafter.propose(params, head, state, pairs, cfg=cfg, num_drafts=K)
        # The target agrees with the drafter's own chain (each draft is the argmax of its
        # hidden) but sequence 1's second row is perturbed: it accepts fewer.
        target = jnp.concatenate([drafts.hidden, drafts.hidden[:, -1:]], axis=1)
        target = target.at[1, 1].set(noise)
        result, state = verify(head, state, target, drafts, cfg=cfg.lm_head_config(), refeed=True)
        out.append((drafts, result))
        n = result.num_output
        pairs = drafter.Pairs(
            tokens=jnp.maximum(result.output_tokens, 0), hidden=target, count=n, start=position
        )
        position = position + n
        # From the host, as a serving loop passes it: the next round's window has the same
        # placement as the first, so propose compiles once.
        pairs = jax.tree.map(np.asarray, pairs)
    return out, state


@functools.cache
def _single(kind: str):
    cfg, params, head = _heads(kind)
    return jax.device_get(_session(cfg, params, head, _state(cfg)))


@functools.cache
def _sharded(kind: str, n: int, expert_axis: str | None = "tp"):
    cfg, params, head = _heads(kind)
    placed = drafter.shard_drafter(params, head, _state(cfg), _mesh(n), cfg=cfg,
                                   expert_axis=expert_axis)  # fmt: skip
    # The state is donated: keep where its leaves were placed.
    placement = (*placed[:2], jax.tree.map(lambda a: a.sharding, placed[2]))
    return placement, _session(cfg, *placed)


# Every mesh size and every kind, each compiled once (the MoE split by width is at 2 below).
CASES = [("dense", 2), ("dense", 8), ("moe", 4), ("moe", 8), ("mla", 4)]


@pytest.mark.parametrize("kind,n", CASES)
def test_sharded_session_matches_one_device(kind, n):
    (ref_rounds, ref_state), ((_, _, _), (rounds, state)) = _single(kind), _sharded(kind, n)
    for r, ((d0, v0), (d1, v1)) in enumerate(zip(ref_rounds, rounds)):
        np.testing.assert_array_equal(d0.tokens, d1.tokens, err_msg=f"round {r} drafts")
        np.testing.assert_array_equal(v0.num_accepted, v1.num_accepted)
        np.testing.assert_array_equal(v0.output_tokens, v1.output_tokens)
        np.testing.assert_allclose(d0.probs, d1.probs, atol=ATOL, rtol=0)
        np.testing.assert_allclose(d0.hidden, d1.hidden, atol=ATOL, rtol=0)
    # The fixture exercises both outcomes: all drafts accepted, and a partial reject.
    assert ref_rounds[0][1].num_accepted.tolist() == [K, 1], ref_rounds[0][1].num_accepted
    paths = jax.tree_util.tree_flatten_with_path(ref_state)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(state), strict=True):
        what = jax.tree_util.keystr(path)
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, what
        if np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
            np.testing.assert_array_equal(a, b, err_msg=what)
        else:  # BF16 KV rows: one storage rounding apart at most
            a, b = a.astype(np.float32), b.astype(np.float32)
            np.testing.assert_allclose(a, b, atol=2**-7 * np.abs(a).max(), rtol=0, err_msg=what)
    # Most rows are bit-identical: only a rounding tie of the BF16 store can differ.
    pool0, pool1 = (np.asarray(s.kv[0].pool.k, np.float32) for s in (ref_state, state))
    assert np.mean(pool0 == pool1) > 0.99


def _expected_spec(path: str, kind: str, expert_parallel: bool) -> P:
    """The placement the design asks for, by leaf path (written out, not derived from the
    leaves' logical axes)."""
    t = "tp"
    column, row = P(t, None), P(None, t)
    if ".pool." in path:  # [P, S, Nkv, D] by KV head; MLA's latent rows replicated
        return P() if kind == "mla" else P(None, None, t)
    if ".experts." in path:
        if expert_parallel:
            return P(t, None, None)
        return P(None, None, t) if "down_proj" in path else P(None, t, None)
    if ".router." in path or "score_correction_bias" in path:
        return (P(t) if "bias" in path else column) if expert_parallel else P()
    if "shared_expert_gate" in path:
        return P()
    dense = (".ffn.gate_proj.", ".ffn.up_proj.", ".shared_expert.gate_proj.",
             ".shared_expert.up_proj.", ".q_proj.", ".k_proj.", ".v_proj.", ".q_b_proj.",
             ".kv_b_proj.")  # fmt: skip
    if any(name in path for name in dense):
        return column
    if any(name in path for name in (".ffn.down_proj.", ".shared_expert.down_proj.", ".o_proj.")):
        return row
    if path.startswith("head.weight."):
        return column  # the LM head's rows: the vocabulary
    return P()


def _trim(spec: P) -> tuple:
    """A spec without its trailing Nones (the same placement)."""
    out = list(spec)
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def _check_placement(placed, kind, expert_parallel=True):
    for name, tree in zip(("params", "head", "state"), placed):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            where = name + jax.tree_util.keystr(path)
            spec = _expected_spec(where, kind, expert_parallel)
            got = (leaf if isinstance(leaf, NamedSharding) else leaf.sharding).spec
            assert _trim(got) == _trim(spec), f"{where}: {got}, expected {spec}"


@pytest.mark.parametrize("kind,n", [("dense", 8), ("moe", 4), ("mla", 4)])
def test_every_leaf_is_placed_as_designed(kind, n):
    placed, (_, state) = _sharded(kind, n)
    _check_placement(placed, kind)
    # The steps hand the state back as they took it: the next call neither reshards nor
    # recompiles.
    for a, b in zip(jax.tree.leaves(placed[2]), jax.tree.leaves(state), strict=True):
        assert a.is_equivalent_to(b.sharding, b.ndim), (a, b.sharding)
    if kind == "moe":
        assert isinstance(placed[0].layer.ffn, ExpertParallelMoeParams)


def test_experts_split_by_width_instead():
    """``expert_axis=None``: each expert's width splits like the dense FFN's, plain MoE params."""
    placed, (rounds, _) = _sharded("moe", 2, None)
    _check_placement(placed, "moe", expert_parallel=False)
    assert not isinstance(placed[0].layer.ffn, ExpertParallelMoeParams)
    ref_rounds, _ = _single("moe")
    for (d0, _), (d1, _) in zip(ref_rounds, rounds):
        np.testing.assert_array_equal(d0.tokens, d1.tokens)
        np.testing.assert_allclose(d0.hidden, d1.hidden, atol=ATOL, rtol=0)


def test_uneven_split_and_explicit_mesh_are_refused():
    cfg = tiny_cfg()  # 4 query heads, 2 KV heads
    params, head = make(cfg)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 must be a multiple of the 4"):
        drafter.shard_drafter(params, head, _state(cfg), _mesh(4), cfg=cfg)
    # Whole heads, but a vocabulary of 128 rows over 3 devices.
    mesh3 = jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3], axis_types=(AxisType.Auto,))
    three = tiny_cfg(num_attention_heads=3, num_key_value_heads=3, intermediate_size=96)
    with pytest.raises(ValueError, match=r"head.weight.*\(128, 64\).*3 devices.*found 128"):
        drafter.shard_drafter(*make(three), _state(three), mesh3, cfg=three)
    explicit = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"AxisType\.Auto"):
        drafter.shard_drafter(params, head, _state(cfg), explicit, cfg=cfg)
    with pytest.raises(ValueError, match="no axis named 'ep'"):
        drafter.shard_drafter(params, head, _state(cfg), _mesh(2), cfg=cfg, expert_axis="ep")
