"""Check and time the Mosaic GPU GEMVs (NVFP4, FP8 per-row; 1 to 128 rows) on one GPU.

The fused epilogue and the 11-op checkpoint decode against the earlier kernel, same run:

    PYTHONPATH=. python3 scripts/bench_mosaic_gemv.py --sections epilogue --budget-s 240 \
        --json $OUT/epilogue.json --logdir $OUT/logs

FP8 block-128 (one run, under 4 minutes incl. compiles):

    PYTHONPATH=. python3 scripts/bench_mosaic_gemv.py --sections mosaic_fp8_block \
        --budget-s 200 --json $OUT/fp8_block.json --logdir $OUT/logs

The many-row and FP8 sections (one run, under 4 minutes incl. compiles):

    MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=. python3 scripts/bench_mosaic_gemv.py \
        --sections mosaic_rows,mosaic_fp8 --budget-s 200 \
        --json $OUT/mosaic_rows_fp8.json --logdir $OUT/logs

(``MOSAIC_GPU_DUMP_PTXAS=1``, a Mosaic GPU debug switch, should put ptxas's register and spill
report of every compiled kernel into the children's logs; the CPU cannot produce it.)

Both new sections make a first pass (the default configs and every baseline, all M) before a
second (alternative tiles and layouts), so a short budget cuts alternatives first; the rows
section gets 45% of the budget, the FP8 section the rest.

Sections (``--sections``, default ``baselines,mosaic``, the measured M=1..8 run):

* ``baselines``: XLA's BF16 ``dot_general`` GEMV and the Triton ``nvfp4_gemv`` (default config)
  on the drafter projection [17408, 5120] at M=1 and the LM head [248320, 5120] at M=1, 2, 4, 8.
* ``mosaic``: :func:`pallas_kernels.gemv_mosaic.nvfp4_gemv_mosaic` on the same shapes over a few
  weight layouts and tile configs.
* ``mosaic_rows``: the NVFP4 Mosaic kernel at M = 16, 32, 64, 96, 128 on the LM head (default
  config, the other CTA width, the tiled layout), against the Triton verify GEMM
  (``verify_gemm_nvfp4`` on the ``make_transposed`` copy) at the same M, the Triton batched
  GEMV at M = 16, 32, and the Mosaic M=1 GEMV. Target: verify-regime rows at 32 and 96 <= 1.6x
  the same format's M=1 GEMV (``ratio_vs_m1``).
* ``mosaic_fp8``: :func:`pallas_kernels.gemv_mosaic.fp8_row_gemv_mosaic` at M = 1, 2, 4, 8, 32,
  96 on the LM head and M = 1, 8 on the MoE LM head [151936, 2048], against the Triton
  ``fp8_row_gemv`` (M <= 32), ``verify_gemm_fp8_row`` (M >= 16), XLA's BF16 GEMV and XLA's FP8
  dequant+dot at the same shape and M. Targets: M=1 <= 0.55x XLA BF16 (``ratio``); M=2..8 <=
  1.15x of M=1 (``ratio_vs_m1``).
* ``mosaic_fp8_block``: :func:`pallas_kernels.gemv_mosaic.fp8_block_gemv_mosaic` (DeepSeek-V3
  block-128 FP8) checked on a small odd shape (M=3, 96; N=1021, K=4640), then on the LM head at
  M = 1, 8, 32, 64, 96 and on [12288, 5120] at M = 1, 8 (each checked on its first launch)
  against the Triton ``fp8_block_gemv`` (M <= 32), XLA's BF16 GEMV and the Mosaic
  ``fp8_row_gemv_mosaic`` (the per-row kernel it should approach, ``ratio_vs_fp8_row_mosaic``)
  at the same shape and M; rows 0, 37, 95 of the 96-row call against the same rows alone (bit
  for bit); then, budget permitting, a few other tiles (``FP8_BLOCK_EXTRA``). Times are
  steady-state (``bench_kernels.time_steady``: calls queued back to back, ``time_us``; with a
  sync after each call, ``synced_us``).
* ``fp8_tiles``: both FP8 kernels at M = 64, 96, 128 on the LM head over ``FP8_TILES`` (128-wide
  K steps fit two or three CTAs per SM where 256-wide ones fit one), each checked on its first
  launch, and XLA's BF16 GEMV at the same M; steady-state.
* ``epilogue``: on the LM head, NVFP4 M=1 (checkpoint and tiled), FP8 M=1, NVFP4 and FP8 M=96
  (default configs), the whole call (``variant="fused"``) against the earlier path
  (``"legacy"``: the kernel's raw accumulator written transposed, f32[N, m_pad], scaled and
  transposed back by XLA; the 15-op checkpoint decode), both checked, then NVFP4 M=8; every
  variant of one (format, rows) timed in 5 interleaved rounds (``time_us`` the median, the
  rounds in ``round_times_us``). At M=1 also the kernel
  alone (activations prepared outside the timed call) with each epilogue and, for the NVFP4
  checkpoint layout, each decode (``*_kernel_only``; the fused ones checked). At M=96, rows
  0, 37, 95 of the call against the same rows computed alone (``*_row_identity``, bit for bit,
  with the M=1 default config and with the 96-row config). First, on small odd shapes (M=5,
  13, 96; N=1021), the fused output against the earlier path, bit for bit
  (``*_vs_legacy``; where they differ, the rows and columns).

Every kernel config is first checked against its ``*_reference`` (relative error): the new
defaults on a small odd shape, every timed variant on the timed shape (its first launch). Times
are medians of repeated calls after warm-up, each timed call launching over >= 3 rotated weight
copies (> 2x the 60 MB L2 in flight), with the helpers of ``scripts/bench_kernels.py``.

Each section runs in its own child process (a kernel that faults cannot take the others down;
a variant that kills its child is skipped on a restart), and every variant in try/except.
Records are JSON lines while running; ``--json`` gets the list with ratios attached: ``ratio`` =
time / XLA BF16 time (same shape and M), ``ratio_vs_triton`` = time / the Triton GEMV of the
same format (same shape and M), ``ratio_vs_m1`` = time / the fastest M=1 GEMV of the same format
and shape in the run.

``--smoke`` runs tiny shapes in Mosaic GPU (and Triton) interpret mode on the CPU, by default
every section (checks the script only).
"""

from __future__ import annotations

