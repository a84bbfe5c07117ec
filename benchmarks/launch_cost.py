"""Fewer, larger GEMVs in the drafter step: is a kernel's own launch cost the bottleneck?

    python -m benchmarks.launch_cost --json $OUT/launch_cost_h200.json
    python -m benchmarks.launch_cost --smoke --json /tmp/launch_cost.json   # CPU, tiny shapes

The drafter's step is one decoder layer at the dense head's shapes
(``benchmarks.propose.head_config("dense")``: hidden 5120, a gated q_proj [12288, 5120],
k/v_proj [1024, 5120], o_proj [5120, 6144], gate/up_proj [17408, 5120], down_proj [5120, 17408],
fc [5120, 10240]; BF16, 849 MB). Each variant is one ``jax.jit`` of
``mtpjax.linear(..., implementation="auto")`` calls, as ``propose`` runs them (on the GPU the
Triton GEMV for BF16 weights), at each of ``--rows`` (1 and 8: one sequence, eight):

* ``separate``: the projections as the drafter issues them (q, k, v, gate, up, o, down, fc):
  8 GEMVs;
* ``fused``: q|k|v and gate|up concatenated along the output axis, the same bytes: 5 GEMVs;
* ``one``: every projection of a 5120-wide input in one weight (q|k|v|gate|up, [49152, 5120]):
  4 GEMVs (o, down, fc read other widths), the floor of "as few kernels as possible";
* ``glue``: ``separate`` inside the layer's own XLA glue (``mtpjax.layers``: the pre-fc norms
  and concat, the input norm, q/k head norms and RoPE, the output gate, the residual adds, the
  FFN norm, silu * up), attention's output replaced by the rotated queries.

The GEMV variants take BF16 inputs (no converts), the five 5120-wide projections one input
(``one`` needs it), and return each GEMV's output unsplit (a consumer fusion slices for free);
the child splits them and compares each projection with ``separate``'s: ``equal_to_separate``
(bit for bit), ``max_rel_diff`` (the Triton heuristic's split-K depends on N, so on the GPU a
concatenated weight may sum K in other slices).

Per (variant, rows): ``gemvs`` (by construction), ``hlo_matmuls`` (Pallas calls + dots) and
``kernels`` (custom calls + fusions + copies, as ``benchmarks.propose.scan_hlo`` counts; XLA's
command buffers form after that HLO and do not show) in the optimised HLO; ``weight_bytes``,
``bytes`` (every argument and output); ``time_queued_us`` (``harness.time_queued`` at
``QUEUED_CALLS``: the device's time) and ``time_synced_us`` (a call waited for, as a caller
reading every result), each the median of ``REPS`` rounds that time every variant in turn after
a warm-up (drift falls on all alike; ``*_p10_us`` / ``*_p90_us``: over the rounds);
``roofline_us`` (``bytes`` at ``harness.copy_bandwidth``, same process; a pure read can beat a
copy's rate, so a ratio may dip under 1) and the times over it and over ``separate``'s.

L2: a call reads each weight once, 849 MB, 14x the H200's L2 (``harness.L2_BYTES``), so none is
cached when read again; calls still rotate through ``max(2, ceil(2 L2 / bytes))`` weight sets
(2: 1.7 GB, plus 2 GB of ``fused`` / ``one`` copies). One child process a row count
(``harness.run_sections``, shares of ``--budget-s``) builds them and runs every variant asked
for; ``separate``, the baseline, always. ``--smoke``: the tiny dense config on the CPU
(``linear``'s XLA reference), in seconds.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import re
import sys
import tempfile

import numpy as np

from benchmarks import harness

VARIANTS = ("separate", "fused", "one", "glue")
IMPLEMENTATION = "auto"  # what propose passes
#: The step's projections, in the drafter's order, and the input each reads.
PROJECTIONS = dict(
    q="hidden", k="hidden", v="hidden", gate="hidden", up="hidden", o="attn", down="mlp", fc="pair"
)
#: Each variant's GEMVs: the projections concatenated (along the output axis) into each weight.
GROUPS = dict(
    separate=tuple((p,) for p in PROJECTIONS),
    fused=(("q", "k", "v"), ("gate", "up"), ("o",), ("down",), ("fc",)),
    one=(("q", "k", "v", "gate", "up"), ("o",), ("down",), ("fc",)),
)
GROUPS["glue"] = GROUPS["separate"]
#: Rounds of :func:`_time_in_turns` (every variant timed once a round) and the queued calls
#: of each round's timer, ``(lo, hi)``: many, so the host's sync jitter divides away.
REPS, QUEUED_CALLS = 15, (4, 40)
MAX_ROWS = 128  # one GEMV pass (``pallas_kernels._linear.triton.WIDE_MAX_ROWS``); XLA's dot past
_FUSION = re.compile(r"\sfusion\(")
_DOT = re.compile(r"\sdot\(")


def head_config(smoke: bool):
    from benchmarks.propose import head_config

    return head_config("dense", smoke=smoke)


def projections(params) -> dict:
    """The step's projection weights of a ``DrafterParams``, by :data:`PROJECTIONS` name."""
    att, ffn = params.layer.attention, params.layer.ffn
    return dict(
        q=att.q_proj, k=att.k_proj, v=att.v_proj, gate=ffn.gate_proj, up=ffn.up_proj,
        o=att.o_proj, down=ffn.down_proj, fc=params.fc,
    )  # fmt: skip


