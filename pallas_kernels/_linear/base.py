"""The contract of ``linear``: its weight operands (four storage formats, the E2M1 / E4M3
constants they rest on) and the protocol every backend implements.

A weight is a frozen, keyword-only dataclass registered as a pytree whose array leaves are the
checkpoint's own tensors, so it passes through ``jit``, ``vmap``, ``tree_map`` and donation
unchanged. Every type may carry leading stacked axes (MoE experts: ``[E, N, K]``): ``shape`` is
the logical ``(..., N, K)`` and ``out_features`` / ``in_features`` are its last two dims.

Shape glossary:
  N      output features (rows of the weight)
  K      input features (the contracted dim)
  ...    optional leading stacked axes, e.g. E experts
  NB     ceil(N / 128), KB = ceil(K / 128)   FP8 block-128 tile grid
  K/16   NVFP4 scale blocks per row; K/2 packed bytes per row

A layer of a stacked ``[L, N, K]`` weight is passed as :class:`StackedWeight` (the stack and a
traced index), which the Pallas backends read in place.

Formats (leaves -> dequantised value):
  Bf16Weight      w: bf16[..., N, K]                               -> w
  Fp8RowWeight    q: e4m3[..., N, K], scale: f32[..., N]           -> q * scale[n]
  Fp8BlockWeight  q: e4m3[..., N, K], scale_inv: f32[..., NB, KB]  -> q * scale_inv[n//128, k//128]
  Nvfp4Weight     packed: u8[..., N, K/2], scale: e4m3[..., N, K/16], scale_2: f32[...]
                                                       -> e2m1(code) * scale[n, k//16] * scale_2
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.implementation import parse_enum

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_BLOCK",
    "NVFP4_BLOCK",
    "Bf16Weight",
    "Fp8BlockWeight",
    "Fp8RowWeight",
    "Nvfp4Weight",
    "StackedWeight",
    "Weight",
    "WeightFormat",
    "decode_e2m1",
    "unpack_e2m1",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest E2M1 magnitude
NVFP4_BLOCK = 16  # elements of K sharing one E4M3 scale
FP8_BLOCK = 128  # DeepSeek/GLM block-128 tile edge, both N and K

# Decoded value of every 4-bit E2M1 code: bit 3 is the sign, bits 0..2 index the magnitudes.
# Code 8 is negative zero and decodes to 0.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


class WeightFormat(enum.Enum):
    """Storage format of a weight; the value is the accepted name."""

    BF16 = "bf16"
    FP8 = "fp8"  # per-row (per output channel) E4M3
    FP8_BLOCK = "fp8_block"  # 128x128-tile E4M3, DeepSeek/GLM native
    NVFP4 = "nvfp4"  # ModelOpt E2M1 with E4M3 block-16 scales and an F32 global scale

    @classmethod
    def parse(cls, fmt: str | WeightFormat) -> WeightFormat:
        """Parses a format name case-insensitively; unknown names raise ValueError."""
        return parse_enum(cls, fmt, "weight format")


def _is_array_like(leaf: Any) -> bool:
    # Pytree machinery rebuilds weights with placeholder leaves (None, object(), ints for vmap
    # axes, shardings); only leaves that describe an array are validated.
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _check_dtype(cls_name: str, field: str, leaf: Any, want: Any) -> None:
    dtype = jnp.dtype(leaf.dtype)
    # AD cotangents of integer leaves are float0; they are not stored weights.
    if dtype == jax.dtypes.float0:
        return
    if dtype != jnp.dtype(want):
        raise TypeError(f"{cls_name}.{field} must be {jnp.dtype(want).name}, got {dtype.name}")


def _nbytes(*leaves: Any) -> int:
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)


class _Matrix:
    """What every weight type derives from its logical ``shape`` ``(..., N, K)`` and leaves.

    ``leaf_dtypes`` names each leaf's dtype, the ``[..., N, K]`` codes (or values) first; a type
    checks its other leaves' shapes in ``_check_shapes``.
    """

    leaf_dtypes: ClassVar[dict[str, Any]]

    def __post_init__(self) -> None:
        leaves = {field: getattr(self, field) for field in self.leaf_dtypes}
        if not all(_is_array_like(leaf) for leaf in leaves.values()):
            return
        cls_name, (codes, leaf) = type(self).__name__, next(iter(leaves.items()))
        if len(leaf.shape) < 2:
            raise ValueError(
                f"{cls_name}.{codes} must be [..., N, K], got shape {tuple(leaf.shape)}"
            )
        for field, want in self.leaf_dtypes.items():
            _check_dtype(cls_name, field, leaves[field], want)
        self._check_shapes()

    def _check_shapes(self) -> None:
        pass

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``(..., N, K)``: the codes' shape."""
        return tuple(getattr(self, next(iter(self.leaf_dtypes))).shape)

    def map_rows(self, fn: Callable[[Any, int], Any]) -> Any:
        """This 2-D weight with ``fn(leaf, per)`` applied to each leaf indexed by its rows, ``per``
        rows to one leaf row (128 for ``scale_inv``); NVFP4's scalar ``scale_2`` is kept."""
        leaves = {field: getattr(self, field) for field in self.leaf_dtypes}
        per = {"scale_inv": FP8_BLOCK}
        return type(self)(
            **{f: v if v.ndim == 0 else fn(v, per.get(f, 1)) for f, v in leaves.items()}
        )

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes a kernel streams to read the whole weight."""
        return _nbytes(*jax.tree.leaves(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Bf16Weight(_Matrix):
    """Plain BF16 weight. ``w: bf16[..., N, K]``."""

    w: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.BF16
    leaf_dtypes: ClassVar[dict[str, Any]] = {"w": jnp.bfloat16}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8RowWeight(_Matrix):
    """E4M3 codes with one F32 scale per output row.

    ``q: e4m3[..., N, K]``, ``scale: f32[..., N]``.
    """

    q: jax.Array
    scale: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.FP8
    leaf_dtypes: ClassVar[dict[str, Any]] = {"q": jnp.float8_e4m3fn, "scale": jnp.float32}

    def _check_shapes(self) -> None:
        if tuple(self.scale.shape) != tuple(self.q.shape[:-1]):
            raise ValueError(
                f"Fp8RowWeight.scale must have shape {tuple(self.q.shape[:-1])} (one per row of "
                f"q {tuple(self.q.shape)}), got {tuple(self.scale.shape)}"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8BlockWeight(_Matrix):
    """E4M3 codes with one F32 factor per 128x128 tile (DeepSeek/GLM checkpoints).

    ``q: e4m3[..., N, K]``, ``scale_inv: f32[..., ceil(N/128), ceil(K/128)]``. Despite the
    checkpoint's name, ``scale_inv`` MULTIPLIES the codes. Edge tiles may be ragged.
    """

    q: jax.Array
    scale_inv: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.FP8_BLOCK
    leaf_dtypes: ClassVar[dict[str, Any]] = {"q": jnp.float8_e4m3fn, "scale_inv": jnp.float32}

    def _check_shapes(self) -> None:
        *lead, n, k = self.q.shape
        want = (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        if tuple(self.scale_inv.shape) != want:
            raise ValueError(
                f"Fp8BlockWeight.scale_inv must have shape {want} (ceil(N/128), ceil(K/128) for "
                f"q {tuple(self.q.shape)}), got {tuple(self.scale_inv.shape)}"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Nvfp4Weight(_Matrix):
    """NVIDIA ModelOpt NVFP4: packed E2M1 codes, E4M3 block-16 scales, an F32 global scale.

    ``packed: u8[..., N, K/2]`` (element 2j is the LOW nibble of byte j),
    ``scale: e4m3[..., N, K/16]``, ``scale_2: f32[...]`` (a scalar per stacked matrix).
    """

    packed: jax.Array
    scale: jax.Array
    scale_2: jax.Array

    format: ClassVar[WeightFormat] = WeightFormat.NVFP4
    leaf_dtypes: ClassVar[dict[str, Any]] = {
        "packed": jnp.uint8,
        "scale": jnp.float8_e4m3fn,
        "scale_2": jnp.float32,
    }

    def _check_shapes(self) -> None:
        *lead, n, half_k = self.packed.shape
        if (2 * half_k) % NVFP4_BLOCK:
            raise ValueError(
                f"Nvfp4Weight.packed {tuple(self.packed.shape)} holds K = {2 * half_k} codes per "
                f"row; K must be a multiple of {NVFP4_BLOCK}"
            )
        want = (*lead, n, 2 * half_k // NVFP4_BLOCK)
        if tuple(self.scale.shape) != want:
            raise ValueError(
                f"Nvfp4Weight.scale must have shape {want} (one per 16 codes of packed "
                f"{tuple(self.packed.shape)}), got {tuple(self.scale.shape)}"
            )
        if tuple(self.scale_2.shape) != tuple(lead):
            raise ValueError(
                f"Nvfp4Weight.scale_2 must have shape {tuple(lead)} (one per matrix), "
                f"got {tuple(self.scale_2.shape)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``(..., N, K)``."""
        *lead, n, half_k = self.packed.shape
        return (*lead, n, 2 * half_k)


