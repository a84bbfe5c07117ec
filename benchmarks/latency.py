"""Where a synchronous call's time goes: dispatch, device work, device idle, the wait.

    python -m benchmarks.latency --json $OUT/latency.json --points dense/bf16-nvfp4head/1/1

A caller that runs ``propose`` and reads its drafts pays more than the device's work: the host
prepares the call, launches its kernels, and waits for the last one. This module measures those
parts for the propose and the verify of ``benchmarks.profile``'s points (random weights at real
shapes, a KV pool filled to ``--context`` rows), each compiled per command-buffer variant of
``benchmarks.generate.COMMAND_BUFFERS``:

* ``dispatch_us``: until the call returns its (not yet computed) outputs;
* ``sync_us``: until they are ready (the call and ``block_until_ready``);
* ``queued_us``: per call, queued back to back (the device's own time, the host's hidden);
* from a profile of synchronised calls, each marked by a host annotation: ``to_first_kernel_us``
  (the call's start to its first device event), ``busy_us`` (device events), ``idle_us`` (the
  device waiting between the first and the last event), ``after_last_kernel_us`` (the last
  event's end to the call's return), the number of device events, and the host events summed by
  name (which host work the call spends its time in);
* ``hlo``: the compiled program's copies and custom calls (``benchmarks.propose.scan_hlo``);
* ``public`` (the ``default`` variant only): dispatch and sync of ``mtpjax.drafter.propose`` and
  ``mtpjax.verify.verify`` as a caller calls them, their Python argument checks included;
* ``layers``: the dispatch split by layer: the donation wrapper's Python (splitting the state
  into donated bulk and kept bookkeeping, joining the result), the compiled program called
  alone, a program that takes the same argument leaves and does nothing (what passing them
  costs), and for the verify its LM head alone (one Pallas kernel and its argmax).

Floors from the same process: a one-op jit (the least a synchronous call costs) and a chain of
``FLOOR_KERNELS`` dependent small dots (what launching a program of that many tiny steps costs,
its work aside).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import generate as bg
from benchmarks import harness
from benchmarks import profile as bprof
from benchmarks import propose as bp
from mtpjax import drafter
from mtpjax.head import lm_head
from mtpjax.verify import verify

FLOOR_KERNELS = 64
ANNOTATION = "mtpjax_call"


def split_events(events: list[dict]) -> tuple[list[dict], list[dict], dict]:
    """The trace's complete events split into (device, host), and the host threads' names."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    gpu = {pid for pid, n in procs.items() if "GPU" in n or "gpu" in n}
    done = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in done if e["pid"] in gpu]
    host = [e for e in done if e["pid"] not in gpu]
    return device, host, threads