def weight_sets(cfg, keys) -> list:
    """Random BF16 drafter heads, one per key number (the same in every process)."""
    import jax

    from mtpjax import drafter

    return [drafter.init(cfg, key=jax.random.key(i), precision="bf16") for i in keys]


def layout(variant: str, params):
    """A variant's weights: ``params`` for ``glue``, else a tuple of one BF16 weight a GEMV."""
    import jax.numpy as jnp

    from mtpjax.weights import Bf16Weight

    if variant == "glue":
        return params
    w = projections(params)
    return tuple(
        w[g[0]] if len(g) == 1 else Bf16Weight(w=jnp.concatenate([w[p].w for p in g]))
        for g in GROUPS[variant]
    )


def inputs(variant: str, widths: dict, rows: int) -> tuple:
    """A variant's activations (fixed keys; ``widths``: each input's K): ``glue`` the embedding
    and hidden rows f32[rows, H] and positions int32[rows]; else ``{input: bf16[rows, K]}``."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(1000 + rows)
    if variant == "glue":
        e, h = jax.random.normal(key, (2, rows, widths["hidden"]), jnp.float32)
        return e, h, jnp.full((rows,), 4095, jnp.int32)
    keys = jax.random.split(key, len(widths))
    return (
        {n: jax.random.normal(k, (rows, K), jnp.bfloat16) for (n, K), k in zip(widths.items(), keys)},
    )  # fmt: skip


def program(variant: str, cfg):
    """The function a variant jits: ``fn(layout, *inputs)`` -> its GEMVs' outputs (``glue``:
    the layer's output f32[rows, H] and the cache rows k, v f32[rows, Nkv, D])."""
    import jax.numpy as jnp

    from mtpjax.weights import linear

    if variant == "glue":
        return functools.partial(_glue, cfg=cfg)
    f32 = dict(out_dtype=jnp.float32, implementation=IMPLEMENTATION)

    def project(weights, xs):
        groups = GROUPS[variant]
        return tuple(linear(xs[PROJECTIONS[g[0]]], w, **f32) for g, w in zip(groups, weights))

    return project


def _glue(params, e, h, positions, *, cfg):
    """One drafter row's layer (``mtpjax.drafter``'s fuse_inputs, pair_rows, decode_row) with
    the rotated queries standing in for attention's output."""
    import jax.numpy as jnp

    from mtpjax.layers.attention import output_projection, project_kv, project_q
    from mtpjax.layers.decoder import ffn_residual, input_norm
    from mtpjax.layers.norms import rms_norm
    from mtpjax.weights import linear

    kw = dict(implementation=IMPLEMENTATION)
    norm = dict(eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm)
    e = rms_norm(e, params.pre_fc_norm_embedding, **norm)
    h = rms_norm(h, params.pre_fc_norm_hidden, **norm)
    x = linear(jnp.concatenate([e, h], axis=-1), params.fc, out_dtype=jnp.float32, **kw)
    att = params.layer.attention
    a = input_norm(params.layer, x, cfg=cfg)
    q, gate = project_q(att, a, positions, cfg, **kw)
    k, v = project_kv(att, a, positions, cfg, **kw)
    x = x + output_projection(att, q, gate, **kw)
    return ffn_residual(params.layer, x, cfg=cfg, **kw), k, v


def split(variant: str, outs, widths: dict) -> dict:
    """A GEMV variant's outputs as ``{projection: f32[rows, N]}`` (``widths``: each N)."""
    parts = {}
    for g, out in zip(GROUPS[variant], outs, strict=True):
        cuts = np.cumsum([widths[p] for p in g])[:-1]
        parts.update(zip(g, np.split(np.asarray(out), cuts, axis=-1), strict=True))
    return parts


