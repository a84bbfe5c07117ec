"""Loading a converted checkpoint: ``load_drafter(path) -> (cfg, params)``.

    cfg, ckpt = load_drafter("out/qwen3-next-mtp")
    out = drafter_forward(ckpt.modules[0], ckpt.head, tokens, hidden, cfg=cfg)

The abstract shape of every leaf is derived from the manifest (for a runnable family checked
against the drafter's description of the config, ``module_leaves``), so orbax restores onto
the requested placement: one ``jax.sharding.Sharding`` for every leaf, or a callable from a
leaf's path (``"modules.0.layer.attention.q_proj.w"``, ``"head.embedding"``; for the named tree
of a non-runnable family ``"model.layers.61.eh_proj.q"``) to a sharding (None = first device).
A leaf shared by several modules (Qwen's ``fc`` and norms) is placed by its first path.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.checkpoint._convert import (
    ARRAY_LEAF,
    FORMAT_VERSION,
    MANIFEST_FILE,
    PARAMS_DIR,
    Manifest,
    TensorRecord,
    content_hash,
)
from mtpjax.checkpoint._formats import weight_class
from mtpjax.checkpoint._layouts import DrafterCheckpoint, assemble
from mtpjax.checkpoint._safetensors_io import CheckpointError
from mtpjax.config import DrafterConfig
from mtpjax.drafter import module_leaves, module_prefix
from mtpjax.weights import Weight, WeightFormat

__all__ = ["ShardingSpec", "load_drafter", "read_manifest"]

ShardingSpec = jax.sharding.Sharding | Callable[[str], jax.sharding.Sharding | None] | None


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of the converted checkpoint in directory ``path``."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_FILE}; not a converted mtpjax checkpoint")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file}: corrupt manifest (not valid JSON: {err})") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format_version {version!r}, this mtpjax reads {FORMAT_VERSION}; "
            "convert the checkpoint again"
        )
    where = "the manifest"
    try:
        fields = {f.name for f in dataclasses.fields(Manifest)}
        missing = sorted(fields - set(data))
        if missing:
            raise KeyError(missing[0])
        for i, record in enumerate(data["tensors"]):
            where = f"tensor record {i} ({record.get('name')!r})"
            TensorRecord.from_json(record)
        where = "the manifest"
        return Manifest.from_json(data)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        what = f"lacks {err.args[0]!r}" if isinstance(err, KeyError) else f"is malformed ({err})"
        raise CheckpointError(f"{file}: {where} {what}") from None


def _build(record: TensorRecord, leaves: Mapping[str, Any]) -> Any:
    """The record's weight (or array) from its leaves: restored arrays, or ShapeDtypeStructs."""
    if record.format is None:
        return leaves[ARRAY_LEAF]
    return weight_class(WeightFormat(record.format))(**leaves)


def _placements(structure: Any, sharding: ShardingSpec) -> dict[int, jax.sharding.Sharding]:
    """``id(ShapeDtypeStruct)`` -> its sharding, each leaf placed by its first path."""
    if not (sharding is None or isinstance(sharding, jax.sharding.Sharding) or callable(sharding)):
        raise TypeError(
            "load_drafter: sharding must be a jax.sharding.Sharding, a callable from a leaf path "
            f"to a Sharding (or None), or None; got {type(sharding).__name__} {sharding!r}"
        )
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed: dict[int, jax.sharding.Sharding] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(structure)[0]:
        if id(leaf) in placed:
            continue
        if sharding is None:
            s = default
        elif isinstance(sharding, jax.sharding.Sharding):
            s = sharding
        else:
            s = sharding(jax.tree_util.keystr(path, simple=True, separator=".")) or default
        placed[id(leaf)] = s
    return placed


_STORE_NAME = re.compile(r'Error reading "([^"/]+)')


