"""``propose`` and ``prefill``: write a window of committed pairs, then chain the drafter's
modules for K drafts; also the paged decode attention the chain runs.

Keys. Every module keys its rows the same way: the row at key ``i`` holds the pair
``(t_{i+1}, hidden)`` at RoPE position ``i``. A round with anchor key ``e`` (the window's last
pair ``(t_{e+1}, h_e)``, ``t_{e+1}`` the newest committed token) runs K steps; step ``s`` runs
module ``m(s)`` at key ``e + s``:

- CLAMP (``ModuleSchedule``, default for ``DrafterModules``): ``m(s) = s``, ``K = min(num_drafts,
  N)``.
- CYCLE (vLLM's ``spec_step_idx % N``): ``m(s) = s mod N``; ``num_drafts`` must be a multiple of
  N. A bare ``DrafterParams`` is N = 1 under CYCLE: the single head, which chains itself.

Step 0 is module 0's forward on the anchor row (the target's hidden) and gives ``d_1``; step
``s >= 1`` appends the row ``(d_s, g_{s-1})`` at key ``e + s`` to module ``m(s)`` and gives
``d_{s+1}``, where ``g_s`` is what the hidden contract hands over from step ``s``: its ``h_out``
(POST_NORM), its pre-norm residual (PRE_NORM) or ``h_e`` (PINNED). (DeepSeek's module ``j`` at
position ``p`` is step ``j`` at ``p = e``: its key is DeepSeek's position plus the module index,
a shift common to all of a module's rows, which RoPE attention does not see.)

Rows. Module 0 holds the committed pairs ``(t_{i+1}, h_i)`` with the target's hidden at a run of
consecutive keys, written from the windows. A module ``m >= 1`` holds only the rows its own steps
wrote and kept (like the reference engines, it never sees the committed pairs it did not draft
from): its row at key ``i`` is ``(t_{i+1}, g)``, ``g`` the hidden the chain handed over
(``ProposeOutput.hidden``). With CLAMP, ``g`` is the contract's output of module ``m - 1``'s
forward at key ``i - 1`` over its rows at keys ``<= i - 1``, so every module's rows are a
from-scratch function of the committed tokens, the target's hidden and the key sets. With CYCLE
and N >= 2, module 0's chain rows give way to target-hidden rows after the verify, so the rows
built on them keep the hidden the chain computed then. ``after_verify`` keeps exactly the rows
whose token was committed.

Windows (``Pairs``): after a prefill of the prompt ``t_0..t_{P-1}``, the anchor alone
(``tokens=[t_P]``, ``hidden=[h_{P-1}]``, ``start=P-1``); after a verify that accepted ``a``
drafts and emitted ``b``, ``tokens=[d_1..d_a, b]`` with the verify's hidden, ``start=n``,
``count=a+1``. A window is the truth about its keys:

- the round of a propose never verified counts as a full reject (its rows are dropped first);
- held rows from the first window pair whose token differs from the held row's are dropped in
  every module (they depend on it) and module 0 rewrites them from the window, so rewinding to
  an earlier point with another token leaves no stale row; pairs equal to held rows are skipped
  (a window may overlap the held rows);
- ``propose`` also drops every module's rows past the window's anchor (a rewind); ``prefill``
  keeps them when the window agrees with them.

A window is refused (nothing written, no drafts; a pending round is still closed; a sticky
``WindowError`` bit in the state that ``raise_on_state_error`` reports) when its ``count`` exceeds its width, when it starts past the
newest held key + 1 (a gap: the keys in between would be missing), or when it is the first window
of a slot after ``free`` and does not start at key 0. A fresh slot's first window may start at any
key (a drafter joining late attends to the rows it has).

Shapes: ``[B]`` sequences, ``[N]`` modules, ``[T]`` window width, ``[K]`` drafts, ``H`` hidden,
``Nq``/``D`` heads / head dim, ``V'`` draft vocab, ``W = ceil(V/32)`` bitmask words.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

import pallas_kernels
from mtpjax import device_values
from mtpjax.config import DrafterConfig, HiddenContract, LMHeadConfig
from mtpjax.drafter._forward import DrafterOutput, output_head, pair_rows, resolve_head_cfg
from mtpjax.drafter._params import (
    DrafterModules,
    DrafterParams,
    ModuleSchedule,
    as_modules,
    check_prefill_support,
    effective_num_drafts,
    kv_row_spec,
)
from mtpjax.drafter._sampling import DEFAULT_DRAFT_TOP_K, DraftProbs, sample_top_k
from mtpjax.drafter._trim import _check_state, module_trims, rows_written
from mtpjax.head import LMHeadParams
from mtpjax.indexed_scan import indexed_scan
from mtpjax.kv import PagedKVCache, WindowError, append, donation
from mtpjax.kv.state import DrafterState, drop_newest, newest_key, put_rows
from mtpjax.layers import mla
from mtpjax.layers.attention import output_projection, project_q
from mtpjax.layers.decoder import ffn_residual
from mtpjax.layers.mla import MlaParams
from pallas_kernels.implementation import Implementation

DEFAULT_CHUNK = 256


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "hidden", "count", "start", "active"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class Pairs:
    """A fixed-width ragged batch of committed pairs, one window per sequence.

    Attributes:
      tokens: int32[B, T]; ``tokens[b, t]`` is the token at position ``start[b] + t + 1``.
      hidden: [B, T, H] (any float dtype); the target's hidden at position ``start[b] + t``.
      count: int32[B] valid pairs per window (the rest is padding; at most T); 0 = nothing to do.
      start: int32[B] key (sequence position of ``hidden[b, 0]``) of the first pair.
      active: bool[B] or None (= ``count > 0``); an inactive sequence is left untouched.
    """

    tokens: jax.Array
    hidden: jax.Array
    count: jax.Array
    start: jax.Array
    active: jax.Array | None = None

    @property
    def last_key(self) -> jax.Array:
        """int32[B] key of each window's last pair (the anchor in ``propose``)."""
        return self.start + self.count - 1


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "tokens",
        "probs",
        "confidence",
        "num_valid",
        "hidden",
        "logits",
        "active",
        "draft_probs",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class ProposeOutput:
    """Drafts of one ``propose`` call.

    Attributes:
      tokens: int32[B, K] drafts; -1 past ``num_valid`` (cut by the confidence threshold or an
        empty grammar mask) and for inactive sequences.
      probs: f32[B, K] probability of each draft under the (masked) draft distribution: its
        top-1 probability for argmax drafts, its proposal probability ``q(d)`` for sampled ones.
      confidence: f32[B, K] running minimum of ``probs`` (the chain confidence after each draft).
      num_valid: int32[B] drafts that count (a prefix; 0 for inactive sequences).
      hidden: f32[B, K, H] what step s handed to the row of step s + 1 under the contract (the
        row at key ``e + s + 1`` holds ``(raw draft of step s, hidden[:, s])``).
      logits: f32[B, K, V'] the draft logits (masked), only when ``return_logits``; else None.
      active: bool[B] the sequences the propose ran (``verify`` emits tokens for these only);
        None on drafts built by hand, which then count as all active.
      draft_probs: ``DraftProbs`` ([B, K, k]) the proposal each sampled draft was drawn from
        (``verify`` hands it to the rejection rule); None for argmax drafts.
    """

    tokens: jax.Array
    probs: jax.Array
    confidence: jax.Array
    num_valid: jax.Array
    hidden: jax.Array
    logits: jax.Array | None = None
    active: jax.Array | None = None
    draft_probs: DraftProbs | None = None


