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
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as BK  # noqa: E402

LM_HEAD = ("lm_head", 248320, 5120)
DRAFTER = ("drafter_proj", 17408, 5120)
LM_ROWS = (1, 2, 4, 8)
MIN_COPIES = 3
TOL = 2e-5


def _mosaic_configs(name: str, m: int):
    from pallas_kernels import gemv_mosaic as GM

    cfgs = [GM.default_config(m, *({"lm_head": LM_HEAD, "drafter_proj": DRAFTER}[name][1:]))]
    if name == "lm_head":
        cfgs += [
            GM.MosaicGemvConfig(block_n=64, block_k=512, stages=4),
            GM.MosaicGemvConfig(block_n=128, block_k=256, stages=6),
            GM.MosaicGemvConfig(block_n=256, block_k=256, stages=4),
            GM.MosaicGemvConfig(block_n=64, block_k=256, stages=8),
        ]
    else:
        cfgs += [GM.MosaicGemvConfig(block_n=64, block_k=256, stages=8)]
    return list(dict.fromkeys(cfgs))


class Ctx(BK.Ctx):
    def __init__(self, smoke: bool, deadline: float, out_path: str):
        super().__init__(smoke, deadline, out_path, "quick", "lm_head")


def _weight_sets(ctx, n: int, k: int):
    """>= MIN_COPIES NVFP4 weights (more while they fit in 2x L2) and their byte count."""
    first = BK._weights(ctx, "nvfp4", n, k)
    nb = BK._nbytes(first)
    copies = max(MIN_COPIES, min(8, math.ceil(2 * BK.L2_BYTES / nb)))
    return [first] + [BK._weights(ctx, "nvfp4", n, k) for _ in range(copies - 1)], nb


def _rec(kernel, name, m, n, k, **kw):
    return dict(kernel=kernel, format=kw.pop("fmt", "nvfp4"), rows=m, n=n, k=k, shape=name, **kw)


def _shapes(ctx):
    if ctx.smoke:
        return [("lm_head", 1021, 512, (1, 3)), ("drafter_proj", 136, 256, (1,))]
    return [(*LM_HEAD, LM_ROWS), (*DRAFTER, (1,))]


