"""Speculative generation against plain decoding, tokens per second, at a Qwen3.5-27B-like
dense target on the GPU; acceptance forced to given rates; exactness; XLA command buffers.

    python -m benchmarks.generate --json $OUT/generate_h200.json
    python -m benchmarks.generate --sections cmdbuf --json $OUT/generate_cmdbuf_h200.json
    python -m benchmarks.generate --sections profile --json $OUT/generate_profile_h200.json
    python -m benchmarks.generate --check-exact --json $OUT/generate_exact_h200.json

Each run starts no new block past ``--budget-s`` (450 s) and records what it skipped.

The target is the reference full-attention target (``mtpjax.reference_target``) with random
weights at the dense 27B shapes: hidden 5120, 24 query and 4 KV heads of 256 (gated), partial
RoPE 0.25, FFN 17408, vocab 248320, ``--layers`` layers (64 by default: the layers are one
``lax.scan``, so the compile does not grow with them; the time per token does), BF16 weights and
BF16 x BF16 matmuls, its LM head BF16 or NVFP4 (``--heads``); with ``--target hybrid`` it is the
hybrid target (``mtpjax.hybrid.target_model``) at Qwen3.5-27B's shapes instead: groups of three
Gated DeltaNet layers (16 key / 48 value heads of 128) and one such full-attention layer, its
state keeping K + 1 GDN snapshots for the speculative steps and one for plain decoding. The
drafter is ``benchmarks.propose``'s dense head in BF16 reading the same LM head. Each batch B
runs B random prompts of ``--prompt-len`` tokens for ``--new-tokens`` new tokens.

**Synthetic acceptance.** With random weights no draft is ever accepted, so the speculative loop
here is ``generate``'s own start and round (``mtpjax.generation``) with its verify step replaced
by :func:`forced_verify`: the same LM head over the B(K+1) verify rows, the drafter's trim and the
metrics, but draft j accepted with probability ``r_j`` given drafts 1..j-1 were (``--rates``,
e.g. the published Qwen3.5 coding rates 0.80,0.62,0.50,0.40), drawn from a fixed key, so every
run commits the same tokens. Its mean acceptance length (MAL) estimates ``1 + sum_j prod_{i<=j}
r_i``. Rates are a traced argument: one compile per (head, B, K) serves every rate set.

Sections (``--sections``), each in a child process with a share of ``--budget-s``:

* ``speed``: per head precision, B and K (``--grid star``: every K at the first B, every B at the
  middle K; ``full``: every pair): tokens/s of the forced loop and of ``generate_baseline``
  (width 1), each from ``t(N new tokens) - t(1 new token)`` so the prefill drops out; the
  steps, queued back to back and synchronised one by one: t(plain step) (target step of one row,
  LM head, argmax), t(propose), t(verify step) (the target's K+1-row step and ``verify``); the
  ideal speed-up ``MAL * t(plain step) / (t(verify step) + t(propose))`` and the measured one.
  At the first B and middle K it also times ``mtpjax.generate`` itself against the forced loop at
  rates 0 (both then accept nothing): the forced loop costs what ``generate`` costs.
* ``cmdbuf``: at the first head, B, middle K and first rates, every timed executable compiled per
  ``COMMAND_BUFFERS`` variant through ``lower(...).compile(compiler_options=...)``: command
  buffers off, XLA's default set, and the default set plus WHILE (a whole while loop on the
  device, a CUDA graph conditional node) with no minimum region size. GPU only.
* ``profile``: kernels and host gaps per propose, per verify step and per round of the forced
  loop, from a ``jax.profiler`` trace (``benchmarks.profile``), command buffers off and on (the
  profiler disables them unless ``xla_enable_command_buffers_during_profiling``).
* ``exact`` (``--check-exact``): greedy ``generate`` against ``generate_baseline`` at width 1 and
  at width K+1 (the same shapes, equal by construction), ``--exact-batch`` prompts,
  ``--exact-tokens`` new tokens, every K, on the shipped pair and on the random target; at the
  first differing token of a sequence, the target's top-2 logit gap there (a full forward).

Records: ``kind`` = ``plain`` (per head, B), ``spec`` (per head, B, K, rates), ``generate_check``,
``cmdbuf``, ``profile``, ``exact``, ``copy_bandwidth``, ``skipped``; the JSON (default
``benchmarks/results/generate_h200.json``) and a plot of speed-up against MAL per B (measured and
ideal) next to it. ``--smoke`` runs tiny shapes on the CPU (checks the benchmark, not the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import mtpjax
from benchmarks import harness
from benchmarks import hybrid as bh
from benchmarks import propose as bp
from mtpjax import demo, hybrid, reference
from mtpjax import drafter as drafter_lib
from mtpjax import generation as gen
from mtpjax.checkpoint import convert, load_drafter
from mtpjax.config import DrafterConfig, HiddenContract
from mtpjax.head import init_lm_head, lm_head
from mtpjax.kv import donation
from mtpjax.verify import VerifyOutput, verify
from mtpjax.verify import metrics as metrics_lib

SECTIONS = ("speed", "cmdbuf", "profile", "exact")
TARGETS = ("reference", "hybrid")
HEADS = ("nvfp4", "bf16")  # the target's (and the drafter's) LM head; layers always BF16
RATE_SETS = {
    "coding": (0.80, 0.62, 0.50, 0.40),  # published Qwen3.5 per-position rates on code
    "low": (0.60, 0.35, 0.20, 0.10),
}
GPU_DEFAULTS = dict(
    layers=64, batches="1,8,32", ks="1,2,3,4", prompt_len=256, new_tokens=128, reps=2,
    exact_batch=8, exact_tokens=256, exact_prompt_len=64,
)  # fmt: skip
# The exact section's shapes are the speed section's: its programs are the same.
SMOKE_DEFAULTS = dict(
    layers=2, batches="4", ks="1,2", prompt_len=8, new_tokens=40, reps=3,
    exact_batch=4, exact_tokens=40, exact_prompt_len=8,
)  # fmt: skip

#: XLA's command buffers (CUDA graphs), chosen per executable as compile options: DebugOptions
#: fields, a repeated enum given as comma-separated names (an empty string clears it). XLA's
#: default set in this jaxlib (its log prints it per module) is FUSION, CUBLAS, CUBLASLT,
#: CUSTOM_CALL, CUDNN, CONDITIONAL and DYNAMIC_SLICE_FUSION over regions of at least 5 kernels;
#: a kernel is a FUSION command (Pallas Triton calls are kernels), a custom call a command only
#: when its FFI handler says it may be captured (Mosaic GPU's does). A while loop becomes one
#: graph node (its condition evaluated on the device, no host round trip per iteration) only with
#: WHILE and when every op of its body and condition can be captured; a loop-dependent dynamic
#: slice that XLA runs as a thunk of its own keeps it out (``mtpjax.indexed_scan`` says which).
DEFAULT_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,DYNAMIC_SLICE_FUSION"
COMMAND_BUFFERS = {
    "off": {"xla_gpu_enable_command_buffer": ""},
    "default": {},
    "loops": {
        "xla_gpu_enable_command_buffer": DEFAULT_COMMANDS + ",WHILE",
        "xla_gpu_graph_min_graph_size": 1,
    },
}
#: Under ``jax.profiler`` XLA runs command buffers op by op unless this is set.
PROFILE_WITH_COMMAND_BUFFERS = {"xla_enable_command_buffers_during_profiling": True}


def compiler_options(variant: str, *, gpu: bool, profiling: bool = False) -> dict | None:
    """The compile options of a ``COMMAND_BUFFERS`` variant: None off the GPU (they are GPU
    options) and for XLA's defaults; ``profiling`` keeps command buffers on under a trace."""
    if variant not in COMMAND_BUFFERS:
        raise ValueError(
            f"command-buffer variant {variant!r}: expected one of {list(COMMAND_BUFFERS)}"
        )
    options = dict(COMMAND_BUFFERS[variant])
    if profiling and variant != "off":
        options.update(PROFILE_WITH_COMMAND_BUFFERS)
    return options if gpu and options else None


