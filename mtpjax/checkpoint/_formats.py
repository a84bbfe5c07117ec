"""Per-tensor format detection, native reading and requantisation of checkpoint projections.

Each projection's storage format is decided from its own tensors, never from the checkpoint's
global quantisation config (NVFP4 checkpoints routinely keep their MTP module in BF16):

  ``{base}.weight`` dtype      companions                               format
  BF16 / F16 / F32             none                                     float (stored BF16)
  F8_E4M3                      ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]
                                                                        FP8 block-128 (DeepSeek, GLM)
  F8_E4M3                      ``weight_scale`` F32 [N] or [N, 1]       FP8 per-row
  F8_E4M3                      ``weight_scale`` F32 [] or [1]           FP8 per-tensor (kept per-row)
  U8 [N, K/2]                  ``weight_scale`` E4M3 [N, K/16] and ``weight_scale_2`` F32 []
                                                                        NVIDIA ModelOpt NVFP4

``input_scale`` (activation calibration) is ignored. A float tensor kept under ``keep`` is
rounded to BF16 (exact for BF16 sources); a quantised one is kept bit for bit. Requantising goes
through the F32 value of the source (dequantised when quantised) and ``mtpjax.weights.quantize``,
one matrix at a time and, for large matrices, in row chunks whose results are bit-identical to
quantising the whole matrix (``CHUNK_ELEMENTS``), so neither a stack of experts nor a large LM
head ever exists as one F32 array; a tensor already stored in the target format is kept as is
(requantising a quantised weight can only lose).

Shapes: ``N`` output rows, ``K`` input features, ``E`` stacked experts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mtpjax.checkpoint._safetensors_io import CheckpointError, SafetensorsCheckpoint, TensorInfo
from mtpjax.weights import (
    FP8_BLOCK,
    NVFP4_BLOCK,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Nvfp4Weight,
    Precision,
    Projection,
    Weight,
    WeightFormat,
    dequantize,
    projection_format,
    quantize,
)

__all__ = [
    "CHUNK_ELEMENTS",
    "FLOAT_DTYPES",
    "KEEP",
    "PRECISIONS",
    "SourceFormat",
    "SourceWeight",
    "check_dtype",
    "companion_names",
    "convert_packed_slices",
    "convert_stacked",
    "convert_weight",
    "describe_precision",
    "detect",
    "parse_target_precision",
    "read_embedding",
    "read_native",
    "stack_weights",
    "target_format",
    "weight_class",
    "weight_leaves",
]

KEEP = "keep"
FLOAT_DTYPES = ("BF16", "F16", "F32")
_IGNORED_COMPANIONS = ("input_scale",)


class SourceFormat(enum.Enum):
    """How a projection is stored in the source checkpoint (the manifest's ``source_format``)."""

    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    FP8_BLOCK = "fp8_block"
    FP8_ROW = "fp8"
    FP8_TENSOR = "fp8_tensor"
    NVFP4 = "nvfp4"

    @property
    def native(self) -> WeightFormat:
        """The library format its tensors are kept in under ``keep``."""
        return _NATIVE[self]


_NATIVE = {
    SourceFormat.BF16: WeightFormat.BF16,
    SourceFormat.F16: WeightFormat.BF16,
    SourceFormat.F32: WeightFormat.BF16,
    SourceFormat.FP8_BLOCK: WeightFormat.FP8_BLOCK,
    SourceFormat.FP8_ROW: WeightFormat.FP8,
    SourceFormat.FP8_TENSOR: WeightFormat.FP8,
    SourceFormat.NVFP4: WeightFormat.NVFP4,
}

_WEIGHT_CLASSES = {c.format: c for c in (Bf16Weight, Fp8RowWeight, Fp8BlockWeight, Nvfp4Weight)}


def weight_class(fmt: WeightFormat) -> type:
    """The weight pytree class of a format."""
    return _WEIGHT_CLASSES[fmt]


def weight_leaves(w: Weight) -> dict[str, np.ndarray]:
    """A weight's array leaves by field name (``w``; ``q, scale``; ``packed, scale, scale_2``)."""
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}


