"""Time `linear` and the LM head as the library dispatches them on the GPU, against XLA.

    python -m benchmarks.linear --json $OUT/linear_h200.json

What a user gets: ``linear(x, w, implementation="pallas")`` for every weight format and row
count (the kernel, tiles and row chunking the library picks), and ``lm_head`` under
``implementation="auto"``. In the same child process it times XLA's BF16 dot at the same shape
and rows, twice (before and after the formats, so the record shows the baseline's drift), and a
device-to-device copy (the bandwidth roofline). Correctness of the same calls is
``tests/test_gpu_linear.py``'s.

Sections (``--sections``), each in a child process:

* ``linear``: the LM head [248320, 5120] at rows 1, 2, 4, 8, 32, 96 (and the MoE head
  [151936, 2048] and the drafter projections at a few rows with ``--shapes all``).
* ``head``: ``lm_head`` on the LM head at rows 1, 4, 32, 96, 256 per head format.

Times are steady-state per launch (``benchmarks.harness.time_steady``); ``time_us_synced`` is the
same call synchronised every time. Record fields: ``kernel, format, rows, n, k, shape, time_us,
time_us_synced, baseline, baseline_time_us, ratio`` (to XLA's BF16 dot at the same shape and
rows), ``ratio_vs_m1`` (to the same format's one-row time), ``bytes, gbps, ok``. ``--plot`` draws
time against rows on the LM head (also afterwards, with ``--from-json``). ``--smoke`` runs tiny
shapes in interpret mode on the CPU (checks the benchmark only).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile

from benchmarks import harness

SECTIONS = ("linear", "head")
FORMATS = ("bf16", "fp8", "fp8_block", "nvfp4")
#: (shape name, N, K, rows): the LM head, then (--shapes all) the MoE head and the drafter's
#: projections.
LM_HEAD = ("lm_head", 248320, 5120, (1, 2, 4, 8, 32, 96))
OTHER_SHAPES = (
    ("moe_lm_head", 151936, 2048, (1, 8, 96)),
    ("qkv_like", 12288, 5120, (1, 8)),
    ("up_like", 17408, 5120, (1, 8)),
    ("down_like", 5120, 17408, (1, 8)),
    ("moe_expert", 512, 2048, (1, 8)),
)
HEAD_ROWS = (1, 4, 32, 96, 256)
SMOKE_SHAPE = ("lm_head", 1024, 512, (1, 3, 12))
SMOKE_HEAD_ROWS = (1, 3, 12)


def _launches(child, est_us: float) -> int:
    """Launches per timed call: >= ~2 ms of work."""
    return 1 if child.smoke else int(min(32, max(4, math.ceil(2000.0 / est_us))))


def _weight_copies(child, nbytes: int) -> int:
    """Distinct weights to rotate through: > 2x the L2, so no launch reads a cached weight."""
    return 1 if child.smoke else int(min(64, max(1, math.ceil(2 * harness.L2_BYTES / nbytes))))


def _xs(child, m: int, k: int, copies: int):
    import jax
    import jax.numpy as jnp

    return [jax.random.normal(child.next_key(), (m, k), jnp.bfloat16) for _ in range(copies)]


def _xla_bf16(x, w):
    import jax
    import jax.numpy as jnp

    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _time(child, rec: dict, fn, sets, nbytes: int) -> None:
    child.emit(harness.measure(rec, fn, sets, n_launch=len(sets), nbytes=nbytes, smoke=child.smoke))


def _shape_block(child, name: str, n: int, k: int, rows: tuple[int, ...]) -> None:
    """Every format and row count of one shape, bracketed by XLA BF16 dots at the same rows."""
    import jax
    import jax.numpy as jnp

    import mtpjax

    est_us = max(5.0, n * k * 2 / 3.5e6)  # the BF16 weight at ~3.5 TB/s
    nw = _weight_copies(child, n * k * 2)
    w_bf16 = [jax.random.normal(child.next_key(), (n, k), jnp.bfloat16) * 0.02 for _ in range(nw)]

    def xla_pass(tag: str):
        for m in rows:
            if child.left() < 10:
                return
            sets = [
                (x, w_bf16[i % nw])
                for i, x in enumerate(_xs(child, m, k, _launches(child, est_us)))
            ]
            rec = dict(
                kernel="xla_bf16_dot", format="bf16", rows=m, n=n, k=k, shape=name, pass_=tag
            )
            _time(child, rec, _xla_bf16, sets, n * k * 2 + m * k * 2)

    xla_pass("before")
    del w_bf16
    for fmt in child.options.formats.split(","):
        ws = [
            mtpjax.quantize(jax.random.normal(child.next_key(), (n, k), jnp.bfloat16) * 0.02, fmt)
            for _ in range(_weight_copies(child, n * k // 2))
        ]
        for m in rows:
            if child.left() < 10:
                break
            xs = _xs(child, m, k, _launches(child, est_us / 2))
            fn = lambda x, w: mtpjax.linear(x, w, out_dtype=jnp.float32, implementation="pallas")  # noqa: E731
            rec = dict(kernel="linear", format=fmt, rows=m, n=n, k=k, shape=name)
            sets = [(x, ws[i % len(ws)]) for i, x in enumerate(xs)]
            _time(child, rec, fn, sets, harness.tree_bytes(ws[0]) + m * k * 2)
        del ws
    w_bf16 = [jax.random.normal(child.next_key(), (n, k), jnp.bfloat16) * 0.02 for _ in range(nw)]
    xla_pass("after")


def section_linear(child) -> None:
    if not child.smoke:
        bw = harness.copy_bandwidth()
        child.emit(dict(kernel="device_copy", format="u32", rows=0, n=0, k=0, shape="copy", **bw))
    blocks = [SMOKE_SHAPE] if child.smoke else [LM_HEAD]
    if child.options.shapes == "all" and not child.smoke:
        blocks += list(OTHER_SHAPES)
    for block in blocks:
        _shape_block(child, *block)


def section_head(child) -> None:
    import jax

    from mtpjax.config import LMHeadConfig
    from mtpjax.head import init_lm_head, lm_head

    name, n, k, _ = SMOKE_SHAPE if child.smoke else LM_HEAD
    cfg = LMHeadConfig(vocab_size=n, hidden_size=k)
    head = jax.jit(lambda p, h: lm_head(p, h, cfg=cfg))
    for fmt in child.options.formats.split(","):
        if child.left() < 20:
            break
        params = init_lm_head(cfg, key=child.next_key(), precision=fmt)
        for m in SMOKE_HEAD_ROWS if child.smoke else HEAD_ROWS:
            if child.left() < 10:
                break
            sets = [(params, x) for x in _xs(child, m, k, _launches(child, 300.0 * max(1, m / 32)))]
            rec = dict(kernel="lm_head_auto", format=fmt, rows=m, n=n, k=k, shape=name)
            _time(child, rec, head, sets, harness.tree_bytes(params.weight) + m * k * 2)
        del params


# ---------------------------------------------------------------------------------------------
# Parent: ratios, the table, the plot.
# ---------------------------------------------------------------------------------------------


def derive(records: list[dict]) -> list[dict]:
    """Attach ``baseline_time_us`` (mean of the two XLA passes), ``ratio`` and ``ratio_vs_m1``."""
    key = lambda r: (r["shape"], r["n"], r["k"], r["rows"])  # noqa: E731
    timed = [r for r in records if "time_us" in r and r.get("ok", True)]
    xla: dict[tuple, list[float]] = {}
    for r in timed:
        if r["kernel"] == "xla_bf16_dot":
            xla.setdefault(key(r), []).append(r["time_us"])
    m1 = {
        (r["kernel"], r["format"], r["shape"]): r["time_us"]
        for r in timed
        if r["rows"] == 1 and r["kernel"] in ("linear", "lm_head_auto")
    }
    for r in records:
        if r.get("kernel") not in ("linear", "lm_head_auto") or "time_us" not in r:
            continue
        base = xla.get(key(r)) or xla.get((r["shape"], r["n"], r["k"], 1))
        r["baseline"] = "xla_bf16_dot" + ("" if xla.get(key(r)) else "_m1")
        r["baseline_time_us"] = None if not base else sum(base) / len(base)
        r["baseline_spread_us"] = None if not base else max(base) - min(base)
        r["ratio"] = None if not base else r["time_us"] / r["baseline_time_us"]
        t1 = m1.get((r["kernel"], r["format"], r["shape"]))
        r["ratio_vs_m1"] = None if t1 is None else r["time_us"] / t1
    return records


def summary(records: list[dict]) -> str:
    lines = [
        f"{'kernel':<16}{'format':<10}{'shape':<12}{'rows':>5}{'time_us':>10}{'GB/s':>7}"
        f"{'XLA us':>9}{'vs XLA':>9}{'vs M=1':>8}  notes"
    ]
    f = lambda v, w, p=3: f"{v:{w}.{p}f}" if isinstance(v, float) else " " * w  # noqa: E731
    for r in records:
        kern = r.get("kernel", "_")
        if kern == "_section_error":
            lines.append(f"SECTION ERROR {r.get('section')}: {r.get('error', '')[-600:]}")
        if kern.startswith("_") or "format" not in r:
            continue
        note = "" if r.get("ok", True) else f"NOT OK {r.get('rel_err')} {r.get('error', '')[-300:]}"
        note += f" pass={r['pass_']}" if "pass_" in r else ""
        lines.append(
            f"{kern:<16}{r['format']:<10}{r['shape']:<12}{r['rows']:>5}"
            f"{f(r.get('time_us'), 10, 1)}{f(r.get('gbps'), 7, 0)}"
            f"{f(r.get('baseline_time_us'), 9, 1)}{f(r.get('ratio'), 9)}"
            f"{f(r.get('ratio_vs_m1'), 8)}  {note}"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """Time against rows on the LM head: `linear` per format and XLA's BF16 dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for kern, fmt in [("linear", fmt) for fmt in FORMATS] + [("xla_bf16_dot", "bf16")]:
        pts: dict[int, list[float]] = {}
        for r in records:
            mine = (r.get("kernel"), r.get("format"), r.get("shape")) == (kern, fmt, "lm_head")
            if mine and "time_us" in r and r.get("ok", True):
                pts.setdefault(r["rows"], []).append(r["time_us"])
        if pts:
            xs = sorted(pts)
            xla = kern == "xla_bf16_dot"
            ys = [sum(pts[x]) / len(pts[x]) for x in xs]
            label = "XLA BF16 dot" if xla else f"linear, {fmt}"
            ax.plot(xs, ys, "o", label=label, ls="--" if xla else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (M)")
    ax.set_ylabel("time per call (µs)")
    ax.set_title("LM head [248320, 5120] on one H200: linear(implementation='pallas')")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the run and its records here")
    ap.add_argument("--plot", default=None, help="draw the LM-head rows plot here (PNG)")
    ap.add_argument("--from-json", default=None, help="only re-derive, summarise and plot a JSON")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"from {','.join(SECTIONS)}")
    ap.add_argument("--shapes", default="lm_head", choices=("lm_head", "all"))
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"from {','.join(FORMATS)}")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    harness.add_child_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.child:
        return harness.child_main(args, {"linear": section_linear, "head": section_head})
    if args.from_json:
        records = derive(harness.read_records(args.from_json))
    else:
        sections = [s for s in args.sections.split(",") if s]
        extra = ["--shapes", args.shapes, "--formats", args.formats] + ["--smoke"] * args.smoke
        with tempfile.TemporaryDirectory() as tmp:
            records = harness.run_sections(
                "benchmarks.linear",
                sections,
                budget_s=args.budget_s,
                extra=extra,
                workdir=tmp,
                weights={"linear": 1.2},
            )
        records = derive(records)
        if args.json:
            env = next((r for r in records if r.get("kernel") == "_env"), {})
            run = harness.run_info("benchmarks.linear", argv, env=env)
            harness.write_records(args.json, records, run)
    print(summary(records))
    if args.plot:
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
