"""The benchmarks' one harness: timers, the copy-bandwidth baseline, child processes, records.

* :func:`time_queued` / :func:`time_steady`: the device's own time per call. Calls are queued
  back to back and synchronised once, ``(8 calls - 2 calls) / 6``, median of 3, so the host's
  per-call dispatch and sync (tens to hundreds of µs) drop out. :func:`time_synced` is the other
  view: each call synchronised, as a caller that waits for every result sees it.
* :func:`copy_bandwidth`: a device-to-device pass over 1 GiB (read, plus as much written), the
  roofline every benchmark divides by, measured in the same process as what it bounds.
* :func:`run_sections`: each section in a child process with a deadline, so one failing lowering
  or a hung compile cannot take the other sections down. The child writes JSON lines through
  :class:`Child`; the parent collects them.
* :func:`write_records`: one JSON file, ``{"run": {device, jax, command, ...}, "records": [...]}``,
  rewritten atomically so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: The H200's L2 (bytes): a timed call rotates through more distinct weights than twice this, so
#: no launch reads a cached weight.
L2_BYTES = 60 * 2**20
COPY_BYTES = 2**30
#: :func:`time_queued`'s calls and reps for --smoke runs.
SMOKE_CALLS = dict(calls=(0, 2), reps=1)


def on_gpu() -> bool:
    import jax

    return jax.default_backend() in ("gpu", "cuda", "rocm")


# ---------------------------------------------------------------------------------------------
# Timers.
# ---------------------------------------------------------------------------------------------


def stats(times_us: list[float]) -> dict:
    """Median, p10 and p90 of microsecond samples."""
    a = np.asarray(times_us)
    return dict(
        time_us=float(np.median(a)),
        p10_us=float(np.percentile(a, 10)),
        p90_us=float(np.percentile(a, 90)),
        n=len(a),
    )


def time_synced(call: Callable[[], object], *, iters: int, warmup: int) -> dict:
    """:func:`stats` of ``iters`` calls of ``call()``, each synchronised, after ``warmup``."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(call())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append((time.perf_counter() - t0) * 1e6)
    return stats(ts)


def time_queued(call: Callable[[], object], *, calls: tuple[int, int] = (2, 8), reps: int = 3):
    """µs per call of ``call()`` queued back to back: ``(t(hi calls) - t(lo calls)) / (hi - lo)``,
    median of ``reps``; ``call`` returns what to wait on (its last output is synchronised).
    ``lo = 0`` gives the plain mean of ``hi`` queued calls, the host's overhead included, which is
    never negative (:data:`SMOKE_CALLS`: smoke runs check the plumbing, not the time)."""
    import jax

    def run(n):
        if n == 0:
            return 0.0
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    lo, hi = calls
    return float(np.median([(run(hi) - run(lo)) / (hi - lo) for _ in range(reps)])) * 1e6


def time_steady(fn, arg_sets: list[tuple], n_launch: int, *, smoke: bool = False):
    """µs per launch of ``fn``: one jitted call runs ``n_launch`` launches cycling through
    ``arg_sets``. Returns ``(steady, synced, first output)``: steady is :func:`time_queued`,
    synced the median of 5 calls synchronised one by one (it includes the per-call overhead)."""
    import jax

    sets = [arg_sets[i % len(arg_sets)] for i in range(n_launch)]
    multi = jax.jit(lambda s: [fn(*a) for a in s])
    out = jax.block_until_ready(multi(sets))
    first = out[0]
    del out
    synced = time_synced(lambda: multi(sets), iters=1 if smoke else 5, warmup=0)["time_us"]
    steady = time_queued(lambda: multi(sets), **(SMOKE_CALLS if smoke else {}))
    return steady / n_launch, synced / n_launch, first


def measure(rec: dict, fn, sets: list[tuple], *, n_launch: int, nbytes=None, smoke=False) -> dict:
    """:func:`time_steady` of ``fn`` into ``rec``: ``time_us``, ``time_us_synced``, ``bytes`` and
    ``gbps`` (for ``nbytes`` per launch) and ``ok`` (the first output is finite: a sanity check;
    correctness is the tests'). Errors are recorded, not raised."""
    try:
        steady, synced, first = time_steady(fn, sets, n_launch, smoke=smoke)
        ok = all(bool(np.isfinite(np.asarray(a, np.float32)).all()) for a in _leaves(first))
        rec.update(time_us=steady, time_us_synced=synced, ok=ok)
        if nbytes:
            rec.update(bytes=nbytes, gbps=nbytes / steady / 1e3)
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
        print(rec["error"], file=sys.stderr)
    return rec


def _leaves(tree):
    import jax

    return [x for x in jax.tree.leaves(tree) if np.issubdtype(np.asarray(x).dtype, np.floating)]


