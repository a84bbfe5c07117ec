"""Command line: `mtpjax demo` (speculative decoding on the shipped pair, or on a Hugging Face
directory with `--model DIR`), `mtpjax generate DIR --prompt TEXT` (generation from a Qwen3.5 /
Qwen3-Next directory, with or without speculation), `mtpjax selfcheck` (version and JAX backend)
`mtpjax convert SRC OUT ...` (a Hugging Face checkpoint's MTP drafter to an mtpjax
checkpoint; `mtpjax convert --help` lists its flags) and `mtpjax finetune --out DIR ...`
(self-distilled multi-step fine-tuning of the MTP head; `mtpjax finetune --help`)."""

from __future__ import annotations

import argparse
import sys

import mtpjax


def _selfcheck(_: argparse.Namespace) -> int:
    import jax

    print(f"mtpjax {mtpjax.__version__}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from mtpjax import demo

    argv = sys.argv[1:] if argv is None else list(argv)
    # The converter parses its own flags (SRC OUT --precision ...): everything after `convert`
    # goes to it untouched, `--help` included.
    if argv[:1] == ["convert"]:
        from mtpjax.checkpoint import convert_main

        return convert_main(argv[1:])
    if argv[:1] == ["finetune"]:  # its own flags too, and optax (the `train` extra) only here
        try:
            from mtpjax.train import finetune_main
        except ModuleNotFoundError as err:
            print(f"mtpjax finetune needs {err.name}: pip install 'mtpjax[train]'", file=sys.stderr)
            return 2
        return finetune_main(argv[1:])
    parser = argparse.ArgumentParser(prog="mtpjax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mtpjax {mtpjax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("selfcheck", help="print the library version and the JAX backend").set_defaults(
        func=_selfcheck
    )
    demo_parser = sub.add_parser(
        "demo",
        help="speculative vs plain decoding on the shipped tiny pair or --model DIR",
        description=demo.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.main)
    generate_parser = sub.add_parser(
        "generate",
        help="generate from a Hugging Face directory: generate DIR --prompt TEXT ...",
        description=demo.GENERATE_DESCRIPTION,
    )
    demo.add_generate_arguments(generate_parser)
    generate_parser.set_defaults(func=demo.generate_main)
    sub.add_parser(
        "convert",
        add_help=False,
        help="convert a Hugging Face checkpoint's MTP drafter: convert SRC OUT --precision ...",
    )
    sub.add_parser(
        "finetune",
        add_help=False,
        help="fine-tune the MTP head on self-distilled data: finetune --out DIR [--model DIR] ...",
    )
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