# ------------------------------------------------------------------------------------------
# The paged decode attention and one paged row.


def paged_attention(
    q: jax.Array,
    cache: PagedKVCache,
    *,
    scale: float | None = None,
    implementation=Implementation.AUTO,
) -> jax.Array:
    """One query row per sequence over its paged context: q [B, Nq, D] -> f32[B, Nq, Dv].

    Sequence b attends to its rows ``0 .. seq_len[b]-1`` (dequantised), GQA as in ``attend``,
    through ``pallas_kernels.paged_attention`` (its reference on XLA, the Triton kernel where it
    reads the pool; a latent pool's rows, whose value is the key row's first ``value_dim``
    dims, always take the reference). ``scale`` of q.k, default ``D**-0.5``. The drafter's only
    attention call.
    """
    chex.assert_rank(q, 3)
    pool = cache.pool
    return pallas_kernels.paged_attention(
        q,
        pool.k,
        pool.v,
        cache.block_table,
        cache.seq_len,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        k_scale=pool.k_scale,  # FP8 pools: per (row, head); None for BF16
        v_scale=pool.v_scale,
        value_dim=pool.value_dim,
        implementation=implementation,
    )


def _attend_row(attn, cache, a, positions, *, cfg, implementation) -> jax.Array:
    """The attention output f32[B, H] of rows a [B, H] at positions [B] over ``cache``."""
    kw = dict(implementation=implementation)
    if isinstance(attn, MlaParams):
        # Absorbed MLA: the query meets the latent rows as stored, never expanded.
        q = mla.absorbed_query(attn, a[:, None], positions[:, None], cfg, **kw)[:, 0]
        ctx = paged_attention(q, cache, scale=mla.softmax_scale(cfg), **kw)  # [B, Nq, L]
        return mla.absorbed_output(attn, ctx, cfg, **kw)
    q, gate = project_q(attn, a[:, None], positions[:, None], cfg, **kw)
    ctx = paged_attention(q[:, 0], cache, **kw)  # [B, Nq, D]
    return output_projection(attn, ctx, None if gate is None else gate[:, 0], **kw)


