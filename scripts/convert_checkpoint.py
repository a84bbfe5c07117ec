#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint's MTP drafter into an mtpjax checkpoint.

    python scripts/convert_checkpoint.py SRC OUT --precision {keep,bf16,fp8,fp8_block,nvfp4}

The same command line as ``mtpjax convert`` (``mtpjax.checkpoint.convert_main``); ``--help``
describes the precisions and exit codes.
"""

import sys

from mtpjax.checkpoint import convert_main

if __name__ == "__main__":
    sys.exit(convert_main(prog="convert_checkpoint.py"))