import argparse
import dataclasses
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
MOE_HEAD = ("moe_lm_head", 151936, 2048)
LM_ROWS = (1, 2, 4, 8)
#: mosaic_rows: rows of the verify regime (batch x (K+1) <= 96) and the B=64 propose head.
MANY_ROWS = (16, 32, 64, 96, 128)
#: mosaic_fp8: (shape, rows) timed.
FP8_SHAPES = ((*LM_HEAD, (1, 2, 4, 8, 32, 96)), (*MOE_HEAD, (1, 8)))
QKV = ("qkv_like", 12288, 5120)
#: mosaic_fp8_block: (shape, rows) timed; the default configs, then ``FP8_BLOCK_EXTRA``.
FP8_BLOCK_SHAPES = ((*LM_HEAD, (1, 8, 32, 64, 96)), (*QKV, (1, 8)))
#: mosaic_fp8_block: alternative tiles timed after every default (a short budget cuts them):
#: (rows, config fields) on the LM head; the other CTA width, and 512-wide K steps at M=1.
FP8_BLOCK_EXTRA = (
    (1, dict(block_n=64, block_k=512, stages=2)),
    (8, dict(block_n=128, block_k=256, stages=2)),
    (64, dict(block_n=128, block_k=256, stages=2)),
    (96, dict(block_n=64, block_k=256, stages=2)),
)
SECTIONS = (
    "baselines",
    "mosaic",
    "mosaic_rows",
    "mosaic_fp8",
    "epilogue",
    "mosaic_fp8_block",
    "fp8_tiles",
)
#: fp8_tiles: rows where one CTA per SM idles its tensor cores while it decodes, and the tiles
#: tried there (128-wide K steps leave room for two or three CTAs per SM).
FP8_TILE_ROWS = (96, 64, 128)  # most important first: a short budget cuts the last
FP8_TILES = ((128, 256, 2), (64, 256, 2), (128, 128, 2), (64, 128, 2), (64, 128, 3), (128, 128, 3))
#: epilogue: (format, rows, NVFP4 layouts) on the LM head, fused vs the earlier kernel, most
#: important first (a short budget cuts the last).
EPILOGUE_PLAN = (
    ("nvfp4", 1, ("checkpoint", "tiled")),
    ("fp8_row", 1, ("checkpoint",)),
    ("nvfp4", 96, ("checkpoint",)),
    ("fp8_row", 96, ("checkpoint",)),
    ("nvfp4", 8, ("checkpoint",)),
)
#: epilogue: interleaved timing rounds per (format, rows).
EPILOGUE_ROUNDS = 5
#: Rows of a 96-row call compared bit for bit with the same row computed alone.
IDENTITY_ROWS = (0, 37, 95)
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


def _weight_sets(ctx, n: int, k: int, fmt: str = "nvfp4"):
    """>= MIN_COPIES weights (more while they fit in 2x L2) and their byte count."""
    first = BK._weights(ctx, fmt, n, k)
    nb = BK._nbytes(first)
    copies = max(MIN_COPIES, min(8, math.ceil(2 * BK.L2_BYTES / nb)))
    return [first] + [BK._weights(ctx, fmt, n, k) for _ in range(copies - 1)], nb


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


def _xla_bf16(x, w):
    """XLA's BF16 GEMV, the baseline of every ratio: bf16[M, K] x bf16[N, K] -> f32[M, N]."""
    import jax
    import jax.numpy as jnp

    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _xla_fp8_row(x, q, scale):
    """XLA's FP8 per-row dequant + dot (as ``scripts/bench_kernels.py`` times it)."""
    import jax.numpy as jnp

    return _xla_bf16(x, q.astype(jnp.bfloat16)) * scale[None, :]


def _time_only(ctx, rec: dict, fn, sets):
    """Time an unchecked baseline into ``rec`` (errors recorded, not raised), then emit it."""
    try:
        rec["time_us"] = BK._time(ctx, fn, sets, reps=1 if ctx.smoke else 7)
        rec["ok"] = True
        if rec.get("bytes"):
            rec["gbps"] = rec["bytes"] / rec["time_us"] / 1e3
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
    ctx.emit(rec)


def _check_small(ctx, skip: set[str], rid: str, rec: dict, fn, args, want):
    """One checked call on a small shape into ``rec`` (a restart skips ``rid``)."""
    if rid in skip:
        return
    ctx.emit(dict(kernel="_start", id=rid))
    try:
        rec["rel_err"] = BK._rel_err(fn(*args), want)
        rec["ok"] = bool(rec["rel_err"] < TOL)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
        traceback.print_exc()
    ctx.emit(rec)


def _timed_variant(ctx, skip: set[str], rid: str, rec: dict, fn, xs, weights, want, nb: int):
    """Check (first launch against ``want``) and time ``fn(x, *weights)`` over rotated copies."""
    if rid in skip or ctx.left() < 8:
        return
    ctx.emit(dict(kernel="_start", id=rid))
    sets = [(x, *weights[i % len(weights)]) for i, x in enumerate(xs)]
    _measure(ctx, rec, fn, sets, want, nb)
    if rec.get("error"):
        print(rec["error"], file=sys.stderr)


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

            rec = _rec("xla_bf16_dot", name, m, n, k, fmt="bf16", bytes=n * k * 2)
            _time_only(ctx, rec, _xla_bf16, sets)
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
        rec = rec_for("small", m, n, k, layout, cfg, check="small")
        ((p, sc, _),) = _prepare([lv], layout, cfg)
        fn = functools.partial(
            GM.nvfp4_gemv_mosaic, n=n, layout=layout, config=cfg, interpret=interp
        )
        rid = run_id("small", m, layout, cfg, "check")
        _check_small(ctx, skip, rid, rec, fn, (x, p, sc, lv[2]), want)
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
                rec = rec_for(
                    name, m, n, k, layout, cfg, is_default=cfg == GM.default_config(m, n, k)
                )
                fn = functools.partial(
                    GM.nvfp4_gemv_mosaic, n=n, layout=layout, config=cfg, interpret=interp
                )
                rid = run_id(name, m, layout, cfg, "time")
                ws = prepped[_prep_key(layout, cfg)]
                _timed_variant(ctx, skip, rid, rec, fn, xs, ws, want, nb)
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
    """The pallas kernel alone (no activation prep; its fused epilogue writes the final output);
    with ``skip_decode`` a diagnostic without the decode arithmetic (results are wrong)."""
    m = xs[0].shape[0]
    kern = _kernel_for("nvfp4", m, n, k, cfg, layout, False, skip_decode=skip_decode)
    sets = _kernel_sets(ctx, "nvfp4", xs, weights, k, cfg)
    kname = "nvfp4_gemv_mosaic_" + ("nodecode_diag" if skip_decode else "kernel_only")
    rec = _rec(kname, "lm_head", m, n, k, layout=layout, config=BK._cfg_dict(cfg))
    try:
        rec["time_us"] = BK._time(ctx, kern, sets, reps=7)
        rec.update(ok=not skip_decode, bytes=nb, gbps=nb / rec["time_us"] / 1e3)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    ctx.emit(rec)


