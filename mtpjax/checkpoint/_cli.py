"""``mtpjax convert SRC OUT``: the converter's command line (``scripts/convert_checkpoint.py``
calls the same ``main``).

Exits 0 on success; otherwise prints one line naming what is wrong and exits 1 (2 for bad
arguments); on SIGINT / SIGTERM prints ``interrupted: nothing was written to OUT`` and exits
130 / 143. OUT is never left half-written.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mtpjax.checkpoint._convert import ConversionInterrupted, convert
from mtpjax.checkpoint._formats import PRECISIONS

__all__ = ["add_arguments", "main"]

DESCRIPTION = "Convert a Hugging Face checkpoint's MTP drafter into an mtpjax checkpoint."
_PRECISION_HELP = (
    "keep: the native per-tensor formats, bit for bit; bf16; fp8: E4M3 with one scale per row; "
    "fp8_block: E4M3 with one scale per 128x128 tile (DeepSeek/GLM native); nvfp4 (alias fp4): "
    "E2M1 with E4M3 block-16 scales. The router and shared-expert gate stay BF16"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The converter's arguments, for ``mtpjax convert`` and the script."""
    choices = [*PRECISIONS, "fp4"]
    parser.add_argument("src", metavar="SRC", help="Hugging Face checkpoint directory")
    parser.add_argument("out", metavar="OUT", help="directory to create (outside SRC)")
    parser.add_argument(
        "--precision",
        default="keep",
        type=str.lower,
        choices=choices,
        help=f"{_PRECISION_HELP} (default keep)",
    )
    parser.add_argument(
        "--head-precision",
        default=None,
        type=str.lower,
        choices=choices,
        help="precision of the LM head, the same choices (default: --precision)",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress (a bar on a terminal, else log lines)"
    )


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None, *, prog: str = "mtpjax convert") -> int:
    """Runs the converter on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.quiet:  # the converter's progress lines; other libraries' INFO stays quiet
        logging.basicConfig(format="%(asctime)s %(message)s")
        logging.getLogger("mtpjax").setLevel(logging.INFO)
    try:
        manifest = convert(
            args.src,
            args.out,
            precision=args.precision,
            head_precision=args.head_precision,
            force=args.force,
            progress=not args.quiet,
        )
    except KeyboardInterrupt as err:
        print(f"interrupted: nothing was written to {args.out}", file=sys.stderr)
        return 128 + (err.signum if isinstance(err, ConversionInterrupted) else 2)
    except (ValueError, OSError) as err:
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    status = "runnable" if manifest.runnable else f"not runnable yet: {manifest.unsupported_reason}"
    n = manifest.num_mtp_modules
    print(
        f"converted {manifest.architecture} ({n} MTP module{'s' if n != 1 else ''}, "
        f"{len(manifest.tensors)} tensors, precision {manifest.precision}) to {args.out}; "
        f"drafter {status}"
    )
    return 0
