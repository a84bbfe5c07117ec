"""The public ``propose`` and ``verify`` timed as a caller calls them, for a before/after check.

    git archive <before> mtpjax benchmarks pallas_kernels | tar -x -C /tmp/before
    cp benchmarks/public_calls.py /tmp/before/benchmarks/
    for i in 1 2; do
      (cd /tmp/before && python -m benchmarks.public_calls before) >> $OUT/public_ab.jsonl
      python -m benchmarks.public_calls after >> $OUT/public_ab.jsonl
    done

Run from a tree's root, the module times that tree's library: ``mtpjax.drafter.propose`` and
``mtpjax.verify.verify`` with their Python argument checks, called round after round on the
dense Qwen3.5-27B-like head (BF16 drafter, NVFP4 LM head, 4k context, B = 1; random weights,
``benchmarks.profile.build``) for K = 1 and 3: medians over 40 rounds of each call's dispatch
(until it returns) and sync (until its outputs and the new state are ready). The trees
alternate, so a drift of the machine shows between rounds, not between trees. It prints one
JSON line per run, then one with host-speed probes (a Python loop, a flatten of the state).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import timeit

import jax

from benchmarks import profile as bprof
from benchmarks import propose as bp
from mtpjax import drafter
from mtpjax.verify import verify

ROUNDS = 40


def _median_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1)


def _best_us(fn, number: int) -> float:
    return round(min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6, 2)


def time_point(k: int, smoke: bool):
    """Medians of the public calls at K = ``k``; also returns the last state (for the probes)."""
    built = bprof.build("dense", "bf16-nvfp4head", k, 1, 64 if smoke else 4096, smoke)
    _, _, params, lm, state, pairs, hidden = built
    cfg = bp.head_config("dense", smoke=smoke)
    holder = [state]

    def propose():
        o, holder[0] = drafter.propose(
            params, lm, holder[0], pairs, cfg=cfg, num_drafts=k, implementation="auto"
        )
        return o

    def verify_(o):
        r, holder[0] = verify(
            lm, holder[0], hidden, o, cfg=cfg.lm_head_config(), refeed=True,
            implementation="auto",
        )  # fmt: skip
        return r

    for _ in range(5):
        jax.block_until_ready(verify_(jax.block_until_ready(propose())))
    pd, ps, vd, vs = [], [], [], []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        o = propose()
        t1 = time.perf_counter()
        jax.block_until_ready((o, holder[0]))
        t2 = time.perf_counter()
        r = verify_(o)
        t3 = time.perf_counter()
        jax.block_until_ready((r, holder[0]))
        t4 = time.perf_counter()
        pd.append(t1 - t0)
        ps.append(t2 - t0)
        vd.append(t3 - t2)
        vs.append(t4 - t2)
    times = dict(
        propose_dispatch_us=_median_us(pd),
        propose_sync_us=_median_us(ps),
        verify_dispatch_us=_median_us(vd),
        verify_sync_us=_median_us(vs),
    )
    return times, holder[0]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    label, smoke = argv[0], "--smoke" in argv[1:]
    out = dict(tree=label)
    for k in (1, 3):
        out[f"K={k}"], state = time_point(k, smoke)
    print(json.dumps(out))
    host = dict(
        python_loop_1000_us=_best_us(lambda: sum(range(1000)), 2000),
        flatten_state_us=_best_us(lambda: jax.tree.flatten(state), 2000),
    )
    print(json.dumps(host))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
