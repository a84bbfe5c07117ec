"""Hugging Face checkpoint -> converted drafter checkpoint (orbax tensors + ``manifest.json``).

    manifest = convert("Qwen3-Next-80B-A3B", "out/qwen3-next-mtp", precision="nvfp4")

Only the MTP modules, the embedding, the LM head and the final norm are read, tensor by tensor
from their byte ranges, and converted tensors are saved group by group, so the process holds
about one group and the tensor in hand, nothing of the target's body (an 80B checkpoint converts
on a 24 GiB machine). Each projection's format is detected from its own tensors (``_formats``);
``precision="keep"`` keeps them bit for bit, other precisions
requantise per ``mtpjax.weights.projection_format`` (the LM head at ``head_precision``, by
default the same; the embedding is always BF16).

Output directory:
  manifest.json   format version, the source ``config.json`` (so the loader rebuilds the
                  ``DrafterConfig``), precision, layout, runnable flag and reason, and per tensor
                  its source name(s), source format, stored format, logical shape, leaves and
                  each leaf's sha256; the size of every file under ``params/``.
  params/NNNN/    orbax checkpoints of ``{name: {leaf: array}}`` (weights: their pytree
                  fields ``w`` / ``q, scale`` / ``q, scale_inv`` / ``packed, scale, scale_2``;
                  arrays and embeddings: ``value``), of about 128 MiB, written while the
                  conversion runs so the process never holds more than one group at a time
                  (orbax copies what it saves); each tensor's record names its group.

The output is staged beside ``out`` and renamed into place (``_Staging``), so a failed or
interrupted conversion leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from mtpjax.checkpoint._formats import (
    SourceFormat,
    check_dtype,
    convert_packed_slices,
    convert_stacked,
    convert_weight,
    describe_precision,
    detect,
    parse_target_precision,
    read_embedding,
    target_format,
    weight_leaves,
)
from mtpjax.checkpoint._layouts import Assembly, Entry, EntryKind, Plan, plan
from mtpjax.checkpoint._safetensors_io import CheckpointError, SafetensorsCheckpoint
from mtpjax.config import DrafterConfig, FfnKind, load_hf_config
from mtpjax.weights import Precision, Weight, WeightFormat

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "PARAMS_DIR",
    "ConversionInterrupted",
    "Manifest",
    "TensorRecord",
    "content_hash",
    "convert",
]

FORMAT_VERSION = 3  # 2: per-leaf sha256 in every tensor record; 3: a tied head stored once
MANIFEST_FILE = "manifest.json"
PARAMS_DIR = "params"
QUANT_CONFIG_FILE = "hf_quant_config.json"
ARRAY_LEAF = "value"  # the one leaf of an array or embedding entry
# Converted tensors are saved in orbax checkpoints of about this size (see _GroupWriter).
GROUP_BYTES = 128 * 1024 * 1024
# Without a terminal, progress is one log line per this many source tensors or seconds.
LOG_EVERY_TENSORS, LOG_EVERY_S = 64, 5.0

log = logging.getLogger("mtpjax.checkpoint")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorRecord:
    """One converted tensor in the manifest.

    Attributes:
      name: its name in the converted checkpoint.
      kind: ``weight`` | ``array`` | ``embedding``.
      sources: the source tensors it was read from.
      source_format: how the source stored it (``bf16``, ``fp8_block``, ``nvfp4``... for
        projections; the lower-case safetensors dtype for arrays).
      format: its stored weight format (``bf16 | fp8 | fp8_block | nvfp4``), None for arrays.
      shape: logical shape (``[..., N, K]`` for weights).
      leaves: each stored leaf's ``(dtype name, shape)``.
      group: the orbax checkpoint under ``params/`` that holds it.
      sha256: each stored leaf's ``content_hash``, checked by ``load_drafter(verify=True)``.
      same_as: the earlier record whose one stored leaf equals this one's one leaf bit for bit
        (a tied head kept at the embedding's BF16): the leaf is stored once, under that record.
    """

    name: str
    kind: str
    sources: tuple[str, ...]
    source_format: str
    format: str | None
    shape: tuple[int, ...]
    leaves: Mapping[str, tuple[str, tuple[int, ...]]]
    group: str = ""
    sha256: Mapping[str, str] = dataclasses.field(default_factory=dict)
    same_as: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        leaves = {k: {"dtype": d, "shape": list(s)} for k, (d, s) in self.leaves.items()}
        return data | dict(sources=list(self.sources), shape=list(self.shape), leaves=leaves)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorRecord:
        return cls(
            name=data["name"],
            kind=data["kind"],
            sources=tuple(data["sources"]),
            source_format=data["source_format"],
            format=data["format"],
            shape=tuple(data["shape"]),
            leaves={k: (v["dtype"], tuple(v["shape"])) for k, v in data["leaves"].items()},
            group=data["group"],
            sha256=dict(data["sha256"]),
            same_as=data["same_as"],
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a converted checkpoint holds; written as ``manifest.json``.

    ``files`` lets the loader name a missing or truncated file before TensorStore meets it.
    ``config`` is the source ``config.json`` (``DrafterConfig.from_hf_config(config)`` rebuilds
    the drafter config); ``quant_config`` is the source ``hf_quant_config.json``, recorded for
    reference only (formats were detected per tensor).
    """

    format_version: int
    architecture: str
    num_mtp_modules: int
    runnable: bool
    unsupported_reason: str | None
    precision: str
    head_precision: str
    layout: str
    tied_embeddings: bool
    mtp_prefixes: tuple[str, ...]
    source: str
    config: Mapping[str, Any]
    quant_config: Mapping[str, Any] | None
    tensors: tuple[TensorRecord, ...]
    files: Mapping[str, int]  # every file under params/ -> its size in bytes

    def tensor(self, name: str) -> TensorRecord:
        for record in self.tensors:
            if record.name == name:
                return record
        raise KeyError(f"the manifest has no tensor {name!r}")

    def drafter_config(self, *, mtp_vocab_size: int | None = None) -> DrafterConfig:
        return DrafterConfig.from_hf_config(dict(self.config), mtp_vocab_size=mtp_vocab_size)

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["mtp_prefixes"] = list(self.mtp_prefixes)
        data["tensors"] = [t.to_json() for t in self.tensors]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        fields = dict(data)
        fields["mtp_prefixes"] = tuple(fields["mtp_prefixes"])
        fields["tensors"] = tuple(TensorRecord.from_json(t) for t in fields["tensors"])
        return cls(**fields)


# --------------------------------------------------------------------------------------------
# Converting one entry.


def _leaf_record(a: Any) -> tuple[str, tuple[int, ...]]:
    return (np.dtype(a.dtype).name, tuple(int(d) for d in np.shape(a)))


_NVFP4_NOTE = " (logical; NVFP4 packs 2 codes per byte)"


def _shape_error(
    name: str, file: str, expected: tuple[int, ...], what: str, found: Any, note: str = ""
) -> CheckpointError:
    from_cfg = f" ({what} from config.json)" if what else ""
    return CheckpointError(
        f"{name} ({file}): expected shape {list(expected)}{from_cfg}, found {list(found)}{note}"
    )


def _weight_format(
    entry: Entry, cfg: DrafterConfig, target: WeightFormat | None, head: WeightFormat | None
) -> WeightFormat | None:
    if entry.head or target is None:
        return head if entry.head else None
    return target_format(entry.role, target, dense_ffn=cfg.ffn is FfnKind.DENSE)


def _convert_weight_entry(
    ckpt: SafetensorsCheckpoint, entry: Entry, fmt: WeightFormat | None
) -> tuple[Weight, str]:
    """-> (the weight, its source format name)."""
    expected = entry.shape
    if entry.assembly is Assembly.SINGLE:
        src = detect(ckpt, entry.sources[0])
        if expected is not None and tuple(src.shape) != expected:
            note = _NVFP4_NOTE if src.format is SourceFormat.NVFP4 else ""
            raise _shape_error(
                src.name, src.weight.file.name, expected, entry.what, src.shape, note
            )
        return convert_weight(ckpt, src, fmt), src.format.value
    if entry.assembly is Assembly.STACK:
        srcs = [detect(ckpt, name) for name in entry.sources]
        for src in srcs:
            if tuple(src.shape) != tuple(srcs[0].shape) or (
                expected is not None and tuple(src.shape) != expected[1:]
            ):
                want = expected[1:] if expected is not None else srcs[0].shape
                raise _shape_error(
                    src.name,
                    src.weight.file.name,
                    tuple(want),
                    entry.what and f"one expert of {entry.what}",
                    src.shape,
                )
        formats = sorted({s.format.value for s in srcs})
        return convert_stacked(ckpt, srcs, fmt, what=entry.name), "+".join(formats)
    info = ckpt.info(entry.sources[0])
    if entry.assembly is Assembly.PACKED:
        want = expected
        rows = (0, expected[1])
    else:
        E, I, H = expected
        want = (E, 2 * I, H)
        rows = (0, I) if entry.assembly is Assembly.PACKED_GATE else (I, 2 * I)
    if info.shape != want:
        what = entry.what
        if entry.assembly is not Assembly.PACKED:
            what = "[num_experts, 2 * moe_intermediate_size, hidden_size], gate rows first"
        raise _shape_error(info.name, info.file.name, want, what, info.shape)
    return convert_packed_slices(ckpt, info, rows=rows, fmt=fmt), info.dtype.lower()


def _convert_entry(
    ckpt: SafetensorsCheckpoint,
    entry: Entry,
    cfg: DrafterConfig,
    target: WeightFormat | None,
    head_target: WeightFormat | None,
) -> tuple[Any, TensorRecord]:
    if entry.kind is EntryKind.WEIGHT:
        fmt = _weight_format(entry, cfg, target, head_target)
        value, source_format = _convert_weight_entry(ckpt, entry, fmt)
        stored_format = value.format.value
    else:
        name = entry.sources[0]
        info = ckpt.info(name)
        if entry.shape is not None and info.shape != entry.shape:
            note = _NVFP4_NOTE if info.dtype == "U8" else ""
            raise _shape_error(name, info.file.name, entry.shape, entry.what, info.shape, note)
        if entry.kind is EntryKind.EMBEDDING:
            value = read_embedding(ckpt, name)
        else:
            check_dtype(info, "norm, bias or other array")
            value = ckpt.read(name)
        source_format, stored_format = info.dtype.lower(), None
    record = TensorRecord(
        name=entry.name,
        kind=entry.kind.value,
        sources=entry.sources,
        source_format=source_format,
        format=stored_format,
        shape=tuple(value.shape),
        leaves={k: _leaf_record(v) for k, v in _stored_leaves(value).items()},
    )
    return value, record


def _stored_leaves(value: Any) -> dict[str, Any]:
    if isinstance(value, np.ndarray):
        return {ARRAY_LEAF: value}
    return weight_leaves(value)


# --------------------------------------------------------------------------------------------
# Paths and the atomic write.


def _check_paths(src: Path, out: Path, force: bool, sources: list[Path]) -> None:
    """``out`` must not be, hold or lie inside the source directory or any file it reads (the
    shards may be symlinks elsewhere, as in the Hugging Face cache), nor be an existing file."""
    target = out.resolve()
    for path in [src, *sources]:
        real = path.resolve()
        relation = (
            "is"
            if target == real
            else "holds"
            if real.is_relative_to(target)
            else "lies inside"
            if target.is_relative_to(real)
            else None
        )
        if relation:
            raise CheckpointError(
                f"{out} {relation} the source checkpoint {path}; refusing to write there "
                "(choose an output directory outside the source)"
            )
    if out.is_file() or (out.is_symlink() and not out.is_dir()):
        raise CheckpointError(f"{out} is an existing file; the output must be a directory")
    if (out.exists() or out.is_symlink()) and not force:
        raise CheckpointError(
            f"{out} already exists; refusing to overwrite it (pass force=True, or --force "
            "on the command line, to replace it)"
        )
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise CheckpointError(f"{out}: {parent} is a file, not a directory")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _save_params(directory: Path, tree: Mapping[str, Mapping[str, Any]]) -> None:
    import orbax.checkpoint as ocp  # deferred: only the write needs it

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory.resolve(), dict(tree))
        checkpointer.wait_until_finished()