def _kernel_for(fmt, m, n, k, cfg, layout, interpret, *, legacy=False, **kw):
    """The bare kernel: fused epilogue and 11-op decode, or with ``legacy`` the earlier one
    (raw transposed output, the 15-op checkpoint decode)."""
    from pallas_kernels import gemv_mosaic as GM

    if legacy:
        kw.update(epilogue="transposed", terms_decode=True)
    return GM._build_kernel(m, n, k, cfg, interpret, layout, fmt=fmt, **kw)


def _kernel_sets(ctx, fmt, xs, weights, k, cfg, *, legacy=False):
    """The bare kernel's operands per launch: activations prepared outside the timed call."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import _common as C
    from pallas_kernels import gemv_mosaic as GM

    prep = jax.jit(lambda x: GM._prepare_x(x, k, fmt))
    sets = []
    for i, x in enumerate(xs):
        w = weights[i % len(weights)]
        x16, xinv = prep(x)
        rowf = jnp.pad(xinv, (0, x16.shape[0] - xinv.shape[0]))
        if fmt == "fp8_row":
            colf = jnp.pad(w[1], (0, C.round_up(w[1].shape[0], cfg.block_n) - w[1].shape[0]))
            ops = (C.as_u8(w[0]),) if legacy else (rowf, C.as_u8(w[0]), colf)
        else:
            rowf = rowf * (jnp.asarray(w[2], jnp.float32) * C.E2M1_F16_UNBIAS)
            ops = (w[0], C.as_u8(w[1])) if legacy else (rowf, w[0], C.as_u8(w[1]))
        sets.append((x16, *ops))
    return sets


def _legacy_gemv(fmt, x, *w, n, layout="checkpoint", config=None, interpret=False):
    """The earlier whole call: the kernel with the 15-op checkpoint decode writes its raw
    accumulator transposed, f32[N, m_pad], and XLA applies the factors to the transposed slice
    and transposes it back (as ``gemv_mosaic`` did before its fused epilogue)."""
    import jax.numpy as jnp

    from pallas_kernels import _common as C
    from pallas_kernels import gemv_mosaic as GM

    m = x.shape[0]
    if fmt == "fp8_row":
        nw, kw = w[0].shape
    elif layout == "tiled":
        nt, kt, bn, bkh = w[0].shape
        nw, kw = nt * bn, kt * bkh * 2
    else:
        nw, kw = w[0].shape[0], w[0].shape[1] * 2
    config = config or GM.default_config(m, nw, kw, fmt=fmt)
    x16, xinv = GM._prepare_x(x, kw, fmt)
    kern = _kernel_for(fmt, m, nw, kw, config, layout, interpret, legacy=True)
    if fmt == "fp8_row":
        out_t = kern(x16, C.as_u8(w[0]))
        return (out_t[:n, :m] * w[1].astype(jnp.float32)[:n, None] * xinv[None, :]).T
    out_t = kern(x16, w[0], C.as_u8(w[1]))
    gscale = jnp.asarray(w[2], jnp.float32) * C.E2M1_F16_UNBIAS
    return (out_t[:n, :m] * (xinv * gscale)[None, :]).T


def _xs(ctx, m: int, k: int, reps: int):
    import jax
    import jax.numpy as jnp

    return [jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16) for _ in range(reps)]


def _cfg_id(cfg) -> str:
    return "default" if cfg is None else f"{cfg.block_n}x{cfg.block_k}x{cfg.stages}"


def _rows_variants(ctx, m: int, n: int, k: int, extra: bool):
    """NVFP4 (layout, config) pairs at ``m`` rows: the default, or with ``extra`` the other CTA
    width and the tiled layout (and with --sweep a 3-stage pipeline)."""
    from pallas_kernels import gemv_mosaic as GM

    d = GM.default_config(m, n, k)
    if not extra:
        return [("checkpoint", d)]
    if m == 1:
        return [("tiled", d)]
    other = GM.MosaicGemvConfig(block_n=64 if d.block_n == 128 else 128, block_k=256, stages=2)
    out = [("checkpoint", other), ("tiled", d)]
    if ctx.sweep:
        out.append(("checkpoint", dataclasses.replace(d, stages=3)))
    return out


def _fp8_variants(ctx, m: int, n: int, k: int, extra: bool):
    """FP8 configs at ``m`` rows: the default, or with ``extra`` a few alternatives."""
    from pallas_kernels import gemv_mosaic as GM

    d = GM.default_config(m, n, k, fmt="fp8_row")
    if not extra:
        return [d]
    cfg = GM.MosaicGemvConfig
    if m <= 8:
        out = [cfg(block_n=64, block_k=512, stages=2), cfg(block_n=128, block_k=256, stages=2)]
        if m in (1, 8):
            out.append(cfg(block_n=64, block_k=256, stages=3))
        if ctx.sweep:
            out += [cfg(block_n=64, block_k=256, stages=4), cfg(block_n=128, block_k=512)]
    else:
        out = [cfg(block_n=64 if d.block_n == 128 else 128, block_k=256, stages=2)]
    return [c for c in out if c != d]


def _pass_rows(ctx, rows: tuple[int, ...], extra: bool) -> tuple[int, ...]:
    """Rows of one pass; the smoke run's second pass (alternatives) takes the first and last."""
    return tuple(dict.fromkeys((rows[0], rows[-1]))) if ctx.smoke and extra else rows


