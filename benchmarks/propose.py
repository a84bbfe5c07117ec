"""Propose and verify latency of the MTP drafter at real shapes, against its rooflines and baselines.

    python -m benchmarks.propose --json $OUT/propose_h200.json

This writes the JSON records (rewritten as the run goes, so a killed run keeps what it measured),
a plot next to them (``--plot``, default: the JSON path as ``.png``), and prints a table last.
The ``--budget-s`` guard skips the blocks that would start after the budget and says which.

All weights are random, at the real shapes:

- **dense**: a Qwen3.5-27B-like head. Hidden 5120; 24 query and 4 KV heads of 256 (gated
  ``q_proj`` 12288 wide); partial RoPE 0.25; dense FFN 17408; LM head ``[248320, 5120]``.
- **moe**: a Qwen3-Next-80B-like head. Hidden 2048; 16 query and 2 KV heads of 256; 512
  experts of width 512, top-10, plus a 512-wide gated shared expert; LM head ``[151936, 2048]``.
- **deepseek** (run it by name: ``--heads deepseek --precisions fp8-block``): DeepSeek-V3's MTP
  module. Hidden 7168; MLA with 128 heads, q_lora 1536, kv_lora 512, RoPE 64, nope 128, v 128
  (YaRN); 256 routed experts of width 2048, top-8 in 8 groups (best 4 kept) with the
  correction bias, plus one shared expert; LM head ``[129280, 7168]``. Its KV pool holds the
  latent rows (512 + 64 values, 1152 bytes per token in BF16), decoded with ``kv_b_proj``
  absorbed; paged attention over latent rows always takes the jnp reference (the Triton kernel
  reads separate K and V pools).

Precisions: ``bf16-nvfp4head`` (a BF16 drafter with an NVFP4 LM head), ``fp8`` (everything FP8
per-row), ``nvfp4`` (everything NVFP4; a dense head keeps fc/k/v in BF16, and the KV pool is FP8;
BF16 at the other two), ``fp8-block`` (DeepSeek's stored formats: every projection FP8 block-128
but the BF16 router, a BF16 LM head, a BF16 pool). Drafts K are 1, 3, 5 and batches B 1, 8, 64. Each sequence's KV holds
``--context`` (4096) random rows written straight into the pool (no prefill); each propose gets
the anchor pair at key ``context - 1`` in a window ``K + 1`` pairs wide, as a serving loop passes.

For every (head, precision, K, B) point:

- **propose latency**: the median over ``--iters`` synchronous calls of the jitted ``propose``
  (AOT-compiled, state donated), after ``--warmup`` calls, each followed by a synchronous
  ``verify`` with ``refeed=True`` (timed too) that trims the chain rows, so every call starts
  from ``context`` rows (checked). ``pipelined_us``: the same propose queued back to back
  (``benchmarks.harness.time_queued``), the device's own time per call.
- **bytes**: the least the step must move: drafter weights once per draft (for the MoE head the
  router, the shared expert and the expected distinct experts B rows of top-10 routing touch,
  ``E (1 - (1 - k/E)^B)``), the LM head once per draft, and the KV rows attended.
- **roofline ratio**: time / (bytes / copy bandwidth), the copy measured in the same process.
- **baselines from the same run**: ``implementation="xla"`` at the middle K, and (when torch is
  installed) ``benchmarks.torch_reference`` with the weights dequantised to BF16, eager and as a
  CUDA graph (``--torch-compile`` adds ``torch.compile``), at the first precision of each head.
- **hidden costs**: the compiled HLO is searched for host transfers and its custom calls listed
  (whether the Pallas kernels were used). Once per head and KV dtype, propose also runs with a KV
  pool 10x larger at the same context: donated, the update is in place, so neither its time nor
  the compiler's temporaries may grow with the pool.
- **two GPUs** (``jax.device_count() >= 2``; first head and precision): the vocab-parallel LM
  head and a batch-sharded propose (one state per device under ``shard_map``) against one GPU.
- **tensor / expert parallel** (``jax.device_count() >= 2``; heads ``dense`` and ``deepseek``
  at their first precision; ``--parallel-only`` runs nothing else): propose with the drafter
  placed by ``drafter.shard_drafter`` over ``--tp-sizes`` devices (1, 2, 4; those the machine
  has and the head splits into whole heads and experts), the MoE's experts split over the
  devices (``split="experts"``) and, apart, each expert's width (``"width"``), at
  ``--parallel-ks`` x ``--parallel-batches`` (1, 3 x 1, 8), all ``implementation="xla"``
  (jit cannot split a Pallas custom call). Per point: the speed-up over one device (synchronous
  and back to back), the ratio to the per-device roofline (the bytes one device holds and must
  read: its shards of the weights, the experts B rows touch split n ways, its KV heads' rows,
  over the copy bandwidth), the collectives in the compiled program and the bytes they return
  (weights never cross devices: kilobytes), and whether the drafts equal one device's. Run it
  at ``--precisions bf16``, which XLA reads at copy bandwidth (a tiny FP8 block-128 head cannot
  split its 128-wide scale tiles and is left out with a note).

The default grid is a *star* around the middle point (K=3, B=8): every B at K=3, K=1 and K=5 at
B=8. ``--grid full`` runs every (K, B) pair. Executables are compiled ahead of time, several at
once (``--compile-workers``), one (head, precision) block at a time; blocks run precision-major
in the order of ``--precisions``, so a run cut by ``--budget-s`` loses the last precision.

``--smoke`` runs tiny shapes on the CPU in seconds. It checks the benchmark, not the GPU; the
drafts' correctness against the PyTorch reference is ``tests/test_gpu_propose.py``'s.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import gc
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from benchmarks import harness
from mtpjax import drafter
from mtpjax.config import Architecture, DrafterConfig, FfnKind, MoeConfig
from mtpjax.head import init_lm_head, lm_head, shard_lm_head, sharded_lm_head
from mtpjax.kv import DrafterState, KVDtype, donation, gather, reserve, row_address, write_rows
from mtpjax.layers import DenseFfnParams, MoeFfnParams
from mtpjax.verify import verify
from mtpjax.weights import Fp8RowWeight, Weight, WeightFormat, dequantize, quantize

PRECISIONS = {  # name -> (drafter precision, LM head precision)
    "bf16-nvfp4head": ("bf16", "nvfp4"),
    "fp8": ("fp8", "fp8"),
    "nvfp4": ("nvfp4", "nvfp4"),
    "fp8-block": ("fp8_block", "bf16"),  # DeepSeek's checkpoint formats (BF16 LM head)
    "bf16": ("bf16", "bf16"),  # what XLA reads at copy bandwidth (the tensor-parallel section)
}
HEADS = ("dense", "moe", "deepseek")
DEFAULT_HEADS = ("dense", "moe")  # deepseek's 11.5 GB of experts runs when named
# Run order: all-NVFP4 first, FP8 last, so a run cut by the time budget loses the least.
DEFAULT_PRECISIONS = ("nvfp4", "bf16-nvfp4head", "fp8")

GPU_DEFAULTS = dict(ks="1,3,5", batches="1,8,64", context=4096, iters=20, warmup=3)
SMOKE_DEFAULTS = dict(ks="2", batches="4", context=40, iters=3, warmup=1)
# The tensor/expert-parallel section: its heads, (K, B) grid and mesh sizes.
PARALLEL_HEADS = ("dense", "deepseek")
PARALLEL_DEFAULTS = dict(ks="1,3", batches="1,8", sizes="1,2,4")
SMOKE_PARALLEL_DEFAULTS = dict(ks="2", batches="4", sizes="1,2,4")

# Fast XLA:CPU compiles for --smoke (the smoke run checks the script, not the speed).
SMOKE_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}

# ---------------------------------------------------------------------------------------------
# Configs, grid and the bytes model.
# ---------------------------------------------------------------------------------------------


def deepseek_config(*, smoke: bool) -> DrafterConfig:
    """DeepSeek-V3's MTP module from its config.json keys (tiny widths for --smoke)."""
    raw = dict(
        model_type="deepseek_v3", num_hidden_layers=61, num_nextn_predict_layers=1,
        hidden_size=7168, vocab_size=129_280, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        moe_intermediate_size=2048, n_shared_experts=1, routed_scaling_factor=2.5,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=163_840,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    )  # fmt: skip
    if smoke:
        raw.update(
            hidden_size=64, vocab_size=512, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            moe_intermediate_size=32,
        )  # fmt: skip
    return DrafterConfig.from_hf_config(raw)


