"""Many-row projections of a stacked weight: what a target's verify step pays per layer.

    python -m benchmarks.stacked_rows --json $OUT/stacked_rows_h200.json

A target scans its layers over weights stacked ``[L, N, K]``; its verify step at B sequences and
K drafts projects ``B (K + 1)`` rows through each layer's entry. Per weight format (BF16, FP8
per-row), projection shape of the dense Qwen3.5-27B layer and row count this times a
``lax.scan`` over ``L`` entries of one stack, each step one projection of the same rows (their
outputs summed, so the result is small), and reports µs per entry against the entry's bytes at
the run's copy bandwidth, with each program's temporary bytes (an entry copied out of the stack
shows there):

* ``xla_copy``: one XLA dot on BF16 operands of each entry (``bf16_operands_dot``), the path
  ``linear`` takes past one GEMV pass (``WIDE_MAX_ROWS``): XLA:GPU copies the entry out of the
  stack for its GEMM;
* ``xla_copy_dsf`` (BF16): the same program compiled with
  ``xla_gpu_enable_dynamic_slice_fusion``, XLA's option for GEMMs that read a slice in place;
* ``xla_plain``: the same dot of an unstacked ``[N, K]`` weight, no slice (the GEMM's own time);
* ``linear``: ``linear(x, StackedWeight, implementation="pallas")``, what the library runs;
* ``triton_default``: the Triton GEMV at its heuristic tile (FP8's ``linear`` takes the
  Mosaic kernel where the shape allows);
* ``triton`` (BF16) per ``TRITON_TILES`` (``--tiles split``: ``SPLIT_TILES``): the Triton GEMV
  at that tile, reading the stack in place, all rows in one pass.

``--smoke``: tiny shapes on the CPU (interpret mode), the plumbing only.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from benchmarks import harness

#: The dense 27B layer's projections, ``(name, N, K)``.
SHAPES = (
    ("q", 12288, 5120),
    ("k", 1024, 5120),  # and v
    ("gate", 17408, 5120),  # and up
    ("down", 5120, 17408),
    ("o", 5120, 6144),
)
SMOKE_SHAPES = (("small", 128, 256),)
ROWS = (32, 64, 128)
#: Triton tiles tried at each row count beside the heuristic's: (block_n, block_k, warps, stages,
#: split_k); a split of None is the heuristic's (enough programs to fill the GPU four times),
#: whose partial sums (split x rows x N F32) reach ~17 MB per projection at 128 rows.
TRITON_TILES = (
    (64, 128, 4, 3, None),
    (64, 64, 4, 4, None),
    (128, 64, 8, 3, None),
    (128, 128, 8, 3, None),
    (64, 128, 4, 4, None),
    (128, 64, 4, 3, None),
    (64, 64, 4, 4, 1),
    (64, 64, 4, 4, 2),
)
#: ``--tiles split``: the default tile past 32 rows at the filling split, one and two slices.
SPLIT_TILES = tuple(t for t in TRITON_TILES if t[:4] == (64, 64, 4, 4))


def _scan_over(stack_fn, x, layers: int):
    """A jitted-able scan: sum over entries i of ``stack_fn(x, i)``."""
    import jax
    import jax.numpy as jnp

    def body(acc, i):
        return acc + stack_fn(x, i), None

    n = jax.eval_shape(stack_fn, x, jnp.int32(0)).shape  # traced for its shape only
    acc, _ = jax.lax.scan(body, jnp.zeros(n, jnp.float32), jnp.arange(layers, dtype=jnp.int32))
    return acc


def _time(fn, args, *, options, smoke: bool):
    """µs per call of ``jax.jit(fn)`` compiled with ``options``, queued back to back, the
    program's temporary bytes (an entry copied out of the stack shows there) and its output."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
    out = jax.block_until_ready(compiled(*args))
    us = harness.time_queued(lambda: compiled(*args), **(harness.SMOKE_CALLS if smoke else {}))
    mem = compiled.memory_analysis()
    return us, None if mem is None else int(mem.temp_size_in_bytes), out


def _stack(fmt: str, layers: int, n: int, k: int):
    """A stacked ``[layers, n, k]`` weight of ``fmt`` (random) and its entry 0 as a weight of
    its own (buffers apart from the stack's)."""
    import jax
    import jax.numpy as jnp

    from mtpjax.weights import quantize

    entries = [
        quantize(jax.random.normal(jax.random.key(n + k + i), (n, k), jnp.float32) * 0.05, fmt)
        for i in range(layers)
    ]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *entries)
    return stack, entries[0]


def _variants(fmt: str, interpret: bool, tiles=TRITON_TILES):
    """``(name, tile, fn(x, stack, plain, layers))``: the timed programs of ``fmt``. A tile is
    None or ``(GemvConfig, whether its split is the heuristic's)``; its program is built per
    shape (``_tile_fn``), where that split is resolved."""
    import jax.numpy as jnp

    from mtpjax.weights import linear
    from pallas_kernels._linear import triton as T
    from pallas_kernels._linear.base import StackedWeight

    def copy(x, stack, plain, layers):
        return _scan_over(
            lambda x, i: T.bf16_operands_dot(x, StackedWeight(stack=stack, index=i)), x, layers
        )

    def xla_plain(x, stack, plain, layers):
        return _scan_over(lambda x, i: T.bf16_operands_dot(x, plain), x, layers)

    def dispatched(x, stack, plain, layers):
        def one(x, i):
            w = StackedWeight(stack=stack, index=i)
            return linear(x, w, out_dtype=jnp.float32, implementation="pallas")

        return _scan_over(one, x, layers)

    out = [("xla_copy", None, copy)]
    if fmt == "bf16":
        out.append(("xla_copy_dsf", None, copy))
    out += [("xla_plain", None, xla_plain), ("linear", None, dispatched)]
    out.append(("triton_default", None, _tile_fn(None, interpret)))
    if fmt == "bf16":
        for bn, bk, warps, stages, split in tiles:
            cfg = T.GemvConfig(
                block_n=bn,
                block_k=bk,
                num_warps=warps,
                num_stages=stages,
                split_k=split or 1,
                compute="dot",
            )
            out.append(("triton", (cfg, split is None), None))
    return out


