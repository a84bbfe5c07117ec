"""``propose``: write the newly committed pairs, draft ``k`` tokens by chaining the head on its
own paged KV, and return the drafts with their confidences. Also the single-row paged step
(``draft_step``) and the paged decode attention (XLA gather + ``attend``, or the Pallas kernel,
chosen by ``implementation=``).

Row layout of one sequence (keys are sequence positions; row key i holds the pair
``(token_{i+1}, hidden_i)`` at RoPE position i):

    ... committed rows (target hidden) ... | anchor e | chain rows e+1 .. e+k-1 (drafter hidden)

The *anchor* is the last committed pair, ``(t_n, h_{n-1})`` at key ``e = n-1`` where ``t_n`` is
the newest committed token. Its full forward gives draft 1 (step 0 always consumes the target's
hidden). Step j = 1..k-1 writes the chain row ``(d_j, hid_j)`` at key ``e+j`` and gives draft
j+1, where ``hid_j`` is what the hidden contract hands over from step j: ``h_out`` (POST_NORM),
the pre-norm residual (PRE_NORM) or the anchor's target hidden (PINNED). A propose therefore
leaves ``k`` rows at keys ``e .. e+k-1``: the anchor (target hidden) and ``k-1`` chain rows
(drafter-side hidden). ``after_verify`` trims them; see ``mtpjax.drafter.after_verify`` for the
invariant that makes the next propose rebuild exactly the committed rows.

Inputs are ``Pairs``: per sequence a fixed-width window of pairs with a count and the key of
the first one. ``propose`` writes only the pairs whose key is past ``last_pair_key`` (pairs
already held are skipped, so a window may overlap the held rows). It first drops the chain rows
of a previous propose that was never verified (as if all its drafts were rejected) and any held
rows past the window's last pair, so proposing again without a verify is allowed. Both
protocols fit:

- first call after the drafter prefill of a prompt ``t_0..t_{P-1}`` with first sampled token
  ``t_P``: the anchor alone, ``tokens=[t_P]``, ``hidden=[h_{P-1}]``, ``start=P-1``;
- after a verify that accepted ``a`` drafts and emitted the token ``b``: ``tokens=[d_1..d_a,
  b]``, ``hidden=`` the target's verify hidden at positions ``n..n+a``, ``start=n``,
  ``count=a+1``.

Without a prefill the first call may carry the whole prompt's pairs, or only the anchor (the
drafter then attends to the rows it has; the row keys stay the pairs' positions).

Shapes: ``[B]`` sequences, ``[T]`` window width, ``[K]`` drafts (static ``num_drafts``), ``H``
hidden, ``Nq``/``Nkv``/``D`` heads / KV heads / head dim, ``V'`` draft vocab, ``W = ceil(V/32)``
bitmask words.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, HiddenContract, LMHeadConfig
from mtpjax.drafter.forward import DrafterOutput, output_head, pair_rows, resolve_head_cfg
from mtpjax.drafter.params import DrafterParams, check_runnable
from mtpjax.head import LMHeadParams
from mtpjax.kv import DrafterState, PagedKVCache, append, gather, truncate
from mtpjax.layers.attention import attend, output_projection, project_q
from mtpjax.layers.decoder import ffn_residual
from mtpjax.weights import Implementation

__all__ = [
    "Pairs",
    "ProposeOutput",
    "StepOutput",
    "draft_step",
    "paged_attention",
    "propose",
    "unpack_bitmask",
]


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
      count: int32[B] valid pairs per window (the rest is padding); 0 = nothing to do.
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
    data_fields=["logits", "h_out", "residual"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOutput:
    """One paged row: logits f32[B, V'], h_out f32[B, H], pre-norm residual f32[B, H]."""

    logits: jax.Array
    h_out: jax.Array
    residual: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "probs", "confidence", "num_valid", "hidden", "logits"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class ProposeOutput:
    """Drafts of one ``propose`` call.

    Attributes:
      tokens: int32[B, K] drafts; -1 past ``num_valid`` (cut by the confidence threshold or an
        empty grammar mask) and for inactive sequences.
      probs: f32[B, K] top-1 probability of each draft under the (masked) draft distribution.
      confidence: f32[B, K] running minimum of ``probs`` (the chain confidence after each draft).
      num_valid: int32[B] drafts that count (a prefix; 0 for inactive sequences).
      hidden: f32[B, K, H] the hidden each step hands to the next under the contract; the chain
        row at key ``e + j`` holds the pair ``(draft j, hidden[:, j-1])`` (the raw argmax, also
        when the draft is marked invalid).
      logits: f32[B, K, V'] the draft logits (masked), only when ``return_logits``; else None.
    """

    tokens: jax.Array
    probs: jax.Array
    confidence: jax.Array
    num_valid: jax.Array
    hidden: jax.Array
    logits: jax.Array | None = None


# ------------------------------------------------------------------------------------------
# Paged attention.


def _parse_implementation(implementation) -> Implementation:
    if isinstance(implementation, Implementation):
        return implementation
    try:
        return Implementation(str(implementation).lower())
    except ValueError:
        accepted = ", ".join(i.value for i in Implementation)
        raise ValueError(
            f"unknown implementation {implementation!r}; expected one of: {accepted}"
        ) from None


def _kernel_supports(cache: PagedKVCache) -> str | None:
    """Why the Pallas paged-attention kernel cannot read this cache, or None when it can."""
    pool = cache.pool
    D, S = pool.k.shape[-1], pool.block_size
    if D < 16 or D & (D - 1) or S & (S - 1):
        return f"the kernel needs a power-of-two head_dim >= 16 and block_size (got {D}, {S})"
    return None


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def paged_attention(q: jax.Array, cache: PagedKVCache, *, implementation="auto") -> jax.Array:
    """One query row per sequence over its paged context: q [B, Nq, D] -> f32[B, Nq, D].

    Sequence b attends to its rows ``0 .. seq_len[b]-1`` (dequantised), GQA as in ``attend``.
    "xla" gathers the context through the block table and runs the ``attend`` reference;
    "pallas" runs ``pallas_kernels.paged_attention`` (interpret mode off-GPU; BF16 or FP8 pools
    with power-of-two head_dim and block_size, else NotImplementedError); "auto" takes the kernel on
    a GPU when it supports the cache, else XLA.
    """
    impl = _parse_implementation(implementation)
    chex.assert_rank(q, 3)
    unsupported = _kernel_supports(cache)
    if impl is Implementation.PALLAS and unsupported is not None:
        raise NotImplementedError(f"no Pallas paged attention for this cache: {unsupported}")
    use_kernel = impl is Implementation.PALLAS or (
        impl is Implementation.AUTO and _on_gpu() and unsupported is None
    )
    if use_kernel:
        from pallas_kernels._paged_attention.triton import paged_attention as kernel

        return kernel(
            q,
            cache.pool.k,
            cache.pool.v,
            jnp.maximum(cache.block_table, 0),  # unheld slots lie past seq_len: never read
            cache.seq_len,
            scale=q.shape[-1] ** -0.5,
            k_scale=cache.pool.k_scale,  # FP8 pools: per (row, head); None for BF16
            v_scale=cache.pool.v_scale,
            interpret=not _on_gpu(),
        )
    k, v, valid = gather(cache, cache.max_rows_per_seq)  # [B, L, Nkv, D], [B, L]
    return attend(q[:, None], k, v, valid[:, None, :])[:, 0]


def _linear_impl(implementation) -> str:
    # Projections take the same choice; "pallas" there means the registered linear kernels.
    return _parse_implementation(implementation).value


def _decode_row(
    params: DrafterParams,
    head: LMHeadParams,
    cache: PagedKVCache,
    x: jax.Array,
    a: jax.Array,
    positions: jax.Array,
    *,
    cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
    implementation,
) -> DrafterOutput:
    """The rest of a row whose K/V is already in ``cache``: x, a [B, H] at positions [B]."""
    impl = _linear_impl(implementation)
    attn = params.layer.attention
    q, gate = project_q(attn, a[:, None], positions[:, None], cfg, implementation=impl)
    ctx = paged_attention(q[:, 0], cache, implementation=implementation)  # [B, Nq, D]
    x = x + output_projection(attn, ctx, None if gate is None else gate[:, 0], implementation=impl)
    x = ffn_residual(params.layer, x, cfg=cfg, implementation=impl)
    return output_head(params, head, x, cfg=cfg, head_cfg=head_cfg, implementation=impl)


def _write_row(
    params, head, cache, tokens, hidden, positions, write, *, cfg, head_cfg, implementation
):
    """Computes the rows of pairs tokens [B], hidden [B, H] at positions [B] and appends them
    where ``write``. Returns (cache, x [B, H], a [B, H])."""
    x, a, k, v = pair_rows(
        params,
        head,
        tokens[:, None],
        hidden[:, None],
        positions[:, None],
        cfg=cfg,
        head_cfg=head_cfg,
        implementation=_linear_impl(implementation),
    )
    cache, _ = append(cache, k, v, write.astype(jnp.int32))
    return cache, x[:, 0], a[:, 0]


# ------------------------------------------------------------------------------------------
# The single-row step.


def _check_state(state: DrafterState, cfg: DrafterConfig) -> int:
    if not isinstance(state, DrafterState):
        raise TypeError(f"state must be a DrafterState, got {type(state).__name__}")
    pool = state.kv.pool
    if pool.k.shape[-2:] != (cfg.num_key_value_heads, cfg.head_dim):
        raise ValueError(
            f"the KV pool holds rows of {tuple(pool.k.shape[-2:])} (kv heads, head dim); the "
            f"drafter needs ({cfg.num_key_value_heads}, {cfg.head_dim})"
        )
    return state.num_seqs


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "head_cfg", "implementation"),
    donate_argnames=("state",),
)
def draft_step(
    params: DrafterParams,
    head: LMHeadParams,
    state: DrafterState,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    *,
    cfg: DrafterConfig,
    active: jax.Array | None = None,
    head_cfg: LMHeadConfig | None = None,
    implementation="auto",
) -> tuple[StepOutput, DrafterState]:
    """One paged row per sequence: write the pair's K/V, attend over the paged context.

    Args:
      tokens: int32[B] the pair's token; hidden: [B, H] the pair's hidden; positions: int32[B]
        the pair key (RoPE position). The row is appended after the sequence's rows.
      active: bool[B] (default all); inactive sequences write nothing and keep their state
        (their outputs are computed but meaningless).

    Returns:
      ``StepOutput(logits [B, V'], h_out [B, H], residual [B, H])`` and the new state, with
      ``last_pair_key = positions`` for the active sequences (``last_num_drafted`` unchanged).
      ``state`` is donated: its buffers are reused for the new state.
    """
    check_runnable(cfg)
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    B = _check_state(state, cfg)
    chex.assert_shape(tokens, (B,))
    chex.assert_shape(hidden, (B, cfg.hidden_size))
    chex.assert_shape(positions, (B,))
    active = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
    chex.assert_shape(active, (B,))
    positions = jnp.asarray(positions, jnp.int32)
    kw = dict(cfg=cfg, head_cfg=head_cfg, implementation=implementation)
    cache, x, a = _write_row(
        params, head, state.kv, jnp.asarray(tokens, jnp.int32), hidden, positions, active, **kw
    )
    out = _decode_row(params, head, cache, x, a, positions, **kw)
    new_state = DrafterState(
        kv=cache,
        last_pair_key=jnp.where(active, positions, state.last_pair_key),
        last_num_drafted=state.last_num_drafted,
    )
    return StepOutput(logits=out.logits, h_out=out.h_out, residual=out.residual), new_state