def head_config(name: str, *, smoke: bool) -> DrafterConfig:
    """The drafter config of a head: real shapes, or tiny ones for --smoke."""
    if name == "deepseek":
        return deepseek_config(smoke=smoke)
    ffn = dict(ffn=FfnKind.MOE) if name == "moe" else {}
    if smoke:
        return DrafterConfig.tiny(vocab_size=512, **ffn)
    common = dict(head_dim=256, partial_rotary_factor=0.25, rope_theta=10_000_000.0)
    common.update(max_position_embeddings=262_144)
    if name == "dense":
        return DrafterConfig.tiny(
            architecture=Architecture.QWEN3_5, hidden_size=5120, vocab_size=248_320,
            num_attention_heads=24, num_key_value_heads=4, intermediate_size=17_408, **common
        )  # fmt: skip
    moe = MoeConfig(
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, shared_expert_gate=True
    )  # fmt: skip
    common.update(num_attention_heads=16, num_key_value_heads=2)
    return DrafterConfig.tiny(
        architecture=Architecture.QWEN3_NEXT, hidden_size=2048, vocab_size=151_936, moe=moe,
        **common, **ffn
    )  # fmt: skip


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


def expected_distinct_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts hit by ``rows`` rows of top-k routing, uniform at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def _weights_and_arrays(tree) -> tuple[int, int]:
    """(bytes of the weight pytrees, bytes of the plain arrays) among ``tree``'s fields."""
    weights = arrays = 0
    for field in dataclasses.fields(tree):
        value = getattr(tree, field.name)
        if isinstance(value, Weight):
            weights += value.nbytes
        elif value is not None:
            arrays += harness.tree_bytes(value)
    return weights, arrays


def drafter_bytes_per_draft(params, cfg: DrafterConfig, batch: int) -> dict:
    """Weight bytes one draft step reads for ``batch`` rows, by part (MLA: every attention
    projection once; its latent cache is the KV side)."""
    attn, ffn = params.layer.attention, params.layer.ffn
    norms = (params.pre_fc_norm_embedding, params.pre_fc_norm_hidden, params.norm)
    norms += (params.layer.input_layernorm, params.layer.post_attention_layernorm)
    attention, head_norms = _weights_and_arrays(attn)
    parts = {
        "fc": params.fc.nbytes,
        "attention": attention,
        "norms": harness.tree_bytes(norms) + head_norms,
        "embedding_rows": batch * cfg.hidden_size * 2,  # BF16 table rows gathered
    }
    if isinstance(ffn, DenseFfnParams):
        parts["ffn"] = sum(w.nbytes for w in (ffn.gate_proj, ffn.up_proj, ffn.down_proj))
    elif isinstance(ffn, MoeFfnParams):
        ex, se = ffn.experts, ffn.shared_expert
        per_expert = (
            sum(w.nbytes for w in (ex.gate_proj, ex.up_proj, ex.down_proj)) / ffn.num_experts
        )
        touched = expected_distinct_experts(ffn.num_experts, cfg.moe.num_experts_per_tok, batch)
        shared = (
            0 if se is None else sum(w.nbytes for w in (se.gate_proj, se.up_proj, se.down_proj))
        )
        if ffn.shared_expert_gate is not None:
            shared += ffn.shared_expert_gate.nbytes
        router = ffn.router.nbytes
        if ffn.score_correction_bias is not None:
            router += harness.tree_bytes(ffn.score_correction_bias)
        parts.update(router=router, shared_expert=shared)
        parts.update(experts=round(touched * per_expert), experts_touched=touched)
    else:
        raise TypeError(type(ffn).__name__)
    parts["total"] = int(sum(v for k, v in parts.items() if k != "experts_touched"))
    return parts


def kv_row_bytes(cfg: DrafterConfig, kv_dtype: KVDtype) -> int:
    """Bytes of one row of one sequence in the pool: K and V, or MLA's one latent row (FP8 rows
    carry F32 scales per head)."""
    pool = drafter.pool_config(cfg, precision="bf16", max_seq_len=1, max_seqs=1, kv_dtype=kv_dtype)
    return pool.row_bytes


def kv_attended_bytes(cfg, kv_dtype, *, k: int, batch: int, context: int) -> int:
    """KV bytes the K steps attend: step j reads ``context + j`` rows of each sequence."""
    rows = sum(context + j for j in range(k))
    return batch * rows * kv_row_bytes(cfg, kv_dtype)


# ---------------------------------------------------------------------------------------------
# Device helpers: copy bandwidth, the filled KV state, inputs, HLO scan, memory.
# ---------------------------------------------------------------------------------------------


def _sync(tree):
    jax.block_until_ready(tree)
    return tree


def prng_impl(smoke: bool) -> str:
    """Threefry on the GPU; the RBG generator for --smoke, whose programs compile ~3x faster on
    the CPU (the values differ, nothing else does)."""
    return "rbg" if smoke else "threefry2x32"