def count_kernels(text: str) -> dict:
    """Launches in optimised HLO text: custom calls + fusions + copies (a GPU's kernels)."""
    from benchmarks.propose import scan_hlo

    hlo = scan_hlo(text)
    calls, fusions = sum(hlo["custom_calls"].values()), len(_FUSION.findall(text))
    return dict(
        kernels=calls + fusions + hlo["copies"], custom_calls=calls, fusions=fusions,
        copies=hlo["copies"], hlo_matmuls=hlo["pallas_kernels"] + len(_DOT.findall(text)),
    )  # fmt: skip


def compare(parts: dict, reference: dict) -> dict:
    """Per-projection outputs against ``separate``'s: bit for bit, and the largest difference."""
    assert sorted(parts) == sorted(reference)
    diff = max(float(np.abs(parts[p] - reference[p]).max()) for p in reference)
    scale = max(float(np.abs(reference[p]).max()) for p in reference)
    same = all(np.array_equal(parts[p], reference[p]) for p in reference)
    return dict(equal_to_separate=same, max_abs_diff=diff, max_rel_diff=diff / scale)


def _prepare(child, rec: dict, fn, args: list[tuple], widths: dict):
    """Compiles ``fn`` into ``rec`` (kernels, bytes, finite); returns a call rotating through
    ``args`` and the first call's per-projection outputs (None for ``glue``)."""
    import jax

    from benchmarks.propose import SMOKE_COMPILER_OPTIONS

    options = SMOKE_COMPILER_OPTIONS if child.smoke else None
    compiled = jax.jit(fn).lower(*args[0]).compile(compiler_options=options)
    rec.update(count_kernels(compiled.as_text()))
    out = jax.block_until_ready(compiled(*args[0]))
    rec["finite"] = all(bool(np.isfinite(np.asarray(a)).all()) for a in jax.tree.leaves(out))
    rec["bytes"] = harness.tree_bytes(args[0]) + harness.tree_bytes(out)
    parts = None if rec["variant"] == "glue" else split(rec["variant"], out, widths)
    sets = itertools.cycle(args)
    return (lambda: compiled(*next(sets))), parts


def _time_in_turns(child, runs: list[tuple[dict, object]], copy_gbps: float) -> None:
    """Times every ``(rec, call)`` in turns, ``REPS`` rounds after a warm-up (so clock and
    drift fall on all variants alike): each timer's median round, and the ratios."""
    import jax

    smoke = child.smoke
    for _, call in runs:
        jax.block_until_ready([call() for _ in range(1 if smoke else 20)])
    times = {(i, t): [] for i in range(len(runs)) for t in ("queued", "synced")}
    for _ in range(1 if smoke else REPS):
        for i, (_, call) in enumerate(runs):
            kw = harness.SMOKE_CALLS if smoke else dict(calls=QUEUED_CALLS, reps=1)
            times[i, "queued"].append(harness.time_queued(call, **kw))
            synced = harness.time_synced(call, iters=1 if smoke else 8, warmup=1)
            times[i, "synced"].append(synced["time_us"])
    base = next((i for i, (r, _) in enumerate(runs) if r["variant"] == "separate"), None)
    for (i, t), ts in times.items():
        rec, st = runs[i][0], harness.stats(ts)
        rec["roofline_us"] = roof = rec["bytes"] / (copy_gbps * 1e3)
        rec.update({f"time_{t}_us": st["time_us"], f"{t}_over_roofline": st["time_us"] / roof})
        rec.update({f"{t}_p10_us": st["p10_us"], f"{t}_p90_us": st["p90_us"]})
        ref = None if base is None else float(np.median(times[base, t]))
        rec[f"{t}_over_separate"] = None if ref is None else st["time_us"] / ref


