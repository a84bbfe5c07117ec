"""Tree drafting: the static tree shape, the targets' tree steps against their full forwards
(every root-to-leaf path) and the commit of a path against a chain over it, the drafter's tree
against chains forced down each path, the tree acceptance rule (greedy cases, a Python loop,
chi-square exactness of the multi-candidate sampling rule, and a wrong rule that fails), and
greedy tree speculation equal to plain greedy decoding on the reference target, the hybrid
target and the shipped pair."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_accept import P_FLOOR, _chi2_pvalue
from test_generate import (
    heldout_prompts,
    tokenizer,  # noqa: F401 (a fixture)
)
from test_generate import pair as shipped_pair  # noqa: F401 (a fixture)
from test_generate_families import TARGET, H, V
from test_hybrid import EXACT
from test_hybrid import pair as hybrid_pair  # noqa: F401 (a fixture)
from test_hybrid import tol as hybrid_tol

import mtpjax
from mtpjax import drafter as drafter_lib
from mtpjax import hybrid, reference
from mtpjax.config import DrafterConfig
from mtpjax.draft_tree import TreeShape, ancestry_mask, tree_depths
from mtpjax.head import from_arrays
from mtpjax.verify.tree import accept_tree
from mtpjax.weights import Bf16Weight

TREE = TreeShape((2, 2, 1))
EPS = float(np.finfo(np.float32).eps)


# --------------------------------------------------------------------------------------------
# The shape.


def test_tree_shape_numbers_nodes_breadth_first():
    assert TREE.level_sizes == (1, 2, 4, 4) and TREE.num_rows == 11 and TREE.depth == 3
    np.testing.assert_array_equal(TREE.parents(), [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(TREE.depths(), [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(tree_depths(jnp.asarray(TREE.parents())), TREE.depths())
    anc = TREE.ancestors()
    assert anc[9].nonzero()[0].tolist() == [0, 2, 5, 9]
    np.testing.assert_array_equal(TREE.children(2), [[3, 4], [5, 6]])
    chain = TreeShape((1, 1, 1))
    np.testing.assert_array_equal(chain.parents(), [-1, 0, 1, 2])
    np.testing.assert_array_equal(
        ancestry_mask(jnp.asarray(chain.parents())), np.tril(np.ones((4, 4)))
    )
    with pytest.raises(ValueError, match="branching must be a non-empty tuple"):
        TreeShape((2, 0))


def _leaf_paths(tree: TreeShape) -> list[list[int]]:
    """Every root-to-leaf path as node numbers."""
    anc = tree.ancestors()
    first = tree.level_starts[-1]
    return [list(anc[leaf].nonzero()[0]) for leaf in range(first, tree.num_rows)]


# --------------------------------------------------------------------------------------------
# Targets: the reference (full attention) and the hybrid (GDN per branch).

REF = TARGET  # the reference target of the family tests: H = 64, V = 128
B, P, MAX_LEN = 2, 6, 32


@pytest.fixture(scope="module")
def ref_pair():
    """The reference target (modest residual writes, a peaked head) and a drafter made to
    predict its function of the token, its attention and FFN writes scaled down but not off, so
    drafts are often, not always, right and the drafter's tree mask matters."""
    params = reference.init(REF, key=jax.random.key(0), std=0.1)
    k_embed, k_head = jax.random.split(jax.random.key(1))
    head = from_arrays(
        REF.lm_head_config(),
        lm_head=4.0 * jax.random.normal(k_head, (V, H)) * H**-0.5,
        embedding=jax.random.normal(k_embed, (V, H)),
    )
    dcfg = DrafterConfig.tiny(vocab_size=V)
    d = drafter_lib.init(dcfg, key=jax.random.key(2))

    def scaled(w):
        return Bf16Weight(w=(w.w * 0.3).astype(jnp.bfloat16))

    layer = dataclasses.replace(
        d.layer,
        attention=dataclasses.replace(d.layer.attention, o_proj=scaled(d.layer.attention.o_proj)),
        ffn=dataclasses.replace(d.layer.ffn, down_proj=scaled(d.layer.ffn.down_proj)),
    )
    passthrough = jnp.concatenate([jnp.eye(H), jnp.zeros((H, H))], axis=1)
    d = dataclasses.replace(
        d, fc=Bf16Weight(w=passthrough.astype(jnp.bfloat16)), layer=layer,
        norm=jnp.zeros((H,), jnp.bfloat16),
    )  # fmt: skip
    return params, head, dcfg, d


