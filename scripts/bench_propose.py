"""Propose and verify latency of the MTP drafter at real shapes, against its rooflines and baselines.

    PYTHONPATH=. python3 scripts/bench_propose.py --json $OUT/propose_h200.json

This writes the JSON records, a plot next to them (``--plot``, default: the JSON path with a
``.png`` suffix), and prints a table last. The default run is sized for one device call of
under 10 minutes on one H200 (about 8 expected, not yet measured); the ``--budget-s`` guard
skips the blocks that would start after the budget and says which ones. The JSON and the plot
are rewritten as the run goes, so a killed run leaves what it measured.

What is measured. All weights are random, at the real shapes:

- **dense**: a Qwen3.5-27B-like head. Hidden 5120; 24 query and 4 KV heads of 256 (gated
  ``q_proj`` 12288 wide); partial RoPE 0.25; dense FFN 17408; LM head ``[248320, 5120]``.
- **moe**: a Qwen3-Next-80B-like head. Hidden 2048; 16 query and 2 KV heads of 256; 512
  experts of width 512, top-10, plus a 512-wide gated shared expert; LM head ``[151936, 2048]``.

Three precisions:

- ``bf16-nvfp4head``: a BF16 drafter with an NVFP4 LM head;
- ``fp8``: everything FP8 per-row;
- ``nvfp4``: everything NVFP4. A dense head keeps fc/k/v in BF16 (DESIGN §3). The KV pool is
  FP8 at this precision and BF16 at the other two (DESIGN §6).

Drafts K are 1, 3, 5 and batches B are 1, 8, 64. The drafter KV holds ``--context`` rows (4096)
per sequence. They are written straight into the pool as random rows; no prefill is run. Each
propose gets the anchor pair at key ``context - 1`` in a window ``K + 1`` pairs wide, which is
the width a serving loop passes. So step 0 attends over ``context`` rows and step j over
``context + j``.

For every (head, precision, K, B) point the script records:

- **propose latency**: the median over ``--iters`` synchronous calls of the jitted ``propose``
  (AOT-compiled, state donated), after ``--warmup`` calls. Between calls, ``verify`` with
  ``refeed=True`` runs on the returned state (that is ``after_verify``), so each call again
  starts from ``context`` rows (checked at the end of every loop). The verify call is timed too.
- **bytes**: the least the step must move. Drafter weights are counted once per draft; for the
  MoE head that means the router, the shared expert and the expected number of distinct
  experts that B rows of top-10 routing touch, ``E (1 - (1 - k/E)^B)``. Add the LM head once
  per draft and the KV rows attended. Logits are not counted; they are reported apart.
- **roofline ratio**: measured time / (bytes / copy bandwidth). The copy bandwidth is measured
  in the same run: an elementwise pass over 2 GiB, counting bytes read plus written.
- **baselines from the same run**:
  - the same propose with ``implementation="xla"`` (at K = the middle of ``--ks``);
  - a PyTorch reference of the same drafter step (``scripts/torch_reference_drafter.py``),
    with weights dequantised to BF16, in eager mode and replayed as a CUDA graph
    (``--torch-compile`` adds ``torch.compile``). It is timed at the first precision of each
    head only: once dequantised, the weights are the same size at every precision.
- **token check**: the reference, run in F32 on the dequantised weights and the same KV rows,
  must produce the JAX drafts. The JAX side is the XLA path at ``highest`` matmul precision.
- **hidden costs**: the compiled HLO of each jitted propose is searched for host transfers
  (send/recv, infeed/outfeed, host callbacks, host memory space). The custom calls it contains
  are listed, which shows whether the Pallas kernels were used. Once per head and KV dtype,
  propose is also timed with a KV pool 10x larger at the same context (B=8, K=3), against the
  1x pool in the same loop: an in-place (donated) update costs the same. The compiler's memory
  analysis says the same thing without timing: the temporaries must not grow with the pool.
- **two GPUs** (when ``jax.device_count() >= 2``; first head, first precision): the
  vocab-parallel LM head (``mtpjax.head.sharded``) and a batch-sharded propose (one state per
  device under ``shard_map``), each timed against one GPU.

The default grid is a *star* around the middle point (K=3, B=8): every B at K=3, and K=1 and
K=5 at B=8. That is 5 points per (head, precision), 30 in all. The XLA baseline runs at K=3
(B = 1, 8, 64). ``--grid full`` runs every (K, B) pair instead, which takes longer than one
device call allows. Executables are compiled ahead of time, several at once
(``--compile-workers``), one block (head, precision) at a time. Compile time is most of the
run. Blocks run precision-major in the order of ``--precisions`` (default nvfp4,
bf16-nvfp4head, fp8), so a run cut by ``--budget-s`` loses the last precision, not a head.

``--smoke`` runs tiny shapes on the CPU in seconds. It checks the script, not the GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mtpjax import drafter  # noqa: E402
from mtpjax.config import Architecture, DrafterConfig, FfnKind, MoeConfig  # noqa: E402
from mtpjax.head import (  # noqa: E402
    init_lm_head,
    lm_head,
    shard_lm_head,
    sharded_lm_head,
    verify_copy_used,
)
from mtpjax.kv import (  # noqa: E402
    DrafterState,
    KVDtype,
    gather,
    reserve,
    row_address,
    write_rows,
)
from mtpjax.layers import DenseFfnParams, MoeFfnParams  # noqa: E402
from mtpjax.verify import verify  # noqa: E402

PRECISIONS = {  # name -> (drafter precision, LM head precision)
    "bf16-nvfp4head": ("bf16", "nvfp4"),
    "fp8": ("fp8", "fp8"),
    "nvfp4": ("nvfp4", "nvfp4"),
}
HEADS = ("dense", "moe")
# Run order: all-NVFP4 first, FP8 last, so a run cut by the time budget loses the least.
DEFAULT_PRECISIONS = ("nvfp4", "bf16-nvfp4head", "fp8")

GPU_DEFAULTS = dict(ks="1,3,5", batches="1,8,64", context=4096, iters=20, warmup=3)
SMOKE_DEFAULTS = dict(ks="2", batches="4", context=40, iters=3, warmup=1)

# Fast XLA:CPU compiles for --smoke (the smoke run checks the script, not the speed).
SMOKE_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}

COPY_BYTES = 2 * 2**30  # bytes read by the copy-bandwidth pass (as much again is written)


# ---------------------------------------------------------------------------------------------
# Configs, grid and the bytes model.
# ---------------------------------------------------------------------------------------------


def head_config(name: str, *, smoke: bool) -> DrafterConfig:
    """The drafter config of a head: real shapes, or tiny ones for --smoke."""
    if smoke:
        if name == "dense":
            return DrafterConfig.tiny(vocab_size=512)
        return DrafterConfig.tiny(ffn=FfnKind.MOE, vocab_size=512)
    common = dict(
        head_dim=256,
        partial_rotary_factor=0.25,
        rope_theta=10_000_000.0,
        max_position_embeddings=262_144,
    )
    if name == "dense":
        return DrafterConfig.tiny(
            architecture=Architecture.QWEN3_5,
            hidden_size=5120,
            vocab_size=248_320,
            num_attention_heads=24,
            num_key_value_heads=4,
            intermediate_size=17_408,
            **common,
        )
    return DrafterConfig.tiny(
        ffn=FfnKind.MOE,
        architecture=Architecture.QWEN3_NEXT,
        hidden_size=2048,
        vocab_size=151_936,
        num_attention_heads=16,
        num_key_value_heads=2,
        moe=MoeConfig(
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            shared_expert_gate=True,
        ),
        **common,
    )


def grid_points(ks: list[int], batches: list[int], grid: str) -> list[tuple[int, int]]:
    """(K, B) points. "full": every pair. "star": every B at the middle K, every K at the
    middle B."""
    kc, bc = center(ks), center(batches)
    pts = [(k, b) for k in ks for b in batches]
    if grid == "star":
        pts = [(k, b) for k, b in pts if k == kc or b == bc]
    return pts


def center(values: list[int]) -> int:
    return values[len(values) // 2]


def _leaf_bytes(tree) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def expected_distinct_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts hit by ``rows`` rows of top-k routing, uniform at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def drafter_bytes_per_draft(params, cfg: DrafterConfig, batch: int) -> dict:
    """Weight bytes one draft step reads for ``batch`` rows, by part."""
    attn = params.layer.attention
    parts = {
        "fc": params.fc.nbytes,
        "attention": sum(w.nbytes for w in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)),
        "norms": _leaf_bytes(
            (
                params.pre_fc_norm_embedding,
                params.pre_fc_norm_hidden,
                params.norm,
                params.layer.input_layernorm,
                params.layer.post_attention_layernorm,
                attn.q_norm,
                attn.k_norm,
            )
        ),
        "embedding_rows": batch * cfg.hidden_size * 2,  # BF16 table rows gathered
    }
    ffn = params.layer.ffn
    if isinstance(ffn, DenseFfnParams):
        parts["ffn"] = sum(w.nbytes for w in (ffn.gate_proj, ffn.up_proj, ffn.down_proj))
    elif isinstance(ffn, MoeFfnParams):
        e = ffn.num_experts
        per_expert = (
            sum(
                w.nbytes
                for w in (ffn.experts.gate_proj, ffn.experts.up_proj, ffn.experts.down_proj)
            )
            / e
        )
        touched = expected_distinct_experts(e, cfg.moe.num_experts_per_tok, batch)
        shared = 0
        if ffn.shared_expert is not None:
            se = ffn.shared_expert
            shared = sum(w.nbytes for w in (se.gate_proj, se.up_proj, se.down_proj))
        if ffn.shared_expert_gate is not None:
            shared += ffn.shared_expert_gate.nbytes
        parts["router"] = ffn.router.nbytes
        parts["shared_expert"] = shared
        parts["experts"] = round(touched * per_expert)
        parts["experts_touched"] = touched
    else:
        raise TypeError(type(ffn).__name__)
    parts["total"] = int(sum(v for k, v in parts.items() if k != "experts_touched"))
    return parts


def kv_row_bytes(cfg: DrafterConfig, kv_dtype: KVDtype) -> int:
    """Bytes of one K+V row of one sequence in the pool (FP8 rows carry F32 scales per head)."""
    elems = 2 * cfg.num_key_value_heads * cfg.head_dim
    if kv_dtype is KVDtype.BF16:
        return elems * 2
    return elems + 2 * cfg.num_key_value_heads * 4


def kv_attended_bytes(cfg, kv_dtype, *, k: int, batch: int, context: int) -> int:
    """KV bytes the K steps attend: step j reads ``context + j`` rows of each sequence."""
    rows = sum(context + j for j in range(k))
    return batch * rows * kv_row_bytes(cfg, kv_dtype)


# ---------------------------------------------------------------------------------------------
# Device helpers: copy bandwidth, the filled KV state, inputs, HLO scan, memory.
# ---------------------------------------------------------------------------------------------


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def _sync(tree):
    jax.block_until_ready(tree)
    return tree


def time_calls(fn, *args, iters: int, warmup: int) -> dict:
    """Median / p10 / p90 microseconds of synchronous calls ``fn(*args)`` after warm-up."""
    for _ in range(warmup):
        _sync(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _sync(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e6)
    return _stats(ts)


def _stats(ts: list[float]) -> dict:
    a = np.asarray(ts)
    return dict(
        time_us=float(np.median(a)),
        p10_us=float(np.percentile(a, 10)),
        p90_us=float(np.percentile(a, 90)),
        n=len(ts),
    )


def prng_impl(smoke: bool) -> str:
    """Threefry on the GPU; the RBG generator for --smoke, whose programs compile ~3x faster on
    the CPU (the values differ, nothing else does)."""
    return "rbg" if smoke else "threefry2x32"


def copy_bandwidth(*, smoke: bool, iters: int) -> dict:
    """Device-to-device bandwidth: ``x + 1`` over four buffers (2 GiB read, 2 GiB written)."""
    total = 4 * 2**16 if smoke else COPY_BYTES
    n = total // 4 // 4  # uint32 elements per buffer
    keys = jax.random.split(jax.random.key(123, impl=prng_impl(smoke)), 4)
    bufs = [jax.random.bits(k, (n,), jnp.uint32) for k in keys]  # random, never zeros
    f = jax.jit(lambda xs: [x + jnp.uint32(1) for x in xs])
    st = time_calls(f, bufs, iters=max(iters, 5), warmup=2)
    moved = 2 * 4 * n * 4
    return dict(kind="copy_bandwidth", bytes=moved, gbps=moved / st["time_us"] / 1e3, **st)


@functools.partial(jax.jit, static_argnames=("pool_cfg", "num_seqs", "context"))
def filled_state(key, first_seq=0, *, pool_cfg, num_seqs: int, context: int) -> DrafterState:
    """A drafter state whose sequences each hold ``context`` random rows (keys 0..context-1).

    Blocks are reserved through the allocator as appends would, then the rows are written as
    ``append`` writes them (FP8 pools quantise per row), so no prefill runs. Row r of sequence
    ``first_seq + b`` is N(0, 1) (the scale of normed, rotated keys) drawn from ``(key, that
    sequence)``: a batch split in halves (``first_seq`` = 0 and B/2) holds the same rows.
    """
    state = drafter.init_state(pool_cfg, num_seqs=num_seqs)
    cache, _ = reserve(state.kv, jnp.full((num_seqs,), context, jnp.int32))
    shape = (context, pool_cfg.num_kv_heads, pool_cfg.head_dim)

    def rows(seq):
        kk, kv_ = jax.random.split(jax.random.fold_in(key, seq))
        return jax.random.normal(kk, shape), jax.random.normal(kv_, shape)

    k, v = jax.vmap(rows)(first_seq + jnp.arange(num_seqs))  # f32[B, context, Nkv, D]
    positions = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (num_seqs, context))
    block, slot = row_address(cache, positions)
    pool = write_rows(
        cache.pool,
        block.reshape(-1),
        slot.reshape(-1),
        k.reshape(-1, *shape[1:]),
        v.reshape(-1, *shape[1:]),
    )
    cache = dataclasses.replace(cache, pool=pool, seq_len=jnp.full((num_seqs,), context, jnp.int32))
    return DrafterState(
        kv=cache,
        last_pair_key=jnp.full((num_seqs,), context - 1, jnp.int32),
        last_num_drafted=jnp.zeros((num_seqs,), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "k", "batch", "context"))
def make_pairs(key, cfg: DrafterConfig, *, k: int, batch: int, context: int) -> drafter.Pairs:
    """A verify-wide window (K+1 pairs) whose one valid pair is the anchor at ``context - 1``."""
    kt, kh = jax.random.split(key)
    T = k + 1
    return drafter.Pairs(
        tokens=jax.random.randint(kt, (batch, T), 0, cfg.vocab_size, jnp.int32),
        hidden=jax.random.normal(kh, (batch, T, cfg.hidden_size), jnp.bfloat16),
        count=jnp.ones((batch,), jnp.int32),
        start=jnp.full((batch,), context - 1, jnp.int32),
    )


@functools.partial(jax.jit, static_argnums=1)
def normal_f32(key, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32)


@functools.partial(jax.jit, static_argnums=1)
def held_rows(cache, length: int):
    """Each sequence's first ``length`` rows, dequantised: f32[B, length, Nkv, D] twice."""
    k, v, _ = gather(cache, length)
    return k, v