def child_mosaic_rows(ctx, skip: set[str]):
    """NVFP4 Mosaic at 16..128 rows against the Triton verify GEMM and batched GEMV."""
    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM
    from pallas_kernels import verify_gemm as V

    interp = ctx.interpret

    # 1) Small odd shape (N=1021 padded to 1024, K=4640 to 4864), the new defaults (each timed
    # variant is checked on its timed shape too).
    n, k = (1021, 4640) if not ctx.smoke else (130, 272)
    lv = BK._weights(ctx, "nvfp4", n, k)
    packed, scale = GM.prepare_nvfp4_mosaic(lv[0], lv[1])
    for m in (33, 128) if not ctx.smoke else (33,):
        x = _xs(ctx, m, k, 1)[0]
        cfg = GM.default_config(m, *packed.shape)
        rec = _rec("nvfp4_gemv_mosaic", "small", m, n, k, config=BK._cfg_dict(cfg), check="small")
        fn = functools.partial(GM.nvfp4_gemv_mosaic, n=n, interpret=interp)
        want = G.nvfp4_gemv_reference(x, *lv)
        _check_small(ctx, skip, f"check:rows:{m}", rec, fn, (x, packed, scale, lv[2]), want)
    del lv, packed, scale

    # 2) The LM head: a first pass with the defaults and the Triton kernels, then alternatives.
    name, n, k = LM_HEAD if not ctx.smoke else ("lm_head", 136, 512)
    rows = MANY_ROWS if not ctx.smoke else (16, 96)
    sets_w, nb = _weight_sets(ctx, n, k)
    prepped = {}
    transposed = []
    for extra in (False, True):
        for m in _pass_rows(ctx, (1, *rows), extra):
            if ctx.left() < 10:
                ctx.emit(dict(kernel="_deadline", shape=name, rows=m, extra=extra))
                return
            xs = _xs(ctx, m, k, _launches(ctx, nb, nb / 3.0e6))
            want = G.nvfp4_gemv_reference(xs[0], *sets_w[0])
            for layout, cfg in _rows_variants(ctx, m, n, k, extra):
                key = _prep_key(layout, cfg)
                if key not in prepped:
                    prepped[key] = _prepare(sets_w, layout, cfg)
                rec = _rec(
                    "nvfp4_gemv_mosaic",
                    name,
                    m,
                    n,
                    k,
                    layout=layout,
                    config=BK._cfg_dict(cfg),
                    is_default=cfg == GM.default_config(m, n, k),
                )
                fn = functools.partial(
                    GM.nvfp4_gemv_mosaic, n=n, layout=layout, config=cfg, interpret=interp
                )
                rid = f"rows:{m}:{layout}:{_cfg_id(cfg)}"
                _timed_variant(ctx, skip, rid, rec, fn, xs, prepped[key], want, nb)
            if not extra and m > 1:
                if not transposed:
                    transposed = [V.make_transposed("nvfp4", *w) for w in sets_w]
                rec = _rec("nvfp4_verify_gemm_triton", name, m, n, k, config=None)
                fn = functools.partial(V.verify_gemm_nvfp4, n=n, interpret=interp)
                _timed_variant(ctx, skip, f"verify:{m}", rec, fn, xs, transposed, want, nb)
            if not extra and 1 < m <= G.MAX_ROWS:
                rec = _rec("nvfp4_gemv_triton", name, m, n, k, config=None)
                fn = functools.partial(G.nvfp4_gemv, interpret=interp)
                _timed_variant(ctx, skip, f"triton:{m}", rec, fn, xs, sets_w, want, nb)
            del xs, want


def child_mosaic_fp8(ctx, skip: set[str]):
    """FP8 per-row Mosaic against the Triton FP8 GEMV / verify GEMM and XLA."""
    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM

    interp = ctx.interpret

    # 1) Small odd shape (N=1021 padded to 1024, K=4640 to 4736), the defaults (each timed
    # variant is checked on its timed shape too).
    n, k = (1021, 4640) if not ctx.smoke else (131, 200)
    q, scale = BK._weights(ctx, "fp8_row", n, k)
    qp, sp = GM.prepare_fp8_row_mosaic(q, scale)
    for m, cfg in ((3, None), (96, None)):
        x = _xs(ctx, m, k, 1)[0]
        rec = _rec(
            "fp8_row_gemv_mosaic",
            "small",
            m,
            n,
            k,
            fmt="fp8_row",
            config=BK._cfg_dict(cfg),
            check="small",
        )
        fn = functools.partial(GM.fp8_row_gemv_mosaic, n=n, config=cfg, interpret=interp)
        want = G.fp8_row_gemv_reference(x, q, scale)
        _check_small(ctx, skip, f"check:fp8:{m}:{_cfg_id(cfg)}", rec, fn, (x, qp, sp), want)
    del q, scale, qp, sp

    # 2) Timed shapes: a first pass with the defaults and every baseline, then alternatives.
    shapes = FP8_SHAPES if not ctx.smoke else (("lm_head", 136, 512, (1, 8, 96)),)
    weights, bf16, transposed = {}, {}, {}
    for extra in (False, True):
        for name, n, k, rows in shapes:
            if name not in weights:
                weights[name] = _weight_sets(ctx, n, k, "fp8_row")
            sets_w, nb = weights[name]
            for m in _pass_rows(ctx, rows, extra):
                if ctx.left() < 10:
                    ctx.emit(dict(kernel="_deadline", shape=name, rows=m, extra=extra))
                    return
                xs = _xs(ctx, m, k, _launches(ctx, nb, nb / 3.0e6))
                want = G.fp8_row_gemv_reference(xs[0], *sets_w[0])
                d = GM.default_config(m, n, k, fmt="fp8_row")
                for cfg in _fp8_variants(ctx, m, n, k, extra):
                    rec = _rec(
                        "fp8_row_gemv_mosaic",
                        name,
                        m,
                        n,
                        k,
                        fmt="fp8_row",
                        config=BK._cfg_dict(cfg),
                        is_default=cfg == d,
                    )
                    fn = functools.partial(GM.fp8_row_gemv_mosaic, config=cfg, interpret=interp)
                    rid = f"fp8:{name}:{m}:{_cfg_id(cfg)}"
                    _timed_variant(ctx, skip, rid, rec, fn, xs, sets_w, want, nb)
                if not extra:
                    _fp8_baselines(ctx, skip, name, m, n, k, xs, weights, bf16, transposed, want)
                del xs, want