Weight = Bf16Weight | Fp8RowWeight | Fp8BlockWeight | Nvfp4Weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StackedWeight:
    """Matrix ``index`` of a stack of weights ``[L, N, K]`` (a model's layers), read in place.

    A ``lax.scan`` over layers that slices each layer's weight out of the stack makes XLA copy
    the slice to a fresh buffer before a custom call (every Pallas kernel), which doubles the
    bytes a decode step moves. ``linear``'s Pallas backends index the stack themselves with
    ``index`` (a traced int32 scalar), so that copy is never made; the reference slices it.

    ``stack``: a weight whose leaves carry one leading ``[L]`` axis; ``index``: int32[] in
    [0, L) (out-of-range values are clamped, as ``lax.dynamic_index_in_dim`` does).
    """

    stack: Weight
    index: jax.Array

    def __post_init__(self) -> None:
        if not all(_is_array_like(leaf) for leaf in jax.tree.leaves(self.stack)):
            return
        if len(self.stack.shape) != 3:
            raise ValueError(
                f"StackedWeight.stack must be one stacked [L, N, K] weight, got a "
                f"{self.stack.format.value} weight of shape {self.stack.shape}"
            )
        if _is_array_like(self.index) and (
            self.index.shape != () or not jnp.issubdtype(self.index.dtype, jnp.integer)
        ):
            raise ValueError(
                f"StackedWeight.index must be an integer scalar, got "
                f"{jnp.dtype(self.index.dtype).name}{list(self.index.shape)}"
            )

    @property
    def format(self) -> WeightFormat:
        return self.stack.format

    @property
    def shape(self) -> tuple[int, int]:
        """The entry's logical ``(N, K)``."""
        return self.stack.shape[1:]

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes a kernel streams to read the entry."""
        return self.stack.nbytes // self.stack.shape[0]

    def leaf(self, field: str) -> jax.Array:
        """The entry of one of the stack's leaves (an XLA dynamic slice: for the small ones)."""
        return jax.lax.dynamic_index_in_dim(getattr(self.stack, field), self.index, 0, False)

    def entry(self) -> Weight:
        """The ``[N, K]`` weight itself, sliced out of the stack (a copy under XLA:GPU)."""
        return type(self.stack)(**{f: self.leaf(f) for f in self.stack.leaf_dtypes})