_HOST_OPS = re.compile(r"\s(send|recv|send-done|recv-done|infeed|outfeed)\(")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_HOST_TARGET = re.compile(r"callback|host|annotate_device_placement", re.IGNORECASE)


def scan_hlo(text: str) -> dict:
    """Host transfers in compiled HLO text, and the custom calls it makes."""
    host_ops = Counter(m.group(1) for m in _HOST_OPS.finditer(text))
    calls = Counter(_CUSTOM_CALL.findall(text))
    host_calls = {t: n for t, n in calls.items() if _HOST_TARGET.search(t)}
    host_memory = text.count("S(5)")
    return dict(
        host_transfer_free=not host_ops and not host_calls and host_memory == 0,
        host_ops=dict(host_ops),
        host_custom_calls=host_calls,
        host_memory_space_refs=host_memory,
        custom_calls=dict(calls),
        pallas_kernels=sum(n for t, n in calls.items() if "triton" in t or "mosaic" in t),
    )


def memory_analysis(compiled) -> dict | None:
    try:
        ma = compiled.memory_analysis()
    except Exception:
        return None
    if ma is None:
        return None
    return {
        f: int(getattr(ma, f))
        for f in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
        )
        if hasattr(ma, f)
    }


def device_memory() -> dict | None:
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return dict(limit=int(stats["bytes_limit"]), in_use=int(stats.get("bytes_in_use", 0)))