def _fp8_baselines(ctx, skip, name, m, n, k, xs, weights, bf16, transposed, want):
    """The Triton FP8 GEMV (M <= 32) and verify GEMM (M >= 16), XLA's FP8 dequant+dot (all
    checked against ``want``) and XLA's BF16 GEMV on a BF16 weight of the same shape."""
    from pallas_kernels import gemv as G
    from pallas_kernels import verify_gemm as V

    sets_w, nb = weights[name]
    if m <= G.MAX_ROWS:
        rec = _rec("fp8_row_gemv_triton", name, m, n, k, fmt="fp8_row")
        fn = functools.partial(G.fp8_row_gemv, interpret=ctx.interpret)
        _timed_variant(ctx, skip, f"fp8_triton:{name}:{m}", rec, fn, xs, sets_w, want, nb)
    if m >= 16:
        if name not in transposed:
            transposed[name] = [V.make_transposed("fp8_row", *w) for w in sets_w]
        rec = _rec("fp8_row_verify_gemm_triton", name, m, n, k, fmt="fp8_row")
        fn = functools.partial(V.verify_gemm_fp8_row, n=n, interpret=ctx.interpret)
        rid = f"fp8_verify:{name}:{m}"
        _timed_variant(ctx, skip, rid, rec, fn, xs, transposed[name], want, nb)
    rec = _rec("xla_fp8_row_dequant_dot", name, m, n, k, fmt="fp8_row")
    _timed_variant(ctx, skip, f"fp8_xla:{name}:{m}", rec, _xla_fp8_row, xs, sets_w, want, nb)
    if name not in bf16:
        bf16[name] = [BK._weights(ctx, "bf16", n, k) for _ in range(MIN_COPIES)]
    sets = [(x, *bf16[name][i % MIN_COPIES]) for i, x in enumerate(xs)]
    _time_only(
        ctx, _rec("xla_bf16_dot", name, m, n, k, fmt="bf16", bytes=n * k * 2), _xla_bf16, sets
    )


def child_epilogue(ctx, skip: set[str]):
    """Fused epilogue and 11-op checkpoint decode against the earlier kernel, same run."""
    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM

    interp = ctx.interpret
    # 1) Small odd shapes: the fused output against the earlier path, bit for bit.
    n, k = (1021, 4640) if not ctx.smoke else (131, 272)
    for fmt, m in (("nvfp4", 5), ("fp8_row", 13), ("nvfp4", 96)):
        _fused_vs_legacy(ctx, skip, fmt, m, n, k)

    # 2) The LM head: per (format, rows), every variant checked, then timed in interleaved
    # rounds (A B C A B C ...), so drift in clocks or memory state hits all alike.
    name, n, k = LM_HEAD if not ctx.smoke else ("lm_head", 136, 512)
    weights = {}
    for fmt, m, layouts in EPILOGUE_PLAN:
        if fmt not in weights:
            weights[fmt] = _weight_sets(ctx, n, k, fmt)
        sets_w, nb = weights[fmt]
        if ctx.left() < 15:
            ctx.emit(dict(kernel="_deadline", shape=name, rows=m, format=fmt))
            return
        xs = _xs(ctx, m, k, _launches(ctx, nb, nb / 3.0e6))
        want = G.KERNELS[fmt][1](xs[0], *sets_w[0])
        public = GM.nvfp4_gemv_mosaic if fmt == "nvfp4" else GM.fp8_row_gemv_mosaic
        entries, identity = [], None
        for layout in layouts:
            cfg = GM.default_config(m, n, k, fmt=fmt)
            ws = sets_w if layout == "checkpoint" else _prepare(sets_w, layout, cfg)
            kw = dict(n=n, config=cfg, interpret=interp)
            if fmt == "nvfp4":
                kw["layout"] = layout
            base = dict(layout=layout, config=BK._cfg_dict(cfg), fmt=fmt)
            whole = [(x, *ws[i % len(ws)]) for i, x in enumerate(xs)]
            for variant, fn in (
                ("fused", functools.partial(public, **kw)),
                ("legacy", functools.partial(_legacy_gemv, fmt, **kw)),
            ):
                rec = _rec(f"{fmt}_gemv_mosaic", name, m, n, k, variant=variant, **base)
                entries.append((f"epi:{fmt}:{m}:{layout}:{variant}", rec, fn, whole, want))
            if m == 1:
                # (fused epilogue, 11-op decode): the split of the difference between the two.
                for fused, terms in ((True, False), (False, True), (True, True), (False, False)):
                    if terms and (fmt == "fp8_row" or layout != "checkpoint"):
                        continue  # only the NVFP4 checkpoint decode differs
                    variant = ("fused" if fused else "transposed") + (
                        ",15op_decode" if terms else ""
                    )
                    rec = _rec(
                        f"{fmt}_gemv_mosaic_kernel_only", name, m, n, k, variant=variant, **base
                    )
                    epi = "fused" if fused else "transposed"
                    kern = _kernel_for(
                        fmt, m, n, k, cfg, layout, interp, epilogue=epi, terms_decode=terms
                    )
                    sets = _kernel_sets(ctx, fmt, xs, ws, k, cfg, legacy=not fused)
                    # The fused kernel's output is the final one: checked like the whole call.
                    rid = f"epi_kernel:{fmt}:{m}:{layout}:{variant}"
                    entries.append((rid, rec, kern, sets, want if fused else None))
            elif identity is None and m > max(IDENTITY_ROWS):
                identity = (layout, ws[0], kw)
        _interleaved(ctx, skip, entries, nb, rounds=1 if ctx.smoke else EPILOGUE_ROUNDS)
        if identity is not None:
            layout, w, kw = identity
            _row_identity(ctx, skip, fmt, name, n, k, xs[0], w, layout, public, kw)
        del xs, want, entries


