"""The target's LM head and embedding lookup, with the row-count ladder of DESIGN §7.

``lm_head(params, hidden, cfg=cfg)`` projects ``hidden [..., H]`` through the ``[V, H]`` head and
returns ``[..., V]`` logits. The number of rows ``M`` (the product of the leading dims) picks the
kernel tier:

  M = 1        GEMV            the weight streamed once for one row (plain decode)
  2 <= M <= 8  BATCHED_GEMV    the weight streamed once for all rows (small verify / batch)
  9 <= M <= 96 VERIFY_GEMM     a tile GEMM on the transposed copy ``[H, Vp]`` (batch * (k + 1)
                               verify rows); without a copy, or for a format whose verify
                               kernel is registered ``auto=False``, it falls back to GEMM
  M > 96       GEMM            prefill-sized projections

The GEMV, batched-GEMV and GEMM tiers read the row-major weight through ``linear``'s registered
Pallas kernels; the verify tier reads the copy built by ``with_verify_copy`` through the kernel
registered with ``register_verify_kernel``, whose XLA twin and test oracle is
``verify_matmul_reference``. Kernels run on a GPU under ``implementation="auto"``.

The XLA path (CPU, or ``implementation="xla"``) computes every tier from the row-major weight,
on rows padded to a multiple of ``XLA_ROW_QUANTUM``, so a row gets the same logits, bit for bit,
however many rows it is projected with. Greedy speculative decoding is exact only if the verify
pass scores a row exactly as the single-row decode head does (the seed engine once ran another
kernel for verify than for decode and drifted with no visible error). XLA:CPU sums a dot in an
order that depends on the row count (a 1- or 2-row dot is a matrix-vector routine; a ragged row
panel takes a remainder path) and on the operands' memory layout (the K-major copy and the
row-major weight disagree in the last bit for F32 activations). Padding fixes the first and
reading a single layout the second; the tests pin both, and the independence from the slice of
the vocabulary that the vocab-parallel head relies on. On GPU the contract is the kernels'.

Activations are projected in their own precision, as ``linear`` does: BF16 hidden meets the
weight in BF16 (products exact in F32), F32 hidden meets it in F32; the dot accumulates in F32.
The soft-cap ``cap * tanh(x / cap)`` is applied in F32 before logits are cast to BF16 (when
``cfg.f32_logits`` is False).

Shape glossary:
  ...  leading dims of hidden (batch, draft position...), flattened to M rows
  H    hidden_size             V   vocab_size (rows of the head)
  V'   draft vocab: the first V' rows when ``draft=True`` and ``cfg.draft_vocab_size`` is set
  Vp   V rounded up to a multiple of 128: the columns of the transposed copy
  KB   ceil(H / 128) K-tiles of a block-128 FP8 weight
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from mtpjax.config import LMHeadConfig
from mtpjax.weights import (
    FP8_BLOCK,
    NVFP4_BLOCK,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Implementation,
    Nvfp4Weight,
    Precision,
    RowsRegime,
    Weight,
    WeightFormat,
    decode_e2m1,
    linear,
    quantize,
    registered_kernels,
    rows_regime,
)

__all__ = [
    "BATCHED_GEMV_MAX_ROWS",
    "VERIFY_COLUMN_ALIGN",
    "VERIFY_MAX_ROWS",
    "XLA_ROW_QUANTUM",
    "Bf16VerifyWeight",
    "Fp8BlockVerifyWeight",
    "Fp8RowVerifyWeight",
    "HeadTier",
    "LMHeadParams",
    "Nvfp4VerifyWeight",
    "VerifyKernel",
    "VerifyWeight",
    "build_verify_copy",
    "embed",
    "from_arrays",
    "head_tier",
    "init_lm_head",
    "lm_head",
    "register_verify_kernel",
    "registered_verify_kernels",
    "verify_copy_used",
    "verify_matmul_reference",
    "with_verify_copy",
]

BATCHED_GEMV_MAX_ROWS = 8  # the widest batched GEMV: one weight read for up to 8 rows
VERIFY_MAX_ROWS = 96  # the verify regime's ceiling: batch * (k + 1) rows
VERIFY_COLUMN_ALIGN = 128  # columns of the transposed copy are padded to a multiple of this
XLA_ROW_QUANTUM = 8  # the XLA path pads rows to a multiple of this (see the module docstring)


class HeadTier(enum.Enum):
    """Kernel tier the LM head projects ``M`` rows with."""

    GEMV = "gemv"  # M == 1
    BATCHED_GEMV = "batched_gemv"  # 2 <= M <= 8
    VERIFY_GEMM = "verify_gemm"  # 9 <= M <= 96, on the transposed copy
    GEMM = "gemm"  # M > 96


def head_tier(rows: int) -> HeadTier:
    """The tier for ``rows`` rows of hidden states (DESIGN §7); 0 rows count as a GEMV."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise ValueError(f"rows must be a non-negative integer, got {rows!r}")
    if rows <= 1:
        return HeadTier.GEMV
    if rows <= BATCHED_GEMV_MAX_ROWS:
        return HeadTier.BATCHED_GEMV
    if rows <= VERIFY_MAX_ROWS:
        return HeadTier.VERIFY_GEMM
    return HeadTier.GEMM


