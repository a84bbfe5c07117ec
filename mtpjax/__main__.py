"""Command line: `python -m mtpjax demo` (speculative decoding on the shipped pair) and
`python -m mtpjax selfcheck` (version and JAX backend)."""

from __future__ import annotations

import argparse
import sys


def _selfcheck(_: argparse.Namespace) -> int:
    import jax

    import mtpjax

    print(f"mtpjax {mtpjax.__version__}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from mtpjax import demo

    return demo.main(args)


def main(argv: list[str] | None = None) -> int:
    from mtpjax import demo

    parser = argparse.ArgumentParser(prog="mtpjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("selfcheck", help="print the library version and the JAX backend").set_defaults(
        func=_selfcheck
    )
    demo_parser = sub.add_parser(
        "demo",
        help="speculative vs plain decoding on the shipped tiny model pair",
        description=demo.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