def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """Unpacks ``uint8[..., K/2]`` into codes ``uint8[..., K]`` (element 2j = low nibble of j)."""
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_e2m1 expects uint8 bytes, got {packed.dtype}")
    low = packed & 0xF
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def decode_e2m1(codes: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Decodes E2M1 codes ``uint8[...]`` to their values (exact in BF16 and F32)."""
    return jnp.asarray(E2M1_VALUES, dtype)[codes.astype(jnp.int32)]


class LinearBackend(Protocol):
    """A kernel family behind ``linear``: ``x: bf16[M, K]`` times one ``[N, K]`` weight (a
    ``Weight``, or a ``StackedWeight`` entry it reads in place).

    ``supported_on`` says whether it compiles for a device (off it, only interpret mode runs);
    ``supports`` gives the reason it cannot take ``rows`` rows of ``w`` (None when it can);
    calling it returns f32[M, N], any M >= 1 (the backend chunks rows as it likes).
    """

    name: str
    config_type: type

    def supported_on(self, device: Any) -> bool: ...

    def supports(self, rows: int, w: Weight) -> str | None: ...

    def __call__(self, x: jax.Array, w: Weight, *, config: Any, interpret: bool) -> jax.Array: ...


def compute_capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device."""
    cc = getattr(device, "compute_capability", None)
    if getattr(device, "platform", None) != "gpu" or cc is None:
        return None
    try:
        major, minor = (int(p) for p in str(cc).split(".")[:2])
    except ValueError:
        return None
    return major, minor