def fits_in_memory(compiled, state_bytes: int) -> tuple[bool, str]:
    """Whether a new state plus the executable's temporaries fit beside what is allocated."""
    mem, ma = device_memory(), memory_analysis(compiled)
    if mem is None or ma is None:
        return True, "no device memory statistics (CPU): not checked"
    extra = max(0, ma.get("output_size_in_bytes", 0) - ma.get("alias_size_in_bytes", 0))
    need = state_bytes + ma.get("temp_size_in_bytes", 0) + extra
    free = mem["limit"] - mem["in_use"]
    msg = f"needs {need / 1e9:.2f} GB (state, temporaries, outputs), {free / 1e9:.2f} GB free"
    return need < 0.95 * free, msg


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation, several executables at once.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """One executable to build: a jitted function, its (abstract) arguments, the matmul
    precision context it is lowered under."""

    key: tuple
    fn: object
    args: tuple
    highest: bool = False
    lowered: object = None
    compiled: object = None
    compile_s: float = 0.0
    error: str | None = None


def compile_jobs(jobs: list[Job], *, workers: int, options: dict | None, desc: str) -> None:
    """Lowers each job here, then compiles them in a thread pool (XLA releases the GIL)."""
    for job in jobs:
        ctx = jax.default_matmul_precision("highest") if job.highest else contextlib.nullcontext()
        try:
            with ctx:
                job.lowered = job.fn.lower(*job.args)
        except Exception as e:
            job.error = f"lowering: {type(e).__name__}: {str(e)[:800]}"

    def build(job: Job) -> Job:
        if job.lowered is None:
            return job
        t0 = time.perf_counter()
        try:
            job.compiled = (
                job.lowered.compile(compiler_options=options)
                if options
                else (job.lowered.compile())
            )
        except Exception as e:
            job.error = f"compile: {type(e).__name__}: {str(e)[:800]}"
        job.compile_s = time.perf_counter() - t0
        return job

    todo = [j for j in jobs if j.lowered is not None]
    with tqdm(total=len(todo), desc=desc, leave=False) as bar:
        if workers <= 1:
            for j in todo:
                build(j)
                bar.update()
        else:
            with cf.ThreadPoolExecutor(max_workers=workers) as ex:
                for _ in cf.as_completed([ex.submit(build, j) for j in todo]):
                    bar.update()