def child_baselines(ctx):
    """XLA BF16 GEMV and the Triton NVFP4 GEMV (default config), every shape and M."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gemv as G

    for name, n, k, rows in _shapes(ctx):
        ws = [BK._weights(ctx, "bf16", n, k)[0] for _ in range(MIN_COPIES)]
        for m in rows:
            reps = BK._launches(n * k * 2, n * k * 2 / 4.0e6)
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
                rec["time_us"] = BK._time(ctx, xla_bf16, sets)
                rec["ok"] = True
            except Exception as e:
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
            ctx.emit(rec)
        del ws
        sets_w, nb = _weight_sets(ctx, n, k)
        for m in rows:
            reps = BK._launches(nb, nb / 3.0e6)
            sets = [
                (jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16), *sets_w[i % len(sets_w)])
                for i in range(reps)
            ]
            want = G.nvfp4_gemv_reference(*sets[0])
            cfg = G.default_config("nvfp4", m, n, k)
            rec = _rec("nvfp4_gemv_triton", name, m, n, k, config=BK._cfg_dict(cfg))
            fn = functools.partial(G.nvfp4_gemv, config=cfg, interpret=ctx.interpret)
            BK._measure(ctx, rec, fn, sets, want, nb, tol=TOL)
            del want, sets
        del sets_w


def child_mosaic(ctx, skip: set[str]):
    """Small-shape check of every config, then check + time on the real shapes."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM

    interp = ctx.interpret

    def run_id(name, m, cfg, what):
        return f"{what}:{name}:{m}:{cfg.block_n}x{cfg.block_k}x{cfg.stages}"

    # 1) Small odd shape (N=1021 padded to 1024, K=4640 padded to 4864), every config, M=3.
    m, n, k = 3, 1021, 4640 if not ctx.smoke else 272
    lv = BK._weights(ctx, "nvfp4", n, k)
    x = jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16)
    want = G.nvfp4_gemv_reference(x, *lv)
    p, s = GM.prepare_nvfp4_mosaic(lv[0], lv[1])
    all_cfgs = list(dict.fromkeys(c for nm, *_ in _shapes(ctx) for c in _mosaic_configs(nm, 1)))
    for cfg in all_cfgs:
        rid = run_id("small", m, cfg, "check")
        if rid in skip:
            continue
        ctx.emit(dict(kernel="_start", id=rid))
        rec = _rec("nvfp4_gemv_mosaic", "small", m, n, k, check="small", config=BK._cfg_dict(cfg))
        try:
            got = GM.nvfp4_gemv_mosaic(x, p, s, lv[2], n=n, config=cfg, interpret=interp)
            rec["rel_err"] = BK._rel_err(got, want)
            rec["ok"] = bool(rec["rel_err"] < TOL)
        except Exception as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
            traceback.print_exc()
        ctx.emit(rec)
    del lv, x, want, p, s

    # 2) Real shapes.
    for name, n, k, rows in _shapes(ctx):
        sets_w, nb = _weight_sets(ctx, n, k)
        if ctx.smoke:  # N=1021 needs the one-time padding; the real shapes are aligned.
            prepped = [(*GM.prepare_nvfp4_mosaic(w[0], w[1]), w[2]) for w in sets_w]
        else:
            prepped = sets_w
        for m in rows:
            if ctx.left() < 10:
                ctx.emit(dict(kernel="_deadline", shape=name, rows=m))
                return
            reps = BK._launches(nb, nb / 3.0e6)
            xs = [jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16) for _ in range(reps)]
            want = G.nvfp4_gemv_reference(xs[0], *sets_w[0])
            sets = [(xs[i], *prepped[i % len(prepped)]) for i in range(reps)]
            for cfg in _mosaic_configs(name, m):
                rid = run_id(name, m, cfg, "time")
                if rid in skip:
                    continue
                ctx.emit(dict(kernel="_start", id=rid))
                rec = _rec(
                    "nvfp4_gemv_mosaic",
                    name,
                    m,
                    n,
                    k,
                    config=BK._cfg_dict(cfg),
                    is_default=cfg == GM.default_config(m, n, k),
                )
                fn = functools.partial(GM.nvfp4_gemv_mosaic, n=n, config=cfg, interpret=interp)
                BK._measure(ctx, rec, fn, sets, want, nb, tol=TOL)
                if rec.get("error"):
                    print(rec["error"], file=sys.stderr)
            del want, sets, xs
        del sets_w, prepped


def run_child(section: str, smoke: bool, deadline: float, out_path: str, skip: set[str]):
    import jax

    if smoke:
        jax.config.update("jax_platforms", "cpu")
    ctx = Ctx(smoke, deadline, out_path)
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
    hdr = f"{'kernel':<22}{'shape':<14}{'rows':>5}{'time_us':>10}{'vs XLA':>8}{'vs Triton':>10}  config"
    lines.append(hdr)
    for r in records:
        if r.get("kernel", "_").startswith("_") or "time_us" not in r:
            continue
        cfg = r.get("config") or {}
        cs = ",".join(f"{a}={b}" for a, b in cfg.items())
        fmt = lambda v, w: f"{v:{w}.3f}" if v is not None else " " * w  # noqa: E731
        lines.append(
            f"{r['kernel']:<22}{r['shape']:<14}{r['rows']:>5}{r['time_us']:>10.1f}"
            f"{fmt(r.get('ratio'), 8)}{fmt(r.get('ratio_vs_triton'), 10)}  {cs[:70]}"
            f"{'' if r.get('ok', True) else '  NOT OK'}"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write all records here (a JSON list)")
    ap.add_argument("--budget-s", type=float, default=210.0, help="wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    ap.add_argument("--sections", default="baselines,mosaic")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(
            args.child, args.smoke, args.deadline, args.out, set(filter(None, args.skip.split(",")))
        )
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
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    sec,
                    "--out",
                    path,
                    "--deadline",
                    str(sec_end),
                    "--skip",
                    ",".join(skip),
                ]
                if args.smoke:
                    cmd.append("--smoke")
                env = dict(os.environ)
                env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
                t0 = time.time()
                try:
                    proc = subprocess.run(
                        cmd,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=max(30.0, sec_end - time.time() + 30),
                    )
                    rc, tail = proc.returncode, (proc.stderr or "")[-3000:]
                except subprocess.TimeoutExpired as e:
                    rc, tail = -9, f"timeout: {str(e.stderr or '')[-2000:]}"
                recs = []
                if os.path.exists(path):
                    with open(path) as f:
                        recs = [json.loads(line) for line in f if line.strip()]
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
