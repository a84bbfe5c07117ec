"""Check and time the Pallas GPU kernels against XLA in one run.

    PYTHONPATH=. python3 scripts/bench_kernels.py --json benchmarks/results/kernels_h200.json

Measures, in one run on one GPU: a device-to-device copy (bandwidth baseline), XLA's BF16 GEMV
(``jnp.dot``) on every shape, XLA's dequantise+dot for every weight format, and every kernel
(GEMV / batched GEMV, verify GEMM, argmax, paged attention) over a few tile configs. Every kernel
config is first checked against its ``*_reference`` twin on the GPU (fresh random data, odd sizes
with tails, then the real shape). Each time is the median of repeated timed calls after warm-up;
one timed call runs several launches on different input buffers (weights rotated so the buffers
in flight exceed the 60 MB L2). Sections run in child processes so one failing lowering cannot
take the others down. Writes one JSON record per measurement and prints a summary table last.

``--smoke`` runs tiny shapes in interpret mode on the CPU (checks the script, not the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

SECTIONS = (
    "baseline",
    "gemv_nvfp4",
    "verify",
    "gemv_fp8_row",
    "argmax",
    "attention",
    "gemv_bf16",
    "gemv_fp8_block",
)

L2_BYTES = 60 * 2**20

LM_HEAD = ("lm_head", 248320, 5120)
SHAPES = [
    LM_HEAD,
    ("qkv_like", 12288, 5120),
    ("o_proj_like", 5120, 10240),
    ("up_like", 17408, 5120),
    ("down_like", 5120, 17408),
    ("moe_expert", 512, 2048),
]
SMOKE_SHAPES = [("lm_head", 1021, 272), ("small", 200, 512)]


# ---------------------------------------------------------------------------------------------
# Child side: data, checks and timing.
# ---------------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, smoke: bool, deadline: float, out_path: str, focus: str, shapes: str):
        import jax

        self.jax = jax
        self.smoke = smoke
        self.deadline = deadline
        self.out_path = out_path
        self.focus = focus
        self.shapes = shapes
        self.key = jax.random.PRNGKey(int(time.time()) & 0xFFFF)
        self.interpret = smoke

    def left(self) -> float:
        return self.deadline - time.time()

    def next_key(self):
        self.key, sub = self.jax.random.split(self.key)
        return sub

    def emit(self, rec: dict):
        with open(self.out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _weights(ctx: Ctx, fmt: str, n: int, k: int):
    """Random leaves of one weight in DESIGN §3 layout."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(ctx.next_key())
    if fmt == "bf16":
        return (jax.random.normal(k1, (n, k), jnp.bfloat16) * 0.05,)
    if fmt == "fp8_row":
        q = jnp.clip(jax.random.normal(k1, (n, k), jnp.float32) * 64, -448, 448)
        return q.astype(jnp.float8_e4m3fn), jax.random.uniform(k2, (n,), jnp.float32, 1e-4, 2e-3)
    if fmt == "fp8_block":
        q = jnp.clip(jax.random.normal(k1, (n, k), jnp.float32) * 64, -448, 448)
        s = jax.random.uniform(k2, (-(-n // 128), -(-k // 128)), jnp.float32, 1e-4, 2e-3)
        return q.astype(jnp.float8_e4m3fn), s
    packed = jax.random.bits(k1, (n, k // 2), jnp.uint8)
    scale = jax.random.uniform(k2, (n, k // 16), jnp.float32, 0.0, 448.0).astype(jnp.float8_e4m3fn)
    return packed, scale, jnp.float32(1e-3)


def _nbytes(arrs) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in arrs))


def _rel_err(out, ref) -> float:
    import jax.numpy as jnp

    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(out))):
        return float("nan")
    den = float(jnp.linalg.norm(ref)) or 1.0
    return float(jnp.linalg.norm(out - ref)) / den


def _time(ctx: Ctx, fn, arg_sets, reps: int = 5, want=None, tol=None):
    """Median microseconds per launch; one timed call runs ``fn`` once per arg set.

    With ``want``, the first launch's output is compared to it: returns (us, rel_err, ok).
    """
    jax = ctx.jax
    multi = jax.jit(lambda sets: [fn(*s) for s in sets])
    out = multi(arg_sets)
    jax.block_until_ready(out)
    err = None
    if want is not None:
        err = _rel_err(out[0], want)
    del out
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = multi(arg_sets)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        del out
    us = float(np.median(times)) / len(arg_sets) * 1e6
    if want is None:
        return us
    return us, err, bool(err < tol)


def _measure(ctx: Ctx, rec: dict, fn, sets, want, nbytes: int, tol: float = 2e-5):
    """Check + time one config into ``rec`` (errors are recorded, not raised), then emit it."""
    try:
        t, err, ok = _time(ctx, fn, sets, want=want, tol=tol)
        rec.update(time_us=t, rel_err=err, ok=ok, bytes=nbytes, gbps=nbytes / t / 1e3)
    except Exception as e:
        rec["ok"] = False
        rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    ctx.emit(rec)


def _launches(bytes_per_launch: int, est_us: float) -> int:
    """How many launches one timed call makes: >= ~1.5 ms of work, >= 2x L2 of distinct bytes."""
    n = max(4, math.ceil(1500.0 / max(est_us, 1.0)))
    n = max(n, math.ceil(2 * L2_BYTES / max(bytes_per_launch, 1)))
    return int(min(n, 48))


def _cfg_dict(cfg) -> dict | None:
    return None if cfg is None else dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# Sections.
# ---------------------------------------------------------------------------------------------


def section_baseline(ctx: Ctx):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import _common as C

    if not ctx.smoke:
        a = jax.random.bits(ctx.next_key(), (2**28,), jnp.uint32)  # 1 GiB
        t = _time(ctx, lambda v: v + jnp.uint32(1), [(a,)] * 6, reps=9)
        ctx.emit(
            dict(
                kernel="d2d_copy",
                format="u32",
                rows=0,
                n=a.size,
                k=0,
                time_us=t,
                bytes=2 * a.size * 4,
                gbps=2 * a.size * 4 / t / 1e3,
            )
        )
        del a
    shapes = SMOKE_SHAPES if ctx.smoke else (SHAPES if ctx.shapes == "all" else [LM_HEAD])
    if ctx.focus == "final":
        shapes = shapes[:1]
    for name, n, k in shapes:
        (w,) = _weights(ctx, "bf16", n, k)
        rows_list = (1, 2, 8, 32, 96) if name == "lm_head" else (1,)
        if ctx.focus == "final":
            rows_list = (1,)
        for m in rows_list:
            xs = [
                (jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16), w)
                for _ in range(_launches(w.size * 2, n * k * 2 / 4.0e6))
            ]

            def xla_bf16(x, w):
                return jax.lax.dot_general(
                    x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )

            t = _time(ctx, xla_bf16, xs)
            ctx.emit(
                dict(
                    kernel="xla_bf16_dot",
                    format="bf16",
                    rows=m,
                    n=n,
                    k=k,
                    shape=name,
                    time_us=t,
                    bytes=w.size * 2,
                    gbps=w.size * 2 / t / 1e3,
                )
            )
        del w, xs
        # XLA dequantise + dot for every quantised format, one row.
        for fmt in (
            ("fp8_row", "fp8_block", "nvfp4") if name == "lm_head" and ctx.focus != "final" else ()
        ):
            leaves = _weights(ctx, fmt, n, k)
            if fmt == "fp8_row":

                def xla_deq(x, q, s):
                    y = jax.lax.dot_general(
                        x,
                        q.astype(jnp.bfloat16),
                        (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32,
                    )
                    return y * s[None, :]
            elif fmt == "fp8_block":

                def xla_deq(x, q, s):
                    w = C.dequant_fp8_block(q, s).astype(jnp.bfloat16)
                    return jax.lax.dot_general(
                        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                    )
            else:

                def xla_deq(x, p, s, s2):
                    w = C.dequant_nvfp4(p, s, s2).astype(jnp.bfloat16)
                    return jax.lax.dot_general(
                        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                    )

            nb = _nbytes(leaves)
            copies = max(1, min(8, math.ceil(2 * L2_BYTES / nb)))
            sets_w = [leaves] + [_weights(ctx, fmt, n, k) for _ in range(copies - 1)]
            reps = _launches(nb, nb / 3.0e6)
            sets = [
                (jax.random.normal(ctx.next_key(), (1, k), jnp.bfloat16), *sets_w[i % copies])
                for i in range(reps)
            ]
            t = _time(ctx, xla_deq, sets)
            ctx.emit(
                dict(
                    kernel=f"xla_dequant_dot_{fmt}",
                    format=fmt,
                    rows=1,
                    n=n,
                    k=k,
                    shape=name,
                    time_us=t,
                    bytes=nb,
                    gbps=nb / t / 1e3,
                )
            )
            del leaves, sets_w, sets
        if ctx.left() < 0:
            return


# Targeted variants (compute, block_n, block_k, num_warps, extra fields) per (format, rows).
_FINAL = {
    ("nvfp4", 1): [("fma", 16, 1024, 4, {}), ("fma", 64, 512, 8, {})],
}

_TUNE = {
    ("nvfp4", 1): [
        ("fma", 32, 512, 4, {}),
        ("fma", 64, 512, 8, {}),
        ("fma", 32, 1024, 4, {}),
        ("fma", 16, 1024, 4, {}),
        ("fma", 32, 512, 4, {"prefetch": False}),
        ("fma", 32, 512, 4, {"decode": "arith"}),
        ("dot", 64, 256, 4, {}),
        ("dot", 64, 512, 4, {}),
        ("dot", 128, 256, 8, {}),
        ("dot", 64, 512, 4, {"prefetch": False}),
    ],
    ("nvfp4", 2): [("fma", 32, 512, 4, {}), ("dot", 64, 512, 4, {})],
    ("nvfp4", 8): [("dot", 64, 256, 4, {}), ("dot", 64, 512, 4, {}), ("dot", 128, 256, 8, {})],
    ("fp8_row", 1): [
        ("fma", 64, 512, 8, {}),
        ("fma", 64, 512, 8, {"prefetch": False}),
        ("fma", 16, 1024, 4, {}),
        ("dot", 64, 128, 4, {}),
        ("dot", 64, 256, 4, {}),
    ],
    ("fp8_row", 8): [("dot", 64, 256, 4, {}), ("dot", 64, 128, 4, {}), ("dot", 128, 128, 8, {})],
    ("bf16", 1): [("dot", 64, 128, 4, {"prefetch": False}), ("dot", 128, 128, 8, {})],
    ("fp8_block", 1): [("fma", 16, 1024, 4, {}), ("dot", 64, 256, 4, {"prefetch": False})],
}


def _gemv_configs(fmt: str, m: int, n: int, k: int, mode: str):
    """The heuristic default first, then (mode "tune", LM head) targeted variants."""
    from pallas_kernels import gemv as G

    d = G.default_config(fmt, m, n, k)
    cfgs = [d]
    if mode in ("tune", "final"):
        table = _TUNE if mode == "tune" else _FINAL
        for compute, bn, bk, warps, extra in table.get((fmt, m), []):
            cfgs.append(
                dataclasses.replace(
                    d, compute=compute, block_n=bn, block_k=bk, num_warps=warps, **extra
                )
            )
    seen, out = set(), []
    for c in cfgs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _rotated_weights(ctx: Ctx, fmt: str, n: int, k: int):
    leaves = _weights(ctx, fmt, n, k)
    nb = _nbytes(leaves)
    copies = max(1, min(8, math.ceil(2 * L2_BYTES / nb)))
    return [leaves] + [_weights(ctx, fmt, n, k) for _ in range(copies - 1)], nb


def section_gemv(ctx: Ctx, fmt: str):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gemv as G

    kern, ref = G.KERNELS[fmt]
    interp = ctx.interpret
    # 1) Small odd shapes with tails: every compute/decode path against the reference.
    small = [(8, 1021, 4096 + 544)]
    if fmt == "fp8_block":
        small = [(8, 1021, 4608 + 128)]
    for m, n, k in small if ctx.focus != "final" else ():
        leaves = _weights(ctx, fmt, n, k)
        x = jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16)
        want = ref(x, *leaves)
        for compute in ("fma", "dot"):
            for decode in ("asm", "arith") if fmt == "nvfp4" and not interp else ("arith",):
                bk = 128 if fmt == "fp8_block" else 64
                cfg = G.GemvConfig(
                    block_n=32 if compute == "fma" else 64,
                    block_k=bk,
                    split_k=3,
                    compute=compute,
                    decode=decode,
                )
                rec = dict(
                    kernel=f"{fmt}_gemv",
                    format=fmt,
                    rows=m,
                    n=n,
                    k=k,
                    check="small",
                    config=_cfg_dict(cfg),
                )
                try:
                    got = kern(x, *leaves, config=cfg, interpret=interp)
                    rec["rel_err"] = _rel_err(got, want)
                    rec["ok"] = bool(rec["rel_err"] < 2e-5)
                except Exception as e:
                    rec["ok"] = False
                    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                ctx.emit(rec)
    if ctx.smoke:
        return
    # 2) Real shapes: check + time.
    shapes = SHAPES if ctx.shapes == "all" else [LM_HEAD]
    for name, n, k in shapes:
        sets_w, nb = _rotated_weights(ctx, fmt, n, k)
        rows_list = (1, 2, 4, 8, 16, 32) if name == "lm_head" else (1,)
        if ctx.focus == "final":
            rows_list = (1, 2, 8) if fmt == "nvfp4" else (1, 8)
        for m in rows_list:
            if ctx.left() < 20:
                return
            mode = ctx.focus if name == "lm_head" else "quick"
            reps = _launches(nb, nb / 3.0e6)
            sets = [
                (jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16), *sets_w[i % len(sets_w)])
                for i in range(reps)
            ]
            want = ref(*sets[0])
            for cfg in _gemv_configs(fmt, m, n, k, mode):
                if ctx.left() < 15:
                    return
                rec = dict(
                    kernel=f"{fmt}_gemv",
                    format=fmt,
                    rows=m,
                    n=n,
                    k=k,
                    shape=name,
                    config=_cfg_dict(cfg),
                    is_default=cfg == G.default_config(fmt, m, n, k),
                )
                fn = functools.partial(kern, config=cfg)
                _measure(ctx, rec, fn, sets, want, nb)
            del want, sets
        del sets_w


def section_verify(ctx: Ctx):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import verify_gemm as V

    interp = ctx.interpret
    for fmt in ("nvfp4", "fp8_row", "bf16", "fp8_block"):
        kern, ref = V.KERNELS[fmt]
        for m, n, k in [(96, 1021, 2048 + 128)] if ctx.focus != "final" else ():
            leaves = _weights(ctx, fmt, n, k)
            wt = V.make_transposed(fmt, *leaves)
            x = jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16)
            want = ref(x, *wt, n=n)
            variants = [{"decode": "arith"}, {"swap_ab": True, "decode": "arith"}]
            if fmt == "nvfp4" and not interp:
                variants += [{"decode": "asm"}, {"swap_ab": True, "decode": "asm"}]
            for extra in variants:
                cfg = V.VerifyGemmConfig(block_n=64, block_k=128, split_k=2, **extra)
                rec = dict(
                    kernel=f"{fmt}_verify_gemm",
                    format=fmt,
                    rows=m,
                    n=n,
                    k=k,
                    check="small",
                    config=_cfg_dict(cfg),
                )
                try:
                    got = kern(x, *wt, n=n, config=cfg, interpret=interp)
                    rec["rel_err"] = _rel_err(got, want)
                    rec["ok"] = bool(rec["rel_err"] < 2e-5)
                except Exception as e:
                    rec["ok"] = False
                    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                ctx.emit(rec)
    if ctx.smoke:
        return
    name, n, k = LM_HEAD
    for fmt in (
        ("nvfp4", "fp8_row", "bf16", "fp8_block") if ctx.focus != "final" else ("nvfp4", "fp8_row")
    ):
        kern, ref = V.KERNELS[fmt]
        wt = V.make_transposed(fmt, *_weights(ctx, fmt, n, k))
        nb = _nbytes(wt)
        rows_list = (9, 16, 32, 64, 96) if fmt in ("nvfp4", "fp8_row") else (9, 32, 96)
        if ctx.focus == "final":
            rows_list = (32, 96)
        for m in rows_list:
            if ctx.left() < 20:
                return
            d = V.default_config(fmt, m, n, k)
            cfgs = [d]
            if m in (32, 96) and ctx.focus == "tune" and fmt in ("nvfp4", "fp8_row"):
                for extra in ({"swap_ab": True}, {"prefetch": False}, {"row_chunks": False}):
                    c = dataclasses.replace(d, **extra)
                    if c not in cfgs:
                        cfgs.append(c)
            sets = [
                (jax.random.normal(ctx.next_key(), (m, k), jnp.bfloat16), *wt)
                for _ in range(_launches(nb, nb / 3.0e6))
            ]
            want = ref(*sets[0], n=n)
            for cfg in cfgs:
                if ctx.left() < 15:
                    return
                rec = dict(
                    kernel=f"{fmt}_verify_gemm",
                    format=fmt,
                    rows=m,
                    n=n,
                    k=k,
                    shape=name,
                    config=_cfg_dict(cfg),
                    is_default=cfg == d,
                )
                fn = functools.partial(kern, n=n, config=cfg)
                _measure(ctx, rec, fn, sets, want, nb)
            del want, sets
        del wt


