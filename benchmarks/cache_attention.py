"""The target steps' cache attention (``pallas_kernels.cache_attention``) against XLA's.

    python -m benchmarks.cache_attention --json $OUT/cache_attention_h200.json
    python -m benchmarks.cache_attention --products bf16x6,ieee --json $OUT/ca.json
    python -m benchmarks.cache_attention --rows-per-dot 16,32,64 --block-keys 16,32 --json $OUT/ca.json
    python -m benchmarks.cache_attention --smoke --json /tmp/ca.json   # CPU, tiny shapes

At the 27B-like target's shapes (24 query heads over 4 KV heads of 256), each case (B
sequences, S query rows a sequence, a cache of L rows of which about n are attended) runs the
op once per layer of a 64-layer stacked cache inside one jit, as a target step's layer scan
does, and reports microseconds per layer for the kernel (``kernel_us``), for XLA's masked
einsum attention (``xla_us``, the op's reference) and for a plain read of the attended cache
rows (``read_us``: the memory floor), with their ratios; ``max_err`` is the kernel's largest
difference from the reference, and ``row0_alone`` whether row 0 of the S-row call equals the
one-row call bit for bit (what greedy speculation's exactness rests on). ``--products``,
``--rows-per-dot``, ``--block-keys`` and ``--split-keys`` take comma-separated values of the
``CacheAttentionConfig`` fields of those names; the kernel is timed once per combination, one
record each (its fields in the record).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks import harness
from pallas_kernels._cache_attention.triton import PRODUCTS, ROWS_PER_DOT


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    rows: int
    cache_len: int
    attended: int
    dtype: str = "float32"


HEADS = dict(n_q=24, n_kv=4, d=256, layers=64)
SMOKE_HEADS = dict(n_q=6, n_kv=2, d=32, layers=2)
CASES = (
    Case(1, 1, 392, 384),
    Case(1, 4, 392, 384),
    Case(8, 1, 392, 384),
    Case(8, 4, 392, 384),
    Case(32, 4, 392, 384),
    Case(1, 4, 4096, 4000),
    Case(8, 4, 392, 384, "bfloat16"),
)
SMOKE_CASES = (Case(2, 4, 40, 33),)


def median_seconds(fn, *args, reps: int) -> float:
    """Median wall time of ``fn(*args)`` after two warm-up calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def over_layers(attention, layers: int):
    """One jit running ``attention`` on every layer of the stacked caches (summed outputs)."""

    @jax.jit
    def run(q, k, v, lengths):
        def body(i, acc):
            return acc + attention(q, k, v, lengths, layer=i)

        return jax.lax.fori_loop(0, layers, body, jnp.zeros(q.shape, jnp.float32))

    return run


def inputs(case: Case, heads: dict, key: jax.Array):
    """q f32[B, S, Nq, D], stacked caches [layers, B, L, Nkv, D], lengths int32[B, S] (causal
    rows ending near ``attended``, a few rows shorter per sequence)."""
    B, S, L = case.batch, case.rows, case.cache_len
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (B, S, heads["n_q"], heads["d"]), jnp.float32)
    shape = (heads["layers"], B, L, heads["n_kv"], heads["d"])
    k = jax.random.normal(kk, shape, jnp.float32).astype(case.dtype)
    v = jax.random.normal(kv, shape, jnp.float32).astype(case.dtype)
    last = case.attended - 3 * jnp.arange(B, dtype=jnp.int32)[:, None]
    lengths = last + jnp.arange(S, dtype=jnp.int32)[None, :] + 1 - S
    return q, k, v, jnp.maximum(lengths, 1)