# Conversion precisions: ``keep``, or the format every projection is requantised to (``fp8`` is
# per row, ``fp8_block`` DeepSeek/GLM's 128x128 tiles); ``fp4`` is an alias of ``nvfp4``.
PRECISIONS = (KEEP, "bf16", "fp8", "fp8_block", "nvfp4")
_ALIASES = {"fp4": "nvfp4"}


def parse_target_precision(precision: str | Precision | WeightFormat | None) -> WeightFormat | None:
    """``keep`` (or None) -> None; ``bf16 | fp8 | fp8_block | nvfp4 | fp4`` (any case) -> the
    format projections are requantised to (the router and shared-expert gate stay BF16)."""
    if isinstance(precision, (Precision, WeightFormat)):
        precision = precision.value
    name = precision.lower() if isinstance(precision, str) else precision
    name = _ALIASES.get(name, name)
    if name is None or name == KEEP:
        return None
    if name not in PRECISIONS:
        raise ValueError(
            f"unknown precision {precision!r}; expected one of: {', '.join(PRECISIONS)} "
            "(fp4 is an alias of nvfp4)"
        )
    return WeightFormat(name)


def target_format(role: Projection, target: WeightFormat, *, dense_ffn: bool) -> WeightFormat:
    """A projection's stored format under ``target``: ``projection_format``'s rule, with
    ``fp8_block`` following the FP8 rule in block-128 tiles."""
    block = target is WeightFormat.FP8_BLOCK
    fmt = projection_format(role, "fp8" if block else target.value, dense_ffn=dense_ffn)
    return WeightFormat.FP8_BLOCK if block and fmt is WeightFormat.FP8 else fmt


def describe_precision(precision: WeightFormat | None) -> str:
    return KEEP if precision is None else precision.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceWeight:
    """One projection in the source: its ``.weight`` tensor, its companions and its format.

    ``shape`` is the logical ``(N, K)`` (NVFP4 packs two codes per byte: ``K = 2 * bytes``).
    """

    name: str  # the weight tensor's full name
    weight: TensorInfo
    format: SourceFormat
    scale: TensorInfo | None = None  # weight_scale_inv (block), weight_scale (row/tensor/NVFP4)
    scale_2: TensorInfo | None = None  # NVFP4 global scale
    shape: tuple[int, ...]


def _shape(info: TensorInfo) -> list[int]:
    return list(info.shape)