def section(rows: int):
    """The child section of one row count: the copy bandwidth, the weight sets, every variant
    asked for compiled (``fused`` and ``one`` compared with ``separate``), then timed in turns."""

    def run(child) -> None:
        bw = harness.copy_bandwidth(smoke=child.smoke)
        child.emit(dict(kernel="device_copy", section=f"rows{rows}", **bw))
        cfg = head_config(child.smoke)
        base = weight_sets(cfg, [0])
        step = projections(base[0])
        n_sets = min(8, max(2, math.ceil(2 * harness.L2_BYTES / harness.tree_bytes(step))))
        base += weight_sets(cfg, range(1, 2 if child.smoke else n_sets))
        widths = {p: w.out_features for p, w in step.items()}
        in_widths = {PROJECTIONS[p]: w.in_features for p, w in step.items()}
        runs, reference = [], None
        for variant in child.options.variants:
            rec = dict(kernel="launch_cost", variant=variant, rows=rows, sets=len(base))
            rec.update(gemvs=len(GROUPS[variant]), weight_bytes=harness.tree_bytes(step))
            if child.left() < (2 if child.smoke else 30):
                child.emit(dict(rec, kernel="skipped"))
                continue
            xs = inputs(variant, in_widths, rows)
            try:
                args = [(layout(variant, p), *xs) for p in base]
                call, parts = _prepare(child, rec, program(variant, cfg), args, widths)
            except Exception as e:  # one failing lowering is recorded, not fatal
                child.emit(dict(rec, error=f"{type(e).__name__}: {str(e)[-1500:]}"))
                continue
            if variant == "separate":
                reference = parts
            elif parts is not None and reference is not None:
                rec.update(compare(parts, reference))
            runs.append((rec, call))
        try:
            _time_in_turns(child, runs, bw["gbps"])
        except Exception as e:  # the compiled variants' records still go out
            for rec, _ in runs:
                rec.update(error=f"{type(e).__name__}: {str(e)[-1500:]}")
        for rec, _ in runs:
            child.emit(rec)

    return run


#: The table's timed columns: (heading, record field).
COLUMNS = (
    ("queued µs", "time_queued_us"), ("synced µs", "time_synced_us"), ("roof µs", "roofline_us"),
    ("q/roof", "queued_over_roofline"), ("s/roof", "synced_over_roofline"),
    ("q/sep", "queued_over_separate"), ("s/sep", "synced_over_separate"),
)  # fmt: skip


def summary(records: list[dict]) -> str:
    cell = lambda v: f"{v:>10.2f}" if isinstance(v, float) else f"{'-':>10}"  # noqa: E731
    head = f"{'variant':<9}{'rows':>5}{'gemvs':>6}{'kernels':>8}{'MB':>6}"
    lines = [head + "".join(f"{name:>10}" for name, _ in COLUMNS) + "  vs separate"]
    for r in records:
        if r.get("kernel") == "device_copy":
            lines.append(f"copy ({r['section']}): {r['gbps']:.0f} GB/s")
        elif r.get("kernel") == "_section_error":
            lines.append(f"SECTION ERROR {r.get('section')}: {r.get('error', '')[-600:]}")
        elif r.get("kernel") in ("launch_cost", "skipped"):
            head = f"{r['variant']:<9}{r['rows']:>5}{r['gemvs']:>6}{r.get('kernels', '-'):>8}"
            if "time_queued_us" not in r:
                lines.append(f"{head}  {r.get('error', 'skipped: out of budget')[:200]}")
                continue
            same = r.get("equal_to_separate")
            note = "" if same is None else "equal" if same else f"rel {r['max_rel_diff']:.1e}"
            cells = "".join(cell(r.get(field)) for _, field in COLUMNS)
            lines.append(f"{head}{r['weight_bytes'] / 1e6:>6.0f}{cells}  {note}")
    return "\n".join(lines)


def _rows(text: str) -> list[int]:
    rows = [int(v) if v.isdigit() else 0 for v in text.split(",")]
    if len(set(rows)) < len(rows) or not all(1 <= m <= MAX_ROWS for m in rows):
        raise ValueError(
            f"--rows: expected distinct comma-separated integers in 1..{MAX_ROWS}, got {text!r}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", default=None, help="write the run and its records here (required)")
    ap.add_argument("--rows", default="1,8", help=f"comma-separated rows a call, 1..{MAX_ROWS}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from {','.join(VARIANTS)}")
    ap.add_argument("--budget-s", type=float, default=140.0, help="the whole run's wall clock")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    harness.add_child_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    try:
        args.rows = _rows(args.rows)
    except ValueError as e:
        ap.error(str(e))
    asked = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in asked if v not in VARIANTS]:
        ap.error(f"--variants: unknown {unknown[0]!r}, expected one of {list(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in asked or v == "separate"]  # the baseline
    if args.child:
        return harness.child_main(args, {f"rows{m}": section(m) for m in args.rows})
    if not args.json:
        ap.error("--json: required")
    sections = [f"rows{m}" for m in args.rows]
    extra = ["--rows", ",".join(map(str, args.rows)), "--variants", ",".join(args.variants)]
    with tempfile.TemporaryDirectory() as tmp:
        records = harness.run_sections(
            "benchmarks.launch_cost", sections, budget_s=args.budget_s,
            extra=extra + ["--smoke"] * args.smoke, workdir=tmp,
        )  # fmt: skip
    env = next((r for r in records if r.get("kernel") == "_env"), {})
    harness.write_records(args.json, records, harness.run_info("benchmarks.launch_cost", argv, env))
    print(summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
