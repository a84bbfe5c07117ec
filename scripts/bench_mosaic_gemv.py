"""Check and time the Mosaic GPU NVFP4 GEMV against the Triton kernel and XLA's BF16 GEMV.

    PYTHONPATH=. python3 scripts/bench_mosaic_gemv.py --json $OUT/mosaic.json

On one GPU, for the LM head [248320, 5120] at M = 1, 2, 4, 8 and the drafter projection
[17408, 5120] at M = 1: XLA's BF16 ``dot_general`` GEMV (the baseline), the Triton
``nvfp4_gemv`` with its default config, and :func:`pallas_kernels.gemv_mosaic.nvfp4_gemv_mosaic`
over a few tile configs. Every kernel config is first checked against ``nvfp4_gemv_reference``
(relative error) on a small odd shape and then on the timed shape. Times are medians of repeated
calls after warm-up, each timed call launching over >= 3 rotated weight copies (> 2x the 60 MB
L2 in flight), with the helpers of ``scripts/bench_kernels.py``.

The XLA/Triton measurements and the Mosaic ones run in separate child processes (a kernel that
faults cannot take the baselines down; a Mosaic config that kills its child is skipped on a
restart). Records are JSON lines while running; ``--json`` gets the list with ratios attached:
``ratio`` = time / XLA BF16 time (same shape and M), ``ratio_vs_triton`` likewise.

``--smoke`` runs tiny shapes in Mosaic GPU interpret mode on the CPU (checks the script only).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as BK

LM_HEAD = ("lm_head", 248320, 5120)
DRAFTER = ("drafter_proj", 17408, 5120)
LM_ROWS = (1, 2, 4, 8)
MIN_COPIES = 3
TOL = 2e-5


def _variants(ctx, name: str, m: int):
    """(weight layout, config) pairs to time: the default first."""
    from pallas_kernels import gemv_mosaic as GM

    n, k = {"lm_head": LM_HEAD, "drafter_proj": DRAFTER}[name][1:]
    d = GM.default_config(m, n, k)
    cfg = GM.MosaicGemvConfig
    out = [("tiled", d), ("checkpoint", d)]
    if name == "lm_head":
        out += [("tiled", cfg(block_n=128, block_k=512, stages=2))]
        if m == 1:
            out += [("relaid", d), ("tiled", cfg(block_n=64, block_k=512, stages=3))]
    if ctx.sweep and name == "lm_head" and m == 1:
        for bn, bk, st in ((64, 512, 3), (64, 256, 4), (64, 1024, 2), (128, 512, 2)):
            out.append(("checkpoint", cfg(block_n=bn, block_k=bk, stages=st)))
    return list(dict.fromkeys(out))


def _prepare(weights, layout, cfg):
    """One-time conversion of every weight copy (tiled layouts depend on the tile)."""
    from pallas_kernels import gemv_mosaic as GM

    tile = dict(block_n=cfg.block_n, block_k=cfg.block_k) if layout == "tiled" else {}
    return [(*GM.prepare_nvfp4_mosaic(w[0], w[1], layout=layout, **tile), w[2]) for w in weights]


def _prep_key(layout, cfg):
    return (layout, cfg.block_n, cfg.block_k) if layout == "tiled" else (layout,)


class Ctx(BK.Ctx):
    def __init__(self, smoke: bool, deadline: float, out_path: str, quick: bool, sweep: bool):
        super().__init__(smoke, deadline, out_path, "quick", "lm_head")
        self.quick = quick
        self.sweep = sweep


def _weight_sets(ctx, n: int, k: int):
    """>= MIN_COPIES NVFP4 weights (more while they fit in 2x L2) and their byte count."""
    first = BK._weights(ctx, "nvfp4", n, k)
    nb = BK._nbytes(first)
    copies = max(MIN_COPIES, min(8, math.ceil(2 * BK.L2_BYTES / nb)))
    return [first] + [BK._weights(ctx, "nvfp4", n, k) for _ in range(copies - 1)], nb


def _launches(ctx, nbytes: int, est_us: float) -> int:
    return 2 if ctx.smoke else BK._launches(nbytes, est_us)


def _measure(ctx, rec: dict, fn, sets, want, nbytes: int):
    """Check + time into ``rec`` (errors recorded, not raised), then emit it."""
    try:
        t, err, ok = BK._time(ctx, fn, sets, reps=1 if ctx.smoke else 7, want=want, tol=TOL)
        rec.update(time_us=t, rel_err=err, ok=ok, bytes=nbytes, gbps=nbytes / t / 1e3)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    ctx.emit(rec)


def _rec(kernel, name, m, n, k, **kw):
    return dict(kernel=kernel, format=kw.pop("fmt", "nvfp4"), rows=m, n=n, k=k, shape=name, **kw)


def _shapes(ctx):
    if ctx.smoke:
        return [("drafter_proj", 136, 256, (1,)), ("lm_head", 1021, 512, (1, 3))]
    if ctx.quick:
        return [(*LM_HEAD, (1,))]
    return [(*DRAFTER, (1,)), (*LM_HEAD, LM_ROWS)]


def child_baselines(ctx):
    """XLA BF16 GEMV and the Triton NVFP4 GEMV (default config), every shape and M."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gemv as G

    for name, n, k, rows in _shapes(ctx):
        ws = [BK._weights(ctx, "bf16", n, k)[0] for _ in range(MIN_COPIES)]
        for m in rows:
            reps = _launches(ctx, n * k * 2, n * k * 2 / 4.0e6)
            sets = [
                (jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16), ws[i % len(ws)])
                for i in range(reps)
            ]

            def xla_bf16(x, w):
                return jax.lax.dot_general(
                    x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )

            rec = _rec("xla_bf16_dot", name, m, n, k, fmt="bf16", bytes=n * k * 2)
            try:
                rec["time_us"] = BK._time(ctx, xla_bf16, sets, reps=1 if ctx.smoke else 7)
                rec["ok"] = True
            except Exception as e:
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
            ctx.emit(rec)
        del ws
        sets_w, nb = _weight_sets(ctx, n, k)
        for m in rows:
            reps = _launches(ctx, nb, nb / 3.0e6)
            sets = [
                (jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16), *sets_w[i % len(sets_w)])
                for i in range(reps)
            ]
            want = G.nvfp4_gemv_reference(*sets[0])
            cfg = G.default_config("nvfp4", m, n, k)
            rec = _rec("nvfp4_gemv_triton", name, m, n, k, config=BK._cfg_dict(cfg))
            fn = functools.partial(G.nvfp4_gemv, config=cfg, interpret=ctx.interpret)
            _measure(ctx, rec, fn, sets, want, nb)
            del want, sets
        del sets_w