def detect(ckpt: SafetensorsCheckpoint, name: str) -> SourceWeight:
    """The format of projection tensor ``name`` (``...weight``), from its dtype and companions.

    Companions are looked up beside it: ``name + "_scale_inv"``, ``name + "_scale"``,
    ``name + "_scale_2"``. A combination that is not one of the formats above raises
    ``CheckpointError`` naming the tensors.
    """
    info = ckpt.info(name)

    def companion(suffix: str) -> TensorInfo | None:
        other = name + suffix
        return ckpt.info(other) if other in ckpt else None

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{name} ({info.file.name}): {what}")

    found = functools.partial(SourceWeight, name=name, weight=info)

    if len(info.shape) < 2:
        raise fail(f"expected a [N, K] projection, found shape {_shape(info)}")
    *lead, n, k = info.shape
    if info.dtype in FLOAT_DTYPES:
        return found(format=SourceFormat(info.dtype.lower()), shape=info.shape)
    if info.dtype == "F8_E4M3":
        scale_inv = companion("_scale_inv")
        if scale_inv is not None:
            want = (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
            if scale_inv.shape != want:
                raise fail(
                    f"FP8 block-{FP8_BLOCK} scale {name}_scale_inv has shape "
                    f"{_shape(scale_inv)}, expected {list(want)} for a weight of shape "
                    f"{_shape(info)} (other block sizes are not supported)"
                )
            check_dtype(scale_inv, "weight scale")
            return found(format=SourceFormat.FP8_BLOCK, scale=scale_inv, shape=info.shape)
        scale = companion("_scale")
        if scale is None:
            raise fail(
                f"F8_E4M3 weight without a {name}_scale_inv (block) or {name}_scale (per-row) "
                "companion: cannot tell how to dequantise it"
            )
        check_dtype(scale, "weight scale")
        if scale.shape in ((*lead, n), (*lead, n, 1)):
            fmt = SourceFormat.FP8_ROW
        elif math.prod(scale.shape) == 1 and not lead:
            fmt = SourceFormat.FP8_TENSOR
        else:
            raise fail(
                f"FP8 scale {name}_scale has shape {_shape(scale)}; expected [{n}] or [{n}, 1] "
                "(per row) or [] (per tensor)"
            )
        return found(format=fmt, scale=scale, shape=info.shape)
    if info.dtype == "U8":
        scale, scale_2 = companion("_scale"), companion("_scale_2")
        if scale is None or scale_2 is None:
            raise fail(
                "U8 weight without both NVFP4 companions "
                f"{name}_scale (E4M3 [N, K/16]) and {name}_scale_2 (F32 scalar)"
            )
        logical = (*lead, n, 2 * k)
        want = (*lead, n, 2 * k // NVFP4_BLOCK)
        if scale.dtype != "F8_E4M3" or scale.shape != want:
            raise fail(
                f"NVFP4 block scale {name}_scale is {scale.dtype}{_shape(scale)}, expected "
                f"F8_E4M3{list(want)} for packed codes of shape {_shape(info)}"
            )
        if scale_2.dtype != "F32" or math.prod(scale_2.shape) != math.prod(lead):
            raise fail(
                f"NVFP4 global scale {name}_scale_2 is {scale_2.dtype}{_shape(scale_2)}, "
                "expected one F32 value per matrix"
            )
        return found(format=SourceFormat.NVFP4, scale=scale, scale_2=scale_2, shape=logical)
    raise fail(
        f"weight dtype {info.dtype} is not a projection format this converter reads "
        "(BF16/F16/F32, F8_E4M3 with a scale, or NVFP4 U8 with E4M3 scales)"
    )


def check_dtype(info: TensorInfo, role: str, allowed: Sequence[str] = FLOAT_DTYPES) -> None:
    """The one dtype check: ``info`` (a ``role`` such as "norm or bias") must be ``allowed``."""
    if info.dtype not in allowed:
        raise CheckpointError(
            f"{info.name} ({info.file.name}): a {role} must be {' / '.join(allowed)}, found "
            f"{info.dtype}"
        )


def companion_names(name: str) -> tuple[str, ...]:
    """Every companion a projection ``...weight`` may have (the ignored ``input_scale`` too)."""
    base = name.removesuffix(".weight")
    return (
        name + "_scale_inv",
        name + "_scale",
        name + "_scale_2",
        *(f"{base}.{c}" for c in _IGNORED_COMPANIONS),
    )


def _as_f32(ckpt: SafetensorsCheckpoint, info: TensorInfo) -> np.ndarray:
    return ckpt.read(info.name).astype(np.float32)


_FLOAT_SOURCES = (SourceFormat.BF16, SourceFormat.F16, SourceFormat.F32)

# Rows are requantised in chunks of about this many elements (64 MiB of F32), so a large matrix
# (an LM head of 1e9 elements) never exists as one F32 array with quantisation temporaries.
CHUNK_ELEMENTS = 1 << 24


def read_native(ckpt: SafetensorsCheckpoint, src: SourceWeight) -> Weight:
    """The projection in its native library format, numpy-backed (see the module table).

    Float sources come back as BF16 (F16/F32 rounded to nearest even, row chunk by row chunk).
    """
    if src.format in _FLOAT_SOURCES:
        return convert_weight(ckpt, src, WeightFormat.BF16)
    w = ckpt.read(src.name)
    if src.format is SourceFormat.FP8_BLOCK:
        return Fp8BlockWeight(q=w, scale_inv=_as_f32(ckpt, src.scale))
    if src.format is SourceFormat.FP8_ROW:
        scale = _as_f32(ckpt, src.scale).reshape(src.shape[:-1])
        return Fp8RowWeight(q=w, scale=scale)
    if src.format is SourceFormat.FP8_TENSOR:
        scale = _as_f32(ckpt, src.scale).reshape(())
        return Fp8RowWeight(q=w, scale=np.full(src.shape[:-1], scale, np.float32))
    scale_2 = ckpt.read(src.scale_2.name).reshape(src.shape[:-2])
    return Nvfp4Weight(packed=w, scale=ckpt.read(src.scale.name), scale_2=scale_2)


def _row_span(leaf: str, r0: int, r1: int) -> slice:
    """The slice of leaf ``leaf`` that holds rows ``[r0, r1)`` of a 2-D weight (``scale_inv``
    has one row per 128-row tile, so a block-128 ``r0`` must be a multiple of 128)."""
    div = FP8_BLOCK if leaf == "scale_inv" else 1
    return slice(r0 // div, -(-r1 // div))


RowReader = Callable[[int, int], np.ndarray]  # (r0, r1) -> f32[r1 - r0, K]


def _float_rows(ckpt: SafetensorsCheckpoint, src: SourceWeight) -> RowReader:
    info, k = src.weight, src.shape[-1]

    def rows(r0: int, r1: int) -> np.ndarray:
        part = np.empty((r1 - r0, k), info.np_dtype)
        ckpt.read_flat(info.name, r0 * k, part)
        return part.astype(np.float32)

    return rows


def _dequantized_rows(native: Weight) -> RowReader:
    def rows(r0: int, r1: int) -> np.ndarray:
        part = native.map_rows(lambda a, per: a[r0 // per : -(-r1 // per)])
        return np.asarray(dequantize(jax.tree.map(jnp.asarray, part)))

    return rows


def _chunk_rows(n: int, k: int, aligned: bool, chunk_elements: int) -> int:
    rows = max(chunk_elements // max(k, 1), 1)
    if aligned:  # block-128 tiles must not straddle two chunks
        rows = -(-rows // FP8_BLOCK) * FP8_BLOCK
    return min(rows, n)


def _requantize_rows(
    rows: RowReader,
    src: SourceWeight,
    fmt: WeightFormat,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> Weight:
    """``quantize(f32 matrix, fmt)`` computed over row chunks, bit-identical to the whole.

    Every format but NVFP4 quantises rows (or 128-row tiles) independently. NVFP4's global scale
    comes from the whole matrix's amax, so it is found first, and each chunk is quantised with
    one extra row holding that amax (then dropped): the chunk's global scale is then exactly the
    whole matrix's, and a row's block scales and codes depend on nothing but that scale.
    """
    n, k = src.shape
    aligned = fmt is WeightFormat.FP8_BLOCK or src.format is SourceFormat.FP8_BLOCK
    step = _chunk_rows(n, k, aligned, chunk_elements)
    bounds = [(r0, min(r0 + step, n)) for r0 in range(0, n, step)]

    def quantize_f32(x: np.ndarray) -> Weight:
        return _quantize_float(x, fmt, src.name)

    if len(bounds) == 1:
        return quantize_f32(rows(0, n))
    amax_row = None
    if fmt is WeightFormat.NVFP4:
        amax = max(float(np.max(np.abs(rows(r0, r1)))) for r0, r1 in bounds)
        amax_row = np.zeros((1, k), np.float32)
        amax_row[0, 0] = amax
    out: dict[str, np.ndarray] = {}
    for r0, r1 in bounds:
        chunk = rows(r0, r1)
        if amax_row is not None:
            chunk = np.concatenate([chunk, amax_row])
        part = weight_leaves(quantize_f32(chunk))
        for name, leaf in part.items():
            if leaf.ndim == 0:  # NVFP4 scale_2: the same for every chunk, by construction
                out[name] = leaf
                continue
            span = _row_span(name, r0, r1)
            if name not in out:
                out[name] = np.empty((_row_span(name, 0, n).stop, *leaf.shape[1:]), leaf.dtype)
            out[name][span] = leaf[: span.stop - span.start]
    return weight_class(fmt)(**out)


def convert_weight(
    ckpt: SafetensorsCheckpoint,
    src: SourceWeight,
    fmt: WeightFormat | None,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> Weight:
    """One ``[N, K]`` projection: native (``fmt`` None, i.e. ``keep``) or stored as ``fmt``.

    Float sources are quantised from their own values (an F32 source is not first rounded to
    BF16); quantised sources from their dequantised F32; a source already in ``fmt`` is kept.
    Large matrices are processed in row chunks of about ``chunk_elements`` (bit-identical).
    """
    if fmt is None:
        return read_native(ckpt, src)
    if src.format in _FLOAT_SOURCES:
        if fmt is WeightFormat.BF16 and src.format is SourceFormat.BF16:
            return Bf16Weight(w=ckpt.read(src.name))
        reader = _float_rows(ckpt, src)
    else:
        native = read_native(ckpt, src)
        if native.format is fmt:
            return native
        reader = _dequantized_rows(native)
    return _requantize_rows(reader, src, fmt, chunk_elements=chunk_elements)


def _quantize_float(w: np.ndarray, fmt: WeightFormat, name: str) -> Weight:
    try:
        return jax.tree.map(np.asarray, quantize(jnp.asarray(w, jnp.float32), fmt))
    except ValueError as err:
        raise CheckpointError(f"{name}: cannot store as {fmt.value}: {err}") from None


def stack_weights(parts: Sequence[Callable[[], Weight]], *, what: str) -> Weight:
    """Stacks per-matrix weights ``[N, K]`` into one ``[E, N, K]`` weight of the same format.

    ``parts`` are thunks producing each matrix in turn, so only one un-stacked matrix is alive
    at a time; the stacked leaves are allocated once, from the first matrix's shapes.
    """
    out: dict[str, np.ndarray] | None = None
    cls: type | None = None
    for e, make in enumerate(parts):
        w = make()
        leaves = weight_leaves(w)
        if out is None:
            cls = type(w)
            out = {
                k: np.empty((len(parts), *np.shape(v)), np.asarray(v).dtype)
                for k, v in leaves.items()
            }
        elif type(w) is not cls:
            raise CheckpointError(
                f"{what}: expert {e} is stored {w.format.value} but expert 0 is "
                f"{cls.format.value}; --precision keep needs one format for all experts (ask "
                "for bf16, fp8 or nvfp4 to requantise them)"
            )
        for k, v in leaves.items():
            if np.shape(v) != out[k].shape[1:]:
                raise CheckpointError(
                    f"{what}: expert {e} has {k} of shape {list(np.shape(v))}, expert 0 "
                    f"{list(out[k].shape[1:])}"
                )
            out[k][e] = np.asarray(v)
        del w, leaves
    assert out is not None and cls is not None
    return cls(**out)


def convert_stacked(
    ckpt: SafetensorsCheckpoint,
    srcs: Sequence[SourceWeight],
    fmt: WeightFormat | None,
    *,
    what: str,
) -> Weight:
    """Per-expert projections ``[N, K]`` -> one stacked ``[E, N, K]`` weight."""
    return stack_weights([lambda s=s: convert_weight(ckpt, s, fmt) for s in srcs], what=what)


def convert_packed_slices(
    ckpt: SafetensorsCheckpoint,
    info: TensorInfo,
    *,
    rows: tuple[int, int],
    fmt: WeightFormat | None,
) -> Weight:
    """Rows ``[r0, r1)`` of every expert of a float packed tensor ``[E, R, K]`` -> ``[E, r1-r0, K]``.

    Each expert's rows are contiguous in the file and are read on their own, one expert at a
    time, so the packed tensor is never held whole.
    """
    if info.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{info.name} ({info.file.name}): packed experts stored {info.dtype}; only float "
            "(BF16/F16/F32) packed experts are supported"
        )
    num, total_rows, k = info.shape
    r0, r1 = rows

    def one(e: int) -> Weight:
        part = np.empty((r1 - r0, k), info.np_dtype)
        ckpt.read_flat(info.name, (e * total_rows + r0) * k, part)
        if fmt is None or (fmt is WeightFormat.BF16 and info.dtype == "BF16"):
            return Bf16Weight(w=part.astype(ml_dtypes.bfloat16, copy=False))
        return _quantize_float(part, fmt, info.name)

    return stack_weights([lambda e=e: one(e) for e in range(num)], what=info.name)


def read_embedding(ckpt: SafetensorsCheckpoint, name: str) -> np.ndarray:
    """An embedding table ``[V, H]`` as BF16 (rounded from its F32 value when stored otherwise)."""
    return convert_weight(ckpt, detect(ckpt, name), WeightFormat.BF16).w
