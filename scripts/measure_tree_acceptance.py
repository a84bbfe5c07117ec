"""Mean acceptance length of tree drafting against chain drafting on the shipped tiny pair, at
equal verify rows (and the chain at the tree's depth), greedy, on held-out code.

    .venv/bin/python scripts/measure_tree_acceptance.py \\
        --json benchmarks/results/tree_acceptance_cpu.json

Inputs as ``scripts/measure_acceptance.py`` (the shipped Qwen3.5-architecture pair, its MTP head
converted at ``--precision``, one window of ``--prompt-len`` tokens from each held-out file, at
most ``--max-snippets``, decoded as one batch), with the default hidden contract.

What is measured. For each tree ``(k_1, .., k_D)`` (S = 1 + k_1 + k_1 k_2 + .. verify rows,
the root included) the prompts are decoded greedily with ``generate(..., tree=...)``, and with
chains of ``k = S - 1`` drafts (the same S verify rows a round) and of ``k = D`` drafts (the
tree's depth: the same number of drafter forwards per path). Every run is checked against
``generate_baseline`` with its own step width (token for token). A record per run holds the
kind (tree or chain), its branching, verify rows, mean acceptance length (tokens per round,
bonus included), the per-position acceptance, target forwards after the prefill and whether
the output equals the baseline. The exit status is 1 if any output differs or the drafter's KV
cache reports an error.
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

from mtpjax import demo, hybrid
from mtpjax import generation as gen
from mtpjax.checkpoint import load_drafter
from mtpjax.draft_tree import TreeShape
from mtpjax.pretrained import converted_drafter
from mtpjax.train import heldout_prompts

DEFAULT_TREES = "2,1,1;2,2,1;3,1,1;2,2,2"


def _trees(s: str) -> list[TreeShape]:
    try:
        return [TreeShape(tuple(int(k) for k in t.split(","))) for t in s.split(";") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"trees like '2,2,1;3,1': {e}") from None


def _finite(x: float) -> float | None:
    return round(float(x), 4) if math.isfinite(x) else None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    p.add_argument("--trees", type=_trees, default=_trees(DEFAULT_TREES), help=DEFAULT_TREES)
    p.add_argument("--precision", default="bf16", choices=demo.PRECISIONS)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-snippets", type=int, default=16)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = Tokenizer.from_file(str(demo.ASSET_DIR / "tokenizer.json"))
    snippets, files = heldout_prompts(
        tokenizer,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        max_snippets=args.max_snippets,
    )
    B = len(files)
    prompts = jnp.asarray(snippets)
    lengths = jnp.full((B,), args.prompt_len, jnp.int32)
    tcfg = hybrid.HybridConfig.from_hf(demo.ASSET_DIR)
    target, head = hybrid.load(demo.ASSET_DIR, cfg=tcfg)
    common = dict(head_cfg=tcfg.lm_head_config(), max_new_tokens=args.new_tokens)
    runs: list[tuple[str, tuple[int, ...], int]] = []  # (kind, branching, verify rows)
    for tree in args.trees:
        runs.append(("tree", tree.branching, tree.num_rows))
        for k in (tree.num_rows - 1, tree.depth):
            if ("chain", (1,) * k, k + 1) not in runs:
                runs.append(("chain", (1,) * k, k + 1))
    records: list[dict[str, Any]] = []
    baselines: dict[int, Any] = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="mtpjax-tree-") as scratch:
        directory, _ = converted_drafter(
            demo.ASSET_DIR, precision=args.precision, cache_dir=scratch, progress=False
        )
        dcfg, ckpt = load_drafter(directory)
        params, drafter_head = ckpt.modules[0], ckpt.head
        for kind, branching, rows in runs:
            model = hybrid.target_model(tcfg, target, head, max_step=rows)
            if rows not in baselines:
                baselines[rows] = jax.device_get(
                    gen.generate_baseline(model, head, prompts, lengths, step_width=rows, **common)
                )
            base = baselines[rows]
            t0 = time.perf_counter()
            out = jax.device_get(
                gen.generate(
                    model,
                    params,
                    head,
                    prompts,
                    lengths,
                    drafter_cfg=dcfg,
                    num_drafts=len(branching),
                    drafter_head=drafter_head,
                    tree=TreeShape(branching) if kind == "tree" else None,
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
                    kind=kind,
                    branching=list(branching),
                    depth=len(branching),
                    verify_rows=rows,
                    mean_acceptance_length=_finite(m.mean_acceptance_length()),
                    per_position_acceptance=[_finite(x) for x in m.acceptance_rate_per_pos()],
                    target_steps=int(out.target_steps),
                    baseline_steps=int(base.target_steps),
                    identical=identical,
                    kv_error=not kv_ok,
                    precision=args.precision,
                    num_snippets=B,
                    prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens,
                    seconds=round(time.perf_counter() - t0, 2),
                )
            )
            r = records[-1]
            print(
                f"{kind:5s} {branching!s:20s} rows={rows:2d} "
                f"mean acceptance length={r['mean_acceptance_length']} identical={identical}",
                flush=True,
            )
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(records, indent=1) + "\n")
    if not ok:
        print("FAILED: a speculative output differs from greedy decoding or the KV cache erred")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