def _interleaved(ctx, skip: set[str], entries, nb: int, *, rounds: int):
    """Check every entry (rid, rec, fn, operand sets, want or None) on its first launch, then
    time them all in ``rounds`` interleaved rounds; ``time_us`` is the median of the rounds'
    medians (``round_times_us``)."""
    import jax
    import numpy as np

    live = []
    for rid, rec, fn, sets, want in entries:
        if rid in skip:
            continue
        ctx.emit(dict(kernel="_start", id=rid))
        try:
            multi = jax.jit(lambda s, fn=fn: [fn(*a) for a in s])
            out = multi(sets)
            jax.block_until_ready(out)
            if want is not None:
                rec["rel_err"] = BK._rel_err(out[0], want)
                rec["ok"] = bool(rec["rel_err"] < TOL)
            del out
            live.append((rec, multi, sets))
        except Exception as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
            print(rec["error"], file=sys.stderr)
            ctx.emit(rec)
    for _ in range(rounds):
        if ctx.left() < 5:
            break
        for rec, multi, sets in live:
            times = []
            for _ in range(1 if ctx.smoke else 7):
                t0 = time.perf_counter()
                jax.block_until_ready(multi(sets))
                times.append(time.perf_counter() - t0)
            rec.setdefault("round_times_us", []).append(float(np.median(times)) / len(sets) * 1e6)
    for rec, _, _ in live:
        if rec.get("round_times_us"):
            rec["time_us"] = float(np.median(rec["round_times_us"]))
            rec.update(bytes=nb, gbps=nb / rec["time_us"] / 1e3)
            rec.setdefault("ok", True)
        ctx.emit(rec)


def _fused_vs_legacy(ctx, skip, fmt, m, n, k):
    """One small odd shape: the fused whole call against the earlier path (expected bit for
    bit) and the reference; where they differ, which rows and columns."""
    import numpy as np

    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM

    rid = f"epi_check:{fmt}:{m}"
    if rid in skip:
        return
    ctx.emit(dict(kernel="_start", id=rid))
    rec = _rec(f"{fmt}_gemv_mosaic_vs_legacy", "small", m, n, k, fmt=fmt, check="small")
    try:
        lv = BK._weights(ctx, fmt, n, k)
        if fmt == "nvfp4":
            w = (*GM.prepare_nvfp4_mosaic(lv[0], lv[1]), lv[2])
            public = GM.nvfp4_gemv_mosaic
        else:
            w = GM.prepare_fp8_row_mosaic(*lv)
            public = GM.fp8_row_gemv_mosaic
        x = _xs(ctx, m, k, 1)[0]
        new = np.asarray(public(x, *w, n=n, interpret=ctx.interpret))
        old = np.asarray(_legacy_gemv(fmt, x, *w, n=n, interpret=ctx.interpret))
        bad = np.argwhere(new != old)
        rec.update(
            rel_err=BK._rel_err(new, G.KERNELS[fmt][1](x, *lv)),
            legacy_rel_err=BK._rel_err(old, G.KERNELS[fmt][1](x, *lv)),
            mismatches=int(bad.shape[0]),
            mismatch_rows=sorted({int(i) for i in bad[:, 0]})[:16],
            mismatch_cols=sorted({int(j) for j in bad[:, 1]})[:16],
            max_abs_diff=float(np.max(np.abs(new - old))),
        )
        rec["ok"] = bool(rec["rel_err"] < TOL and rec["mismatches"] == 0)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
        traceback.print_exc()
    ctx.emit(rec)


def _row_identity(ctx, skip, fmt, name, n, k, x, w, layout, public, kw):
    """Rows of an M-row call against the same rows computed alone (the M=1 default config and
    the M-row call's config), bit for bit."""
    import numpy as np

    rid = f"epi_rows:{fmt}:{x.shape[0]}:{layout}"
    if rid in skip or ctx.left() < 8:
        return
    ctx.emit(dict(kernel="_start", id=rid))
    rec = _rec(f"{fmt}_gemv_mosaic_row_identity", name, x.shape[0], n, k, layout=layout, fmt=fmt)
    try:
        full = np.asarray(public(x, *w, **kw))
        diffs = {}
        for label, cfg in (("m1_default", None), ("same_config", kw["config"])):
            for r in IDENTITY_ROWS:
                one = np.asarray(public(x[r : r + 1], *w, **{**kw, "config": cfg}))[0]
                diffs[f"{label}:{r}"] = float(np.max(np.abs(one - full[r])))
        same = all(d == 0.0 for d in diffs.values())
        # Interpret mode: the wgmma is an XLA:CPU dot whose summation order depends on N.
        rec.update(ok=None if ctx.interpret else same, identical=same, max_abs_diff=diffs)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    ctx.emit(rec)


def _steady_variant(ctx, skip: set[str], rid: str, rec: dict, fn, sets, want, nb: int, n_launch):
    """Steady-state time of ``fn`` over ``sets`` (``bench_kernels.time_steady``), its first
    launch checked against ``want`` (None: unchecked), into ``rec``; errors recorded."""
    if rid in skip or ctx.left() < 8:
        return
    ctx.emit(dict(kernel="_start", id=rid))
    BK.measure_steady(
        ctx, rec, fn, sets, n_launch, tol=TOL, want=want, nbytes=nb, synced_key="synced_us"
    )
    ctx.emit(rec)