# ------------------------------------------------------------------------------------------
# Draft selection: grammar mask, argmax, top-1 probability.


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


# ------------------------------------------------------------------------------------------
# propose.


def _shift_left(x: jax.Array, skip: jax.Array) -> jax.Array:
    """x[b, t + skip[b]] along axis 1 (clamped at the end): [B, T, ...] -> [B, T, ...]."""
    T = x.shape[1]
    idx = jnp.clip(jnp.arange(T, dtype=jnp.int32)[None, :] + skip[:, None], 0, T - 1)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def check_pairs(pairs: Pairs, B: int, cfg: DrafterConfig) -> jax.Array:
    """Validates a window batch; returns the effective active mask bool[B] (``count > 0``)."""
    if not isinstance(pairs, Pairs):
        raise TypeError(f"inputs must be Pairs, got {type(pairs).__name__}")
    chex.assert_rank(pairs.tokens, 2)
    T = pairs.tokens.shape[1]
    chex.assert_shape(pairs.tokens, (B, T))
    chex.assert_shape(pairs.hidden, (B, T, cfg.hidden_size))
    chex.assert_shape(pairs.count, (B,))
    chex.assert_shape(pairs.start, (B,))
    if not jnp.issubdtype(pairs.tokens.dtype, jnp.integer):
        raise TypeError(f"Pairs.tokens must be integer token ids, got {pairs.tokens.dtype}")
    active = pairs.count > 0
    if pairs.active is not None:
        chex.assert_shape(pairs.active, (B,))
        active = active & pairs.active.astype(bool)
    return active


