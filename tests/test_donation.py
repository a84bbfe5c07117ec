"""mtpjax.kv.donation: the steps donate a state's bulk buffers and keep its bookkeeping, so XLA
neither copies the old bookkeeping aside nor copies an untouched one into its output."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import clone, make, new_state, pairs, random_pairs, tiny_cfg

from mtpjax import drafter
from mtpjax.drafter import _propose, _trim
from mtpjax.kv import donation
from mtpjax.verify import _step, verify
from pallas_kernels.implementation import Implementation

B, K = 4, 3
BOOKKEEPING = {"num_free", "seq_len", "error", "last_num_drafted", "window_error", "freed"}


def _names(tree) -> list[str]:
    """The last attribute name of each leaf's path."""
    return [
        next(k.name for k in reversed(path) if isinstance(k, jax.tree_util.GetAttrKey))
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(0), (B, 6))
    window = pairs(tokens, hidden, [6, 5, 4, 6], [0, 0, 0, 0])
    state = drafter.prefill(params, head, new_state(cfg, B), window, cfg=cfg, chunk_size=4)
    return cfg, params, head, window, state


def test_split_takes_the_bookkeeping_out_and_join_puts_it_back(setup):
    *_, state = setup
    bulk, books = donation.split(state)
    assert set(_names(books)) == BOOKKEEPING
    assert not set(_names(bulk)) & BOOKKEEPING  # every other leaf is bulk
    assert len(jax.tree.leaves(bulk)) + len(jax.tree.leaves(books)) == len(jax.tree.leaves(state))
    back = donation.join(bulk, books)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)))


def test_a_step_donates_the_bulk_and_hands_back_untouched_bookkeeping(setup):
    cfg, params, head, window, state = setup
    drafts, state = drafter.propose(params, head, clone(state), window, cfg=cfg, num_drafts=K)
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((B, K + 1, cfg.hidden_size)))
    bulk, books = donation.split(state)
    _, new = verify(head, state, hidden.astype(jnp.float32), drafts, cfg=cfg.lm_head_config())
    assert all(x.is_deleted() for x in jax.tree.leaves(bulk))  # donated
    assert not any(x.is_deleted() for x in jax.tree.leaves(books))  # kept
    # The verify trims rows and resets the round; it leaves the refusal and free bits alone,
    # and those come back as the caller's own arrays (no copy).
    assert new.freed is state.freed and new.window_error is state.window_error
    assert new.last_num_drafted is not state.last_num_drafted
    np.testing.assert_array_equal(new.last_num_drafted, 0)


def test_the_split_step_computes_what_a_plain_jit_of_the_body_does(setup):
    cfg, params, head, window, state = setup
    kw = dict(cfg=cfg, num_drafts=K)
    drafts, got = drafter.propose(params, head, clone(state), window, **kw)
    plain = jax.jit(drafter.propose, static_argnames=("cfg", "num_drafts"))
    want_drafts, want = plain(params, head, clone(state), window, **kw)
    np.testing.assert_array_equal(drafts.tokens, want_drafts.tokens)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def _entry_parameters(hlo: str) -> dict[str, int]:
    entry = hlo[hlo.index("ENTRY") :]
    return {m[0]: int(m[1]) for m in re.findall(r"%(\S+) = \S+ parameter\((\d+)\)", entry)}


def _compiled_steps(setup):
    """(name, compiled text, number of bookkeeping leaves) of each drafter step."""
    cfg, params, head, window, state = setup
    s = clone(state)
    drafts, proposed = drafter.propose(params, head, clone(s), window, cfg=cfg, num_drafts=K)
    hidden = jnp.zeros((B, K + 1, cfg.hidden_size), jnp.float32)
    n_books = len(jax.tree.leaves(donation.split(state)[1]))
    propose = _propose._propose.lower(
        _propose.as_modules(params, cfg), head, s,
        _propose.check_propose_inputs(s, window, cfg, 1), None, None, None, None,
        cfg=cfg, num_drafts=K, hidden_contract=cfg.default_hidden_contract,
        head_cfg=cfg.lm_head_config(), return_logits=False, implementation=Implementation.AUTO,
    )  # fmt: skip
    verify_ = _step._verify.lower(
        head, proposed, hidden, drafts, 0.0, None, jnp.asarray(False), None, None, None,
        cfg=cfg.lm_head_config(), implementation="auto",
    )  # fmt: skip
    lowered = {
        "propose": propose,
        "verify": verify_,
        "after_verify": _trim._after_verify.lower(
            proposed, jnp.ones((B,), jnp.int32), np.zeros((B,), bool)
        ),
        "free": _trim._free.lower(s, jnp.asarray([True, False, False, False])),
    }
    return [(name, low.compile().as_text(), n_books) for name, low in lowered.items()]


def test_no_step_copies_or_aliases_the_bookkeeping(setup):
    for name, hlo, n_books in _compiled_steps(setup):
        params = _entry_parameters(hlo)  # (unused arguments are pruned: numbers are not positions)
        books = {p for p in params if p.startswith("books")}
        assert 0 < len(books) <= n_books, name
        copied = re.findall(r"= \S+ copy\(%(\S+?)\)", hlo)
        assert not books & set(copied), (name, books & set(copied))
        number = {i: p for p, i in params.items()}
        aliased = {number[int(i)] for i in re.findall(r"\(\s*(\d+),\s*\{[^}]*\},\s*may-alias", hlo)}
        assert aliased, name  # the bulk is donated
        assert not aliased & books, (name, aliased & books)


def test_a_step_given_something_else_than_a_state_names_what_it_got(setup):
    cfg, _, head, *_ = setup
    with pytest.raises(TypeError, match="state must be a DrafterState, got dict"):
        verify(head, {"seq_len": jnp.zeros(B, jnp.int32)}, None, None, cfg=cfg.lm_head_config())


def test_a_callers_own_function_jitted_through_step_donates_as_the_steps_do(setup):
    *_, state = setup

    def close_round(extra, state):
        _, state = drafter.after_verify(state, jnp.zeros(B, jnp.int32))
        return extra + 1, state

    f = donation.step(donate_argnames=("extra",))(close_round)
    for call in (f, f.lower(jnp.zeros(8), state).compile()):  # jitted, and compiled ahead
        s, extra = clone(state), jnp.zeros(8)
        bulk, books = donation.split(s)
        out, new = call(extra, s)
        np.testing.assert_array_equal(out, 1)
        assert extra.is_deleted() and all(x.is_deleted() for x in jax.tree.leaves(bulk))
        assert not any(x.is_deleted() for x in jax.tree.leaves(books))
        assert new.freed is s.freed  # untouched: the caller's own array
        np.testing.assert_array_equal(new.kv[0].seq_len, state.kv[0].seq_len)