def _argmax_cfg_dict(cfg) -> dict:
    return {k: getattr(v, "value", v) for k, v in dataclasses.asdict(cfg).items()}


def time_steady(ctx: Ctx, fn, arg_sets, n_launch: int, reps: int = 3, calls: tuple = (2, 8)):
    """µs per launch of ``fn``; one call runs ``n_launch`` launches cycling through ``arg_sets``.

    Returns (steady, synced, first output). ``steady`` is the device's time: calls enqueued
    back to back, (``calls[1]`` calls - ``calls[0]`` calls) / their difference, so the per-call
    dispatch and sync drop out (median of ``reps``). ``synced`` is the median over 5 calls with
    a sync after each, the way ``_time`` measures; it includes that per-call overhead (measured
    on the H200: ~75 us per launch of the NVFP4 LM-head GEMV at 6 launches per call).
    """
    jax = ctx.jax
    sets = [arg_sets[i % len(arg_sets)] for i in range(n_launch)]
    multi = jax.jit(lambda s: [fn(*a) for a in s])
    out = multi(sets)
    jax.block_until_ready(out)
    first = out[0]
    del out

    def run(n_calls):
        t0 = time.perf_counter()
        for _ in range(n_calls):
            out = multi(sets)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    lo, hi = calls
    synced = float(np.median([run(1) for _ in range(5)])) / n_launch * 1e6
    steady = float(np.median([(run(hi) - run(lo)) / (hi - lo) for _ in range(reps)]))
    return steady / n_launch * 1e6, synced, first


