"""Drafter prefill: write the rows of a prompt's pairs without running attention.

A drafter row's K/V depend only on its pair ``(token_{i+1}, hidden_i)`` (one layer), so the rows
of a whole prompt are ``norms + fc + input_layernorm + k/v + k_norm + RoPE`` and a cache write —
no attention, no FFN, no LM head. The pairs are processed in static-size chunks by a
``lax.fori_loop`` (one compiled chunk whatever the prompt length), each chunk appended to the
paged cache. The rows are the ones ``propose`` / ``draft_step`` write one at a time.

Only heads whose fc, k_proj and v_proj are BF16 run it (``supports_drafter_prefill``): that is the
rule the GPU path is built on (the many-row pass is a BF16 GEMM). Other heads catch up through
``propose``, whose window may carry any number of pairs.

Shapes: ``[B]`` sequences, ``[T]`` pairs per window, ``[C]`` chunk rows, ``H`` hidden.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, LMHeadConfig
from mtpjax.drafter.forward import pair_rows, resolve_head_cfg
from mtpjax.drafter.params import DrafterParams, check_runnable, projection_formats
from mtpjax.drafter.propose import (
    Pairs,
    _check_state,
    _linear_impl,
    _shift_left,
    check_pairs,
    held_prefix,
)
from mtpjax.head import LMHeadParams
from mtpjax.kv import DrafterState, append
from mtpjax.weights import supports_drafter_prefill

__all__ = ["DEFAULT_CHUNK", "check_prefill_support", "prefill"]

DEFAULT_CHUNK = 256


def check_prefill_support(params: DrafterParams) -> None:
    """Raises ValueError naming the offending formats unless fc, k_proj and v_proj are BF16."""
    formats = projection_formats(params)
    if not supports_drafter_prefill(formats):
        found = ", ".join(f"{n}={formats[n].value}" for n in ("fc", "k_proj", "v_proj"))
        raise ValueError(
            "the drafter prefill needs fc, k_proj and v_proj stored BF16; this head has "
            f"{found}. Load the head at bf16 (or a dense head at nvfp4, which keeps them BF16), "
            "or write the prompt's pairs through propose instead"
        )


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "chunk_size", "head_cfg", "implementation"),
    donate_argnames=("state",),
)
def prefill(
    params: DrafterParams,
    head: LMHeadParams,
    state: DrafterState,
    pairs: Pairs,
    *,
    cfg: DrafterConfig,
    chunk_size: int = DEFAULT_CHUNK,
    head_cfg: LMHeadConfig | None = None,
    implementation="auto",
) -> DrafterState:
    """Writes the rows of each window's pairs (those past ``last_pair_key``), no attention.

    Unverified chain rows of a previous propose are dropped first, as in ``propose``.

    Args:
      params: a head with BF16 fc/k_proj/v_proj (else ValueError).
      head: the target's embedding / LM head (only the embedding is read).
      state: donated; its buffers are reused for the result.
      pairs: ``Pairs`` windows, e.g. for a prompt ``t_0..t_{P-1}``: ``tokens = t_1..t_{P-1}``,
        ``hidden = h_0..h_{P-2}``, ``start = 0`` (the anchor ``(t_P, h_{P-1})`` then goes to
        ``propose``; giving it here too is harmless: propose skips held pairs).
      cfg: static drafter config. chunk_size: static rows per chunk (clamped to T).

    Returns:
      The new state: rows appended, ``last_pair_key`` = the last key written (or kept),
      ``last_num_drafted = 0`` for the active sequences; inactive ones untouched. A
      multi-module drafter is served by `multi_module.prefill_multi` (module 0 only).
    """
    if not isinstance(params, DrafterParams):
        from mtpjax.drafter import multi_module  # it builds on this module

        return multi_module.prefill_multi.__wrapped__(
            params,
            head,
            state,
            pairs,
            cfg=cfg,
            chunk_size=chunk_size,
            head_cfg=head_cfg,
            implementation=implementation,
        )
    check_runnable(cfg)
    check_prefill_support(params)
    head_cfg = resolve_head_cfg(cfg, head_cfg)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a static int >= 1, got {chunk_size!r}")
    B = _check_state(state, cfg)
    active = check_pairs(pairs, B, cfg)
    cache, last, skip = held_prefix(state, pairs, active, drop_stale=False)
    count = pairs.count.astype(jnp.int32)
    num_new = jnp.where(active, count - skip, 0)
    first_key = pairs.start.astype(jnp.int32) + skip

    T = pairs.tokens.shape[1]
    C = min(chunk_size, T)
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    tokens = jnp.pad(_shift_left(pairs.tokens.astype(jnp.int32), skip), ((0, 0), (0, pad)))
    hidden = jnp.pad(_shift_left(pairs.hidden, skip), ((0, 0), (0, pad), (0, 0)))
    offsets = jnp.arange(C, dtype=jnp.int32)

    def chunk(c, cache):
        lo = c * C
        tok = jax.lax.dynamic_slice_in_dim(tokens, lo, C, axis=1)
        hid = jax.lax.dynamic_slice_in_dim(hidden, lo, C, axis=1)
        positions = first_key[:, None] + lo + offsets[None, :]
        _, _, k, v = pair_rows(
            params,
            head,
            tok,
            hid,
            positions,
            cfg=cfg,
            head_cfg=head_cfg,
            implementation=_linear_impl(implementation),
        )
        cache, _ = append(cache, k, v, jnp.clip(num_new - lo, 0, C))
        return cache

    cache = jax.lax.fori_loop(0, num_chunks, chunk, cache)
    end = pairs.start.astype(jnp.int32) + count - 1
    return DrafterState(
        kv=cache,
        last_pair_key=jnp.where(active, jnp.maximum(last, end), state.last_pair_key),
        last_num_drafted=jnp.where(active, 0, state.last_num_drafted).astype(jnp.int32),
    )