# ---------------------------------------------------------------------------------------------
# The benchmark.
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.t0 = time.monotonic()
        self.records: list[dict] = []
        self.skipped: list[str] = []
        self.gpu = on_gpu()
        self.meta = dict(
            command="python3 scripts/bench_propose.py " + " ".join(args.argv),
            backend=jax.default_backend(),
            devices=[str(d) for d in jax.devices()],
            device_kind=jax.devices()[0].device_kind,
            device_count=jax.device_count(),
            jax=jax.__version__,
            python=platform.python_version(),
            smoke=args.smoke,
            heads=args.heads,
            precisions=args.precisions,
            ks=args.ks,
            batches=args.batches,
            grid=args.grid,
            points=grid_points(args.ks, args.batches, args.grid),
            xla_baseline_k=center(args.ks),
            context=args.context,
            iters=args.iters,
            warmup=args.warmup,
            compile_workers=args.compile_workers,
            budget_s=args.budget_s,
            registered_linear_kernels=[],
            registered_verify_kernels=[],
            notes=[],
        )
        self.key = jax.random.key(args.seed, impl=prng_impl(args.smoke))
        self.pool10x_done: set = set()
        self.torch = None
        self.torch_ref = None
        self.torch_error = None

    # -- bookkeeping ---------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over_budget(self) -> bool:
        return self.a.budget_s is not None and self.elapsed() > self.a.budget_s

    def emit(self, rec: dict) -> dict:
        self.records.append(rec)
        self.save()
        return rec

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        self.emit(dict(kind="skipped", what=what, reason=why))
        tqdm.write(f"skipped {what}: {why}")

    def save(self) -> None:
        self.meta["elapsed_s"] = self.elapsed()
        self.meta["skipped"] = self.skipped
        path = self.a.json
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(dict(run=self.meta, records=self.records), indent=1))
        os.replace(tmp, path)

    # -- set-up --------------------------------------------------------------------------------

    def setup(self) -> None:
        self.meta["kernel_registration"] = register_kernels()
        from mtpjax.head import registered_verify_kernels
        from mtpjax.weights import registered_kernels

        self.meta["registered_linear_kernels"] = sorted(
            f"{f.value}/{r.value}" for f, r in registered_kernels()
        )
        self.meta["registered_verify_kernels"] = sorted(
            f.value for f in registered_verify_kernels()
        )
        if self.gpu and not self.meta["registered_linear_kernels"]:
            self.meta["notes"].append(
                "no Pallas linear kernels are registered: 'auto' projections run the XLA path"
            )
        if not self.a.skip_torch:
            try:
                import torch

                self.torch = torch
                self.torch_ref = load_torch_reference()
                self.meta["torch"] = torch.__version__
            except Exception as e:  # torch is optional
                self.torch_error = f"{type(e).__name__}: {e}"
                self.meta["torch"] = None
                self.meta["notes"].append(f"PyTorch baseline not run: {self.torch_error}")
        bw = copy_bandwidth(smoke=self.a.smoke, iters=self.a.iters)
        self.bw_gbps = bw["gbps"]
        self.meta["copy_gbps"] = self.bw_gbps
        self.emit(bw)
        tqdm.write(f"copy bandwidth {self.bw_gbps:.0f} GB/s (read + write)")

    # -- one (head, precision) block -------------------------------------------------------------

    def run(self) -> None:
        self.setup()
        # Precision-major, so a run cut by the budget still covers every head.
        blocks = [(h, p) for p in self.a.precisions for h in self.a.heads]
        for head_name, prec in tqdm(blocks, desc="blocks"):
            if self.over_budget():
                self.skip(f"{head_name}/{prec}", f"over the {self.a.budget_s:.0f} s budget")
                continue
            first_of_head = prec == self.a.precisions[0]
            try:
                self.block(head_name, prec, first_of_head=first_of_head)
            except Exception as e:
                self.skip(f"{head_name}/{prec}", f"failed: {type(e).__name__}: {str(e)[:800]}")
            gc.collect()
            with contextlib.suppress(Exception):  # the plot is a convenience, never fatal
                plot(self.records, self.a.plot, k=center(self.a.ks), context=self.a.context)

    def block(self, head_name: str, prec: str, *, first_of_head: bool) -> None:
        a = self.a
        cfg = head_config(head_name, smoke=a.smoke)
        head_cfg = cfg.lm_head_config()
        dprec, hprec = PRECISIONS[prec]
        key = self.key
        t_init = time.perf_counter()
        params = drafter.init(cfg, key=jax.random.fold_in(key, 1), precision=dprec)
        head = init_lm_head(
            head_cfg,
            key=jax.random.fold_in(key, 2),
            precision=hprec,
            verify_copy=verify_copy_used(hprec),
        )
        _sync((params, head))
        init_s = time.perf_counter() - t_init
        kmax = max(a.ks)
        pool_cfgs = {
            (b, f): drafter.pool_config(
                cfg, precision=dprec, max_seq_len=a.context + kmax + 1, max_seqs=b * f
            )
            for b in a.batches
            for f in (1, 10)
        }
        kv_dtype = pool_cfgs[(a.batches[0], 1)].kv_dtype
        points = grid_points(a.ks, a.batches, a.grid)
        kc, bc = center(a.ks), center(a.batches)
        base = dict(
            head=head_name,
            precision=prec,
            drafter_precision=dprec,
            head_precision=hprec,
            kv_dtype=kv_dtype.value,
            context=a.context,
        )
        self.emit(
            dict(
                kind="memory_plan",
                **base,
                drafter_weight_bytes=_leaf_bytes(params),
                lm_head_bytes=head.weight.nbytes,
                verify_copy_bytes=_leaf_bytes(head.verify_weight),
                embedding_bytes=_leaf_bytes(head.embedding),
                kv_pool_bytes={
                    str(b): _leaf_bytes(
                        jax.eval_shape(
                            lambda c=pool_cfgs[(b, 1)], b=b: drafter.init_state(c, num_seqs=b)
                        ).kv.pool
                    )
                    for b in a.batches
                },
                kv_pool_10x_bytes_at_center_batch=_leaf_bytes(
                    jax.eval_shape(
                        lambda: drafter.init_state(pool_cfgs[(bc, 10)], num_seqs=bc)
                    ).kv.pool
                ),
                device_memory=device_memory(),
                init_s=init_s,
            )
        )

        # Executables: propose (auto; xla at the baseline K), verify, the 10x pool, the check.
        def eff(impl: str) -> str:
            return impl if self.gpu else "xla"  # off-GPU "auto" is the XLA path

        def state_abs(b: int, f: int = 1):
            return jax.eval_shape(
                functools.partial(
                    filled_state, pool_cfg=pool_cfgs[(b, f)], num_seqs=b, context=a.context
                ),
                key,
            )

        def pairs_abs(k: int, b: int):
            return jax.eval_shape(
                functools.partial(make_pairs, cfg=cfg, k=k, batch=b, context=a.context), key
            )

        jobs: dict[tuple, Job] = {}
        drafts_abs: dict[tuple, object] = {}

        def want(kind: str, impl: str, k: int, b: int, *, factor: int = 1, highest=False):
            jk = (kind, eff(impl), k, b, factor, highest and self.gpu)
            if jk in jobs:
                return jk
            if kind == "propose":
                fn = propose_fn(cfg, k, eff(impl))
                args = (params, head, state_abs(b, factor), pairs_abs(k, b))
            else:
                if (k, b) not in drafts_abs:  # the same outputs whatever the implementation
                    drafts_abs[(k, b)] = jax.eval_shape(
                        propose_fn(cfg, k, "xla"), params, head, state_abs(b), pairs_abs(k, b)
                    )[0]
                drafts = drafts_abs[(k, b)]
                th = jax.ShapeDtypeStruct((b, k + 1, cfg.hidden_size), jnp.float32)
                fn = verify_fn(head_cfg, eff(impl))
                args = (head, state_abs(b), th, drafts)
            jobs[jk] = Job(key=jk, fn=fn, args=args, highest=highest and self.gpu)
            return jk

        plan = {}
        for k, b in points:
            plan[(k, b)] = dict(
                propose=want("propose", "auto", k, b), verify=want("verify", "auto", k, b)
            )
            if k == kc:
                plan[(k, b)].update(
                    propose_xla=want("propose", "xla", k, b),
                    verify_xla=want("verify", "xla", k, b),
                )
        check_point = (kmax, bc)
        extra = {}
        if (head_name, kv_dtype) not in self.pool10x_done:  # once per head and KV dtype
            self.pool10x_done.add((head_name, kv_dtype))
            extra["pool10x"] = want("propose", "auto", kc, bc, factor=10)
        if first_of_head and self.torch_ref is not None:
            extra["check"] = want("propose", "xla", *check_point, highest=True)
        options = SMOKE_COMPILER_OPTIONS if a.smoke else None
        compile_jobs(
            list(jobs.values()),
            workers=a.compile_workers,
            options=options,
            desc=f"compile {head_name}/{prec} ({len(jobs)})",
        )
        for job in jobs.values():
            if job.error:
                self.meta["notes"].append(f"{head_name}/{prec} {job.key}: {job.error}")

        # Timing, point by point.
        for k, b in tqdm(points, desc=f"time {head_name}/{prec}", leave=False):
            self.point(cfg, head_cfg, params, head, pool_cfgs, base, jobs, plan[(k, b)], k, b)

        if "pool10x" in extra:
            self.pool10x(cfg, params, head, pool_cfgs, base, jobs, extra["pool10x"], kc, bc)
        if first_of_head and self.torch_ref is not None:
            if self.over_budget():
                self.skip(f"torch {head_name}", f"over the {a.budget_s:.0f} s budget")
            else:
                self.torch_section(
                    cfg, params, head, pool_cfgs, base, jobs, extra.get("check"), points, kv_dtype
                )
        if first_of_head and head_name == a.heads[0]:
            if jax.device_count() < 2:
                self.meta["notes"].append("two-GPU section not run: one device")
            elif a.skip_two_gpu:
                self.meta["notes"].append("two-GPU section not run: --skip-two-gpu")
            elif self.over_budget():
                self.skip("two-GPU section", f"over the {a.budget_s:.0f} s budget")
            else:
                self.two_gpu_section(cfg, head_cfg, params, head, pool_cfgs, base, jobs, kc)

    def state_key(self, b: int) -> jax.Array:
        """The key of the KV rows of every B-sequence state: the same rows at any pool size."""
        return jax.random.fold_in(self.key, 1000 + b)

    def seeded_state(self, pool_cfg, b: int) -> DrafterState:
        """B sequences holding ``--context`` rows, as every timing loop of batch B starts."""
        return filled_state(
            self.state_key(b), pool_cfg=pool_cfg, num_seqs=b, context=self.a.context
        )

    def seeded_pairs(self, cfg, k: int, b: int) -> drafter.Pairs:
        """The propose window of every (K, B) timing loop."""
        return make_pairs(
            jax.random.fold_in(self.key, 2000 + 10 * b + k),
            cfg,
            k=k,
            batch=b,
            context=self.a.context,
        )

    def point(self, cfg, head_cfg, params, head, pool_cfgs, base, jobs, plan, k, b) -> None:
        a = self.a
        rec = dict(kind="propose", **base, k=k, batch=b, impl="auto", iters=a.iters)
        job = jobs[plan["propose"]]
        if job.compiled is None:
            rec["error"] = job.error
            self.emit(rec)
            return
        rec["compile_s"] = job.compile_s
        rec["hlo"] = scan_hlo(job.compiled.as_text())
        rec["memory"] = memory_analysis(job.compiled)
        sb = _leaf_bytes(job.args[2])
        ok, msg = fits_in_memory(job.compiled, sb)
        rec["memory_check"] = msg
        if not ok:
            self.skip(f"{base['head']}/{base['precision']} K={k} B={b}", msg)
            return

        # The bytes model.
        d = drafter_bytes_per_draft(params, cfg, b)
        head_bytes = head.weight.nbytes  # the drafter scores every row of the head (no V')
        kv_dtype = pool_cfgs[(b, 1)].kv_dtype
        kv_bytes = kv_attended_bytes(cfg, kv_dtype, k=k, batch=b, context=a.context)
        total = k * (d["total"] + head_bytes) + kv_bytes
        roof = total / (self.bw_gbps * 1e3)
        rec.update(
            drafter_bytes_per_draft=d["total"],
            drafter_bytes_parts=d,
            head_bytes_per_draft=head_bytes,
            weight_bytes=k * (d["total"] + head_bytes),
            kv_bytes=kv_bytes,
            bytes=total,
            logits_bytes=k * b * head_cfg.draft_rows * 4 * 2,  # written and read, not counted
            roofline_us=roof,
        )

        # Auto, then the XLA baseline, each with its verify.
        pairs = self.seeded_pairs(cfg, k, b)
        th = normal_f32(jax.random.fold_in(self.key, 3000 + b), (b, k + 1, cfg.hidden_size))
        for impl in ("auto", "xla"):
            pkey, vkey = ("propose", "verify") if impl == "auto" else ("propose_xla", "verify_xla")
            if pkey not in plan:
                continue
            pj, vj = jobs[plan[pkey]], jobs[plan[vkey]]
            if pj.compiled is None or vj.compiled is None:
                rec[f"{impl}_error"] = pj.error or vj.error
                continue
            state = self.seeded_state(pool_cfgs[(b, 1)], b)
            res = time_rounds(
                pj.compiled,
                vj.compiled,
                params,
                head,
                state,
                pairs,
                th,
                iters=a.iters,
                warmup=a.warmup,
                context=a.context,
            )
            prefix = "" if impl == "auto" else "xla_"
            if impl == "auto":  # the same executable back to back: what the device itself takes
                # time_rounds consumed (donated) the state above.
                fresh = self.seeded_state(pool_cfgs[(b, 1)], b)
                rec["pipelined_us"] = time_pipelined(
                    pj.compiled, params, head, fresh, pairs, iters=a.iters
                )
                del fresh
                rec["pipelined_per_draft_us"] = rec["pipelined_us"] / k
            rec[f"{prefix}time_us"] = res["propose"]["time_us"]
            rec[f"{prefix}p10_us"] = res["propose"]["p10_us"]
            rec[f"{prefix}p90_us"] = res["propose"]["p90_us"]
            rec[f"{prefix}per_draft_us"] = res["propose"]["time_us"] / k
            rec[f"{prefix}verify_us"] = res["verify"]["time_us"]
            rec[f"{prefix}context_kept"] = res["context_kept"]
            rec[f"{prefix}kv_errors"] = res["kv_errors"]
            if impl == "auto":
                rec["drafts_sample"] = res["tokens"][: min(b, 4)].tolist()
            else:
                rec["xla_compile_s"] = pj.compile_s
            del state
        if "time_us" in rec:
            rec["roofline_ratio"] = rec["time_us"] / roof
        if "pipelined_us" in rec:
            rec["pipelined_roofline_ratio"] = rec["pipelined_us"] / roof
        if "xla_time_us" in rec and "time_us" in rec:
            rec["xla_over_auto"] = rec["xla_time_us"] / rec["time_us"]
        # Verify: (K+1) * B rows through the full head + acceptance + the drafter trim.
        vbytes = head.weight.nbytes + b * (k + 1) * cfg.hidden_size * 4
        rec.update(
            verify_rows=b * (k + 1),
            verify_bytes=vbytes,
            verify_logits_bytes=b * (k + 1) * head_cfg.vocab_size * 4 * 2,
            verify_roofline_us=vbytes / (self.bw_gbps * 1e3),
        )
        if "verify_us" in rec:
            rec["verify_roofline_ratio"] = rec["verify_us"] / rec["verify_roofline_us"]
        trec = getattr(self, "torch_times", {}).get((base["head"], k, b))
        if trec is not None:
            _set_torch_fields(rec, trec)
        self.emit(rec)

    def pool10x(self, cfg, params, head, pool_cfgs, base, jobs, jk, k, b) -> None:
        """Propose with a KV pool 10x larger, same context: donation makes the update in place,
        so the time must not grow with the pool. Proposing again without a verify drops the
        previous chain rows itself, so the context stays put between calls."""
        a = self.a
        job = jobs[jk]
        rec = dict(kind="pool_10x", **base, k=k, batch=b, impl="auto")
        if job.compiled is None:
            rec["error"] = job.error
            self.emit(rec)
            return
        ok, msg = fits_in_memory(job.compiled, _leaf_bytes(job.args[2]))
        if not ok:
            self.skip(f"{base['head']} 10x pool", msg)
            return
        pairs = self.seeded_pairs(cfg, k, b)
        state = self.seeded_state(pool_cfgs[(b, 10)], b)
        res = time_rounds(
            job.compiled,
            None,
            params,
            head,
            state,
            pairs,
            None,
            iters=a.iters,
            warmup=a.warmup,
            context=a.context,
        )
        pool_bytes = _leaf_bytes(job.args[2].kv.pool)
        pool_1x_bytes = _leaf_bytes(
            jax.eval_shape(lambda: drafter.init_state(pool_cfgs[(b, 1)], num_seqs=b)).kv.pool
        )
        rec.update(pool_bytes=pool_bytes, pool_1x_bytes=pool_1x_bytes)
        # The compiler's own account: a pool-sized copy or conversion shows up as temporaries
        # that grow with the pool.
        one = jobs.get(("propose", "auto" if self.gpu else "xla", k, b, 1, False))
        m10 = memory_analysis(job.compiled)
        m1 = memory_analysis(one.compiled) if one is not None and one.compiled else None
        if m1 and m10:
            growth = m10["temp_size_in_bytes"] - m1["temp_size_in_bytes"]
            rec.update(
                temp_bytes_1x=m1["temp_size_in_bytes"],
                temp_bytes_10x=m10["temp_size_in_bytes"],
                in_place=bool(
                    growth < 0.5 * (pool_bytes - pool_1x_bytes)
                    and m10["alias_size_in_bytes"] >= pool_bytes
                ),
            )
        rec.update(
            time_us=res["propose"]["time_us"],
            context_kept=res["context_kept"],
            p10_us=res["propose"]["p10_us"],
            p90_us=res["propose"]["p90_us"],
            memory=memory_analysis(job.compiled),
            hlo=scan_hlo(job.compiled.as_text()),
        )
        del state
        # The same executable's pool, timed by the same loop.
        if one is not None and one.compiled is not None:
            state = self.seeded_state(pool_cfgs[(b, 1)], b)
            res1 = time_rounds(
                one.compiled,
                None,
                params,
                head,
                state,
                pairs,
                None,
                iters=a.iters,
                warmup=a.warmup,
                context=a.context,
            )
            rec["pool_1x_time_us"] = res1["propose"]["time_us"]
            rec["ratio_10x_over_1x"] = rec["time_us"] / rec["pool_1x_time_us"]
            del state
        self.emit(rec)

    # -- PyTorch --------------------------------------------------------------------------------

    def torch_section(self, cfg, params, head, pool_cfgs, base, jobs, check_jk, points, kv_dtype):
        torch, ref = self.torch, self.torch_ref
        a = self.a
        dev = "cuda" if self.gpu and torch.cuda.is_available() else "cpu"
        if self.gpu and dev == "cpu":
            self.meta["notes"].append("torch has no CUDA device here: PyTorch baseline on CPU")
        dims = ref.Dims.from_config(cfg)

        def inputs(k, b, pool_f=1):
            return self.seeded_state(pool_cfgs[(b, pool_f)], b), self.seeded_pairs(cfg, k, b)

        def torch_kv(state, capacity, dtype):
            kk, vv = jax.block_until_ready(held_rows(state.kv, a.context))
            kt = ref._to_torch(kk, torch.float32).to(dev)
            vt = ref._to_torch(vv, torch.float32).to(dev)
            return ref.kv_cache_from_rows(kt, vt, capacity=capacity, dtype=dtype)

        def torch_anchor(pairs, dtype):
            tok = torch.from_numpy(np.array(pairs.tokens[:, 0], np.int64))
            hid = torch.from_numpy(np.array(pairs.hidden[:, 0].astype(jnp.float32)))
            return tok.to(dev), hid.to(dev, dtype)

        # 1. Token check: F32 reference against the XLA path at highest precision.
        if check_jk is not None:
            k, b = check_jk[2], check_jk[3]
            rec = dict(kind="torch_check", **base, k=k, batch=b, torch_dtype="float32")
            job = jobs[check_jk]
            try:
                if job.compiled is None:
                    raise RuntimeError(job.error)
                w32 = ref.weights_from_jax(params, head, cfg, dtype=torch.float32)
                w32 = _move(w32, dev)
                state, pairs = inputs(k, b)
                kc, vc = torch_kv(state, a.context + k, torch.float32)
                out, state = job.compiled(params, head, state, pairs)
                jt, jp, jh = (np.asarray(x) for x in (out.tokens, out.probs, out.hidden))
                del state
                model = ref.TorchDrafter(w32, dims, kv_round=kv_dtype.value)
                tok, hid = torch_anchor(pairs, torch.float32)
                length = torch.full((b,), a.context, dtype=torch.long, device=dev)
                anchor = torch.full((b,), a.context - 1, dtype=torch.long, device=dev)
                with torch.no_grad(), _torch_f32_exact(torch):
                    tt, tp, th = model.propose(tok, hid, anchor, kc, vc, length, num_drafts=k)
                rec.update(compare_drafts(jt, jp, jh, *(x.cpu().numpy() for x in (tt, tp, th))))
                rec["jax_side"] = "xla, highest matmul precision"
                # The auto path's drafts (the timed executable) on the same inputs.
                auto = jobs.get(("propose", "auto" if self.gpu else "xla", k, b, 1, False))
                if auto is not None and auto.compiled is not None:
                    state, pairs = inputs(k, b)
                    out_auto, state = auto.compiled(params, head, state, pairs)
                    at = np.asarray(out_auto.tokens)
                    rec["auto_vs_torch"] = compare_drafts(
                        at,
                        np.asarray(out_auto.probs),
                        np.asarray(out_auto.hidden),
                        *(x.cpu().numpy() for x in (tt, tp, th)),
                    )
                    del state
                del w32, kc, vc, model
            except Exception as e:
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
            self.emit(rec)
            tqdm.write(
                f"torch check {base['head']}: ok={rec.get('ok')} "
                f"chain_match={rec.get('chain_match')} hidden_rel_err={rec.get('hidden_rel_err')}"
            )
            _free_torch(torch)

        # 2. Timing: BF16 weights, eager and CUDA graph (and torch.compile when asked).
        try:
            w16 = _move(ref.weights_from_jax(params, head, cfg, dtype=torch.bfloat16), dev)
        except Exception as e:
            self.skip(f"torch timing {base['head']}", f"{type(e).__name__}: {e}")
            return
        model = ref.TorchDrafter(w16, dims)
        for k, b in tqdm(points, desc=f"torch {base['head']}", leave=False):
            rec = dict(kind="torch", **base, k=k, batch=b, torch_dtype="bfloat16", device=dev)
            try:
                state, pairs = inputs(k, b)
                kc, vc = torch_kv(state, a.context + k, torch.bfloat16)
                del state
                tok, hid = torch_anchor(pairs, torch.bfloat16)
                anchor = torch.full((b,), a.context - 1, dtype=torch.long, device=dev)
                base_len = torch.full((b,), a.context, dtype=torch.long, device=dev)
                length = base_len.clone()

                def run(
                    model=model,
                    tok=tok,
                    hid=hid,
                    anchor=anchor,
                    kc=kc,
                    vc=vc,
                    length=length,
                    base_len=base_len,
                    k=k,
                ):
                    length.copy_(base_len)
                    return model.propose(tok, hid, anchor, kc, vc, length, num_drafts=k)

                with torch.no_grad():
                    rec["eager"] = _time_torch(torch, run, dev, a.iters, a.warmup)
                    if dev == "cuda":
                        rec["cuda_graph"] = _time_cuda_graph(torch, run, a.iters, a.warmup)
                    else:
                        rec["cuda_graph"] = dict(error="no CUDA device")
                    if a.torch_compile:
                        rec["torch_compile"] = _time_torch_compile(
                            torch, run, dev, a.iters, a.warmup
                        )
                for mode in ("eager", "cuda_graph", "torch_compile"):
                    if "time_us" in rec.get(mode, {}):
                        rec[mode]["per_draft_us"] = rec[mode]["time_us"] / k
                del kc, vc
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
            self.emit(rec)
            self._attach_torch(rec)
        del model, w16
        _free_torch(torch)

    def _attach_torch(self, trec: dict) -> None:
        """Copies the PyTorch times into every propose record of that head, K and B: the
        dequantised BF16 weights are the same size whatever the JAX precision."""
        for r in self.records:
            if (
                r.get("kind") == "propose"
                and r["head"] == trec["head"]
                and r["k"] == trec["k"]
                and r["batch"] == trec["batch"]
            ):
                _set_torch_fields(r, trec)
        self.torch_times = getattr(self, "torch_times", {})
        self.torch_times[(trec["head"], trec["k"], trec["batch"])] = trec
        self.save()

    # -- two GPUs -------------------------------------------------------------------------------

    def two_gpu_section(self, cfg, head_cfg, params, head, pool_cfgs, base, jobs, k) -> None:
        a = self.a
        devs = jax.devices()[:2]
        key = self.key
        opts = SMOKE_COMPILER_OPTIONS if a.smoke else None

        # (a) Vocab-parallel LM head against the replicated head on one device: greedy token.
        mesh = jax.make_mesh((2,), ("tp",), devices=devs)
        try:
            sharded = shard_lm_head(head, mesh, "tp")
        except Exception as e:
            self.skip("sharded LM head", f"{type(e).__name__}: {e}")
            sharded = None
        one = jax.jit(
            lambda h, x: jnp.argmax(lm_head(h, x, cfg=head_cfg, draft=True), -1).astype(jnp.int32)
        )
        two = jax.jit(
            lambda sh, x: sharded_lm_head(sh, x, cfg=head_cfg, draft=True, with_logits=False).token
        )
        for b in a.batches if sharded is not None else ():
            rec = dict(kind="sharded_lm_head", **base, batch=b, devices=2)
            try:
                x = normal_f32(jax.random.fold_in(key, 4000 + b), (b, cfg.hidden_size))
                x2 = jax.device_put(x, NamedSharding(mesh, P()))
                c1 = _compile(one, (head, x), opts)
                c2 = _compile(two, (sharded, x2), opts)
                t1 = time_calls(c1, head, x, iters=a.iters, warmup=a.warmup)
                t2 = time_calls(c2, sharded, x2, iters=a.iters, warmup=a.warmup)
                rec.update(
                    one_gpu_us=t1["time_us"],
                    two_gpu_us=t2["time_us"],
                    speedup=t1["time_us"] / t2["time_us"],
                    head_bytes=head.weight.nbytes,
                    roofline_one_gpu_us=head.weight.nbytes / (self.bw_gbps * 1e3),
                    tokens_match=bool(
                        np.array_equal(np.asarray(c1(head, x)), np.asarray(c2(sharded, x2)))
                    ),
                    hlo=scan_hlo(c2.as_text()),
                )
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
            self.emit(rec)
        del sharded

        # (b) Batch-sharded propose: one state of B/2 sequences per device, under shard_map.
        dp = jax.make_mesh((2,), ("dp",), devices=devs)
        rep = NamedSharding(dp, P())
        params2, head2 = jax.device_put((params, head), rep)
        fn = sharded_propose_fn(cfg, k, dp)
        for b in a.batches:
            if b < 2 or b % 2:
                continue
            rec = dict(kind="sharded_propose", **base, k=k, batch=b, devices=2, impl="auto")
            try:
                half = b // 2
                f = functools.partial(
                    filled_state,
                    pool_cfg=pool_cfgs[(half, 1)]
                    if (half, 1) in pool_cfgs
                    else drafter.pool_config(
                        cfg,
                        precision=base["drafter_precision"],
                        max_seq_len=a.context + max(a.ks) + 1,
                        max_seqs=half,
                    ),
                    num_seqs=half,
                    context=a.context,
                )
                # The one-GPU point's rows: sequences 0..B/2-1 on one device, the rest on the
                # other.
                halves = jax.vmap(f, in_axes=(None, 0))(self.state_key(b), jnp.array([0, half]))
                states = jax.device_put(halves, NamedSharding(dp, P("dp")))
                # The one-GPU point's pairs, split in two halves of B/2 sequences.
                pairs = self.seeded_pairs(cfg, k, b)
                pairs = jax.tree.map(lambda t, h=half: t.reshape(2, h, *t.shape[1:]), pairs)
                pairs = jax.device_put(pairs, NamedSharding(dp, P("dp")))
                c = _compile(fn, (params2, head2, states, pairs), opts)
                res = time_rounds(
                    c,
                    None,
                    params2,
                    head2,
                    states,
                    pairs,
                    None,
                    iters=a.iters,
                    warmup=a.warmup,
                    context=a.context,
                    sharded=True,
                )
                rec.update(
                    two_gpu_us=res["propose"]["time_us"],
                    per_draft_us=res["propose"]["time_us"] / k,
                    context_kept=res["context_kept"],
                    hlo=scan_hlo(c.as_text()),
                )
                del states
                # One GPU, all B sequences, timed by the same loop (no verify in between).
                one = jobs.get(("propose", "auto" if self.gpu else "xla", k, b, 1, False))
                if one is not None and one.compiled is not None:
                    state = self.seeded_state(pool_cfgs[(b, 1)], b)
                    pairs1 = self.seeded_pairs(cfg, k, b)
                    res1 = time_rounds(
                        one.compiled,
                        None,
                        params,
                        head,
                        state,
                        pairs1,
                        None,
                        iters=a.iters,
                        warmup=a.warmup,
                        context=a.context,
                    )
                    del state
                    rec["one_gpu_us"] = res1["propose"]["time_us"]
                    rec["speedup"] = rec["one_gpu_us"] / rec["two_gpu_us"]
                    # The two halves are the one-GPU batch split in two: the same drafts, up to
                    # rounding that may differ with the rows per device.
                    rec["draft_agreement"] = float(np.mean(res1["tokens"] == res["tokens"]))
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
            self.emit(rec)
        del params2, head2


