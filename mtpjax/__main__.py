"""Command line: `python -m mtpjax selfcheck` (version and JAX backend)."""

from __future__ import annotations

import argparse
import sys


def _selfcheck(_: argparse.Namespace) -> int:
    import jax

    import mtpjax

    print(f"mtpjax {mtpjax.__version__}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("selfcheck", help="print the library version and the JAX backend").set_defaults(
        func=_selfcheck
    )
    sub.add_parser("demo", help="the speculative-decoding demo on the shipped model").set_defaults(
        func=_selfcheck
    )
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
