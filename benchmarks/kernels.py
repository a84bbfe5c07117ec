"""Tile sweeps of the kernel ops over their backends' configs, through the public op API.

    python -m benchmarks.kernels --json $OUT/kernels_h200.json

Each case of :data:`SWEEPS` names an op (``pallas_kernels.linear`` or
``pallas_kernels.paged_attention``), its operands, a backend (``implementation=``), the name of
that backend's config class exported by ``pallas_kernels`` and the tile variants to time. A case
times the backend's heuristic default (``config=None``) first, then each variant, then XLA
(``implementation="xla"``) on the same operands, all steady-state (``benchmarks.harness``), each
section in a child process. A variant that is invalid or fails to lower is recorded with its
error. Correctness of every config is the tests'. Record fields: ``kernel, op, format, rows, n,
k, shape, implementation, config, is_default, time_us, time_us_synced, bytes, gbps, ok,
xla_time_us, ratio`` (to XLA), ``frac_of_copy_bw``. ``--smoke``: tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile

from benchmarks import harness


def _ws(block_n: int, block_k: int, stages: int) -> dict:
    """A warp-specialised CTA: one producer and two consumer warpgroups, as many stages as fit
    the SM's shared memory."""
    return dict(block_n=block_n, block_k=block_k, stages=stages, consumers=2)


#: The verify's 32 rows (B = 8, K = 3): two consumer warpgroups sharing each activation tile
#: (the one-warpgroup tiles around the 64x256 default were measured before: BENCHMARKS.md).
NVFP4_32_ROWS = (_ws(128, 256, 4), _ws(128, 256, 6), _ws(128, 512, 3), _ws(256, 256, 3))
#: linear: (format, rows, implementation, config class, variants as field dicts), on the LM head.
LINEAR_SWEEP = (
    (
        "nvfp4",
        1,
        "mosaic_gpu",
        "MosaicGemvConfig",
        (
            {"block_n": 128},
            {"block_k": 1024},
            _ws(128, 512, 4),
            _ws(128, 256, 10),
            _ws(256, 256, 5),
        ),
    ),
    ("nvfp4", 8, "mosaic_gpu", "MosaicGemvConfig", ({"block_n": 128}, {"stages": 3})),
    (
        "nvfp4",
        16,
        "mosaic_gpu",
        "MosaicGemvConfig",
        ({"block_k": 512}, {"block_n": 128}, _ws(128, 256, 8)),
    ),
    ("nvfp4", 32, "mosaic_gpu", "MosaicGemvConfig", NVFP4_32_ROWS),
    (
        "nvfp4",
        96,
        "mosaic_gpu",
        "MosaicGemvConfig",
        (
            {"block_n": 64, "block_k": 256},
            {"block_n": 128, "block_k": 256, "stages": 3},
            _ws(128, 256, 2),
        ),
    ),
    ("fp8", 1, "mosaic_gpu", "MosaicGemvConfig", ({"block_k": 512}, {"block_n": 128})),
    (
        "fp8",
        96,
        "mosaic_gpu",
        "MosaicGemvConfig",
        ({"block_k": 256}, {"block_n": 64, "block_k": 128}),
    ),
    ("fp8_block", 1, "mosaic_gpu", "MosaicGemvConfig", ({"block_k": 512},)),
    ("bf16", 1, "triton", "GemvConfig", ({"block_n": 128, "num_warps": 8},)),
    ("nvfp4", 1, "triton", "GemvConfig", ({"block_n": 16, "block_k": 1024},)),
)
LM_HEAD = ("lm_head", 248320, 5120)
#: paged attention: (KV dtype, batch, context, implementation, config class, variants).
ATTENTION_SWEEP = (
    ("bf16", 8, 4096, "triton", "PagedAttentionConfig", ({"pages_per_step": 8},)),
    ("fp8_block", 32, 2048, "triton", "PagedAttentionConfig", ({"pages_per_step": 2},)),
)
ATTN_HEADS = (16, 2, 256, 16)  # query heads, KV heads, head dim, block size (the MoE head's)
SMOKE_SHAPE = ("small", 256, 512)
SECTIONS = ("linear", "attention")


def _config(cls_name: str, fields: dict | None):
    """The backend config (None: the backend's heuristic), named as ``pallas_kernels`` exports
    it; ``fields`` override the defaults of its class."""
    import pallas_kernels

    return None if fields is None else getattr(pallas_kernels, cls_name)(**fields)