# ---------------------------------------------------------------------------------------------
# Jitted step wrappers and the timing loop.
# ---------------------------------------------------------------------------------------------


def propose_fn(cfg, k: int, impl: str):
    """``propose`` with its static arguments bound; the state (argument 2) is donated."""
    return jax.jit(
        lambda p, h, s, x: drafter.propose(p, h, s, x, cfg=cfg, num_drafts=k, implementation=impl),
        donate_argnums=(2,),
    )


def verify_fn(head_cfg, impl: str):
    """``verify`` (greedy, ``refeed=True``) with its static arguments bound; state donated."""
    return jax.jit(
        lambda h, s, th, d: verify(h, s, th, d, cfg=head_cfg, refeed=True, implementation=impl),
        donate_argnums=(1,),
    )


def sharded_propose_fn(cfg, k: int, mesh):
    """Propose over a state stacked ``[2, ...]`` along the mesh axis: one state per device."""

    def local(p, h, s, x):
        s0 = jax.tree.map(lambda t: t[0], s)
        x0 = jax.tree.map(lambda t: t[0], x)
        out, s1 = drafter.propose(p, h, s0, x0, cfg=cfg, num_drafts=k, implementation="auto")
        return jax.tree.map(lambda t: t[None], (out.tokens, s1))

    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(), P("dp"), P("dp")),
        out_specs=P("dp"),
        check_vma=False,
    )
    return jax.jit(f, donate_argnums=(2,))