def _restore(
    directory: Path,
    target: dict[str, dict[str, jax.ShapeDtypeStruct]],
    groups: Mapping[str, str],
) -> dict:
    """Restores every tensor of ``target`` from its group checkpoint under ``directory``.

    A damaged group raises one ``CheckpointError`` naming it and, where TensorStore says, the
    array it could not read (not TensorStore's multi-line report).
    """
    import orbax.checkpoint as ocp  # deferred: the import is slow and only loading needs it

    by_group: dict[str, list[str]] = {}
    for name in target:
        by_group.setdefault(groups[name], []).append(name)
    restored: dict = {}
    damaged = None
    with ocp.StandardCheckpointer() as checkpointer:
        for group, names in by_group.items():
            path = directory / group
            if not path.is_dir():
                raise CheckpointError(f"{path}: missing; the converted checkpoint is incomplete")
            try:
                restored |= checkpointer.restore(path.resolve(), {n: target[n] for n in names})
            except Exception as err:  # TensorStore / orbax raise bare Exception and ValueError
                damaged = _damaged(path, names, err)
                break
    if damaged is not None:
        gc.collect()  # finalise orbax's abandoned reads now, not noisily at exit
        raise damaged
    return restored


def _check_files(path: Path, files: Mapping[str, int]) -> None:
    """Every file the conversion wrote is there at its size (TensorStore's own report of a
    missing or truncated file is many lines, and leaves its abandoned reads behind)."""
    for name, size in files.items():
        file = path / PARAMS_DIR / name
        found = file.stat().st_size if file.is_file() else None
        if found != size:
            what = "is missing" if found is None else f"holds {found} bytes, expected {size}"
            raise CheckpointError(f"{file}: {what}; the converted checkpoint is damaged")


def _damaged(path: Path, names: list[str], err: BaseException) -> CheckpointError:
    """One line for a restore failure: the innermost cause (TensorStore's own reason), with the
    array it names, instead of orbax's multi-line TensorStore report."""
    chain = [err]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    found = next((m for e in chain if (m := _STORE_NAME.search(str(e)))), None)
    array = f"array {found[1]!r}" if found else f"one of its {len(names)} arrays"
    reason = (str(chain[-1]).strip().splitlines() or [type(chain[-1]).__name__])[0][:300]
    return CheckpointError(
        f"{path}: cannot read {array}: the converted checkpoint is damaged ({reason}); "
        "convert it again"
    )


def _verify(path: Path, record: TensorRecord, leaves: Mapping[str, jax.Array]) -> None:
    for leaf, want in record.sha256.items():
        if content_hash(np.asarray(leaves[leaf])) != want:
            raise CheckpointError(
                f"{path / PARAMS_DIR / record.group}: array {record.name}.{leaf} does not match "
                "the sha256 in its manifest record (the checkpoint is damaged); convert it again"
            )


def _check_twin(manifest: Path, record: TensorRecord, twin: TensorRecord | None) -> None:
    """A ``same_as`` record names a stored one-leaf tensor of its own dtype, shape and sha256."""
    ok = (
        twin is not None
        and twin.same_as is None
        and len(record.leaves) == len(twin.leaves) == 1
        and list(record.leaves.values()) == list(twin.leaves.values())
        and list(record.sha256.values()) == list(twin.sha256.values())
    )
    if not ok:
        raise CheckpointError(
            f"{manifest}: tensor {record.name!r} is recorded as stored under {record.same_as!r}, "
            "which is not a stored tensor of the same dtype, shape and sha256; convert the "
            "checkpoint again"
        )


def _check_described(
    manifest: Path, cfg: DrafterConfig, prefixes: tuple[str, ...], abstract: Mapping[str, Any]
) -> None:
    """The MTP modules were found where the drafter's description of ``cfg`` puts them
    (``prefixes``, the manifest's ``mtp_prefixes``), and every leaf it names is recorded at its
    logical shape (KeyError for a missing record)."""
    described = tuple(module_prefix(cfg, i) for i in range(cfg.num_mtp_modules))
    if tuple(prefixes) != described:
        raise CheckpointError(
            f"{manifest}: MTP modules recorded under {list(prefixes)}, but config.json puts them "
            f"under {list(described)}; convert the checkpoint again"
        )
    for i in range(cfg.num_mtp_modules):
        for name, leaf in module_leaves(cfg, i):
            found = tuple(abstract[name].shape)
            if found != leaf.shape:
                raise CheckpointError(
                    f"{manifest}: tensor {name!r} is recorded as {list(found)}, but config.json "
                    f"gives {list(leaf.shape)} {leaf.what}; convert the checkpoint again"
                )


