"""Checkpoint I/O: convert a Hugging Face checkpoint's MTP drafter, and load the result.

    manifest = checkpoint.convert("Qwen3-Next-80B-A3B", "out/mtp", precision="keep")
    cfg, ckpt = checkpoint.load_drafter("out/mtp")        # ckpt.modules[i], ckpt.head

``convert`` reads only the MTP modules, the embedding, the LM head and the final norm, lazily
and tensor by tensor, from a safetensors reader that checks every header against the format
(no overlapping, gapped or out-of-range byte ranges, no duplicate keys) and every float tensor
for inf / NaN; ``_layouts`` says which source tensors make which drafter leaf per family;
``_formats`` detects each tensor's format from its own dtype and companions and requantises on
request. ``load_drafter`` checks each array against the sha256 its manifest records.
``convert_main`` is the command line (``mtpjax convert``, ``scripts/convert_checkpoint.py``).
Every failure is one ``CheckpointError`` line naming the file, tensor, expected and found value.
"""

from mtpjax.checkpoint._cli import main as convert_main
from mtpjax.checkpoint._convert import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    PARAMS_DIR,
    ConversionInterrupted,
    Manifest,
    TensorRecord,
    convert,
)
from mtpjax.checkpoint._formats import PRECISIONS, SourceFormat, parse_target_precision
from mtpjax.checkpoint._layouts import DrafterCheckpoint, assemble
from mtpjax.checkpoint._load import ShardingSpec, load_drafter, read_manifest
from mtpjax.checkpoint._safetensors_io import (
    CheckpointError,
    SafetensorsCheckpoint,
    SafetensorsFile,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "PARAMS_DIR",
    "PRECISIONS",
    "CheckpointError",
    "ConversionInterrupted",
    "DrafterCheckpoint",
    "Manifest",
    "SafetensorsCheckpoint",
    "SafetensorsFile",
    "ShardingSpec",
    "SourceFormat",
    "TensorRecord",
    "assemble",
    "convert",
    "convert_main",
    "load_drafter",
    "parse_target_precision",
    "read_manifest",
]
