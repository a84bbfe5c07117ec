"""``linear(x, w)``: ``x @ W.T`` for any weight format, dispatched on the weight's type and rows.

The XLA path (``linear_reference``) is the CPU fallback and the oracle for the Pallas kernels. It
never rounds the weight: E2M1 * E4M3 products and E4M3 codes are exact in BF16, so the weight is
expanded in the activation's compute dtype (BF16 for BF16 activations, F32 otherwise), the dot
accumulates in F32, and the F32 global / row scale is applied once to the F32 result. Block-128
FP8 applies each tile's factor to that tile's partial dot, as a kernel streaming K-tiles does.

Pallas kernels plug in through ``register_kernel(format, regime, kernel)``; the regime is the
number of rows of ``x`` (DESIGN §7): 1 -> GEMV, 2..8 -> batched GEMV, 9..96 -> tile GEMM, more ->
GEMM. A kernel takes ``x: [M, K]``, one ``[N, K]`` weight, ``out_dtype=`` and ``interpret=``
(True off-GPU) and returns ``[M, N]`` in ``out_dtype``.

Stacked (MoE expert) weights ``[E, N, K]`` are handled by the caller with ``jax.vmap``:
``jax.vmap(linear)(x_e, w_e)`` for per-expert activations ``x_e: [E, T, K]``, or
``jax.vmap(lambda w: linear(x, w))(w_e)`` to apply every expert to the same ``x``.

Shape glossary:
  ...  leading dims of x (batch, sequence...), flattened to M rows for a kernel
  K    input features; N output features
  KB   ceil(K / 128) K-tiles of a block-128 weight
"""

from __future__ import annotations

import enum
import math
import types
from collections.abc import Mapping
from typing import Protocol

import jax
import jax.numpy as jnp

from mtpjax.weights.formats import (
    FP8_BLOCK,
    NVFP4_BLOCK,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Nvfp4Weight,
    Weight,
    WeightFormat,
)
from mtpjax.weights.quantize import decode_e2m1, unpack_e2m1

__all__ = [
    "Implementation",
    "LinearKernel",
    "RowsRegime",
    "linear",
    "linear_reference",
    "register_kernel",
    "registered_kernels",
    "rows_regime",
]


class Implementation(enum.Enum):
    """Which path ``linear`` takes."""

    AUTO = "auto"  # a registered Pallas kernel on a GPU, else XLA
    XLA = "xla"  # the pure-jnp reference
    PALLAS = "pallas"  # a registered kernel (interpret mode off-GPU); error if none


class RowsRegime(enum.Enum):
    """Kernel regime chosen by the number of rows M of ``x``."""

    GEMV = "gemv"  # M == 1
    BATCHED_GEMV = "batched_gemv"  # 2 <= M <= 8: stream the weight once for all rows
    TILE_GEMM = "tile_gemm"  # 9 <= M <= 96: the verify regime, batch * (k + 1)
    GEMM = "gemm"  # M > 96


def rows_regime(rows: int) -> RowsRegime:
    """Regime for ``rows`` rows of activations."""
    if rows <= 1:
        return RowsRegime.GEMV
    if rows <= 8:
        return RowsRegime.BATCHED_GEMV
    if rows <= 96:
        return RowsRegime.TILE_GEMM
    return RowsRegime.GEMM


class LinearKernel(Protocol):
    """A Pallas linear kernel: ``x: [M, K]``, one ``[N, K]`` weight -> ``[M, N]`` in out_dtype."""

    def __call__(
        self, x: jax.Array, w: Weight, *, out_dtype: jnp.dtype, interpret: bool
    ) -> jax.Array: ...


_KERNELS: dict[tuple[WeightFormat, RowsRegime], LinearKernel] = {}


def register_kernel(
    fmt: WeightFormat | str,
    regime: RowsRegime | str,
    kernel: LinearKernel,
    *,
    replace: bool = False,
) -> None:
    """Registers ``kernel`` for weights of ``fmt`` in ``regime``; re-registering needs replace."""
    key = (WeightFormat.parse(fmt), RowsRegime(regime))
    if key in _KERNELS and not replace:
        raise ValueError(
            f"a kernel is already registered for {key[0].value} weights in the {key[1].value} "
            "regime; pass replace=True to override it"
        )
    _KERNELS[key] = kernel


