"""Checkpoint I/O: convert a Hugging Face checkpoint's MTP drafter, and load the result.

    manifest = checkpoint.convert("Qwen3-Next-80B-A3B", "out/mtp", precision="keep")
    cfg, ckpt = checkpoint.load_drafter("out/mtp")        # ckpt.modules[i], ckpt.head

``convert`` reads only the MTP modules, the embedding, the LM head and the final norm, lazily
and tensor by tensor (``safetensors_io``); ``layouts`` says which source tensors make which
drafter leaf per family; ``formats`` detects each tensor's format from its own dtype and
companions and requantises on request. The command-line entry point is
``scripts/convert_checkpoint.py``.
"""

from mtpjax.checkpoint.convert import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    PARAMS_DIR,
    Manifest,
    TensorRecord,
    convert,
)
from mtpjax.checkpoint.formats import SourceFormat, parse_target_precision
from mtpjax.checkpoint.layouts import DrafterCheckpoint, assemble
from mtpjax.checkpoint.load import ShardingSpec, load_drafter, read_manifest
from mtpjax.checkpoint.safetensors_io import (
    CheckpointError,
    SafetensorsCheckpoint,
    SafetensorsFile,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "PARAMS_DIR",
    "CheckpointError",
    "DrafterCheckpoint",
    "Manifest",
    "SafetensorsCheckpoint",
    "SafetensorsFile",
    "ShardingSpec",
    "SourceFormat",
    "TensorRecord",
    "assemble",
    "convert",
    "load_drafter",
    "parse_target_precision",
    "read_manifest",
]