def _compile(fn, args, options):
    lowered = fn.lower(*args)
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def time_rounds(
    propose_c,
    verify_c,
    params,
    head,
    state,
    pairs,
    target_hidden,
    *,
    iters,
    warmup,
    context,
    sharded: bool = False,
) -> dict:
    """Synchronous propose calls, each followed by a synchronous verify (which trims the rows
    the propose added) when ``verify_c`` is given. Returns median times, the drafts of the last
    call and whether the context stayed at ``context`` rows."""
    tp, tv = [], []
    tokens = None
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        out, state = propose_c(params, head, state, pairs)
        _sync((out, state))
        t1 = time.perf_counter()
        if verify_c is not None:
            vout, state = verify_c(head, state, target_hidden, out)
            _sync((vout, state))
        t2 = time.perf_counter()
        if i >= warmup:
            tp.append((t1 - t0) * 1e6)
            tv.append((t2 - t1) * 1e6)
        tokens = out if sharded else out.tokens
    tokens = np.asarray(tokens)
    k = tokens.shape[-1]
    seq_len = np.asarray(state.kv.seq_len)
    errors = np.asarray(state.kv.error)
    # Without a verify the last call's K - 1 chain rows are still held (the next propose would
    # drop them itself).
    held = context if verify_c is not None else context + k - 1
    return dict(
        propose=_stats(tp),
        verify=_stats(tv) if verify_c is not None else None,
        tokens=tokens.reshape(-1, k),
        context_kept=bool(np.all(seq_len == held)),
        kv_errors=int(np.count_nonzero(errors)),
    )


