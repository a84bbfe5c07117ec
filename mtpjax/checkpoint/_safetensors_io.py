"""Lazy, per-tensor reading of Hugging Face safetensors checkpoints, without torch.

A checkpoint directory holds either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). Only the
index (or the single file's header) is read up front; a shard's header is parsed the first time
one of its tensors is asked for, and each tensor is read on its own from its byte range into a
fresh numpy buffer. Nothing is memory-mapped, so the process holds only the tensors it keeps,
never the page cache of the shards it skips.

The file format: 8 bytes little-endian ``u64`` header length ``n``; ``n`` bytes of JSON mapping
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
end of the header) plus an optional ``"__metadata__"``; then the data. BF16 and FP8 tensors are
viewed through ``ml_dtypes`` (numpy itself has neither).

Headers are held to the format: no duplicate keys, dims and offsets non-negative integers, each
byte range the size its shape and dtype need, and the ranges tiling the data section exactly (no
overlap, no gap, nothing past the end). Every float tensor read is checked for inf / NaN.
Every failure raises ``CheckpointError`` naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "SafetensorsCheckpoint",
    "SafetensorsFile",
    "TensorInfo",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# A header beyond this is not a real checkpoint's (the largest published ones are a few MB);
# refusing it keeps a corrupt length field from allocating gigabytes.
_MAX_HEADER_BYTES = 256 * 1024 * 1024

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


class CheckpointError(ValueError):
    """A checkpoint cannot be read, converted or loaded; the one-line message names the file,
    the tensor, and the expected and found values."""


_FLOAT_NAMES = frozenset(k for k in DTYPES if k.startswith(("F", "BF")))


def _check_finite(info: TensorInfo, start: int, values: np.ndarray) -> None:
    """Rejects inf / NaN in what was read of a float tensor (elements ``start ..``): quantising
    one turns a whole row (FP8) or matrix (NVFP4) into NaN, or silently into 0."""
    bad = ~np.isfinite(values.reshape(-1))
    if bad.any():
        first = np.unravel_index(start + int(np.argmax(bad)), info.shape)
        whole = start == 0 and values.size == math.prod(info.shape)
        where = "" if whole else f" among elements [{start}, {start + values.size})"
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} holds {int(bad.sum())} non-finite values (inf or "
            f"NaN){where}, the first at index {[int(i) for i in first]}"
        )


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json`` object hook: a key given twice is an error (the format forbids it), not "last
    one wins"."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One tensor's header entry: safetensors dtype name, shape and absolute byte range."""

    name: str
    file: Path
    dtype: str  # safetensors name: "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """The parsed header of one ``.safetensors`` file; tensors are read on demand.

    The header is checked against the file as a whole: a file shorter than its header says
    (truncated), a header that is not JSON, an unknown dtype, or a byte range that does not
    match its shape all raise ``CheckpointError`` naming the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def _parse(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail(
                        f"not a safetensors file: {size} bytes, shorter than the 8-byte header "
                        "length (truncated or empty)"
                    )
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER_BYTES:
                    raise self._fail(
                        f"corrupt safetensors file: header length field says {n} bytes"
                    )
                if 8 + n > size:
                    raise self._fail(
                        f"truncated safetensors file: the header needs {8 + n} bytes but the "
                        f"file holds {size}"
                    )
                raw = f.read(n)
        except FileNotFoundError:
            raise self._fail("no such file") from None
        except OSError as err:
            raise self._fail(f"cannot read: {err.strerror or err}") from None
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._fail(f"corrupt safetensors header (not valid JSON: {err})") from None
        except _DuplicateKey as err:
            raise self._fail(
                f"corrupt safetensors header: key {err.args[0]!r} appears twice"
            ) from None
        if not isinstance(header, dict):
            raise self._fail("corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        data_start, data_size = 8 + n, size - 8 - n
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry, data_start, data_size)
        # The format forbids holes and overlaps: the data section is exactly the tensors' byte
        # ranges laid end to end (so no two tensors alias, and no bytes hide between them).
        end = 0
        for info in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if info.begin - data_start != end:
                what = (
                    "overlaps the tensor before it"
                    if info.begin - data_start < end
                    else (f"leaves a gap of {info.begin - data_start - end} bytes before it")
                )
                raise self._fail(
                    f"corrupt safetensors header: tensor {info.name!r} data_offsets "
                    f"[{info.begin - data_start}, {info.end - data_start}] {what}"
                )
            end = info.end - data_start
        if end != data_size:
            raise self._fail(
                f"corrupt safetensors file: the tensors cover {end} bytes of a data section of "
                f"{data_size} (trailing bytes the header does not describe)"
            )

    def _entry(self, name: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise self._fail(
                f"corrupt safetensors header: entry {name!r} lacks dtype/shape/data_offsets"
            )
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise self._fail(
                f"tensor {name!r} has dtype {dtype!r}, which this reader does not know "
                f"(known: {', '.join(DTYPES)})"
            )
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self._fail(
                f"corrupt safetensors header: tensor {name!r} has shape {shape!r}, expected a "
                "list of non-negative integers"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise self._fail(
                f"corrupt safetensors header: tensor {name!r} has data_offsets {offsets!r}, "
                "expected [begin, end] non-negative integers"
            )
        begin, end = offsets
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != want:
            raise self._fail(
                f"corrupt safetensors header: tensor {name!r}: shape {shape} of {dtype} needs "
                f"{want} bytes, data_offsets [{begin}, {end}] span {end - begin}"
            )
        if end > data_size:
            raise self._fail(
                f"truncated safetensors file: tensor {name!r} ends at byte {data_start + end} "
                f"but the file holds {data_start + data_size} bytes"
            )
        return TensorInfo(
            name=name,
            file=self.path,
            dtype=dtype,
            shape=tuple(shape),
            begin=data_start + begin,
            end=data_start + end,
        )

    def read(self, name: str) -> np.ndarray:
        """The whole tensor ``name`` as a numpy array in a fresh buffer."""
        info = self._info(name)
        out = np.empty(info.shape, info.np_dtype)
        self._read_into(info, 0, out)
        return out

    def read_flat(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        """Elements ``start .. start + out.size`` of the flattened tensor, read into ``out``.

        ``out`` is a C-contiguous array of the tensor's dtype (any shape), e.g. one expert's
        slice of a stacked buffer: a packed ``[E, 2I, H]`` tensor's gate rows of expert ``e``
        are the contiguous elements ``e * 2I * H .. (e * 2I + I) * H``.
        """
        info = self._info(name)
        if out.dtype != info.np_dtype:
            raise self._fail(f"tensor {name!r} is {info.dtype}, cannot read it into {out.dtype}")
        total = math.prod(info.shape)
        if start < 0 or start + out.size > total:
            raise self._fail(
                f"elements [{start}, {start + out.size}) are outside tensor {name!r} of "
                f"{total} elements"
            )
        self._read_into(info, start * info.np_dtype.itemsize, out)
        return out

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise self._fail(f"has no tensor {name!r}")
        return info

    def _read_into(self, info: TensorInfo, offset: int, out: np.ndarray) -> None:
        if not out.flags.c_contiguous:
            raise ValueError("reads need a C-contiguous output buffer")
        view = memoryview(out.reshape(-1).view(np.uint8))
        nbytes = out.nbytes
        done = 0
        fd = self._descriptor()
        while done < nbytes:
            try:
                got = os.preadv(fd, [view[done:]], info.begin + offset + done)
            except OSError as err:
                raise self._fail(
                    f"cannot read tensor {info.name!r}: {err.strerror or err}"
                ) from None
            if got == 0:
                raise self._fail(
                    f"truncated safetensors file: tensor {info.name!r} stops after "
                    f"{offset + done} of {info.nbytes} bytes"
                )
            done += got
        if info.dtype in _FLOAT_NAMES:
            _check_finite(info, offset // info.np_dtype.itemsize, out)

    def _descriptor(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as err:
                raise self._fail(f"cannot open: {err.strerror or err}") from None
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafetensorsCheckpoint:
    """A checkpoint directory: tensor names from the index, shards opened on first use.

    ``names`` lists every tensor the checkpoint declares (from the index's ``weight_map``, or
    the single file's header). ``info(name)`` and ``read(name)`` open the owning shard lazily;
    a name the index lists but the shard lacks raises ``CheckpointError`` naming both.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        self._files: dict[str, SafetensorsFile] = {}
        if index.is_file():
            self.source = INDEX_FILE
            self._weight_map = self._load_index(index)
        elif single.is_file():
            self.source = SINGLE_FILE
            self._files[SINGLE_FILE] = SafetensorsFile(single)
            self._weight_map = dict.fromkeys(self._files[SINGLE_FILE].tensors, SINGLE_FILE)
        else:
            raise CheckpointError(
                f"{self.directory}: no {INDEX_FILE} and no {SINGLE_FILE}: not a safetensors "
                "checkpoint directory"
            )

    @staticmethod
    def _load_index(path: Path) -> dict[str, str]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: not valid JSON ({err})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{path}: expected a JSON object with a 'weight_map' of tensor name -> shard file"
            )
        for shard in set(weight_map.values()):
            if Path(shard).name != shard:
                raise CheckpointError(f"{path}: shard {shard!r} is not a plain file name")
        return dict(weight_map)

    @property
    def names(self) -> list[str]:
        return list(self._weight_map)

    @property
    def shards(self) -> list[str]:
        """The shard file names (the single file's name when there is no index)."""
        return sorted(set(self._weight_map.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def shard_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.directory / self.source}: no tensor {name!r}") from None

    def _file(self, shard: str) -> SafetensorsFile:
        f = self._files.get(shard)
        if f is None:
            path = self.directory / shard
            if not path.is_file():
                raise CheckpointError(
                    f"{self.directory / self.source} lists shard {shard!r}, which does not exist "
                    f"in {self.directory}"
                )
            f = self._files[shard] = SafetensorsFile(path)
        return f

    def _owner(self, name: str) -> SafetensorsFile:
        """The shard holding ``name``; naming the index and the shard when it lacks the tensor."""
        shard = self.shard_of(name)
        f = self._file(shard)
        if name not in f.tensors:
            raise CheckpointError(
                f"{self.directory / self.source} maps {name!r} to {shard!r}, but that file has "
                "no such tensor"
            )
        return f

    def info(self, name: str) -> TensorInfo:
        return self._owner(name).tensors[name]

    def read(self, name: str) -> np.ndarray:
        """The whole tensor ``name`` (a fresh numpy buffer)."""
        return self._owner(name).read(name)

    def read_flat(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        """Part of tensor ``name`` read into ``out`` (see ``SafetensorsFile.read_flat``)."""
        return self._owner(name).read_flat(name, start, out)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
