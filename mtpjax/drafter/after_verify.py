"""After a verify round: drop the drafter rows the next propose must rebuild; free sequences.

Invariant. Let a sequence's committed tokens be ``t_0 .. t_n`` and ``h_i`` the target's hidden at
position i (known for i < n). Its *rebuild* is the rows of the pairs ``(t_{i+1}, h_i)`` at keys
``i = 0 .. n-1``, as the prefill or ``kv_rows`` writes them from scratch. Between rounds (after
``after_verify``, before the next ``propose``) every held row has key <= ``last_pair_key`` and
holds its key's committed token; its hidden is the target's, except — only without ``refeed`` —
accepted chain rows, which keep the drafter-side hidden that the chain fed them. The next
``propose`` writes the keys past ``last_pair_key`` from the verify window with the target's
hidden, so with ``refeed=True`` the rows equal the rebuild exactly, round after round.

Why the trim is what it is. ``propose`` leaves ``K`` rows at keys ``e .. e+K-1``: ``R_0``, the
anchor ``(t_n, h_{n-1})`` with the target's hidden, and ``R_j = (d_j, hid_j)`` for
``j = 1 .. K-1`` with the drafter-side hidden. A verify that accepts ``a`` drafts commits
``d_1 .. d_a`` and one target token, so ``R_j``'s token is committed iff ``j <= a``: the rows
with committed tokens are the first ``A = min(a + 1, K)``. ``after_verify`` therefore calls the
seed engine's rule with ``num_accepted = A``:

- ``rows_to_trim(K, A, refeed=False) = K - A``: exactly the rows whose token was rejected.
- ``rows_to_trim(K, A, refeed=True) = K - 1`` (A >= 1): every drafter-hidden row goes too; the
  anchor stays.

The rows left end at key ``e + A - 1`` (or ``e``), and the verify window the next propose gets —
the accepted drafts and the emitted token, with the verify's hidden at keys ``e+1 .. e+a+1`` —
covers every key past that. (The seed engine passed ``num_accepted = a``, identifying ``R_j``
with the draft it produced; that also drops ``R_a``, whose token is committed, and on a full
reject the anchor, which the next propose could only rebuild if re-fed the previous anchor's
hidden. The rule itself is unchanged and tested on its own.) A propose that is never verified
counts as fully rejected: the next propose or prefill drops its chain rows itself.

Shapes: ``[B]`` sequences.
"""

from __future__ import annotations

import functools
import numbers

import chex
import jax
import jax.numpy as jnp

from mtpjax.kv import DrafterState, free_sequences, truncate

__all__ = ["after_verify", "free", "rows_to_trim"]


def _is_python_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, jax.Array)


def rows_to_trim(num_drafted, num_accepted, refeed):
    """How many drafter rows to drop after a verify (the seed engine's rule).

    ``min(num_drafted, (num_drafted - num_accepted) + (max(num_accepted - 1, 0) if refeed
    else 0))``, with the rejected count floored at 0. Rejected rows always go; with ``refeed``
    the accepted rows written with the drafter's hidden (all but the first) go too, to be
    rebuilt from the target's. Never more than ``num_drafted``.

    Pure: Python ints (and a bool ``refeed``) give a Python int; arrays give int32 arrays
    (``refeed`` may then be a bool array too).
    """
    if _is_python_int(num_drafted) and _is_python_int(num_accepted) and isinstance(refeed, bool):
        rejected = max(num_drafted - num_accepted, 0)
        drafter_hidden = max(num_accepted - 1, 0) if refeed else 0
        return min(num_drafted, rejected + drafter_hidden)
    d = jnp.asarray(num_drafted, jnp.int32)
    a = jnp.asarray(num_accepted, jnp.int32)
    rejected = jnp.maximum(d - a, 0)
    drafter_hidden = jnp.where(jnp.asarray(refeed, bool), jnp.maximum(a - 1, 0), 0)
    return jnp.minimum(d, rejected + drafter_hidden).astype(jnp.int32)


@functools.partial(jax.jit, donate_argnames=("state",))
def after_verify(
    state: DrafterState, num_accepted: jax.Array, *, refeed: bool | jax.Array = False
) -> tuple[jax.Array, DrafterState]:
    """Trims the rows of the last propose that the next one must rebuild.

    Args:
      state: the drafter state after ``propose``; donated.
      num_accepted: int32[B] drafts the verify accepted (clipped to ``[0, last_num_drafted]``).
      refeed: bool or bool[B] (traced, no recompile); also drop the accepted rows built from the
        drafter's hidden so the next propose rebuilds them from the target's.

    Returns:
      (rows trimmed int32[B], new state) with ``seq_len`` and ``last_pair_key`` lowered by the
      trim and ``last_num_drafted = 0`` (a second call trims nothing). Sequences that did not
      draft (``last_num_drafted == 0``) are untouched. A `MultiDrafterState` is trimmed by
      `multi_module.after_verify_multi` (then the trims are int32[B, N], one per module).
    """
    if not isinstance(state, DrafterState):
        from mtpjax.drafter import multi_module  # it builds on this module

        if isinstance(state, multi_module.MultiDrafterState):
            return multi_module.after_verify_multi.__wrapped__(state, num_accepted, refeed=refeed)
        raise TypeError(f"state must be a DrafterState, got {type(state).__name__}")
    B = state.num_seqs
    num_accepted = jnp.asarray(num_accepted, jnp.int32)
    chex.assert_shape(num_accepted, (B,))
    drafted = state.last_num_drafted
    accepted = jnp.clip(num_accepted, 0, drafted)
    committed_rows = jnp.minimum(accepted + 1, drafted)  # the anchor + the accepted drafts' rows
    trim = rows_to_trim(drafted, committed_rows, refeed)
    new_state = DrafterState(
        kv=truncate(state.kv, trim),
        last_pair_key=state.last_pair_key - trim,
        last_num_drafted=jnp.zeros_like(drafted),
    )
    return trim, new_state


@functools.partial(jax.jit, donate_argnames=("state",))
def free(state: DrafterState, mask: jax.Array) -> DrafterState:
    """Returns the blocks of the sequences where ``mask`` bool[B] to the allocator and resets
    their rows and bookkeeping (``last_pair_key = -1``). ``state`` is donated."""
    if not isinstance(state, DrafterState):
        from mtpjax.drafter import multi_module  # it builds on this module

        if isinstance(state, multi_module.MultiDrafterState):
            return multi_module.free_multi.__wrapped__(state, mask)
        raise TypeError(f"state must be a DrafterState, got {type(state).__name__}")
    mask = jnp.asarray(mask, bool)
    chex.assert_shape(mask, (state.num_seqs,))
    return free_sequences(state, mask)