def _tile_fn(cfg, interpret: bool):
    """The Triton GEMV with tile ``cfg`` over the stack's entries."""
    from pallas_kernels._linear import triton as T
    from pallas_kernels._linear.base import StackedWeight

    def fn(x, stack, plain, layers):
        def one(x, i):
            return T.gemv(x, StackedWeight(stack=stack, index=i), config=cfg, interpret=interpret)

        return _scan_over(one, x, layers)

    return fn


def _measure(rec: dict, fn, operands, *, layers: int, options, bw_gbps: float, smoke: bool):
    """Times ``fn`` over ``layers`` entries into ``rec`` (errors recorded, not raised); returns
    its output, or None."""
    plain = operands[2]
    try:
        us, temp, out = _time(
            lambda x, s, p: fn(x, s, p, layers), operands, options=options, smoke=smoke
        )
    except Exception as e:  # a tile that fails to lower is recorded, not fatal
        rec.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        return None
    per = us / layers
    ideal = plain.nbytes / (bw_gbps * 1e3)  # the entry read once at copy speed
    rec.update(us_per_entry=per, ideal_us=ideal, ratio_to_ideal=per / ideal, temp_bytes=temp)
    return out


def run(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels._linear import triton as T

    smoke = args.smoke
    bw = harness.copy_bandwidth(smoke=smoke)
    records = [dict(kind="copy_bandwidth", **bw)]
    tiles = SPLIT_TILES if args.tiles == "split" else TRITON_TILES
    start = time.time()
    for fmt in args.formats:
        for name, n, k in SMOKE_SHAPES if smoke else SHAPES:
            stack, plain = _stack(fmt, args.layers, n, k)
            for rows in args.rows:
                x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
                reference = None  # xla_copy's sum over the entries: every stack read's too
                for vname, tile, fn in _variants(fmt, smoke, tiles):
                    rec = dict(kind="projection", format=fmt, shape=name, n=n, k=k, rows=rows)
                    rec.update(variant=vname, layers=args.layers)
                    if time.time() - start > args.budget_s:
                        records.append(dict(rec, kind="skipped"))
                        continue
                    if tile is not None:
                        cfg, fill = tile
                        if fill:
                            split = T.filling_split(n, k, cfg.block_n, cfg.block_k)
                            cfg = dataclasses.replace(cfg, split_k=split)
                        fn, rec["config"] = _tile_fn(cfg, smoke), dataclasses.asdict(cfg)
                    dsf = vname == "xla_copy_dsf" and not smoke
                    options = {"xla_gpu_enable_dynamic_slice_fusion": True} if dsf else None
                    rec["compiler_options"] = options
                    out = _measure(
                        rec, fn, (x, stack, plain), layers=args.layers, options=options,
                        bw_gbps=bw["gbps"], smoke=smoke,
                    )  # fmt: skip
                    if out is not None and vname == "xla_copy":
                        reference = np.asarray(out)
                    elif out is not None and vname != "xla_plain" and reference is not None:
                        err = np.abs(np.asarray(out) - reference).max()
                        rec["max_rel_err"] = float(err / np.abs(reference).max())
                    records.append(rec)
                    print(_line(rec), flush=True)
            del stack, plain
    return records


def _line(r: dict) -> str:
    cfg = r.get("config")
    tile = "" if not isinstance(cfg, dict) else (
        f" {cfg['block_n']}x{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']}"
        f" split{cfg['split_k']}"
    )  # fmt: skip
    what = f"{r['format']:5} {r['shape']:5} rows {r['rows']:4} {r['variant']:13}{tile}"
    if "error" in r:
        return f"{what}: {r['error'][:120]}"
    err = f", rel err {r['max_rel_err']:.1e}" if "max_rel_err" in r else ""
    return f"{what}: {r['us_per_entry']:8.1f} µs/entry, {r['ratio_to_ideal']:.2f}x the read{err}"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", default=str(harness.REPO / "benchmarks/results/stacked_rows.json"))
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=list(ROWS))
    p.add_argument("--formats", type=lambda s: s.split(","), default=["bf16", "fp8"])
    p.add_argument("--tiles", choices=("all", "split"), default="all", help="BF16 tiles timed")
    p.add_argument("--layers", type=int, default=None, help="entries per stack (4; smoke 2)")
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args(argv)
    if args.smoke and "--formats" not in argv:
        args.formats = ["bf16"]  # FP8 takes the Mosaic kernel, slow to interpret
    if args.smoke and "--rows" not in argv:
        args.rows = [4, 40]
    if args.layers is None:
        args.layers = 2 if args.smoke else 4
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        import jax

        jax.config.update("jax_platforms", "cpu")
    records = run(args)
    harness.write_records(args.json, records, harness.run_info("benchmarks.stacked_rows", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
