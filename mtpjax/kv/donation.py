"""Which leaves of a drafter state a jitted step donates: the bulk buffers, not the bookkeeping.

A step updates the KV pages, block tables, row keys and free stack in slices, so donating them
lets XLA write into the input buffers instead of copying them whole. A state's per-sequence
vectors (``seq_len``, error bits, ``last_num_drafted``, ...) and its scalars (the allocator's
``num_free``) are rewritten whole by elementwise ops that still read the old values: donated,
XLA copies each old value aside before the new one takes its buffer, two device copies per
leaf, each a launch of its own. Not donated, a rewritten one gets a fresh buffer and no copy;
one the step leaves as it was would be copied into its output buffer, so the step hands those
back as None and the caller keeps the input's (``step`` does both). Which leaves are which
follows from their shapes alone: a state always splits the same way, one jit cache entry.

``step`` jits a step ``f(..., state, ...) -> new_state`` or ``-> (..., new_state)`` of a
``DrafterState`` (any state with ``num_seqs``); a caller's own function of a state (a propose
with its arguments bound, say) jitted through it donates what the library's steps donate,
where a plain ``jax.jit`` donating the whole state brings the copies back.
"""

from __future__ import annotations

import functools
import inspect

import jax


def _is_bookkeeping(x: jax.Array, num_seqs: int) -> bool:
    """A scalar or a vector of at most one entry per sequence."""
    return x.ndim == 0 or (x.ndim == 1 and x.shape[0] <= num_seqs)


def _is_none(x) -> bool:
    return x is None


def split(state):
    """``(bulk, books)``: two pytrees of ``state``'s structure, each holding its share of the
    leaves and None in place of the other's; ``join`` undoes it."""
    n = getattr(state, "num_seqs", None)
    if not isinstance(n, int):
        raise TypeError(f"state must be a DrafterState, got {type(state).__name__}")
    bulk = jax.tree.map(lambda x: None if _is_bookkeeping(x, n) else x, state)
    books = jax.tree.map(lambda x: x if _is_bookkeeping(x, n) else None, state)
    return bulk, books


def join(bulk, books):
    """The state ``split`` took apart (a None of ``books`` may also be filled from ``bulk``)."""
    return jax.tree.map(lambda b, s: s if b is None else b, bulk, books, is_leaf=_is_none)


def _drop_unchanged(books, before):
    """``books`` with None where a leaf is the very input leaf (traced: the step left it)."""
    return jax.tree.map(
        lambda new, old: None if new is old else new, books, before, is_leaf=_is_none
    )


def _with_state(result, replace):
    """``result`` (a state, or a tuple ending in one) with its state mapped by ``replace``."""
    if isinstance(result, tuple):
        return (*result[:-1], replace(result[-1]))
    return replace(result)


class _Compiled:
    """A compiled split step, called as the step is (its static arguments left out); any other
    attribute is the ``jax.stages.Compiled``'s."""

    def __init__(self, compiled, split_args):
        self._compiled, self._split_args = compiled, split_args

    def __call__(self, *args, **kwargs):
        books, args = self._split_args(args)
        result = self._compiled(books, *args, **kwargs)
        return _with_state(result, lambda new: join(new, books))

    def __getattr__(self, name):
        return getattr(self._compiled, name)


class _Lowered:
    """A lowered split step; ``compile`` takes ``jax.stages.Lowered.compile``'s options, any
    other attribute is the ``jax.stages.Lowered``'s."""

    def __init__(self, lowered, split_args):
        self._lowered, self._split_args = lowered, split_args

    def compile(self, **options) -> _Compiled:
        return _Compiled(self._lowered.compile(**options), self._split_args)

    def __getattr__(self, name):
        return getattr(self._lowered, name)


def step(
    *,
    static_argnames: tuple[str, ...] = (),
    donate_argnames: tuple[str, ...] = (),
    state: str = "state",
):
    """``jax.jit`` of a step, donating the bulk of its ``state`` argument and keeping its
    bookkeeping, and donating the ``donate_argnames`` arguments whole (these and ``state`` are
    passed positionally); the wrapped step's signature and results are unchanged.

    The returned function also has ``lower`` (of the step's arguments; its ``compile`` gives a
    callable of them too) and the jitted body's ``_cache_size`` and ``clear_cache``.
    """

    def wrap(fun):
        names = list(inspect.signature(fun).parameters)
        pos = names.index(state)
        # The books come first, so every argument is one place later in the jitted body.
        donated = (pos + 1, *(names.index(n) + 1 for n in donate_argnames))

        def split_step(books, *args, **kwargs):
            args = list(args)
            args[pos] = join(args[pos], books)
            result = fun(*args, **kwargs)

            def hand_back(new):
                new_bulk, new_books = split(new)
                return join(new_bulk, _drop_unchanged(new_books, books))

            return _with_state(result, hand_back)

        # Named as the step, for tracebacks and profiles.
        split_step.__name__ = split_step.__qualname__ = fun.__name__
        jitted = jax.jit(split_step, static_argnames=static_argnames, donate_argnums=donated)

        def split_args(args):
            args = list(args)
            args[pos], books = split(args[pos])
            return books, args

        @functools.wraps(fun)
        def call(*args, **kwargs):
            books, args = split_args(args)
            result = jitted(books, *args, **kwargs)
            return _with_state(result, lambda new: join(new, books))

        def lower(*args, **kwargs) -> _Lowered:
            books, args = split_args(args)
            return _Lowered(jitted.lower(books, *args, **kwargs), split_args)

        call.lower = lower
        call._cache_size = jitted._cache_size
        call.clear_cache = jitted.clear_cache
        return call

    return wrap
