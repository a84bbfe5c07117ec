"""Where the time of one jitted propose (or verify) goes: a GPU kernel breakdown from a profile.

    python -m benchmarks.profile --json $OUT/profile.json \
        --points dense/bf16-nvfp4head/3/1,dense/nvfp4/3/64

Each point is ``head/precision/K/B`` with the heads and precisions of ``benchmarks.propose``,
whose builders (random weights at real shapes, a KV pool filled to ``--context`` rows) this
module reuses. For each point it runs the jitted step under ``jax.profiler.trace`` with a
Perfetto trace, then sums the device-side events by kernel name and divides by the number of
profiled calls. The table shows, per kernel, its microseconds per call and its share of the
GPU busy time; "gaps" is the wall time per call minus the busy time (launch latency, host work).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import tempfile
import time
from pathlib import Path

import jax

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
    """Profiles ``calls`` proposes (``what="propose"``) or propose + verify rounds ("round")."""
    head, prec, k, b, what = point
    propose, verify, params, lm, state, pairs, hidden = build(head, prec, k, b, context, smoke)
    holder = [state]

    def call():
        # A propose alone keeps its K - 1 chain rows; the next propose drops them itself.
        out, holder[0] = propose(params, lm, holder[0], pairs)
        if what == "round":
            out, holder[0] = verify(lm, holder[0], hidden, out)
        return out, holder[0]

    wall, rows, busy = trace_calls(call, calls)
    name = f"{head}/{prec}/K={k}/B={b}/{what}"
    print(f"\n{name}: {wall:.0f} µs per call under the profiler, GPU busy {busy:.0f} µs")
    print(f"{'µs/call':>9} {'share':>6} {'n/call':>6}  kernel")
    for r in rows[:top]:
        share = r["us_per_call"] / busy if busy else 0.0
        print(
            f"{r['us_per_call']:9.1f} {share:6.1%} {r['launches_per_call']:6.1f}  {r['kernel'][:110]}"
        )
    return dict(point=name, wall_us=wall, busy_us=busy, kernels=rows[:60])


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