def child_mosaic_fp8_block(ctx, skip: set[str]):
    """FP8 block-128 Mosaic against the Triton FP8 block GEMV, XLA BF16 and Mosaic FP8 per-row."""
    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM

    interp = ctx.interpret

    # 1) Small odd shape (N=1021 padded to 1024, K=4640 to 4736: ragged last scale blocks).
    n, k = (1021, 4640) if not ctx.smoke else (131, 200)
    q, sinv = BK._weights(ctx, "fp8_block", n, k)
    qp, sp = GM.prepare_fp8_block_mosaic(q, sinv)
    for m in (3, 96):
        x = _xs(ctx, m, k, 1)[0]
        cfg = GM.default_config(m, *qp.shape, fmt="fp8_block")
        rec = _rec(
            "fp8_block_gemv_mosaic",
            "small",
            m,
            n,
            k,
            fmt="fp8_block",
            config=BK._cfg_dict(cfg),
            check="small",
        )
        fn = functools.partial(GM.fp8_block_gemv_mosaic, n=n, interpret=interp)
        want = G.fp8_block_gemv_reference(x, q, sinv)
        _check_small(ctx, skip, f"check:fp8_block:{m}", rec, fn, (x, qp, sp), want)
    del q, sinv, qp, sp

    # 2) Timed shapes: the defaults and every baseline, then other tiles.
    shapes = FP8_BLOCK_SHAPES
    if ctx.smoke:
        shapes = (("lm_head", 136, 512, (1, 96)), ("qkv_like", 200, 256, (1,)))
    extra = FP8_BLOCK_EXTRA if not ctx.smoke else FP8_BLOCK_EXTRA[:1]
    weights, later = {}, []
    for name, n, k, rows in shapes:
        for fmt in ("fp8_block", "fp8_row"):
            weights[name, fmt] = _weight_sets(ctx, n, k, fmt)
        bf16 = [BK._weights(ctx, "bf16", n, k) for _ in range(MIN_COPIES)]
        sets_w, nb = weights[name, "fp8_block"]
        row_w, row_nb = weights[name, "fp8_row"]
        # Aligned shapes (prepare pads nothing, casts the scales): the checkpoint leaves.
        prepped = [GM.prepare_fp8_block_mosaic(*w) for w in sets_w]
        n_launch = _launches(ctx, nb, nb / 4.0e6)
        for m in rows:
            if ctx.left() < 10:
                ctx.emit(dict(kernel="_deadline", shape=name, rows=m))
                return
            xs = _xs(ctx, m, k, min(n_launch, 8))
            sets = [(x, *prepped[i % len(prepped)]) for i, x in enumerate(xs)]
            want = G.fp8_block_gemv_reference(xs[0], *sets_w[0])
            cfg = GM.default_config(m, n, k, fmt="fp8_block")
            kw = dict(n=n, config=cfg, interpret=interp)
            rec = _rec(
                "fp8_block_gemv_mosaic",
                name,
                m,
                n,
                k,
                fmt="fp8_block",
                config=BK._cfg_dict(cfg),
                is_default=True,
            )
            fn = functools.partial(GM.fp8_block_gemv_mosaic, **kw)
            rid = f"fp8_block:{name}:{m}:{_cfg_id(cfg)}"
            _steady_variant(ctx, skip, rid, rec, fn, sets, want, nb, n_launch)
            if m <= G.MAX_ROWS:
                rec = _rec("fp8_block_gemv_triton", name, m, n, k, fmt="fp8_block")
                fn = functools.partial(G.fp8_block_gemv, interpret=interp)
                tsets = [(x, *sets_w[i % len(sets_w)]) for i, x in enumerate(xs)]
                rid = f"fp8_block_triton:{name}:{m}"
                _steady_variant(ctx, skip, rid, rec, fn, tsets, want, nb, n_launch)
            del want
            rsets = [(x, *row_w[i % len(row_w)]) for i, x in enumerate(xs)]
            rwant = G.fp8_row_gemv_reference(*rsets[0])
            rcfg = GM.default_config(m, n, k, fmt="fp8_row")
            rec = _rec(
                "fp8_row_gemv_mosaic", name, m, n, k, fmt="fp8_row", config=BK._cfg_dict(rcfg)
            )
            fn = functools.partial(GM.fp8_row_gemv_mosaic, interpret=interp)
            rid = f"fp8_row_mosaic:{name}:{m}"
            _steady_variant(ctx, skip, rid, rec, fn, rsets, rwant, row_nb, n_launch)
            del rwant
            rec = _rec("xla_bf16_dot", name, m, n, k, fmt="bf16")
            bsets = [(x, *bf16[i % len(bf16)]) for i, x in enumerate(xs)]
            rid = f"xla_bf16:{name}:{m}"
            _steady_variant(ctx, skip, rid, rec, _xla_bf16, bsets, None, n * k * 2, n_launch)
            if m > max(IDENTITY_ROWS):
                public = GM.fp8_block_gemv_mosaic
                w = prepped[0]
                _row_identity(
                    ctx, skip, "fp8_block", name, n, k, xs[0], w, "checkpoint", public, kw
                )
            for em, fields in extra if name == "lm_head" else ():
                if em == m:
                    later.append((name, n, k, m, GM.MosaicGemvConfig(**fields), xs, sets_w))
            del xs, sets
        del bf16, prepped

    # 3) Other tiles on the LM head, budget permitting (checked on their first launch).
    for name, n, k, m, cfg, xs, sets_w in later:
        if ctx.left() < 15:
            ctx.emit(dict(kernel="_deadline", shape=name, rows=m, extra=True))
            return
        nb = weights[name, "fp8_block"][1]
        want = G.fp8_block_gemv_reference(xs[0], *sets_w[0])
        rec = _rec(
            "fp8_block_gemv_mosaic",
            name,
            m,
            n,
            k,
            fmt="fp8_block",
            config=BK._cfg_dict(cfg),
            is_default=False,
        )
        fn = functools.partial(GM.fp8_block_gemv_mosaic, n=n, config=cfg, interpret=interp)
        sets = [(x, *sets_w[i % len(sets_w)]) for i, x in enumerate(xs)]
        rid = f"fp8_block:{name}:{m}:{_cfg_id(cfg)}"
        _steady_variant(ctx, skip, rid, rec, fn, sets, want, nb, _launches(ctx, nb, nb / 4.0e6))
        del want