@functools.partial(jax.jit, static_argnames=("pool_cfg", "num_seqs", "context"))
def filled_state(key, first_seq=0, *, pool_cfg, num_seqs: int, context: int) -> DrafterState:
    """A drafter state whose sequences each hold ``context`` random rows (keys 0..context-1).

    Blocks are reserved through the allocator as appends would, then the rows are written as
    ``append`` writes them (FP8 pools quantise per row), so no prefill runs. Row r of sequence
    ``first_seq + b`` is N(0, 1) (the scale of normed, rotated keys) drawn from ``(key, that
    sequence)``: a batch split in halves (``first_seq`` = 0 and B/2) holds the same rows.
    """
    state = drafter.init_state(pool_cfg, num_seqs=num_seqs)
    cache, _ = reserve(state.kv[0], jnp.full((num_seqs,), context, jnp.int32))
    shape = (context, pool_cfg.num_kv_heads, pool_cfg.head_dim)

    def rows(seq):
        kk, kv_ = jax.random.split(jax.random.fold_in(key, seq))
        return jax.random.normal(kk, shape), jax.random.normal(kv_, shape)

    k, v = jax.vmap(rows)(first_seq + jnp.arange(num_seqs))  # f32[B, context, Nkv, D]
    positions = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (num_seqs, context))
    block, slot = row_address(cache, positions)
    latent = pool_cfg.value_dim is not None  # MLA: one latent row per token, no V buffer
    rows_ = (k.reshape(-1, *shape[1:]), None if latent else v.reshape(-1, *shape[1:]))
    pool = write_rows(cache.pool, block.reshape(-1), slot.reshape(-1), *rows_)
    cache = dataclasses.replace(cache, pool=pool, seq_len=jnp.full((num_seqs,), context, jnp.int32))
    keys = jnp.arange(cache.max_rows_per_seq, dtype=jnp.int32)
    keys = jnp.broadcast_to(jnp.where(keys < context, keys, -1), (num_seqs, keys.shape[0]))
    # Held tokens are 0, as is the anchor token of make_pairs: the anchor row is held, not redone.
    return dataclasses.replace(state, kv=(cache,), row_keys=(keys,))


@functools.partial(jax.jit, static_argnames=("cfg", "k", "batch", "context"))
def make_pairs(key, cfg: DrafterConfig, *, k: int, batch: int, context: int) -> drafter.Pairs:
    """A verify-wide window (K+1 pairs) whose one valid pair is the anchor at ``context - 1``."""
    kt, kh = jax.random.split(key)
    T = k + 1
    tokens = jax.random.randint(kt, (batch, T), 0, cfg.vocab_size, jnp.int32)
    return drafter.Pairs(
        tokens=tokens.at[:, 0].set(0),  # the token filled_state holds at the anchor's key
        hidden=jax.random.normal(kh, (batch, T, cfg.hidden_size), jnp.bfloat16),
        count=jnp.ones((batch,), jnp.int32),
        start=jnp.full((batch,), context - 1, jnp.int32),
    )


@functools.partial(jax.jit, static_argnums=1)
def normal_f32(key, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32)


@jax.jit
def _row_to_block(w: Fp8RowWeight) -> Weight:
    """An FP8 per-row weight ([..., N, K]; stacked experts one at a time) requantised to FP8
    block-128."""

    def one(w):
        return quantize(dequantize(w), WeightFormat.FP8_BLOCK)

    return one(w) if len(w.shape) == 2 else jax.lax.map(one, w)


def init_drafter(cfg: DrafterConfig, key, precision: str):
    """Random drafter weights at ``precision``; ``fp8_block`` (DeepSeek's stored format) draws
    them at FP8 per-row and requantises every FP8 projection to block-128."""
    if precision != "fp8_block":
        return drafter.init(cfg, key=key, precision=precision)
    params = drafter.init(cfg, key=key, precision="fp8")
    return jax.tree.map(
        lambda w: _row_to_block(w) if isinstance(w, Fp8RowWeight) else w,
        params,
        is_leaf=lambda x: isinstance(x, Weight),
    )


def pool_precision(precision: str) -> str:
    """The KV pool rule's input for a drafter precision (FP8 block-128 keeps a BF16 pool)."""
    return "fp8" if precision == "fp8_block" else precision


@functools.partial(jax.jit, static_argnums=1)
def held_rows(cache, length: int):
    """Each sequence's first ``length`` rows, dequantised: f32[B, length, Nkv, D] twice."""
    k, v, _ = gather(cache, length)
    return k, v


_HOST_OPS = re.compile(r"\s(send|recv|send-done|recv-done|infeed|outfeed)\(")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_HOST_TARGET = re.compile(r"callback|host|annotate_device_placement", re.IGNORECASE)


_COPY = re.compile(r"= \S+ copy(?:-start)?\(")


def scan_hlo(text: str) -> dict:
    """Host transfers in compiled HLO text, the custom calls it makes, and its copies (each a
    launch of its own on a GPU)."""
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
        copies=len(_COPY.findall(text)),
    )


def memory_analysis(compiled) -> dict | None:
    """The compiler's argument, output, aliased and temporary bytes (None where unavailable)."""
    fields = ("argument", "output", "alias", "temp")
    try:
        ma = compiled.memory_analysis()
        return {f"{f}_size_in_bytes": int(getattr(ma, f"{f}_size_in_bytes")) for f in fields}
    except Exception:
        return None


def pool_bytes(pool_cfg, num_seqs: int) -> int:
    """Bytes of the KV pool of a ``num_seqs``-sequence state."""
    return harness.tree_bytes(
        jax.eval_shape(lambda: drafter.init_state(pool_cfg, num_seqs=num_seqs)).kv[0].pool
    )


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
    """One executable to build: a jitted function and its (abstract) arguments."""

    key: tuple
    fn: object
    args: tuple
    compiled: object = None
    compile_s: float = 0.0
    error: str | None = None