def held_prefix(
    state: DrafterState, pairs: Pairs, active: jax.Array, *, drop_stale: bool
) -> tuple[PagedKVCache, jax.Array, jax.Array]:
    """Which leading pairs of each window the state already holds.

    First, the chain rows of a propose that was never verified (``last_num_drafted > 0``: no
    ``after_verify`` since) are dropped, as if every draft was rejected; with ``drop_stale``, so
    are held rows past the window's last key. Returns (cache, last_pair_key, skip int32[B]):
    pairs ``t < skip[b]`` have keys at or below ``last_pair_key`` and are not rewritten.
    """
    cache, last = state.kv, state.last_pair_key
    count, start = pairs.count.astype(jnp.int32), pairs.start.astype(jnp.int32)
    unverified = jnp.where(active, jnp.maximum(state.last_num_drafted - 1, 0), 0)
    cache = truncate(cache, unverified)
    last = last - unverified
    if drop_stale:
        end = start + count - 1
        stale = jnp.where(active, jnp.maximum(last - end, 0), 0)
        cache = truncate(cache, stale)
        last = last - stale
    skip = jnp.clip(last - start + 1, 0, count)
    return cache, last, skip


def finish_drafts(
    draft_tokens: jax.Array,
    probs: jax.Array,
    oks: jax.Array,
    hidden: jax.Array,
    logits: jax.Array | None,
    active: jax.Array,
    confidence_threshold: float | jax.Array | None,
) -> ProposeOutput:
    """The chain's raw per-step outputs -> a `ProposeOutput` with the valid prefix marked.

    A chain is cut at the first empty grammar mask (`oks` False) and after the first draft whose
    running confidence falls below the threshold; inactive sequences get no valid draft.
    draft_tokens, probs: [B, K]; oks: bool[B, K]; hidden: [B, K, H]; active: bool[B].
    """
    B, K = probs.shape
    confidence = jax.lax.cummin(probs, axis=1)
    num_valid = jnp.sum(jnp.cumprod(oks.astype(jnp.int32), axis=1), axis=1)
    if confidence_threshold is not None:
        thr = jnp.asarray(confidence_threshold, jnp.float32)
        if thr.ndim > 1 or (thr.ndim == 1 and thr.shape != (B,)):
            raise ValueError(
                f"confidence_threshold must be a scalar or f32[B={B}], got shape {thr.shape}"
            )
        if thr.ndim == 1:
            thr = thr[:, None]
        confident = jnp.sum(confidence >= thr, axis=1)  # a prefix: confidence never rises
        num_valid = jnp.minimum(num_valid, jnp.minimum(confident + 1, K))
    num_valid = jnp.where(active, num_valid, 0).astype(jnp.int32)
    valid = jnp.arange(K, dtype=jnp.int32)[None, :] < num_valid[:, None]
    zero = jnp.zeros_like(probs)
    return ProposeOutput(
        tokens=jnp.where(valid, draft_tokens, -1),
        probs=jnp.where(active[:, None], probs, zero),
        confidence=jnp.where(active[:, None], confidence, zero),
        num_valid=num_valid,
        hidden=jnp.where(active[:, None, None], hidden, 0.0),
        logits=logits,
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
def propose(
    params: DrafterParams,
    head: LMHeadParams,
    state: DrafterState,
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
) -> tuple[ProposeOutput, DrafterState]:
    """Writes the newly committed pairs and drafts ``num_drafts`` tokens per sequence.

    Args:
      params, head: the MTP head and the target's embedding / LM head.
      state: the drafter state; donated (its KV buffers are updated in place).
      inputs: ``Pairs`` windows; the last pair of each is the anchor (see the module docstring).
        Pairs with keys past ``last_pair_key`` are written with the target's hidden.
      cfg: static drafter config. num_drafts: static K >= 1.
      hidden_contract: static; what steps 1.. consume (POST_NORM: h_out; PRE_NORM: the pre-norm
        residual; PINNED: the anchor's target hidden).
      bitmask: optional grammar mask, packed int32[B, W] (every draft) or [B, K, W] (per
        draft); bit ``j % 32`` of word ``j // 32`` allows token j. Applied before the argmax.
      confidence_threshold: optional scalar or f32[B]; drafts after the first one whose running
        confidence falls below it are invalid (token -1, excluded from ``num_valid``).
      head_cfg: static LM head config (default ``cfg.lm_head_config()``); with a reduced draft
        vocab only its first V' rows are scored, so drafts are < V'.
      return_logits: static; also return the masked draft logits [B, K, V'].
      implementation: "auto" | "xla" | "pallas" for the projections and the paged attention.

    Returns:
      ``ProposeOutput`` and the new state: for active sequences ``last_pair_key = e + K - 1``
      (e = anchor key) and ``last_num_drafted = K`` (rows written by the chain, invalid drafts
      included); inactive sequences are untouched.

    A `MultiDrafterParams` / `MultiDrafterState` pair (several MTP modules) is served by
    `multi_module.propose_multi` behind this same entry point.
    """
    if not isinstance(params, DrafterParams):
        from mtpjax.drafter import multi_module  # it builds on this module

        return multi_module.propose_multi.__wrapped__(
            params,
            head,
            state,
            inputs,
            cfg=cfg,
            num_drafts=num_drafts,
            hidden_contract=hidden_contract,
            bitmask=bitmask,
            confidence_threshold=confidence_threshold,
            head_cfg=head_cfg,
            return_logits=return_logits,
            implementation=implementation,
        )
    check_runnable(cfg)
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    if not isinstance(num_drafts, int) or num_drafts < 1:
        raise ValueError(f"num_drafts must be a static int >= 1, got {num_drafts!r}")
    if not isinstance(hidden_contract, HiddenContract):
        raise TypeError(f"hidden_contract must be a HiddenContract, got {hidden_contract!r}")
    B = _check_state(state, cfg)
    K = num_drafts
    active = check_pairs(inputs, B, cfg)
    if bitmask is not None:
        bitmask = jnp.asarray(bitmask)
        _check_bitmask(bitmask, B, K, head_cfg)
    kw = dict(cfg=cfg, head_cfg=head_cfg, implementation=implementation)
    vocab = head_cfg.draft_rows

    # 1. The window's rows; write the ones not held yet.
    cache, _, skip = held_prefix(state, inputs, active, drop_stale=True)
    count = inputs.count.astype(jnp.int32)
    start = inputs.start.astype(jnp.int32)
    T = inputs.tokens.shape[1]
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    tokens = inputs.tokens.astype(jnp.int32)
    x, a, k, v = pair_rows(
        params,
        head,
        tokens,
        inputs.hidden,
        positions,
        cfg=cfg,
        head_cfg=head_cfg,
        implementation=_linear_impl(implementation),
    )
    num_new = jnp.where(active, count - skip, 0)
    cache, _ = append(cache, _shift_left(k, skip), _shift_left(v, skip), num_new)

    # 2. The draft chain. Step 0 is the anchor's forward over the paged context (its row is held
    # now, so it writes nothing); step j >= 1 writes the row (d_j, hid_j) at key e + j with the
    # drafter-side hidden and attends over the context including it. K is static and small, but
    # the body is a whole layer plus the LM head, so it is one lax.scan body, not K copies.
    last = jnp.clip(count - 1, 0, T - 1)

    def at_last(y):
        return jnp.take_along_axis(y, last.reshape((B,) + (1,) * (y.ndim - 1)), axis=1)[:, 0]

    anchor_key = start + count - 1
    anchor_token = at_last(tokens)
    anchor_hidden = at_last(inputs.hidden).astype(jnp.float32)  # [B, H]
    anchor_x, anchor_a = at_last(x), at_last(a)

    def handed_over(o: DrafterOutput) -> jax.Array:
        if hidden_contract is HiddenContract.POST_NORM:
            return o.h_out
        if hidden_contract is HiddenContract.PRE_NORM:
            return o.residual
        return anchor_hidden

    def step(carry, j):
        cache, tok, hid = carry
        pos = anchor_key + j
        chained = j > 0
        cache, x_j, a_j = _write_row(params, head, cache, tok, hid, pos, active & chained, **kw)
        # The anchor's layer input is the one its held row was computed from.
        x_j = jnp.where(chained, x_j, anchor_x)
        a_j = jnp.where(chained, a_j, anchor_a)
        o = _decode_row(params, head, cache, x_j, a_j, pos, **kw)
        allowed = None
        if bitmask is not None:
            mask = bitmask if bitmask.ndim == 2 else jnp.take(bitmask, j, axis=1)
            allowed = unpack_bitmask(mask, vocab)
        t, p, ok, lg = _select(o.logits, allowed)
        h = handed_over(o)
        return (cache, t, h), (t, p, ok, h, lg if return_logits else None)

    (cache, _, _), ys = jax.lax.scan(
        step, (cache, anchor_token, anchor_hidden), jnp.arange(K, dtype=jnp.int32)
    )
    draft_tokens, probs, oks, hidden, all_logits = (
        None if y is None else jnp.moveaxis(y, 0, 1) for y in ys
    )  # [B, K], [B, K], [B, K], [B, K, H], [B, K, V'] or None

    # 3. Validity.
    output = finish_drafts(
        draft_tokens, probs, oks, hidden, all_logits, active, confidence_threshold
    )
    new_state = DrafterState(
        kv=cache,
        last_pair_key=jnp.where(active, anchor_key + K - 1, state.last_pair_key),
        last_num_drafted=jnp.where(active, K, state.last_num_drafted).astype(jnp.int32),
    )
    return output, new_state