def child_mosaic(ctx, skip: set[str]):
    """Small-shape check of every variant, then check + time on the real shapes."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM

    interp = ctx.interpret

    def run_id(name, m, layout, cfg, what):
        return f"{what}:{name}:{m}:{layout}:{cfg.block_n}x{cfg.block_k}x{cfg.stages}"

    def rec_for(name, m, n, k, layout, cfg, **kw):
        return _rec(
            "nvfp4_gemv_mosaic", name, m, n, k, layout=layout, config=BK._cfg_dict(cfg), **kw
        )

    # 1) Small odd shape (N=1021 padded to 1024, K=4640 padded to 4864), every variant, M=3.
    m, n, k = 3, 1021, 4640 if not ctx.smoke else 272
    lv = BK._weights(ctx, "nvfp4", n, k)
    x = jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16)
    want = G.nvfp4_gemv_reference(x, *lv)
    variants = list(
        dict.fromkeys(v for nm, *_ in _shapes(ctx) for mm in (1, 8) for v in _variants(ctx, nm, mm))
    )
    for layout, cfg in variants[:2] if ctx.smoke else variants:
        rid = run_id("small", m, layout, cfg, "check")
        if rid in skip:
            continue
        ctx.emit(dict(kernel="_start", id=rid))
        rec = rec_for("small", m, n, k, layout, cfg, check="small")
        try:
            ((p, sc, _),) = _prepare([lv], layout, cfg)
            got = GM.nvfp4_gemv_mosaic(
                x, p, sc, lv[2], n=n, layout=layout, config=cfg, interpret=interp
            )
            rec["rel_err"] = BK._rel_err(got, want)
            rec["ok"] = bool(rec["rel_err"] < TOL)
        except Exception as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
            traceback.print_exc()
        ctx.emit(rec)
    del lv, x, want

    # 2) Real shapes.
    for name, n, k, rows in _shapes(ctx):
        sets_w, nb = _weight_sets(ctx, n, k)
        # The real shapes are aligned (prepare only moves bits and tiles); N=1021 is padded.
        prepped = {}
        for mm in rows:
            for lay, c in _variants(ctx, name, mm)[: 1 if ctx.smoke else None]:
                if _prep_key(lay, c) not in prepped:
                    prepped[_prep_key(lay, c)] = _prepare(sets_w, lay, c)
        for m in rows:
            if ctx.left() < 10:
                ctx.emit(dict(kernel="_deadline", shape=name, rows=m))
                return
            reps = _launches(ctx, nb, nb / 3.0e6)
            xs = [jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16) for _ in range(reps)]
            want = G.nvfp4_gemv_reference(xs[0], *sets_w[0])
            for layout, cfg in _variants(ctx, name, m)[: 1 if ctx.smoke else None]:
                rid = run_id(name, m, layout, cfg, "time")
                if rid in skip or ctx.left() < 8:
                    continue
                ctx.emit(dict(kernel="_start", id=rid))
                rec = rec_for(
                    name, m, n, k, layout, cfg, is_default=cfg == GM.default_config(m, n, k)
                )
                ws = prepped[_prep_key(layout, cfg)]
                sets = [(xs[i], *ws[i % len(ws)]) for i in range(reps)]
                fn = functools.partial(
                    GM.nvfp4_gemv_mosaic, n=n, layout=layout, config=cfg, interpret=interp
                )
                _measure(ctx, rec, fn, sets, want, nb)
                if rec.get("error"):
                    print(rec["error"], file=sys.stderr)
                del sets
            if name == "lm_head" and m == 1 and not interp:
                for layout, cfg, skip_decode in _kernel_only_variants(ctx, m, n, k):
                    ws = prepped[_prep_key(layout, cfg)]
                    _kernel_only(ctx, xs, ws, n, k, nb, layout, cfg, skip_decode)
            del want, xs
        del sets_w, prepped


def _kernel_only_variants(ctx, m, n, k):
    from pallas_kernels import gemv_mosaic as GM

    d = GM.default_config(m, n, k)
    out = [("tiled", d, False), ("tiled", d, True)]
    return out if not ctx.smoke else []


def _kernel_only(ctx, xs, weights, n, k, nb, layout, cfg, skip_decode):
    """The pallas kernel alone (no activation prep, no output transpose); with
    ``skip_decode`` a diagnostic without the decode arithmetic (results are wrong)."""
    import jax

    from pallas_kernels import _common as C
    from pallas_kernels import gemv_mosaic as GM

    m = xs[0].shape[0]
    m_pad = C.round_up(m, 8)
    kern = GM._build_kernel(m_pad, n, k, cfg, False, layout, skip_decode=skip_decode)
    prep = jax.jit(lambda x: GM.permute_k(C.to_f16_rowscaled(x, m_pad)[0]))
    sets = [(prep(x), w[0], C.as_u8(w[1])) for x, w in zip(xs, weights * len(xs))]
    kname = "nvfp4_gemv_mosaic_" + ("nodecode_diag" if skip_decode else "kernel_only")
    rec = _rec(kname, "lm_head", m, n, k, layout=layout, config=BK._cfg_dict(cfg))
    try:
        rec["time_us"] = BK._time(ctx, kern, sets, reps=7)
        rec.update(ok=not skip_decode, bytes=nb, gbps=nb / rec["time_us"] / 1e3)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    ctx.emit(rec)


def run_child(section, smoke, deadline, out_path, skip: set[str], quick: bool, sweep: bool):
    import jax

    if smoke:
        jax.config.update("jax_platforms", "cpu")
    ctx = Ctx(smoke, deadline, out_path, quick, sweep)
    ctx.emit(
        dict(kernel="_env", section=section, jax=jax.__version__, device=str(jax.devices()[0]))
    )
    try:
        if section == "baselines":
            child_baselines(ctx)
        else:
            child_mosaic(ctx, skip)
    except Exception:
        ctx.emit(
            dict(kernel="_section_error", section=section, error=traceback.format_exc()[-3000:])
        )


# ---------------------------------------------------------------------------------------------
# Parent.
# ---------------------------------------------------------------------------------------------


def _derive(records: list[dict]) -> list[dict]:
    key = lambda r: (r["shape"], r["n"], r["k"], r["rows"])  # noqa: E731
    xla = {
        key(r): r["time_us"]
        for r in records
        if r.get("kernel") == "xla_bf16_dot" and "time_us" in r
    }
    tri = {
        key(r): r["time_us"]
        for r in records
        if r.get("kernel") == "nvfp4_gemv_triton" and r.get("ok") and "time_us" in r
    }
    for r in records:
        if r.get("kernel", "_").startswith("_") or "time_us" not in r:
            continue
        b = xla.get(key(r))
        r["baseline"] = "xla_bf16_dot_same_shape_and_rows"
        r["baseline_time_us"] = b
        r["ratio"] = None if b is None else r["time_us"] / b
        t = tri.get(key(r))
        r["triton_time_us"] = t
        r["ratio_vs_triton"] = None if t is None else r["time_us"] / t
    return records


def _summary(records: list[dict]) -> str:
    lines = []
    for r in records:
        if r.get("kernel") in ("_section_error", "_crash") or r.get("ok") is False:
            err = r.get("error") or r.get("rel_err")
            lines.append(
                f"FAIL {r.get('kernel')} {r.get('shape', '')} rows={r.get('rows', '')} "
                f"cfg={r.get('config')} {str(err)[-400:]}"
            )
    hdr = f"{'kernel':<34}{'shape':<14}{'rows':>5}{'time_us':>10}{'vs XLA':>8}{'vs Triton':>10}  config"
    lines.append(hdr)
    for r in records:
        if r.get("kernel", "_").startswith("_") or "time_us" not in r:
            continue
        cfg = r.get("config") or {}
        cs = ",".join(f"{a}={b}" for a, b in cfg.items())
        cs = f"{r['layout']}:{cs}" if r.get("layout") else cs
        fmt = lambda v, w: f"{v:{w}.3f}" if v is not None else " " * w  # noqa: E731
        lines.append(
            f"{r['kernel']:<34}{r['shape']:<14}{r['rows']:>5}{r['time_us']:>10.1f}"
            f"{fmt(r.get('ratio'), 8)}{fmt(r.get('ratio_vs_triton'), 10)}  {cs[:70]}"
            f"{'' if r.get('ok', True) else '  NOT OK'}"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write all records here (a JSON list)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    ap.add_argument("--sections", default="baselines,mosaic")
    ap.add_argument("--quick", action="store_true", help="LM head at M=1 only")
    ap.add_argument("--sweep", action="store_true", help="more tile variants and diagnostics")
    ap.add_argument("--logdir", default=None, help="keep each child's stdout/stderr here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        skip = set(filter(None, args.skip.split(",")))
        run_child(args.child, args.smoke, args.deadline, args.out, skip, args.quick, args.sweep)
        return 0

    start = time.time()
    records: list[dict] = []
    share = {"baselines": 0.35, "mosaic": 0.65}
    with tempfile.TemporaryDirectory() as tmp:
        for sec in [s for s in args.sections.split(",") if s]:
            skip: list[str] = []
            sec_end = time.time() + share.get(sec, 0.5) * (args.budget_s - (time.time() - start))
            if sec == args.sections.split(",")[-1]:
                sec_end = start + args.budget_s
            for attempt in range(3):
                path = os.path.join(tmp, f"{sec}_{attempt}.jsonl")
                extra = ["--skip", ",".join(skip)]
                extra += ["--smoke"] if args.smoke else []
                extra += ["--quick"] if args.quick else []
                extra += ["--sweep"] if args.sweep else []
                t0 = time.time()
                rc, out, err, recs = BK.run_section_child(
                    __file__, sec, path, sec_end, extra, grace=30
                )
                tail = err[-3000:]
                if args.logdir and rc != -9:
                    os.makedirs(args.logdir, exist_ok=True)
                    with open(os.path.join(args.logdir, f"{sec}_{attempt}.log"), "w") as f:
                        f.write(out + "\n---- stderr ----\n" + err)
                records.extend(r for r in recs if r.get("kernel") != "_start")
                print(
                    f"[{sec} attempt {attempt}] rc={rc} records={len(recs)} {time.time() - t0:.0f}s",
                    flush=True,
                )
                if rc == 0:
                    if tail.strip() and any(r.get("ok") is False for r in recs):
                        print(tail[-1500:], flush=True)
                    break
                started = [r["id"] for r in recs if r.get("kernel") == "_start"]
                crashed = started[-1] if started else None
                records.append(dict(kernel="_crash", section=sec, id=crashed, rc=rc, error=tail))
                print(f"child crashed in {crashed}: {tail[-1500:]}", flush=True)
                if crashed is None or time.time() > sec_end - 20:
                    break
                # Everything before the crash is recorded; the restart skips it and the crash.
                skip.extend(started)
    records = _derive(records)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print(_summary(records))
    print(f"total {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