def time_pipelined(propose_c, params, head, state, pairs, *, iters: int) -> float:
    """Microseconds per propose when ``iters`` calls are queued back to back and synchronised
    once at the end: the host's dispatch overlaps the device's work, so this is the device's
    own time per call (a serving loop that keeps the device busy sees it). Each call drops the
    K - 1 chain rows the previous one held, so the context stays the same."""
    out, state = propose_c(params, head, state, pairs)
    _sync((out, state))
    t0 = time.perf_counter()
    for _ in range(iters):
        out, state = propose_c(params, head, state, pairs)
    _sync((out, state))
    return (time.perf_counter() - t0) / iters * 1e6


def compare_drafts(jt, jp, jh, tt, tp, th) -> dict:
    """Agreement of two draft chains (tokens [B, K], probs [B, K], hidden [B, K, H]).

    After the first disagreement a chain legitimately diverges, so agreement is the common
    prefix per sequence; probabilities and hidden states are compared over that prefix.
    """
    B, K = jt.shape
    same = jt == tt
    prefix = np.where(same.all(1), K, np.argmin(same, axis=1))
    mask = np.arange(K)[None, :] < prefix[:, None]
    hid0 = float(np.linalg.norm(th[:, 0] - jh[:, 0]) / max(np.linalg.norm(jh[:, 0]), 1e-30))
    prob_err = float(np.max(np.abs(tp - jp)[mask] / np.abs(jp)[mask])) if mask.any() else None
    return dict(
        all_match=bool((prefix == K).all()),
        first_draft_match=float(np.mean(prefix >= 1)),
        chain_match=float(prefix.mean() / K),
        mismatched_sequences=int((prefix < K).sum()),
        hidden_rel_err=hid0,
        prob_rel_err=prob_err,
        ok=bool(prefix.min() >= 1 and hid0 < 1e-3),
        jax_tokens=jt[: min(B, 4)].tolist(),
        torch_tokens=tt[: min(B, 4)].tolist(),
    )


# ---------------------------------------------------------------------------------------------
# PyTorch helpers.
# ---------------------------------------------------------------------------------------------