def measure(
    case: Case, heads: dict, reps: int, configs: tuple[pk.CacheAttentionConfig, ...]
) -> list[dict]:
    """One record per kernel config; the read and XLA's time shared."""
    q, k, v, lengths = inputs(case, heads, jax.random.key(0))
    scale = heads["d"] ** -0.5
    xla = functools.partial(pk.cache_attention, scale=scale, implementation="xla")
    n = case.attended

    @jax.jit
    def read(k, v):
        return jnp.sum(k[:, :, :n].astype(jnp.float32)) + jnp.sum(v[:, :, :n].astype(jnp.float32))

    per_layer = 1e6 / heads["layers"]
    read_us = median_seconds(read, k, v, reps=reps) * per_layer
    xla_us = median_seconds(over_layers(xla, heads["layers"]), q, k, v, lengths, reps=reps)
    xla_us *= per_layer
    layer = jnp.int32(heads["layers"] - 1)
    ref = np.asarray(jax.jit(xla)(q, k, v, lengths, layer=layer))
    records = []
    for cfg in configs:
        kernel = functools.partial(
            pk.cache_attention, scale=scale, implementation="pallas", config=cfg
        )
        rec = dict(dataclasses.asdict(case), **heads, **dataclasses.asdict(cfg), read_us=read_us)
        rec["xla_us"] = xla_us
        rec["kernel_us"] = per_layer * median_seconds(
            over_layers(kernel, heads["layers"]), q, k, v, lengths, reps=reps
        )
        rec["kernel_over_xla"] = rec["kernel_us"] / rec["xla_us"]
        rec["kernel_over_read"] = rec["kernel_us"] / rec["read_us"]
        one = jax.jit(kernel)
        got = np.asarray(one(q, k, v, lengths, layer=layer))
        rec["max_err"] = float(np.max(np.abs(got - ref)))
        alone = np.asarray(one(q[:, :1], k, v, lengths[:, :1], layer=layer))
        rec["row0_alone"] = bool(np.array_equal(alone[:, 0], got[:, 0]))
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument(
        "--products",
        default="bf16x6",
        help=f"the kernel's dot products to time, comma-separated from {','.join(PRODUCTS)}",
    )
    default = pk.CacheAttentionConfig()
    ints = dict(
        rows_per_dot=f"query rows per dot, comma-separated from {ROWS_PER_DOT}",
        block_keys="cache rows per loop step (powers of two >= 16)",
        split_keys="cache rows per program (multiples of every --block-keys)",
    )
    for field, what in ints.items():
        flag = "--" + field.replace("_", "-")
        ap.add_argument(flag, default=str(getattr(default, field)), help=what)
    args = ap.parse_args(argv)
    products = tuple(args.products.split(","))
    if unknown := sorted(set(products) - set(PRODUCTS)):
        ap.error(f"--products: unknown {unknown[0]!r}, expected one of {sorted(PRODUCTS)}")
    values = {"products": products}
    for field in ints:
        text = getattr(args, field)
        try:
            values[field] = tuple(int(v) for v in text.split(","))
        except ValueError:
            ap.error(
                f"--{field.replace('_', '-')}: expected comma-separated integers, got {text!r}"
            )
    try:
        configs = tuple(
            pk.CacheAttentionConfig(**dict(zip(values, combo, strict=True)))
            for combo in itertools.product(*values.values())
        )
    except ValueError as e:
        ap.error(str(e))
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    heads, cases = (SMOKE_HEADS, SMOKE_CASES) if args.smoke else (HEADS, CASES)
    run = harness.run_info("benchmarks.cache_attention", sys.argv[1:] if argv is None else argv)
    records: list[dict] = []
    for i, case in enumerate(cases, 1):
        new = measure(case, heads, 1 if args.smoke else args.reps, configs)
        records += new
        harness.write_records(args.json, records, run)
        for rec in new:
            print(
                f"[{i}/{len(cases)}] B={case.batch} S={case.rows} L={case.cache_len} "
                f"{case.dtype} {rec['products']} rows {rec['rows_per_dot']} keys "
                f"{rec['block_keys']}/{rec['split_keys']}: kernel {rec['kernel_us']:.1f} µs/layer = "
                f"{rec['kernel_over_xla']:.2f}x XLA, {rec['kernel_over_read']:.1f}x the read, "
                f"max err {rec['max_err']:.1e}; row 0 alone "
                f"{'equal' if rec['row0_alone'] else 'DIFFERS'}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