def tree_bytes(tree) -> int:
    """Bytes of the array leaves of ``tree`` (arrays or ShapeDtypeStructs)."""
    import jax

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def copy_bandwidth(*, smoke: bool = False) -> dict:
    """Device-to-device bandwidth of ``x + 1`` over a 1 GiB uint32 buffer (a small one for
    ``smoke``), counting bytes read plus written: ``bytes``, ``gbps``, ``time_us`` per pass."""
    import jax
    import jax.numpy as jnp

    n = (2**16 if smoke else COPY_BYTES) // 4
    x = jax.random.bits(jax.random.key(123), (n,), jnp.uint32)  # random: never all zeros
    us, _, _ = time_steady(lambda a: a + jnp.uint32(1), [(x,)], 4, smoke=smoke)
    moved = 2 * 4 * n
    return dict(bytes=moved, gbps=moved / us / 1e3, time_us=us)


# ---------------------------------------------------------------------------------------------
# Child processes.
# ---------------------------------------------------------------------------------------------


class Child:
    """The child side of one section: its deadline, a key stream, and the JSON-lines output."""

    def __init__(self, *, smoke: bool, deadline: float, out: str, options: argparse.Namespace):
        import jax

        self.smoke, self.deadline, self.out, self.options = smoke, deadline, out, options
        self.key = jax.random.key(int(time.time()) & 0xFFFF)

    def left(self) -> float:
        return self.deadline - time.time()

    def next_key(self):
        import jax

        self.key, sub = jax.random.split(self.key)
        return sub

    def emit(self, rec: dict) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def add_child_args(ap: argparse.ArgumentParser) -> None:
    """The hidden arguments :func:`run_sections` passes to the child."""
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)


def child_main(args: argparse.Namespace, sections: dict[str, Callable[[Child], None]]) -> int:
    """Runs section ``args.child`` into ``args.out``: an ``_env`` record first, a
    ``_section_error`` record (with the traceback) if it raises."""
    import jax

    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    child = Child(smoke=args.smoke, deadline=args.deadline, out=args.out, options=args)
    dev = jax.devices()[0]
    child.emit(
        dict(
            kernel="_env",
            section=args.child,
            jax=jax.__version__,
            device=str(dev),
            device_kind=dev.device_kind,
            platform=dev.platform,
        )
    )
    try:
        sections[args.child](child)
    except Exception:
        child.emit(
            dict(kernel="_section_error", section=args.child, error=traceback.format_exc()[-3000:])
        )
    return 0


def run_sections(
    module: str,
    sections: list[str],
    *,
    budget_s: float,
    extra: list[str],
    workdir: str,
    weights: dict[str, float] | None = None,
    grace: float = 30.0,
) -> list[dict]:
    """``python -m module --child SECTION ...`` for each section, one after the other, from the
    repository root; each gets a share of what is left of ``budget_s`` (scaled by ``weights``)
    and is killed ``grace`` seconds past it. Returns every child's records, plus a
    ``_section_error`` record for a child that failed or was killed."""
    start = time.time()
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the parent holds no GPU memory
    records: list[dict] = []
    for i, sec in enumerate(sections):
        left = budget_s - (time.time() - start)
        share = left / (len(sections) - i) * (weights or {}).get(sec, 1.0)
        deadline = time.time() + max(5.0, min(left - 5, share))
        path = os.path.join(workdir, f"{sec}.jsonl")
        cmd = [sys.executable, "-m", module, "--child", sec, "--out", path]
        cmd += ["--deadline", str(deadline), *extra]
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=max(30.0, deadline - time.time() + grace),
            )
            rc, err = proc.returncode, proc.stderr or ""
        except subprocess.TimeoutExpired as e:
            rc, err = -9, f"timeout: {str(e.stderr or '')[-2000:]}"
        if os.path.exists(path):
            with open(path) as f:
                records += [json.loads(line) for line in f if line.strip()]
        if rc != 0:
            records.append(dict(kernel="_section_error", section=sec, error=err[-2000:]))
        print(f"{sec}: rc={rc}, {len(records)} records, {time.time() - start:.0f} s", flush=True)
    return records


# ---------------------------------------------------------------------------------------------
# Records.
# ---------------------------------------------------------------------------------------------


def run_info(module: str, argv: list[str], env: dict | None = None, **extra) -> dict:
    """What a result file says about its run: the command, device and JAX version (from a child's
    ``_env`` record when given, else from this process)."""
    if env is None:
        import jax

        dev = jax.devices()[0]
        env = dict(
            jax=jax.__version__,
            device=str(dev),
            device_kind=dev.device_kind,
            device_count=jax.device_count(),
            backend=jax.default_backend(),
        )
    info = {k: v for k, v in env.items() if k not in ("kernel", "section")}
    command = " ".join(["python -m", module, *argv])
    return dict(command=command, python=platform.python_version(), **info, **extra)


def write_records(path: str | Path, records: list[dict], run: dict) -> None:
    """Writes ``{"run": run, "records": records}`` to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(dict(run=run, records=records), indent=1))
    os.replace(tmp, path)


def read_records(path: str | Path) -> list[dict]:
    """The records of a result file: this harness's ``{"run", "records"}``, or a bare list (the
    files written before it)."""
    data = json.loads(Path(path).read_text())
    return data if isinstance(data, list) else data["records"]
