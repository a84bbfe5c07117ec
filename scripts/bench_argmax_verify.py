"""Times the Pallas argmax kernel against ``jnp.argmax`` as the verify step's greedy pick uses it.

The verify step's greedy acceptance needs the argmax of each verify row's logits (``[M, V]``,
F32 after the LM head); the kernel returns the argmax and its log-probability. Both are timed
steady-state (calls queued back to back, (8 calls - 2 calls) / 6, median of 3) in one process,
each as the only op of a jitted function, at the LM head's vocabulary (248320).

    PYTHONPATH=. python3 scripts/bench_argmax_verify.py --json $OUT/argmax_verify_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.argmax import argmax_logprob


def steady_us(fn, xs: list) -> float:
    """µs per launch of ``fn``, one launch per distinct array of ``xs`` in each call."""
    multi = jax.jit(lambda arrays: [fn(a) for a in arrays])
    jax.block_until_ready(multi(xs))

    def run(n):
        t0 = time.perf_counter()
        for _ in range(n):
            out = multi(xs)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    per = [(run(8) - run(2)) / 6 for _ in range(3)]
    return float(np.median(per)) / len(xs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--vocab", type=int, default=248320)
    args = ap.parse_args()
    records = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows in (4, 32, 96):
            keys = jax.random.split(jax.random.key(rows), 8)
            xs = [jax.random.normal(k, (rows, args.vocab), jnp.float32).astype(dtype) for k in keys]
            x = xs[0]
            want = jnp.argmax(x, axis=-1)
            got = argmax_logprob(x)[0]
            assert bool(jnp.all(got == want)), "argmax kernel disagrees with jnp.argmax"
            jnp_us = steady_us(lambda a: jnp.argmax(a, axis=-1).astype(jnp.int32), xs)
            kernel_us = steady_us(lambda a: argmax_logprob(a)[0], xs)
            rec = dict(
                rows=rows,
                vocab=args.vocab,
                dtype=jnp.dtype(dtype).name,
                jnp_argmax_us=jnp_us,
                pallas_argmax_us=kernel_us,
                ratio_pallas_over_jnp=kernel_us / jnp_us,
            )
            print(json.dumps(rec), flush=True)
            records.append(rec)
    out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, records=records)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
