"""The target's LM head and embedding lookup.

``lm_head(params, hidden, cfg=cfg)`` projects ``hidden [..., H]`` through the ``[V, H]`` head and
returns ``[..., V]`` logits, every row count through ``linear`` (whose kernels score a row the
same whatever the row count: decode, verify and a batch agree).

The XLA path (CPU, or ``implementation="xla"``) pads the rows to a multiple of
``XLA_ROW_QUANTUM``, so a row gets the same logits, bit for bit, however many rows it is
projected with. Greedy speculative decoding is exact only if the verify pass scores a row exactly
as the single-row decode head does. XLA:CPU sums a dot in an order that depends on the row count
(a 1- or 2-row dot is a matrix-vector routine; a ragged row panel takes a remainder path);
padding fixes it, and block-128 FP8 sums its K-tiles in order (``_block_fp8_f32``). The tests pin
both, and the independence from the slice of the vocabulary that the vocab-parallel head relies
on.

Activations are projected in their own precision, as ``linear`` does: BF16 hidden meets the
weight in BF16 (products exact in F32), F32 hidden meets it in F32; the dot accumulates in F32.
The soft-cap ``cap * tanh(x / cap)`` is applied in F32 before logits are cast to BF16 (when
``cfg.f32_logits`` is False).

Shape glossary:
  ...  leading dims of hidden (batch, draft position...), flattened to M rows
  H    hidden_size             V   vocab_size (rows of the head)
  V'   draft vocab: the first V' rows when ``draft=True`` and ``cfg.draft_vocab_size`` is set
  KB   ceil(H / 128) K-tiles of a block-128 FP8 weight
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mtpjax.config import LMHeadConfig
from mtpjax.weights import (
    FP8_BLOCK,
    Fp8BlockWeight,
    Implementation,
    Precision,
    Weight,
    WeightFormat,
    linear,
    quantize,
)
from pallas_kernels import linear_backend
from pallas_kernels.implementation import parse_enum

__all__ = [
    "XLA_ROW_QUANTUM",
    "LMHeadParams",
    "embed",
    "from_arrays",
    "init_lm_head",
    "lm_head",
]

XLA_ROW_QUANTUM = 8  # the XLA path pads rows to a multiple of this (see the module docstring)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _is_array_like(leaf: Any) -> bool:
    # Pytree machinery rebuilds these dataclasses with placeholder leaves (None, object(),
    # PartitionSpecs, vmap axes); only leaves that describe an array are validated.
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _check_head_weight(weight: Any) -> None:
    if not isinstance(weight, Weight):
        raise TypeError(f"the LM head weight must be a weight pytree, got {type(weight).__name__}")
    if len(weight.shape) != 2:
        raise ValueError(f"the LM head weight must be one [V, H] matrix, got shape {weight.shape}")


# --------------------------------------------------------------------------------------------
# Params.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LMHeadParams:
    """The target's output head and input embedding.

    weight:        [V, H] the target's lm_head (the embedding itself, possibly quantised, when
                   the word embeddings are tied), any weight format.
    embedding:     bf16[V, H] the embed_tokens lookup table.
    final_norm:    [H] the target's final norm weight, for callers that need it; unused here.
    """

    weight: Weight
    embedding: jax.Array
    final_norm: jax.Array | None = None

    def __post_init__(self) -> None:
        emb = self.embedding
        if _is_array_like(emb) and (len(emb.shape) != 2 or jnp.dtype(emb.dtype) != jnp.bfloat16):
            raise ValueError(
                f"LMHeadParams.embedding must be bf16[V, H], got {emb.dtype}{list(emb.shape)}"
            )
        if not isinstance(self.weight, Weight):
            return  # a pytree placeholder (specs, vmap axes), not a weight
        if not all(_is_array_like(x) for x in jax.tree.leaves(self.weight)):
            return
        _check_head_weight(self.weight)
        v, h = self.weight.shape
        if _is_array_like(self.embedding) and tuple(self.embedding.shape) != (v, h):
            raise ValueError(
                f"LMHeadParams.embedding {tuple(self.embedding.shape)} does not match the head "
                f"weight {(v, h)}; both are [V, H]"
            )
        if _is_array_like(self.final_norm) and tuple(self.final_norm.shape) != (h,):
            raise ValueError(
                f"LMHeadParams.final_norm must be [H] = ({h},), got {tuple(self.final_norm.shape)}"
            )

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]


def _parse_format(precision: str | WeightFormat | Precision) -> WeightFormat:
    if isinstance(precision, Precision):
        return WeightFormat(precision.value)
    return parse_enum(WeightFormat, precision, "LM head precision", {"fp4": WeightFormat.NVFP4})


def _check_cfg_shape(cfg: LMHeadConfig, what: str, shape: tuple[int, ...]) -> None:
    want = (cfg.vocab_size, cfg.hidden_size)
    if tuple(shape) != want:
        raise ValueError(f"{what} has shape {tuple(shape)}, expected [V, H] = {want} from cfg")


def from_arrays(
    cfg: LMHeadConfig,
    *,
    lm_head: jax.Array | Weight | None = None,
    embedding: jax.Array,
    final_norm: jax.Array | None = None,
    precision: str | WeightFormat | Precision | None = None,
) -> LMHeadParams:
    """LM head params from checkpoint tensors.

    lm_head:    f32/bf16[V, H] (quantised to ``precision``) or an already-stored weight pytree
                (kept as stored; ``precision``, if given, must name its format). None when
                ``cfg.tie_word_embeddings``: the embedding is the head.
    embedding:  [V, H], stored BF16.
    final_norm: [H] or None.
    precision:  bf16 | fp8 (per row) | fp8_block | nvfp4 (alias fp4); default bf16 for arrays.
    """
    fmt = None if precision is None else _parse_format(precision)
    embedding = jnp.asarray(embedding)
    _check_cfg_shape(cfg, "embedding", embedding.shape)
    embedding = embedding.astype(jnp.bfloat16)
    if lm_head is None:
        if not cfg.tie_word_embeddings:
            raise ValueError(
                "lm_head is required unless cfg.tie_word_embeddings is set (then the embedding "
                "is the head)"
            )
        lm_head = embedding
    if isinstance(lm_head, Weight):
        if fmt is not None and fmt is not lm_head.format:
            raise ValueError(
                f"lm_head is stored {lm_head.format.value} but precision={precision!r} was asked "
                "for; re-quantising a stored weight loses precision, so dequantise it first if "
                "that is really wanted"
            )
        weight = lm_head
    else:
        weight = quantize(jnp.asarray(lm_head), WeightFormat.BF16 if fmt is None else fmt)
    _check_head_weight(weight)
    _check_cfg_shape(cfg, "lm_head", weight.shape)
    if final_norm is not None:
        final_norm = jnp.asarray(final_norm)
    return LMHeadParams(weight=weight, embedding=embedding, final_norm=final_norm)


def init_lm_head(
    cfg: LMHeadConfig,
    *,
    key: jax.Array,
    precision: str | WeightFormat | Precision = "bf16",
) -> LMHeadParams:
    """Random head for tests and benchmarks: embedding and head ~ N(0, 0.02^2) (HF's default
    ``initializer_range``), the head quantised to ``precision``; tied heads reuse the embedding."""
    fmt = _parse_format(precision)
    k_embed, k_head = jax.random.split(key)
    shape = (cfg.vocab_size, cfg.hidden_size)
    embedding = (0.02 * jax.random.normal(k_embed, shape, jnp.float32)).astype(jnp.bfloat16)
    head = None if cfg.tie_word_embeddings else 0.02 * jax.random.normal(k_head, shape)
    return from_arrays(cfg, lm_head=head, embedding=embedding, precision=fmt)


# --------------------------------------------------------------------------------------------
# Embedding.


@functools.partial(jax.jit, static_argnames=("cfg",))
def embed(params: LMHeadParams, tokens: jax.Array, *, cfg: LMHeadConfig) -> jax.Array:
    """Embedding rows ``f32[..., H]`` for token ids ``int[...]``, times ``cfg.embedding_scale``.

    Ids outside [0, V) are clamped into range, so padding ids (-1, V) give finite rows that
    cannot poison batched arithmetic; callers mask such rows themselves.
    """
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"embed expects integer token ids, got {tokens.dtype}")
    _check_cfg_shape(cfg, "LMHeadParams.embedding", params.embedding.shape)
    e = jnp.take(params.embedding, tokens, axis=0, mode="clip").astype(jnp.float32)
    return e if cfg.embedding_scale is None else e * jnp.float32(cfg.embedding_scale)


# --------------------------------------------------------------------------------------------
# Projection.


def _dot_nk(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x: [M, K]`` . ``w: [N, K]`` -> ``f32[M, N]`` with F32 accumulation."""
    return jax.lax.dot_general(
        x,
        w,
        (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _compute_dtype(x: jax.Array) -> jnp.dtype:
    # linear's rule: BF16 activations meet the weight in BF16, any other dtype in F32.
    return jnp.dtype(jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32)


def _block_fp8_f32(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """Block-128 FP8: ``x: [M, H]`` (compute dtype), codes ``q: [n, H]``, per-row tile factors
    ``scale: f32[n, KB]`` -> ``f32[M, n]``.

    ``acc += dot(x_tile, q_tile) * scale[:, tile]`` over the K-tiles in order, as a kernel
    streaming K-tiles does. Spelled out because XLA:CPU sums a batched einsum, and a reduction
    over the short KB axis, in orders that depend on the row count.
    """
    acc = None
    for t, k0 in enumerate(range(0, x.shape[-1], FP8_BLOCK)):
        x_t = x[:, k0 : k0 + FP8_BLOCK]
        part = _dot_nk(x_t, q[:, k0 : k0 + FP8_BLOCK].astype(x.dtype)) * scale[:, t]
        acc = part if acc is None else acc + part
    return acc


def _xla_rows(x: jax.Array, w: Weight) -> jax.Array:
    """The XLA path: ``x: [M, H]`` against a row-major ``[n, H]`` -> ``f32[M, n]``.

    ``linear``'s XLA reference on rows padded to the quantum, except block-128 FP8, whose
    reference sums in a row-count-dependent order (see ``_block_fp8_f32``).
    """
    xp = _pad_rows(x, _round_up(max(x.shape[0], 1), XLA_ROW_QUANTUM))
    if isinstance(w, Fp8BlockWeight):
        scale = jnp.repeat(w.scale_inv, FP8_BLOCK, axis=0)[: w.out_features]  # [n, KB]
        out = _block_fp8_f32(xp.astype(_compute_dtype(x)), w.q, scale)
    else:
        out = linear(xp, w, out_dtype=jnp.float32, implementation=Implementation.XLA)
    return out[: x.shape[0]]


def _take_rows(w: Weight, n: int) -> Weight:
    """The first n rows of a ``[V, H]`` weight: a reduced vocab is never computed then sliced."""
    return w if n == w.out_features else w.map_rows(lambda a, per: a[: -(-n // per)])


def _project(weight: Weight, x: jax.Array, *, n_cols: int, implementation: Implementation):
    """Raw logits ``f32[M, n_cols]`` of ``x: [M, H]`` against the first n_cols rows of the head.

    Shared by the replicated and the vocab-parallel heads, which is what makes their per-column
    math one and the same.
    """
    if x.shape[0] == 0:
        return jnp.zeros((0, n_cols), jnp.float32)
    w = _take_rows(weight, n_cols)
    if linear_backend(x.shape[0], w, implementation) is None:
        return _xla_rows(x, w)
    return linear(x, w, out_dtype=jnp.float32, implementation=implementation)


def _finish_logits(logits: jax.Array, cfg: LMHeadConfig) -> jax.Array:
    """Soft-cap in F32 (when set), then the logits dtype: ``f32[...] -> f32|bf16[...]``."""
    if cfg.logit_softcap is not None:
        cap = jnp.float32(cfg.logit_softcap)
        logits = cap * jnp.tanh(logits / cap)
    return logits if cfg.f32_logits else logits.astype(jnp.bfloat16)


def _output_columns(cfg: LMHeadConfig, draft: bool) -> int:
    """Logit columns produced: V' for a draft projection with a reduced vocab, else V."""
    return cfg.draft_rows if draft else cfg.vocab_size


def _check_hidden(hidden: jax.Array, cfg: LMHeadConfig) -> None:
    if not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise TypeError(f"lm_head expects floating-point hidden states, got {hidden.dtype}")
    if hidden.ndim < 1 or hidden.shape[-1] != cfg.hidden_size:
        raise ValueError(
            f"hidden of shape {tuple(hidden.shape)} does not end in H = {cfg.hidden_size}"
        )


def lm_head(
    params: LMHeadParams,
    hidden: jax.Array,
    *,
    cfg: LMHeadConfig,
    draft: bool = False,
    implementation: Implementation | str = Implementation.AUTO,
) -> jax.Array:
    """Logits ``[..., V]`` (``[..., V']`` for a reduced draft vocab) of ``hidden [..., H]``.

    Returns F32 when ``cfg.f32_logits``, else BF16; soft-capped in F32 first when set.

    draft:          project only the first ``cfg.draft_vocab_size`` rows (when set): the
                    drafter's reduced vocab; those rows alone are read and multiplied.
    implementation: as ``linear``'s: AUTO (its best backend on the device, else XLA), XLA, or
                    PALLAS (NotImplementedError if no backend takes the head).
    """
    impl = Implementation.parse(implementation)
    return _lm_head(params, hidden, cfg=cfg, draft=draft, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "draft", "implementation"))
def _lm_head(params, hidden, *, cfg, draft, implementation):
    hidden = jnp.asarray(hidden)
    _check_hidden(hidden, cfg)
    _check_cfg_shape(cfg, "LMHeadParams.weight", params.weight.shape)
    lead = hidden.shape[:-1]
    x = hidden.reshape(-1, cfg.hidden_size)
    n = _output_columns(cfg, draft)
    logits = _project(params.weight, x, n_cols=n, implementation=implementation)
    return _finish_logits(logits, cfg).reshape(*lead, n)