def call_timeline(device: list[dict], host: list[dict], threads: dict, *, top: int = 80) -> dict:
    """Per annotated call (the host span named :data:`ANNOTATION`): medians of the timeline's
    parts, the host events inside the calls summed by (thread, name) and the device events by
    name, per call."""
    calls = sorted((e for e in host if e["name"] == ANNOTATION), key=lambda e: e["ts"])
    if not calls:
        raise ValueError(f"the trace has no {ANNOTATION!r} host spans")
    device = sorted(device, key=lambda e: e["ts"])
    parts = collections.defaultdict(list)
    kernels = collections.defaultdict(float)
    launches = collections.Counter()
    for c in calls:
        t0, t1 = float(c["ts"]), float(c["ts"]) + float(c["dur"])
        mine = [e for e in device if t0 <= float(e["ts"]) <= t1]
        for e in mine:
            kernels[e["name"]] += float(e["dur"])
            launches[e["name"]] += 1
        parts["wall_us"].append(t1 - t0)
        parts["device_events"].append(len(mine))
        if not mine:
            continue
        first, last = float(mine[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in mine)
        busy = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in mine])
        parts["to_first_kernel_us"].append(first - t0)
        parts["busy_us"].append(busy)
        parts["idle_us"].append(last - first - busy)
        parts["after_last_kernel_us"].append(t1 - last)
    out = {k: statistics.median(v) for k, v in parts.items()}
    sums = collections.defaultdict(float)
    counts = collections.Counter()
    for e in host:
        if e["name"] == ANNOTATION:
            continue
        ts = float(e["ts"])
        if any(float(c["ts"]) <= ts <= float(c["ts"]) + float(c["dur"]) for c in calls):
            key = (threads.get((e["pid"], e.get("tid")), str(e.get("tid"))), e["name"])
            sums[key] += float(e["dur"])
            counts[key] += 1
    n = len(calls)
    rows = sorted(sums.items(), key=lambda kv: -kv[1])[:top]
    out["host_events"] = [
        dict(thread=t, name=name[:160], us_per_call=v / n, count_per_call=counts[(t, name)] / n)
        for (t, name), v in rows
    ]
    out["device_kernels"] = [
        dict(kernel=name[:160], us_per_call=v / n, launches_per_call=launches[name] / n)
        for name, v in sorted(kernels.items(), key=lambda kv: -kv[1])
    ]
    out["calls"] = n
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``spans`` (device streams may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profiled(call, calls: int, *, before=None) -> dict:
    """:func:`call_timeline` of ``calls`` synchronised calls ``call(*before())``, each call (not
    ``before``, which prepares its arguments untimed) annotated."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                args = before() if before else ()
                with jax.profiler.TraceAnnotation(ANNOTATION):
                    jax.block_until_ready(call(*args))
        return call_timeline(*split_events(bprof.load_trace(Path(d))))


def split_times(call, iters: int, *, before=None) -> dict:
    """Medians of dispatch (``call(*before())`` returns) and sync (its outputs ready) over
    ``iters`` calls; ``before`` prepares each call's arguments, untimed."""
    disp, sync = [], []
    for _ in range(iters):
        args = before() if before else ()
        t0 = time.perf_counter()
        out = call(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        disp.append((t1 - t0) * 1e6)
        sync.append((t2 - t0) * 1e6)
    return dict(dispatch_us=statistics.median(disp), sync_us=statistics.median(sync))


def compiled_alone(compiled, make_args, keep, iters: int) -> dict:
    """Medians over ``iters`` calls of a donation-split compiled step (``mtpjax.kv.donation``):
    ``dispatch_us`` and ``sync_us`` of its program alone, and ``python_us``, the wrapper's split
    of the arguments and join of the result around it. ``make_args()`` gives each call's
    arguments (untimed) and ``keep`` takes its result (the state the next call starts from)."""
    disp, sync, py = [], [], []
    for _ in range(iters):
        args = make_args()
        t0 = time.perf_counter()
        split = compiled._split_args(args)
        t1 = time.perf_counter()
        out = compiled._compiled(split.books, *split.args)
        t2 = time.perf_counter()
        jax.block_until_ready(out)
        t3 = time.perf_counter()
        result = split.result(out)
        t4 = time.perf_counter()
        keep(result)
        disp.append((t2 - t1) * 1e6)
        sync.append((t3 - t1) * 1e6)
        py.append((t1 - t0 + t4 - t3) * 1e6)
    return dict(
        dispatch_us=statistics.median(disp),
        sync_us=statistics.median(sync),
        python_us=statistics.median(py),
    )


def warmed_times(call, iters: int) -> dict:
    """:func:`split_times` of ``call`` after three untimed calls (its compile among them)."""
    for _ in range(3):
        jax.block_until_ready(call())
    return split_times(call, iters)


def arguments_alone(args: tuple, iters: int) -> dict:
    """Dispatch and sync of a program that takes ``args``' leaves (kept, not pruned) and returns
    a constant: what handing that many buffers to a call costs, with no work to launch."""
    noop = jax.jit(lambda *a: jnp.zeros((), jnp.int32), keep_unused=True)
    out = warmed_times(lambda: noop(*args), iters)
    out["leaves"] = len(jax.tree.leaves(args))
    return out


def head_alone(lm, hidden, head_cfg, iters: int) -> dict:
    """Dispatch and sync of the verify's LM head and argmax over its rows, jitted alone."""
    fn = jax.jit(lambda h, x: jnp.argmax(lm_head(h, x, cfg=head_cfg), axis=-1))
    return warmed_times(lambda: fn(lm, hidden), iters)


def floors(iters: int) -> dict:
    """A one-op jit and a chain of :data:`FLOOR_KERNELS` dependent small dots, synchronised."""
    x = jnp.ones((8, 128), jnp.float32)
    w = jnp.ones((128, 128), jnp.float32) / 128

    @jax.jit
    def one(x):
        return x + 1

    @jax.jit
    def chain(x, w):
        for _ in range(FLOOR_KERNELS):
            x = jnp.tanh(x @ w)  # each dot waits for the one before: no two run at once
        return x

    out = {}
    for name, call in (("one_op", lambda: one(x)), ("chain", lambda: chain(x, w))):
        for _ in range(5):
            jax.block_until_ready(call())
        out[name] = split_times(call, iters)
        out[name]["queued_us"] = harness.time_queued(call)
    return out


def measure_point(
    point, variant: str, *, context: int, iters: int, calls: int, smoke: bool = False
) -> dict:
    """Propose and verify of one point, compiled with the variant's options."""
    head, prec, k, b, _ = point
    built = bprof.build(head, prec, k, b, context, smoke)
    propose, verify, params, lm, state, pairs, hidden = built
    gpu = harness.on_gpu()
    opts = bg.compiler_options(variant, gpu=gpu, profiling=False)
    popts = bg.compiler_options(variant, gpu=gpu, profiling=True)

    def comp(fn, args, options):
        lowered = fn.lower(*args)
        return lowered.compile(compiler_options=options) if options else lowered.compile()

    # One round first: the verify trims the propose's rows, so the context stays the same.
    drafted, state = propose(params, lm, state, pairs)
    _, state = verify(lm, state, hidden, drafted)
    args_p = (params, lm, state, pairs)
    comp_p, prof_p = comp(propose, args_p, opts), comp(propose, args_p, popts)
    holder = [state]

    def run_propose(c):
        def run():
            o, holder[0] = c(params, lm, holder[0], pairs)
            return o, holder[0]

        return run

    res = dict(point=f"{head}/{prec}/K={k}/B={b}", variant=variant, compiler_options=opts)
    run = run_propose(comp_p)
    for _ in range(3):
        jax.block_until_ready(run())
    res["propose"] = split_times(run, iters)
    res["propose"]["queued_us"] = harness.time_queued(run)
    res["propose"]["profile"] = profiled(run_propose(prof_p), calls)
    res["propose"]["hlo"] = bp.scan_hlo(comp_p.as_text())
    res["propose"]["layers"] = dict(
        program=compiled_alone(
            comp_p,
            lambda: (params, lm, holder[0], pairs),
            lambda r: holder.__setitem__(0, r[-1]),
            iters,
        ),
        arguments=arguments_alone((params, lm, holder[0], pairs), iters),
    )

    # The verify, each after an untimed propose (which it trims back to the context).
    drafted, s = comp_p(params, lm, holder[0], pairs)
    comp_v = comp(verify, (lm, s, hidden, drafted), opts)
    prof_v = comp(verify, (lm, s, hidden, drafted), popts)
    holder[0] = s

    def proposed():
        o, st = comp_p(params, lm, holder[0], pairs)
        return jax.block_until_ready((o, st))

    def run_verify(c):
        def run(o, st):
            vo, holder[0] = c(lm, st, hidden, o)
            return vo, holder[0]

        return run

    # Each round's propose redraws from the state the previous verify left.
    jax.block_until_ready(run_verify(comp_v)(drafted, s))
    res["verify"] = split_times(run_verify(comp_v), iters, before=proposed)
    res["verify"]["profile"] = profiled(run_verify(prof_v), calls, before=proposed)
    res["verify"]["hlo"] = bp.scan_hlo(comp_v.as_text())

    def verify_args():
        o, st = proposed()
        return lm, st, hidden, o

    head_cfg = bp.head_config(head, smoke=smoke).lm_head_config()
    res["verify"]["layers"] = dict(
        program=compiled_alone(comp_v, verify_args, lambda r: holder.__setitem__(0, r[-1]), iters),
        arguments=arguments_alone(proposed_args := verify_args(), iters),
        head=head_alone(lm, hidden, head_cfg, iters),
    )
    holder[0] = proposed_args[1]  # not donated by the no-op: the next propose starts from it
    if variant == "default":
        res["propose"]["public"], res["verify"]["public"] = public_entry_points(
            point, built, holder, proposed, iters, smoke=smoke
        )
    return res


def public_entry_points(point, built, holder, proposed, iters: int, *, smoke: bool):
    """Dispatch and sync of ``mtpjax.drafter.propose`` and ``mtpjax.verify.verify`` called as a
    caller calls them (their argument checks in Python, then the library's own jitted steps with
    XLA's default options), against the same state."""
    head, _, k, _, _ = point
    _, _, params, lm, _, pairs, hidden = built
    cfg = bp.head_config(head, smoke=smoke)

    def run_propose():
        o, holder[0] = drafter.propose(
            params, lm, holder[0], pairs, cfg=cfg, num_drafts=k, implementation="auto"
        )
        return o, holder[0]

    def run_verify(o, st):
        vo, holder[0] = verify(
            lm, st, hidden, o, cfg=cfg.lm_head_config(), refeed=True, implementation="auto"
        )
        return vo, holder[0]

    for _ in range(3):
        jax.block_until_ready(run_propose())
        jax.block_until_ready(run_verify(*proposed()))
    return split_times(run_propose, iters), split_times(run_verify, iters, before=proposed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="dense/bf16-nvfp4head/1/1,dense/bf16-nvfp4head/3/1")
    ap.add_argument("--variants", default="default,off,loops")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
    a = ap.parse_args(argv)
    points = [bprof.parse_point(p) for p in a.points.split(",") if p]
    given = sys.argv[1:] if argv is None else list(argv)
    result = dict(run=harness.run_info("benchmarks.latency", given), records=[])
    result["floors"] = floors(a.iters)
    print(json.dumps(result["floors"]))
    for p in points:
        for v in a.variants.split(","):
            try:
                r = measure_point(
                    p, v, context=a.context, iters=a.iters, calls=a.calls, smoke=a.smoke
                )
            except Exception as e:  # one failing point must not lose the others
                r = dict(
                    point="/".join(map(str, p)), variant=v, error=f"{type(e).__name__}: {e}"[:2000]
                )
            result["records"].append(r)
            a.json.write_text(json.dumps(result, indent=1))
            _print(r)
    return 0


def _print(r: dict) -> None:
    if "error" in r:
        print(f"{r['point']} {r['variant']}: {r['error'][:300]}")
        return
    for step in ("propose", "verify"):
        s = r[step]
        p = s["profile"]
        print(
            f"{r['point']} {r['variant']:8} {step:7} dispatch {s['dispatch_us']:7.0f} sync "
            f"{s['sync_us']:7.0f} queued {s.get('queued_us', float('nan')):7.0f} | profiled: "
            f"wall {p['wall_us']:7.0f} first {p.get('to_first_kernel_us', 0):6.0f} busy "
            f"{p.get('busy_us', 0):6.0f} idle {p.get('idle_us', 0):6.0f} tail "
            f"{p.get('after_last_kernel_us', 0):6.0f} events {p['device_events']:.0f} | "
            f"program: {s['hlo']['copies']} copies, {s['hlo']['pallas_kernels']} Pallas kernels"
        )
        lay = s["layers"]
        parts = [
            f"wrapper python {lay['program']['python_us']:5.0f}",
            f"program alone dispatch {lay['program']['dispatch_us']:6.0f} sync "
            f"{lay['program']['sync_us']:6.0f}",
            f"{lay['arguments']['leaves']} argument leaves alone dispatch "
            f"{lay['arguments']['dispatch_us']:5.0f} sync {lay['arguments']['sync_us']:5.0f}",
        ]
        if "head" in lay:
            parts.append(
                f"head alone dispatch {lay['head']['dispatch_us']:5.0f} sync "
                f"{lay['head']['sync_us']:5.0f}"
            )
        if "public" in s:
            parts.append(
                f"public entry point dispatch {s['public']['dispatch_us']:5.0f} sync "
                f"{s['public']['sync_us']:5.0f}"
            )
        print("      layers: " + " | ".join(parts))
        for h in p["host_events"][:12]:
            print(
                f"      {h['us_per_call']:8.1f} us {h['count_per_call']:6.1f}x  [{h['thread'][:24]}] {h['name'][:90]}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
