"""A fine-tuned head written back: its MTP tensors in the Hugging Face layout of the source
directory (so ``mtpjax demo --model`` and ``mtpjax.pretrained.load`` read it as they read the
source), then converted into the converter's orbax format (``mtpjax.checkpoint.convert``).

A single-file source (``model.safetensors``, as the shipped pair) is rewritten whole, every
other tensor as stored; a sharded source keeps its shards (linked, not copied) and gets one new
shard holding the MTP tensors, which the rewritten index maps them to (a source written here
has that shard already: it is rewritten, not linked). Every small non-weight file of the source
(``config.json``, ``tokenizer.json``, ``heldout_files.txt``) is copied, so ``out`` reads as the
source does and can itself be the source of a further fine-tune.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.checkpoint import CheckpointError, SafetensorsCheckpoint, convert
from mtpjax.config import DrafterConfig
from mtpjax.drafter._params import DrafterParams, from_named, module_leaves
from mtpjax.weights import Bf16Weight

__all__ = ["hf_tensors", "write_model_dir"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MTP_SHARD = "model-mtp-finetuned.safetensors"
_SMALL_FILE = 64 << 20  # non-weight files (config, tokenizer, split lists) are copied


class _Name(str):
    """A checkpoint name standing in for a leaf in ``from_named`` (a pytree leaf)."""


def hf_tensors(params: DrafterParams, cfg: DrafterConfig) -> dict[str, np.ndarray]:
    """Checkpoint name (``module_leaves`` + ``.weight``) -> the head's BF16 tensor, module 0."""
    names = from_named({n: _Name(n) for n, _ in module_leaves(cfg, 0)}, cfg)
    out: dict[str, np.ndarray] = {}

    def put(name: _Name, value) -> None:
        w = value.w if isinstance(value, Bf16Weight) else value
        if not hasattr(w, "dtype"):
            raise TypeError(f"{name}: only BF16 weights are written, got {type(value).__name__}")
        out[name + ".weight"] = np.asarray(jax.device_get(w))

    jax.tree.map(put, names, params, is_leaf=lambda x: isinstance(x, _Name))
    return out


def _save(path: Path, tensors: dict[str, Any]) -> None:
    from safetensors.flax import save_file  # BF16, which safetensors' numpy API cannot type

    arrays = {k: jnp.asarray(v) for k, v in sorted(tensors.items())}
    save_file(arrays, str(path), metadata={"format": "pt"})


def write_model_dir(
    source: Path,
    out: Path,
    params: DrafterParams,
    cfg: DrafterConfig,
    *,
    drafter_out: Path | None = None,
) -> dict[str, int]:
    """Writes ``out`` (a Hugging Face directory: the source's files with the head's tensors
    replaced; each must exist in the source under its name, in the same shape) and, when
    ``drafter_out`` is given, converts it there at BF16. Returns {name: elements} written."""
    tensors = hf_tensors(params, cfg)
    ckpt = SafetensorsCheckpoint(source)
    for name, value in tensors.items():
        if name not in ckpt:
            raise CheckpointError(f"{source}: no tensor {name!r} to write the fine-tuned head into")
        shape = tuple(ckpt.info(name).shape)
        if shape != value.shape:
            raise CheckpointError(f"{name}: fine-tuned shape {value.shape}, source {shape}")
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        weights = f.name.endswith(".safetensors") or f.name == INDEX
        if f.is_file() and not weights and f.stat().st_size <= _SMALL_FILE:
            shutil.copy2(f, out / f.name)
    from safetensors.flax import load_file  # BF16, as _save

    if ckpt.source == SINGLE:
        full = load_file(str(source / SINGLE))
        _save(out / SINGLE, full | tensors)
    else:
        index = json.loads((source / INDEX).read_text())
        head_shard = tensors
        for shard in ckpt.shards:
            link = out / shard
            if link.exists() or link.is_symlink():
                link.unlink()
            if shard == MTP_SHARD:
                # A source this function wrote (a fine-tuned head fine-tuned again): its head
                # shard is rewritten into ``out``, never linked, so the source's is never written.
                head_shard = load_file(str(source / shard)) | tensors
                continue
            os.symlink((source / shard).resolve(), link)
        _save(out / MTP_SHARD, head_shard)
        index["weight_map"] = index["weight_map"] | dict.fromkeys(tensors, MTP_SHARD)
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if drafter_out is not None:
        convert(out, drafter_out, precision="bf16", force=True, progress=False)
    return {k: int(v.size) for k, v in tensors.items()}