def _copies(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else max(1, min(8, math.ceil(2 * harness.L2_BYTES / nbytes)))


def _case(child, rec: dict, call, sets: list[tuple], nbytes: int, variants) -> None:
    """Default, variants, then XLA on ``sets``; ``call(impl, config, *operands)``."""
    n_launch = 2 if child.smoke else max(4, len(sets))
    xla = harness.measure(
        dict(rec, kernel="xla", implementation="xla"),
        lambda *a: call("xla", None, *a),
        sets,
        n_launch=n_launch,
        nbytes=nbytes,
        smoke=child.smoke,
    )
    child.emit(xla)
    default_key = (rec["op"], rec["format"], rec["rows"], rec["n"], rec["implementation"])
    timed_default = default_key in child.options.defaults_timed
    child.options.defaults_timed.add(default_key)
    for fields in (*(() if timed_default else (None,)), *variants):
        if child.left() < 15:
            return
        out = dict(rec, config=fields, is_default=fields is None)
        try:
            cfg = _config(rec["config_class"], fields)
            fn = lambda *a, cfg=cfg: call(rec["implementation"], cfg, *a)  # noqa: E731
            harness.measure(out, fn, sets, n_launch=n_launch, nbytes=nbytes, smoke=child.smoke)
        except Exception as e:
            out.update(ok=False, error=f"{type(e).__name__}: {str(e)[-800:]}")
        if out.get("time_us") and xla.get("time_us"):
            out.update(xla_time_us=xla["time_us"], ratio=out["time_us"] / xla["time_us"])
        child.emit(out)


def section_linear(child) -> None:
    import jax
    import jax.numpy as jnp

    import mtpjax
    import pallas_kernels

    if not child.smoke:
        bw = harness.copy_bandwidth()
        child.emit(dict(kernel="device_copy", op="copy", **bw))
    name, n, k = SMOKE_SHAPE if child.smoke else LM_HEAD
    for fmt, rows, impl, cls_name, variants in LINEAR_SWEEP:
        if child.options.cases and f"{fmt}/{rows}/{impl}" not in child.options.cases:
            continue
        if child.left() < 20:
            return
        w0 = jax.random.normal(child.next_key(), (n, k), jnp.bfloat16) * 0.02
        ws = [mtpjax.quantize(w0, fmt)]
        nbytes = harness.tree_bytes(ws[0])
        ws += [mtpjax.quantize(w0 * (i + 2), fmt) for i in range(_copies(nbytes, child.smoke) - 1)]
        xs = [jax.random.normal(child.next_key(), (rows, k), jnp.bfloat16) for _ in ws]

        def call(impl, cfg, x, w):
            kw = dict(out_dtype=jnp.float32, implementation=impl)
            return pallas_kernels.linear(x, w, **kw, **({} if cfg is None else dict(config=cfg)))

        rec = dict(op="linear", format=fmt, rows=rows, n=n, k=k, shape=name, implementation=impl)
        rec.update(kernel=f"linear_{impl}", config_class=cls_name)
        sets = list(zip(xs, ws, strict=True))
        _case(child, rec, call, sets, nbytes + rows * k * 2, variants)
        del ws, xs, sets


def _attention_operands(child, kv: str, b: int, context: int, copies: int):
    """One query row per sequence over ``context`` KV rows of a shuffled paged pool."""
    import jax
    import jax.numpy as jnp

    n_q, n_kv, d, bs = (8, 2, 64, 16) if child.smoke else ATTN_HEADS
    per_seq = -(-context // bs)
    nb = b * per_seq * copies
    k0, k1, k2, k3 = jax.random.split(child.next_key(), 4)
    dtype = jnp.bfloat16 if kv == "bf16" else jnp.float8_e4m3fn
    kp = jax.random.normal(k0, (nb, bs, n_kv, d), jnp.float32).astype(dtype)
    vp = jax.random.normal(k1, (nb, bs, n_kv, d), jnp.float32).astype(dtype)
    tables = jax.random.permutation(k2, nb).astype(jnp.int32).reshape(copies, b, per_seq)
    seq_len = jnp.full((b,), context, jnp.int32)
    scales = {}
    if kv == "fp8_block":
        scales = dict(k_scale=jnp.full((nb, n_kv), 0.5), v_scale=jnp.full((nb, n_kv), 0.25))
    qs = [jax.random.normal(jax.random.fold_in(k3, i), (b, n_q, d)) for i in range(copies)]
    sets = [(q, kp, vp, t, seq_len) for q, t in zip(qs, tables, strict=True)]
    return sets, scales, d**-0.5, 2 * b * context * n_kv * d * jnp.dtype(dtype).itemsize


def section_attention(child) -> None:
    import pallas_kernels

    for kv, b, context, impl, cls_name, variants in ATTENTION_SWEEP:
        if child.left() < 20:
            return
        if child.smoke:
            b, context = 2, 40
        _, n_kv, d, _ = ATTN_HEADS
        copies = _copies(2 * b * context * n_kv * d * 2, child.smoke)
        sets, scales, scale, nbytes = _attention_operands(child, kv, b, context, copies)

        def call(impl, cfg, *operands, scales=scales, scale=scale):
            kw = dict(scale=scale, implementation=impl, **scales)
            if cfg is not None:
                kw["config"] = cfg
            return pallas_kernels.paged_attention(*operands, **kw)

        rec = dict(op="paged_attention", format=kv, rows=b, n=context, k=sets[0][0].shape[-1])
        rec.update(shape=f"b{b}_ctx{context}", implementation=impl, config_class=cls_name)
        rec["kernel"] = f"paged_attention_{impl}"
        _case(child, rec, call, sets, nbytes, variants)


def derive(records: list[dict]) -> list[dict]:
    """``frac_of_copy_bw``: each timed record's bandwidth over the device copy's."""
    copy = next((r["gbps"] for r in records if r.get("kernel") == "device_copy"), None)
    for r in records:
        if copy and r.get("gbps") and r.get("kernel") != "device_copy":
            r["frac_of_copy_bw"] = r["gbps"] / copy
    return records


def summary(records: list[dict]) -> str:
    lines = [f"{'kernel':<24}{'fmt':<10}{'rows':>5}{'time_us':>10}{'GB/s':>7}{'vs XLA':>8}  config"]
    for r in records:
        kern = r.get("kernel", "_")
        if kern == "_section_error":
            lines.append(f"SECTION ERROR {r.get('section')}: {r.get('error', '')[-600:]}")
        if kern.startswith("_") or "format" not in r:
            continue
        t, g, ratio = r.get("time_us"), r.get("gbps"), r.get("ratio")
        cfg = "default" if r.get("is_default") else (r.get("config") or "")
        note = "" if r.get("ok", True) else f"  NOT OK {r.get('error', '')[-200:]}"
        lines.append(
            f"{kern:<24}{r['format']:<10}{r['rows']:>5}{'' if t is None else f'{t:10.1f}':>10}"
            f"{'' if g is None else f'{g:7.0f}':>7}{'' if ratio is None else f'{ratio:8.3f}':>8}"
            f"  {cfg}{note}"
        )
    return "\n".join(lines)


def _cases(text: str) -> tuple[str, ...]:
    known = {f"{f}/{r}/{i}" for f, r, i, *_ in LINEAR_SWEEP}
    cases = tuple(c for c in text.split(",") if c)
    unknown = [c for c in cases if c not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown cases {unknown}: expected from {sorted(known)}")
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the run and its records here")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"from {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    ap.add_argument(
        "--cases", type=_cases, default=(), help="linear cases only, as format/rows/implementation"
    )
    harness.add_child_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.defaults_timed = set()  # (op, format, rows, N, implementation) whose default is timed
    if args.child:
        return harness.child_main(args, {"linear": section_linear, "attention": section_attention})
    with tempfile.TemporaryDirectory() as tmp:
        records = harness.run_sections(
            "benchmarks.kernels",
            [s for s in args.sections.split(",") if s],
            budget_s=args.budget_s,
            extra=["--smoke"] * args.smoke
            + (["--cases", ",".join(args.cases)] if args.cases else []),
            workdir=tmp,
        )
    records = derive(records)
    if args.json:
        env = next((r for r in records if r.get("kernel") == "_env"), {})
        harness.write_records(args.json, records, harness.run_info("benchmarks.kernels", argv, env))
    print(summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