def load_drafter(
    path: str | os.PathLike,
    *,
    sharding: ShardingSpec = None,
    allow_unrunnable: bool = False,
    mtp_vocab_size: int | None = None,
    verify: bool = True,
) -> tuple[DrafterConfig, DrafterCheckpoint | dict[str, Weight | jax.Array]]:
    """Restores a checkpoint written by ``convert``.

    Args:
      path: the converted checkpoint directory.
      sharding: where the leaves go: a ``jax.sharding.Sharding`` applied to every leaf, a
        callable from leaf path to sharding (None for the default), or None (first device).
      allow_unrunnable: for a family the drafter does not run (DeepSeek-V3.2's sparse
        attention, MiniMax-M2), return its converted tensors by name instead of raising.
      mtp_vocab_size: passed to ``DrafterConfig.from_hf_config`` (a reduced draft vocab).
      verify: check every restored array against the sha256 in the manifest (a host copy and
        a hash of every byte; ``verify=False`` skips it).

    Returns:
      ``(cfg, DrafterCheckpoint)`` for runnable families (``modules[i]`` is MTP module ``i``,
      ``head`` the target's embedding / LM head / final norm), or ``(cfg, {name: weight or
      array})`` for the others with ``allow_unrunnable=True``.
    """
    path = Path(path)
    manifest = read_manifest(path)
    cfg = manifest.drafter_config(mtp_vocab_size=mtp_vocab_size)
    if not cfg.runnable and not allow_unrunnable:
        raise CheckpointError(
            f"{path}: the converted {cfg.architecture.value} checkpoint holds an MTP drafter "
            f"mtpjax cannot run yet: {cfg.unsupported_reason} (load_drafter(..., "
            "allow_unrunnable=True) returns its tensors by name)"
        )
    specs = {
        r.name: {k: jax.ShapeDtypeStruct(shape, jnp.dtype(d)) for k, (d, shape) in r.leaves.items()}
        for r in manifest.tensors
    }
    abstract = {r.name: _build(r, specs[r.name]) for r in manifest.tensors}
    try:
        if cfg.runnable:
            _check_described(path / MANIFEST_FILE, cfg, manifest.mtp_prefixes, abstract)
        structure = assemble(abstract, cfg) if cfg.runnable else abstract
    except KeyError as err:
        raise CheckpointError(
            f"{path / MANIFEST_FILE}: no record of tensor {err.args[0]!r}, which the "
            f"{cfg.architecture.value} drafter needs; convert the checkpoint again"
        ) from None
    placed = _placements(structure, sharding)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {
        name: {
            k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed.get(id(a), default))
            for k, a in leaves.items()
        }
        for name, leaves in specs.items()
    }
    groups = {r.name: r.group for r in manifest.tensors}
    _check_files(path, manifest.files)
    twins = {r.name: r for r in manifest.tensors if r.same_as is not None}
    records = {r.name: r for r in manifest.tensors}
    for record in twins.values():
        _check_twin(path / MANIFEST_FILE, record, records.get(record.same_as))
    stored = {name: t for name, t in target.items() if name not in twins}
    restored = _restore(path / PARAMS_DIR, stored, groups)
    for name, record in twins.items():
        # Stored once, under its twin: placed where this tensor's own leaf goes.
        ((leaf, spec),) = target[name].items()
        (value,) = restored[record.same_as].values()
        restored[name] = {leaf: jax.device_put(value, spec.sharding)}
    if verify:
        for record in manifest.tensors:
            if record.name not in twins:  # a twin's bytes are its stored twin's, checked there
                _verify(path, record, restored[record.name])
    named = {r.name: _build(r, restored[r.name]) for r in manifest.tensors}
    if cfg.runnable:
        return cfg, assemble(named, cfg)
    return cfg, named
