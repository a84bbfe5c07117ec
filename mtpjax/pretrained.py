"""A Hugging Face Qwen3.5 / Qwen3.6 / Qwen3-Next directory, ready for ``mtpjax.generate``.

    model = pretrained.load("Qwen3.5-0.8B", num_drafts=3)  # the MTP head converted once, cached
    ids = model.tokenizer.encode(text).ids
    prompts, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
    spec = mtpjax.generate(model.target, model.drafter, model.head, prompts, lengths,
                           drafter_cfg=model.drafter_cfg, drafter_head=model.drafter_head,
                           head_cfg=model.head_cfg, eos_id=model.eos_id,
                           max_new_tokens=64, num_drafts=3)
    plain = mtpjax.generate_baseline(model.target, model.head, prompts, lengths,
                                     head_cfg=model.head_cfg, eos_id=model.eos_id,
                                     max_new_tokens=64, step_width=3 + 1)

The target is ``mtpjax.hybrid`` (Gated DeltaNet and gated full-attention layers per
``layer_types``), read tensor by tensor from the directory in the formats it stores. The MTP head
is converted by ``mtpjax.checkpoint.convert`` into
``<cache_dir>/<directory name>-<precision>-<content_key>-v<checkpoint format>`` on first use and
loaded from there afterwards. The converter stages its output beside that directory and renames
it into place when complete, so a failed or interrupted conversion leaves nothing in the cache.
``content_key`` changes whenever a file of the checkpoint changes (see there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from mtpjax import hybrid
from mtpjax.checkpoint import FORMAT_VERSION, MANIFEST_FILE, CheckpointError, convert, load_drafter
from mtpjax.config import ConfigView, DrafterConfig, LMHeadConfig, check_int, load_hf_config
from mtpjax.drafter import DrafterParams
from mtpjax.head import LMHeadParams
from mtpjax.target_model import TargetModel
from pallas_kernels.implementation import Implementation

__all__ = [
    "DEFAULT_CACHE_DIR",
    "TOKENIZER_FILE",
    "Pretrained",
    "content_key",
    "converted_drafter",
    "load",
]

DEFAULT_CACHE_DIR = Path("~/.cache/mtpjax")
TOKENIZER_FILE = "tokenizer.json"
# Files whose whole content enters the key; weight files enter by size, mtime and header.
_KEY_FILES = ("config.json", "model.safetensors.index.json", "hf_quant_config.json")
_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on a header


def content_key(directory: str | os.PathLike) -> str:
    """16 hex digits of SHA-256 that change whenever a file of the checkpoint changes.

    Hashes the bytes of ``config.json``, the shard index and ``hf_quant_config.json`` (when
    present), and of each ``*.safetensors`` file its name, size, modification time (ns) and
    header (every tensor's name, dtype, shape and byte range). Reading every weight byte would
    cost minutes for a large checkpoint on every run; a file rewritten in place gets a new
    modification time. Symlinks (the Hugging Face cache's) are followed.
    """
    directory = Path(directory)
    digest = hashlib.sha256()
    for name in _KEY_FILES:
        path = directory / name
        if path.is_file():
            digest.update(f"{name}\0".encode())
            digest.update(path.read_bytes())
    for path in sorted(directory.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(size, _MAX_HEADER_BYTES)))
    return digest.hexdigest()[:16]


def converted_drafter(
    source: str | os.PathLike,
    *,
    precision: str = "keep",
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    progress: bool = True,
) -> tuple[Path, bool]:
    """The MTP head of the checkpoint ``source`` converted at ``precision``: (its directory in
    ``cache_dir``, whether it was there already).

    Converts with ``mtpjax.checkpoint.convert`` on first use. The directory name carries the
    precision, ``content_key(source)`` and the checkpoint format version, so neither a changed
    checkpoint nor an older converter's output is reused. Raises the converter's
    ``CheckpointError`` (one line) for a checkpoint without MTP tensors and every other bad input;
    nothing is then left in ``cache_dir``.
    """
    source = Path(source)
    name = f"{source.resolve().name}-{precision}-{content_key(source)}-v{FORMAT_VERSION}"
    out = Path(cache_dir).expanduser() / name
    if (out / MANIFEST_FILE).is_file():
        return out, True
    try:
        convert(source, out, precision=precision, progress=progress)
    except CheckpointError:
        if not (out / MANIFEST_FILE).is_file():  # not another process finishing first
            raise
        return out, True
    return out, False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pretrained:
    """A loaded checkpoint directory: what ``generate`` / ``generate_baseline`` take.

    Attributes:
      directory: the Hugging Face directory.
      cfg: the target's ``HybridConfig``.
      target: ``hybrid.target_model(cfg, params, head, max_step=num_drafts + 1)``; its params
        are ``(params, head)``.
      head: the target's embedding / LM head (``final_norm`` set), which verifies.
      head_cfg: its static config.
      num_drafts: the most drafts per round the target's state holds snapshots for (and the
        baseline's largest ``step_width`` minus one).
      drafter_cfg, drafter, drafter_head: the MTP head's config, its first module and the head
        it reads (embedding and LM head at the converted precision); None when loaded with
        ``drafter=False``.
      checkpoint: the converted drafter's directory (None without a drafter), and
        checkpoint_reused: whether it was converted by an earlier call.
      tokenizer: the directory's ``tokenizer.json`` (a ``tokenizers.Tokenizer``); None when the
        directory has none.
      eos_id: ``eos_token_id`` from config.json (the first, when it lists several), or None.
    """

    directory: Path
    cfg: hybrid.HybridConfig
    target: TargetModel
    head: LMHeadParams
    head_cfg: LMHeadConfig
    num_drafts: int
    drafter_cfg: DrafterConfig | None
    drafter: DrafterParams | None
    drafter_head: LMHeadParams | None
    checkpoint: Path | None
    checkpoint_reused: bool
    tokenizer: Any
    eos_id: int | None


def _eos_id(raw: dict[str, Any]) -> int | None:
    eos = ConfigView(raw).raw("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def load(
    directory: str | os.PathLike,
    *,
    num_drafts: int = 3,
    drafter: bool = True,
    precision: str = "keep",
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    compute_dtype: str = "float32",
    kv_dtype: jnp.dtype = jnp.float32,
    implementation: Implementation | str = Implementation.AUTO,
    progress: bool = True,
) -> Pretrained:
    """Loads a Qwen3.5 / Qwen3.6 / Qwen3-Next Hugging Face directory (see the module docstring).

    Args:
      directory: ``config.json``, ``model.safetensors`` or shards with their index, and
        optionally ``tokenizer.json``.
      num_drafts: K; the target's steps take up to K + 1 rows (``generate`` with this
        ``num_drafts``, ``generate_baseline`` with ``step_width=num_drafts + 1`` to compare
        token for token).
      drafter: convert (or reuse) and load the MTP head; False loads the target alone, for
        checkpoints without MTP tensors.
      precision: the converted drafter's precision (``mtpjax.checkpoint.convert``): ``keep``
        the stored formats, or ``bf16 | fp8 | fp8_block | nvfp4``.
      cache_dir: where converted drafters are kept.
      compute_dtype: the target's activations before each projection (``HybridConfig``).
      kv_dtype: the target's full-attention KV cache dtype.
      implementation: the target's ``Implementation`` (or its name).
      progress: the converter's progress bar or log lines.

    Raises ValueError (``CheckpointError`` for tensors: one line naming the tensor, the expected
    and the found shape) for anything the directory lacks or holds wrongly; the drafter is
    converted before the target is read, so a checkpoint without MTP tensors fails fast.
    """
    check_int("num_drafts", num_drafts, minimum=1)
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (expected a Hugging Face checkpoint)")
    raw = load_hf_config(directory)
    cfg = hybrid.HybridConfig.from_hf(raw, compute_dtype=compute_dtype)
    checkpoint, reused = None, False
    if drafter:
        checkpoint, reused = converted_drafter(
            directory, precision=precision, cache_dir=cache_dir, progress=progress
        )
    params, head = hybrid.load(directory, cfg=cfg)
    drafter_cfg = mtp = drafter_head = None
    if checkpoint is not None:
        drafter_cfg, ckpt = load_drafter(checkpoint)
        mtp, drafter_head = ckpt.modules[0], ckpt.head
    tokenizer = None
    if (directory / TOKENIZER_FILE).is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    target = hybrid.target_model(
        cfg,
        params,
        head,
        max_step=num_drafts + 1,
        kv_dtype=kv_dtype,
        implementation=implementation,
    )
    return Pretrained(
        directory=directory,
        cfg=cfg,
        target=target,
        head=head,
        head_cfg=cfg.lm_head_config(),
        num_drafts=num_drafts,
        drafter_cfg=drafter_cfg,
        drafter=mtp,
        drafter_head=drafter_head,
        checkpoint=checkpoint,
        checkpoint_reused=reused,
        tokenizer=tokenizer,
        eos_id=_eos_id(raw),
    )
