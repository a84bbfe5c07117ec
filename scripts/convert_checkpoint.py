#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint's MTP drafter into an mtpjax checkpoint.

    python scripts/convert_checkpoint.py SRC_DIR OUT_DIR --precision {keep,bf16,fp8,nvfp4} [--force]

SRC_DIR holds config.json and model.safetensors (or shards with model.safetensors.index.json).
Only the MTP modules, the embedding, the LM head and the final norm are read. Exits 0 on success;
otherwise prints one line naming what is wrong and exits 1 (2 for bad arguments, 130 when
interrupted). OUT_DIR is never left half-written.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description="Convert a Hugging Face checkpoint's MTP drafter into an mtpjax checkpoint.",
    )
    p.add_argument("src", metavar="SRC_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("out", metavar="OUT_DIR", help="directory to create")
    p.add_argument(
        "--precision",
        default="keep",
        type=str.lower,
        choices=["keep", "bf16", "fp8", "nvfp4", "fp4"],
        help="keep the native per-tensor formats, or requantise the projections (default keep)",
    )
    p.add_argument(
        "--head-precision",
        default=None,
        type=str.lower,
        choices=["keep", "bf16", "fp8", "nvfp4", "fp4"],
        help="precision of the LM head (default: the same as --precision)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from mtpjax.checkpoint import convert

        manifest = convert(
            args.src,
            args.out,
            precision=args.precision,
            head_precision=args.head_precision,
            force=args.force,
            progress=not args.quiet,
        )
    except KeyboardInterrupt:
        print("convert_checkpoint: interrupted; nothing was written", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:
        print(f"convert_checkpoint: error: {_one_line(err)}", file=sys.stderr)
        return 1
    status = "runnable" if manifest.runnable else f"not runnable yet: {manifest.unsupported_reason}"
    print(
        f"converted {manifest.architecture} ({manifest.num_mtp_modules} MTP module"
        f"{'s' if manifest.num_mtp_modules != 1 else ''}, {len(manifest.tensors)} tensors, "
        f"precision {manifest.precision}) to {args.out}; drafter {status}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