def measure_steady(
    ctx: Ctx,
    rec: dict,
    fn,
    sets,
    n_launch: int,
    *,
    tol: float,
    want=None,
    nbytes=None,
    synced_key: str = "time_us_synced",
) -> None:
    """:func:`time_steady` of ``fn`` into ``rec`` (``time_us``, the synced time under
    ``synced_key``, ``bytes``/``gbps``), its first launch checked against ``want`` (None:
    unchecked) to relative error ``tol``; errors are recorded, not raised."""
    try:
        kw = dict(reps=1, calls=(1, 2)) if ctx.smoke else {}
        steady, synced, first = time_steady(ctx, fn, sets, n_launch, **kw)
        rec.update({"time_us": steady, synced_key: synced, "ok": True})
        if nbytes:
            rec.update(bytes=nbytes, gbps=nbytes / steady / 1e3)
        if want is not None:
            rec["rel_err"] = _rel_err(first, want)
            rec["ok"] = bool(rec["rel_err"] < tol)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
        print(rec["error"], file=sys.stderr)


def _argmax_variants(A, m: int, dtype, focus: str) -> list:
    """The default first, then (focus "tune") variants around it: loads per step, warps,
    slices, Triton pipelining, the merge, the position re-read; at 96 rows also the previous
    kernel's shape (one 1024-lane load per step, 11 slices, num_stages 3, XLA merge)."""
    import jax.numpy as jnp

    d = A.default_config(m, 248320, dtype)
    var = functools.partial(dataclasses.replace, d)
    xla = A.Merge.XLA
    out = [d]
    if focus != "tune":
        return out
    out += [var(reload=not d.reload), var(merge=xla), var(reload=not d.reload, merge=xla)]
    if m == 96:
        out.append(A.ArgmaxConfig(unroll=1, block_v=1024, splits=11, num_stages=3, merge=xla))
        out.append(A.ArgmaxConfig(unroll=1, block_v=1024, splits=11, reload=False, merge=xla))
        for w in (4, 8):
            for u in (2, 4, 8):
                out.append(var(unroll=u, num_warps=w))
        for sp in (3, 4, 8, 12):
            out.append(var(splits=sp))
        out += [var(num_stages=3), var(unroll=2, num_stages=3), var(num_warps=16)]
        if dtype == jnp.bfloat16:  # 8-byte loads, twice as many of them
            out.append(var(block_v=1024, unroll=8))
    else:
        for u in (1, 2, 4):
            out.append(var(unroll=u))
        out += [var(num_warps=4), var(unroll=4, num_warps=4)]
        if m == 32:
            out += [var(splits=8), var(unroll=8)]
    return list(dict.fromkeys(out))


