"""Which leaves of a drafter state a jitted step donates: the bulk buffers, not the bookkeeping.

A step updates the KV pages, block tables, row keys and free stack in slices, so donating them
lets XLA write into the input buffers instead of copying them whole. A state's per-sequence
vectors (``seq_len``, error bits, ``last_num_drafted``, ...) and its scalars (the allocator's
``num_free``) are rewritten whole by elementwise ops that still read the old values: donated,
XLA copies each old value aside before the new one takes its buffer, two device copies per
leaf, each a launch of its own. Not donated, a rewritten one gets a fresh buffer and no copy;
one the step leaves as it was would be copied into its output buffer, so the step hands those
back as None and the caller keeps the input's (``step`` does both). Which leaves are which
follows from their shapes alone: a state always splits the same way, one jit cache entry. The
jitted body takes the state as its two lists of leaves and returns it as one, so a call
flattens the state once and rebuilds it once, the split looked up rather than recomputed.

``step`` jits a step ``f(..., state, ...) -> new_state`` or ``-> (..., new_state)`` of a
``DrafterState`` (any state with ``num_seqs``); a caller's own function of a state (a propose
with its arguments bound, say) jitted through it donates what the library's steps donate,
where a plain ``jax.jit`` donating the whole state brings the copies back.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax


class Layout(NamedTuple):
    """How a state's leaves split: its structure, and per leaf (in flattening order) whether it
    is bookkeeping (a scalar, or a vector of at most one entry per sequence)."""

    treedef: Any
    books: tuple[bool, ...]


@functools.lru_cache(maxsize=256)
def _layout(treedef, shapes: tuple, num_seqs: int) -> Layout:
    books = tuple(len(s) == 0 or (len(s) == 1 and s[0] <= num_seqs) for s in shapes)
    return Layout(treedef, books)


def layout_of(state) -> tuple[Layout, list]:
    """``(layout, leaves)`` of a state. Runs on every call of a step: one flatten, and the split
    looked up by structure and shapes (mapping over the leaves cost a call tens of µs)."""
    n = getattr(state, "num_seqs", None)
    if not isinstance(n, int):
        raise TypeError(f"state must be a DrafterState, got {type(state).__name__}")
    leaves, treedef = jax.tree.flatten(state)
    return _layout(treedef, tuple(x.shape for x in leaves), n), leaves


def split(state):
    """``(bulk, books)``: two pytrees of ``state``'s structure, each holding its share of the
    leaves and None in place of the other's; ``join`` undoes it."""
    layout, leaves = layout_of(state)
    bulk = [None if b else x for x, b in zip(leaves, layout.books)]
    books = [x if b else None for x, b in zip(leaves, layout.books)]
    return layout.treedef.unflatten(bulk), layout.treedef.unflatten(books)


def join(bulk, books):
    """The state ``split`` took apart (a None of ``books`` may also be filled from ``bulk``)."""
    ours, treedef = jax.tree.flatten(bulk, is_leaf=_is_none)
    theirs = treedef.flatten_up_to(books)
    return treedef.unflatten([b if a is None else a for a, b in zip(ours, theirs)])


def _is_none(x) -> bool:
    return x is None


def _with_state(result, replace):
    """``result`` (a state, or a tuple ending in one) with its state mapped by ``replace``."""
    if isinstance(result, tuple):
        return (*result[:-1], replace(result[-1]))
    return replace(result)


class _Args(NamedTuple):
    """A step's arguments as its jitted body takes them: the state's layout (static), its
    bookkeeping leaves (kept), and the arguments with the state replaced by its bulk leaves
    (donated); ``leaves`` are the state's leaves, for the untouched bookkeeping handed back."""

    layout: Layout
    books: tuple
    args: list
    leaves: list

    def result(self, out):
        """The step's result, its state rebuilt from the body's flat leaves (None: unchanged)."""

        def rebuild(new):
            return self.layout.treedef.unflatten(
                [old if x is None else x for x, old in zip(new, self.leaves)]
            )

        return _with_state(out, rebuild)


class _Compiled:
    """A compiled split step, called as the step is (its static arguments left out); any other
    attribute is the ``jax.stages.Compiled``'s."""

    def __init__(self, compiled, split_args, layout: Layout):
        self._compiled, self._split_args, self._layout = compiled, split_args, layout

    def __call__(self, *args, **kwargs):
        a = self._split_args(args)
        if a.layout is not self._layout and a.layout != self._layout:
            raise TypeError("the state's structure or shapes differ from the lowered one's")
        return a.result(self._compiled(a.books, *a.args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._compiled, name)


class _Lowered:
    """A lowered split step; ``compile`` takes ``jax.stages.Lowered.compile``'s options, any
    other attribute is the ``jax.stages.Lowered``'s."""

    def __init__(self, lowered, split_args, layout: Layout):
        self._lowered, self._split_args, self._layout = lowered, split_args, layout

    def compile(self, **options) -> _Compiled:
        return _Compiled(self._lowered.compile(**options), self._split_args, self._layout)

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
        # The layout and the books come first: every argument is two places later in the body.
        donated = (pos + 2, *(names.index(n) + 2 for n in donate_argnames))

        def split_step(layout, books, *args, **kwargs):
            args = list(args)
            books_in, bulk_in = iter(books), iter(args[pos])
            leaves = [next(books_in) if b else next(bulk_in) for b in layout.books]
            args[pos] = layout.treedef.unflatten(leaves)
            result = fun(*args, **kwargs)

            def hand_back(new):
                out, treedef = jax.tree.flatten(new)
                if treedef != layout.treedef:
                    raise TypeError(
                        f"{fun.__name__} returned a state of another structure than it was given"
                    )
                # A bookkeeping leaf the step left as it was goes back as None: the caller keeps
                # its own array (returned, XLA would copy it into a fresh output buffer).
                # A list, not a tuple: a step returning its state alone stays told apart from
                # one returning (..., state).
                return [
                    None if b and x is old else x for x, old, b in zip(out, leaves, layout.books)
                ]

            return _with_state(result, hand_back)

        # Named as the step, for tracebacks and profiles.
        split_step.__name__ = split_step.__qualname__ = fun.__name__
        jitted = jax.jit(
            split_step,
            static_argnums=(0,),
            static_argnames=static_argnames,
            donate_argnums=donated,
        )

        def split_args(args) -> _Args:
            args = list(args)
            layout, leaves = layout_of(args[pos])
            books = tuple(x for x, b in zip(leaves, layout.books) if b)
            args[pos] = tuple(x for x, b in zip(leaves, layout.books) if not b)
            return _Args(layout, books, args, leaves)

        @functools.wraps(fun)
        def call(*args, **kwargs):
            a = split_args(args)
            return a.result(jitted(a.layout, a.books, *a.args, **kwargs))

        def lower(*args, **kwargs) -> _Lowered:
            a = split_args(args)
            return _Lowered(
                jitted.lower(a.layout, a.books, *a.args, **kwargs), split_args, a.layout
            )

        call.lower = lower
        call._cache_size = jitted._cache_size
        call.clear_cache = jitted.clear_cache
        return call

    return wrap