def load_torch_reference():
    path = Path(__file__).resolve().parent / "torch_reference_drafter.py"
    spec = importlib.util.spec_from_file_location("torch_reference_drafter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _move(weights, dev: str):
    return dataclasses.replace(
        weights,
        **{
            f.name: getattr(weights, f.name).to(dev)
            for f in dataclasses.fields(weights)
            if getattr(weights, f.name) is not None
        },
    )


@contextlib.contextmanager
def _torch_f32_exact(torch):
    """F32 matmuls without TF32, for the token check."""
    old = torch.get_float32_matmul_precision()
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


def _free_torch(torch) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_torch(torch, run, dev: str, iters: int, warmup: int) -> dict:
    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        run()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        sync()
        ts.append((time.perf_counter() - t0) * 1e6)
    return _stats(ts)


def _time_cuda_graph(torch, run, iters: int, warmup: int) -> dict:
    """Captures the whole K-step propose as one CUDA graph and times its replays."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        return _time_torch(torch, g.replay, "cuda", iters, warmup)
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {str(e)[:400]}")


def _time_torch_compile(torch, run, dev: str, iters: int, warmup: int) -> dict:
    try:
        t0 = time.perf_counter()
        compiled = torch.compile(run)
        compiled()
        if dev == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        out = _time_torch(torch, compiled, dev, iters, warmup)
        out["compile_s"] = compile_s
        return out
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {str(e)[:400]}")


def _set_torch_fields(r: dict, trec: dict) -> None:
    for name in ("eager", "cuda_graph", "torch_compile"):
        t = trec.get(name)
        if t and "time_us" in t:
            r[f"torch_{name}_us"] = t["time_us"]
            r[f"torch_{name}_per_draft_us"] = t["time_us"] / r["k"]
    if "torch_eager_us" in r and "time_us" in r:
        r["torch_eager_over_auto"] = r["torch_eager_us"] / r["time_us"]
    if "torch_cuda_graph_us" in r and "time_us" in r:
        r["torch_cuda_graph_over_auto"] = r["torch_cuda_graph_us"] / r["time_us"]


def register_kernels() -> str:
    """Makes sure the Pallas kernels are registered behind ``linear`` and the LM head's verify
    tier (importing ``mtpjax`` does it; calling again is a no-op). Returns what was done."""
    try:
        from mtpjax.kernels import register_pallas_kernels

        register_pallas_kernels()
        return "mtpjax.kernels.register_pallas_kernels()"
    except Exception as e:
        return f"kernel registration failed: {type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------
# Report: table and plot.
# ---------------------------------------------------------------------------------------------


def _fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(records: list[dict]) -> str:
    rows = [r for r in records if r.get("kind") == "propose"]
    head = (
        f"{'head':6} {'precision':15} {'K':>2} {'B':>3} {'propose':>9} {'/draft':>8} "
        f"{'roof':>8} {'ratio':>6} {'piped':>6} {'xla':>9} {'torch':>9} {'graph':>9} {'verify':>8} "
        f"{'v.ratio':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['head']:6} {r['precision']:15} {r['k']:>2} {r['batch']:>3} "
            f"{_fmt(r.get('time_us')):>9} {_fmt(r.get('per_draft_us')):>8} "
            f"{_fmt(r.get('roofline_us')):>8} {_fmt(r.get('roofline_ratio'), '.2f'):>6} "
            f"{_fmt(r.get('pipelined_roofline_ratio'), '.2f'):>6} "
            f"{_fmt(r.get('xla_time_us')):>9} {_fmt(r.get('torch_eager_us')):>9} "
            f"{_fmt(r.get('torch_cuda_graph_us')):>9} {_fmt(r.get('verify_us')):>8} "
            f"{_fmt(r.get('verify_roofline_ratio'), '.2f'):>7}"
            + (f"  ERROR {r['error'][:60]}" if r.get("error") else "")
        )
    lines.append(
        "times in µs (median); roof = bytes / copy bandwidth; ratio = propose / roof; piped = "
        "the same ratio for calls queued back to back; xla = same "
        "propose with implementation='xla'; torch / graph = PyTorch BF16 eager / CUDA graph"
    )
    extra = []
    for r in records:
        kind = r.get("kind")
        if kind == "pool_10x" and "time_us" in r:
            extra.append(
                f"10x KV pool {r['head']}/{r['precision']} K={r['k']} B={r['batch']}: "
                f"{r['time_us']:.0f} µs vs {_fmt(r.get('pool_1x_time_us'))} µs "
                f"(ratio {_fmt(r.get('ratio_10x_over_1x'), '.2f')}), KV {r['kv_dtype']}, "
                f"in place per the compiler: {r.get('in_place')}"
            )
        elif kind == "torch_check":
            extra.append(
                f"torch check {r['head']}/{r['precision']} K={r['k']} B={r['batch']}: "
                f"ok={r.get('ok')} all_match={r.get('all_match')} "
                f"chain_match={_fmt(r.get('chain_match'), '.3f')} "
                f"hidden_rel_err={_fmt(r.get('hidden_rel_err'), '.1e')}"
                + (f" ERROR {r['error'][:80]}" if r.get("error") else "")
            )
        elif kind == "sharded_lm_head" and "two_gpu_us" in r:
            extra.append(
                f"vocab-parallel head {r['head']} B={r['batch']}: 1 GPU {r['one_gpu_us']:.0f} µs, "
                f"2 GPUs {r['two_gpu_us']:.0f} µs (x{r['speedup']:.2f}), "
                f"tokens match {r['tokens_match']}"
            )
        elif kind == "sharded_propose" and "two_gpu_us" in r:
            extra.append(
                f"batch-sharded propose {r['head']} K={r['k']} B={r['batch']}: "
                f"2 GPUs {r['two_gpu_us']:.0f} µs, 1 GPU {_fmt(r.get('one_gpu_us'))} µs "
                f"(x{_fmt(r.get('speedup'), '.2f')})"
            )
    hlo = [r for r in rows if "hlo" in r]
    if hlo:
        clean = sum(r["hlo"]["host_transfer_free"] for r in hlo)
        extra.append(f"compiled propose HLO free of host transfers: {clean}/{len(hlo)}")
    return "\n".join(lines + extra)


def plot(records: list[dict], path: Path, *, k: int, context: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("kind") == "propose" and r["k"] == k and "time_us" in r]
    heads = list(dict.fromkeys(r["head"] for r in rows))
    if not heads:
        return
    fig, axes = plt.subplots(1, len(heads), figsize=(6.0 * len(heads) + 2.6, 4.8), squeeze=False)
    colors = dict(zip(PRECISIONS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for ax, h in zip(axes[0], heads, strict=True):
        for prec, color in colors.items():
            pts = sorted(
                (r for r in rows if r["head"] == h and r["precision"] == prec),
                key=lambda r: r["batch"],
            )
            if not pts:
                continue
            bs = [r["batch"] for r in pts]
            ax.plot(bs, [r["per_draft_us"] for r in pts], "o-", color=color, label=prec)
            ax.plot(
                bs,
                [r["roofline_us"] / k for r in pts],
                "_--",
                color=color,
                label=f"{prec} roofline",
            )
            piped = [
                (r["batch"], r["pipelined_per_draft_us"])
                for r in pts
                if "pipelined_per_draft_us" in r
            ]
            if piped:
                ax.plot(
                    *zip(*piped, strict=True),
                    "^-.",
                    color=color,
                    ms=4,
                    alpha=0.6,
                    label=f"{prec} back to back",
                )
            xs = [(r["batch"], r["xla_per_draft_us"]) for r in pts if "xla_per_draft_us" in r]
            if xs:
                ax.plot(
                    *zip(*xs, strict=True),
                    "s:",
                    color=color,
                    mfc="none",
                    alpha=0.7,
                    label=f"{prec} xla",
                )
        tr = sorted(
            {
                r["batch"]: r for r in rows if r["head"] == h and "torch_eager_per_draft_us" in r
            }.values(),
            key=lambda r: r["batch"],
        )
        if tr:
            ax.plot(
                [r["batch"] for r in tr],
                [r["torch_eager_per_draft_us"] for r in tr],
                "kx",
                ms=8,
                label="PyTorch bf16 eager",
            )
            g = [
                (r["batch"], r["torch_cuda_graph_per_draft_us"])
                for r in tr
                if "torch_cuda_graph_per_draft_us" in r
            ]
            if g:
                ax.plot(*zip(*g, strict=True), "k+", ms=10, label="PyTorch bf16 CUDA graph")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B (sequences)")
        ax.set_ylabel("propose latency per draft (µs)")
        ax.set_title(f"{h} head, K={k}, context {context}")
        ax.grid(True, which="both", alpha=0.3)
    # One legend for all panels, outside them: the series are the same in each.
    handles, labels = {}, []
    for ax in axes[0]:
        for hnd, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in handles:
                handles[lab] = hnd
                labels.append(lab)
    axes[0][-1].legend(
        [handles[lab] for lab in labels],
        labels,
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    out = [int(x) for x in s.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _names(allowed):
    def parse(s: str) -> list[str]:
        out = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in out if x not in allowed]
        if bad or not out:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(allowed)}"
            )
        return out

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, default=REPO / "benchmarks/results/propose_h200.json")
    p.add_argument("--plot", type=Path, default=None, help="default: the JSON path as .png")
    p.add_argument("--heads", type=_names(HEADS), default=list(HEADS))
    p.add_argument(
        "--precisions",
        type=_names(tuple(PRECISIONS)),
        default=list(DEFAULT_PRECISIONS),
        help="in run order (default nvfp4,bf16-nvfp4head,fp8)",
    )
    p.add_argument("--ks", type=_ints, default=None, help="drafts K (default 1,3,5)")
    p.add_argument("--batches", type=_ints, default=None, help="batches B (default 1,8,64)")
    p.add_argument("--grid", choices=("star", "full"), default="star")
    p.add_argument("--context", type=int, default=None, help="KV rows per sequence (4096)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per point (20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (3)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no block after this many seconds (default 390; none for smoke)",
    )
    p.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="executables compiled at once (default 6 on GPU, 1 on CPU)",
    )
    p.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        help="JAX persistent compilation cache directory: a second run on a warm machine "
        "skips the compiles (off by default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds")
    p.add_argument("--skip-torch", action="store_true", help="no PyTorch baseline or check")
    p.add_argument("--torch-compile", action="store_true", help="also time torch.compile")
    p.add_argument("--skip-two-gpu", action="store_true", help="no two-device section")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: print the table of these result files together and write their "
        "plot (--plot, default the first file's .png)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    args.ks = args.ks or _ints(defaults["ks"])
    args.batches = args.batches or _ints(defaults["batches"])
    for name in ("context", "iters", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.context < 2:
        p.error("--context must be at least 2")
    if args.budget_s is None and not args.smoke:
        args.budget_s = 390.0
    if args.compile_workers is None:
        args.compile_workers = min(8, os.cpu_count() or 1) if on_gpu() else 1
    if args.plot is None:
        args.plot = (args.merge[0] if args.merge else args.json).with_suffix(".png")
    return args


def merge(paths: list[Path], plot_path: Path, *, k: int, context: int) -> list[dict]:
    """Records of several result files (e.g. a block re-run apart) as one table and plot."""
    records = []
    for path in paths:
        try:
            records += json.loads(path.read_text())["records"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{path}: not a bench_propose result file ({e})") from None
    plot(records, plot_path, k=k, context=context)
    print(table(records))
    print(f"wrote {plot_path} from {len(paths)} files")
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, args.plot, k=center(args.ks), context=args.context)
        return 0
    if args.compile_cache is not None:
        args.compile_cache.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(args.compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    bench = Bench(args)
    print(
        f"bench_propose: {jax.default_backend()} x{jax.device_count()}, heads {args.heads}, "
        f"precisions {args.precisions}, points {grid_points(args.ks, args.batches, args.grid)}, "
        f"context {args.context}",
        flush=True,
    )
    bench.run()
    bench.save()
    plot(bench.records, args.plot, k=center(args.ks), context=args.context)
    print(table(bench.records))
    if bench.skipped:
        print("skipped:\n  " + "\n  ".join(bench.skipped))
    for note in bench.meta["notes"]:
        print(f"note: {note}")
    print(f"wrote {args.json} and {args.plot} in {bench.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
