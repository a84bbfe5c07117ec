"""Propose latency of two source trees of mtpjax, in one run on one device: a before/after check.

    git archive <commit> | tar -x -C /tmp/before
    python -m benchmarks.propose_ab --tree before=/tmp/before --tree after=. --json $OUT/ab.json

Each tree is imported in its own child process (``PYTHONPATH`` = the tree), so both run the same
timing code here against their own library; children alternate (before, after, before, after
for ``--rounds 2``), so a drift of the machine shows as a difference between rounds, not between
trees. Only the drafter API both trees share is used: ``drafter.init``, ``init_lm_head``,
``drafter.pool_config``, ``drafter.init_state``, ``drafter.prefill`` (the context's rows) and
``drafter.propose``.

For each point ``precision/K/B`` (dense Qwen3.5-27B-like head, ``--context`` rows held, the
anchor window ``K + 1`` wide at key ``context - 1``): the median of ``--iters`` synchronous calls
of the AOT-compiled propose (state donated; each call drops the previous call's chain rows
itself), the mean of calls queued back to back (the device's own time), and the ops the device
runs per call (the compiled module's instructions that launch work, while bodies counted once
per trip). A copy of 1 GiB is timed in each child as the baseline. The printed table gives the
after / before ratio per point, from the medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PRECISIONS = {
    "bf16-nvfp4head": ("bf16", "nvfp4"),
    "nvfp4": ("nvfp4", "nvfp4"),
    "bf16": ("bf16", "bf16"),
}
_LAUNCHING = re.compile(
    r" = .*?\b(fusion|custom-call|copy|scatter|gather|dot|reduce|sort|dynamic-update-slice|"
    r"dynamic-slice|concatenate|convolution|all-reduce)\("
)


def device_ops(hlo: str) -> int:
    """Instructions that launch device work per call in compiled HLO text: the entry
    computation's, each while body's times its known trip count (once without one), and those
    of computations it calls (XLA:CPU wraps loops in calls)."""
    blocks = {b.split(" ", 1)[0].lstrip("%"): b for b in hlo.split("\n\n") if b.strip()}
    entry = next(b for b in blocks.values() if b.startswith("ENTRY"))

    def ops(block: str, depth: int = 0) -> int:
        n = 0
        for line in block.splitlines():
            n += bool(_LAUNCHING.search(line))
            if depth > 8:
                continue
            if " while(" in line:
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                trip = re.search(r'"n":"(\d+)"', line)
                n += ops(blocks.get(body, ""), depth + 1) * (int(trip.group(1)) if trip else 1)
            elif " call(" in line:
                n += ops(
                    blocks.get(re.search(r"to_apply=%?([\w.\-]+)", line).group(1), ""), depth + 1
                )
        return n

    return ops(entry)


def child(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp

    from mtpjax.config import Architecture, DrafterConfig

    cfg = DrafterConfig.tiny(
        architecture=Architecture.QWEN3_5, hidden_size=5120, vocab_size=248_320,
        num_attention_heads=24, num_key_value_heads=4, intermediate_size=17_408, head_dim=256,
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, max_position_embeddings=262_144,
    )  # fmt: skip
    if args.smoke:
        cfg = DrafterConfig.tiny(architecture=Architecture.QWEN3_5, vocab_size=512)
    key = jax.random.key(0)
    x = jnp.zeros((256 * 1024 * 1024 // (64 if args.smoke else 1),), jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    copy_us = _time(lambda: copy(x), args.iters, 3)[0]
    records = []
    for point in args.points.split(","):
        records.append(dict(point=point, copy_us=copy_us, **_measure(cfg, key, point, args)))
        print(json.dumps(records[-1]), file=sys.stderr, flush=True)
    Path(args.child_out).write_text(json.dumps(records))


def _measure(cfg, key, point: str, args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    from mtpjax import drafter
    from mtpjax.head import init_lm_head

    prec, k, b = point.split("/")
    k, b = int(k), int(b)
    dprec, hprec = PRECISIONS[prec]
    params = drafter.init(cfg, key=jax.random.fold_in(key, 1), precision=dprec)
    head = init_lm_head(cfg.lm_head_config(), key=jax.random.fold_in(key, 2), precision=hprec)
    pool = drafter.pool_config(cfg, precision=dprec, max_seq_len=args.context + k + 1, max_seqs=b)
    state = drafter.init_state(pool, num_seqs=b)
    kt, kh = jax.random.split(jax.random.fold_in(key, 3))
    c = args.context
    tokens = jax.random.randint(kt, (b, c), 0, cfg.vocab_size, jnp.int32)
    hidden = jax.random.normal(kh, (b, c, cfg.hidden_size), jnp.bfloat16)
    ones = jnp.ones((b,), jnp.int32)
    prompt = drafter.Pairs(
        tokens=tokens[:, : c - 1], hidden=hidden[:, : c - 1], count=(c - 1) * ones,
        start=0 * ones,
    )  # fmt: skip
    state = drafter.prefill(params, head, state, prompt, cfg=cfg)
    pad = ((0, 0), (0, k))
    pairs = drafter.Pairs(
        tokens=jnp.pad(tokens[:, c - 1 :], pad), hidden=jnp.pad(hidden[:, c - 1 :], (*pad, (0, 0))),
        count=ones, start=(c - 1) * ones,
    )  # fmt: skip
    fn = jax.jit(
        lambda p, h, s, w: drafter.propose(p, h, s, w, cfg=cfg, num_drafts=k),
        donate_argnums=(2,),
    )
    t0 = time.perf_counter()
    compiled = fn.lower(params, head, state, pairs).compile()
    compile_s = time.perf_counter() - t0
    holder = [state]

    def call():
        out, holder[0] = compiled(params, head, holder[0], pairs)
        return out, holder[0]

    sync_us, tokens_out = _time(call, args.iters, 5)
    queued = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(8):
            out = call()
        jax.block_until_ready(out)
        queued.append((time.perf_counter() - t0) / 8 * 1e6)
    return dict(
        sync_us=sync_us, queued_us=float(np.median(queued)),
        device_ops=device_ops(compiled.as_text()), compile_s=compile_s,
        drafts=np.asarray(tokens_out[0].tokens).tolist(),
    )  # fmt: skip


def _time(call, iters: int, warmup: int):
    import jax

    for _ in range(warmup):
        out = jax.block_until_ready(call())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(call())
        ts.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(ts)), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR, in run order")
    ap.add_argument(
        "--points",
        default="bf16-nvfp4head/1/8,bf16-nvfp4head/3/1,bf16-nvfp4head/3/8,nvfp4/1/8,nvfp4/3/1,nvfp4/3/8",
        help="precision/K/B, comma-separated",
    )
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_out:
        child(args)
        return 0
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) < 2 or any(len(t) != 2 for t in trees):
        ap.error("give at least two --tree NAME=DIR")
    out = Path(args.json or "propose_ab.json")
    passthrough = ["--points", args.points, "--context", str(args.context)]
    passthrough += ["--iters", str(args.iters)] + (["--smoke"] if args.smoke else [])
    runs = []
    for r in range(args.rounds):
        for name, tree in trees:
            tmp = out.with_suffix(f".{name}.{r}.tmp")
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child-out", str(tmp)]
            print(f"round {r}: {name} ({tree})", flush=True)
            subprocess.run(cmd + passthrough, env=env, check=True)
            runs.append(dict(tree=name, dir=tree, round=r, records=json.loads(tmp.read_text())))
            tmp.unlink()
            out.write_text(json.dumps(dict(argv=sys.argv, runs=runs), indent=1))
    names = [n for n, _ in trees]
    print(
        f"{'point':24s}" + "".join(f"{n + ' µs':>14s}{'ops':>6s}" for n in names),
        "ratios, same drafts",
    )
    for point in args.points.split(","):
        med, drafts = {}, {}
        for n in names:
            recs = [
                x for run in runs if run["tree"] == n for x in run["records"] if x["point"] == point
            ]
            med[n] = (float(np.median([x["sync_us"] for x in recs])), recs[0]["device_ops"])
            drafts[n] = recs[0]["drafts"]
        ratios = " ".join(f"{med[n][0] / med[names[0]][0]:.3f}" for n in names[1:])
        same = all(drafts[n] == drafts[names[0]] for n in names)
        row = "".join(f"{med[n][0]:14.0f}{med[n][1]:6d}" for n in names)
        print(f"{point:24s}{row}  {ratios} {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