def content_hash(a: Any) -> str:
    """The sha256 of an array's C-order bytes (the manifest's per-leaf ``sha256``)."""
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).reshape(-1)).hexdigest()


class _GroupWriter:
    """Saves converted tensors in orbax checkpoints of about ``budget`` bytes, as they come.

    Orbax copies every array it saves; saving a group at a time (and dropping it) bounds the
    process to about twice one group (or twice the largest tensor), instead of every kept
    tensor twice over. A one-leaf tensor equal to one already written (a tied head at the
    embedding's precision) is recorded ``same_as`` that one and not written again.
    """

    def __init__(self, directory: Path, budget: int) -> None:
        self.directory, self.budget = directory, budget
        self.pending: dict[str, dict[str, Any]] = {}
        self.pending_bytes = 0
        self.count = 0
        self.one_leaf: dict[tuple, TensorRecord] = {}  # (dtype, shape, sha256) -> its record

    @property
    def group(self) -> str:
        return f"{self.count:04d}"

    def add(self, record: TensorRecord, value: Any) -> TensorRecord:
        """Queues a tensor; saves the group once it reaches the budget (the caller then drops
        its reference, so a large tensor is held only while orbax writes it)."""
        leaves = _stored_leaves(value)
        hashes = {k: content_hash(v) for k, v in leaves.items()}
        if len(leaves) == 1:
            ((leaf, a),) = leaves.items()
            key = (*_leaf_record(a), hashes[leaf])
            if (twin := self.one_leaf.get(key)) is not None:
                return dataclasses.replace(
                    record, group=twin.group, sha256=hashes, same_as=twin.name
                )
        record = dataclasses.replace(record, group=self.group, sha256=hashes)
        if len(leaves) == 1:
            self.one_leaf[key] = record
        self.pending[record.name] = leaves
        self.pending_bytes += sum(np.asarray(v).nbytes for v in leaves.values())
        if self.pending_bytes >= self.budget:
            self.flush()
        return record

    def flush(self) -> None:
        if not self.pending:
            return
        self.directory.mkdir(exist_ok=True)
        _save_params(self.directory / self.group, self.pending)
        self.pending, self.pending_bytes = {}, 0
        self.count += 1


class ConversionInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived during a conversion; ``signum`` says which. Nothing was
    written (the staging directory and the parents the conversion created are removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``ConversionInterrupted`` in the main thread while the block
    runs, so its cleanup (``finally``) runs for both; elsewhere handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise ConversionInterrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _Staging:
    """A temporary directory beside ``out``, renamed into place by ``commit``. On any other
    exit (an error, SIGINT, SIGTERM) it is removed, with every parent directory it created.
    With ``force`` an existing ``out`` is renamed away, the new one renamed in, then the old one
    deleted (restored if the second rename fails)."""

    def __init__(self, out: Path, *, force: bool) -> None:
        self.out, self.force = out, force
        self.path = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.created: list[Path] = []

    def __enter__(self) -> _Staging:
        missing = [p for p in self.out.absolute().parents if not p.exists()]
        for parent in reversed(missing):
            parent.mkdir()
            self.created.append(parent)
        self.path.mkdir()
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if kind is None:
            return
        _remove(self.path)
        for parent in reversed(self.created):
            with contextlib.suppress(OSError):
                parent.rmdir()  # only if still empty

    def commit(self) -> None:
        out = self.out
        if out.exists() or out.is_symlink():
            if not self.force:
                raise CheckpointError(
                    f"{out} appeared during the conversion; refusing to overwrite it"
                )
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            try:
                os.rename(self.path, out)
            except BaseException:
                os.rename(old, out)
                raise
            _remove(old)
        else:
            os.rename(self.path, out)


# --------------------------------------------------------------------------------------------
# The conversion.


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    return data if isinstance(data, dict) else None


def _source_order(ckpt: SafetensorsCheckpoint, entries: tuple[Entry, ...]) -> list[Entry]:
    """Entries in shard order, then by offset, so each shard is read front to back once."""

    def key(entry: Entry) -> tuple[str, int]:
        name = entry.sources[0]
        return (ckpt.shard_of(name), ckpt.info(name).begin)

    return sorted(entries, key=key)


def _file_sizes(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class _Progress:
    """A tqdm bar when stderr is a terminal; otherwise an INFO log line (logger
    ``mtpjax.checkpoint``) every ``LOG_EVERY_TENSORS`` tensors or ``LOG_EVERY_S`` seconds."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        tty = enabled and sys.stderr is not None and sys.stderr.isatty()
        self.bar = tqdm(total=total, desc="converting", unit="tensor") if tty else None
        self.logged_at, self.logged_done = time.monotonic(), 0

    def step(self, name: str, count: int) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)
            self.bar.update(count)
            return
        now = time.monotonic()
        due = (
            self.done - self.logged_done >= LOG_EVERY_TENSORS or now - self.logged_at >= LOG_EVERY_S
        )
        if self.enabled and (due or self.done == self.total):
            log.info("converted %d/%d source tensors (last: %s)", self.done, self.total, name)
            self.logged_at, self.logged_done = now, self.done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    precision: str | Precision | WeightFormat | None = "keep",
    head_precision: str | Precision | WeightFormat | None = None,
    force: bool = False,
    progress: bool = True,
) -> Manifest:
    """Converts the MTP drafter of the HF checkpoint ``src`` into ``out``; returns the manifest.

    Args:
      src: directory with ``config.json`` and ``model.safetensors`` or shards listed by
        ``model.safetensors.index.json`` (``hf_quant_config.json`` is recorded when present).
      out: the directory to create; it must lie outside ``src`` and its files.
      precision: ``keep`` (native formats, bit for bit), or requantise every projection:
        ``bf16``; ``fp8`` (E4M3, one scale per row); ``fp8_block`` (E4M3, one scale per 128x128
        tile, DeepSeek/GLM's native format); ``nvfp4`` (``fp4`` is an alias). The router and
        the shared-expert gate stay BF16, and a dense head asked for NVFP4 keeps
        fc/k_proj/v_proj BF16 (``mtpjax.weights.projection_format``).
      head_precision: the LM head's precision (the same names); None = ``precision``.
      force: replace an existing ``out`` (only once the new one is complete).
      progress: a progress bar on stderr when it is a terminal, else an INFO log line
        (logger ``mtpjax.checkpoint``) every few tensors or seconds.

    Raises:
      CheckpointError (a ValueError) with a one-line reason naming the file, tensor, expected
      and found values: missing MTP weights or an untied LM head, wrong shapes or dtypes,
      non-finite values, truncated or corrupt files, an ``out`` that would overwrite the source
      or exists without ``force``. ``ConversionInterrupted`` (a KeyboardInterrupt) on SIGINT /
      SIGTERM. On every failure nothing is left behind: ``out`` is as it was, and no temporary
      or parent directory the conversion created remains.
    """
    src, out = Path(src), Path(out)
    target = parse_target_precision(precision)
    head_target = target if head_precision is None else parse_target_precision(head_precision)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory (expected a Hugging Face checkpoint)")
    try:
        raw = load_hf_config(src)
        cfg = DrafterConfig.from_hf_config(raw)
    except (ValueError, FileNotFoundError) as err:
        raise CheckpointError(f"{src / 'config.json'}: {err}") from None
    quant_config = _read_json(src / QUANT_CONFIG_FILE)
    records: list[TensorRecord] = []
    with SafetensorsCheckpoint(src) as ckpt:
        sources = [src / "config.json", src / ckpt.source, *(src / f for f in ckpt.shards)]
        _check_paths(src, out, force, sources)
        conversion: Plan = plan(cfg, ckpt, raw)
        entries = _source_order(ckpt, conversion.entries)
        with _signals_raise(), _Staging(out, force=force) as staging:
            writer = _GroupWriter(staging.path / PARAMS_DIR, GROUP_BYTES)
            bar = _Progress(sum(len(e.sources) for e in entries), progress)
            try:
                for entry in entries:
                    value, record = _convert_entry(ckpt, entry, cfg, target, head_target)
                    records.append(writer.add(record, value))
                    del value
                    bar.step(entry.name, len(entry.sources))
            finally:
                bar.close()
            writer.flush()
            order = {e.name: i for i, e in enumerate(conversion.entries)}
            records.sort(key=lambda r: order[r.name])
            manifest = Manifest(
                format_version=FORMAT_VERSION,
                architecture=cfg.architecture.value,
                num_mtp_modules=cfg.num_mtp_modules,
                runnable=cfg.runnable,
                unsupported_reason=cfg.unsupported_reason,
                precision=describe_precision(target),
                head_precision=describe_precision(head_target),
                layout=conversion.layout,
                tied_embeddings=conversion.tied_embeddings,
                mtp_prefixes=conversion.mtp_prefixes,
                source=str(src),
                config=raw,
                quant_config=quant_config,
                tensors=tuple(records),
                files=_file_sizes(staging.path / PARAMS_DIR),
            )
            text = json.dumps(manifest.to_json(), indent=1) + "\n"
            (staging.path / MANIFEST_FILE).write_text(text)
            staging.commit()
    return manifest
