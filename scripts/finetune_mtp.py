"""Self-distilled multi-step fine-tuning of an MTP head on its frozen target: ``mtpjax finetune``
for a checkout (``mtpjax/train/_cli.py`` has the whole description; ``--help`` prints it). It
runs from the repository root without installing the package, given jax, numpy, chex, optax,
orbax-checkpoint, safetensors, tokenizers, tqdm and matplotlib:

    PYTHONPATH=. python3 scripts/finetune_mtp.py --out runs/ft
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    try:
        from mtpjax.train import finetune_main
    except ModuleNotFoundError as err:  # optax, the library's own dependencies, or the library
        if (err.name or "").split(".")[0] == "mtpjax":
            sys.exit(
                "scripts/finetune_mtp.py: no mtpjax; run it from the repository root with PYTHONPATH=."
            )
        sys.exit(f"scripts/finetune_mtp.py needs the Python module {err.name}")
    sys.exit(finetune_main(prog="scripts/finetune_mtp.py"))