def child_fp8_tiles(ctx, skip: set[str]):
    """Both FP8 Mosaic GEMVs at 64..128 rows on the LM head over :data:`FP8_TILES` (each
    checked on its first launch), and XLA's BF16 dot at the same rows; steady-state."""
    from pallas_kernels import gemv as G
    from pallas_kernels import gemv_mosaic as GM

    name, n, k = LM_HEAD if not ctx.smoke else ("lm_head", 136, 512)
    rows = FP8_TILE_ROWS if not ctx.smoke else (13,)
    tiles = FP8_TILES if not ctx.smoke else FP8_TILES[2:4]
    kernels = {
        "fp8_row": (GM.fp8_row_gemv_mosaic, G.fp8_row_gemv_reference),
        "fp8_block": (GM.fp8_block_gemv_mosaic, G.fp8_block_gemv_reference),
    }
    bf16 = [BK._weights(ctx, "bf16", n, k) for _ in range(MIN_COPIES)]
    for m in rows:
        xs = _xs(ctx, m, k, 2 if ctx.smoke else 8)
        rec = _rec("xla_bf16_dot", name, m, n, k, fmt="bf16")
        bsets = [(x, *bf16[i % len(bf16)]) for i, x in enumerate(xs)]
        _steady_variant(ctx, skip, f"xla:{m}", rec, _xla_bf16, bsets, None, n * k * 2, len(xs))
        for fmt, (kernel, reference) in kernels.items():
            weights, nb = _weight_sets(ctx, n, k, fmt)
            sets = [(x, *weights[i % len(weights)]) for i, x in enumerate(xs)]
            want = reference(*sets[0])
            default = GM.default_config(m, n, k, fmt=fmt)
            for bn, bk, st in tiles:
                cfg = GM.MosaicGemvConfig(block_n=bn, block_k=bk, stages=st)
                rec = _rec(f"{fmt}_gemv_mosaic", name, m, n, k, fmt=fmt)
                rec.update(config=BK._cfg_dict(cfg), is_default=cfg == default)
                fn = functools.partial(kernel, config=cfg, interpret=ctx.interpret)
                rid = f"{fmt}:{m}:{_cfg_id(cfg)}"
                _steady_variant(ctx, skip, rid, rec, fn, sets, want, nb, len(xs))
            del weights, sets, want


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
        elif section == "mosaic":
            child_mosaic(ctx, skip)
        elif section == "mosaic_rows":
            child_mosaic_rows(ctx, skip)
        elif section == "mosaic_fp8":
            child_mosaic_fp8(ctx, skip)
        elif section == "epilogue":
            child_epilogue(ctx, skip)
        elif section == "mosaic_fp8_block":
            child_mosaic_fp8_block(ctx, skip)
        elif section == "fp8_tiles":
            child_fp8_tiles(ctx, skip)
        else:
            raise ValueError(f"unknown section {section!r}; expected one of {SECTIONS}")
    except Exception:
        ctx.emit(
            dict(kernel="_section_error", section=section, error=traceback.format_exc()[-3000:])
        )


# ---------------------------------------------------------------------------------------------
# Parent.
# ---------------------------------------------------------------------------------------------


#: The Triton GEMV that ``ratio_vs_triton`` compares each format with.
_TRITON_GEMV = {
    "nvfp4": "nvfp4_gemv_triton",
    "fp8_row": "fp8_row_gemv_triton",
    "fp8_block": "fp8_block_gemv_triton",
}


def _derive(records: list[dict]) -> list[dict]:
    key = lambda r: (r["shape"], r["n"], r["k"], r["rows"])  # noqa: E731
    timed = [
        r
        for r in records
        if not r.get("kernel", "_").startswith("_") and "time_us" in r and r.get("ok", True)
    ]
    xla = {key(r): r["time_us"] for r in timed if r["kernel"] == "xla_bf16_dot"}
    tri = {
        (r["format"], *key(r)): r["time_us"] for r in timed if r["kernel"] in _TRITON_GEMV.values()
    }
    row_mosaic = {key(r): r["time_us"] for r in timed if r["kernel"] == "fp8_row_gemv_mosaic"}
    # The fastest checked M=1 GEMV of each format and shape (any kernel, layout or config).
    m1: dict[tuple, float] = {}
    for r in timed:
        whole_call = not r["kernel"].endswith(("_diag", "_kernel_only"))
        if r["rows"] == 1 and "gemv" in r["kernel"] and whole_call:
            kk = (r["format"], r["shape"], r["n"], r["k"])
            m1[kk] = min(m1.get(kk, math.inf), r["time_us"])
    for r in records:
        if r.get("kernel", "_").startswith("_") or "time_us" not in r:
            continue
        b = xla.get(key(r))
        r["baseline"] = "xla_bf16_dot_same_shape_and_rows"
        r["baseline_time_us"] = b
        r["ratio"] = None if b is None else r["time_us"] / b
        t = tri.get((r.get("format"), *key(r)))
        r["triton_time_us"] = t
        r["ratio_vs_triton"] = None if t is None else r["time_us"] / t
        t1 = m1.get((r.get("format"), r["shape"], r["n"], r["k"]))
        r["m1_gemv_time_us"] = t1
        r["ratio_vs_m1"] = None if t1 is None else r["time_us"] / t1
        if r.get("format") == "fp8_block":
            t = row_mosaic.get(key(r))
            r["fp8_row_mosaic_time_us"] = t
            r["ratio_vs_fp8_row_mosaic"] = None if t is None else r["time_us"] / t
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
    for r in records:
        if r.get("kernel", "").endswith("_row_identity") and r.get("ok"):
            lines.append(f"ok {r['kernel']} rows={r['rows']} {r.get('max_abs_diff')}")
    hdr = (
        f"{'kernel':<34}{'shape':<14}{'rows':>5}{'time_us':>10}{'vs XLA':>8}{'vs Triton':>10}"
        f"{'vs M=1':>8}  config"
    )
    lines.append(hdr)
    for r in records:
        if r.get("kernel", "_").startswith("_") or "time_us" not in r:
            continue
        cfg = r.get("config") or {}
        cs = ",".join(f"{a}={b}" for a, b in cfg.items())
        cs = f"{r['layout']}:{cs}" if r.get("layout") else cs
        cs = f"{r['variant']}:{cs}" if r.get("variant") else cs
        fmt = lambda v, w: f"{v:{w}.3f}" if v is not None else " " * w  # noqa: E731
        lines.append(
            f"{r['kernel']:<34}{r['shape']:<14}{r['rows']:>5}{r['time_us']:>10.1f}"
            f"{fmt(r.get('ratio'), 8)}{fmt(r.get('ratio_vs_triton'), 10)}"
            f"{fmt(r.get('ratio_vs_m1'), 8)}  {cs[:70]}"
            f"{'' if r.get('ok', True) else '  NOT OK'}"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write all records here (a JSON list)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    ap.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated, from {','.join(SECTIONS)} (default: baselines,mosaic; with "
        "--smoke all of them)",
    )
    ap.add_argument("--quick", action="store_true", help="LM head at M=1 only")
    ap.add_argument("--sweep", action="store_true", help="more tile variants and diagnostics")
    ap.add_argument("--logdir", default=None, help="keep each child's stdout/stderr here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.sections is None:
        args.sections = ",".join(SECTIONS) if args.smoke else "baselines,mosaic"
    unknown = set(filter(None, args.sections.split(","))) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.child:
        skip = set(filter(None, args.skip.split(",")))
        run_child(args.child, args.smoke, args.deadline, args.out, skip, args.quick, args.sweep)
        return 0

    start = time.time()
    records: list[dict] = []
    share = {"baselines": 0.35, "mosaic": 0.65, "mosaic_rows": 0.45}
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