def compile_jobs(jobs: list[Job], *, workers: int, options: dict | None, desc: str) -> None:
    """Lowers each job here, then compiles them in a thread pool (XLA releases the GIL)."""
    lowered = {}
    for job in jobs:
        try:
            lowered[job.key] = job.fn.lower(*job.args)
        except Exception as e:
            job.error = f"lowering: {type(e).__name__}: {str(e)[:800]}"

    def build(job: Job) -> None:
        t0 = time.perf_counter()
        try:
            job.compiled = lowered[job.key].compile(compiler_options=options)
        except Exception as e:
            job.error = f"compile: {type(e).__name__}: {str(e)[:800]}"
        job.compile_s = time.perf_counter() - t0

    todo = [j for j in jobs if j.key in lowered]
    bar = tqdm(total=len(todo), desc=desc, leave=False)
    with bar, cf.ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
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
        self.gpu = harness.on_gpu()
        self.meta = harness.run_info(
            "benchmarks.propose",
            args.argv,
            devices=[str(d) for d in jax.devices()],
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
            notes=[],
        )
        self.key = jax.random.key(args.seed, impl=prng_impl(args.smoke))
        self.pool10x_done: set = set()
        self.torch = self.torch_ref = None
        self.torch_times: dict[tuple, dict] = {}

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
        self.meta.update(elapsed_s=self.elapsed(), skipped=self.skipped)
        harness.write_records(self.a.json, self.records, self.meta)

    def setup(self) -> None:
        if not self.a.skip_torch:
            try:
                import torch

                from benchmarks import torch_reference

                self.torch, self.torch_ref = torch, torch_reference
                self.meta["torch"] = torch.__version__
            except Exception as e:  # torch is optional
                self.meta["torch"] = None
                self.meta["notes"].append(f"PyTorch baseline not run: {type(e).__name__}: {e}")
        bw = harness.copy_bandwidth(smoke=self.a.smoke)
        self.bw_gbps = self.meta["copy_gbps"] = bw["gbps"]
        self.emit(dict(kind="copy_bandwidth", **bw))
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
        params = init_drafter(cfg, jax.random.fold_in(key, 1), dprec)
        head = init_lm_head(head_cfg, key=jax.random.fold_in(key, 2), precision=hprec)
        _sync((params, head))
        init_s = time.perf_counter() - t_init
        kmax = max(a.ks)
        pool_cfg = functools.partial(
            drafter.pool_config,
            cfg,
            precision=pool_precision(dprec),
            max_seq_len=a.context + kmax + 1,
        )
        pool_cfgs = {(b, f): pool_cfg(max_seqs=b * f) for b in a.batches for f in (1, 10)}
        kv_dtype = pool_cfgs[(a.batches[0], 1)].kv_dtype
        points = grid_points(a.ks, a.batches, a.grid)
        kc, bc = center(a.ks), center(a.batches)
        base = dict(head=head_name, precision=prec, drafter_precision=dprec)
        base.update(head_precision=hprec, kv_dtype=kv_dtype.value, context=a.context)
        plan = dict(kind="memory_plan", **base, drafter_weight_bytes=harness.tree_bytes(params))
        plan.update(
            lm_head_bytes=head.weight.nbytes, embedding_bytes=harness.tree_bytes(head.embedding)
        )
        plan["kv_pool_bytes"] = {str(b): pool_bytes(pool_cfgs[(b, 1)], b) for b in a.batches}
        plan["kv_pool_10x_bytes_at_center_batch"] = pool_bytes(pool_cfgs[(bc, 10)], bc)
        self.emit(dict(plan, device_memory=device_memory(), init_s=init_s))
        parallel = first_of_head and head_name in PARALLEL_HEADS
        if a.parallel_only:
            if parallel:
                self.parallel_section(cfg, params, head, base)
            return

        # Executables: propose (auto; xla at the baseline K), verify, the 10x pool.
        def eff(impl: str) -> str:
            return impl if self.gpu else "xla"  # off-GPU "auto" is the XLA path

        def state_abs(b: int, f: int = 1):
            fill = functools.partial(filled_state, pool_cfg=pool_cfgs[(b, f)], num_seqs=b)
            return jax.eval_shape(functools.partial(fill, context=a.context), key)

        def pairs_abs(k: int, b: int):
            make = functools.partial(make_pairs, cfg=cfg, k=k, batch=b, context=a.context)
            return jax.eval_shape(make, key)

        jobs: dict[tuple, Job] = {}
        drafts_abs: dict[tuple, object] = {}

        def want(kind: str, impl: str, k: int, b: int, *, factor: int = 1):
            jk = (kind, eff(impl), k, b, factor)
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
            jobs[jk] = Job(key=jk, fn=fn, args=args)
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
        extra = {}
        if (head_name, kv_dtype) not in self.pool10x_done:  # once per head and KV dtype
            self.pool10x_done.add((head_name, kv_dtype))
            extra["pool10x"] = want("propose", "auto", kc, bc, factor=10)
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
                self.torch_section(cfg, params, head, pool_cfgs, base, points)
        if first_of_head and head_name == a.heads[0]:
            if jax.device_count() < 2:
                self.meta["notes"].append("two-GPU section not run: one device")
            elif a.skip_two_gpu:
                self.meta["notes"].append("two-GPU section not run: --skip-two-gpu")
            elif self.over_budget():
                self.skip("two-GPU section", f"over the {a.budget_s:.0f} s budget")
            else:
                self.two_gpu_section(cfg, head_cfg, params, head, pool_cfgs, base, jobs, kc)
        if parallel:
            self.parallel_section(cfg, params, head, base)

    def state_key(self, b: int) -> jax.Array:
        """The key of the KV rows of every B-sequence state: the same rows at any pool size."""
        return jax.random.fold_in(self.key, 1000 + b)

    def seeded_state(self, pool_cfg, b: int) -> DrafterState:
        """B sequences holding ``--context`` rows, as every timing loop of batch B starts."""
        key = self.state_key(b)
        return filled_state(key, pool_cfg=pool_cfg, num_seqs=b, context=self.a.context)

    def seeded_pairs(self, cfg, k: int, b: int) -> drafter.Pairs:
        """The propose window of every (K, B) timing loop."""
        key = jax.random.fold_in(self.key, 2000 + 10 * b + k)
        return make_pairs(key, cfg, k=k, batch=b, context=self.a.context)

    def rounds(self, propose_c, verify_c, params, head, state, pairs, th, **kw) -> dict:
        a = self.a
        kw.update(iters=a.iters, warmup=a.warmup, context=a.context)
        return time_rounds(propose_c, verify_c, params, head, state, pairs, th, **kw)

    def point(self, cfg, head_cfg, params, head, pool_cfgs, base, jobs, plan, k, b) -> None:
        a = self.a
        rec = dict(kind="propose", **base, k=k, batch=b, impl="auto", iters=a.iters)
        job = jobs[plan["propose"]]
        if job.compiled is None:
            self.emit(dict(rec, error=job.error))
            return
        rec.update(compile_s=job.compile_s, hlo=scan_hlo(job.compiled.as_text()))
        ok, msg = fits_in_memory(job.compiled, harness.tree_bytes(job.args[2]))
        rec.update(memory=memory_analysis(job.compiled), memory_check=msg)
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
        rec.update(drafter_bytes_per_draft=d["total"], drafter_bytes_parts=d)
        rec.update(head_bytes_per_draft=head_bytes, weight_bytes=k * (d["total"] + head_bytes))
        rec.update(kv_bytes=kv_bytes, bytes=total, roofline_us=roof)
        rec["logits_bytes"] = k * b * head_cfg.draft_rows * 4 * 2  # written and read, not counted

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
            res = self.rounds(pj.compiled, vj.compiled, params, head, state, pairs, th)
            prefix = "" if impl == "auto" else "xla_"
            if impl == "auto":  # the same executable back to back: what the device itself takes
                # time_rounds consumed (donated) the state above.
                fresh = self.seeded_state(pool_cfgs[(b, 1)], b)
                rec["pipelined_us"] = time_pipelined(
                    pj.compiled, params, head, fresh, pairs, smoke=a.smoke
                )
                del fresh
                rec["pipelined_per_draft_us"] = rec["pipelined_us"] / k
            rec.update({prefix + f: res["propose"][f] for f in ("time_us", "p10_us", "p90_us")})
            rec[f"{prefix}per_draft_us"] = res["propose"]["time_us"] / k
            rec[f"{prefix}verify_us"] = res["verify"]["time_us"]
            rec.update({prefix + f: res[f] for f in ("context_kept", "kv_errors")})
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
        rec.update(verify_rows=b * (k + 1), verify_bytes=vbytes)
        rec["verify_logits_bytes"] = b * (k + 1) * head_cfg.vocab_size * 4 * 2
        rec["verify_roofline_us"] = vbytes / (self.bw_gbps * 1e3)
        if "verify_us" in rec:
            rec["verify_roofline_ratio"] = rec["verify_us"] / rec["verify_roofline_us"]
        trec = self.torch_times.get((base["head"], k, b))
        if trec is not None:
            _set_torch_fields(rec, trec)
        self.emit(rec)

    def pool10x(self, cfg, params, head, pool_cfgs, base, jobs, jk, k, b) -> None:
        """Propose with a KV pool 10x larger, same context: donation makes the update in place,
        so the time must not grow with the pool. Proposing again without a verify drops the
        previous chain rows itself, so the context stays put between calls."""
        job = jobs[jk]
        rec = dict(kind="pool_10x", **base, k=k, batch=b, impl="auto")
        if job.compiled is None:
            self.emit(dict(rec, error=job.error))
            return
        ok, msg = fits_in_memory(job.compiled, harness.tree_bytes(job.args[2]))
        if not ok:
            self.skip(f"{base['head']} 10x pool", msg)
            return
        pairs = self.seeded_pairs(cfg, k, b)
        state = self.seeded_state(pool_cfgs[(b, 10)], b)
        res = self.rounds(job.compiled, None, params, head, state, pairs, None)
        big, small = harness.tree_bytes(job.args[2].kv[0].pool), pool_bytes(pool_cfgs[(b, 1)], b)
        rec.update(pool_bytes=big, pool_1x_bytes=small)
        # The compiler's own account: a pool-sized copy or conversion shows up as temporaries
        # that grow with the pool.
        one = jobs.get(("propose", "auto" if self.gpu else "xla", k, b, 1))
        m10 = memory_analysis(job.compiled)
        m1 = memory_analysis(one.compiled) if one is not None and one.compiled else None
        if m1 and m10:
            growth = m10["temp_size_in_bytes"] - m1["temp_size_in_bytes"]
            rec.update(
                temp_bytes_1x=m1["temp_size_in_bytes"], temp_bytes_10x=m10["temp_size_in_bytes"]
            )
            rec["in_place"] = bool(
                growth < 0.5 * (big - small) and m10["alias_size_in_bytes"] >= big
            )
        rec.update({f: res["propose"][f] for f in ("time_us", "p10_us", "p90_us")})
        rec.update(
            context_kept=res["context_kept"], memory=m10, hlo=scan_hlo(job.compiled.as_text())
        )
        del state
        # The same executable's pool, timed by the same loop.
        if one is not None and one.compiled is not None:
            state = self.seeded_state(pool_cfgs[(b, 1)], b)
            res1 = self.rounds(one.compiled, None, params, head, state, pairs, None)
            rec["pool_1x_time_us"] = res1["propose"]["time_us"]
            rec["ratio_10x_over_1x"] = rec["time_us"] / rec["pool_1x_time_us"]
            del state
        self.emit(rec)

    # -- PyTorch --------------------------------------------------------------------------------

    def torch_section(self, cfg, params, head, pool_cfgs, base, points) -> None:
        """PyTorch BF16 eager and CUDA-graph times of the same drafter step (weights
        dequantised, so the same at every precision: timed at the head's first precision)."""
        torch, ref, a = self.torch, self.torch_ref, self.a
        if cfg.mla is not None:
            self.meta["notes"].append(f"no PyTorch baseline for {base['head']}: MLA has none")
            return
        dev = "cuda" if self.gpu and torch.cuda.is_available() else "cpu"
        if self.gpu and dev == "cpu":
            self.meta["notes"].append("torch has no CUDA device here: PyTorch baseline on CPU")
        try:
            w16 = ref.weights_from_jax(params, head, cfg, dtype=torch.bfloat16).to(dev)
        except Exception as e:
            self.skip(f"torch timing {base['head']}", f"{type(e).__name__}: {e}")
            return
        model = ref.TorchDrafter(w16, ref.Dims.from_config(cfg))
        for k, b in tqdm(points, desc=f"torch {base['head']}", leave=False):
            rec = dict(kind="torch", **base, k=k, batch=b, torch_dtype="bfloat16", device=dev)
            try:
                state, pairs = self.seeded_state(pool_cfgs[(b, 1)], b), self.seeded_pairs(cfg, k, b)
                kk, vv = jax.block_until_ready(held_rows(state.kv[0], a.context))
                del state
                kc, vc = ref.kv_cache_from_rows(
                    ref.to_torch(kk, torch.float32).to(dev),
                    ref.to_torch(vv, torch.float32).to(dev),
                    capacity=a.context + k,
                    dtype=torch.bfloat16,
                )
                tok = torch.from_numpy(np.array(pairs.tokens[:, 0], np.int64)).to(dev)
                hid = torch.from_numpy(np.array(pairs.hidden[:, 0].astype(jnp.float32)))
                hid = hid.to(dev, torch.bfloat16)
                anchor = torch.full((b,), a.context - 1, dtype=torch.long, device=dev)
                base_len = torch.full((b,), a.context, dtype=torch.long, device=dev)
                length = base_len.clone()

                def run(m=model, t=tok, h=hid, a0=anchor, kc=kc, vc=vc, n=length, b0=base_len, k=k):
                    n.copy_(b0)
                    return m.propose(t, h, a0, kc, vc, n, num_drafts=k)

                with torch.no_grad():
                    rec["eager"] = _time_torch(torch, run, dev, a.iters, a.warmup)
                    rec["cuda_graph"] = (
                        _time_cuda_graph(torch, run, a.iters, a.warmup)
                        if dev == "cuda"
                        else dict(error="no CUDA device")
                    )
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
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
        one = jax.jit(lambda h, x: jnp.argmax(lm_head(h, x, cfg=head_cfg, draft=True), -1))
        two = jax.jit(
            lambda sh, x: sharded_lm_head(sh, x, cfg=head_cfg, draft=True, with_logits=False).token
        )
        for b in a.batches if sharded is not None else ():
            rec = dict(kind="sharded_lm_head", **base, batch=b, devices=2)
            try:
                x = normal_f32(jax.random.fold_in(key, 4000 + b), (b, cfg.hidden_size))
                x2 = jax.device_put(x, NamedSharding(mesh, P()))
                c1, c2 = _compile(one, (head, x), opts), _compile(two, (sharded, x2), opts)
                kw = dict(iters=a.iters, warmup=a.warmup)
                t1 = harness.time_synced(functools.partial(c1, head, x), **kw)["time_us"]
                t2 = harness.time_synced(functools.partial(c2, sharded, x2), **kw)["time_us"]
                same = np.array_equal(np.asarray(c1(head, x)), np.asarray(c2(sharded, x2)))
                rec.update(one_gpu_us=t1, two_gpu_us=t2, speedup=t1 / t2, tokens_match=bool(same))
                rec.update(head_bytes=head.weight.nbytes, hlo=scan_hlo(c2.as_text()))
                rec["roofline_one_gpu_us"] = head.weight.nbytes / (self.bw_gbps * 1e3)
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
                half_cfg = drafter.pool_config(
                    cfg, precision=base["drafter_precision"], max_seqs=half,
                    max_seq_len=a.context + max(a.ks) + 1,
                )  # fmt: skip
                f = functools.partial(
                    filled_state, pool_cfg=half_cfg, num_seqs=half, context=a.context
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
                res = self.rounds(c, None, params2, head2, states, pairs, None, sharded=True)
                t2 = res["propose"]["time_us"]
                rec.update(two_gpu_us=t2, per_draft_us=t2 / k, context_kept=res["context_kept"])
                rec["hlo"] = scan_hlo(c.as_text())
                del states
                # One GPU, all B sequences, timed by the same loop (no verify in between).
                one = jobs.get(("propose", "auto" if self.gpu else "xla", k, b, 1))
                if one is not None and one.compiled is not None:
                    state = self.seeded_state(pool_cfgs[(b, 1)], b)
                    pairs1 = self.seeded_pairs(cfg, k, b)
                    res1 = self.rounds(one.compiled, None, params, head, state, pairs1, None)
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

    # -- tensor / expert parallel ---------------------------------------------------------------

    def parallel_section(self, cfg, params, head, base) -> None:
        """Propose with the drafter sharded over 1, 2, 4 devices (``drafter.shard_drafter``):
        attention and FFN tensor-parallel, the MoE's experts split over the devices
        (``split="experts"``) or each expert's width (``"width"``), the vocab-parallel LM head,
        the KV pool by KV head (MLA: replicated). Every size runs ``implementation="xla"``:
        jit propagates the shardings through XLA's own ops, while a Pallas kernel is a custom
        call it would feed whole (gathered) operands. Per point: the speed-up over one device,
        the per-device bytes (each leaf's shard, the experts B rows touch split n ways, the KV
        rows a device holds) over the copy bandwidth, and whether the drafts match."""
        a = self.a
        if jax.device_count() < 2:
            self.meta["notes"].append("tensor-parallel section not run: one device")
            return
        if a.skip_parallel:
            self.meta["notes"].append("tensor-parallel section not run: --skip-parallel")
            return
        if self.over_budget():
            self.skip(f"tensor-parallel {base['head']}", f"over the {a.budget_s:.0f} s budget")
            return
        sizes = sorted({1, *(n for n in a.tp_sizes if n <= jax.device_count())})
        splits = ("experts", "width") if cfg.ffn is FfnKind.MOE else ("tp",)
        points = [(k, b) for k in a.parallel_ks for b in a.parallel_batches]
        pool = functools.partial(
            drafter.pool_config,
            cfg,
            precision=pool_precision(base["drafter_precision"]),
            max_seq_len=a.context + max(a.parallel_ks) + 1,
        )
        pool_cfgs = {b: pool(max_seqs=b) for b in a.parallel_batches}
        kv_dtype = pool_cfgs[a.parallel_batches[0]].kv_dtype
        opts = SMOKE_COMPILER_OPTIONS if a.smoke else None
        # The meshes the head splits over: whole heads and experts per device.
        meshes = [(1, None, None, None)]
        for split in splits:
            expert_axis = None if split == "width" else "tp"
            for n in sizes[1:]:
                mesh = jax.make_mesh(
                    (n,), ("tp",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,)
                )
                try:
                    shardings = drafter.drafter_shardings(
                        params, head, None, mesh, cfg=cfg, expert_axis=expert_axis
                    )
                except ValueError as e:
                    self.meta["notes"].append(f"{base['head']} not sharded {n} ways: {e}")
                    continue
                meshes.append((n, split, mesh, shardings))
        if len(meshes) == 1:
            return
        one: dict[tuple, dict] = {}  # (K, B) -> the one-device record
        for n, split, mesh, shardings in meshes:
            if self.over_budget():
                self.skip(f"tensor-parallel {base['head']} n={n}", "over the budget")
                continue
            expert_axis = None if split == "width" else "tp"
            p, h = params, head
            if mesh is not None:
                p, h, _ = drafter.shard_drafter(
                    params, head, None, mesh, cfg=cfg, expert_axis=expert_axis
                )
            jobs = {}
            for k, b in points:
                fill = functools.partial(
                    filled_state, pool_cfg=pool_cfgs[b], num_seqs=b, context=a.context
                )
                st = jax.eval_shape(fill, self.key)
                pr = jax.eval_shape(
                    functools.partial(make_pairs, cfg=cfg, k=k, batch=b, context=a.context),
                    self.key,
                )
                if mesh is not None:
                    st_sh = drafter.drafter_shardings(
                        params, head, st, mesh, cfg=cfg, expert_axis=expert_axis
                    )[2]
                    st = jax.tree.map(_with_sharding, st, st_sh)
                    pr = jax.tree.map(
                        lambda x, m=mesh: _with_sharding(x, NamedSharding(m, P())), pr
                    )
                args = (*jax.tree.map(_abstract, (p, h)), st, pr)
                jobs[(k, b)] = Job(key=(n, split, k, b), fn=propose_fn(cfg, k, "xla"), args=args)
            compile_jobs(
                list(jobs.values()), workers=a.compile_workers, options=opts,
                desc=f"compile {base['head']} tp={n} {split or ''}",
            )  # fmt: skip
            for (k, b), job in jobs.items():
                rec = dict(kind="parallel_propose", **base, k=k, batch=b, devices=n)
                rec.update(split=split, impl="xla", iters=a.iters)
                if job.compiled is None:
                    self.emit(dict(rec, error=job.error))
                    continue
                try:
                    self.parallel_point(rec, cfg, p, h, job, shardings, pool_cfgs[b], kv_dtype)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
                if n == 1:
                    one[(k, b)] = rec
                elif (k, b) in one and "time_us" in rec and "time_us" in one[(k, b)]:
                    base1 = one[(k, b)]
                    rec["one_device_us"] = base1["time_us"]
                    rec["speedup"] = base1["time_us"] / rec["time_us"]
                    rec["pipelined_speedup"] = base1["pipelined_us"] / rec["pipelined_us"]
                    rec["draft_agreement"] = float(
                        np.mean(np.asarray(base1["drafts"]) == np.asarray(rec["drafts"]))
                    )
                self.emit(rec)
            del p, h, jobs
            gc.collect()

    def parallel_point(self, rec, cfg, params, head, job, shardings, pool_cfg, kv_dtype) -> None:
        """Times one (devices, split, K, B) point into ``rec``."""
        a, k, b = self.a, rec["k"], rec["batch"]

        def placed(tree, abstract):  # where the executable takes it (one device: as made)
            if shardings is None:
                return tree
            return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, abstract))

        state = placed(self.seeded_state(pool_cfg, b), job.args[2])
        pairs = placed(self.seeded_pairs(cfg, k, b), job.args[3])
        res = self.rounds(job.compiled, None, params, head, state, pairs, None)
        fresh = placed(self.seeded_state(pool_cfg, b), job.args[2])
        rec["pipelined_us"] = time_pipelined(
            job.compiled, params, head, fresh, pairs, smoke=a.smoke
        )
        del fresh, state
        d = parallel_bytes(
            params, head, cfg, shardings, k=k, batch=b, kv_dtype=kv_dtype, context=a.context
        )
        roof = d["total"] / (self.bw_gbps * 1e3)
        rec.update({f: res["propose"][f] for f in ("time_us", "p10_us", "p90_us")})
        rec.update(per_draft_us=rec["time_us"] / k, per_device_bytes=d["total"])
        rec.update(per_device_bytes_parts=d, per_device_roofline_us=roof)
        rec.update(roofline_ratio=rec["time_us"] / roof)
        rec["pipelined_roofline_ratio"] = rec["pipelined_us"] / roof
        rec.update(context_kept=res["context_kept"], kv_errors=res["kv_errors"])
        rec["drafts"] = res["tokens"].tolist()
        text = job.compiled.as_text()
        rec["hlo"] = scan_hlo(text)
        rec["collectives"] = dict(Counter(_COLLECTIVE.findall(text)))
        rec["collective_bytes"] = collective_bytes(text)