# --------------------------------------------------------------------------------------------
# The transposed copy read by the verify GEMM.


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _is_array_like(leaf: Any) -> bool:
    # Pytree machinery rebuilds these dataclasses with placeholder leaves (None, object(),
    # PartitionSpecs, vmap axes); only leaves that describe an array are validated.
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _check_leaf(cls: str, field: str, leaf: Any, dtype: Any, ndim: int) -> None:
    if jnp.dtype(leaf.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{cls}.{field} must be {jnp.dtype(dtype).name}, got {leaf.dtype}")
    if len(leaf.shape) != ndim:
        raise ValueError(f"{cls}.{field} must have {ndim} dims, got shape {tuple(leaf.shape)}")


def _check_aligned(cls: str, field: str, cols: int) -> None:
    if cols % VERIFY_COLUMN_ALIGN:
        raise ValueError(
            f"{cls}.{field} has {cols} columns; the transposed copy's columns must be a multiple "
            f"of {VERIFY_COLUMN_ALIGN} (build it with with_verify_copy)"
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Bf16VerifyWeight:
    """Transposed BF16 head. ``wt: bf16[H, Vp]``, ``wt[k, n] = w[n, k]``, zero past V."""

    wt: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.BF16

    def __post_init__(self) -> None:
        if _is_array_like(self.wt):
            _check_leaf("Bf16VerifyWeight", "wt", self.wt, jnp.bfloat16, 2)
            _check_aligned("Bf16VerifyWeight", "wt", self.wt.shape[1])

    @property
    def hidden_size(self) -> int:
        return self.wt.shape[0]

    @property
    def padded_vocab(self) -> int:
        return self.wt.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8RowVerifyWeight:
    """Transposed per-row FP8 head. ``qt: e4m3[H, Vp]``, ``scale: f32[Vp]`` (one per column).

    Column n dequantises to ``qt[:, n] * scale[n]``; padded columns hold zero codes and scales.
    """

    qt: jax.Array
    scale: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.FP8

    def __post_init__(self) -> None:
        if not (_is_array_like(self.qt) and _is_array_like(self.scale)):
            return
        _check_leaf("Fp8RowVerifyWeight", "qt", self.qt, jnp.float8_e4m3fn, 2)
        _check_leaf("Fp8RowVerifyWeight", "scale", self.scale, jnp.float32, 1)
        _check_aligned("Fp8RowVerifyWeight", "qt", self.qt.shape[1])
        if self.scale.shape[0] != self.qt.shape[1]:
            raise ValueError(
                f"Fp8RowVerifyWeight.scale must have {self.qt.shape[1]} entries (one per column "
                f"of qt {tuple(self.qt.shape)}), got {tuple(self.scale.shape)}"
            )

    @property
    def hidden_size(self) -> int:
        return self.qt.shape[0]

    @property
    def padded_vocab(self) -> int:
        return self.qt.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8BlockVerifyWeight:
    """Transposed block-128 FP8 head. ``qt: e4m3[H, Vp]``, ``scale_inv_t: f32[KB, Vp / 128]``.

    ``qt[k, n] * scale_inv_t[k // 128, n // 128]`` (a multiply, as in the checkpoint); Vp being a
    multiple of 128, every column tile is whole, and padded tiles hold zeros.
    """

    qt: jax.Array
    scale_inv_t: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.FP8_BLOCK

    def __post_init__(self) -> None:
        if not (_is_array_like(self.qt) and _is_array_like(self.scale_inv_t)):
            return
        _check_leaf("Fp8BlockVerifyWeight", "qt", self.qt, jnp.float8_e4m3fn, 2)
        _check_leaf("Fp8BlockVerifyWeight", "scale_inv_t", self.scale_inv_t, jnp.float32, 2)
        _check_aligned("Fp8BlockVerifyWeight", "qt", self.qt.shape[1])
        h, vp = self.qt.shape
        want = (-(-h // FP8_BLOCK), vp // FP8_BLOCK)
        if tuple(self.scale_inv_t.shape) != want:
            raise ValueError(
                f"Fp8BlockVerifyWeight.scale_inv_t must have shape {want} (ceil(H/128), Vp/128 "
                f"for qt {tuple(self.qt.shape)}), got {tuple(self.scale_inv_t.shape)}"
            )

    @property
    def hidden_size(self) -> int:
        return self.qt.shape[0]

    @property
    def padded_vocab(self) -> int:
        return self.qt.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Nvfp4VerifyWeight:
    """Transposed NVFP4 head, K leading. ``packed_t: u8[H/2, Vp]``, ``scale_t: e4m3[H/16, Vp]``,
    ``scale_2: f32[]``.

    Byte ``packed_t[j, n]`` holds the codes of elements ``k = 2j`` (low nibble) and ``k = 2j + 1``
    (high nibble) of column n: the row-major ``packed[n, j]`` moved, not repacked, so a kernel
    tile ``[BK/2, BN]`` unpacks to ``[BK, BN]`` by interleaving its low and high nibbles along K.
    ``scale_t[k // 16, n]`` scales those codes; padded columns hold zero codes and zero scales.
    """

    packed_t: jax.Array
    scale_t: jax.Array
    scale_2: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.NVFP4

    def __post_init__(self) -> None:
        if not all(_is_array_like(x) for x in (self.packed_t, self.scale_t, self.scale_2)):
            return
        _check_leaf("Nvfp4VerifyWeight", "packed_t", self.packed_t, jnp.uint8, 2)
        _check_leaf("Nvfp4VerifyWeight", "scale_t", self.scale_t, jnp.float8_e4m3fn, 2)
        _check_leaf("Nvfp4VerifyWeight", "scale_2", self.scale_2, jnp.float32, 0)
        _check_aligned("Nvfp4VerifyWeight", "packed_t", self.packed_t.shape[1])
        half_k, vp = self.packed_t.shape
        want = (2 * half_k // NVFP4_BLOCK, vp)
        if (2 * half_k) % NVFP4_BLOCK or tuple(self.scale_t.shape) != want:
            raise ValueError(
                f"Nvfp4VerifyWeight.scale_t must have shape {want} (one per 16 codes of packed_t "
                f"{tuple(self.packed_t.shape)}), got {tuple(self.scale_t.shape)}"
            )

    @property
    def hidden_size(self) -> int:
        return 2 * self.packed_t.shape[0]

    @property
    def padded_vocab(self) -> int:
        return self.packed_t.shape[1]


VerifyWeight = Bf16VerifyWeight | Fp8RowVerifyWeight | Fp8BlockVerifyWeight | Nvfp4VerifyWeight


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _check_head_weight(weight: Any) -> None:
    if not isinstance(weight, Bf16Weight | Fp8RowWeight | Fp8BlockWeight | Nvfp4Weight):
        raise TypeError(f"the LM head weight must be a weight pytree, got {type(weight).__name__}")
    if len(weight.shape) != 2:
        raise ValueError(f"the LM head weight must be one [V, H] matrix, got shape {weight.shape}")


@functools.partial(jax.jit, static_argnames=("padded_vocab",))
def build_verify_copy(weight: Weight, *, padded_vocab: int | None = None) -> VerifyWeight:
    """The transposed copy ``[H, Vp]`` of a ``[V, H]`` head, zero-padded past V.

    ``padded_vocab`` defaults to V rounded up to a multiple of 128 and must be such a multiple,
    at least V. Costs one extra copy of the head in memory; it is what lets a tile GEMM read
    the weight K-major with whole 128-column tiles whatever the vocabulary (248077 exists).
    """
    _check_head_weight(weight)
    n = weight.out_features
    vp = _round_up(n, VERIFY_COLUMN_ALIGN) if padded_vocab is None else padded_vocab
    if vp < n or vp % VERIFY_COLUMN_ALIGN:
        raise ValueError(
            f"padded_vocab={vp} must be a multiple of {VERIFY_COLUMN_ALIGN} and at least the "
            f"head's {n} rows"
        )
    if isinstance(weight, Bf16Weight):
        return Bf16VerifyWeight(wt=_pad_rows(weight.w, vp).T)
    if isinstance(weight, Fp8RowWeight):
        return Fp8RowVerifyWeight(qt=_pad_rows(weight.q, vp).T, scale=_pad_rows(weight.scale, vp))
    if isinstance(weight, Fp8BlockWeight):
        return Fp8BlockVerifyWeight(
            qt=_pad_rows(weight.q, vp).T,
            scale_inv_t=_pad_rows(weight.scale_inv, vp // FP8_BLOCK).T,
        )
    return Nvfp4VerifyWeight(
        packed_t=_pad_rows(weight.packed, vp).T,
        scale_t=_pad_rows(weight.scale, vp).T,
        scale_2=weight.scale_2,
    )


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
    verify_weight: the transposed copy ``[H, Vp]`` the verify GEMM reads (``with_verify_copy``),
                   in the weight's format; None keeps verify-sized projections on the GEMM path.
    """

    weight: Weight
    embedding: jax.Array
    final_norm: jax.Array | None = None
    verify_weight: VerifyWeight | None = None

    def __post_init__(self) -> None:
        emb = self.embedding
        if _is_array_like(emb) and (len(emb.shape) != 2 or jnp.dtype(emb.dtype) != jnp.bfloat16):
            raise ValueError(
                f"LMHeadParams.embedding must be bf16[V, H], got {emb.dtype}{list(emb.shape)}"
            )
        if not isinstance(self.weight, Bf16Weight | Fp8RowWeight | Fp8BlockWeight | Nvfp4Weight):
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
        vw = self.verify_weight
        if vw is None or not all(_is_array_like(x) for x in jax.tree.leaves(vw)):
            return
        if vw.format is not self.weight.format:
            raise TypeError(
                f"LMHeadParams.verify_weight is a {vw.format.value} copy of a "
                f"{self.weight.format.value} head; rebuild it with with_verify_copy"
            )
        want = (h, _round_up(v, VERIFY_COLUMN_ALIGN))
        if (vw.hidden_size, vw.padded_vocab) != want:
            raise ValueError(
                f"LMHeadParams.verify_weight is [H, Vp] = {(vw.hidden_size, vw.padded_vocab)}, "
                f"expected {want} for a head of shape {(v, h)}"
            )

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]


def with_verify_copy(params: LMHeadParams) -> LMHeadParams:
    """``params`` with ``verify_weight`` built from its weight (one extra copy of the head).

    The default tier choice reads it only where `verify_copy_used` says so; the GPU kernels of
    `mtpjax.kernels` verify faster from the row-major weight, so with them the copy is read
    only under a forced ``tier="verify_gemm"``."""
    return dataclasses.replace(params, verify_weight=build_verify_copy(params.weight))


_FORMAT_NAMES = {"fp4": WeightFormat.NVFP4}


def _parse_format(precision: str | WeightFormat | Precision) -> WeightFormat:
    if isinstance(precision, WeightFormat):
        return precision
    if isinstance(precision, Precision):
        return WeightFormat(precision.value)
    if isinstance(precision, str):
        name = precision.lower()
        if name in _FORMAT_NAMES:
            return _FORMAT_NAMES[name]
        try:
            return WeightFormat(name)
        except ValueError:
            pass
    accepted = ", ".join([f.value for f in WeightFormat] + list(_FORMAT_NAMES))
    raise ValueError(f"unknown LM head precision {precision!r}; expected one of: {accepted}")


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
    if isinstance(lm_head, Bf16Weight | Fp8RowWeight | Fp8BlockWeight | Nvfp4Weight):
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
    verify_copy: bool = False,
) -> LMHeadParams:
    """Random head for tests and benchmarks: embedding and head ~ N(0, 0.02^2) (HF's default
    ``initializer_range``), the head quantised to ``precision``; tied heads reuse the embedding.
    ``verify_copy`` also builds the transposed copy."""
    fmt = _parse_format(precision)
    k_embed, k_head = jax.random.split(key)
    shape = (cfg.vocab_size, cfg.hidden_size)
    embedding = (0.02 * jax.random.normal(k_embed, shape, jnp.float32)).astype(jnp.bfloat16)
    head = None if cfg.tie_word_embeddings else 0.02 * jax.random.normal(k_head, shape)
    params = from_arrays(cfg, lm_head=head, embedding=embedding, precision=fmt)
    return with_verify_copy(params) if verify_copy else params


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
# XLA math: the fallback of every kernel and the oracle of their tests.


def _dot_nk(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x: [M, K]`` . ``w: [N, K]`` -> ``f32[M, N]`` with F32 accumulation."""
    return jax.lax.dot_general(
        x,
        w,
        (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _dot_kn(x: jax.Array, wt: jax.Array) -> jax.Array:
    """``x: [M, K]`` . ``wt: [K, N]`` -> ``f32[M, N]`` with F32 accumulation."""
    return jax.lax.dot_general(
        x,
        wt,
        (((1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _compute_dtype(x: jax.Array) -> jnp.dtype:
    # linear's rule: BF16 activations meet the weight in BF16, any other dtype in F32.
    return jnp.dtype(jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32)


def _block_fp8_f32(x: jax.Array, q: jax.Array, scale: jax.Array, *, k_major: bool) -> jax.Array:
    """Block-128 FP8: ``x: [M, H]`` (compute dtype), codes ``q: [n, H]`` (``[H, n]`` when
    ``k_major``), per-row tile factors ``scale: f32[n, KB]`` -> ``f32[M, n]``.

    ``acc += dot(x_tile, q_tile) * scale[:, tile]`` over the K-tiles in order, as a kernel
    streaming K-tiles does. Spelled out because XLA:CPU sums a batched einsum, and a reduction
    over the short KB axis, in orders that depend on the row count, and has no BF16 batched dot
    for the K-major layout.
    """
    acc = None
    for t, k0 in enumerate(range(0, x.shape[-1], FP8_BLOCK)):
        x_t = x[:, k0 : k0 + FP8_BLOCK]
        if k_major:
            part = _dot_kn(x_t, q[k0 : k0 + FP8_BLOCK].astype(x.dtype))
        else:
            part = _dot_nk(x_t, q[:, k0 : k0 + FP8_BLOCK].astype(x.dtype))
        part = part * scale[:, t]
        acc = part if acc is None else acc + part
    return acc


def _pad_to_quantum(x: jax.Array) -> jax.Array:
    return _pad_rows(x, _round_up(max(x.shape[0], 1), XLA_ROW_QUANTUM))


def _xla_rows(x: jax.Array, w: Weight) -> jax.Array:
    """The XLA path of every tier: ``x: [M, H]`` against a row-major ``[n, H]`` -> ``f32[M, n]``.

    ``linear``'s XLA reference on rows padded to the quantum, except block-128 FP8, whose
    reference sums in a row-count-dependent order (see ``_block_fp8_f32``).
    """
    xp = _pad_to_quantum(x)
    if isinstance(w, Fp8BlockWeight):
        scale = jnp.repeat(w.scale_inv, FP8_BLOCK, axis=0)[: w.out_features]  # [n, KB]
        out = _block_fp8_f32(xp.astype(_compute_dtype(x)), w.q, scale, k_major=False)
    else:
        out = linear(xp, w, out_dtype=jnp.float32, implementation=Implementation.XLA)
    return out[: x.shape[0]]


@functools.partial(jax.jit, static_argnames=("n_cols",))
def verify_matmul_reference(x: jax.Array, vw: VerifyWeight, *, n_cols: int) -> jax.Array:
    """The verify GEMM in XLA: ``x: [M, H]`` times the copy's first ``n_cols`` columns ->
    ``f32[M, n_cols]``; the oracle of the verify kernels.

    Reads the K-major copy in place with ``linear``'s per-format math (compute dtype, F32
    accumulation, scales applied to the F32 result). Columns past ``n_cols``, the padding
    included, are never read. It agrees with ``lm_head``'s XLA path to F32 rounding, not bit
    for bit: XLA:CPU sums a K-major operand in another order.
    """
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] != vw.hidden_size:
        raise ValueError(f"x must be [M, H] with H = {vw.hidden_size}, got {tuple(x.shape)}")
    if not 0 < n_cols <= vw.padded_vocab:
        raise ValueError(f"n_cols={n_cols} must be in [1, {vw.padded_vocab}] for this copy")
    n = n_cols
    cdt = _compute_dtype(x)
    x = x.astype(cdt)
    if isinstance(vw, Bf16VerifyWeight):
        return _dot_kn(x, vw.wt[:, :n].astype(cdt))
    if isinstance(vw, Fp8RowVerifyWeight):
        return _dot_kn(x, vw.qt[:, :n].astype(cdt)) * vw.scale[:n]
    if isinstance(vw, Nvfp4VerifyWeight):
        packed = vw.packed_t[:, :n]  # [H/2, n]
        codes = jnp.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1, n)  # [H, n]
        scale = jnp.repeat(vw.scale_t[:, :n].astype(cdt), NVFP4_BLOCK, axis=0)  # [H, n]
        # E2M1 * E4M3 is exact in BF16, so the weight is never rounded.
        return _dot_kn(x, decode_e2m1(codes, cdt) * scale) * vw.scale_2
    if isinstance(vw, Fp8BlockVerifyWeight):
        scale = jnp.repeat(vw.scale_inv_t[:, : -(-n // FP8_BLOCK)].T, FP8_BLOCK, axis=0)[:n]
        return _block_fp8_f32(x, vw.qt[:, :n], scale, k_major=True)
    raise TypeError(f"expected a transposed verify copy, got {type(vw).__name__}")


# --------------------------------------------------------------------------------------------
# Verify-kernel seam.


class VerifyKernel(Protocol):
    """A verify GEMM: ``x: [M, H]`` (dtype as given) times the first ``n_cols`` (<= Vp) columns
    of the copy -> ``f32[M, n_cols]``.

    It treats x as ``linear`` does (BF16 meets BF16, F32 meets F32, F32 accumulation) and must
    score each row exactly as the GEMV kernel does, or greedy speculative decoding stops being
    exact; ``interpret`` is True off-GPU.
    """

    def __call__(
        self, x: jax.Array, vw: VerifyWeight, *, n_cols: int, interpret: bool
    ) -> jax.Array: ...


_VERIFY_KERNELS: dict[WeightFormat, VerifyKernel] = {}
_FORCED_ONLY: set[WeightFormat] = set()  # formats whose copy is read only under a forced tier


def register_verify_kernel(
    fmt: WeightFormat | str, kernel: VerifyKernel, *, replace: bool = False, auto: bool = True
) -> None:
    """Registers the verify GEMM for copies of ``fmt``; re-registering needs ``replace=True``.

    ``auto=False``: the row-major kernels project 9..96 rows of such heads faster, so the
    default tier choice takes GEMM even when the params carry a copy; ``tier="verify_gemm"``
    still runs this kernel.
    """
    fmt = WeightFormat.parse(fmt)
    if fmt in _VERIFY_KERNELS and not replace:
        raise ValueError(
            f"a verify kernel is already registered for {fmt.value} heads; pass replace=True"
        )
    _VERIFY_KERNELS[fmt] = kernel
    if auto:
        _FORCED_ONLY.discard(fmt)
    else:
        _FORCED_ONLY.add(fmt)


def verify_copy_used(fmt: WeightFormat | str) -> bool:
    """Whether the default tier choice reads a ``fmt`` head's transposed copy on a GPU (a
    verify kernel is registered for it, and not with ``auto=False``); build the copy only then."""
    fmt = WeightFormat.parse(fmt)
    return fmt in _VERIFY_KERNELS and fmt not in _FORCED_ONLY


def registered_verify_kernels() -> Mapping[WeightFormat, VerifyKernel]:
    """Read-only view of the verify-kernel table."""
    return types.MappingProxyType(_VERIFY_KERNELS)


# --------------------------------------------------------------------------------------------
# Projection.


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def _parse_implementation(implementation: Implementation | str) -> Implementation:
    if isinstance(implementation, Implementation):
        return implementation
    if isinstance(implementation, str):
        try:
            return Implementation(implementation.lower())
        except ValueError:
            pass
    accepted = ", ".join(i.value for i in Implementation)
    raise ValueError(f"unknown implementation {implementation!r}; expected one of: {accepted}")


def _take_rows(w: Weight, n: int) -> Weight:
    """The first n rows of a ``[V, H]`` weight: a reduced vocab is never computed then sliced."""
    if n == w.out_features:
        return w
    if isinstance(w, Bf16Weight):
        return Bf16Weight(w=w.w[:n])
    if isinstance(w, Fp8RowWeight):
        return Fp8RowWeight(q=w.q[:n], scale=w.scale[:n])
    if isinstance(w, Fp8BlockWeight):
        return Fp8BlockWeight(q=w.q[:n], scale_inv=w.scale_inv[: -(-n // FP8_BLOCK)])
    return Nvfp4Weight(packed=w.packed[:n], scale=w.scale[:n], scale_2=w.scale_2)


def _row_major_regime(tier: HeadTier, rows: int) -> RowsRegime:
    """The ``linear`` regime each kernel call of a row-major tier lands in."""
    if tier is HeadTier.GEMV:
        return RowsRegime.GEMV
    if tier is HeadTier.BATCHED_GEMV:
        return RowsRegime.BATCHED_GEMV
    return rows_regime(rows)


def _kernel_rows(x: jax.Array, w: Weight, tier: HeadTier) -> jax.Array:
    """Row-major tiers through ``linear``'s kernels, grouping the rows as the tier does."""

    def call(rows: jax.Array) -> jax.Array:
        return linear(rows, w, out_dtype=jnp.float32, implementation=Implementation.PALLAS)

    m = x.shape[0]
    if tier is HeadTier.GEMV:
        return jax.lax.map(lambda r: call(r[None])[0], x)
    if tier is HeadTier.BATCHED_GEMV:
        if m < 2:  # one row alone is a GEMV; a forced batched call carries a zero row
            return call(_pad_rows(x, 2))[:m]
        if m <= BATCHED_GEMV_MAX_ROWS:
            return call(x)
        chunks = _pad_rows(x, _round_up(m, BATCHED_GEMV_MAX_ROWS))
        chunks = chunks.reshape(-1, BATCHED_GEMV_MAX_ROWS, x.shape[1])
        return jax.lax.map(call, chunks).reshape(-1, w.out_features)[:m]
    return call(x)


def _project(
    weight: Weight,
    verify_weight: VerifyWeight | None,
    x: jax.Array,
    *,
    n_cols: int,
    tier: HeadTier,
    implementation: Implementation,
) -> jax.Array:
    """Raw logits ``f32[M, n_cols]`` of ``x: [M, H]`` against the first n_cols rows of the head.

    ``tier`` is resolved (VERIFY_GEMM only with a copy). Shared by the replicated and the
    vocab-parallel heads, which is what makes their per-column math one and the same.
    """
    m = x.shape[0]
    if m == 0:
        return jnp.zeros((0, n_cols), jnp.float32)
    on_gpu = _on_gpu()
    if tier is HeadTier.VERIFY_GEMM:
        kernel = _VERIFY_KERNELS.get(weight.format)
        if implementation is Implementation.PALLAS and kernel is None:
            raise NotImplementedError(
                f"no verify kernel registered for {weight.format.value} heads; use "
                "implementation='xla' or register one with register_verify_kernel"
            )
        if implementation is Implementation.PALLAS or (
            implementation is Implementation.AUTO and on_gpu and kernel is not None
        ):
            out = kernel(x, verify_weight, n_cols=n_cols, interpret=not on_gpu)
            if out.shape != (m, n_cols) or out.dtype != jnp.float32:
                raise ValueError(
                    f"the {weight.format.value} verify kernel returned {out.dtype}"
                    f"{list(out.shape)}, expected float32{[m, n_cols]}"
                )
            return out
        # No verify kernel to run: the copy is only worth reading through one, so project the
        # row-major weight as the GEMM tier does.
        tier = HeadTier.GEMM
    w = _take_rows(weight, n_cols)
    use_kernels = implementation is Implementation.PALLAS or (
        implementation is Implementation.AUTO
        and on_gpu
        and (weight.format, _row_major_regime(tier, m)) in registered_kernels()
    )
    return _kernel_rows(x, w, tier) if use_kernels else _xla_rows(x, w)


def _resolve_tier(
    tier: HeadTier | str | None, rows: int, has_copy: bool, fmt: WeightFormat
) -> HeadTier:
    """The tier to run: ``tier`` if forced (VERIFY_GEMM then needs the copy), else by rows,
    with VERIFY_GEMM only for a copy whose verify kernel is registered for the default choice."""
    if tier is None:
        chosen = head_tier(rows)
        use_copy = has_copy and fmt not in _FORCED_ONLY
        return HeadTier.GEMM if chosen is HeadTier.VERIFY_GEMM and not use_copy else chosen
    try:
        tier = HeadTier(tier.lower() if isinstance(tier, str) else tier)
    except ValueError:
        accepted = ", ".join(t.value for t in HeadTier)
        raise ValueError(f"unknown tier {tier!r}; expected one of: {accepted}") from None
    if tier is HeadTier.VERIFY_GEMM and not has_copy:
        raise ValueError(
            "tier=verify_gemm reads the transposed copy, and these params have none; build it "
            "with with_verify_copy(params)"
        )
    return tier


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


@functools.partial(jax.jit, static_argnames=("cfg", "draft", "tier", "implementation"))
def lm_head(
    params: LMHeadParams,
    hidden: jax.Array,
    *,
    cfg: LMHeadConfig,
    draft: bool = False,
    tier: HeadTier | str | None = None,
    implementation: Implementation | str = Implementation.AUTO,
) -> jax.Array:
    """Logits ``[..., V]`` (``[..., V']`` for a reduced draft vocab) of ``hidden [..., H]``.

    Returns F32 when ``cfg.f32_logits``, else BF16; soft-capped in F32 first when set.

    draft:          project only the first ``cfg.draft_vocab_size`` rows (when set): the
                    drafter's reduced vocab; those rows alone are read and multiplied.
    tier:           force a tier (tests, benchmarks); default by the row count (``head_tier``),
                    with VERIFY_GEMM falling back to GEMM when the params carry no copy (or
                    its kernel was registered with ``auto=False``). With
                    kernels, GEMV projects each row alone and BATCHED_GEMV up to 8 rows per
                    weight pass; the XLA path computes every tier alike.
    implementation: "auto" (registered Pallas kernels on a GPU, else XLA), "xla", or "pallas"
                    (NotImplementedError if the tier's kernel is not registered).
    """
    hidden = jnp.asarray(hidden)
    _check_hidden(hidden, cfg)
    _check_cfg_shape(cfg, "LMHeadParams.weight", params.weight.shape)
    impl = _parse_implementation(implementation)
    lead = hidden.shape[:-1]
    x = hidden.reshape(-1, cfg.hidden_size)
    resolved = _resolve_tier(
        tier, x.shape[0], params.verify_weight is not None, params.weight.format
    )
    n = _output_columns(cfg, draft)
    logits = _project(
        params.weight, params.verify_weight, x, n_cols=n, tier=resolved, implementation=impl
    )
    return _finish_logits(logits, cfg).reshape(*lead, n)