def _argmax_gemv_baseline(ctx: Ctx):
    """The NVFP4 LM-head GEMV at one row (Mosaic kernel, default tiles): the time the argmax
    is held to (<= 0.1x). Timed only; its checks are in scripts/bench_mosaic_gemv.py."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gemv_mosaic as GM

    _, n, k = LM_HEAD
    rec = dict(kernel="nvfp4_gemv_mosaic", format="nvfp4", rows=1, n=n, k=k, shape="lm_head")
    try:
        rec["config"] = _cfg_dict(GM.default_config(1, n, k))
        leaves = _weights(ctx, "nvfp4", n, k)  # 715 MB: > 2x L2 on its own
        sets = [(jax.random.normal(ctx.next_key(), (1, k), jnp.bfloat16), *leaves)]
        fn = functools.partial(GM.nvfp4_gemv_mosaic, n=n)
        t, t_sync, _ = time_steady(ctx, fn, sets, n_launch=6)
        nb = _nbytes(leaves)
        rec.update(time_us=t, time_us_synced=t_sync, bytes=nb, gbps=nb / t / 1e3, check="none")
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    ctx.emit(rec)
    return rec.get("time_us")


def _argmax_checks(ctx: Ctx, A):
    import jax
    import jax.numpy as jnp

    v_big = 1021 * 7 if ctx.smoke else 248320
    small_cfgs = [
        None,
        A.ArgmaxConfig(block_v=256, unroll=3, splits=3),
        A.ArgmaxConfig(unroll=2, splits=5, merge=A.Merge.IN_KERNEL),
        A.ArgmaxConfig(block_v=256, unroll=4, splits=3, reload=False),
    ]
    for m, v in [(1, 1000), (5, 4099), (96, v_big)]:
        for dtype in (jnp.float32, jnp.bfloat16):
            x = (jax.random.normal(ctx.next_key(), (m, v), jnp.float32) * 4).astype(dtype)
            x = x.at[:, 7].set(50.0).at[:, v - 3].set(50.0).at[:, 11].set(-jnp.inf)
            wi, wl = A.argmax_logprob_reference(x)
            for cfg in small_cfgs if dtype == jnp.float32 else small_cfgs[:1]:
                if ctx.left() < 5:
                    return
                rec = dict(
                    kernel="argmax_logprob",
                    format=jnp.dtype(dtype).name,
                    rows=m,
                    n=v,
                    k=0,
                    check="small",
                    config=None if cfg is None else _argmax_cfg_dict(cfg),
                )
                try:
                    gi, gl = A.argmax_logprob(x, config=cfg, interpret=ctx.interpret)
                    rec["idx_match"] = bool(jnp.all(gi == wi))
                    rec["max_abs_err"] = float(jnp.max(jnp.abs(gl - wl)))
                    rec["ok"] = rec["idx_match"] and rec["max_abs_err"] < 1e-4
                except Exception as e:
                    rec["ok"] = False
                    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                ctx.emit(rec)


def section_argmax(ctx: Ctx):

    from pallas_kernels import argmax as A

    if not ctx.smoke:
        _argmax_timings(ctx, A)
    # Odd shapes with planted ties and -inf (tails, several slices, both merges), last: every
    # timed config was already checked on its real-shape output.
    _argmax_checks(ctx, A)


def _argmax_timings(ctx: Ctx, A):
    """The GEMV the target is relative to, then the LM-head vocabulary, 96 rows first."""
    import jax
    import jax.numpy as jnp

    gemv_us = _argmax_gemv_baseline(ctx)
    v = 248320
    for m in (96, 1, 8, 32):
        for dtype in (jnp.float32, jnp.bfloat16):
            fmt = jnp.dtype(dtype).name
            nb = m * v * jnp.dtype(dtype).itemsize
            # Enough distinct buffers that the L2 (60 MB) holds none from one launch to its next;
            # as many launches per call as _time makes (so time_us_synced compares with it).
            distinct = int(min(48, max(3, math.ceil(3 * L2_BYTES / nb))))
            n_launch = _launches(nb, nb / 3.0e6)
            sets = [
                ((jax.random.normal(ctx.next_key(), (m, v), jnp.float32) * 4).astype(dtype),)
                for _ in range(distinct)
            ]
            wi, wl = A.argmax_logprob_reference(*sets[0])
            base = dict(rows=m, n=v, k=0, shape="lm_head_vocab", format=fmt)
            if m == 96:
                # Same-bytes references: an XLA copy (reads and writes), an XLA row max (reads).
                for name, fn, nbytes in (
                    ("d2d_copy", lambda a: a + jnp.asarray(1, a.dtype), 2 * nb),
                    ("xla_row_max", lambda a: jnp.max(a, axis=1), nb),
                    ("xla_argmax_logsumexp", A.argmax_logprob_reference, nb),
                ):
                    t, t_sync, _ = time_steady(ctx, fn, sets, n_launch)
                    ctx.emit(
                        dict(
                            base,
                            kernel=name,
                            time_us=t,
                            time_us_synced=t_sync,
                            bytes=nbytes,
                            gbps=nbytes / t / 1e3,
                        )
                    )
            default = A.default_config(m, v, dtype)
            for cfg in _argmax_variants(A, m, dtype, ctx.focus):
                if ctx.left() < 10:
                    return
                rec = dict(
                    base,
                    kernel="argmax_logprob",
                    config=_argmax_cfg_dict(cfg),
                    is_default=cfg == default,
                )
                t0 = time.time()
                try:
                    fn = functools.partial(A.argmax_logprob, config=cfg)
                    plan = A._plan(cfg, m, v, jnp.dtype(dtype).itemsize)
                    rec.update(programs=m * plan.splits, chunk=plan.chunk, cps=plan.cps)
                    t, t_sync, (gi, gl) = time_steady(ctx, fn, sets, n_launch)
                    rec["idx_match"] = bool(jnp.all(gi == wi))
                    rec["max_abs_err"] = float(jnp.max(jnp.abs(gl - wl)))
                    rec["ok"] = rec["idx_match"] and rec["max_abs_err"] < 1e-4
                    rec.update(time_us=t, time_us_synced=t_sync, bytes=nb, gbps=nb / t / 1e3)
                    if gemv_us:
                        rec.update(
                            baseline_kernel="nvfp4_gemv_mosaic",
                            baseline_time_us=gemv_us,
                            ratio=t / gemv_us,
                        )
                except Exception as e:
                    rec["ok"] = False
                    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                rec["wall_s"] = time.time() - t0
                ctx.emit(rec)
            del sets


def _attn_inputs(ctx: Ctx, b, n_q, n_kv, d, bs, ctx_len, kv, nb_extra=8, copies=1):
    """Pool, queries and ``copies`` disjoint block tables (to rotate KV bytes past the L2)."""
    import jax
    import jax.numpy as jnp

    per_seq = -(-ctx_len // bs)
    nb = copies * b * per_seq + nb_extra
    k1, k2, k3, k4 = jax.random.split(ctx.next_key(), 4)
    q = jax.random.normal(k1, (b, n_q, d), jnp.bfloat16)
    dt = jnp.float8_e4m3fn if kv != "bf16" else jnp.bfloat16
    kp = (jax.random.normal(k2, (nb, bs, n_kv, d), jnp.float32) * 2).astype(dt)
    vp = (jax.random.normal(k3, (nb, bs, n_kv, d), jnp.float32) * 2).astype(dt)
    perm = jax.random.permutation(k4, nb)[: copies * b * per_seq].astype(jnp.int32)
    bt = perm.reshape(copies, b, per_seq)
    if copies == 1:
        bt = bt[0]
    lengths = jnp.full((b,), ctx_len, jnp.int32).at[0].set(max(1, ctx_len - 5))
    kw = {}
    if kv == "fp8_block":
        kw = dict(
            k_scale=jnp.full((nb, n_kv), 0.5, jnp.float32),
            v_scale=jnp.full((nb, n_kv), 0.25, jnp.float32),
        )
    elif kv == "fp8_tensor":
        kw = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25))
    return (q, kp, vp, bt, lengths), kw


def section_attention(ctx: Ctx):
    import jax

    P = importlib.import_module("pallas_kernels.paged_attention")

    n_q, n_kv, d, bs = (16, 2, 256, 16) if not ctx.smoke else (8, 2, 64, 16)
    # Checks: odd lengths, empty sequence, every KV flavour.
    for kv in (
        ("bf16", "fp8_block", "fp8_tensor") if ctx.focus != "final" else ("fp8_block", "fp8_tensor")
    ):
        args, kw = _attn_inputs(ctx, 3, n_q, n_kv, d, bs, 77, kv)
        q, kp, vp, bt, lengths = args
        lengths = lengths.at[2].set(0)
        want = P.paged_attention_reference(q, kp, vp, bt, lengths, scale=d**-0.5, **kw)
        for cfg in (P.PagedAttentionConfig(pages_per_step=2, splits=2),):
            rec = dict(
                kernel="paged_attention",
                format=kv,
                rows=3,
                n=77,
                k=d,
                check="small",
                config=_cfg_dict(cfg),
            )
            try:
                got = P.paged_attention(
                    q, kp, vp, bt, lengths, scale=d**-0.5, config=cfg, interpret=ctx.interpret, **kw
                )
                rec["rel_err"] = _rel_err(got, want)
                rec["ok"] = bool(rec["rel_err"] < 1e-2)
            except Exception as e:
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            ctx.emit(rec)
    if ctx.smoke:
        return
    for kv in ("bf16", "fp8_block") if ctx.focus != "final" else ("fp8_block",):
        for b, ctx_len in (
            ((1, 4096), (8, 4096), (32, 2048)) if ctx.focus != "final" else ((8, 4096),)
        ):
            if ctx.left() < 15:
                return
            itemsize = 2 if kv == "bf16" else 1
            nb = 2 * b * ctx_len * n_kv * d * itemsize
            copies = max(1, min(8, math.ceil(2 * L2_BYTES / nb)))
            args, kw = _attn_inputs(ctx, b, n_q, n_kv, d, bs, ctx_len, kv, copies=copies)
            q, kp, vp, bts, lengths = args
            bts = bts.reshape(copies, b, -1)
            cfgs = [P.PagedAttentionConfig()]
            if ctx.focus == "tune" and b == 32:
                for pps, warps in ((8, 4), (2, 4)):
                    c = P.PagedAttentionConfig(pages_per_step=pps, num_warps=warps)
                    if c not in cfgs:
                        cfgs.append(c)
            reps = _launches(nb, nb / 3.0e6)
            sets = [
                (
                    jax.random.normal(ctx.next_key(), q.shape, q.dtype),
                    kp,
                    vp,
                    bts[i % copies],
                    lengths,
                )
                for i in range(reps)
            ]
            want = P.paged_attention_reference(*sets[0], scale=d**-0.5, **kw)
            for cfg in cfgs:
                rec = dict(
                    kernel="paged_attention",
                    format=kv,
                    rows=b,
                    n=ctx_len,
                    k=d,
                    shape=f"b{b}_ctx{ctx_len}",
                    config=_cfg_dict(cfg),
                    is_default=cfg == P.PagedAttentionConfig(),
                )
                fn = functools.partial(P.paged_attention, scale=d**-0.5, config=cfg, **kw)
                _measure(ctx, rec, fn, sets, want, nb, tol=1e-2)
            fn = functools.partial(P.paged_attention_reference, scale=d**-0.5, **kw)
            t = _time(ctx, fn, sets[: max(2, len(sets) // 4)])
            ctx.emit(
                dict(
                    kernel="xla_paged_attention_reference",
                    format=kv,
                    rows=b,
                    n=ctx_len,
                    k=d,
                    shape=f"b{b}_ctx{ctx_len}",
                    time_us=t,
                    bytes=nb,
                    gbps=nb / t / 1e3,
                )
            )


def run_child(section: str, smoke: bool, deadline: float, out_path: str, focus: str, shapes: str):
    import jax

    if smoke:
        jax.config.update("jax_platforms", "cpu")
    ctx = Ctx(smoke, deadline, out_path, focus, shapes)
    ctx.emit(
        dict(
            kernel="_env",
            section=section,
            jax=jax.__version__,
            device=str(jax.devices()[0]),
            platform=jax.devices()[0].platform,
        )
    )
    try:
        if section == "baseline":
            section_baseline(ctx)
        elif section.startswith("gemv_"):
            section_gemv(ctx, section[len("gemv_") :])
        elif section == "verify":
            section_verify(ctx)
        elif section == "argmax":
            section_argmax(ctx)
        elif section == "attention":
            section_attention(ctx)
        else:
            raise ValueError(section)
    except Exception:
        ctx.emit(
            dict(kernel="_section_error", section=section, error=traceback.format_exc()[-2000:])
        )


# ---------------------------------------------------------------------------------------------
# Parent side: run sections, derive ratios, summarise.
# ---------------------------------------------------------------------------------------------


def _derive(records: list[dict]) -> list[dict]:
    """Attach baseline (XLA BF16 GEMV, one row, same shape) and ratios; mark the best configs."""
    xla = {
        (r["n"], r["k"], r["rows"]): r["time_us"]
        for r in records
        if r.get("kernel") == "xla_bf16_dot" and "time_us" in r
    }
    copy = [r for r in records if r.get("kernel") == "d2d_copy"]
    copy_gbps = copy[0]["gbps"] if copy else None
    for r in records:
        if "time_us" not in r or r["kernel"].startswith("_"):
            continue
        base = xla.get((r["n"], r["k"], 1))
        if r["kernel"].startswith(("argmax", "xla_argmax")):
            r["baseline"] = "nvfp4_gemv_lm_head_m1_best"
        elif r["kernel"].startswith(("paged_attention", "xla_paged")):
            r["baseline"] = "xla_paged_attention_reference"
        else:
            r["baseline"] = "xla_bf16_dot_m1"
            r["baseline_time_us"] = base
            r["ratio"] = None if base is None else r["time_us"] / base
        if copy_gbps and r.get("gbps"):
            r["frac_of_copy_bw"] = r["gbps"] / copy_gbps
    # Best config per (kernel, format, rows, shape) among checked-OK runs.
    best: dict = {}
    for r in records:
        if "time_us" in r and r.get("ok", True) and not r["kernel"].startswith("_"):
            key = (r["kernel"], r["format"], r["rows"], r["n"], r["k"])
            if key not in best or r["time_us"] < best[key]["time_us"]:
                best[key] = r
    for r in best.values():
        r["best"] = True
    nv = best.get(("nvfp4_gemv", "nvfp4", 1, LM_HEAD[1], LM_HEAD[2]))
    attn_ref = {
        (r["format"], r["shape"]): r["time_us"]
        for r in records
        if r.get("kernel") == "xla_paged_attention_reference"
    }
    for r in records:
        if r.get("kernel") == "argmax_logprob" and "time_us" in r and nv:
            r["baseline_time_us"] = nv["time_us"]
            r["ratio"] = r["time_us"] / nv["time_us"]
        if r.get("kernel") == "paged_attention" and "time_us" in r:
            b = attn_ref.get((r["format"], r.get("shape")))
            r["baseline_time_us"] = b
            r["ratio"] = None if b is None else r["time_us"] / b
    return records


def _summary(records: list[dict]) -> str:
    best = {
        (r["kernel"], r["format"], r["rows"], r["n"], r["k"]): r for r in records if r.get("best")
    }
    lines = []
    fails = [r for r in records if r.get("ok") is False]
    errs = [r for r in records if r.get("kernel") == "_section_error"]
    lines.append(
        f"checks: {sum(1 for r in records if r.get('ok') is True)} ok, "
        f"{len(fails)} failed; section errors: {len(errs)}"
    )
    for r in fails[:12]:
        lines.append(
            f"  FAIL {r['kernel']} rows={r['rows']} n={r['n']} k={r['k']} "
            f"err={r.get('rel_err', r.get('error', ''))!s:.160} cfg={r.get('config')}"
        )
    for r in errs:
        lines.append(f"  SECTION ERROR {r['section']}: {r['error'][-600:]}")
    copy = [r for r in records if r["kernel"] == "d2d_copy"]
    if copy:
        lines.append(f"d2d copy: {copy[0]['gbps']:.0f} GB/s")
    n, k = LM_HEAD[1], LM_HEAD[2]
    xla1 = next(
        (
            r["time_us"]
            for r in records
            if r["kernel"] == "xla_bf16_dot" and r["n"] == n and r["k"] == k and r["rows"] == 1
        ),
        None,
    )
    lines.append(f"LM head [{n}, {k}]  XLA bf16 GEMV M=1: {xla1}")
    hdr = f"{'kernel':<26}{'fmt':<10}{'rows':>5}{'time_us':>10}{'GB/s':>8}{'ratio':>8}  config"
    lines.append(hdr)
    for key in sorted(best, key=lambda t: (t[0], t[1], t[3], t[4], t[2])):
        r = best[key]
        if r["n"] != n and not r["kernel"].startswith(("argmax", "paged", "xla_paged", "xla_arg")):
            continue
        cfg = r.get("config") or {}
        cs = ",".join(f"{a}={b}" for a, b in cfg.items() if b is not None)
        ratio = r.get("ratio")
        lines.append(
            f"{r['kernel']:<26}{r['format']:<10}{r['rows']:>5}{r['time_us']:>10.1f}"
            f"{r.get('gbps', 0):>8.0f}{'' if ratio is None else f'{ratio:8.3f}':>8}  {cs[:90]}"
        )
    lines.append("other shapes (best, M=1 and M=8):")
    for key in sorted(best, key=lambda t: (t[0], t[1], t[3], t[4], t[2])):
        r = best[key]
        if (
            r["n"] == n
            or r["rows"] not in (1, 8)
            or r["kernel"].startswith(("argmax", "paged", "xla_paged", "xla_arg"))
        ):
            continue
        ratio = r.get("ratio")
        lines.append(
            f"{r['kernel']:<26}{r['format']:<10}{r['rows']:>5} [{r['n']},{r['k']}]"
            f"{r['time_us']:>9.1f}{r.get('gbps', 0):>7.0f}{'' if ratio is None else f'{ratio:8.3f}':>8}"
        )
    return "\n".join(lines)


def run_section_child(
    script: str, section: str, out_path: str, deadline: float, extra: list[str], *, grace: float
) -> tuple[int, str, str, list[dict]]:
    """Runs ``script --child section --out out_path --deadline deadline *extra`` in a fresh
    process, so a kernel that faults cannot take the others down. Returns (returncode, stdout,
    stderr, the JSON-lines records it wrote); the return code is -9 when the child outlives
    ``deadline + grace`` seconds."""
    cmd = [sys.executable, os.path.abspath(script), "--child", section, "--out", out_path]
    cmd += ["--deadline", str(deadline), *extra]
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=max(30.0, deadline - time.time() + grace),
        )
        rc, out, err = proc.returncode, proc.stdout or "", proc.stderr or ""
    except subprocess.TimeoutExpired as e:
        rc, out, err = -9, "", f"timeout: {str(e.stderr or '')[-2000:]}"
    records = []
    if os.path.exists(out_path):
        with open(out_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return rc, out, err, records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=False, default=None, help="write all records here")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget, all sections")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    ap.add_argument(
        "--focus",
        default="tune",
        choices=("tune", "quick", "final"),
        help="tune: also time tile variants on the LM head; quick: defaults only; "
        "final: a short confirmation pass of the chosen defaults on the LM head",
    )
    ap.add_argument(
        "--shapes",
        default="all",
        choices=("all", "lm_head"),
        help="GEMV shapes: the LM head only, or also the drafter projections",
    )
    ap.add_argument("--workdir", default=None, help="keep the per-section JSONL files here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        run_child(args.child, args.smoke, args.deadline, args.out, args.focus, args.shapes)
        return 0

    from tqdm import tqdm

    sections = [s for s in args.sections.split(",") if s]
    start = time.time()
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = args.workdir or tmpdir
        os.makedirs(tmp, exist_ok=True)
        bar = tqdm(sections, desc="sections", file=sys.stdout)
        for i, sec in enumerate(bar):
            bar.set_postfix_str(sec)
            remaining = args.budget_s - (time.time() - start)
            share = remaining / (len(sections) - i)
            # Give the big sections more of the remaining time.
            weight = {"gemv_nvfp4": 1.6, "verify": 1.6, "baseline": 0.7}.get(sec, 1.0)
            deadline = time.time() + min(remaining - 5, share * weight)
            path = os.path.join(tmp, f"{sec}.jsonl")
            extra = ["--focus", args.focus, "--shapes", args.shapes] + (
                ["--smoke"] if args.smoke else []
            )
            rc, _, err, recs = run_section_child(__file__, sec, path, deadline, extra, grace=60)
            records.extend(recs)
            if rc != 0:
                records.append(
                    dict(
                        kernel="_section_error",
                        section=sec,
                        error=err[-2000:],
                        rows=0,
                        n=0,
                        k=0,
                        format="",
                    )
                )
            bar.write(
                f"{sec}: rc={rc}, {len(records)} records so far, {time.time() - start:.0f}s elapsed"
            )
    records = _derive(records)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), records=records), f, indent=1)
    print(_summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
