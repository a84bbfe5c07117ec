"""Where the time of one jitted propose (or verify) goes: a GPU kernel breakdown from a profile.

    python -m benchmarks.profile --json $OUT/profile.json \
        --points dense/bf16-nvfp4head/3/1,dense/nvfp4/3/64

Each point is ``head/precision/K/B`` with the heads and precisions of ``benchmarks.propose``,
whose builders (random weights at real shapes, a KV pool filled to ``--context`` rows) this
module reuses. For each point it runs the jitted step under ``jax.profiler.trace`` with a
Perfetto trace, then sums the device-side events by kernel name and divides by the number of
profiled calls. A propose's kernels are also attributed to the part of the step that made
them (``STEP_PARTS``: ``linear``'s XLA ops, the LM head, the norms, q/k norm + RoPE, the KV
write, the page allocation, the pair window, ...; the Pallas kernels, which carry no HLO op, by
their names) through the stack frames of the compiled HLO, so the table
shows what fusing a part could save at most: its kernels and their time. Per kernel and per part:
microseconds per call, share of the GPU busy time, launches per call; "gaps" is the wall time per
call minus the busy time (launch latency, host work). ``--smoke`` runs tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import tempfile
import time
from pathlib import Path

import jax

from benchmarks import harness
from benchmarks import propose as bp
from mtpjax import drafter
from mtpjax.head import init_lm_head


def parse_point(text: str) -> tuple[str, str, int, int, str]:
    parts = text.split("/")
    if len(parts) not in (4, 5):
        raise argparse.ArgumentTypeError(f"point {text!r} is not head/precision/K/B[/round]")
    head, prec, k, b = parts[:4]
    what = parts[4] if len(parts) == 5 else "propose"
    if head not in bp.HEADS or prec not in bp.PRECISIONS or what not in ("propose", "round"):
        raise argparse.ArgumentTypeError(f"point {text!r}: unknown head, precision or step")
    return head, prec, int(k), int(b), what


def load_trace(trace_dir: Path) -> list[dict]:
    """The events of the newest Perfetto trace under ``trace_dir``."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def device_events(trace_dir: Path) -> list[dict]:
    """Complete ('X') events of GPU processes in the Perfetto trace under ``trace_dir``."""
    events = load_trace(trace_dir)
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
    if not gpu:  # a CPU run (--smoke): every process, to check the parsing
        gpu = set(names)
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def breakdown(events: list[dict], calls: int) -> tuple[list[dict], float]:
    """Per kernel name: µs per call, launches per call; plus the busy µs per call."""
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for e in events:
        tot[e["name"]] += float(e["dur"])
        cnt[e["name"]] += 1
    busy = sum(tot.values()) / calls
    rows = [
        dict(kernel=n, us_per_call=t / calls, launches_per_call=cnt[n] / calls)
        for n, t in sorted(tot.items(), key=lambda kv: -kv[1])
    ]
    return rows, busy