def _tokens(shape, seed, vocab):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _tree_vs_forward(init, prefill, tree_step, forward, vocab, tol):
    """Tree step after a prefill vs the full forward over prompt + each root-to-leaf path."""
    prompt = _tokens((B, P), 3, vocab)
    lengths = jnp.full((B,), P, jnp.int32)
    tokens = _tokens((B, TREE.num_rows), 4, vocab)
    hidden_tree = tree_step(prefill(init(), prompt, lengths)[1], tokens, lengths)[0]
    for path in _leaf_paths(TREE):
        full = forward(jnp.concatenate([prompt, tokens[:, path]], axis=1))[:, P:]
        np.testing.assert_allclose(hidden_tree[:, path], full, atol=tol, rtol=0)


def _commit_vs_chain(init, prefill, tree_step, step, commit, vocab):
    """After a tree step and the commit of a path with ``a`` accepted, the next step gives what
    it gives after a chain step over the path's tokens: KV rows and GDN states of rejected
    branches are gone."""
    prompt = _tokens((B, P), 5, vocab)
    lengths = jnp.full((B,), P, jnp.int32)
    tokens = _tokens((B, TREE.num_rows), 6, vocab)
    later = _tokens((B, TREE.num_rows), 7, vocab)
    paths = _leaf_paths(TREE)
    path = jnp.asarray([paths[3], paths[1]], jnp.int32)  # a different path per sequence
    accepted = jnp.asarray([2, 1], jnp.int32)
    state = tree_step(prefill(init(), prompt, lengths)[1], tokens, lengths)[1]
    state = commit(state, lengths, path)
    got = step(state, later, lengths + accepted + 1)[0]
    chain_tokens = jnp.take_along_axis(tokens, path, axis=1)
    pad = jnp.zeros((B, TREE.num_rows - path.shape[1]), jnp.int32)
    state = step(
        prefill(init(), prompt, lengths)[1], jnp.concatenate([chain_tokens, pad], 1), lengths
    )[1]
    want = step(state, later, lengths + accepted + 1)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _reference_calls(params, head):
    kw = dict(cfg=REF)
    return dict(
        init=lambda: reference.init_cache(REF, batch=B, max_len=MAX_LEN),
        prefill=lambda c, t, n: reference.target_prefill(params, head, c, t, n, **kw),
        tree_step=lambda c, t, s: reference.target_tree_step(
            params, head, c, t, s, jnp.asarray(TREE.parents()), **kw
        ),
        step=lambda c, t, s: reference.target_step(params, head, c, t, s, **kw),
        commit=reference.commit_path,
        forward=lambda t: reference.target_forward(params, head, t, **kw),
    )


def _hybrid_calls(params, head):
    kw = dict(cfg=EXACT)
    return dict(
        init=lambda: hybrid.init_state(EXACT, batch=B, max_len=MAX_LEN, max_step=TREE.num_rows),
        prefill=lambda c, t, n: hybrid.prefill(params, head, c, t, n, **kw),
        tree_step=lambda c, t, s: hybrid.tree_step(
            params, head, c, t, s, jnp.asarray(TREE.parents()), **kw
        ),
        step=lambda c, t, s: hybrid.step(params, head, c, t, s, **kw),
        commit=lambda c, s, p: hybrid.commit_path(c, s, p, **kw),
        forward=lambda t: hybrid.forward(params, head, t, **kw)[0],
    )


def test_reference_tree_step_is_every_path_of_the_full_forward(ref_pair):
    params, head, _, _ = ref_pair
    c = _reference_calls(params, head)
    tol = 4 * REF.num_hidden_layers * math.sqrt((P + 4) * H) * EPS
    _tree_vs_forward(c["init"], c["prefill"], c["tree_step"], c["forward"], V, tol)


def test_reference_commit_path_equals_a_chain_over_the_path(ref_pair):
    params, head, _, _ = ref_pair
    c = _reference_calls(params, head)
    _commit_vs_chain(c["init"], c["prefill"], c["tree_step"], c["step"], c["commit"], V)


