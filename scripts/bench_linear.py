"""Time `linear` and the LM head as the library dispatches them on the GPU, against XLA.

    PYTHONPATH=. python3 scripts/bench_linear.py --json $OUT/linear.json

``scripts/bench_kernels.py`` and ``scripts/bench_mosaic_gemv.py`` time kernels and tile
variants one by one; this script times what a user gets: ``linear(x, w, implementation=
"pallas")`` for every weight format and row count (the kernel, config and row chunking that
`mtpjax.kernels` picks), and ``lm_head`` under ``implementation="auto"`` with the verify copy
built where `verify_copy_used` says the default tier reads it. In the same child process it
times XLA's BF16 dot at the same shape and rows, twice (before and after the formats, so the
record shows the baseline's drift), and a device-to-device copy of the LM head's BF16 bytes.

Sections (``--sections``):

* ``linear``: the LM head [248320, 5120] at M = 1..128 (and the MoE head [151936, 2048] and the
  drafter projections at a few M with ``--shapes all``). Every call is checked against an F32
  dot of the dequantised weight (relative error, first launch) before it is timed.
* ``head``: ``lm_head`` on the LM head at M = 1, 4, 32, 96, 256 per head format, and whether a
  row's logits are the same bits at every row count (decode, a verify window and a batch must
  score a row alike for greedy speculative decoding to stay exact): rows 0..3 of the 256-row
  call against calls of 1, 4, 32 and 96 rows.

Times are steady-state, per launch: calls of several launches queued back to back, so the
host's per-call dispatch and sync (tens to hundreds of us) drop out; ``time_us_synced`` is the
same call synced every time, for comparison with the older results. Record fields: ``kernel,
format, rows, n, k, shape, time_us, time_us_synced, baseline, baseline_time_us, ratio`` (to XLA's BF16 dot at the same shape and rows), ``ratio_vs_m1`` (to the same format's
M=1 time), ``bytes, gbps, rel_err, ok``. ``--plot`` draws time against rows on the LM head
(from ``--json``, also afterwards with ``--from-json``). ``--smoke`` runs tiny shapes in
interpret mode on the CPU (checks the script only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_kernels as BK

SECTIONS = ("linear", "head")
FORMATS = ("bf16", "fp8", "fp8_block", "nvfp4")
LM_HEAD = ("lm_head", 248320, 5120)
LM_ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128)
#: --shapes all: (name, N, K, rows) beyond the LM head.
OTHER_SHAPES = (
    ("moe_lm_head", 151936, 2048, (1, 8, 96)),
    ("qkv_like", 12288, 5120, (1, 8)),
    ("up_like", 17408, 5120, (1, 8)),
    ("down_like", 5120, 17408, (1, 8)),
    ("moe_expert", 512, 2048, (1, 8)),
)
HEAD_ROWS = (1, 4, 32, 96, 256)
SMOKE_LINEAR = (("lm_head", 1024, 512, (1, 3, 12)),)
SMOKE_HEAD_ROWS = (1, 3, 12)
TOL = 1e-4


class Ctx(BK.Ctx):
    def __init__(self, smoke: bool, deadline: float, out_path: str, shapes: str, formats: str):
        super().__init__(smoke, deadline, out_path, "quick", shapes)
        self.formats = tuple(formats.split(","))


def _quantized(ctx, fmt: str, n: int, k: int):
    """A random ``[n, k]`` weight of ``fmt`` (quantised from a BF16 draw, as a checkpoint is)."""
    import jax
    import jax.numpy as jnp

    import mtpjax

    w = jax.random.normal(ctx.next_key(), (n, k), jnp.bfloat16) * 0.02
    return mtpjax.quantize(w, fmt)


def _leaves_bytes(tree) -> int:
    import jax

    return int(sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree)))


def _xs(ctx, m: int, k: int, copies: int):
    import jax
    import jax.numpy as jnp

    return [jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16) for _ in range(copies)]


def _launches(ctx, est_us: float) -> int:
    """Launches per timed call: >= ~2 ms of work."""
    return 2 if ctx.smoke else int(min(32, max(4, math.ceil(2000.0 / est_us))))


def _weight_copies(ctx, nbytes: int) -> int:
    """Distinct weights to rotate through: > 2x the L2, so no launch reads a cached weight."""
    return 1 if ctx.smoke else int(min(64, max(1, math.ceil(2 * BK.L2_BYTES / nbytes))))


def _emit_timed(ctx, rec: dict, fn, sets, want=None, nbytes: int | None = None):
    """Check (when ``want``) and time ``fn`` over ``sets`` into ``rec``, then emit it.

    ``time_us`` is the steady-state time per launch (calls queued back to back, so the host's
    per-call dispatch and sync drop out); ``time_us_synced`` syncs after every call."""
    BK.measure_steady(ctx, rec, fn, sets, len(sets), tol=TOL, want=want, nbytes=nbytes)
    ctx.emit(rec)


def _xla_bf16(x, w):
    import jax
    import jax.numpy as jnp

    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _shape_block(ctx, name: str, n: int, k: int, rows: tuple[int, ...]):
    """Every format and row count of one shape, bracketed by XLA BF16 dots at the same rows."""
    import jax
    import jax.numpy as jnp

    import mtpjax

    est_us = max(5.0, n * k * 2 / 3.5e6)  # the BF16 weight at ~3.5 TB/s
    nw = _weight_copies(ctx, n * k * 2)
    w_bf16 = [jax.random.normal(ctx.next_key(), (n, k), jnp.bfloat16) * 0.02 for _ in range(nw)]

    def xla_pass(tag: str):
        for m in rows:
            if ctx.left() < 10:
                return
            xs = _xs(ctx, m, k, _launches(ctx, est_us))
            sets = [(x, w_bf16[i % nw]) for i, x in enumerate(xs)]
            rec = dict(kernel="xla_bf16_dot", format="bf16", rows=m, n=n, k=k, shape=name)
            nb = n * k * 2 + m * k * 2
            _emit_timed(ctx, dict(rec, pass_=tag), _xla_bf16, sets, nbytes=nb)

    if name == "lm_head" and not ctx.smoke:
        rec = dict(kernel="device_copy", format="bf16", rows=0, n=n, k=k, shape=name)
        sets = [(w_bf16[0],)] * _launches(ctx, 2 * est_us)
        _emit_timed(ctx, rec, lambda a: a + 0, sets, nbytes=2 * n * k * 2)
    xla_pass("before")
    for fmt in ctx.formats:
        ws = [_quantized(ctx, fmt, n, k) for _ in range(_weight_copies(ctx, n * k // 2))]
        wf = mtpjax.dequantize(ws[0]).astype(jnp.float32)
        for m in rows:
            if ctx.left() < 10:
                break
            xs = _xs(ctx, m, k, _launches(ctx, est_us / 2))
            want = jnp.dot(xs[0].astype(jnp.float32), wf.T, precision="highest")
            fn = lambda x, w: mtpjax.linear(  # noqa: E731
                x, w, out_dtype=jnp.float32, implementation="pallas"
            )
            rec = dict(kernel="linear", format=fmt, rows=m, n=n, k=k, shape=name)
            nb = _leaves_bytes(ws[0]) + m * k * 2
            _emit_timed(ctx, rec, fn, [(x, ws[i % len(ws)]) for i, x in enumerate(xs)], want, nb)
        del ws, wf
    xla_pass("after")


def section_linear(ctx):
    blocks = list(SMOKE_LINEAR) if ctx.smoke else [(*LM_HEAD, LM_ROWS)]
    if ctx.shapes == "all" and not ctx.smoke:
        blocks += list(OTHER_SHAPES)
    for name, n, k, rows in blocks:
        _shape_block(ctx, name, n, k, rows)


def section_head(ctx):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mtpjax.config import LMHeadConfig
    from mtpjax.head import init_lm_head, lm_head, verify_copy_used

    name, n, k = ("lm_head", 1024, 512) if ctx.smoke else LM_HEAD
    rows = SMOKE_HEAD_ROWS if ctx.smoke else HEAD_ROWS
    cfg = LMHeadConfig(vocab_size=n, hidden_size=k)
    for fmt in ctx.formats:
        if ctx.left() < 20:
            break
        params = init_lm_head(
            cfg, key=ctx.next_key(), precision=fmt, verify_copy=verify_copy_used(fmt)
        )
        head = jax.jit(lambda p, h: lm_head(p, h, cfg=cfg))
        hidden = jax.random.normal(ctx.next_key(), (max(rows), k), jnp.bfloat16)
        full = np.asarray(head(params, hidden))
        for m in rows:
            if ctx.left() < 10:
                break
            part = np.asarray(head(params, hidden[:m]))
            r = min(m, 4)
            diff = np.abs(part[:r] - full[:r])
            ctx.emit(
                dict(
                    kernel="row_consistency",
                    format=fmt,
                    rows=m,
                    n=n,
                    k=k,
                    shape=name,
                    against_rows=max(rows),
                    bitwise=bool(np.array_equal(part[:r], full[:r])),
                    max_abs_diff=float(diff.max()),
                    argmax_equal=bool(np.array_equal(part[:r].argmax(-1), full[:r].argmax(-1))),
                    verify_copy=params.verify_weight is not None,
                )
            )
            nb = _leaves_bytes(params.weight) + m * k * 2
            sets = [(params, x) for x in _xs(ctx, m, k, _launches(ctx, 300.0 * max(1, m / 32)))]
            rec = dict(
                kernel="lm_head_auto",
                format=fmt,
                rows=m,
                n=n,
                k=k,
                shape=name,
                verify_copy=params.verify_weight is not None,
            )
            _emit_timed(ctx, rec, head, sets, nbytes=nb)
        del params


def run_child(section: str, smoke: bool, deadline: float, out_path: str, shapes: str, formats: str):
    import jax

    if smoke:
        jax.config.update("jax_platforms", "cpu")
    ctx = Ctx(smoke, deadline, out_path, shapes, formats)
    ctx.emit(
        dict(kernel="_env", section=section, jax=jax.__version__, device=str(jax.devices()[0]))
    )
    try:
        {"linear": section_linear, "head": section_head}[section](ctx)
    except Exception:
        ctx.emit(
            dict(kernel="_section_error", section=section, error=traceback.format_exc()[-3000:])
        )


# ---------------------------------------------------------------------------------------------
# Parent.
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
        if kern.startswith("_"):
            if kern == "_section_error":
                lines.append(f"SECTION ERROR {r.get('section')}: {r.get('error', '')[-600:]}")
            continue
        if kern == "row_consistency":
            lines.append(
                f"{kern:<16}{r['format']:<10}{r['shape']:<12}{r['rows']:>5}  bitwise="
                f"{r['bitwise']} max|diff|={r['max_abs_diff']:.3g} argmax_equal="
                f"{r['argmax_equal']} (vs {r['against_rows']} rows)"
            )
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
    series = [("linear", fmt) for fmt in FORMATS] + [("xla_bf16_dot", "bf16")]
    for kern, fmt in series:
        pts: dict[int, list[float]] = {}
        for r in records:
            mine = (r.get("kernel"), r.get("format"), r.get("shape")) == (kern, fmt, "lm_head")
            if mine and "time_us" in r and r.get("ok", True):
                pts.setdefault(r["rows"], []).append(r["time_us"])
        if not pts:
            continue
        xs = sorted(pts)
        label = "XLA BF16 dot" if kern == "xla_bf16_dot" else f"linear, {fmt}"
        ax.plot(
            xs,
            [sum(pts[x]) / len(pts[x]) for x in xs],
            "o",
            label=label,
            ls="--" if kern == "xla_bf16_dot" else "-",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (M)")
    ax.set_ylabel("time per call (µs)")
    ax.set_title("LM head [248320, 5120] on one H200: linear(implementation='pallas')")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write all records here (a JSON list)")
    ap.add_argument("--plot", default=None, help="draw the LM-head rows plot here (PNG)")
    ap.add_argument("--from-json", default=None, help="only re-derive, summarise and plot a JSON")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"from {','.join(SECTIONS)}")
    ap.add_argument("--shapes", default="lm_head", choices=("lm_head", "all"))
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"from {','.join(FORMATS)}")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; from {SECTIONS}")
    if set(args.formats.split(",")) - set(FORMATS):
        ap.error(f"unknown formats in {args.formats!r}; from {FORMATS}")
    if args.child:
        run_child(args.child, args.smoke, args.deadline, args.out, args.shapes, args.formats)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            records = derive(json.load(f))
    else:
        from tqdm import tqdm

        start = time.time()
        records = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, sec in enumerate(tqdm(sections, desc="sections", file=sys.stdout)):
                left = args.budget_s - (time.time() - start)
                deadline = time.time() + left * (
                    0.6 if sec == "linear" and i < len(sections) - 1 else 1.0
                )
                extra = ["--shapes", args.shapes, "--formats", args.formats]
                extra += ["--smoke"] if args.smoke else []
                path = os.path.join(tmp, f"{sec}.jsonl")
                rc, _, err, recs = BK.run_section_child(
                    __file__, sec, path, deadline, extra, grace=30
                )
                records += recs
                if rc != 0:
                    records.append(dict(kernel="_section_error", section=sec, error=err[-2000:]))
        records = derive(records)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    print(summary(records))
    if args.plot:
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
