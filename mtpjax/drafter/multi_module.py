"""The multi-module MTP proposer (DeepSeek-V3 / GLM / MiniMax-M2 / multi-layer Qwen): N modules,
each with its own weights, paged KV pool and ``DrafterState``; draft ``s + 1`` comes from the
module that runs step ``s``, fed the previous step's draft and hidden.

    params = multi_module.init_multi(cfg, key=key)               # cfg.num_mtp_modules modules
    state = multi_module.init_multi_state(pool_cfg, num_seqs=B, num_modules=N)
    state = multi_module.prefill_multi(params, head, state, prompt_pairs, cfg=cfg)
    out, state = multi_module.propose_multi(params, head, state, window, cfg=cfg, num_drafts=k)
    ... verify ...
    trimmed, state = multi_module.after_verify_multi(state, num_accepted)

Keys. Every module keys its rows by the single head's rule (``mtpjax.drafter.propose``): the row
at key ``i`` holds a pair whose token is ``t_{i+1}``, at RoPE position ``i``.

Schedule (``ModuleSchedule``, a static field of ``MultiDrafterParams``). A round with anchor key
``e`` (``t_{e+1}`` the newest committed token) runs ``K`` steps; step ``s`` runs module ``m(s)``
at key ``e + s``:

- CLAMP (default; the seed engine): ``m(s) = s``. A request for more drafts than modules is
  clamped: ``K = min(num_drafts, N)``, and the outputs are ``[B, K]``.
- CYCLE (vLLM's ``spec_step_idx % N``): ``m(s) = s mod N``; ``num_drafts`` must be a multiple
  of ``N`` (ValueError otherwise) and ``K = num_drafts``.

Step 0 is module 0's forward on the anchor row ``(t_{e+1}, h_e)`` (the target's hidden) and
gives draft ``d_1``; step ``s >= 1`` appends the row ``(d_s, g_{s-1})`` at key ``e + s`` to module
``m(s)`` and gives ``d_{s+1}``, where ``g_s`` is what the hidden contract hands over from step
``s``: its ``h_out`` (POST_NORM), its pre-norm residual (PRE_NORM) or ``h_e`` (PINNED). In
DeepSeek's notation (module ``j`` at position ``p`` takes ``(t_{p+j+1}, hidden of module j-1 at
p)``), step ``s`` is module ``s`` at ``p = e``; its key ``e + s`` is DeepSeek's position plus the
module index. That shift is the same for all of a module's rows, and RoPE attention depends only
on relative positions, so it changes nothing in the module's attention; in exchange every module
keys a row by its token.

Rows. Module 0 holds the single head's rows: the committed pairs ``(t_{i+1}, h_i)`` with the
target's hidden at a run of consecutive keys, written from the ``Pairs`` windows exactly as
``propose`` writes them (held pairs skipped, the anchor last). A module ``m >= 1`` holds only the
rows its own steps wrote and kept: like the reference engines, it never sees the committed pairs
it did not draft from (DeepSeek trains every module on every position; filling those rows would
need a forward of module ``m - 1`` over each committed key).

After a verify that accepted ``a`` drafts (``d_1 .. d_a`` and the target's token committed), the
row of step ``s`` holds token ``d_s`` (``t_{e+1}`` for s = 0): a committed token iff ``s <= a``.
``after_verify_multi`` keeps exactly those rows. With CLAMP (one row per module): modules
``0 .. a`` keep their row, modules ``a+1 .. K-1`` drop it. (The seed engine and DESIGN §6 trim
modules ``a .. K-1``: that also drops module ``a``'s row, whose token ``d_a`` is committed, and
on a full reject module 0's anchor, which no later window rebuilds; it is the off-by-one the
single head's ``after_verify`` corrects, and with N = 1 this rule is the single head's.) Two
refinements keep module 0 dense:
- N = 1: module 0 is the single head; its accepted chain rows stay, or go with ``refeed``.
- N >= 2 (CYCLE): module 0's chain rows (keys ``e + N``, ``e + 2N``, ...) would leave holes at
  the keys the other modules wrote, so module 0 keeps only its anchor and the next window
  rewrites the keys past it with the target's hidden, as ``refeed`` does for the single head.
``refeed`` has no effect on modules ``>= 1``: their rows are drafter-side by definition.

Invariant (after every ``propose_multi``, ``after_verify_multi`` and ``prefill_multi``). Let
``t`` be the committed tokens, extended by the round's drafts after a propose, ``h_i`` the
target's hidden and ``row_keys[m]`` the (ascending) keys module ``m`` holds: for module 0 a run of
consecutive keys ending at the last anchor (and, after a propose, its chain keys); for a module
``m >= 1`` with CLAMP, the key ``e_r + m`` of every round ``r`` (anchor ``e_r``) that ran module
``m`` and accepted ``a_r >= m`` (after a propose, also this round's). Then:
- module 0's row at key ``i`` is ``(t_{i+1}, h_i)`` (with N = 1 and no ``refeed``, accepted chain
  rows keep the hidden the chain fed them, as in the single head);
- a module ``m >= 1``'s row at key ``i`` is ``(t_{i+1}, g)``, ``g`` the hidden the chain handed
  over (``ProposeOutput.hidden``). With CLAMP, ``g`` is the contract's output of module
  ``m - 1``'s forward at key ``i - 1`` over its rows at keys ``<= i - 1`` (PINNED:
  ``h_{i-m}``); key ``i - 1`` is held by module ``m - 1``, and those rows never change while the
  row at ``i`` is held, so every module's rows are a from-scratch function of the committed
  tokens, the target's hidden and the key sets (``tests/test_multi_module.py`` rebuilds them with
  ``drafter_forward`` and ``kv_rows``). With CYCLE and N >= 2, module 0's chain rows give way to
  target-hidden rows after the verify, so the rows other modules built on them keep the hidden
  the chain computed then: the first form holds, the from-scratch one does not.
A propose that is never verified counts as a full reject (the next propose or prefill drops its
rows); a window that ends before the held rows (a rewind) drops every module's rows past its
anchor.

Shapes: ``[B]`` sequences, ``[N]`` modules, ``[K]`` drafts, ``[T]`` window width, ``[R]`` rows per
sequence of a module's pool (``max_rows_per_seq``), ``H`` hidden, ``V'`` draft vocab.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import chex
import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, HiddenContract, LMHeadConfig
from mtpjax.drafter.after_verify import rows_to_trim
from mtpjax.drafter.forward import DrafterOutput, pair_rows, resolve_head_cfg
from mtpjax.drafter.params import DrafterParams, check_runnable
from mtpjax.drafter.params import init as init_module
from mtpjax.drafter.prefill import DEFAULT_CHUNK, prefill
from mtpjax.drafter.propose import (
    Pairs,
    ProposeOutput,
    _check_bitmask,
    _check_state,
    _decode_row,
    _linear_impl,
    _select,
    _shift_left,
    _write_row,
    check_pairs,
    finish_drafts,
    held_prefix,
    unpack_bitmask,
)
from mtpjax.head import LMHeadParams
from mtpjax.kv import DrafterState, PoolConfig, append, free_sequences, init_state, truncate
from mtpjax.weights import Precision

__all__ = [
    "ModuleSchedule",
    "MultiDrafterParams",
    "MultiDrafterState",
    "after_verify_multi",
    "effective_num_drafts",
    "free_multi",
    "init_multi",
    "init_multi_state",
    "module_trims",
    "prefill_multi",
    "propose_multi",
]


class ModuleSchedule(enum.Enum):
    """Which module runs draft step ``s`` of a round (N modules)."""

    CLAMP = "clamp"  # module s; more drafts than modules are clamped to N (the seed engine)
    CYCLE = "cycle"  # module s mod N (vLLM's rule); num_drafts must be a multiple of N


def effective_num_drafts(num_modules: int, num_drafts: int, schedule: ModuleSchedule) -> int:
    """K, the drafts a round produces: ``min(num_drafts, N)`` for CLAMP, ``num_drafts`` (a
    multiple of N, else ValueError) for CYCLE. All static Python ints."""
    if not isinstance(num_drafts, int) or isinstance(num_drafts, bool) or num_drafts < 1:
        raise ValueError(f"num_drafts must be a static int >= 1, got {num_drafts!r}")
    if not isinstance(num_modules, int) or num_modules < 1:
        raise ValueError(f"a multi-module drafter needs at least one module, got {num_modules!r}")
    if not isinstance(schedule, ModuleSchedule):
        raise TypeError(f"schedule must be a ModuleSchedule, got {schedule!r}")
    if schedule is ModuleSchedule.CLAMP:
        return min(num_drafts, num_modules)
    if num_drafts % num_modules:
        raise ValueError(
            f"the CYCLE schedule runs module s mod N, so num_drafts must be a multiple of "
            f"N={num_modules} modules (got {num_drafts}); ask for "
            f"{num_modules * max(num_drafts // num_modules, 1)} or use ModuleSchedule.CLAMP"
        )
    return num_drafts


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["modules"], meta_fields=["schedule"]
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiDrafterParams:
    """The weights of N MTP modules and the (static) schedule that runs them.

    Attributes:
      modules: one ``DrafterParams`` per module, in step order (non-empty; a list is taken as a
        tuple). All share one ``DrafterConfig``.
      schedule: static ``ModuleSchedule`` (part of the pytree structure, so changing it
        recompiles, like a config).
    """

    modules: tuple[DrafterParams, ...]
    schedule: ModuleSchedule = ModuleSchedule.CLAMP

    def __post_init__(self) -> None:
        # Only an empty sequence is refused here: pytree prefixes (sharding specs, vmap axes)
        # build this class with other leaves; the steps check the types at their boundary.
        if isinstance(self.modules, list):
            object.__setattr__(self, "modules", tuple(self.modules))
        if isinstance(self.modules, tuple) and not self.modules:
            raise ValueError(
                "MultiDrafterParams needs at least one module (got 0); a checkpoint without MTP "
                "weights cannot make a drafter"
            )
        if not isinstance(self.schedule, ModuleSchedule):
            raise TypeError(f"schedule must be a ModuleSchedule, got {self.schedule!r}")

    @property
    def num_modules(self) -> int:
        return len(self.modules)

    @classmethod
    def from_checkpoint(
        cls, checkpoint, *, schedule: ModuleSchedule = ModuleSchedule.CLAMP
    ) -> MultiDrafterParams:
        """The modules of a loaded ``DrafterCheckpoint`` (its ``head`` is passed separately)."""
        return cls(modules=tuple(checkpoint.modules), schedule=schedule)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["modules", "row_keys", "last_num_drafted"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiDrafterState:
    """Per-module drafter states plus the bookkeeping of the multi-module round.

    Attributes:
      modules: one ``DrafterState`` per module (its own pool, allocator and block tables). Its
        ``last_pair_key`` is the key of the module's newest row and ``last_num_drafted`` the
        rows the module wrote in the last round (0 after ``after_verify_multi``).
      row_keys: per module int32[B, R]: the key of each held row, -1 from ``seq_len`` on. The
        keys of a module ``m >= 1`` are sparse, so they are recorded rather than derived.
      last_num_drafted: int32[B] K of the last round (0 after ``after_verify_multi``).
    """

    modules: tuple[DrafterState, ...]
    row_keys: tuple[jax.Array, ...]
    last_num_drafted: jax.Array

    def __post_init__(self) -> None:
        for name in ("modules", "row_keys"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.modules, tuple) and not self.modules:
            raise ValueError("MultiDrafterState needs at least one module state (got 0)")
        if (
            isinstance(self.modules, tuple)
            and isinstance(self.row_keys, tuple)
            and len(self.row_keys) != len(self.modules)
        ):
            raise ValueError(
                f"MultiDrafterState needs one row_keys array per module ({len(self.modules)}), "
                f"got {len(self.row_keys)}"
            )

    @property
    def num_modules(self) -> int:
        return len(self.modules)

    @property
    def num_seqs(self) -> int:
        return self.last_num_drafted.shape[0]

    @property
    def seq_len(self) -> jax.Array:
        """int32[N, B] rows held per module and sequence."""
        return jnp.stack([m.seq_len for m in self.modules])


# ------------------------------------------------------------------------------------------
# Construction.


def init_multi(
    cfg: DrafterConfig,
    *,
    key: jax.Array,
    precision: Precision | str = Precision.BF16,
    schedule: ModuleSchedule = ModuleSchedule.CLAMP,
) -> MultiDrafterParams:
    """Random weights for ``cfg.num_mtp_modules`` independent modules (one key split each),
    each as ``mtpjax.drafter.init`` makes them."""
    check_runnable(cfg)
    keys = jax.random.split(key, cfg.num_mtp_modules)
    # A module's weights do not depend on the module count: share the single head's program.
    module_cfg = dataclasses.replace(cfg, num_mtp_modules=1)
    return MultiDrafterParams(
        modules=tuple(init_module(module_cfg, key=k, precision=precision) for k in keys),
        schedule=schedule,
    )


def init_multi_state(
    cfg: PoolConfig | tuple[PoolConfig, ...], *, num_seqs: int, num_modules: int | None = None
) -> MultiDrafterState:
    """Empty states for ``num_seqs`` sequence slots: one pool of ``cfg`` per module, or one pool
    per entry when ``cfg`` is a tuple of ``PoolConfig`` (then ``num_modules`` may be omitted)."""
    if isinstance(cfg, PoolConfig):
        if num_modules is None:
            raise ValueError("init_multi_state needs num_modules with a single PoolConfig")
        cfgs = (cfg,) * num_modules
    else:
        cfgs = tuple(cfg)
        if num_modules is not None and num_modules != len(cfgs):
            raise ValueError(f"num_modules={num_modules} but {len(cfgs)} pool configs given")
    if not cfgs:
        raise ValueError("a multi-module drafter state needs at least one module (got 0)")
    return MultiDrafterState(
        modules=tuple(init_state(c, num_seqs=num_seqs) for c in cfgs),
        row_keys=tuple(jnp.full((num_seqs, c.max_rows_per_seq), -1, jnp.int32) for c in cfgs),
        last_num_drafted=jnp.zeros((num_seqs,), jnp.int32),
    )


# ------------------------------------------------------------------------------------------
# Checks and row-key bookkeeping.


def _check_params(params: MultiDrafterParams, cfg: DrafterConfig) -> int:
    if not isinstance(params, MultiDrafterParams):
        raise TypeError(f"params must be MultiDrafterParams, got {type(params).__name__}")
    for i, module in enumerate(params.modules):
        if not isinstance(module, DrafterParams):
            raise TypeError(f"module {i} must be DrafterParams, got {type(module).__name__}")
    if params.num_modules != cfg.num_mtp_modules:
        raise ValueError(
            f"MultiDrafterParams holds {params.num_modules} modules but cfg.num_mtp_modules="
            f"{cfg.num_mtp_modules}; pass dataclasses.replace(cfg, num_mtp_modules="
            f"{params.num_modules}) to run a subset of a checkpoint's modules"
        )
    return params.num_modules


def _check_multi_state(state: MultiDrafterState, cfg: DrafterConfig, num_modules: int) -> int:
    if not isinstance(state, MultiDrafterState):
        raise TypeError(f"state must be a MultiDrafterState, got {type(state).__name__}")
    if state.num_modules != num_modules:
        raise ValueError(
            f"the state has {state.num_modules} module states, the drafter {num_modules} modules"
        )
    B = state.num_seqs
    for module, keys in zip(state.modules, state.row_keys):
        if _check_state(module, cfg) != B:
            raise ValueError(f"every module state must hold B={B} sequences")
        chex.assert_shape(keys, (B, module.kv.max_rows_per_seq))
    return B


def _row_index(keys: jax.Array) -> jax.Array:
    return jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :]


def _record(keys: jax.Array, len_before: jax.Array, len_after: jax.Array, last_key: jax.Array):
    """Keys of the rows just appended (indices ``len_before .. len_after-1``, consecutive keys
    ending at ``last_key``); stale entries past ``len_after`` are cleared."""
    idx = _row_index(keys)
    new = (idx >= len_before[:, None]) & (idx < len_after[:, None])
    keys = jnp.where(new, last_key[:, None] - (len_after[:, None] - 1 - idx), keys)
    return jnp.where(idx < len_after[:, None], keys, -1)


def _newest_key(keys: jax.Array, length: jax.Array) -> jax.Array:
    """int32[B] key of row ``length - 1`` (-1 when empty)."""
    last = jnp.take_along_axis(keys, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(length > 0, last, -1)


def _drop_newest(
    module: DrafterState, keys: jax.Array, num_rows: jax.Array, last_num_drafted: jax.Array
) -> tuple[DrafterState, jax.Array]:
    """Drops each sequence's newest ``num_rows`` rows; the newest kept row's key becomes
    ``last_pair_key`` where anything was dropped."""
    kv = truncate(module.kv, num_rows)
    keys = jnp.where(_row_index(keys) < kv.seq_len[:, None], keys, -1)
    last = jnp.where(num_rows > 0, _newest_key(keys, kv.seq_len), module.last_pair_key)
    state = DrafterState(kv=kv, last_pair_key=last, last_num_drafted=last_num_drafted)
    return state, keys


# ------------------------------------------------------------------------------------------
# after_verify.


def module_trims(num_modules: int, rows_written, num_drafted, num_accepted, refeed):
    """Rows each module drops after a verify: int32[..., N] (pure; ints or arrays in).

    Args:
      num_modules: static N.
      rows_written: int32[..., N] rows each module wrote in the round (its steps ``s < K`` with
        ``s mod N = m``).
      num_drafted: int32[...] K of the round (0: nothing to trim).
      num_accepted: int32[...] drafts accepted (clipped to ``[0, K]``).
      refeed: bool or bool[...]; only affects module 0 when N = 1 (see the module docstring).

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
        kept = jnp.where(last_kept >= m, (last_kept - m) // N + 1, 0)
        kept = jnp.minimum(kept, R)
        if m == 0 and N == 1:
            trim = rows_to_trim(R, kept, refeed)
        elif m == 0:
            trim = R - jnp.minimum(R, 1)
        else:
            trim = R - kept
        trims.append(trim)
    return jnp.stack(trims, axis=-1).astype(jnp.int32)


def _after_verify(
    state: MultiDrafterState,
    num_accepted: jax.Array,
    *,
    refeed: bool | jax.Array = False,
    where: jax.Array | None = None,
) -> tuple[jax.Array, MultiDrafterState]:
    """The trim of ``after_verify_multi``, limited to the sequences ``where`` (default all)."""
    if not isinstance(state, MultiDrafterState):
        raise TypeError(f"state must be a MultiDrafterState, got {type(state).__name__}")
    B = state.num_seqs
    num_accepted = jnp.asarray(num_accepted, jnp.int32)
    chex.assert_shape(num_accepted, (B,))
    written = jnp.stack([m.last_num_drafted for m in state.modules], axis=-1)  # [B, N]
    trims = module_trims(
        state.num_modules, written, state.last_num_drafted, num_accepted, refeed
    )  # [B, N]
    if where is not None:
        trims = jnp.where(where[:, None], trims, 0)
    modules, row_keys = [], []
    for m, (module, keys) in enumerate(zip(state.modules, state.row_keys)):
        drafted = module.last_num_drafted
        drafted = jnp.zeros_like(drafted) if where is None else jnp.where(where, 0, drafted)
        module, keys = _drop_newest(module, keys, trims[:, m], drafted)
        modules.append(module)
        row_keys.append(keys)
    last = state.last_num_drafted
    last = jnp.zeros_like(last) if where is None else jnp.where(where, 0, last)
    new_state = MultiDrafterState(
        modules=tuple(modules), row_keys=tuple(row_keys), last_num_drafted=last
    )
    return trims, new_state


@functools.partial(jax.jit, donate_argnames=("state",))
def after_verify_multi(
    state: MultiDrafterState, num_accepted: jax.Array, *, refeed: bool | jax.Array = False
) -> tuple[jax.Array, MultiDrafterState]:
    """Trims the rows of the last round whose token the verify did not commit.

    Args:
      state: the state after ``propose_multi``; donated.
      num_accepted: int32[B] drafts accepted (clipped to ``[0, K]``).
      refeed: bool or bool[B] (traced); drops module 0's accepted chain rows too when N = 1
        (the single head's ``refeed``); no effect on other rows (see the module docstring).

    Returns:
      (rows trimmed int32[B, N], new state) with every module's ``last_num_drafted`` and the
      round's K reset to 0 (a second call trims nothing). Sequences that did not draft are
      untouched.
    """
    return _after_verify(state, num_accepted, refeed=refeed)


@functools.partial(jax.jit, donate_argnames=("state",))
def free_multi(state: MultiDrafterState, mask: jax.Array) -> MultiDrafterState:
    """Returns every module's blocks of the sequences where ``mask`` bool[B] to their allocators
    and resets those sequences (no rows, ``last_pair_key = -1``, no pending round). ``state`` is
    donated."""
    if not isinstance(state, MultiDrafterState):
        raise TypeError(f"state must be a MultiDrafterState, got {type(state).__name__}")
    mask = jnp.asarray(mask, bool)
    chex.assert_shape(mask, (state.num_seqs,))
    return MultiDrafterState(
        modules=tuple(free_sequences(m, mask) for m in state.modules),
        row_keys=tuple(jnp.where(mask[:, None], -1, k) for k in state.row_keys),
        last_num_drafted=jnp.where(mask, 0, state.last_num_drafted),
    )


# ------------------------------------------------------------------------------------------
# prefill and propose.


def _settle(
    state: MultiDrafterState, active: jax.Array, anchor_key: jax.Array | None
) -> MultiDrafterState:
    """Before writing a window: the unverified round of the active sequences counts as a full
    reject and, when ``anchor_key`` is given, every module ``m >= 1`` drops its rows past it (a
    rewind; module 0's are dropped by ``held_prefix``)."""
    B = state.num_seqs
    _, state = _after_verify(state, jnp.zeros((B,), jnp.int32), where=active)
    if anchor_key is None:
        return state
    modules, row_keys = [state.modules[0]], [state.row_keys[0]]
    for module, keys in zip(state.modules[1:], state.row_keys[1:]):
        held = _row_index(keys) < module.seq_len[:, None]
        stale = jnp.sum(held & (keys > anchor_key[:, None]), axis=1, dtype=jnp.int32)
        module, keys = _drop_newest(
            module, keys, jnp.where(active, stale, 0), module.last_num_drafted
        )
        modules.append(module)
        row_keys.append(keys)
    return dataclasses.replace(state, modules=tuple(modules), row_keys=tuple(row_keys))


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "chunk_size", "head_cfg", "implementation"),
    donate_argnames=("state",),
)
def prefill_multi(
    params: MultiDrafterParams,
    head: LMHeadParams,
    state: MultiDrafterState,
    pairs: Pairs,
    *,
    cfg: DrafterConfig,
    chunk_size: int = DEFAULT_CHUNK,
    head_cfg: LMHeadConfig | None = None,
    implementation="auto",
) -> MultiDrafterState:
    """Writes a prompt's pairs into module 0 (``mtpjax.drafter.prefill``, attention-free).

    Modules ``>= 1`` hold only rows their own draft steps write, so the prompt adds none; an
    unverified round of the active sequences is dropped first, as in ``propose_multi``.
    Arguments as ``prefill``; ``state`` is donated.
    """
    check_runnable(cfg)
    N = _check_params(params, cfg)
    B = _check_multi_state(state, cfg, N)
    active = check_pairs(pairs, B, cfg)
    state = _settle(state, active, None)
    first = state.modules[0]
    module = prefill.__wrapped__(
        params.modules[0],
        head,
        first,
        pairs,
        cfg=cfg,
        chunk_size=chunk_size,
        head_cfg=head_cfg,
        implementation=implementation,
    )
    keys = _record(state.row_keys[0], first.seq_len, module.seq_len, module.last_pair_key)
    return dataclasses.replace(
        state,
        modules=(module, *state.modules[1:]),
        row_keys=(keys, *state.row_keys[1:]),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "cfg",
        "num_drafts",
        "hidden_contract",
        "head_cfg",
        "return_logits",
        "implementation",
    ),
    donate_argnames=("state",),
)
def propose_multi(
    params: MultiDrafterParams,
    head: LMHeadParams,
    state: MultiDrafterState,
    inputs: Pairs,
    *,
    cfg: DrafterConfig,
    num_drafts: int,
    hidden_contract: HiddenContract = HiddenContract.POST_NORM,
    bitmask: jax.Array | None = None,
    confidence_threshold: float | jax.Array | None = None,
    head_cfg: LMHeadConfig | None = None,
    return_logits: bool = False,
    implementation="auto",
) -> tuple[ProposeOutput, MultiDrafterState]:
    """``propose`` for N modules: module 0 writes the window, then the modules chain K drafts.

    Args:
      params: ``MultiDrafterParams`` (its ``schedule`` picks the module of each step);
        ``len(params.modules)`` must equal ``cfg.num_mtp_modules``.
      head: the target's embedding / LM head, shared by every module.
      state: ``MultiDrafterState``; donated.
      inputs: ``Pairs`` windows, as for ``propose`` (module 0 writes the pairs past its
        ``last_pair_key``; the last pair is the anchor).
      cfg: static config shared by the modules. num_drafts: static; K = ``effective_num_drafts``
        (CLAMP: ``min(num_drafts, N)``; CYCLE: a multiple of N, else ValueError).
      hidden_contract, confidence_threshold, head_cfg, return_logits, implementation: as for
        ``propose``.
      bitmask: packed int32[B, W] or per draft [B, K, W] (``[B, num_drafts, W]`` is accepted
        and cut to the first K).

    Returns:
      ``ProposeOutput`` with ``[B, K]`` drafts (same meaning as ``propose``'s; ``hidden[:, s]``
      is what step s handed to the row of step s + 1), and the new state: the modules that ran
      have ``last_num_drafted`` = rows they wrote and ``last_pair_key`` = their newest key; the
      round's K is recorded for ``after_verify_multi``. Inactive sequences are untouched.
    """
    check_runnable(cfg)
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    N = _check_params(params, cfg)
    cycle = params.schedule is ModuleSchedule.CYCLE
    K = effective_num_drafts(N, num_drafts, params.schedule)
    if not isinstance(hidden_contract, HiddenContract):
        raise TypeError(f"hidden_contract must be a HiddenContract, got {hidden_contract!r}")
    B = _check_multi_state(state, cfg, N)
    active = check_pairs(inputs, B, cfg)
    if bitmask is not None:
        bitmask = jnp.asarray(bitmask)
        if bitmask.ndim == 3 and bitmask.shape[1] == num_drafts:
            bitmask = bitmask[:, :K]  # a per-draft mask for the request before clamping
        _check_bitmask(bitmask, B, K, head_cfg)
    kw = dict(cfg=cfg, head_cfg=head_cfg, implementation=implementation)
    vocab = head_cfg.draft_rows
    count = inputs.count.astype(jnp.int32)
    start = inputs.start.astype(jnp.int32)
    anchor_key = start + count - 1

    # 1. Settle the previous round, then module 0 writes the window's new pairs (as propose).
    state = _settle(state, active, anchor_key)
    first = state.modules[0]
    cache, _, skip = held_prefix(first, inputs, active, drop_stale=True)
    keys0 = jnp.where(_row_index(state.row_keys[0]) < cache.seq_len[:, None], state.row_keys[0], -1)
    T = inputs.tokens.shape[1]
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    tokens = inputs.tokens.astype(jnp.int32)
    x, a, k, v = pair_rows(
        params.modules[0],
        head,
        tokens,
        inputs.hidden,
        positions,
        cfg=cfg,
        head_cfg=head_cfg,
        implementation=_linear_impl(implementation),
    )
    num_new = jnp.where(active, count - skip, 0)
    len_before = cache.seq_len
    cache, _ = append(cache, _shift_left(k, skip), _shift_left(v, skip), num_new)
    keys0 = _record(keys0, len_before, cache.seq_len, anchor_key)

    # 2. The chain: a lax.scan over cycles, each running the modules of one cycle in step order
    # (CYCLE: all N, K // N cycles; CLAMP: the first K, one cycle), so each module's layer and
    # the LM head appear once in the program whatever K is.
    M, C = (N, K // N) if cycle else (K, 1)
    last = jnp.clip(count - 1, 0, T - 1)

    def at_last(y):
        return jnp.take_along_axis(y, last.reshape((B,) + (1,) * (y.ndim - 1)), axis=1)[:, 0]

    anchor_token = at_last(tokens)
    anchor_hidden = at_last(inputs.hidden).astype(jnp.float32)  # [B, H]
    anchor_x, anchor_a = at_last(x), at_last(a)

    def handed_over(o: DrafterOutput) -> jax.Array:
        if hidden_contract is HiddenContract.POST_NORM:
            return o.h_out
        if hidden_contract is HiddenContract.PRE_NORM:
            return o.residual
        return anchor_hidden

    def run_cycle(carry, c):
        caches, row_keys, tok, hid = carry
        caches, row_keys = list(caches), list(row_keys)
        outs = []
        for m in range(M):
            module = params.modules[m]
            s = c * M + m
            pos = anchor_key + s
            before = caches[m].seq_len
            if m == 0:
                # The anchor's row is held now (step 0 writes nothing); later cycles chain.
                chained = c > 0
                new, x_s, a_s = _write_row(
                    module, head, caches[0], tok, hid, pos, active & chained, **kw
                )
                x_s = jnp.where(chained, x_s, anchor_x)
                a_s = jnp.where(chained, a_s, anchor_a)
            else:
                new, x_s, a_s = _write_row(module, head, caches[m], tok, hid, pos, active, **kw)
            row_keys[m] = _record(row_keys[m], before, new.seq_len, pos)
            caches[m] = new
            o = _decode_row(module, head, new, x_s, a_s, pos, **kw)
            allowed = None
            if bitmask is not None:
                mask = bitmask if bitmask.ndim == 2 else jnp.take(bitmask, s, axis=1)
                allowed = unpack_bitmask(mask, vocab)
            t, p, ok, lg = _select(o.logits, allowed)
            tok, hid = t, handed_over(o)
            outs.append((t, p, ok, hid, lg if return_logits else None))
        return (tuple(caches), tuple(row_keys), tok, hid), tuple(outs)

    caches = (cache, *(mod.kv for mod in state.modules[1:M]))
    row_keys = (keys0, *state.row_keys[1:M])
    (caches, row_keys, _, _), ys = jax.lax.scan(
        run_cycle,
        (caches, row_keys, anchor_token, anchor_hidden),
        jnp.arange(C, dtype=jnp.int32),
    )

    def steps(field: int):
        """Stacks one output field of every step in step order: [B, K, ...]."""
        per_module = [ys[m][field] for m in range(M)]
        if per_module[0] is None:
            return None
        y = jnp.stack(per_module, axis=1)  # [C, M, B, ...]
        y = y.reshape((C * M, *y.shape[2:]))
        return jnp.moveaxis(y, 0, 1)

    draft_tokens, probs, oks, hidden, all_logits = (steps(f) for f in range(5))

    # 3. Validity, as in propose.
    output = finish_drafts(
        draft_tokens, probs, oks, hidden, all_logits, active, confidence_threshold
    )

    modules, new_keys = list(state.modules), list(state.row_keys)
    for m in range(M):
        rows = C  # module m runs steps m, m + M, ..., one per cycle
        newest = anchor_key + m + (rows - 1) * M
        old = state.modules[m]
        modules[m] = DrafterState(
            kv=caches[m],
            last_pair_key=jnp.where(active, newest, old.last_pair_key),
            last_num_drafted=jnp.where(active, rows, old.last_num_drafted).astype(jnp.int32),
        )
        new_keys[m] = row_keys[m]
    new_state = MultiDrafterState(
        modules=tuple(modules),
        row_keys=tuple(new_keys),
        last_num_drafted=jnp.where(active, K, state.last_num_drafted).astype(jnp.int32),
    )
    return output, new_state
