"""The acceptance rule of one speculative verify round: greedy matching or lossless rejection sampling.

A round checks K drafted tokens per sequence against the K+1 verify rows of the target model and
emits between 1 and K+1 tokens per sequence: the accepted prefix of the drafts, then one token
sampled by the target (the correction at the first rejection, or the bonus token when every valid
draft was accepted).

Shapes:
  [B]  sequences in the batch
  [K]  drafts per sequence (static; may be 0)
  [V]  vocabulary size

Row ``i`` of ``target_logits`` ([B, K+1, V]) scores the token that follows draft ``i-1``: row 0
is the target's next-token distribution after the last committed token, and row K is the bonus
row after the last draft.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import device_values
from mtpjax.drafter._sampling import DraftProbs

__all__ = ["PLACEHOLDER_TOKEN_ID", "AcceptResult", "accept", "check_temperature"]

# Fill value for the unused tail of `AcceptResult.output_tokens` (vLLM uses the same id).
PLACEHOLDER_TOKEN_ID = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AcceptResult:
    """Outcome of one verify round.

    Attributes:
      num_accepted: int32[B] drafts accepted, the length of the accepted prefix (<= num_valid).
      output_tokens: int32[B, K+1] tokens to commit, in order: the ``num_accepted`` accepted
        drafts, then the target's token. Positions ``>= num_output`` hold
        ``PLACEHOLDER_TOKEN_ID`` (-1) so the shape stays fixed; use ``num_output`` as the count.
      num_output: int32[B] tokens emitted, always ``num_accepted + 1``.
    """

    num_accepted: jax.Array  # [B]
    output_tokens: jax.Array  # [B, K+1]
    num_output: jax.Array  # [B]


def accept(
    draft_tokens: jax.Array,
    draft_probs: jax.Array | DraftProbs | None,
    target_logits: jax.Array,
    *,
    temperature: float | jax.Array,
    key: jax.Array | None = None,
    num_valid: jax.Array | None = None,
) -> AcceptResult:
    """Accepts a prefix of the drafts and samples the token that follows it.

    ``temperature == 0`` is greedy: the accepted prefix is the longest one where each draft
    equals the argmax of its target row (ties go to the lowest token id), and the emitted token
    is the argmax of the row after it. Speculative greedy decoding then reproduces plain greedy
    decoding token for token.

    ``temperature > 0`` is lossless rejection sampling with ``p = softmax(target_logits /
    temperature)``: draft ``i`` (token ``x``) is accepted with probability ``min(1, p_i(x) /
    q_i(x))``; at the first rejection the token is resampled from ``normalize(max(p_i - q_i,
    0))`` (from ``p_i`` if that residual is all zero, which only rounding can cause); if every
    valid draft is accepted the bonus token is sampled from ``p`` at the row after the last
    valid draft. The emitted tokens are then distributed exactly as sampling from the target
    alone at this temperature, provided the drafts were sampled from ``q``.

    Args:
      draft_tokens: int[B, K] drafted token ids. Drafts outside ``[0, V)`` (e.g. -1 padding)
        are never accepted.
      draft_probs: f[B, K, V] the drafter's distribution ``q`` each draft was sampled from, the
        same ``q`` on its support as a ``DraftProbs`` (ids, probs [B, K, k]: q is 0 off the
        listed ids, as for drafts from the drafter's top k, ``propose(temperature=, key=)``), or
        None for argmax drafts (``q`` one-hot at the draft: accept with probability ``p(x)``,
        resample from ``p`` with ``x`` removed). The caller passes ``q`` already at the same
        temperature as the target (softmax of the drafter logits / temperature); this function
        does not rescale it. Ignored when greedy.
      target_logits: f[B, K+1, V] the target's logits for the K+1 verify rows, before
        temperature. Computed in float32 whatever the input dtype.
      temperature: a real scalar >= 0 (see `check_temperature`); 0 selects greedy
        verification. A traced value: every temperature shares one compiled program.
      key: one PRNG key for the whole batch (rows draw independently), required when
        ``temperature > 0``, ignored when greedy.
      num_valid: int[B] drafts that count per sequence (the rest were cut, e.g. by a confidence
        threshold); acceptance never extends past it. Clipped to ``[0, K]``; default K.

    Returns:
      AcceptResult with ``num_accepted`` [B], ``output_tokens`` [B, K+1] padded with -1 after
      ``num_output`` [B] = ``num_accepted + 1`` tokens.
    """
    temperature, key = check_temperature(temperature, key)
    draft_tokens, target_logits = jnp.asarray(draft_tokens), jnp.asarray(target_logits)
    if isinstance(draft_probs, DraftProbs):
        draft_probs = DraftProbs(
            ids=jnp.asarray(draft_probs.ids), probs=jnp.asarray(draft_probs.probs)
        )
    elif draft_probs is not None:
        draft_probs = jnp.asarray(draft_probs)
    num_valid = None if num_valid is None else jnp.asarray(num_valid)
    _check_inputs(draft_tokens, draft_probs, target_logits, num_valid)
    return _accept(draft_tokens, draft_probs, target_logits, num_valid, temperature, key)


def check_temperature(
    temperature: float | jax.Array, key: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """-> (temperature as a float32 scalar, the key the rule needs: None for greedy).

    A concrete temperature (a Python, NumPy or JAX real scalar) must be finite and >= 0, with a
    key when > 0; at 0 the key is dropped, so greedy runs its own program and ignores any key.
    A traced temperature cannot be checked: without a key the rule is greedy; with one it
    samples, greedy where the temperature is 0.
    """
    if isinstance(temperature, jax.core.Tracer):
        if temperature.shape != () or not jnp.issubdtype(temperature.dtype, jnp.floating):
            raise TypeError(
                f"temperature must be a float scalar, got {temperature.dtype}"
                f"{list(temperature.shape)}"
            )
        return temperature.astype(jnp.float32), key
    real = isinstance(temperature, (numbers.Real, np.ndarray, jax.Array)) and not isinstance(
        temperature, (bool, np.bool_)
    )
    if real:
        dtype = np.asarray(temperature).dtype
        real = np.ndim(temperature) == 0 and (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        )
    if not real:
        raise TypeError(f"temperature must be a real scalar (0.0 for greedy), got {temperature!r}")
    value = float(temperature)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {value}")
    if value > 0 and key is None:
        raise ValueError(f"key is required for rejection sampling (temperature={value})")
    # A device scalar reused across calls: a host one is copied to the device on every call.
    return device_values.scalar(value, "float32"), key if value > 0 else None


@jax.jit
def _accept(draft_tokens, draft_probs, target_logits, num_valid, temperature, key):
    batch, num_drafts = draft_tokens.shape
    vocab = target_logits.shape[2]
    draft_tokens = draft_tokens.astype(jnp.int32)
    if num_valid is None:
        num_valid = jnp.full((batch,), num_drafts, jnp.int32)
    num_valid = jnp.clip(num_valid.astype(jnp.int32), 0, num_drafts)  # [B]

    positions = jnp.arange(num_drafts, dtype=jnp.int32)
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)
    can_accept = in_vocab & (positions[None, :] < num_valid[:, None])  # [B, K]
    logits = target_logits.astype(jnp.float32)

    def greedy():
        return _greedy(draft_tokens, can_accept, logits)

    def sample():
        return _rejection_sample(
            draft_tokens, draft_probs, logits / temperature, can_accept, num_valid, key
        )

    if key is None:
        num_accepted, final_token = greedy()
    else:
        num_accepted, final_token = jax.lax.cond(temperature > 0, sample, greedy)

    slots = jnp.arange(num_drafts + 1, dtype=jnp.int32)[None, :]  # [1, K+1]
    n = num_accepted[:, None]
    drafts_padded = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=PLACEHOLDER_TOKEN_ID)
    output_tokens = jnp.where(
        slots < n,
        drafts_padded,
        jnp.where(slots == n, final_token[:, None], PLACEHOLDER_TOKEN_ID),
    )
    return AcceptResult(
        num_accepted=num_accepted,
        output_tokens=output_tokens.astype(jnp.int32),
        num_output=num_accepted + 1,
    )


def _greedy(draft_tokens, can_accept, logits):
    """-> (num_accepted int32[B], the target's token int32[B]) for greedy verification."""
    num_drafts = draft_tokens.shape[1]
    target_argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    accepted = can_accept & (draft_tokens == target_argmax[:, :num_drafts])
    num_accepted = _prefix_length(accepted)
    return num_accepted, _take_row(target_argmax, num_accepted)


def _rejection_sample(draft_tokens, draft_probs, scaled_logits, can_accept, num_valid, key):
    """-> (num_accepted int32[B], the target's token int32[B]) by lossless rejection sampling.

    scaled_logits: f32[B, K+1, V], already divided by the temperature.
    """
    batch, num_drafts = draft_tokens.shape
    vocab = scaled_logits.shape[-1]
    key_accept, key_sample = jax.random.split(key)
    probs = jax.nn.softmax(scaled_logits, axis=-1)  # [B, K+1, V]
    sparse = isinstance(draft_probs, DraftProbs)
    if draft_probs is not None and not sparse:
        draft_probs = draft_probs.astype(jnp.float32)

    # Clipped ids only keep the gathers in bounds; out-of-vocab drafts are in can_accept.
    safe_tokens = jnp.clip(draft_tokens, 0, vocab - 1)[..., None]  # [B, K, 1]
    p_draft = jnp.take_along_axis(probs[:, :num_drafts], safe_tokens, axis=-1)[..., 0]  # [B, K]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    elif sparse:
        q_draft = draft_probs.at(draft_tokens).astype(jnp.float32)  # 0 off the support
    else:
        q_draft = jnp.take_along_axis(draft_probs, safe_tokens, axis=-1)[..., 0]  # [B, K]
    uniform = jax.random.uniform(key_accept, (batch, num_drafts))
    # u < p/q written as u*q < p: accepts with probability min(1, p/q) without dividing, so
    # q(x) = 0 (a draft the drafter could not have sampled) accepts iff p(x) > 0.
    accepted = can_accept & (uniform * q_draft < p_draft)
    num_accepted = _prefix_length(accepted)

    # Every emitted target token comes from row `num_accepted`: the residual there on a
    # rejection, p itself for the bonus. One categorical draw over [B, V] covers both.
    p_row = _take_row(probs, num_accepted)  # [B, V]
    sample_probs = p_row
    if num_drafts > 0:
        rejected_row = jnp.minimum(num_accepted, num_drafts - 1)
        if draft_probs is None:
            # one_hot of an out-of-vocab id is all zero, so its residual is p.
            q_row = jax.nn.one_hot(_take_row(draft_tokens, rejected_row), vocab)
        elif sparse:
            # q over the vocabulary for the one row per sequence that needs it: [B, V].
            support = jax.tree.map(lambda x: _take_row(x, rejected_row), draft_probs)
            q_row = support.dense(vocab)
        else:
            q_row = _take_row(draft_probs, rejected_row)
        residual = jnp.maximum(p_row - q_row, 0.0)
        has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0
        residual = jnp.where(has_mass, residual, p_row)
        rejected = num_accepted < num_valid
        sample_probs = jnp.where(rejected[:, None], residual, p_row)
    # categorical normalises, so the residual needs no explicit division by its sum.
    final_token = jax.random.categorical(key_sample, jnp.log(sample_probs), axis=-1)
    return num_accepted, final_token.astype(jnp.int32)


def _prefix_length(accepted: jax.Array) -> jax.Array:
    """bool[B, K] -> int32[B]: length of the leading run of True."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _take_row(x: jax.Array, row: jax.Array) -> jax.Array:
    """x[b, row[b], ...] for each b: [B, R, ...] x int[B] -> [B, ...]."""
    index = row.reshape(row.shape + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)[:, 0]


def _bad(name: str, expected: str, x: jax.Array) -> ValueError:
    return ValueError(f"{name} must be {expected}, got {x.dtype}{list(x.shape)}")


def _check_inputs(draft_tokens, draft_probs, target_logits, num_valid) -> None:
    """Validates static shapes and dtypes."""
    if draft_tokens.ndim != 2 or not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise _bad("draft_tokens", "int[B, K]", draft_tokens)
    batch, num_drafts = draft_tokens.shape
    if target_logits.ndim != 3 or not jnp.issubdtype(target_logits.dtype, jnp.floating):
        raise _bad("target_logits", "float[B, K+1, V]", target_logits)
    vocab = target_logits.shape[2]
    if target_logits.shape[:2] != (batch, num_drafts + 1) or vocab == 0:
        raise ValueError(
            f"target_logits must have shape [B, K+1, V] = [{batch}, {num_drafts + 1}, V>0] "
            f"for draft_tokens [B, K] = {list(draft_tokens.shape)}, got "
            f"{list(target_logits.shape)}"
        )
    if isinstance(draft_probs, DraftProbs):
        ids, probs = draft_probs.ids, draft_probs.probs
        k = ids.shape[-1] if ids.ndim == 3 else -1
        if ids.ndim != 3 or ids.shape[:2] != (batch, num_drafts) or k < 1:
            raise _bad("draft_probs.ids", f"int[B, K, k] = [{batch}, {num_drafts}, k>=1]", ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise _bad("draft_probs.ids", "integer token ids", ids)
        if probs.shape != ids.shape or not jnp.issubdtype(probs.dtype, jnp.floating):
            raise _bad("draft_probs.probs", f"float{list(ids.shape)} (as ids)", probs)
    elif draft_probs is not None and (
        draft_probs.shape != (batch, num_drafts, vocab)
        or not jnp.issubdtype(draft_probs.dtype, jnp.floating)
    ):
        raise _bad(
            "draft_probs", f"float[B, K, V] = [{batch}, {num_drafts}, {vocab}] or None", draft_probs
        )
    if num_valid is not None and (
        num_valid.shape != (batch,) or not jnp.issubdtype(num_valid.dtype, jnp.integer)
    ):
        raise _bad("num_valid", f"int[B] = int[{batch}] or None", num_valid)