def registered_kernels() -> Mapping[tuple[WeightFormat, RowsRegime], LinearKernel]:
    """Read-only view of the kernel table."""
    return types.MappingProxyType(_KERNELS)


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def _dot_nk(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x: [..., K]`` . ``w: [N, K]`` -> ``f32[..., N]`` with F32 accumulation."""
    return jax.lax.dot_general(
        x,
        w,
        (((x.ndim - 1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


@jax.jit
def _reference_f32(x: jax.Array, w: Weight) -> jax.Array:
    # BF16 activations meet a BF16 weight; any other activation dtype computes in F32.
    cdt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    x = x.astype(cdt)
    if isinstance(w, Bf16Weight):
        return _dot_nk(x, w.w.astype(cdt))
    if isinstance(w, Fp8RowWeight):
        return _dot_nk(x, w.q.astype(cdt)) * w.scale
    if isinstance(w, Nvfp4Weight):
        scale = jnp.repeat(w.scale.astype(cdt), NVFP4_BLOCK, axis=-1)  # [N, K]
        w_c = decode_e2m1(unpack_e2m1(w.packed), cdt) * scale  # exact: 2 x 4 significant bits
        return _dot_nk(x, w_c) * w.scale_2
    if isinstance(w, Fp8BlockWeight):
        n, k = w.shape
        kb = w.scale_inv.shape[-1]
        pad = kb * FP8_BLOCK - k
        x_t = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        x_t = x_t.reshape(*x.shape[:-1], kb, FP8_BLOCK)  # [..., KB, 128]
        q_t = jnp.pad(w.q.astype(cdt), [(0, 0), (0, pad)]).reshape(n, kb, FP8_BLOCK)
        partial = jnp.einsum(
            "...tk,ntk->...nt",
            x_t,
            q_t,
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )  # [..., N, KB]
        scale = jnp.repeat(w.scale_inv, FP8_BLOCK, axis=0)[:n]  # [N, KB]
        return jnp.sum(partial * scale, axis=-1)
    raise AssertionError(type(w))  # _check_inputs admits only the four weight types


def _check_inputs(x: jax.Array, w: Weight) -> None:
    if not isinstance(w, Weight):
        raise TypeError(f"linear expects a weight pytree, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(
            f"linear takes one [N, K] weight, got a stacked {w.format.value} weight of shape "
            f"{w.shape}; vmap over the leading axes instead"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"linear expects floating-point activations, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != w.in_features:
        raise ValueError(
            f"linear: x of shape {tuple(x.shape)} does not match the {w.format.value} weight of "
            f"shape {w.shape}; x's last dim must be K = {w.in_features}"
        )


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


def linear_reference(x: jax.Array, w: Weight, *, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """XLA reference: ``x: [..., K]``, ``w: [N, K]`` -> ``[..., N]`` in out_dtype (default x's)."""
    x = jnp.asarray(x)
    _check_inputs(x, w)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return _reference_f32(x, w).astype(out_dtype)


def linear(
    x: jax.Array,
    w: Weight,
    *,
    out_dtype: jnp.dtype | None = None,
    implementation: Implementation | str = Implementation.AUTO,
) -> jax.Array:
    """``x: [..., K]`` times one weight ``[N, K]`` (transposed) -> ``[..., N]``.

    ``out_dtype`` defaults to x's dtype. ``implementation``: "auto" (a registered Pallas kernel
    when running on a GPU, else XLA), "xla", or "pallas" (NotImplementedError if no kernel is
    registered for the weight's format and the rows regime).
    """
    x = jnp.asarray(x)
    _check_inputs(x, w)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    impl = _parse_implementation(implementation)
    if impl is Implementation.XLA:
        return _reference_f32(x, w).astype(out_dtype)

    rows = math.prod(x.shape[:-1])
    regime = rows_regime(rows)
    kernel = _KERNELS.get((w.format, regime))
    if impl is Implementation.AUTO and (kernel is None or not _on_gpu()):
        return _reference_f32(x, w).astype(out_dtype)
    if kernel is None:
        raise NotImplementedError(
            f"no Pallas kernel registered for {w.format.value} weights in the {regime.value} "
            f"regime ({rows} rows); use implementation='xla' or register one with register_kernel"
        )
    n, k = w.shape
    out = kernel(x.reshape(rows, k), w, out_dtype=out_dtype, interpret=not _on_gpu())
    if out.shape != (rows, n) or out.dtype != out_dtype:
        raise ValueError(
            f"the {w.format.value}/{regime.value} kernel returned {out.dtype}{list(out.shape)}, "
            f"expected {jnp.dtype(out_dtype).name}{[rows, n]}"
        )
    return out.reshape(*x.shape[:-1], n)
