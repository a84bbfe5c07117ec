"""Self-distilled multi-step fine-tuning of an MTP head on its frozen target: ``mtpjax finetune``
for a checkout (``mtpjax/train/_cli.py`` has the whole description; ``--help`` prints it).

    PYTHONPATH=. .venv/bin/python scripts/finetune_mtp.py --out runs/ft
"""

from __future__ import annotations

import sys

from mtpjax.train import finetune_main

if __name__ == "__main__":
    sys.exit(finetune_main(prog="scripts/finetune_mtp.py"))