def compile_all(
    jobs: list[bp.Job], *, variant: str, gpu: bool, workers: int, desc: str, profiling=False
) -> dict | None:
    """Compiles ``jobs`` (``benchmarks.propose.compile_jobs``) with the variant's options; returns
    the options used (None: XLA's defaults, or not a GPU)."""
    options = compiler_options(variant, gpu=gpu, profiling=profiling)
    bp.compile_jobs(jobs, workers=workers, options=options, desc=desc)
    return options


# ---------------------------------------------------------------------------------------------
# Configs and weights.
# ---------------------------------------------------------------------------------------------


def target_config(
    *, layers: int, smoke: bool, kind: str = "reference"
) -> reference.TargetConfig | hybrid.HybridConfig:
    """The ``kind`` target at the drafter's shapes (``benchmarks.propose.head_config``): the
    reference full-attention target, or the hybrid one in groups of GDN layers closed by a full
    attention layer ([G, G, G, F], Qwen3.5-27B's; [G, F] for --smoke), ``layers`` a multiple of
    the group."""
    d = bp.head_config("dense", smoke=smoke)
    if kind == "hybrid":
        group = 2 if smoke else 4
        if layers % group:
            raise ValueError(f"--layers of the hybrid target: a multiple of {group}, got {layers}")
        if smoke:
            return hybrid.HybridConfig.tiny(
                num_hidden_layers=layers, full_attention_interval=group,
                hidden_size=d.hidden_size, vocab_size=d.vocab_size,
                max_position_embeddings=d.max_position_embeddings, compute_dtype="bfloat16",
            )  # fmt: skip
        return bh.config_27b("GGGF" * (layers // group), smoke=False)
    return reference.TargetConfig(
        hidden_size=d.hidden_size, num_hidden_layers=layers,
        num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim, partial_rotary_factor=d.partial_rotary_factor,
        rope_theta=d.rope_theta, intermediate_size=d.intermediate_size, vocab_size=d.vocab_size,
        max_position_embeddings=d.max_position_embeddings, compute_dtype="bfloat16",
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("cfg",))
def init_target(cfg: reference.TargetConfig, key: jax.Array) -> reference.TargetParams:
    """``reference.init`` one layer at a time (``lax.map``): the same statistics (residual
    outputs scaled by 1/sqrt(2L)), with one layer's temporaries instead of the whole stack's
    (the random normals are F32 before the BF16 cast)."""
    one = dataclasses.replace(cfg, num_hidden_layers=1)
    scale = 1.0 / math.sqrt(cfg.num_hidden_layers)  # one layer's init scales by 1/sqrt(2)

    def layer(k):
        lp = reference.init(one, key=k).layers
        scaled = lambda w: dataclasses.replace(w, w=(w.w * scale).astype(w.w.dtype))  # noqa: E731
        attention = dataclasses.replace(lp.attention, o_proj=scaled(lp.attention.o_proj))
        ffn = dataclasses.replace(lp.ffn, down_proj=scaled(lp.ffn.down_proj))
        lp = dataclasses.replace(lp, attention=attention, ffn=ffn)
        return jax.tree.map(lambda x: x[0], lp)

    layers = jax.lax.map(layer, jax.random.split(key, cfg.num_hidden_layers))
    return reference.TargetParams(
        layers=layers, final_norm=jnp.zeros((cfg.hidden_size,), jnp.bfloat16)
    )


@dataclasses.dataclass
class Setup:
    """Random weights: one target layer stack and drafter, an LM head per precision."""

    tcfg: reference.TargetConfig | hybrid.HybridConfig
    dcfg: DrafterConfig
    layers: reference.TargetParams | hybrid.HybridParams
    drafter: drafter_lib.DrafterParams
    heads: dict

    @property
    def kind(self) -> str:
        return "hybrid" if isinstance(self.tcfg, hybrid.HybridConfig) else "reference"

    @property
    def head_cfg(self):
        return self.tcfg.lm_head_config()

    def target(self, prec: str, *, rows: int) -> gen.TargetModel:
        """The target with ``prec``'s head, for steps of up to ``rows`` rows (the hybrid's
        state keeps that many GDN snapshots, as ``generate`` sizes it: K + 1, or 1 plain)."""
        if self.kind == "hybrid":
            return hybrid.target_model(self.tcfg, self.layers, self.heads[prec], max_step=rows)
        return gen.reference_target(self.tcfg, self.layers, self.heads[prec])

    def forward(self, prec: str):
        """``tokens int[B, T] -> hidden [B, T, H]`` of the whole sequence (the exact section's
        top-2 gaps)."""
        head = self.heads[prec]
        if self.kind == "hybrid":
            return lambda seq: hybrid.forward(self.layers, head, seq, cfg=self.tcfg)[0]
        return functools.partial(reference.target_forward, self.layers, head, cfg=self.tcfg)


def build_setup(
    *, layers: int, heads, smoke: bool, seed: int = 0, kind: str = "reference"
) -> Setup:
    key = jax.random.key(seed)
    tcfg = target_config(layers=layers, smoke=smoke, kind=kind)
    dcfg = bp.head_config("dense", smoke=smoke)
    if kind == "hybrid":  # its own head is dropped: the heads below serve both kinds
        params = hybrid.init(tcfg, key=jax.random.fold_in(key, 1))[0]
    else:
        params = init_target(tcfg, jax.random.fold_in(key, 1))
    drafter = drafter_lib.init(dcfg, key=jax.random.fold_in(key, 2), precision="bf16")
    hk = jax.random.fold_in(key, 3)  # the same embedding values whatever the head's format
    lm = {p: init_lm_head(tcfg.lm_head_config(), key=hk, precision=p) for p in heads}
    jax.block_until_ready((params, drafter, lm))
    return Setup(tcfg=tcfg, dcfg=dcfg, layers=params, drafter=drafter, heads=lm)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """Full-length random prompts: (int32[B, T], int32[B] = T)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, length), dtype=np.int32)
    return jnp.asarray(ids), jnp.full((batch,), length, jnp.int32)


def mal_expected(rates) -> tuple[float, float]:
    """Mean and standard deviation of ``1 + accepted drafts`` when draft j is accepted with
    probability ``rates[j-1]`` given every earlier one was: ``P(a >= j) = prod_{i<=j} r_i``."""
    at_least = np.cumprod(np.asarray(rates, np.float64))  # P(a >= j), j = 1..K
    mean = float(at_least.sum())
    second = float(sum((2 * j + 1) * p for j, p in enumerate(at_least)))  # E[a^2]
    return 1.0 + mean, math.sqrt(max(second - mean**2, 0.0))


# ---------------------------------------------------------------------------------------------
# The forced-acceptance loop: generate's own start and round, the acceptance drawn.
# ---------------------------------------------------------------------------------------------


def forced_verify(
    head, state, target_hidden, drafts, *, cfg, temperature, key, refeed, metrics, active,
    implementation, rates,
):  # fmt: skip
    """``verify``'s work with the acceptance drawn instead of checked.

    The LM head over the B(K+1) verify rows and the argmax of each row (what greedy acceptance
    reads), then draft j (of the valid ones) accepted iff ``u_j < rates[j-1]`` and every earlier
    draft was, ``u`` uniform from ``key``; the token after the accepted prefix is the argmax of
    its row, as greedy verification emits it; the drafter's trim and the metrics as ``verify``.
    rates: f32[K]. Returns ``(VerifyOutput, state)``.
    """
    del temperature
    B, K = drafts.tokens.shape
    num_valid = jnp.where(active, drafts.num_valid, 0)
    logits = lm_head(
        head, target_hidden.reshape(B * (K + 1), -1), cfg=cfg, implementation=implementation
    )
    row_argmax = jnp.argmax(logits.reshape(B, K + 1, -1).astype(jnp.float32), axis=-1)
    j = jnp.arange(K, dtype=jnp.int32)[None, :]
    drawn = (jax.random.uniform(key, (B, K)) < rates[None, :]) & (j < num_valid[:, None])
    accepted = jnp.sum(jnp.cumprod(drawn.astype(jnp.int32), axis=1), axis=1)
    accepted = jnp.where(active, accepted, 0).astype(jnp.int32)
    final = jnp.take_along_axis(row_argmax.astype(jnp.int32), accepted[:, None], axis=1)
    slot = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    padded = jnp.pad(drafts.tokens, ((0, 0), (0, 1)), constant_values=-1)
    tokens = jnp.where(
        slot < accepted[:, None], padded, jnp.where(slot == accepted[:, None], final, -1)
    )
    _, state = drafter_lib.after_verify(state, accepted, refeed=refeed)
    out = VerifyOutput(
        num_accepted=accepted,
        output_tokens=jnp.where(active[:, None], tokens, -1),
        num_output=jnp.where(active, accepted + 1, 0),
        metrics=metrics_lib.update(metrics, accepted, num_valid),
    )
    return out, state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopResult:
    """tokens int32[B, N], lengths int32[B], metrics (K positions), rounds int32[], and the
    loop's last carry (its caches, drafter state and next window, for timing the steps)."""

    tokens: jax.Array
    lengths: jax.Array
    metrics: metrics_lib.SpecDecodeMetrics
    rounds: jax.Array
    carry: gen._Loop


def _loop_body(
    target, drafter, head, prompts, lengths, rates, limit, key, *, drafter_cfg, head_cfg,
    max_new_tokens, num_drafts, implementation,
):  # fmt: skip
    temperature = jnp.zeros((), jnp.float32)  # greedy: the first token and every target token
    loop = gen._start(
        target, drafter, head, head, prompts, lengths, temperature, key,
        drafter_cfg=drafter_cfg, head_cfg=head_cfg, max_new_tokens=max_new_tokens,
        step_width=num_drafts + 1, eos_id=None, implementation=implementation,
    )  # fmt: skip
    round_ = functools.partial(
        gen._spec_round, target=target, drafter=drafter, head=head, drafter_head=head,
        temperature=temperature, drafter_cfg=drafter_cfg, head_cfg=head_cfg, eos_id=None,
        hidden_contract=HiddenContract.POST_NORM, refeed=False, implementation=implementation,
        verify_step=functools.partial(forced_verify, rates=rates),
    )  # fmt: skip
    # generate's condition, plus a traced stop: every sequence has ``limit`` tokens.
    more = lambda c: jnp.any(~c.out.done & (c.out.num_generated < limit))  # noqa: E731
    loop = jax.lax.while_loop(more, round_, loop)
    return LoopResult(
        tokens=loop.out.tokens,
        lengths=loop.out.num_generated,
        metrics=loop.metrics,
        rounds=loop.steps,
        carry=loop,
    )


@functools.cache
def loop_fn(drafter_cfg, head_cfg, max_new_tokens: int, num_drafts: int, implementation: str):
    """The jitted forced loop ``(target, drafter, head, prompts, lengths, rates f32[K], limit,
    key) -> LoopResult``: ``generate(..., num_drafts=K, max_new_tokens=N)`` greedy with
    :func:`forced_verify` for ``verify``, stopping once every sequence has ``limit`` <= N
    tokens (``limit`` is traced: one program times N and 1 new token)."""
    body = functools.partial(
        _loop_body, drafter_cfg=drafter_cfg, head_cfg=head_cfg, max_new_tokens=max_new_tokens,
        num_drafts=num_drafts, implementation=implementation,
    )  # fmt: skip
    return jax.jit(body)


@functools.cache
def baseline_fn(head_cfg, max_new_tokens: int, implementation: str, step_width: int = 1):
    """``generate_baseline`` as one jitted ``(target, head, prompts, lengths)``."""
    return jax.jit(
        lambda target, head, prompts, lengths: mtpjax.generate_baseline(
            target, head, prompts, lengths, head_cfg=head_cfg, max_new_tokens=max_new_tokens,
            step_width=step_width, implementation=implementation,
        )
    )  # fmt: skip


@functools.cache
def generate_fn(drafter_cfg, head_cfg, max_new_tokens: int, num_drafts: int, implementation: str):
    """``generate`` (greedy) as one jitted ``(target, drafter, head, prompts, lengths)``."""
    return jax.jit(
        lambda target, drafter, head, prompts, lengths: mtpjax.generate(
            target, drafter, head, prompts, lengths, drafter_cfg=drafter_cfg, head_cfg=head_cfg,
            max_new_tokens=max_new_tokens, num_drafts=num_drafts, implementation=implementation,
        )
    )  # fmt: skip


def plain_step_fn(head_cfg, implementation: str):
    """One plain decode step as ``generate_baseline`` runs it: the target over one row, the LM
    head, argmax. ``(target, head, cache, tokens int32[B, 1], position) -> (token, cache)``;
    the cache is donated."""

    def step(target, head, cache, tokens, position):
        hidden, cache = target.step(target.params, cache, tokens, position)
        logits = lm_head(head, hidden[:, 0], cfg=head_cfg, implementation=implementation)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    return jax.jit(step, donate_argnums=(2,))


def verify_step_fn(head_cfg, implementation: str):
    """The target's K+1-row step and ``verify``, as a round runs them: ``(target, head, cache,
    state, window int32[B, K+1], position, drafts) -> (VerifyOutput, cache, state)``; the cache
    is donated, and the drafter state as ``verify`` donates it (``mtpjax.kv.donation``)."""

    def step(target, head, cache, state, window, position, drafts):
        hidden, cache = target.step(target.params, cache, window, position)
        out, state = verify(
            head, state, hidden, drafts, cfg=head_cfg, implementation=implementation
        )
        return out, cache, state

    return donation.step(donate_argnames=("cache",))(step)


# ---------------------------------------------------------------------------------------------
# Timers.
# ---------------------------------------------------------------------------------------------


def _wall(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t0, out


def time_limits(run, *, hi: int, reps: int, smoke: bool = False) -> tuple[float, object]:
    """``t(run(hi)) - t(run(1))`` in seconds (the prefill and the first token drop out), each the
    least of ``reps`` timed calls after one untimed call (the least is the call least disturbed
    by other work on the machine); and the last ``run(hi)`` output. Raises when the difference
    is not positive: the machine's noise was larger than the ``hi - 1`` tokens' time. A smoke
    run (tiny shapes on a busy CPU: it checks the plumbing, not the time) takes ``t(run(hi))``
    instead, which is never negative."""
    jax.block_until_ready(run(1))
    out = jax.block_until_ready(run(hi))
    t_hi, t_lo = [], []
    for _ in range(reps):
        t, out = _wall(lambda: run(hi))
        t_hi.append(t)
        t_lo.append(_wall(lambda: run(1))[0])
    dt = min(t_hi) - min(t_lo)
    if dt <= 0:
        if smoke:
            return min(t_hi), out
        raise RuntimeError(
            f"run({hi}) took {min(t_hi) * 1e3:.2f} ms, no longer than run(1) at "
            f"{min(t_lo) * 1e3:.2f} ms: timing noise; raise --reps or --new-tokens"
        )
    return dt, out


def time_threaded(call, *, smoke: bool) -> dict:
    """A call that threads donated state through a holder: µs per call queued back to back
    (``harness.time_queued``) and synchronised one by one."""
    jax.block_until_ready(call())
    queued = harness.time_queued(call, **(harness.SMOKE_CALLS if smoke else {}))
    synced = harness.time_synced(call, iters=1 if smoke else 5, warmup=0)["time_us"]
    return dict(queued_us=queued, synced_us=synced)


class Steps:
    """The propose and the verify step as a round runs them, on the loop's last carry ``c``
    (consumed: each call donates the state it threads). ``verify`` runs on the drafts of one more
    propose, made at its first call."""

    def __init__(self, c, propose_c, verify_c, target, drafter, head):
        self.c, self.propose_c, self.verify_c = c, propose_c, verify_c
        self.target, self.drafter, self.head = target, drafter, head
        self.state, self.cache, self.drafts = c.state, c.cache, None

    def propose(self):
        out, self.state = self.propose_c(self.drafter, self.head, self.state, self.c.pairs)
        return out, self.state

    def verify(self):
        if self.drafts is None:
            self.drafts = self.propose()[0]
            tokens = jnp.maximum(self.drafts.tokens, 0)
            self.window = jnp.concatenate([self.c.last[:, None], tokens], axis=1)
        out, self.cache, self.state = self.verify_c(
            self.target, self.head, self.cache, self.state, self.window, self.c.position,
            self.drafts,
        )  # fmt: skip
        return out, self.cache


def time_steps(steps: Steps, *, smoke: bool) -> dict:
    """t(propose), then t(verify step), queued and synchronised."""
    t_propose = time_threaded(steps.propose, smoke=smoke)
    t_verify = time_threaded(steps.verify, smoke=smoke)
    return {
        "t_propose_us": t_propose["queued_us"],
        "t_propose_synced_us": t_propose["synced_us"],
        "t_verify_us": t_verify["queued_us"],
        "t_verify_synced_us": t_verify["synced_us"],
    }


# ---------------------------------------------------------------------------------------------
# Bytes: the step rooflines.
# ---------------------------------------------------------------------------------------------


def target_step_bytes(setup: Setup, head, *, batch: int, rows: int, cache_rows: int) -> int:
    """The least one target step reads: every layer weight, the LM head weight, and the f32 K/V
    cache (the reference target attends over all ``cache_rows`` rows, masked); the hybrid's
    full-attention layers the same, its GDN layers their conv and recurrent states
    (``benchmarks.hybrid.step_bytes``)."""
    t = setup.tcfg
    if setup.kind == "hybrid":
        parts = bh.step_bytes(
            t, setup.layers, batch=batch, rows=rows, context=cache_rows, kv_itemsize=4
        )
        return parts["total"] + head.weight.nbytes
    kv = 2 * t.num_hidden_layers * batch * cache_rows * t.num_key_value_heads * t.head_dim * 4
    return (
        harness.tree_bytes(setup.layers)
        + head.weight.nbytes
        + kv
        + batch * rows * t.hidden_size * 2
    )


# ---------------------------------------------------------------------------------------------
# Child side: sections.
# ---------------------------------------------------------------------------------------------


def grid_points(ks: list[int], batches: list[int], grid: str) -> list[tuple[int, int]]:
    """(K, B) points. "star": every K at the first B, every B at the middle K; "full": all."""
    pts = [(k, b) for b in batches for k in ks]
    if grid == "star":
        kc = bp.center(ks)
        pts = [(k, b) for k, b in pts if b == batches[0] or k == kc]
    return pts


def _workers(child) -> int:
    return child.options.compile_workers


def _setup(child, heads) -> Setup:
    o = child.options
    setup = build_setup(layers=o.layers, heads=heads, smoke=child.smoke, seed=o.seed, kind=o.target)
    child.emit(
        dict(
            kind="setup", target=o.target, layers=o.layers, target_bytes=harness.tree_bytes(setup.layers),
            drafter_bytes=harness.tree_bytes(setup.drafter),
            head_bytes={p: setup.heads[p].weight.nbytes for p in heads},
            prompt_len=o.prompt_len, new_tokens=o.new_tokens,
        )
    )  # fmt: skip
    return setup


class Block:
    """The executables of one head precision and their inputs, built and compiled together."""

    def __init__(self, child, setup: Setup, prec: str, points, *, variant: str = "default"):
        o, impl = child.options, "auto"
        self.child, self.setup, self.prec, self.points, self.variant = (
            child,
            setup,
            prec,
            points,
            variant,
        )
        self.head = setup.heads[prec]
        self.N, self.T = o.new_tokens, o.prompt_len
        hc, dcfg = setup.head_cfg, setup.dcfg
        self.prompts = {
            b: random_prompts(b, self.T, hc.vocab_size, o.seed + b) for b in {b for _, b in points}
        }
        self.key = jax.random.key(o.seed + 7)
        kmax = max(k for k, _ in points)
        self.rates = {name: jnp.asarray(r[:kmax], jnp.float32) for name, r in o.rates}
        jobs: dict[tuple, bp.Job] = {}
        for b, (p, n) in self.prompts.items():
            for lim in (self.N, 1):
                jobs[("baseline", b, lim)] = bp.Job(
                    key=("baseline", b, lim), fn=baseline_fn(hc, lim, impl),
                    args=(self.target(1), self.head, p, n),
                )  # fmt: skip
            cache = jax.eval_shape(
                lambda b=b: self.target(1).init_cache(b, gen.cache_length(self.T, self.N, 1))
            )
            tok = jax.ShapeDtypeStruct((b, 1), jnp.int32)
            pos = jax.ShapeDtypeStruct((b,), jnp.int32)
            jobs[("plain_step", b)] = bp.Job(
                key=("plain_step", b), fn=plain_step_fn(hc, impl),
                args=(self.target(1), self.head, cache, tok, pos),
            )  # fmt: skip
        for k, b in points:
            p, n = self.prompts[b]
            loop = loop_fn(dcfg, hc, self.N, k, impl)
            largs = (
                self.target(k + 1),
                setup.drafter,
                self.head,
                p,
                n,
                self.rates_for(k, None),
                jnp.int32(self.N),
                self.key,
            )
            jobs[("loop", b, k)] = bp.Job(key=("loop", b, k), fn=loop, args=largs)
            c = jax.eval_shape(loop, *largs).carry
            propose = bp.propose_fn(dcfg, k, impl)
            pargs = (setup.drafter, self.head, c.state, c.pairs)
            jobs[("propose", b, k)] = bp.Job(key=("propose", b, k), fn=propose, args=pargs)
            drafts = jax.eval_shape(propose, *pargs)[0]
            window = jax.ShapeDtypeStruct((b, k + 1), jnp.int32)
            jobs[("verify", b, k)] = bp.Job(
                key=("verify", b, k), fn=verify_step_fn(hc, impl),
                args=(self.target(k + 1), self.head, c.cache, c.state, window, c.position,
                      drafts),
            )  # fmt: skip
        self.jobs = jobs

    def target(self, rows: int) -> gen.TargetModel:
        """The target for steps of ``rows`` rows: 1 plain, K + 1 speculative."""
        return self.setup.target(self.prec, rows=rows)

    def rates_for(self, k: int, name: str | None) -> jax.Array:
        """The first rate set's (or ``name``'s) first k rates."""
        name = name or next(iter(self.rates))
        return self.rates[name][:k]

    def add_generate(self, k: int, b: int) -> None:
        p, n = self.prompts[b]
        fn = generate_fn(self.setup.dcfg, self.setup.head_cfg, self.N, k, "auto")
        self.jobs[("generate", b, k)] = bp.Job(
            key=("generate", b, k),
            fn=fn,
            args=(self.target(k + 1), self.setup.drafter, self.head, p, n),
        )

    def compile(self) -> dict | None:
        child = self.child
        options = compile_all(
            list(self.jobs.values()), variant=self.variant, gpu=harness.on_gpu(),
            workers=_workers(child), desc=f"compile {self.prec} {self.variant} ({len(self.jobs)})",
        )  # fmt: skip
        for job in self.jobs.values():
            if job.error:
                child.emit(
                    dict(kind="compile_error", head=self.prec, job=str(job.key), error=job.error)
                )
        return options

    def ok(self, *keys) -> bool:
        return all(self.jobs.get(k) is not None and self.jobs[k].compiled is not None for k in keys)

    def base(self, **kw) -> dict:
        return dict(head=self.prec, variant=self.variant, target=self.setup.kind,
                    layers=self.setup.tcfg.num_hidden_layers, prompt_len=self.T,
                    new_tokens=self.N, **kw)  # fmt: skip

    # -- timing ------------------------------------------------------------------------------

    def plain(self, b: int) -> dict:
        """generate_baseline's tokens/s and t(plain step) at batch b."""
        child, smoke = self.child, self.child.smoke
        rec = self.base(kind="plain", batch=b)
        if not self.ok(("baseline", b, self.N), ("baseline", b, 1), ("plain_step", b)):
            return dict(rec, error="not compiled")
        p, n = self.prompts[b]
        runs = {lim: self.jobs[("baseline", b, lim)].compiled for lim in (self.N, 1)}
        target = self.target(1)
        dt, out = time_limits(
            lambda lim: runs[lim](target, self.head, p, n),
            hi=self.N, reps=child.options.reps, smoke=smoke,
        )  # fmt: skip
        tokens = b * (self.N - 1)
        rec.update(t_plain_loop_us=dt / (self.N - 1) * 1e6, tokens_per_s=tokens / dt)
        rec["steps"] = int(out.target_steps)
        rows = gen.cache_length(self.T, self.N, 1)
        t = time_threaded(self.plain_step_call(b), smoke=smoke)
        rec.update(t_plain_step_us=t["queued_us"], t_plain_step_synced_us=t["synced_us"])
        nbytes = target_step_bytes(self.setup, self.head, batch=b, rows=1, cache_rows=rows)
        rec.update(plain_step_bytes=nbytes)
        if getattr(child, "bw_gbps", None):
            rec["plain_step_roofline_us"] = nbytes / (child.bw_gbps * 1e3)
            rec["plain_step_roofline_ratio"] = (
                rec["t_plain_step_us"] / rec["plain_step_roofline_us"]
            )
        return rec

    def plain_step_call(self, b: int):
        """A call of the plain step that threads its donated cache (its contents do not change
        the time: the reference target attends over every row, masked)."""
        step_c = self.jobs[("plain_step", b)].compiled
        target = self.target(1)
        cache = [target.init_cache(b, gen.cache_length(self.T, self.N, 1))]
        tok = jnp.zeros((b, 1), jnp.int32)
        pos = jnp.full((b,), self.T + self.N // 2, jnp.int32)

        def call():
            token, cache[0] = step_c(target, self.head, cache[0], tok, pos)
            return token, cache[0]

        return call

    def loop_run(self, k: int, b: int, rates):
        """``limit -> LoopResult`` of the compiled forced loop at (k, b)."""
        p, n = self.prompts[b]
        loop_c = self.jobs[("loop", b, k)].compiled
        target = self.target(k + 1)

        def run(limit: int):
            drafter = self.setup.drafter
            return loop_c(target, drafter, self.head, p, n, rates, jnp.int32(limit), self.key)

        return run

    def steps(self, k: int, b: int, carry) -> Steps:
        propose_c, verify_c = (self.jobs[(s, b, k)].compiled for s in ("propose", "verify"))
        target = self.target(k + 1)
        return Steps(carry, propose_c, verify_c, target, self.setup.drafter, self.head)

    def spec(self, k: int, b: int, plain: dict) -> list[dict]:
        """The forced loop at every rate set, then the steps on its last carry."""
        child = self.child
        if not self.ok(("loop", b, k), ("propose", b, k), ("verify", b, k)):
            return [self.base(kind="spec", batch=b, k=k, error="not compiled")]
        recs, last = [], None
        for name in self.rates:
            if child.left() < 10:
                break
            rates = self.rates_for(k, name)
            dt, out = time_limits(
                self.loop_run(k, b, rates), hi=self.N, reps=child.options.reps, smoke=child.smoke
            )
            rec = self.base(kind="spec", batch=b, k=k, rates_name=name)
            rec.update(
                rates=[float(x) for x in np.asarray(rates)], **loop_stats(out, rates, self.N)
            )
            rec.update(t_loop_s=dt, t_round_loop_us=dt / max(int(out.rounds), 1) * 1e6,
                       tokens_per_s=b * (self.N - 1) / dt)  # fmt: skip
            recs.append(rec)
            last = out
        if last is None:
            return recs
        steps = time_steps(self.steps(k, b, last.carry), smoke=child.smoke)
        for rec in recs:
            rec.update(steps)
            derive_speedups(rec, plain)
        return recs

    def generate_check(self, k: int, b: int) -> dict:
        """``generate`` against the forced loop at rates 0 (neither accepts): same rounds, and
        the forced loop must cost what generate costs."""
        rec = self.base(kind="generate_check", batch=b, k=k)
        if not self.ok(("generate", b, k), ("loop", b, k)):
            return dict(rec, error="not compiled")
        p, n = self.prompts[b]
        gen_c = self.jobs[("generate", b, k)].compiled
        forced = self.loop_run(k, b, jnp.zeros((k,), jnp.float32))
        target = self.target(k + 1)
        runs = {
            "generate": lambda: gen_c(target, self.setup.drafter, self.head, p, n),
            "forced": lambda: forced(self.N),
        }
        times = {name: [] for name in runs}
        outs = {}
        for name, run in runs.items():
            outs[name] = jax.block_until_ready(run())
        for _ in range(max(1, self.child.options.reps)):
            for name, run in runs.items():
                times[name].append(_wall(run)[0])
        g, f = outs["generate"], outs["forced"]
        rec.update(
            t_generate_s=float(np.median(times["generate"])), t_forced_s=float(np.median(times["forced"])),
            rounds_generate=int(g.target_steps), rounds_forced=int(f.rounds),
            mal_generate=float(g.metrics.mean_acceptance_length()),
        )  # fmt: skip
        rec["forced_over_generate"] = rec["t_forced_s"] / rec["t_generate_s"]
        return rec


def loop_stats(out: LoopResult, rates, n: int) -> dict:
    """MAL and per-position acceptance measured, against what the rates give."""
    m = out.metrics
    mal = float(m.mean_acceptance_length())
    exp, sd = mal_expected(np.asarray(rates))
    samples = int(m.num_drafts)
    se = sd / math.sqrt(max(samples, 1))
    per_pos = m.acceptance_rate_per_pos()  # P(a >= j)
    conditional = per_pos / np.concatenate([[1.0], per_pos[:-1]])
    return dict(
        mal=mal, mal_expected=exp, mal_se=se, mal_z=(mal - exp) / se if se > 0 else 0.0,
        acceptance_per_pos=[float(x) for x in per_pos],
        acceptance_conditional=[float(x) for x in np.nan_to_num(conditional)],
        samples=samples, rounds=int(out.rounds),
        all_done=bool(np.all(np.asarray(out.lengths) == n)),
    )  # fmt: skip


def derive_speedups(rec: dict, plain: dict) -> dict:
    """The ideal speed-up ``MAL * t(plain step) / (t(verify step) + t(propose))`` (queued and
    synchronised times) and the measured one (tokens/s of the two loops)."""
    if "t_plain_step_us" in plain and "t_verify_us" in rec:
        for sfx in ("", "_synced"):
            step = rec[f"t_verify{sfx}_us"] + rec[f"t_propose{sfx}_us"]
            rec[f"ideal_speedup{sfx}"] = rec["mal"] * plain[f"t_plain_step{sfx}_us"] / step
        rec["t_plain_step_us"] = plain["t_plain_step_us"]
    if "tokens_per_s" in plain and "tokens_per_s" in rec:
        rec["plain_tokens_per_s"] = plain["tokens_per_s"]
        rec["t_plain_loop_us"] = plain["t_plain_loop_us"]
        rec["measured_speedup"] = rec["tokens_per_s"] / plain["tokens_per_s"]
        if "ideal_speedup" in rec:
            rec["measured_over_ideal"] = rec["measured_speedup"] / rec["ideal_speedup"]
    return rec


def _copy_bandwidth(child) -> None:
    bw = harness.copy_bandwidth(smoke=child.smoke)
    child.bw_gbps = bw["gbps"]
    child.emit(dict(kind="copy_bandwidth", **bw))


def section_speed(child) -> None:
    o = child.options
    _copy_bandwidth(child)
    setup = _setup(child, o.heads)
    points = grid_points(o.ks, o.batches, o.grid)
    kc, b0 = bp.center(o.ks), o.batches[0]
    for prec in o.heads:
        if child.left() < 30:
            child.emit(dict(kind="skipped", what=f"head {prec}", reason="over the budget"))
            continue
        block = Block(child, setup, prec, points)
        if (kc, b0) in points:
            block.add_generate(kc, b0)
        block.compile()
        for b in dict.fromkeys(b for _, b in points):
            if child.left() < 15:
                child.emit(dict(kind="skipped", what=f"{prec} B={b}", reason="over the budget"))
                continue
            plain = block.plain(b)
            child.emit(plain)
            for k, _ in [pt for pt in points if pt[1] == b]:
                if child.left() < 10:
                    child.emit(
                        dict(kind="skipped", what=f"{prec} B={b} K={k}", reason="over the budget")
                    )
                    continue
                for rec in block.spec(k, b, plain):
                    child.emit(rec)
            if b == b0 and ("generate", b0, kc) in block.jobs and child.left() > 10:
                child.emit(block.generate_check(kc, b0))


def section_cmdbuf(child) -> None:
    """Every timed executable at one point, per command-buffer variant."""
    o = child.options
    if not harness.on_gpu():
        child.emit(dict(kind="skipped", what="cmdbuf", reason="compiler options are GPU-only"))
        return
    _copy_bandwidth(child)
    prec, b, k = o.heads[0], o.batches[0], bp.center(o.ks)
    setup = _setup(child, [prec])
    for variant in COMMAND_BUFFERS:
        if child.left() < 30:
            child.emit(dict(kind="skipped", what=f"cmdbuf {variant}", reason="over the budget"))
            continue
        block = Block(child, setup, prec, [(k, b)], variant=variant)
        block.rates = dict(list(block.rates.items())[:1])
        options = block.compile()
        plain = block.plain(b)
        for rec in [plain, *block.spec(k, b, plain)]:
            rec.update(kind="cmdbuf", step=rec["kind"], compiler_options=options)
            rec["hlo_command_buffers"] = {
                str(key): job.compiled.as_text().count("command_buffer")
                for key, job in block.jobs.items()
                if job.compiled is not None
            }
            child.emit(rec)


def section_profile(child) -> None:
    """Kernels and host gaps per propose, verify step and loop round, per command-buffer
    variant (kept on under the trace)."""
    o = child.options
    prec, b, k = o.heads[0], o.batches[0], bp.center(o.ks)
    setup = _setup(child, [prec])
    for variant in COMMAND_BUFFERS if harness.on_gpu() else ("default",):
        if child.left() < 30:
            child.emit(dict(kind="skipped", what=f"profile {variant}", reason="over the budget"))
            continue
        child.emit(profile_point(child, Block(child, setup, prec, [(k, b)], variant=variant), k, b))


def profile_point(child, block: Block, k: int, b: int) -> dict:
    """One variant's profile: the forced loop at N and at 1 new token (their difference over
    the rounds is one round), then the propose and the verify step on its last carry."""
    from benchmarks import profile as bprof

    keys = [("loop", b, k), ("propose", b, k), ("verify", b, k)]
    jobs = [block.jobs[key] for key in keys]
    options = compile_all(
        jobs, variant=block.variant, gpu=harness.on_gpu(), workers=_workers(child),
        desc=f"profile {block.variant}", profiling=True,
    )  # fmt: skip
    rec = block.base(kind="profile", batch=b, k=k, compiler_options=options)
    if not block.ok(*keys):
        return dict(rec, error="; ".join(j.error or "" for j in jobs))
    run = block.loop_run(k, b, block.rates_for(k, None))
    full = jax.block_until_ready(run(block.N))
    calls = 1 if child.smoke else child.options.profile_calls
    prof = {lim: profile_calls(functools.partial(run, lim), calls, bprof) for lim in (block.N, 1)}
    rounds = max(int(full.rounds), 1)
    fields = ("wall_us", "busy_us", "gap_us", "kernels", "memcpys")
    rec.update(rounds=rounds, loop_full=prof[block.N], loop_prefill=prof[1])
    rec["round"] = {f: (prof[block.N][f] - prof[1][f]) / rounds for f in fields}
    steps = block.steps(k, b, full.carry)
    rec["propose"] = profile_calls(steps.propose, calls, bprof)
    rec["verify"] = profile_calls(steps.verify, calls, bprof)
    return rec


def profile_calls(call, calls: int, bprof) -> dict:
    """Per call of ``call`` under ``jax.profiler`` (``benchmarks.profile.trace_calls``): wall and
    device-busy µs, their gap, kernels and copies launched, and the top kernels."""
    wall, rows, busy = bprof.trace_calls(call, calls, warmup=2)
    copies = sum(r["launches_per_call"] for r in rows if "memcpy" in r["kernel"].lower())
    launches = sum(r["launches_per_call"] for r in rows)
    return dict(
        wall_us=wall,
        busy_us=busy,
        gap_us=wall - busy,
        kernels=launches - copies,
        memcpys=copies,
        top=rows[:25],
    )


# ---------------------------------------------------------------------------------------------
# Exactness.
# ---------------------------------------------------------------------------------------------


def text_prompts(tcfg, batch: int, length: int, seed: int) -> tuple[jax.Array, jax.Array, str]:
    """Windows of the shipped pair's held-out files (random ids where the tokenizer or the files
    are missing): (int32[B, T], lengths = T, the source)."""
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(demo.ASSET_DIR / "tokenizer.json"))
        rng = np.random.default_rng(seed)
        rows = []
        for path in demo.heldout_files():
            ids = tok.encode(path.read_text(encoding="utf-8")).ids
            if len(ids) > length:
                s = int(rng.integers(0, len(ids) - length))
                rows.append(ids[s : s + length])
            if len(rows) == batch:
                ids = np.asarray(rows, np.int32)
                return jnp.asarray(ids), jnp.full((batch,), length, jnp.int32), "heldout"
    except (ImportError, OSError):
        pass
    return (*random_prompts(batch, length, tcfg.vocab_size, seed), "random")


def check_exact(
    target, forward, drafter, head, tcfg, dcfg, prompts, lengths, *, ks, max_new_tokens, workers=1
) -> list[dict]:
    """Greedy ``generate`` at each K against ``generate_baseline`` at width 1 and at width K+1
    (every program compiled first, ``workers`` at once).

    Returns one record per K: ``match_width1``, ``match_same_width``, the first differing token
    per sequence (-1: none) against width 1, and the target's top-2 logit gap where each of
    those tokens is predicted, from a full forward over the prompt and the width-1 output (a
    small gap: the step shapes round a near tie differently, not a wrong token).
    """
    N = max_new_tokens
    jobs = exact_jobs(target, drafter, head, tcfg, dcfg, prompts, lengths, ks=ks, n=N)
    bp.compile_jobs(list(jobs.values()), workers=workers, options=None, desc="exact")

    def run(key):
        job = jobs[key]
        if job.compiled is None:
            raise RuntimeError(f"{key}: {job.error}")
        return jax.device_get(job.compiled(*job.args))

    width1 = run(("baseline", 1))
    gaps: dict[tuple[int, int], float] = {}  # (sequence, token) -> top-2 gap
    records = []
    for k in ks:
        spec, same = run(("generate", k)), run(("baseline", k + 1))
        first = first_difference(spec.tokens, width1.tokens)
        rec = dict(
            kind="exact", k=k, batch=int(prompts.shape[0]), new_tokens=N,
            match_width1=bool(np.array_equal(spec.tokens, width1.tokens)),
            match_same_width=bool(np.array_equal(spec.tokens, same.tokens)),
            width1_vs_same_width=bool(np.array_equal(width1.tokens, same.tokens)),
            first_difference_width1=first.tolist(),
            first_difference_same_width=first_difference(spec.tokens, same.tokens).tolist(),
            mal=float(spec.metrics.mean_acceptance_length()), rounds=int(spec.target_steps),
        )  # fmt: skip
        new = [(int(b), int(first[b])) for b in np.flatnonzero(first >= 0)]
        new = [bt for bt in new if bt not in gaps]
        if new:
            gaps.update(
                zip(new, top2_gaps(forward, head, tcfg, prompts, width1.tokens, new), strict=True)
            )
        rec["margin_at_first_difference"] = [
            gaps.get((b, int(f))) if f >= 0 else None for b, f in enumerate(first)
        ]
        records.append(rec)
    return records


def exact_jobs(target, drafter, head, tcfg, dcfg, prompts, lengths, *, ks, n) -> dict:
    """The exactness programs by name: ``("baseline", width)`` for widths 1 and K+1,
    ``("generate", K)``."""
    hc = tcfg.lm_head_config()
    base, spec = (target, head, prompts, lengths), (target, drafter, head, prompts, lengths)
    names = [("baseline", 1)] + [
        (s, w) for k in ks for s, w in (("generate", k), ("baseline", k + 1))
    ]
    return {
        (s, w): bp.Job(
            key=(s, w),
            fn=generate_fn(dcfg, hc, n, w, "auto")
            if s == "generate"
            else baseline_fn(hc, n, "auto", w),
            args=spec if s == "generate" else base,
        )
        for s, w in names
    }


def first_difference(a, b) -> np.ndarray:
    """int[B]: the first column where a and b [B, N] differ, -1 where they agree."""
    diff = np.asarray(a) != np.asarray(b)
    return np.where(diff.any(axis=1), diff.argmax(axis=1), -1)


def top2_gaps(forward, head, tcfg, prompts, tokens, where) -> list[float]:
    """The target's top-1 minus top-2 logit where token ``t`` of sequence ``b`` is predicted,
    for each ``(b, t)`` in ``where``, from one teacher-forced ``forward(seq) -> hidden f32[B', T',
    H]`` over the (full-length) prompts and ``tokens`` [B, N]."""
    T = prompts.shape[1]
    rows = jnp.asarray([b for b, _ in where])
    seq = jnp.concatenate([prompts, jnp.asarray(tokens)[:, :-1]], axis=1)[rows]
    hidden = forward(seq)
    h = hidden[jnp.arange(len(where)), jnp.asarray([T - 1 + t for _, t in where])]
    logits = lm_head(head, h, cfg=tcfg.lm_head_config()).astype(jnp.float32)
    top = jax.lax.top_k(logits, 2)[0]
    return [float(x) for x in np.asarray(top[:, 0] - top[:, 1])]


def shipped_pair(max_step: int):
    """The shipped pair: its hybrid target (GDN snapshots for ``max_step`` rows), the MTP head
    through the converter at BF16, and the target's teacher-forced forward."""
    tcfg = hybrid.HybridConfig.from_hf(demo.ASSET_DIR)
    params, head = hybrid.load(demo.ASSET_DIR, cfg=tcfg)
    with tempfile.TemporaryDirectory() as tmp:
        convert(demo.ASSET_DIR, Path(tmp) / "mtp", precision="bf16", progress=False)
        dcfg, ckpt = load_drafter(Path(tmp) / "mtp")
    target = hybrid.target_model(tcfg, params, head, max_step=max_step)
    forward = functools.partial(hybrid.forward, params, head, cfg=tcfg)
    return tcfg, target, head, dcfg, ckpt.modules[0], lambda seq: forward(seq)[0]


def section_exact(child) -> None:
    o = child.options
    for model in o.exact_models:
        if child.left() < 20:
            child.emit(dict(kind="skipped", what=f"exact {model}", reason="over the budget"))
            continue
        if model == "pair":
            tcfg, target, head, dcfg, drafter, forward = shipped_pair(max(o.ks) + 1)
            prompts, lengths, source = text_prompts(tcfg, o.exact_batch, o.exact_prompt_len, o.seed)
        else:
            setup = build_setup(
                layers=o.layers, heads=["bf16"], smoke=child.smoke, seed=o.seed, kind=o.target
            )
            tcfg, head, dcfg, drafter = setup.tcfg, setup.heads["bf16"], setup.dcfg, setup.drafter
            prompts, lengths = random_prompts(
                o.exact_batch, o.exact_prompt_len, tcfg.vocab_size, o.seed
            )
            source = "random"
            target = setup.target("bf16", rows=max(o.ks) + 1)
            forward = setup.forward("bf16")
        for rec in check_exact(
            target,
            forward,
            drafter,
            head,
            tcfg,
            dcfg,
            prompts,
            lengths,
            ks=o.ks,
            max_new_tokens=o.exact_tokens,
        ):
            child.emit(
                dict(
                    rec, model=model, target=exact_target(model, o.target),
                    prompts=source, layers=tcfg.num_hidden_layers,
                )
            )  # fmt: skip


SECTION_FNS = dict(
    speed=section_speed, cmdbuf=section_cmdbuf, profile=section_profile, exact=section_exact
)


# ---------------------------------------------------------------------------------------------
# Parent: table and plot.
# ---------------------------------------------------------------------------------------------


def _f(x, spec=".2f", w=8) -> str:
    return f"{'-':>{w}}" if x is None else f"{x:>{w}{spec}}"


def exact_target(model: str, random_target: str = "reference") -> str:
    """The target the exact section checks as ``model``: the shipped pair's is hybrid, the
    random model's is ``--target`` (records written before they named it: the reference)."""
    return "hybrid" if model == "pair" else random_target


def table(records: list[dict]) -> str:
    targets = sorted({r["target"] for r in records if r.get("kind") == "spec" and "target" in r})
    lines = [f"target: {', '.join(targets)}"] if targets else []
    lines += [
        f"{'head':6} {'B':>3} {'K':>2} {'rates':7} {'MAL':>6} {'exp':>6} {'plain':>8} "
        f"{'propose':>8} {'verify':>8} {'round':>8} {'ideal':>6} {'meas':>6} {'m/i':>5}"
    ]
    for r in records:
        if r.get("kind") == "spec" and "error" not in r:
            lines.append(
                f"{r['head']:6} {r['batch']:>3} {r['k']:>2} {r['rates_name']:7} {_f(r['mal'], '.2f', 6)} "
                f"{_f(r['mal_expected'], '.2f', 6)} {_f(r.get('t_plain_step_us'), '.0f')} "
                f"{_f(r.get('t_propose_us'), '.0f')} {_f(r.get('t_verify_us'), '.0f')} "
                f"{_f(r.get('t_round_loop_us'), '.0f')} {_f(r.get('ideal_speedup'), '.2f', 6)} "
                f"{_f(r.get('measured_speedup'), '.2f', 6)} {_f(r.get('measured_over_ideal'), '.2f', 5)}"
            )
    lines.append(
        "µs: plain = t(plain step), propose / verify = the steps queued back to back, round = the "
        "loop's time per round; ideal = MAL * plain / (verify + propose); meas = tokens/s of the "
        "forced loop over generate_baseline's"
    )
    for r in records:
        kind = r.get("kind")
        if kind == "plain" and "error" not in r:
            lines.append(
                f"plain {r['head']} B={r['batch']}: loop {r['t_plain_loop_us']:.0f} µs/token, "
                f"step {r['t_plain_step_us']:.0f} µs (synced {r['t_plain_step_synced_us']:.0f})"
            )
        elif kind == "generate_check" and "error" not in r:
            lines.append(
                f"generate vs forced loop at rates 0, {r['head']} B={r['batch']} K={r['k']}: "
                f"{r['t_generate_s']:.3f} s vs {r['t_forced_s']:.3f} s "
                f"(x{r['forced_over_generate']:.3f}), rounds {r['rounds_generate']} / {r['rounds_forced']}"
            )
        elif kind == "cmdbuf" and "error" not in r:
            what = r["step"]
            t = r.get("t_plain_step_us") if what == "plain" else r.get("t_round_loop_us")
            extra = (
                ""
                if what == "plain"
                else f" propose {_f(r.get('t_propose_us'), '.0f', 0)} verify {_f(r.get('t_verify_us'), '.0f', 0)}"
            )
            lines.append(
                f"cmdbuf {r['variant']:8} {what:6} tokens/s {r.get('tokens_per_s', 0):.1f}, "
                f"{'step' if what == 'plain' else 'round'} {_f(t, '.0f', 0)} µs{extra}"
            )
        elif kind == "profile" and "error" not in r:
            rd = r["round"]
            lines.append(
                f"profile {r['variant']:8} per round: {rd['kernels']:.0f} kernels, "
                f"{rd['memcpys']:.1f} copies, busy {rd['busy_us']:.0f} µs, gaps {rd['gap_us']:.0f} µs; "
                f"propose {r['propose']['kernels']:.0f} kernels gaps {r['propose']['gap_us']:.0f} µs; "
                f"verify {r['verify']['kernels']:.0f} kernels gaps {r['verify']['gap_us']:.0f} µs"
            )
        elif kind == "exact":
            lines.append(
                f"exact {r['model']} ({r.get('target') or exact_target(r['model'])}) K={r['k']}: width 1 {'PASS' if r['match_width1'] else 'FAIL'}, "
                f"width K+1 {'PASS' if r['match_same_width'] else 'FAIL'}, MAL {r['mal']:.2f}"
            )
        elif kind in ("skipped", "compile_error", "_section_error"):
            lines.append(
                f"{kind}: {r.get('what', r.get('job', r.get('section')))} {str(r.get('reason', r.get('error', '')))[-400:]}"
            )
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    """Speed-up against MAL, one panel per B: measured (filled) and ideal (hollow) per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("kind") == "spec" and "measured_speedup" in r]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.2), squeeze=False)
    colors = dict(zip(HEADS, ("tab:blue", "tab:orange"), strict=True))
    for ax, b in zip(axes[0], batches, strict=True):
        for r in (r for r in rows if r["batch"] == b):
            c = colors.get(r["head"], "k")
            ax.plot(r["mal"], r["measured_speedup"], "o", color=c)
            if "ideal_speedup" in r:
                ax.plot(r["mal"], r["ideal_speedup"], "o", mfc="none", color=c)
            ax.annotate(f"K={r['k']}", (r["mal"], r["measured_speedup"]), fontsize=7,
                        xytext=(3, -9), textcoords="offset points")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set(xlabel="mean acceptance length (measured)", ylabel="speed-up over plain decoding",
               title=f"B = {b}")  # fmt: skip
        ax.grid(alpha=0.3)
    handles = [
        plt.Line2D([], [], marker="o", ls="", color=c, label=f"{h} head, measured")
        for h, c in colors.items()
    ]
    handles += [
        plt.Line2D([], [], marker="o", ls="", mfc="none", color=c, label=f"{h} head, ideal")
        for h, c in colors.items()
    ]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left")
    fig.suptitle("speculative generate vs generate_baseline, forced acceptance", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------


def parse_rates(s: str) -> tuple[str, tuple[float, ...]]:
    """A named rate set (``RATE_SETS``) or comma-separated probabilities in [0, 1]."""
    if s in RATE_SETS:
        return s, RATE_SETS[s]
    try:
        rates = tuple(float(x) for x in s.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise argparse.ArgumentTypeError(
            f"--rates {s!r}: expected one of {', '.join(RATE_SETS)} or probabilities in [0, 1]"
        )
    return s, rates


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add = p.add_argument
    add("--json", type=Path, default=harness.REPO / "benchmarks/results/generate_h200.json")
    add("--plot", type=Path, default=None, help="default: the JSON path as .png")
    add("--from-json", type=Path, default=None, help="only print the table and plot of a JSON")
    add(
        "--sections", type=bp._names(SECTIONS), default=["speed"], help=f"from {','.join(SECTIONS)}"
    )
    add("--check-exact", action="store_true", help="the exact section alone (--sections exact)")
    add("--heads", type=bp._names(HEADS), default=None,
        help="LM head precisions, in run order (nvfp4,bf16; smoke bf16)")  # fmt: skip
    add("--target", choices=TARGETS, default="reference",
        help="the random target: full attention, or hybrid GDN groups [G, G, G, F]")  # fmt: skip
    add("--layers", type=int, default=None, help="target layers (64; smoke 2)")
    add("--batches", type=bp._ints, default=None, help="batches B (1,8,32)")
    add("--ks", type=bp._ints, default=None, help="drafts K (1,2,3,4)")
    add("--grid", choices=("star", "full"), default="star")
    add("--rates", type=parse_rates, action="append", default=None,
        help="per-position acceptance (repeatable): coding, low or r1,r2,..")  # fmt: skip
    add("--prompt-len", type=int, default=None, help="prompt tokens T (256)")
    add("--new-tokens", type=int, default=None, help="new tokens N per timed call (128)")
    add("--reps", type=int, default=None, help="timed (N, 1) pairs per loop (2)")
    add("--exact-batch", type=int, default=None, help="exact: prompts (8)")
    add("--exact-tokens", type=int, default=None, help="exact: new tokens (256)")
    add("--exact-prompt-len", type=int, default=None, help="exact: prompt tokens (64)")
    add("--exact-models", type=bp._names(("pair", "random")), default=["pair", "random"])
    add("--profile-calls", type=int, default=3)
    add("--compile-workers", type=int, default=None, help="default 8 on GPU, 1 on CPU")
    add("--budget-s", type=float, default=None, help="wall-clock budget (450; smoke 600)")
    add("--seed", type=int, default=0)
    add("--smoke", action="store_true", help="tiny shapes on the CPU")
    harness.add_child_args(p)
    args = p.parse_args(argv)
    if args.check_exact:
        args.sections = ["exact"]
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, bp._ints(value) if name in ("batches", "ks") else value)
    args.heads = args.heads or (["bf16"] if args.smoke else list(HEADS))
    args.rates = args.rates or list(RATE_SETS.items())
    short = [name for name, r in args.rates if len(r) < max(args.ks)]
    if short:
        p.error(f"--rates {short[0]} has fewer rates than the largest K ({max(args.ks)})")
    if args.budget_s is None:
        args.budget_s = 600.0 if args.smoke else 450.0
    if args.compile_workers is None:
        args.compile_workers = 1 if args.smoke else 8
    if args.plot is None:
        args.plot = (args.from_json or args.json).with_suffix(".png")
    return args


def child_argv(args: argparse.Namespace) -> list[str]:
    """The options a child needs, as command-line arguments."""
    out = ["--heads", ",".join(args.heads), "--layers", str(args.layers), "--grid", args.grid]
    out += ["--target", args.target]
    out += ["--batches", ",".join(map(str, args.batches)), "--ks", ",".join(map(str, args.ks))]
    for name, _ in args.rates:
        out += ["--rates", name]
    for flag in ("prompt_len", "new_tokens", "reps", "exact_batch", "exact_tokens",
                 "exact_prompt_len", "profile_calls", "compile_workers", "seed"):  # fmt: skip
        out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    out += ["--exact-models", ",".join(args.exact_models)] + ["--smoke"] * args.smoke
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return harness.child_main(args, SECTION_FNS)
    if args.from_json:
        records = harness.read_records(args.from_json)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            records = harness.run_sections(
                "benchmarks.generate", args.sections, budget_s=args.budget_s,
                extra=child_argv(args), workdir=tmp,
            )  # fmt: skip
        env = next((r for r in records if r.get("kernel") == "_env"), {})
        run = harness.run_info(
            "benchmarks.generate", argv, env=env, sections=args.sections, heads=args.heads,
            layers=args.layers, batches=args.batches, ks=args.ks, grid=args.grid,
            rates=dict(args.rates), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
            budget_s=args.budget_s, smoke=args.smoke,
        )  # fmt: skip
        harness.write_records(args.json, records, run)
    print(table(records))
    with contextlib.suppress(Exception):  # the plot is a convenience, never fatal
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