def decode_row(module, head, cache, x, a, positions, *, cfg, head_cfg, implementation):
    """The rest of a row whose K/V is already in ``cache``: x, a [B, H] at positions [B]."""
    kw = dict(implementation=implementation)
    attn = module.layer.attention
    x = x + _attend_row(attn, cache, a, positions, cfg=cfg, implementation=implementation)
    x = ffn_residual(module.layer, x, cfg=cfg, **kw)
    return output_head(module, head, x, cfg=cfg, head_cfg=head_cfg, **kw)


def _record(state, m, cache, len_before, first_key, tokens) -> DrafterState:
    """``state`` with module m's cache replaced by ``cache`` and the keys (consecutive from
    ``first_key`` int32[B]) and, for module 0, the tokens int32[B, T] of the rows just
    appended recorded."""
    n = cache.seq_len - len_before
    T = tokens.shape[1]
    keys = first_key[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    row_keys = list(state.row_keys)
    row_keys[m] = put_rows(row_keys[m], len_before, n, keys)
    kv = (*state.kv[:m], cache, *state.kv[m + 1 :])
    row_tokens = state.row_tokens if m else put_rows(state.row_tokens, len_before, n, tokens)
    return dataclasses.replace(state, kv=kv, row_keys=tuple(row_keys), row_tokens=row_tokens)


def _shift_left(x: jax.Array | None, skip: jax.Array) -> jax.Array | None:
    """x[b, t + skip[b]] along axis 1 (clamped at the end): [B, T, ...] -> [B, T, ...] (None,
    a latent pool's absent value rows, stays None)."""
    if x is None:
        return None
    T = x.shape[1]
    idx = jnp.clip(jnp.arange(T, dtype=jnp.int32)[None, :] + skip[:, None], 0, T - 1)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


# ------------------------------------------------------------------------------------------
# Windows.


def _check_shape(name: str, x, shape: tuple[int, ...]) -> None:
    # Plain tuple comparisons: these run on every call, where the host's time is the latency.
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def check_propose_inputs(state: DrafterState, pairs: Pairs, cfg: DrafterConfig, num_modules: int):
    """Static checks of the state against the drafter and of the window; returns ``pairs`` with
    its index arrays as int32 and ``active`` filled in (all True when absent: one program with or
    without it); ``count > 0`` joins it inside the jit, so the wrapper launches no device work."""
    B = _check_state(state)
    if state.num_modules != num_modules:
        raise ValueError(
            f"the state has {state.num_modules} module states, the drafter {num_modules} modules"
        )
    heads, width, value_dim = kv_row_spec(cfg)
    for m, (cache, keys) in enumerate(zip(state.kv, state.row_keys)):
        found = (*cache.pool.k.shape[-2:], cache.pool.value_dim)
        if found != (heads, width, value_dim):
            raise ValueError(
                f"module {m}'s KV pool holds rows of {found} (kv heads, head dim, value_dim); "
                f"the drafter needs {(heads, width, value_dim)} (drafter.pool_config(cfg, ...) "
                "makes its pool)"
            )
        _check_shape(f"state.row_keys[{m}]", keys, (B, cache.max_rows_per_seq))
    if not isinstance(pairs, Pairs):
        raise TypeError(f"inputs must be Pairs, got {type(pairs).__name__}")
    if len(pairs.tokens.shape) != 2:
        raise ValueError(f"Pairs.tokens must be [B, T], got shape {tuple(pairs.tokens.shape)}")
    T = pairs.tokens.shape[1]
    _check_shape("Pairs.tokens", pairs.tokens, (B, T))
    _check_shape("Pairs.hidden", pairs.hidden, (B, T, cfg.hidden_size))
    _check_shape("Pairs.count", pairs.count, (B,))
    _check_shape("Pairs.start", pairs.start, (B,))
    if not jnp.issubdtype(pairs.tokens.dtype, jnp.integer):
        raise TypeError(f"Pairs.tokens must be integer token ids, got {pairs.tokens.dtype}")
    if pairs.active is None:  # one program either way; made on the device once per B
        active = device_values.full((B,), True, "bool")
    else:
        _check_shape("Pairs.active", pairs.active, (B,))
        active = pairs.active
    return dataclasses.replace(
        pairs,
        tokens=device_values.as_int32(pairs.tokens),
        count=device_values.as_int32(pairs.count),
        start=device_values.as_int32(pairs.start),
        active=active,
    )


def _open_window(state: DrafterState, pairs: Pairs, *, drop_past_anchor: bool):
    """Before module 0 writes a window: close the unverified round (a full reject), refuse bad
    windows, drop the held rows the window contradicts (and, with ``drop_past_anchor``, those
    past its anchor). Returns (state, active bool[B], skip int32[B]: leading pairs held).

    Module 0's keys are consecutive once the unverified round is gone (its chain rows are the
    only ones that leave holes), so its newest key and its rows past a key are arithmetic on
    the length; only modules >= 1 look at their row keys. The two drops are one truncation."""
    T = pairs.tokens.shape[1]
    count, start = pairs.count, pairs.start
    active = (pairs.count > 0) & pairs.active.astype(bool)
    active = active & (state.window_error == 0)  # a refused sequence waits for free
    N, K = state.num_modules, state.last_num_drafted
    unverified = module_trims(N, rows_written(N, K), K, 0, False)  # [B, N]
    unverified = jnp.where(active[:, None], unverified, 0)
    lengths = [c.seq_len - unverified[:, m] for m, c in enumerate(state.kv)]
    keys0 = state.row_keys[0]
    last = newest_key(keys0, lengths[0])
    error = jnp.where(count > T, int(WindowError.COUNT_PAST_WIDTH), 0)
    error |= jnp.where((lengths[0] > 0) & (start > last + 1), int(WindowError.GAP), 0)
    error |= jnp.where(state.freed & (start != 0), int(WindowError.NOT_FROM_START), 0)
    error = jnp.where(active, error, 0)
    opened = active & (error == 0)
    # The first window pair whose token differs from module 0's held row at its key.
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    key = start[:, None] + t
    held = (t < count[:, None]) & (key >= keys0[:, :1]) & (key <= last[:, None])
    row = jnp.clip(lengths[0][:, None] - 1 - (last[:, None] - key), 0, keys0.shape[1] - 1)
    differs = held & (jnp.take_along_axis(state.row_tokens, row, axis=1) != pairs.tokens)
    cut = jnp.min(jnp.where(differs, key - 1, jnp.iinfo(jnp.int32).max), axis=1)
    if drop_past_anchor:
        cut = jnp.minimum(cut, pairs.last_key)
    past = [jnp.clip(last - cut, 0, lengths[0])]
    for m in range(1, N):
        rows = jnp.arange(keys0.shape[1])[None, :] < lengths[m][:, None]
        past.append(jnp.sum(rows & (state.row_keys[m] > cut[:, None]), axis=1, dtype=jnp.int32))
    state = drop_newest(state, unverified + jnp.where(opened[:, None], jnp.stack(past, -1), 0))
    state = dataclasses.replace(
        state,
        last_num_drafted=jnp.where(active, 0, K),
        window_error=state.window_error | error,
        freed=state.freed & ~opened,
    )
    drop0 = jnp.where(opened, past[0], 0)
    last = jnp.where(lengths[0] > drop0, last - drop0, -1)
    return state, opened, jnp.clip(last - start + 1, 0, count)


# ------------------------------------------------------------------------------------------
# Draft selection: grammar mask, argmax, top-1 probability, validity.


def unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:
    """Packed int32[..., W] (bit j%32 of word j//32 = token j allowed) -> bool[..., vocab]."""
    j = jnp.arange(vocab, dtype=jnp.int32)
    words = jnp.take(bitmask.astype(jnp.int32), j // 32, axis=-1)
    return (jnp.right_shift(words, j % 32) & 1).astype(bool)


def _select(logits: jax.Array, allowed: jax.Array | None):
    """Masked argmax of logits [B, V']: (token int32[B], top-1 prob f32[B], any allowed bool[B],
    masked logits)."""
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    peak = jnp.max(logits, axis=-1)
    ok = jnp.isfinite(peak)
    # The argmax's softmax probability is 1 / sum(exp(l - max)).
    denom = jnp.sum(jnp.exp(logits - jnp.where(ok, peak, 0.0)[:, None]), axis=-1)
    prob = jnp.where(ok, 1.0 / jnp.where(ok, denom, 1.0), 0.0)
    return token, prob, ok, logits


def _check_bitmask(bitmask: jax.Array, B: int, K: int, head_cfg: LMHeadConfig) -> None:
    if not jnp.issubdtype(bitmask.dtype, jnp.integer):
        raise TypeError(f"bitmask must be packed int32 words, got {bitmask.dtype}")
    v_draft, v_full = head_cfg.draft_rows, head_cfg.vocab_size
    lo, hi = -(-v_draft // 32), -(-v_full // 32)
    words = bitmask.shape[-1]
    if bitmask.ndim not in (2, 3) or bitmask.shape[0] != B or not lo <= words <= hi:
        raise ValueError(
            f"bitmask must be int32[B, W] or int32[B, K, W] with B={B}, K={K} and "
            f"ceil(V'/32)={lo} <= W <= ceil(V/32)={hi}; got shape {tuple(bitmask.shape)}"
        )
    if bitmask.ndim == 3 and bitmask.shape[1] != K:
        raise ValueError(
            f"a per-draft bitmask must have K={K} masks per sequence, got {bitmask.shape[1]}"
        )


def _finish(tokens, probs, oks, hidden, logits, active, threshold) -> ProposeOutput:
    """The chain's raw per-step outputs [B, K, ...] -> a ``ProposeOutput``: a chain is cut at the
    first empty grammar mask and after the first draft whose running confidence falls below
    ``threshold`` f32[B] (or None); inactive sequences get no valid draft."""
    K = probs.shape[1]
    confidence = jax.lax.cummin(probs, axis=1)
    num_valid = jnp.sum(jnp.cumprod(oks.astype(jnp.int32), axis=1), axis=1)
    if threshold is not None:
        confident = jnp.sum(confidence >= threshold[:, None], axis=1)  # confidence never rises
        num_valid = jnp.minimum(num_valid, jnp.minimum(confident + 1, K))
    num_valid = jnp.where(active, num_valid, 0).astype(jnp.int32)
    valid = jnp.arange(K, dtype=jnp.int32)[None, :] < num_valid[:, None]
    zero = jnp.zeros_like(probs)
    return ProposeOutput(
        tokens=jnp.where(valid, tokens, -1),
        probs=jnp.where(active[:, None], probs, zero),
        confidence=jnp.where(active[:, None], confidence, zero),
        num_valid=num_valid,
        hidden=jnp.where(active[:, None, None], hidden, 0.0),
        logits=logits,
        active=active,
    )


# ------------------------------------------------------------------------------------------
# propose.


def write_window(module, head, state, pairs, **kw):
    """Module 0's rows of the window's pairs the state does not hold yet (the pairs it holds
    from an earlier window are skipped; past-anchor rows are dropped first).

    Returns (state, active bool[B], and every pair's fused input and attention input ``x``,
    ``a`` [B, T, H], for the chain's first step to read at the anchor).
    """
    T = pairs.tokens.shape[1]
    state, active, skip = _open_window(state, pairs, drop_past_anchor=True)
    positions = pairs.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x, a, k, v = pair_rows(module, head, pairs.tokens, pairs.hidden, positions, **kw)
    before = state.kv[0].seq_len
    cache, _ = append(
        state.kv[0],
        _shift_left(k, skip),
        _shift_left(v, skip),
        jnp.where(active, pairs.count - skip, 0),
    )
    state = _record(state, 0, cache, before, pairs.start + skip, _shift_left(pairs.tokens, skip))
    return state, active, x, a


@donation.step(
    static_argnames=(
        "cfg",
        "num_drafts",
        "hidden_contract",
        "head_cfg",
        "return_logits",
        "implementation",
        "draft_top_k",
    )
)
def _propose(
    modules: DrafterModules,
    head: LMHeadParams,
    state: DrafterState,
    pairs: Pairs,
    bitmask: jax.Array | None,
    threshold: jax.Array | None,
    temperature: jax.Array | None = None,
    key: jax.Array | None = None,
    *,
    cfg: DrafterConfig,
    num_drafts: int,
    hidden_contract: HiddenContract,
    head_cfg: LMHeadConfig,
    return_logits: bool,
    implementation: Implementation,
    draft_top_k: int = DEFAULT_DRAFT_TOP_K,
) -> tuple[ProposeOutput, DrafterState]:
    B, T = pairs.tokens.shape
    N, K = modules.num_modules, num_drafts
    # The projections' linear takes the implementation by name.
    kw = dict(cfg=cfg, head_cfg=head_cfg, implementation=implementation.value)
    first = modules.modules[0]

    # 1. Module 0 writes the window's pairs it does not hold.
    state, active, x, a = write_window(first, head, state, pairs, **kw)

    # 2. The chain, cycle by cycle, each running the modules of one cycle in step order (CYCLE:
    # all N, K // N cycles; CLAMP: the first K, one cycle). The first cycle runs outside any
    # loop: its module-0 step is the anchor, whose row is held now, so it writes nothing and
    # takes the layer input its row was computed from. The other cycles are one lax.scan, so
    # each module's layer and the LM head appear at most twice in the program whatever K is.
    M, C = (N, K // N) if modules.schedule is ModuleSchedule.CYCLE else (K, 1)
    last = jnp.clip(pairs.count - 1, 0, T - 1)

    def at_last(y):
        return jnp.take_along_axis(y, last.reshape((B,) + (1,) * (y.ndim - 1)), axis=1)[:, 0]

    anchor_key = pairs.last_key
    anchor_hidden = at_last(pairs.hidden).astype(jnp.float32)  # [B, H]
    handed_over = {
        HiddenContract.POST_NORM: lambda o: o.h_out,
        HiddenContract.PRE_NORM: lambda o: o.residual,
        HiddenContract.PINNED: lambda o: anchor_hidden,
    }[hidden_contract]

    def run_cycle(carry, c, *, first: bool):
        state, tok, hid = carry
        outs = []
        for m in range(M):
            module, s = modules.modules[m], c * M + m
            pos = anchor_key + s
            if first and m == 0:
                x_s, a_s = at_last(x), at_last(a)
            else:
                xs, as_, ks, vs = pair_rows(
                    module, head, tok[:, None], hid[:, None], pos[:, None], **kw
                )
                before = state.kv[m].seq_len
                cache, _ = append(state.kv[m], ks, vs, active.astype(jnp.int32))
                state = _record(state, m, cache, before, pos, tok[:, None])
                x_s, a_s = xs[:, 0], as_[:, 0]
            o: DrafterOutput = decode_row(module, head, state.kv[m], x_s, a_s, pos, **kw)
            allowed = None
            if bitmask is not None:
                mask = bitmask if bitmask.ndim == 2 else jnp.take(bitmask, s, axis=1)
                allowed = unpack_bitmask(mask, head_cfg.draft_rows)
            tok, p, ok, lg = _select(o.logits, allowed)
            ids = qs = None
            if key is not None:  # sampled drafts (the argmax where the temperature is 0)
                drawn, ids, qs = sample_top_k(
                    lg, temperature, jax.random.fold_in(key, s), top_k=draft_top_k
                )
                sampling = temperature > 0
                tok = jnp.where(sampling, drawn, tok)
                p = jnp.where(sampling, DraftProbs(ids=ids, probs=qs).at(drawn), p)
                # At temperature 0 the proposal is the argmax itself (one-hot).
                qs = jnp.where(sampling, qs, (ids == tok[:, None]).astype(qs.dtype))
            hid = handed_over(o)
            outs.append((tok, p, ok, hid, lg if return_logits else None, ids, qs))
        return (state, tok, hid), tuple(outs)

    carry, ys = run_cycle((state, at_last(pairs.tokens), anchor_hidden), 0, first=True)
    ys = jax.tree.map(lambda y: y[None], ys)  # [1, B, ...] per step of the cycle
    if C > 1:
        later = functools.partial(run_cycle, first=False)
        carry, rest = indexed_scan(later, carry, C - 1, start=1)
        ys = jax.tree.map(lambda y, r: jnp.concatenate([y, r]), ys, rest)
    state = carry[0]

    def steps(field: int):
        """One output field of every step in step order: [B, K, ...]."""
        if ys[0][field] is None:
            return None
        y = jnp.stack([ys[m][field] for m in range(M)], axis=1)  # [C, M, B, ...]
        return jnp.moveaxis(y.reshape((C * M, *y.shape[2:])), 0, 1)

    output = _finish(*(steps(f) for f in range(5)), active, threshold)
    if key is not None:
        output = dataclasses.replace(output, draft_probs=DraftProbs(ids=steps(5), probs=steps(6)))
    state = dataclasses.replace(
        state, last_num_drafted=jnp.where(active, K, state.last_num_drafted).astype(jnp.int32)
    )
    return output, state


def propose(
    params: DrafterParams | DrafterModules,
    head: LMHeadParams,
    state: DrafterState,
    pairs: Pairs,
    *,
    cfg: DrafterConfig,
    num_drafts: int,
    hidden_contract: HiddenContract | None = None,
    bitmask: jax.Array | None = None,
    confidence_threshold: float | jax.Array | None = None,
    head_cfg: LMHeadConfig | None = None,
    return_logits: bool = False,
    implementation: Implementation | str = Implementation.AUTO,
    temperature: float | jax.Array = 0.0,
    key: jax.Array | None = None,
    draft_top_k: int = DEFAULT_DRAFT_TOP_K,
) -> tuple[ProposeOutput, DrafterState]:
    """Writes the window's new pairs and drafts K tokens per sequence (see the module docstring).

    Args:
      params: one module (``DrafterParams``, the single head) or ``DrafterModules``.
      head: the target's embedding / LM head, shared by every module.
      state: the drafter state; donated (its KV buffers are updated in place).
      pairs: ``Pairs`` windows; the last pair of each is the anchor.
      cfg: static drafter config. num_drafts: static int >= 1; K = ``effective_num_drafts``
        (the single head: num_drafts; CLAMP: ``min(num_drafts, N)``; CYCLE: a multiple of N).
      hidden_contract: static; what steps 1.. consume (POST_NORM: h_out; PRE_NORM: the pre-norm
        residual; PINNED: the anchor's target hidden); None: ``cfg.default_hidden_contract``.
      bitmask: optional grammar mask, packed int32[B, W] (every draft) or [B, K, W] (per draft;
        ``[B, num_drafts, W]`` is cut to the first K); bit ``j % 32`` of word ``j // 32``
        allows token j. Applied before the argmax or the draw.
      confidence_threshold: optional scalar or f32[B]; drafts after the first one whose running
        confidence falls below it are invalid (token -1, excluded from ``num_valid``).
      head_cfg: static LM head config (default ``cfg.lm_head_config()``); with a reduced draft
        vocab only its first V' rows are scored, so drafts are < V'.
      return_logits: static; also return the masked draft logits [B, K, V'].
      implementation: ``Implementation`` or its name, for the projections and the attention.
      temperature: a real scalar, traced as in ``generate`` (``accept.check_temperature``);
        with ``key`` and > 0 each draft is sampled from the drafter's top ``draft_top_k``
        tokens at this temperature, renormalised (``mtpjax.drafter._sampling`` says why that
        proposal keeps rejection sampling exact), and returned in ``draft_probs``; verify at the
        same temperature. 0 (or no key) drafts by argmax, the program of a call without it.
      key: PRNG key of the draws (one for the batch); None: argmax drafts.
      draft_top_k: static int >= 1, the proposal's support per draft (clamped to V').

    Returns:
      ``ProposeOutput`` ([B, K]) and the new state: ``last_num_drafted = K`` for the active
      sequences (rows written by the chain, invalid drafts included); inactive sequences and
      refused windows are untouched but for the refusal's ``WindowError`` bit.
    """
    modules = as_modules(params, cfg)
    K = effective_num_drafts(modules.num_modules, num_drafts, modules.schedule)
    # Imported here: mtpjax.verify imports this package.
    from mtpjax.verify.accept import check_temperature

    temperature, key = check_temperature(temperature, key)
    if isinstance(draft_top_k, bool) or not isinstance(draft_top_k, int) or draft_top_k < 1:
        raise ValueError(f"draft_top_k must be a Python int >= 1, got {draft_top_k!r}")
    if hidden_contract is None:
        hidden_contract = cfg.default_hidden_contract
    if not isinstance(hidden_contract, HiddenContract):
        raise TypeError(f"hidden_contract must be a HiddenContract, got {hidden_contract!r}")
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    pairs = check_propose_inputs(state, pairs, cfg, modules.num_modules)
    B = state.num_seqs
    if bitmask is not None:
        bitmask = jnp.asarray(bitmask)
        if bitmask.ndim == 3 and bitmask.shape[1] == num_drafts:
            bitmask = bitmask[:, :K]  # a per-draft mask for the request before clamping
        _check_bitmask(bitmask, B, K, head_cfg)
    if confidence_threshold is not None:
        threshold = jnp.asarray(confidence_threshold, jnp.float32)
        if threshold.ndim > 1 or (threshold.ndim == 1 and threshold.shape != (B,)):
            raise ValueError(
                f"confidence_threshold must be a scalar or f32[B={B}], got shape {threshold.shape}"
            )
        confidence_threshold = jnp.broadcast_to(threshold, (B,))
    return _propose(
        modules,
        head,
        state,
        pairs,
        bitmask,
        confidence_threshold,
        temperature,
        key,
        cfg=cfg,
        num_drafts=K,
        hidden_contract=hidden_contract,
        head_cfg=head_cfg,
        return_logits=bool(return_logits),
        implementation=Implementation.parse(implementation),
        # One program for argmax drafts whatever top_k says.
        draft_top_k=draft_top_k if key is not None else DEFAULT_DRAFT_TOP_K,
    )


# ------------------------------------------------------------------------------------------
# prefill.


@donation.step(static_argnames=("cfg", "chunk_size", "head_cfg", "implementation"))
def _prefill(modules, head, state, pairs, *, cfg, chunk_size, head_cfg, implementation):
    state, active, skip = _open_window(state, pairs, drop_past_anchor=False)
    num_new = jnp.where(active, pairs.count - skip, 0)
    first_key = pairs.start + skip
    T = pairs.tokens.shape[1]
    C = min(chunk_size, T)
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    tokens = jnp.pad(_shift_left(pairs.tokens, skip), ((0, 0), (0, pad)))
    hidden = jnp.pad(_shift_left(pairs.hidden, skip), ((0, 0), (0, pad), (0, 0)))
    offsets = jnp.arange(C, dtype=jnp.int32)[None, :]

    def chunk(c, state):
        lo = c * C
        tok = jax.lax.dynamic_slice_in_dim(tokens, lo, C, axis=1)
        hid = jax.lax.dynamic_slice_in_dim(hidden, lo, C, axis=1)
        positions = first_key[:, None] + lo + offsets
        _, _, k, v = pair_rows(
            modules.modules[0], head, tok, hid, positions, cfg=cfg, head_cfg=head_cfg,
            implementation=implementation.value,
        )  # fmt: skip
        before = state.kv[0].seq_len
        cache, _ = append(state.kv[0], k, v, jnp.clip(num_new - lo, 0, C))
        return _record(state, 0, cache, before, first_key + lo, tok)

    return jax.lax.fori_loop(0, num_chunks, chunk, state)


def prefill(
    params: DrafterParams | DrafterModules,
    head: LMHeadParams,
    state: DrafterState,
    pairs: Pairs,
    *,
    cfg: DrafterConfig,
    chunk_size: int = DEFAULT_CHUNK,
    head_cfg: LMHeadConfig | None = None,
    implementation: Implementation | str = Implementation.AUTO,
) -> DrafterState:
    """Writes the rows of each window's pairs into module 0 without attention.

    A row's K/V depend only on its pair (one layer), so a prompt's rows are ``norms + fc +
    input_layernorm + k/v + k_norm + RoPE`` and a cache write, in static chunks of
    ``chunk_size`` rows (one compiled chunk whatever the prompt length). Modules ``>= 1`` hold
    only rows their own draft steps write, so a prompt adds none to them. Windows are opened as
    for ``propose`` (held pairs skipped, contradicted rows dropped) but rows past the window stay.

    Args:
      params: the drafter; module 0's fc, k_proj and v_proj must be BF16 (else ValueError; other
        heads write the prompt through ``propose``, whose window takes any number of pairs).
      head: the target's embedding / LM head (only the embedding is read).
      state: donated. pairs: e.g. for a prompt ``t_0..t_{P-1}``: ``tokens = t_1..t_{P-1}``,
        ``hidden = h_0..h_{P-2}``, ``start = 0`` (the anchor then goes to ``propose``).
      cfg: static drafter config. chunk_size: static rows per chunk (clamped to T).

    Returns:
      The new state (no pending round for the active sequences; inactive ones untouched).
    """
    modules = as_modules(params, cfg)
    check_prefill_support(modules.modules[0])
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    return _prefill(
        modules,
        head,
        state,
        check_propose_inputs(state, pairs, cfg, modules.num_modules),
        cfg=cfg,
        chunk_size=chunk_size,
        head_cfg=resolve_head_cfg(cfg, head_cfg),
        implementation=Implementation.parse(implementation),
    )