def trace_events(call, calls: int, *, warmup: int = 3) -> tuple[float, list[dict]]:
    """``calls`` synchronised calls of ``call()`` under ``jax.profiler.trace`` (after
    ``warmup``): (wall µs per call, the trace's :func:`device_events`)."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(call())
        wall = (time.perf_counter() - t0) / calls * 1e6
        return wall, device_events(Path(d))


def trace_calls(call, calls: int, *, warmup: int = 3) -> tuple[float, list[dict], float]:
    """:func:`trace_events`, summed: (wall µs per call, :func:`breakdown` rows, device-busy µs
    per call)."""
    wall, events = trace_events(call, calls, warmup=warmup)
    rows, busy = breakdown(events, calls)
    return wall, rows, busy


# ---------------------------------------------------------------------------------------------
# Kernels attributed to source through the compiled HLO's stack frames.
# ---------------------------------------------------------------------------------------------

_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
#: Kernels named by a library rather than by their HLO op (cuBLAS, CUTLASS, Pallas GEMVs).
_MATMUL_KERNEL = re.compile(r"gemv|gemm|xmma|cutlass|mosaic|cublas", re.IGNORECASE)
#: Device-to-device copies XLA inserts (no HLO op in the trace).
_COPY_KERNEL = re.compile(r"memcpy", re.IGNORECASE)
#: The Pallas attention kernels (named by their ``pallas_call``).
_ATTENTION_KERNEL = re.compile(r"attention", re.IGNORECASE)


def hlo_sources(text: str) -> dict[str, list[tuple[str, str, int]]]:
    """For each instruction of a compiled HLO module (``compiled.as_text()``), the Python stack
    that made it, innermost first: ``[(file, function, line), ...]``. A fusion without a frame
    of its own takes its fused computation's root's. Names are as in the HLO and also with '.'
    and '-' as '_' (the GPU kernels' names)."""
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    table = None
    own: dict[str, int] = {}
    calls: dict[str, str] = {}
    roots: dict[str, int] = {}
    comp = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
            continue
        if table is not None:
            m = _TABLE_ROW.match(line)
            if m:
                tables[table][int(m.group(1))] = m.group(2)
                continue
            table = None
        m = _COMP.match(line)
        if m and " = " not in line:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(2)
        f = _FRAME_ID.search(line)
        if f:
            own[name] = int(f.group(1))
            if m.group(1) and comp:
                roots[comp] = int(f.group(1))
        c = _CALLS.search(line)
        if c:
            calls[name] = c.group(1)

    def unquote(s: str) -> str:
        return s.strip().strip('"')

    files = {i: unquote(s) for i, s in tables["FileNames"].items()}
    funcs = {i: unquote(s) for i, s in tables["FunctionNames"].items()}
    locs = {i: dict(_FIELD.findall(s)) for i, s in tables["FileLocations"].items()}
    frames = {i: dict(_FIELD.findall(s)) for i, s in tables["StackFrames"].items()}

    def stack(fid: int) -> list[tuple[str, str, int]]:
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc = locs.get(int(frames[fid].get("file_location_id", 0)), {})
            out.append(
                (
                    files.get(int(loc.get("file_name_id", 0)), "?"),
                    funcs.get(int(loc.get("function_name_id", 0)), "?"),
                    int(loc.get("line", 0)),
                )
            )
            # The printed parent id is one more than the parent's row (0: none).
            fid = int(frames[fid].get("parent_frame_id", 0)) - 1
        return out

    result = {}
    for name in set(own) | set(calls):
        fid = own.get(name, roots.get(calls.get(name, ""), -1))
        if fid in frames:
            result[name] = stack(fid)
    for name in list(result):
        result.setdefault(name.replace(".", "_").replace("-", "_"), result[name])
    return result


def unmapped_category(kernel: str) -> str:
    """The category of a kernel the trace ties to no HLO op, from its name."""
    if _COPY_KERNEL.search(kernel):
        return "copies (no HLO op)"
    if _MATMUL_KERNEL.search(kernel):
        return "matmuls (no HLO op)"
    if _ATTENTION_KERNEL.search(kernel):
        return "attention (no HLO op)"
    return "unattributed"


def kernel_ops(events: list[dict], sources: dict) -> dict[str, str]:
    """Each kernel name's HLO op: the event's ``hlo_op`` annotation where it names an op of the
    program (inside a command buffer it names the buffer, ``command_buffer_N``), else the
    kernel's own name (a fusion's kernel is named after it)."""
    op_of = {}
    for e in events:
        op = (e.get("args") or {}).get("hlo_op")
        op_of.setdefault(e["name"], op if op in sources else e["name"])
    return op_of


def attributed_profile(call, hlo_text: str, categorize, *, calls: int, top: int) -> dict:
    """``calls`` synchronised calls of ``call()`` (one compiled program, whose optimised HLO is
    ``hlo_text``) under the profiler, each kernel attributed to the source that made it:
    ``categorize(stack) -> (category, frame or None)`` names its part. Returns the wall and busy
    µs per call, µs and launches per call by category and by source line, and the ``top``
    kernels (each with its category and source)."""
    sources = hlo_sources(hlo_text)
    wall, events = trace_events(call, calls, warmup=1)
    if not harness.on_gpu():
        # The CPU trace holds the host's Python too, and a loop's thunk spans its body's: the
        # thunks of HLO ops other than loops only.
        events = [
            e
            for e in events
            if (e.get("args") or {}).get("hlo_op", "while").partition(".")[0] != "while"
        ]
    rows, busy = breakdown(events, calls)
    op_of = kernel_ops(events, sources)
    cats: dict[str, float] = collections.defaultdict(float)
    launches: dict[str, float] = collections.defaultdict(float)
    lines: dict[str, float] = collections.defaultdict(float)
    mapped = 0.0
    for r in rows:
        op = op_of.get(r["kernel"], r["kernel"])
        stack = sources.get(op) or sources.get(op.replace(".", "_").replace("-", "_"))
        if stack:
            r["category"], frame = categorize(stack)
        else:
            r["category"] = unmapped_category(r["kernel"])
        cats[r["category"]] += r["us_per_call"]
        launches[r["category"]] += r["launches_per_call"]
        if stack:
            mapped += r["us_per_call"]
            file, fn, line = frame or stack[0]
            r["source"] = f"{os.path.basename(file)}:{line} {fn}"
            lines[r["source"]] += r["us_per_call"]
    return dict(
        wall_us=wall,
        busy_us=busy,
        gaps_us=max(0.0, wall - busy),
        attributed_us=mapped,
        categories=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        launches=dict(sorted(launches.items(), key=lambda kv: -kv[1])),
        lines=dict(sorted(lines.items(), key=lambda kv: -kv[1])[:20]),
        kernels=rows[:top],
        calls=calls,
    )


#: The parts of a propose, in the order they are checked: a kernel belongs to the first part
#: that some frame of its stack names, by function (``fns``) or file (``files``: base names).
STEP_PARTS = (
    ("embedding", dict(fns={"embed", "embed_pairs"})),
    ("LM head + argmax", dict(files={"_lm_head.py"})),
    ("split-K sums", dict(fns={"sum_in_order"})),
    ("linear's XLA ops (casts, row chunks)", dict(fns={"linear", "gemv", "_gemv"})),
    ("attention", dict(fns={"paged_attention"})),
    ("q/k norm + RoPE", dict(fns={"_norm_rope", "apply_rope", "rope_cos_sin"})),
    ("page allocation", dict(fns={"reserve", "allocate", "block_ids", "release"})),
    ("KV write", dict(fns={"write_rows", "append", "quantize_rows_fp8"})),
    ("norms", dict(fns={"rms_norm", "_row_norm", "row_norm_reference"})),
    (
        "layer glue (concat, residuals, gate, silu*up)",
        dict(
            fns={
                "fuse_inputs",
                "decode_row",
                "_attend_row",
                "output_projection",
                "ffn_residual",
                "apply_ffn",
                "dense_ffn",
            }
        ),
    ),
    (
        "pair window and records",
        dict(
            fns={
                "write_window",
                "_open_window",
                "_record",
                "put_rows",
                "_shift_left",
                "last_key",
                "newest_key",
                "drop_newest",
                "truncate",
            }
        ),
    ),
    ("draft selection", dict(fns={"_select", "at_last", "unpack_bitmask"}, files={"_sampling.py"})),
    ("outputs and counters", dict(fns={"_finish"}, files={"metrics.py", "donation.py"})),
)


def categorize_step(stack: list[tuple[str, str, int]]) -> tuple[str, tuple[str, str, int] | None]:
    """The part of a propose (:data:`STEP_PARTS`) a kernel belongs to, from its stack (innermost
    first), and the frame that says so; ``("other", None)`` when no part matches."""
    names = [(os.path.basename(f), q.rpartition(".")[2], (f, q, line)) for f, q, line in stack]
    for part, match in STEP_PARTS:
        for base, fn, frame in names:
            if fn in match.get("fns", ()) or base in match.get("files", ()):
                return part, frame
    return "other", None


def build(head: str, prec: str, k: int, b: int, context: int, smoke: bool = False):
    """The jitted propose and verify and their arguments, as ``benchmarks.propose`` builds them."""
    cfg = bp.head_config(head, smoke=smoke)
    head_cfg = cfg.lm_head_config()
    dprec, hprec = bp.PRECISIONS[prec]
    key = jax.random.key(0)
    params = drafter.init(cfg, key=jax.random.fold_in(key, 1), precision=dprec)
    lm = init_lm_head(head_cfg, key=jax.random.fold_in(key, 2), precision=hprec)
    pool_cfg = drafter.pool_config(cfg, precision=dprec, max_seq_len=context + k + 1, max_seqs=b)
    state = bp.filled_state(key, pool_cfg=pool_cfg, num_seqs=b, context=context)
    pairs = bp.make_pairs(key, cfg, k=k, batch=b, context=context)
    hidden = bp.normal_f32(key, (b, k + 1, cfg.hidden_size))
    propose = bp.propose_fn(cfg, k, "auto")
    verify = bp.verify_fn(head_cfg, "auto")
    return propose, verify, params, lm, state, pairs, hidden


def profile_point(point, *, context: int, calls: int, top: int, smoke: bool = False) -> dict:
    """Profiles ``calls`` proposes (``what="propose"``), each kernel attributed to its part of
    the step (:data:`STEP_PARTS`), or propose + verify rounds ("round", by kernel only)."""
    head, prec, k, b, what = point
    propose, verify, params, lm, state, pairs, hidden = build(head, prec, k, b, context, smoke)
    name = f"{head}/{prec}/K={k}/B={b}/{what}"
    holder = [state]
    if what == "propose":
        compiled = propose.lower(params, lm, state, pairs).compile()

        def call():
            # A propose alone keeps its K - 1 chain rows; the next propose drops them itself.
            out, holder[0] = compiled(params, lm, holder[0], pairs)
            return out, holder[0]

        rec = attributed_profile(call, compiled.as_text(), categorize_step, calls=calls, top=60)
    else:

        def call():
            out, holder[0] = propose(params, lm, holder[0], pairs)
            out, holder[0] = verify(lm, holder[0], hidden, out)
            return out, holder[0]

        wall, rows, busy = trace_calls(call, calls)
        rec = dict(wall_us=wall, busy_us=busy, kernels=rows[:60])
    busy = rec["busy_us"]
    print(f"\n{name}: {rec['wall_us']:.0f} µs per call under the profiler, GPU busy {busy:.0f} µs")
    if "categories" in rec:
        print(f"{'µs/call':>9} {'share':>6} {'n/call':>6}  part")
        for part, us in rec["categories"].items():
            share = us / busy if busy else 0.0
            print(f"{us:9.1f} {share:6.1%} {rec['launches'][part]:6.1f}  {part}")
    print(f"{'µs/call':>9} {'share':>6} {'n/call':>6}  kernel")
    for r in rec["kernels"][:top]:
        share = r["us_per_call"] / busy if busy else 0.0
        where = f"  [{r['category']}: {r.get('source', '-')}]" if "category" in r else ""
        print(
            f"{r['us_per_call']:9.1f} {share:6.1%} {r['launches_per_call']:6.1f}  "
            f"{r['kernel'][:60]}{where}"
        )
    return dict(point=name, **rec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", required=True, help="comma list of head/precision/K/B[/round]")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
    a = ap.parse_args(argv)
    points = [parse_point(p) for p in a.points.split(",") if p]
    results = []
    for p in points:
        try:
            results.append(
                profile_point(p, context=a.context, calls=a.calls, top=a.top, smoke=a.smoke)
            )
        except Exception as e:  # one failing point must not lose the others
            print(f"{p}: failed: {type(e).__name__}: {str(e)[:600]}")
            results.append(dict(point="/".join(map(str, p)), error=str(e)[:2000]))
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
