"""After a verify round: drop the drafter rows whose token was not committed; free sequences.

A round with anchor key ``e`` leaves the row of step ``s`` (module ``m(s)``, key ``e + s``,
``s < K``) holding token ``d_s`` (``t_{e+1}`` for the anchor, s = 0). A verify that accepts ``a``
drafts commits ``d_1 .. d_a`` and one target token, so that row's token is committed iff
``s <= a``, and ``module_trims`` keeps exactly those rows, with two refinements that keep module
0 dense:

- N = 1 (the single head): rows ``0 .. A-1``, ``A = min(a + 1, K)``, are committed, and the seed
  engine's rule is called with ``num_accepted = A``: ``rows_to_trim(K, A, False) = K - A`` (the
  rejected rows) or, with ``refeed``, ``K - 1`` (every drafter-hidden row goes; the anchor
  stays). (The seed engine passed ``a``: that also drops ``R_a``, whose token is committed, and
  on a full reject the anchor, which no later window rebuilds.)
- N >= 2 (CYCLE): module 0 keeps only its anchor (its chain rows at keys ``e + N, e + 2N, ...``
  would leave holes at the keys the other modules wrote).

The next window (the accepted drafts and the emitted token with the verify's hidden, from key
``e + 1``) then covers every key past module 0's rows, so with ``refeed`` (or N >= 2) module 0's
rows equal a from-scratch rebuild of the pairs ``(t_{i+1}, h_i)``, round after round; without it,
accepted chain rows keep the drafter-side hidden the chain fed them. ``refeed`` has no effect on
modules ``>= 1``: their rows are drafter-side by definition. A propose never verified counts as a
full reject: the next propose or prefill drops its rows itself.

Shapes: ``[B]`` sequences, ``[N]`` modules.
"""

from __future__ import annotations

import dataclasses
import numbers

import chex
import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.kv import donation
from mtpjax.kv.state import DrafterState, drop_newest, free_sequences


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


def rows_written(num_modules: int, num_drafted: jax.Array) -> jax.Array:
    """int32[..., N] rows module m wrote in a round of K = ``num_drafted`` steps: its steps
    ``s < K`` with ``s mod N = m`` (module 0's count includes the anchor's step)."""
    K = jnp.asarray(num_drafted, jnp.int32)[..., None]
    m = jnp.arange(num_modules, dtype=jnp.int32)
    return jnp.where(m < K, (K - 1 - m) // num_modules + 1, 0)


def module_trims(num_modules: int, rows_written, num_drafted, num_accepted, refeed):
    """Rows each module drops after a verify: int32[..., N] (pure; ints or arrays in).

    Args:
      num_modules: static N.
      rows_written: int32[..., N] rows each module wrote in the round.
      num_drafted: int32[...] K of the round (0: nothing to trim).
      num_accepted: int32[...] drafts accepted (clipped to ``[0, K]``).
      refeed: bool or bool[...]; only affects module 0 when N = 1.

    A module keeps the rows of its steps ``s <= min(a, K-1)`` (their tokens are committed);
    module 0 with N >= 2 keeps only its anchor.
    """
    N = num_modules
    written = jnp.asarray(rows_written, jnp.int32)
    K = jnp.asarray(num_drafted, jnp.int32)
    a = jnp.clip(jnp.asarray(num_accepted, jnp.int32), 0, K)
    last_kept = jnp.minimum(a, K - 1)  # -1 when nothing was drafted
    trims = []
    for m in range(N):
        R = written[..., m]
        kept = jnp.minimum(jnp.where(last_kept >= m, (last_kept - m) // N + 1, 0), R)
        if m == 0 and N == 1:
            trim = rows_to_trim(R, kept, refeed)
        elif m == 0:
            trim = R - jnp.minimum(R, 1)
        else:
            trim = R - kept
        trims.append(trim)
    return jnp.stack(trims, axis=-1).astype(jnp.int32)


def trim_round(
    state: DrafterState, num_accepted: jax.Array, refeed: jax.Array, where: jax.Array
) -> tuple[jax.Array, DrafterState]:
    """The trim of ``after_verify`` on the sequences ``where`` bool[B]; their round is closed."""
    K = state.last_num_drafted
    written = rows_written(state.num_modules, K)
    trims = module_trims(state.num_modules, written, K, num_accepted, refeed)
    trims = jnp.where(where[:, None], trims, 0)
    state = drop_newest(state, trims)
    return trims, dataclasses.replace(state, last_num_drafted=jnp.where(where, 0, K))


def _check_state(state: DrafterState) -> int:
    if not isinstance(state, DrafterState):
        raise TypeError(f"state must be a DrafterState, got {type(state).__name__}")
    return state.num_seqs


@donation.step()
def _after_verify(state, num_accepted, refeed):
    return trim_round(state, num_accepted, refeed, jnp.ones_like(refeed))


def after_verify(
    state: DrafterState, num_accepted: jax.Array, *, refeed: bool | jax.Array = False
) -> tuple[jax.Array, DrafterState]:
    """Trims the rows of the last round whose token the verify did not commit.

    Args:
      state: the state after ``propose``; donated.
      num_accepted: int32[B] drafts accepted (clipped to ``[0, K]``).
      refeed: bool or bool[B] (traced: any spelling shares one program); with N = 1, also drop
        the accepted rows built from the drafter's hidden so the next propose rebuilds them
        from the target's. No effect on other rows.

    Returns:
      (rows trimmed int32[B, N], new state) with ``last_num_drafted = 0`` (a second call trims
      nothing). Sequences that did not draft are untouched.
    """
    B = _check_state(state)
    num_accepted = jnp.asarray(num_accepted, jnp.int32)
    chex.assert_shape(num_accepted, (B,))
    if isinstance(refeed, jax.Array):  # a device or traced flag
        refeed = jnp.broadcast_to(refeed.astype(bool), (B,))
    else:  # a Python or NumPy flag, broadcast on the host: no device op before the jitted trim
        refeed = np.broadcast_to(np.asarray(refeed, bool), (B,))
    return _after_verify(state, num_accepted, refeed)


@donation.step()
def _free(state, mask):
    return free_sequences(state, mask)


def free(state: DrafterState, mask: jax.Array) -> DrafterState:
    """Returns every module's blocks of the sequences where ``mask`` bool[B] to the allocators
    and resets them; the slot's next window must start at key 0 (else ``WindowError``).
    ``state`` is donated."""
    mask = jnp.asarray(mask, bool)
    chex.assert_shape(mask, (_check_state(state),))
    return _free(state, mask)
