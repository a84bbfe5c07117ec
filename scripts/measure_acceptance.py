"""Mean acceptance length of the shipped tiny pair on held-out code, per drafter precision,
hidden contract and number of drafts k.

    .venv/bin/python scripts/measure_acceptance.py \\
        --json benchmarks/results/acceptance_cpu.json

Inputs. The target is the shipped pair's (``mtpjax/assets/tiny_pair``), a Qwen3.5-architecture
model run by ``mtpjax.hybrid``. The drafters are its MTP head converted with
``mtpjax.checkpoint.convert`` into a temporary directory at each precision (BF16 keeps the
stored values); they read the converted embedding and LM head, as a quantised checkpoint ships
them, while the target verifies with its own BF16 head. The prompts are one window of
``--prompt-len`` tokens from the middle of each held-out standard-library file
(``mtpjax.demo.heldout_files``: the pair never saw them in training; the codec tables under
``encodings/`` are left out), keeping only files with room for the continuation;
``--max-snippets`` keeps that many, spread evenly over the list. All snippets decode as one batch.

What is measured. For every (k, precision, contract) the prompts are decoded greedily for
``--new-tokens`` tokens with ``mtpjax.generation.generate``, and once per k with
``generate_baseline(step_width=k + 1)``: the target alone, every target call shaped like a
verify step, so the two outputs must agree token for token (the module docstring of
``mtpjax/generation.py`` says why the step width matters). Each JSON record holds the mean
acceptance length (tokens emitted per round, the bonus token included), the per-position
acceptance rates, the draft acceptance rate, the target forwards after the prefill of both runs
and their difference, and whether the outputs are identical. A table of mean acceptance lengths
(rows precision x contract, columns k) is printed last. The exit status is 1 if any speculative
output differs from its baseline or the drafter's KV cache reports an error.

The JSON list is rewritten after every configuration, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from mtpjax import demo, hybrid
from mtpjax import generation as gen
from mtpjax.checkpoint import convert, load_drafter
from mtpjax.config import HiddenContract
from mtpjax.train import heldout_prompts

PRECISIONS = demo.PRECISIONS  # bf16, fp8, nvfp4
CONTRACTS = tuple(c.value for c in HiddenContract)


# ------------------------------------------------------------------------------------------
# Inputs.


def heldout_snippets(
    tokenizer: Any, *, prompt_len: int, new_tokens: int, max_snippets: int | None
) -> tuple[np.ndarray, list[str]]:
    """(int32[B, prompt_len] prompts, their file names): one window from the middle of each
    held-out file with at least ``prompt_len + new_tokens + 2`` tokens, at most ``max_snippets``
    of them spread evenly over the list (``mtpjax.train.heldout_prompts``, which the
    fine-tuning's before/after evaluation uses too)."""
    return heldout_prompts(
        tokenizer, prompt_len=prompt_len, new_tokens=new_tokens, max_snippets=max_snippets
    )


def load_drafters(precisions: list[str], *, scratch: Path) -> dict[str, tuple]:
    """precision -> (drafter config, drafter params, the head the drafter reads): the shipped
    head converted into ``scratch`` at each precision."""
    out = {}
    for precision in precisions:
        convert(demo.ASSET_DIR, scratch / precision, precision=precision, progress=False)
        dcfg, ckpt = load_drafter(scratch / precision)
        out[precision] = (dcfg, ckpt.modules[0], ckpt.head)
    return out


# ------------------------------------------------------------------------------------------
# Presentation.


def _finite(x: float, digits: int = 4) -> float | None:
    return round(float(x), digits) if math.isfinite(x) else None


def table(records: list[dict[str, Any]]) -> str:
    """Markdown table of mean acceptance lengths: rows precision x contract, columns k. A cell
    whose speculative output differed from the baseline is marked ``(differs!)``."""
    ks = sorted({r["k"] for r in records})
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        rows.setdefault((r["precision"], r["contract"]), {})[r["k"]] = r
    lines = [
        "| precision | contract | " + " | ".join(f"k={k}" for k in ks) + " |",
        "|---|---|" + "---:|" * len(ks),
    ]
    for (precision, contract), by_k in rows.items():
        cells = []
        for k in ks:
            r = by_k.get(k)
            if r is None:
                cells.append("")
                continue
            mal = r["mean_acceptance_length"]
            cell = "n/a" if mal is None else f"{mal:.2f}"
            cells.append(cell if r["identical"] else f"{cell} (differs!)")
        lines.append(f"| {precision} | {contract} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Driver.


def _names(allowed: tuple[str, ...]):
    def parse(s: str) -> list[str]:
        out = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in out if x not in allowed]
        if bad or not out:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(allowed)}"
            )
        return out

    return parse


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    p.add_argument("--ks", type=_ints, default=[1, 2, 3, 4], help="drafts per round (1,2,3,4)")
    p.add_argument(
        "--precisions",
        type=_names(PRECISIONS),
        default=list(PRECISIONS),
        help=f"drafter precisions ({','.join(PRECISIONS)})",
    )
    p.add_argument(
        "--contracts",
        type=_names(CONTRACTS),
        default=list(CONTRACTS),
        help=f"hidden contracts ({','.join(CONTRACTS)})",
    )
    p.add_argument("--prompt-len", type=_positive, default=64, help="prompt tokens (64)")
    p.add_argument("--new-tokens", type=_positive, default=128, help="tokens generated (128)")
    p.add_argument(
        "--max-snippets", type=_positive, default=None, help="at most this many prompts (all)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = Tokenizer.from_file(str(demo.ASSET_DIR / "tokenizer.json"))
    snippets, files = heldout_snippets(
        tokenizer,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        max_snippets=args.max_snippets,
    )
    B = len(files)
    print(f"{B} held-out snippets: {', '.join(files)}", file=sys.stderr, flush=True)
    prompts = jnp.asarray(snippets)  # [B, P]
    lengths = jnp.full((B,), args.prompt_len, jnp.int32)

    tcfg = hybrid.HybridConfig.from_hf(demo.ASSET_DIR)
    target, head = hybrid.load(demo.ASSET_DIR, cfg=tcfg)
    common = dict(head_cfg=tcfg.lm_head_config(), max_new_tokens=args.new_tokens)

    records: list[dict[str, Any]] = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="mtpjax-acceptance-") as scratch:
        drafters = load_drafters(args.precisions, scratch=Path(scratch))
        total = len(args.ks) * len(args.precisions) * len(args.contracts)
        with tqdm(total=total, desc="configurations", unit="cfg") as bar:
            for k in args.ks:
                # The state keeps the GDN layers' states after each of a step's k + 1 rows.
                model = hybrid.target_model(tcfg, target, head, max_step=k + 1)
                base = jax.device_get(
                    gen.generate_baseline(model, head, prompts, lengths, step_width=k + 1, **common)
                )
                for precision in args.precisions:
                    dcfg, params, drafter_head = drafters[precision]
                    for contract in args.contracts:
                        bar.set_postfix_str(f"k={k} {precision} {contract}")
                        t0 = time.perf_counter()
                        out = jax.device_get(
                            gen.generate(
                                model,
                                params,
                                head,
                                prompts,
                                lengths,
                                drafter_cfg=dcfg,
                                num_drafts=k,
                                drafter_head=drafter_head,
                                hidden_contract=contract,
                                **common,
                            )
                        )
                        identical = bool(
                            np.array_equal(out.tokens, base.tokens)
                            and np.array_equal(out.lengths, base.lengths)
                        )
                        kv_ok = not np.any(out.kv_error)
                        ok &= identical and kv_ok
                        m = out.metrics
                        records.append(
                            dict(
                                precision=precision,
                                contract=contract,
                                k=k,
                                mean_acceptance_length=_finite(m.mean_acceptance_length()),
                                per_position_acceptance=[
                                    _finite(x) for x in m.acceptance_rate_per_pos()
                                ],
                                draft_acceptance_rate=_finite(m.draft_acceptance_rate()),
                                target_steps=int(out.target_steps),
                                baseline_steps=int(base.target_steps),
                                target_forwards_saved=int(base.target_steps - out.target_steps),
                                identical=identical,
                                kv_error=not kv_ok,
                                num_snippets=B,
                                prompt_len=args.prompt_len,
                                new_tokens=args.new_tokens,
                                seconds=round(time.perf_counter() - t0, 2),
                            )
                        )
                        if not identical:
                            tqdm.write(f"k={k} {precision} {contract}: differs from the baseline")
                        if args.json is not None:
                            args.json.parent.mkdir(parents=True, exist_ok=True)
                            args.json.write_text(json.dumps(records, indent=1) + "\n")
                        bar.update()

    print(
        f"\nMean acceptance length (tokens per round, bonus included), greedy, {B} held-out "
        f"snippets, {args.prompt_len} prompt + {args.new_tokens} new tokens:\n"
    )
    print(table(records))
    if args.json is not None:
        print(f"\nwrote {len(records)} records to {args.json}")
    if not ok:
        print("FAILED: a speculative output differs from greedy decoding or the KV cache erred")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