def test_hybrid_tree_step_is_every_path_of_the_full_forward(hybrid_pair):  # noqa: F811
    params, head, _, _ = hybrid_pair
    c = _hybrid_calls(params, head)
    tol = hybrid_tol(EXACT, P + 4)
    _tree_vs_forward(c["init"], c["prefill"], c["tree_step"], c["forward"], EXACT.vocab_size, tol)


def test_hybrid_commit_path_equals_a_chain_over_the_path(hybrid_pair):  # noqa: F811
    params, head, _, _ = hybrid_pair
    c = _hybrid_calls(params, head)
    _commit_vs_chain(
        c["init"], c["prefill"], c["tree_step"], c["step"], c["commit"], EXACT.vocab_size
    )


# --------------------------------------------------------------------------------------------
# The drafter's tree against chains forced down each path.


def test_drafter_tree_equals_chains_forced_down_each_path(ref_pair):
    """Every inner node's logits equal a chain propose whose per-draft bitmask forces the drafts
    of its path (the chain's rows at those keys are the node's ancestors), and each node's
    children are the top-k of its logits."""
    _, head, dcfg, d = ref_pair
    tree = TREE
    rng = np.random.default_rng(8)
    n = 9  # committed pairs in the window
    tokens = rng.integers(0, V, (1, n)).astype(np.int32)
    hidden = rng.standard_normal((1, n, H)).astype(np.float32)
    pool = drafter_lib.pool_config(dcfg, precision="bf16", max_seq_len=40, max_seqs=1)

    def window(batch):
        return drafter_lib.Pairs(
            tokens=jnp.asarray(np.repeat(tokens, batch, 0)),
            hidden=jnp.asarray(np.repeat(hidden, batch, 0)),
            count=jnp.full((batch,), n, jnp.int32),
            start=jnp.zeros((batch,), jnp.int32),
        )

    state = mtpjax.init_state(pool, num_seqs=1)
    drafts, state = drafter_lib.propose_tree(
        d, head, state, window(1), cfg=dcfg, tree=tree, return_logits=True
    )
    assert int(state.kv[0].seq_len[0]) == n and int(state.last_num_drafted[0]) == 0
    tree_tokens = np.concatenate([[-1], np.asarray(drafts.tokens[0])])
    logits = np.asarray(drafts.logits[0])  # [inner, V]
    for i in range(1, tree.num_inner):
        parent = tree.parents()[i]
        k = tree.branching[tree.depths()[i] - 1]
        assert tree_tokens[i] in np.argsort(-logits[parent], kind="stable")[:k]
    for d_ in range(1, tree.depth + 1):  # each node's children: its top k, best first
        for node, kids in zip(
            range(tree.level_starts[d_ - 1], tree.level_starts[d_]), tree.children(d_)
        ):
            want = np.argsort(-logits[node], kind="stable")[: len(kids)]
            np.testing.assert_array_equal(tree_tokens[kids], want)
    # One chain per inner node, batched: steps along its path forced, the rest free.
    inner = list(range(tree.num_inner))
    anc = tree.ancestors()
    K = tree.depth
    words = -(-V // 32)
    mask = np.full((len(inner), K, words), -1, np.int32)
    for row, i in enumerate(inner):
        path = anc[i].nonzero()[0][1:]  # the node's ancestors below the root, then itself
        for s, node in enumerate(path):
            bits = np.zeros(words, np.uint32)
            bits[tree_tokens[node] // 32] = np.uint32(1) << np.uint32(tree_tokens[node] % 32)
            mask[row, s] = bits.view(np.int32)
    pool = drafter_lib.pool_config(dcfg, precision="bf16", max_seq_len=40, max_seqs=len(inner))
    chain_state = mtpjax.init_state(pool, num_seqs=len(inner))
    out, _ = drafter_lib.propose(
        d, head, chain_state, window(len(inner)), cfg=dcfg, num_drafts=K,
        bitmask=jnp.asarray(mask), return_logits=True,
    )  # fmt: skip
    chain_logits = np.asarray(out.logits)
    for row, i in enumerate(inner):
        depth = tree.depths()[i]
        np.testing.assert_allclose(logits[i], chain_logits[row, depth], atol=2e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# Greedy tree speculation equals plain greedy decoding.


def _greedy_pair(model, head, head_cfg, d, dcfg, tree, prompts, lengths, n_new):
    kw = dict(head_cfg=head_cfg, max_new_tokens=n_new)
    spec = mtpjax.generate(
        model, d, head, prompts, lengths, drafter_cfg=dcfg, num_drafts=tree.depth, tree=tree,
        **kw,
    )  # fmt: skip
    base = mtpjax.generate_baseline(model, head, prompts, lengths, step_width=tree.num_rows, **kw)
    spec, base = jax.device_get((spec, base))
    np.testing.assert_array_equal(spec.tokens, base.tokens)
    np.testing.assert_array_equal(spec.lengths, base.lengths)
    np.testing.assert_array_equal(spec.kv_error, 0)
    m = spec.metrics
    assert int(m.num_draft_tokens) == tree.depth * int(m.num_drafts)
    assert 0 < int(m.num_accepted_tokens) < int(m.num_draft_tokens)  # partial accepts
    assert int(spec.target_steps) < int(base.target_steps)
    return spec


@pytest.mark.parametrize("branching", [(2, 2, 1), (3, 1)])
def test_greedy_tree_speculation_equals_plain_greedy_reference(ref_pair, branching):
    params, head, dcfg, d = ref_pair
    model = mtpjax.reference_target(REF, params, head)
    prompts = np.asarray(_tokens((3, 8), 11, V))
    lengths = np.array([3, 8, 5], np.int32)
    cfg = REF.lm_head_config()
    _greedy_pair(model, head, cfg, d, dcfg, TreeShape(branching), prompts, lengths, 12)


def test_sampled_tree_speculation_emits_valid_tokens(ref_pair):
    params, head, dcfg, d = ref_pair
    model = mtpjax.reference_target(REF, params, head)
    prompts = np.asarray(_tokens((3, 8), 12, V))
    lengths = np.array([3, 8, 5], np.int32)
    out = jax.device_get(
        mtpjax.generate(
            model, d, head, prompts, lengths, drafter_cfg=dcfg, num_drafts=TREE.depth,
            tree=TREE, head_cfg=REF.lm_head_config(), max_new_tokens=12, temperature=1.0,
            key=jax.random.key(0),
        )
    )  # fmt: skip
    np.testing.assert_array_equal(out.lengths, 12)
    assert ((out.tokens >= 0) & (out.tokens < V)).all()
    assert int(out.metrics.num_accepted_tokens) > 0
    with pytest.raises(ValueError, match="num_drafts=2 must equal the depth 3"):
        mtpjax.generate(
            model, d, head, prompts, lengths, drafter_cfg=dcfg, num_drafts=2, tree=TREE,
            head_cfg=REF.lm_head_config(), max_new_tokens=4,
        )  # fmt: skip


def test_greedy_tree_speculation_equals_plain_greedy_hybrid(hybrid_pair):  # noqa: F811
    params, head, dcfg, d = hybrid_pair
    model = hybrid.target_model(EXACT, params, head, max_step=TREE.num_rows)
    prompts = np.asarray(_tokens((3, 8), 11, EXACT.vocab_size))
    lengths = np.array([3, 8, 5], np.int32)
    _greedy_pair(model, head, EXACT.lm_head_config(), d, dcfg, TREE, prompts, lengths, 12)


def test_greedy_tree_speculation_equals_plain_greedy_on_the_shipped_pair(
    shipped_pair,  # noqa: F811
    tokenizer,  # noqa: F811
):
    p = shipped_pair
    prompts, lengths = heldout_prompts(tokenizer, width=24)
    prompts, lengths = prompts[:4], lengths[:4]
    model = hybrid.target_model(p["tcfg"], p["target"], p["head"], max_step=TREE.num_rows)
    cfg = p["tcfg"].lm_head_config()
    spec = _greedy_pair(model, p["head"], cfg, p["drafter"], p["dcfg"], TREE, prompts, lengths, 16)
    assert spec.metrics.mean_acceptance_length() > 1.5


# --------------------------------------------------------------------------------------------
# The acceptance rule: greedy.


def _greedy_loop(tree: TreeShape, tokens: np.ndarray, logits: np.ndarray):
    """A Python walk of one sequence: (num_accepted, output tokens)."""
    best = logits.argmax(-1)
    node, out = 0, []
    for d in range(1, tree.depth + 1):
        kids = tree.children(d)[node - tree.level_starts[d - 1]]
        hit = [c for c in kids if tokens[c - 1] == best[node]]
        if not hit:
            break
        node = hit[0]
        out.append(int(tokens[node - 1]))
    return len(out), [*out, int(best[node])]


def test_greedy_tree_acceptance_matches_a_python_walk():
    rng = np.random.default_rng(0)
    n, v = 64, 5  # a small vocab: matches at every depth are common
    tokens = np.stack([rng.permutation(v)[:2] for _ in range(n * 5)]).reshape(n, 10)
    tokens = tokens[:, : TREE.num_drafts].astype(np.int32)  # siblings distinct
    tokens[:, 6:] = rng.integers(0, v, (n, 4))  # the (1,)-branching leaves
    logits = rng.normal(size=(n, TREE.num_rows, v)).astype(np.float32)
    r = jax.device_get(accept_tree(tokens, None, logits, tree=TREE, temperature=0.0))
    seen = set()
    for b in range(n):
        a, out = _greedy_loop(TREE, tokens[b], logits[b])
        seen.add(a)
        assert int(r.num_accepted[b]) == a and int(r.num_output[b]) == a + 1
        np.testing.assert_array_equal(r.output_tokens[b, : a + 1], out)
        assert (r.output_tokens[b, a + 1 :] == -1).all()
        nodes = r.path[b, 1 : a + 1]
        np.testing.assert_array_equal(np.concatenate([[-1], tokens[b]])[nodes], out[:-1])
    assert seen == {0, 1, 2, 3}


def test_greedy_tree_accepts_a_second_child():
    """The root's second child matches, then its first child does: path 0 -> 2 -> 5."""
    v = 8
    tokens = np.array([[1, 2, 3, 4, 5, 6, 7, 7, 7, 7]], np.int32)  # nodes 1..10
    logits = np.zeros((1, TREE.num_rows, v), np.float32)
    logits[0, 0, 2] = logits[0, 2, 5] = logits[0, 5, 0] = 1.0  # node 5's child (9) is 7: no
    r = accept_tree(tokens, None, logits, tree=TREE, temperature=0.0)
    assert int(r.num_accepted[0]) == 2
    np.testing.assert_array_equal(r.output_tokens[0], [2, 5, 0, -1])
    np.testing.assert_array_equal(r.path[0], [0, 2, 5, 5])


# --------------------------------------------------------------------------------------------
# The acceptance rule: sampling is exact (chi-square), a wrong rule is not.

N_SAMPLES = 100_000
SMALL = TreeShape((2, 2))
VS = 5  # vocab


def _dists(rng, shape, spread=0.5):
    logits = rng.normal(scale=spread, size=(*shape, VS))
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _sampling_case(rng, explicit_q):
    """A toy target over contexts of up to two tokens (p0 [V], p1 [V, V], p2 [V, V, V]), drafts
    for N rounds of the (2, 2) tree, and their target rows. One-hot: each node's children are
    the top 2 of its q, fixed before the target draws (as ``propose_tree`` drafts). Explicit q: each
    inner node's children are i.i.d. draws from its q (``draft_probs``)."""
    p0, p1, p2 = _dists(rng, ()), _dists(rng, (VS,)), _dists(rng, (VS, VS))
    n = N_SAMPLES
    q = _dists(rng, (SMALL.num_inner,), spread=1.0)  # per inner node
    if explicit_q:
        cdf = np.cumsum(q, -1)
        draw = lambda node, size: np.minimum(  # noqa: E731
            (rng.random((size, 1)) > cdf[node]).sum(-1), VS - 1
        )
        d1 = np.stack([draw(0, n), draw(0, n)], 1)
        d2 = np.stack([draw(1, n), draw(1, n), draw(2, n), draw(2, n)], 1)
    else:  # the drafter's top 2 per inner node, the same every round
        top = np.argsort(-q, axis=1, kind="stable")[:, :2]  # [inner, 2]
        d1 = np.broadcast_to(top[0], (n, 2))
        d2 = np.broadcast_to(np.concatenate([top[1], top[2]]), (n, 4))
    tokens = np.concatenate([d1, d2], 1).astype(np.int32)  # nodes 1..6
    rows = [np.broadcast_to(p0, (n, VS)), p1[d1[:, 0]], p1[d1[:, 1]]]
    parents = SMALL.parents()
    for j in range(4):
        node = 3 + j
        first = d1[:, parents[node] - 1]
        rows.append(p2[first, d2[:, j]])
    probs = np.stack(rows, 1)  # [n, S, V]
    draft_probs = np.broadcast_to(q, (n, *q.shape)).astype(np.float32) if explicit_q else None
    return (p0, p1, p2), tokens, draft_probs, probs


def _complete(rng, out, num_output, p1):
    """The first two tokens: the round's, or (when it emitted one) the second from the target
    itself after the first, p1[first]."""
    second = out[:, 1].copy()
    short = num_output < 2
    cdf = np.cumsum(p1[out[short, 0]], -1)
    second[short] = np.minimum((rng.random((short.sum(), 1)) > cdf).sum(-1), VS - 1)
    return out[:, 0], second


def _wrong_tree_rule(rng, tokens, probs):
    """Multi-candidate sampling with one flaw, written here and never in the library: every
    sibling is tried against the node's own row p instead of the residual left by the earlier
    rejections (the final draw still takes the residual). Numpy, one-hot drafts, (2, 2) tree."""
    n = tokens.shape[0]
    rows = np.arange(n)
    node = np.zeros(n, int)
    alive = np.ones(n, bool)
    out = np.full((n, 3), -1)
    count = np.zeros(n, int)
    final = probs[:, 0].copy()
    for d in (1, 2):
        kids = np.asarray(SMALL.children(d))[node - SMALL.level_starts[d - 1]]  # [n, 2]
        p = probs[rows, node]
        residual = p.copy()
        found = np.zeros(n, bool)
        chosen = node.copy()
        for j in range(2):
            x = tokens[rows, kids[:, j] - 1]
            ok = alive & ~found & (rng.random(n) < p[rows, x])
            chosen = np.where(ok, kids[:, j], chosen)
            found |= ok
            residual[rows[~found], x[~found]] = 0
        residual /= residual.sum(-1, keepdims=True)
        dies = alive & ~found
        final[dies] = residual[dies]
        out[alive & found, d - 1] = tokens[rows, chosen - 1][alive & found]
        count += alive & found
        final[found] = probs[rows, chosen][found]
        node = np.where(found, chosen, node)
        alive &= found
    cdf = np.cumsum(final, -1)
    token = np.minimum((rng.random((n, 1)) > cdf).sum(-1), VS - 1)
    out[rows, count] = token
    return out, count + 1


@pytest.mark.parametrize("explicit_q", [False, True], ids=["top_k", "draft_probs"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_tree_sampling_emits_the_target_distribution(explicit_q, temperature):
    """The first token is p0 and the first two are jointly p0(x) p1[x](y), whichever branch
    (or none) the round took; deep paths are well exercised."""
    rng = np.random.default_rng(int(10 * temperature) + explicit_q)
    (p0, p1, _), tokens, draft_probs, probs = _sampling_case(rng, explicit_q)
    logits = (temperature * np.log(probs)).astype(np.float32)  # softmax(l / T) = p
    r = accept_tree(
        tokens, draft_probs, logits, tree=SMALL, temperature=temperature,
        key=jax.random.key(3, impl="rbg"),
    )  # fmt: skip
    out, num_output = np.asarray(r.output_tokens), np.asarray(r.num_output)
    assert _chi2_pvalue(out[:, 0], p0) > P_FLOOR
    first, second = _complete(rng, out, num_output, p1)
    assert _chi2_pvalue(first * VS + second, p0[:, None] * p1) > P_FLOOR
    assert np.mean(num_output == 3) > 0.1  # the leaves' bonus rows are reached
    took_second = np.asarray(r.path[:, 1]) == 2
    assert took_second.mean() > 0.02, took_second.mean()  # second children get accepted


def test_a_wrong_tree_rule_fails():
    rng = np.random.default_rng(1)
    (p0, p1, _), tokens, _, probs = _sampling_case(rng, explicit_q=False)
    out, num_output = _wrong_tree_rule(rng, tokens, probs)
    first, second = _complete(rng, out, num_output, p1)
    pvalues = (_chi2_pvalue(out[:, 0], p0), _chi2_pvalue(first * VS + second, p0[:, None] * p1))
    assert min(pvalues) < P_FLOOR, pvalues