# ---------------------------------------------------------------------------------------------
# Jitted step wrappers and the timing loop.
# ---------------------------------------------------------------------------------------------


def propose_fn(cfg, k: int, impl: str):
    """``propose`` with its static arguments bound, jitted as the library jits it (the state's
    bulk donated, ``mtpjax.kv.donation``)."""

    def propose(p, h, state, x):
        return drafter.propose(p, h, state, x, cfg=cfg, num_drafts=k, implementation=impl)

    return donation.step()(propose)


def verify_fn(head_cfg, impl: str):
    """``verify`` (greedy, ``refeed=True``) with its static arguments bound, jitted as the
    library jits it."""

    def verify_(h, state, th, d):
        return verify(h, state, th, d, cfg=head_cfg, refeed=True, implementation=impl)

    return donation.step()(verify_)


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


def _abstract(x):
    """An array's shape, dtype and placement, for lowering."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _with_sharding(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


_COLLECTIVE_OPS = "all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
_COLLECTIVE = re.compile(rf"\s({_COLLECTIVE_OPS})\(")
_COLLECTIVE_TYPES = re.compile(rf"=\s*(.*?)\s(?:{_COLLECTIVE_OPS})\(")
_ARRAY_TYPE = re.compile(r"\b([a-z]+)(\d*)[a-z0-9]*\[([\d,]*)\]")


def collective_bytes(text: str) -> int:
    """Bytes the compiled program's collectives return, summed over their ops (each op once,
    however often it runs): a weight gathered or all-reduced shows up as megabytes where the
    activations' reductions are kilobytes."""
    total = 0
    for types in _COLLECTIVE_TYPES.findall(text):
        for kind, bits, dims in _ARRAY_TYPE.findall(types):
            width = 1 if kind == "pred" or not bits else max(1, int(bits) // 8)
            total += width * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _local_fraction(tree, shardings) -> float:
    """The share of ``tree``'s bytes one device holds under ``shardings`` (same structure)."""
    leaves = jax.tree.leaves(tree)
    if shardings is None or not leaves:
        return 1.0
    shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    total = sum(x.nbytes for x in leaves)
    local = sum(
        x.nbytes * math.prod(s.shard_shape(x.shape)) / max(1, math.prod(x.shape))
        for x, s in zip(leaves, shs, strict=True)
    )
    return local / total


def parallel_bytes(params, head, cfg, shardings, *, k, batch, kv_dtype, context) -> dict:
    """The least one device of a sharded propose must read (the bytes model of
    ``drafter_bytes_per_draft``, each part scaled by the share of it a device holds;
    ``shardings`` from ``drafter.drafter_shardings``, None on one device): the experts B rows
    touch are split n ways whether the experts or their widths are; the KV rows by KV head
    (MLA's latent rows are replicated, read whole on every device)."""
    d = drafter_bytes_per_draft(params, cfg, batch)
    p_sh, h_sh = (None, None) if shardings is None else shardings[:2]
    layer, lsh = params.layer, None if p_sh is None else p_sh.layer

    def frac(attr, sub=None):
        tree = getattr(layer, attr) if sub is None else getattr(getattr(layer, attr), sub)
        if lsh is None:
            return 1.0
        sh = getattr(lsh, attr) if sub is None else getattr(getattr(lsh, attr), sub)
        return _local_fraction(tree, sh)

    scale = dict(attention=frac("attention"))
    if cfg.ffn is FfnKind.DENSE:
        scale["ffn"] = frac("ffn")
    else:
        scale.update(experts=frac("ffn", "experts"), router=frac("ffn", "router"))
        if layer.ffn.shared_expert is not None:
            scale["shared_expert"] = frac("ffn", "shared_expert")
    parts = {
        key: round(v * scale.get(key, 1.0))
        for key, v in d.items()
        if key not in ("total", "experts_touched")
    }
    head_share = 1.0 if h_sh is None else _local_fraction(head.weight, h_sh.weight)
    parts["lm_head"] = round(head.weight.nbytes * head_share)
    n = 1 if shardings is None else max(s.num_devices for s in jax.tree.leaves(
        p_sh, is_leaf=lambda x: isinstance(x, NamedSharding)))  # fmt: skip
    kv = kv_attended_bytes(cfg, kv_dtype, k=k, batch=batch, context=context)
    parts["kv"] = kv if cfg.mla is not None else kv // n
    per_draft = sum(v for key, v in parts.items() if key != "kv")
    parts["total"] = int(k * per_draft + parts["kv"])
    return parts


def time_rounds(
    propose_c, verify_c, params, head, state, pairs, target_hidden, *, iters, warmup, context,
    sharded: bool = False,
) -> dict:  # fmt: skip
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
    seq_len, errors = np.asarray(state.kv[0].seq_len), np.asarray(state.error)
    # Without a verify the last call's K - 1 chain rows are still held (the next propose would
    # drop them itself).
    held = context if verify_c is not None else context + k - 1
    return dict(
        propose=harness.stats(tp),
        verify=harness.stats(tv) if verify_c is not None else None,
        tokens=tokens.reshape(-1, k),
        context_kept=bool(np.all(seq_len == held)),
        kv_errors=int(np.count_nonzero(errors)),
    )


def time_pipelined(propose_c, params, head, state, pairs, *, smoke: bool) -> float:
    """µs per propose queued back to back (:func:`benchmarks.harness.time_queued`): the host's
    dispatch overlaps the device's work, so this is the device's own time per call. Each call
    drops the K - 1 chain rows the previous one held, so the context stays the same."""
    holder = [state]

    def call():
        out, holder[0] = propose_c(params, head, holder[0], pairs)
        return out, holder[0]

    _sync(call())
    return harness.time_queued(call, **(harness.SMOKE_CALLS if smoke else {}))


# ---------------------------------------------------------------------------------------------
# PyTorch timing.
# ---------------------------------------------------------------------------------------------


def _time_torch(torch, run, dev: str, iters: int, warmup: int) -> dict:
    """:func:`benchmarks.harness.stats` of synchronous calls of ``run``."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for _ in range(warmup):
        run()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        sync()
        ts.append((time.perf_counter() - t0) * 1e6)
    return harness.stats(ts)


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


# ---------------------------------------------------------------------------------------------
# Report: table and plot.
# ---------------------------------------------------------------------------------------------


def _fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


#: The table's columns: (title, record field, format, width).
COLUMNS = (
    ("propose", "time_us", ".0f", 9), ("/draft", "per_draft_us", ".0f", 8),
    ("roof", "roofline_us", ".0f", 8), ("ratio", "roofline_ratio", ".2f", 6),
    ("piped", "pipelined_roofline_ratio", ".2f", 6), ("xla", "xla_time_us", ".0f", 9),
    ("torch", "torch_eager_us", ".0f", 9), ("graph", "torch_cuda_graph_us", ".0f", 9),
    ("verify", "verify_us", ".0f", 8), ("v.ratio", "verify_roofline_ratio", ".2f", 7),
)  # fmt: skip


def table(records: list[dict]) -> str:
    rows = [r for r in records if r.get("kind") == "propose"]
    head = f"{'head':6} {'precision':15} {'K':>2} {'B':>3} "
    head += " ".join(f"{t:>{w}}" for t, _, _, w in COLUMNS)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{_fmt(r.get(f), spec):>{w}}" for _, f, spec, w in COLUMNS)
        error = f"  ERROR {r['error'][:60]}" if r.get("error") else ""
        lines.append(
            f"{r['head']:6} {r['precision']:15} {r['k']:>2} {r['batch']:>3} {cells}{error}"
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
        elif kind == "parallel_propose" and "time_us" in r:
            split = "" if r["split"] in (None, "tp") else f" ({r['split']} split)"
            extra.append(
                f"tensor-parallel propose {r['head']}/{r['precision']} K={r['k']} B={r['batch']} "
                f"on {r['devices']}{split}: {r['time_us']:.0f} µs (x{_fmt(r.get('speedup'), '.2f')}"
                f" over 1), {r['roofline_ratio']:.2f}x its per-device roofline, back to back "
                f"{r['pipelined_roofline_ratio']:.2f}x; drafts agree "
                f"{_fmt(r.get('draft_agreement'), '.2f')}"
            )
    hlo = [r for r in rows if "hlo" in r]
    if hlo:
        clean = sum(r["hlo"]["host_transfer_free"] for r in hlo)
        extra.append(f"compiled propose HLO free of host transfers: {clean}/{len(hlo)}")
    return "\n".join(lines + extra)


def plot(records: list[dict], path: Path, *, k: int, context: int) -> None:
    """Propose latency per draft against B at ``k`` drafts, one panel per head: each precision
    synchronous, queued back to back, through XLA and its roofline; PyTorch when timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("kind") == "propose" and r["k"] == k and "time_us" in r]
    heads = list(dict.fromkeys(r["head"] for r in rows))
    if not heads:
        return
    fig, axes = plt.subplots(1, len(heads), figsize=(6.0 * len(heads) + 2.6, 4.8), squeeze=False)
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    colors = dict(zip(PRECISIONS, palette, strict=True))
    series = (  # (field, style, label suffix, alpha)
        ("per_draft_us", "o-", "", 1.0),
        ("roofline_per_draft_us", "_--", " roofline", 1.0),
        ("pipelined_per_draft_us", "^-.", " back to back", 0.6),
        ("xla_per_draft_us", "s:", " xla", 0.7),
        ("torch_eager_per_draft_us", "x", " PyTorch bf16 eager", 1.0),
        ("torch_cuda_graph_per_draft_us", "+", " PyTorch bf16 CUDA graph", 1.0),
    )
    for ax, h in zip(axes[0], heads, strict=True):
        for prec, color in colors.items():
            pts = sorted(
                (r for r in rows if (r["head"], r["precision"]) == (h, prec)),
                key=lambda r: r["batch"],
            )
            for field, style, suffix, alpha in series:
                roof = field == "roofline_per_draft_us"
                xy = [
                    (r["batch"], r["roofline_us"] / k if roof else r[field])
                    for r in pts
                    if roof or field in r
                ]
                if xy:
                    torch_ = field.startswith("torch")
                    label = suffix.strip() if torch_ else f"{prec}{suffix}"
                    c = "k" if torch_ else color
                    ax.plot(*zip(*xy, strict=True), style, color=c, alpha=alpha, label=label)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="batch B (sequences)")
        ax.set(ylabel="propose latency per draft (µs)", title=f"{h} head, K={k}, context {context}")
        ax.grid(True, which="both", alpha=0.3)
    # One legend for all panels, outside them: the series are the same in each.
    handles = {}
    for ax in axes[0]:
        for hnd, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, hnd)
    axes[0][-1].legend(
        list(handles.values()),
        list(handles),
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.02, 1),
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
    add = p.add_argument
    add("--json", type=Path, default=harness.REPO / "benchmarks/results/propose_h200.json")
    add("--plot", type=Path, default=None, help="default: the JSON path as .png")
    add("--heads", type=_names(HEADS), default=list(DEFAULT_HEADS),
        help="default dense,moe (deepseek runs when named)")  # fmt: skip
    add("--precisions", type=_names(tuple(PRECISIONS)), default=list(DEFAULT_PRECISIONS),
        help="in run order (default nvfp4,bf16-nvfp4head,fp8)")  # fmt: skip
    add("--ks", type=_ints, default=None, help="drafts K (default 1,3,5)")
    add("--batches", type=_ints, default=None, help="batches B (default 1,8,64)")
    add("--grid", choices=("star", "full"), default="star")
    add("--context", type=int, default=None, help="KV rows per sequence (4096)")
    add("--iters", type=int, default=None, help="timed calls per point (20)")
    add("--warmup", type=int, default=None, help="untimed calls first (3)")
    add("--budget-s", type=float, default=None,
        help="start no block after this many seconds (default 390; none for smoke)")  # fmt: skip
    add("--compile-workers", type=int, default=None,
        help="executables compiled at once (default 8 on GPU, 1 on CPU)")  # fmt: skip
    add("--compile-cache", type=Path, default=None,
        help="JAX persistent compilation cache directory: a second run on a warm machine "
        "skips the compiles (off by default)")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--smoke", action="store_true", help="tiny shapes on the CPU, seconds")
    add("--skip-torch", action="store_true", help="no PyTorch baseline")
    add("--torch-compile", action="store_true", help="also time torch.compile")
    add("--skip-two-gpu", action="store_true", help="no two-device section")
    add("--skip-parallel", action="store_true", help="no tensor/expert-parallel section")
    add("--parallel-only", action="store_true",
        help="run only the tensor/expert-parallel section (heads dense and deepseek)")  # fmt: skip
    add("--tp-sizes", type=_ints, default=None,
        help="devices of the tensor-parallel section (default 1,2,4; those present)")  # fmt: skip
    add("--parallel-ks", type=_ints, default=None, help="its drafts K (default 1,3)")
    add("--parallel-batches", type=_ints, default=None, help="its batches B (default 1,8)")
    add("--merge", type=Path, nargs="+", default=None, metavar="JSON",
        help="run nothing: print the table of these result files together and write their "
        "plot (--plot, default the first file's .png)")  # fmt: skip
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    args.ks = args.ks or _ints(defaults["ks"])
    args.batches = args.batches or _ints(defaults["batches"])
    pdefaults = SMOKE_PARALLEL_DEFAULTS if args.smoke else PARALLEL_DEFAULTS
    args.tp_sizes = args.tp_sizes or _ints(pdefaults["sizes"])
    args.parallel_ks = args.parallel_ks or _ints(pdefaults["ks"])
    args.parallel_batches = args.parallel_batches or _ints(pdefaults["batches"])
    for name in ("context", "iters", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.context < 2:
        p.error("--context must be at least 2")
    if args.budget_s is None and not args.smoke:
        args.budget_s = 390.0
    if args.compile_workers is None:
        args.compile_workers = min(8, os.cpu_count() or 1) if harness.on_gpu() else 1
    if args.plot is None:
        args.plot = (args.merge[0] if args.merge else args.json).with_suffix(".png")
    return args


def merge(paths: list[Path], plot_path: Path, *, k: int, context: int) -> list[dict]:
    """Records of several result files (e.g. a block re-run apart) as one table and plot."""
    records = []
    for path in paths:
        try:
            records += harness.read_records(path)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{path}: not a benchmarks.propose result file ({e})") from None
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
        f"benchmarks.propose: {jax.default_backend()} x{jax.device_count()}, heads {args.heads}, "
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
