"""Sampled drafts: each draft is drawn from the drafter's tempered distribution restricted to its
top ``k`` tokens, and that restricted distribution is returned as the proposal ``q`` the
rejection rule needs.

Why top-k. Exact rejection sampling needs, at a rejected position, the residual
``normalize(max(0, p - q))`` over the whole vocabulary, so ``q`` must be known everywhere. A
draft drawn from the top ``k`` tokens renormalised has a proposal that is exactly zero outside
those ``k`` tokens: ``(ids, probs)`` of shape ``[B, K, k]`` *is* ``q``, not an approximation of
it, and the rule ``accept with min(1, p/q), resample from max(0, p - q)`` is lossless for any
proposal (the target's distribution comes out whatever ``q`` is, as long as the drafts were
drawn from it). Truncation only costs acceptance where the drafter puts mass outside its top
``k``; it never biases the output. ``q`` is the tempered distribution ``softmax(l / T)`` over the
top-k logits ``l`` at the verify's temperature ``T``.

Shapes: ``[B]`` sequences, ``[K]`` drafts, ``[k]`` the static ``draft_top_k``, ``V'`` draft vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

DEFAULT_DRAFT_TOP_K = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftProbs:
    """The proposal distribution ``q`` of each draft, on its support.

    Attributes:
      ids: int32[B, K, k] token ids, the drafter's top ``k`` at each step (grammar mask and
        reduced draft vocab applied), by decreasing probability.
      probs: f32[B, K, k] ``q`` on those ids; each row sums to 1 (0 where the mask forbids a
        token); ``q`` is 0 on every id not listed.
    """

    ids: jax.Array
    probs: jax.Array

    def at(self, tokens: jax.Array) -> jax.Array:
        """q of tokens int[B, K] -> f32[B, K] (0 for a token outside the support)."""
        hit = self.ids == tokens[..., None]
        return jnp.sum(jnp.where(hit, self.probs, 0.0), axis=-1)

    def dense(self, vocab: int) -> jax.Array:
        """q over the vocabulary: f32[..., vocab] (the ids are distinct and < vocab)."""
        lead = self.ids.shape[:-1]
        ids = self.ids.reshape(-1, self.ids.shape[-1])
        probs = self.probs.reshape(ids.shape).astype(jnp.float32)
        rows = jnp.arange(ids.shape[0])[:, None]
        out = jnp.zeros((ids.shape[0], vocab), jnp.float32).at[rows, ids].add(probs)
        return out.reshape(*lead, vocab)


def sample_top_k(
    logits: jax.Array, temperature: jax.Array, key: jax.Array, *, top_k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One draft per sequence from the top ``top_k`` of masked logits f32[B, V'] at
    ``temperature`` (traced f32[], > 0 where used; -inf logits are forbidden tokens).

    Returns (token int32[B], ids int32[B, k], probs f32[B, k]) with ``k = min(top_k, V')``;
    the token is drawn from exactly ``probs`` on ``ids``. A row with no allowed token gets
    probs all 0 and token ``ids[:, 0]`` (the caller cuts the chain there).
    """
    k = min(top_k, logits.shape[-1])
    values, ids = jax.lax.top_k(logits.astype(jnp.float32), k)  # [B, k], decreasing
    ok = jnp.isfinite(values[:, :1])
    scaled = jnp.where(ok, values, 0.0) / jnp.where(temperature > 0, temperature, 1.0)
    probs = jnp.where(ok, jax.nn.softmax(scaled, axis=-1), 0.0)  # -inf entries -> 0
    # Drawn from log(probs), the very numbers returned as q.
    pick = jax.random.categorical(key, jnp.log(jnp.where(ok, probs, 1.0)), axis=-1)
    token = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
    return token.astype(jnp.int32), ids.astype(jnp.int32), probs
