"""The hybrid target (Gated DeltaNet + gated full attention) at real shapes on the GPU: the
verify step against one-row decoding, each layer's time against its bytes, where a GDN layer's
time goes, and a Qwen3.5-0.8B-shaped model's prefill and steps.

    python -m benchmarks.hybrid --json $OUT/hybrid_h200.json --compile-cache /tmp/jax_cache

All weights are random BF16 (``hybrid.init``), activations enter the projections in BF16
(``compute_dtype="bfloat16"``), the KV cache is BF16, and the GDN states F32 (the library's
layout). Each section runs in a child process with a share of ``--budget-s``
(``benchmarks.harness``); every executable of a section is compiled ahead of time, several at
once, and ``--compile-cache`` (a JAX persistent compilation cache) lets a second run skip them.

Sections (``--sections``):

* ``27b``: Qwen3.5-27B-like shapes at B = 1 and ``--context`` 4096: hidden 5120; full attention
  24 query / 4 KV heads of 256, partial RoPE 0.25; GDN 16 key / 48 value heads of 128, conv
  kernel 4; dense FFN 17408; vocab 248320. Three reduced models share one set of weights:
  ``mixed`` ([G, G, G, F] x 2, the verify against decode headline: two of the 64-layer model's
  16 groups, so that the scan over the groups stays a loop as it is there: XLA inlines a
  one-trip loop, and the state's updates would then compile unlike the real model's), ``GDN`` (its 6 GDN layers) and ``full`` (its 2
  full-attention layers). Each is stepped with 1 row and with k + 1 rows (``--drafts`` k = 3)
  from a state that keeps k + 1 GDN snapshots; ``mixed`` also with 1 row from a state that keeps
  one (what plain decoding allocates). Per layer, the bytes a step must move (``step_bytes``)
  over the device copy's bandwidth in the same process is the roofline. The LM head on 1 and
  k + 1 rows completes an estimate of the whole 64-layer target's verify over plain decode. Then the delta rule alone at the GDN shapes: the library's ``recurrent_delta_rule``
  and three variants written here (``one_pass``: every row reads its state once, q^T S and k^T S
  in one contraction of the old state; ``reduce``: the same as elementwise products and sums;
  ``unrolled``: the library's rule called row by row, one program), each timed, against its own
  roofline, and checked on the device: is a k+1-row call bitwise the same as k+1 one-row calls
  (the property greedy speculation's exactness needs)? Last, ``--profile`` points (``GDN/1``:
  model/rows) run under ``jax.profiler``; each kernel is attributed through the compiled HLO's
  stack frames to the source it came from (projections, FFN, the delta rule, the state writes,
  ...), so the table splits a GDN layer's time.
* ``0.8b``: a Qwen3.5-0.8B-shaped model at its 24 layers (hidden 1024; 8 query / 2 KV heads of
  256; GDN 16 key / 16 value heads of 128; FFN 3584; vocab 248320, tied embeddings): prefill
  over ``--prompts`` (512, 2048) tokens and steps of 1 and k + 1 rows at context 2048, each at
  ``--batches`` (1, 8), and the LM head on each step's rows.

Times are steady state (``benchmarks.harness.time_queued``: calls queued back to back, the
state donated from one to the next; a step repeated at the same start is the same work every
time); ``time_us_synced`` synchronises each call. ``--smoke`` runs tiny shapes on the CPU (it
checks the benchmark, not the speed). The table is printed last; ``--plot`` (default: the JSON
path as ``.png``) draws the per-layer times against their rooflines and the 0.8B steps and
prefill; ``--from-json`` re-derives, prints and plots a result file.
"""

from __future__ import annotations

import argparse
import functools
import linecache
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks import harness

SECTIONS = ("27b", "0.8b")
#: The reduced 27B-like models: name -> layer pattern (G: GDN, F: full attention).
MODELS_27B = {"mixed": "GGGF" * 2, "GDN": "G" * 6, "full": "FF"}
#: The same for --smoke: half the layers per group, half the compile time.
SMOKE_MODELS_27B = {"mixed": "GF" * 2, "GDN": "GG", "full": "FF"}
#: The layers of each kind in the 64-layer model (16 groups of [G, G, G, F]).
LAYERS_IN_64 = {"mixed": 64, "GDN": 48, "full": 16}
VARIANTS = ("library", "one_pass", "reduce", "unrolled")
GPU_DEFAULTS = dict(
    context=4096, small_context=2048, prompts="512,2048", batches="1,8",
    profile="GDN/1,GDN/4,full/4",
)  # fmt: skip
SMOKE_DEFAULTS = dict(context=24, small_context=16, prompts="8", batches="2", profile="GDN/4")

QWEN35_27B = dict(
    model_type="qwen3_5_text",
    hidden_size=5120,
    intermediate_size=17408,
    vocab_size=248320,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_parameters=dict(rope_theta=10_000_000.0, partial_rotary_factor=0.25),
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
)
#: Qwen/Qwen3.5-0.8B's text_config (its linear_* fields as published).
QWEN35_08B = dict(
    QWEN35_27B,
    hidden_size=1024,
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    tie_word_embeddings=True,
)


def _pattern_types(pattern: str) -> list[str]:
    return ["full_attention" if c == "F" else "linear_attention" for c in pattern]


def config_27b(pattern: str, *, smoke: bool):
    """The 27B-like config with the layers of ``pattern`` (``"GGGFGGGF"``), or a tiny one."""
    from mtpjax import hybrid

    if smoke:  # HybridConfig.tiny's shapes
        from mtpjax.config import FfnKind

        kinds = tuple(hybrid.LayerType(t) for t in _pattern_types(pattern))
        return hybrid.HybridConfig.tiny(
            num_hidden_layers=len(pattern),
            layer_types=kinds,
            ffn_kinds=(FfnKind.DENSE,) * len(pattern),
            compute_dtype="bfloat16",
        )
    raw = dict(QWEN35_27B, num_hidden_layers=len(pattern), layer_types=_pattern_types(pattern))
    return hybrid.HybridConfig.from_hf(raw, compute_dtype="bfloat16")


def config_08b(*, smoke: bool):
    """The Qwen3.5-0.8B-shaped config at 24 layers ([G, G, G, F] * 6), or a tiny one ([G, F]
    * 2: the group scan runs twice)."""
    from mtpjax import hybrid

    if smoke:
        return hybrid.HybridConfig.tiny(
            num_hidden_layers=4,
            full_attention_interval=2,
            tie_word_embeddings=True,
            compute_dtype="bfloat16",
        )
    raw = dict(QWEN35_08B, num_hidden_layers=24, layer_types=_pattern_types("GGGF" * 6))
    return hybrid.HybridConfig.from_hf(raw, compute_dtype="bfloat16")


# ---------------------------------------------------------------------------------------------
# The bytes model.
# ---------------------------------------------------------------------------------------------


def step_bytes(cfg, params, *, batch: int, rows: int, context: int, kv_itemsize: int = 2) -> dict:
    """The least a step of ``rows`` rows per sequence at ``context`` must move, by part.

    Weights: every layer's leaves once and the embedding rows gathered. GDN layers read the
    selected conv history (K-1 rows of C, F32) and recurrent snapshot (Hv x dk x dv, F32) and
    write the K-1+S conv window and S recurrent snapshots. Full-attention layers read the
    ``context + rows`` KV rows they attend and write ``rows`` rows. Activations ([B, S, H]) are
    left out: at these batches they are under 0.1% of the weights.
    """
    from mtpjax.hybrid import LayerType

    n_gdn = sum(t is LayerType.LINEAR_ATTENTION for t in cfg.layer_types)
    n_full = cfg.num_hidden_layers - n_gdn
    K, C, S = cfg.linear_conv_kernel_dim, cfg.conv_dim, rows
    snap = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * kv_itemsize
    parts = dict(
        weights=harness.tree_bytes(params) + batch * rows * cfg.hidden_size * 2,
        gdn_state_read=n_gdn * batch * ((K - 1) * C * 4 + snap),
        gdn_state_written=n_gdn * batch * ((K - 1 + S) * C * 4 + S * snap),
        kv_read=n_full * batch * (context + S) * kv_row,
        kv_written=n_full * batch * S * kv_row,
    )
    parts["total"] = sum(parts.values())
    return parts


def delta_rule_bytes(*, batch: int, rows: int, hv: int, dk: int, dv: int) -> int:
    """The delta rule's inputs (q, k, v, g, beta, the start state) read and its outputs (o and
    the state after each row) written, all F32."""
    B, S = batch, rows
    inputs = B * S * hv * (2 * dk + dv + 2) * 4 + B * hv * dk * dv * 4
    return inputs + B * S * hv * dv * 4 + S * B * hv * dk * dv * 4


# ---------------------------------------------------------------------------------------------
# Delta-rule variants (candidates for the library, timed against its rule).
# ---------------------------------------------------------------------------------------------


def _one_read_rule(contract, q, k, v, g, beta, state):
    """``recurrent_delta_rule`` reading each row's state once: with ``e = exp(g)``,
    ``k^T (e S) = e (k^T S)`` and ``q^T S' = e (q^T S) + (q . k) u``, so both contractions are
    one ``contract([k; q] [B, Hv, 2, dk], S [B, Hv, dk, dv]) -> [B, Hv, 2, dv]`` of the old
    state, and ``S' = e S + k u^T`` is one elementwise pass. Still a scan over the rows, as the
    library's: every row runs the same compiled body. Shapes as the library's."""
    import jax
    import jax.numpy as jnp

    def body(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        e = jnp.exp(g_t)[..., None]  # [B, Hv, 1]
        r = contract(jnp.stack([k_t, q_t], axis=-2), s)
        u = (v_t - e * r[..., 0, :]) * b_t[..., None]
        o = e * r[..., 1, :] + jnp.sum(q_t * k_t, axis=-1, keepdims=True) * u
        s = s * e[..., None] + k_t[..., :, None] * u[..., None, :]
        return s, (o, s)

    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta))
    _, (o, states) = jax.lax.scan(body, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def _dot(qk, s):
    import jax
    import jax.numpy as jnp

    return jnp.einsum("bhnk,bhkv->bhnv", qk, s, precision=jax.lax.Precision.HIGHEST)


def _products_and_sum(qk, s):
    """The contraction as elementwise products and a sum over dk: no dot, so the compiler may
    fuse it with its neighbours and needs no autotuning."""
    import jax.numpy as jnp

    return jnp.sum(qk[..., :, None] * s[:, :, None], axis=-2)


def one_pass_delta_rule(q, k, v, g, beta, state):
    """``_one_read_rule`` with the contraction as one F32 dot."""
    return _one_read_rule(_dot, q, k, v, g, beta, state)


def reduce_delta_rule(q, k, v, g, beta, state):
    """``_one_read_rule`` with the contraction as products and a sum."""
    return _one_read_rule(_products_and_sum, q, k, v, g, beta, state)


def unrolled_delta_rule(q, k, v, g, beta, state):
    """The library's rule one row at a time in one program (rows are then compiled apart, so a
    row's rounding may depend on its index: timed for scale, not a candidate)."""
    import jax.numpy as jnp

    from mtpjax import hybrid

    os_, ss = [], []
    for t in range(g.shape[1]):
        o, s = hybrid.recurrent_delta_rule(*(a[:, t : t + 1] for a in (q, k, v, g, beta)), state)
        state = s[:, 0]
        os_.append(o)
        ss.append(s)
    return jnp.concatenate(os_, axis=1), jnp.concatenate(ss, axis=1)


def delta_variant(name: str):
    from mtpjax import hybrid

    return dict(
        library=hybrid.recurrent_delta_rule,
        one_pass=one_pass_delta_rule,
        reduce=reduce_delta_rule,
        unrolled=unrolled_delta_rule,
    )[name]


def delta_inputs(seed: int, *, batch: int, rows: int, hv: int, dk: int, dv: int):
    """Inputs as a GDN layer hands them to the rule (host-drawn: no program to compile): q, k
    unit vectors (q / sqrt(dk)), v normal, g in (-1, 0), beta in (0, 1), a start state of scale
    0.1; all F32."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    arrays = (
        unit((batch, rows, hv, dk)) * dk**-0.5,
        unit((batch, rows, hv, dk)),
        rng.standard_normal((batch, rows, hv, dv)),
        -rng.uniform(0, 1, (batch, rows, hv)),
        rng.uniform(0, 1, (batch, rows, hv)),
        0.1 * rng.standard_normal((batch, hv, dk, dv)),
    )
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def host_tokens(seed: int, shape: tuple[int, ...], vocab: int):
    import jax.numpy as jnp
    import numpy as np

    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def window_exact(all_rows, one_row, inputs) -> bool:
    """Whether one call over all S rows gives bitwise the outputs and states of S one-row calls
    chained through the state. ``all_rows`` / ``one_row``: the S-row and 1-row programs."""
    import numpy as np

    q, k, v, g, beta, state = inputs
    o_all, s_all = all_rows(q, k, v, g, beta, state)
    os_, ss = [], []
    for t in range(g.shape[1]):
        o, s = one_row(*(a[:, t : t + 1] for a in (q, k, v, g, beta)), state)
        state = s[:, 0]
        os_.append(np.asarray(o))
        ss.append(np.asarray(s))
    return bool(
        np.array_equal(np.asarray(o_all), np.concatenate(os_, axis=1))
        and np.array_equal(np.asarray(s_all), np.concatenate(ss, axis=1))
    )


# ---------------------------------------------------------------------------------------------
# States, params and the jitted calls.
# ---------------------------------------------------------------------------------------------


def filled_state(*, cfg, batch: int, max_len: int, max_step: int, start: int):
    """``init_state``'s layout with every KV row and GDN state filled with values of scale 0.1
    (a step's cost does not depend on them; a sine of the index compiles faster than a random
    draw) and ``base = start - 1``, so a step at ``start`` continues from snapshot 0, as after a
    prefill of ``start`` tokens."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp

    from mtpjax import hybrid

    empty = hybrid.init_state(
        cfg, batch=batch, max_len=max_len, max_step=max_step, kv_dtype=jnp.bfloat16
    )
    leaves, tree = jax.tree.flatten(empty.layers)
    leaves = [
        (0.1 * jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * 0.618 + i))
        .reshape(x.shape)
        .astype(x.dtype)
        for i, x in enumerate(leaves)
    ]
    base = jnp.full((batch,), start - 1, jnp.int32)
    return dc.replace(empty, layers=jax.tree.unflatten(tree, leaves), base=base)


def split_params(params, cfg):
    """The ``GDN`` and ``full`` models' params out of the ``mixed`` model's: its GDN slots
    stacked on the group axis, its full-attention slot alone."""
    import jax
    import jax.numpy as jnp

    from mtpjax.hybrid import HybridParams, LayerType

    gdn = [p for p in range(cfg.period) if cfg.layer_types[p] is LayerType.LINEAR_ATTENTION]
    full = [p for p in range(cfg.period) if cfg.layer_types[p] is LayerType.FULL_ATTENTION]
    stacked = jax.tree.map(lambda *a: jnp.concatenate(a), *[params.layers[p] for p in gdn])
    return dict(
        mixed=params,
        GDN=HybridParams(layers=(stacked,), final_norm=params.final_norm),
        full=HybridParams(layers=(params.layers[full[0]],), final_norm=params.final_norm),
    )


def step_fn(cfg):
    """``hybrid.step`` with its config bound; the state (argument 2) is donated."""
    import jax

    from mtpjax import hybrid

    return jax.jit(lambda p, h, s, t, w: hybrid.step(p, h, s, t, w, cfg=cfg), donate_argnums=(2,))


def prefill_fn(cfg):
    import jax

    from mtpjax import hybrid

    return jax.jit(
        lambda p, h, s, t, n: hybrid.prefill(p, h, s, t, n, cfg=cfg), donate_argnums=(2,)
    )


def compiler_memory(compiled, state_bytes: int) -> dict:
    """The compiler's memory account of a step: ``memory`` (argument, output, alias, temp bytes)
    and ``temp_over_state``: temporaries as a multiple of the donated state. A step that updates
    its state in place needs temporaries far smaller than the state; a multiple of it means the
    state is rebuilt in a new buffer (and copied) every step."""
    from benchmarks.propose import memory_analysis

    mem = memory_analysis(compiled)
    ratio = None if mem is None or not state_bytes else mem["temp_size_in_bytes"] / state_bytes
    return dict(memory=mem, temp_over_state=ratio)


def time_head(compiled, head, batch: int, rows: int, hidden_size: int, *, smoke: bool):
    """Steady-state µs of the LM head ``compiled(head, hidden [B, S, H])``."""
    import jax.numpy as jnp

    x = jnp.sin(jnp.arange(batch * rows * hidden_size, dtype=jnp.float32))
    x = x.reshape(batch, rows, hidden_size)
    return harness.time_queued(lambda: compiled(head, x), **(harness.SMOKE_CALLS if smoke else {}))


def time_donating(compiled, params, head, state, tokens, where, *, smoke: bool):
    """Steady-state and synchronised µs of ``compiled(params, head, state, tokens, where)``,
    each call taking the state the previous one returned. Returns (times, the last state)."""
    import jax

    holder = [state]

    def call():
        out, holder[0] = compiled(params, head, holder[0], tokens, where)
        return out, holder[0]

    jax.block_until_ready(call())
    synced = harness.time_synced(call, iters=1 if smoke else 10, warmup=0)["time_us"]
    queued = harness.time_queued(call, **(harness.SMOKE_CALLS if smoke else {}))
    return dict(time_us=queued, time_us_synced=synced), holder[0]


# ---------------------------------------------------------------------------------------------
# The profile: device kernels attributed to source through the HLO's stack frames.
# ---------------------------------------------------------------------------------------------

#: (category, function names) checked innermost frame first; the first match names the kernel.
_BY_FUNCTION = (
    ("conv", {"causal_conv"}),
    ("state select", {"_select", "_snapshot_index", "commit"}),
    ("norms", {"_norm", "rms_norm", "l2_normalize"}),
    ("gdn gates", {"_gdn_core_inputs"}),
    ("gdn projections", {"_gdn_inputs", "_gdn_output"}),
    ("ffn", {"apply_ffn"}),
    ("attention projections", {"project_q", "project_kv", "output_projection"}),
    ("attention", {"attend"}),
    ("embedding", {"embed"}),
    ("layer scan", {"_scan_groups"}),
)


def categorize(stack: list[tuple[str, str, int]]) -> tuple[str, tuple[str, str, int] | None]:
    """The part of a hybrid step a kernel belongs to, from its stack (innermost first; function
    names as the HLO gives them, ``outer.<locals>.inner``), and the frame that says so."""
    for frame in stack:
        file, qualname, line = frame
        base, fn = os.path.basename(file), qualname.rpartition(".")[2]
        in_kernel_package = os.path.basename(os.path.dirname(file)) == "_delta_rule"
        if in_kernel_package and base != "reference.py":
            return "delta rule (kernel)", frame  # the Triton kernel, one call a layer
        delta = base == "_delta.py" or (in_kernel_package and base == "reference.py")
        if delta and fn not in ("causal_conv", "l2_normalize"):
            row = fn in ("body", "delta_step")  # the per-position step the scans run
            return ("delta rule (row body)" if row else "delta rule (scan in/out)"), frame
        if base == "_model.py" and ".at[" in linecache.getline(file, line):
            text = linecache.getline(file, line)
            return ("kv writes" if "st.k" in text or "st.v" in text else "gdn state writes"), frame
        for category, names in _BY_FUNCTION:
            if fn in names:
                return category, frame
    return "other", None


def profile_step(compiled, params, head, state, tokens, where, *, calls: int, top: int):
    """Kernel time per call of ``compiled`` under ``jax.profiler``, by category and by source
    line, with the ``top`` kernels. Returns (record fields, the last state)."""
    from benchmarks.profile import attributed_profile

    holder = [state]

    def call():
        out, holder[0] = compiled(params, head, holder[0], tokens, where)
        return out, holder[0]

    fields = attributed_profile(call, compiled.as_text(), categorize, calls=calls, top=top)
    return fields, holder[0]


# ---------------------------------------------------------------------------------------------
# The sections.
# ---------------------------------------------------------------------------------------------


def _configure_child(args: argparse.Namespace) -> None:
    """Before the child's first compile: the persistent cache (JAX decides once whether it is
    used) and the donation warning."""
    import jax

    if args.compile_cache:
        Path(args.compile_cache).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(args.compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # The state's base (int32[B]) is donated and replaced by ``start``: nothing to alias.
    warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")


def _compile(child, jobs, desc: str) -> None:
    from benchmarks import propose as bp

    workers = child.options.compile_workers or (
        min(8, os.cpu_count() or 1) if not child.smoke else 1
    )
    options = bp.SMOKE_COMPILER_OPTIONS if child.smoke else None
    t0 = time.perf_counter()
    bp.compile_jobs(list(jobs.values()), workers=workers, options=options, desc=desc)
    child.emit(
        dict(
            kernel="compile",
            what=desc,
            jobs=len(jobs),
            wall_s=time.perf_counter() - t0,
            errors={str(j.key): j.error for j in jobs.values() if j.error},
        )
    )


def _skip(child, what: str, why: str) -> None:
    child.emit(dict(kernel="skipped", what=what, reason=why))


def _ready(child, job, what: str, margin: float = 8.0) -> bool:
    if job.compiled is None:
        _skip(child, what, f"not compiled: {job.error}")
        return False
    if child.left() < margin:
        _skip(child, what, f"{child.left():.0f} s left in the section")
        return False
    return True


def _job(key, fn, *args):
    from benchmarks.propose import Job

    return Job(key=key, fn=fn, args=args)


def section_27b(child) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import propose as bp
    from mtpjax import hybrid
    from mtpjax.head import lm_head

    o = child.options
    bw = harness.copy_bandwidth(smoke=child.smoke)
    child.emit(dict(kernel="device_copy", **bw))
    gbps = bw["gbps"]
    B, W, ctx = 1, o.drafts + 1, o.context
    max_len = ctx + W
    patterns = SMOKE_MODELS_27B if child.smoke else MODELS_27B
    cfgs = {name: config_27b(pat, smoke=child.smoke) for name, pat in patterns.items()}
    mixed = cfgs["mixed"]
    key = jax.random.key(0, impl=bp.prng_impl(child.smoke))
    init = jax.jit(lambda kk: hybrid.init(mixed, key=kk))
    abs_params, abs_head = jax.eval_shape(init, key)
    split = jax.jit(functools.partial(split_params, cfg=mixed))
    abs_models = jax.eval_shape(split, abs_params)
    start = jnp.full((B,), ctx, jnp.int32)
    hv, dk, dv = (
        mixed.linear_num_value_heads,
        mixed.linear_key_head_dim,
        mixed.linear_value_head_dim,
    )
    dshape = dict(batch=B, hv=hv, dk=dk, dv=dv)
    # (model, GDN snapshots kept, rows): the headline first, compiled and timed on its own so a
    # tight budget keeps it; then the single-kind models and the delta rule alone.
    headline = [("mixed", W, 1), ("mixed", W, W), ("mixed", 1, 1)]
    rows = (W,) if child.smoke else (1, W)
    per_kind = [(m, W, s) for m in ("GDN", "full") for s in rows]
    variants = VARIANTS[:2] if child.smoke else VARIANTS
    fills: dict[tuple, object] = {}

    def step_jobs(points):
        jobs = {}
        for name, w, s in points:
            if (name, w) not in fills:
                fills[(name, w)] = fill = jax.jit(
                    functools.partial(
                        filled_state, cfg=cfgs[name], batch=B, max_len=max_len, max_step=w,
                        start=ctx,
                    )
                )  # fmt: skip
                jobs[("fill", name, w)] = _job(("fill", name, w), fill)
            abs_state = jax.eval_shape(fills[(name, w)])
            tokens = jax.ShapeDtypeStruct((B, s), jnp.int32)
            jobs[("step", name, w, s)] = _job(
                ("step", name, w, s), step_fn(cfgs[name]), abs_models[name], abs_head,
                abs_state, tokens, start,
            )  # fmt: skip
        return jobs

    jobs = {("init",): _job(("init",), init, key), **step_jobs(headline)}
    _compile(child, jobs, "27b mixed")
    if not _ready(child, jobs[("init",)], "27b init", margin=5):
        return
    params, head = jobs[("init",)].compiled(key)
    models = split(params)
    del params
    states: dict[tuple, object] = {}

    def time_steps(points):
        for name, w, s in points:
            what = f"27b {name} W={w} S={s}"
            job, fjob = jobs[("step", name, w, s)], jobs[("fill", name, w)]
            if not (_ready(child, job, what) and _ready(child, fjob, what)):
                continue
            state = states.pop((name, w), None)
            if state is None:
                state = fjob.compiled()
            tokens = host_tokens(s, (B, s), mixed.vocab_size)
            times, states[(name, w)] = time_donating(
                job.compiled, models[name], head, state, tokens, start, smoke=child.smoke
            )
            cfg = cfgs[name]
            nbytes = step_bytes(cfg, models[name], batch=B, rows=s, context=ctx)
            L = cfg.num_hidden_layers
            per_layer, roof = times["time_us"] / L, nbytes["total"] / (gbps * 1e3)
            rec = dict(
                kernel="step", section="27b", model=name, pattern=patterns[name], layers=L,
                batch=B, rows=s, snapshots=w, context=ctx, **times, compile_s=job.compile_s,
                per_layer_us=per_layer, in_64_layers_us=per_layer * LAYERS_IN_64[name],
                bytes=nbytes, bytes_per_layer=nbytes["total"] / L, roofline_us=roof,
                frac_of_copy=roof / times["time_us"], copy_gbps=gbps,
                state_bytes=harness.tree_bytes(states[(name, w)]),
                custom_calls=bp.scan_hlo(job.compiled.as_text())["custom_calls"],
            )  # fmt: skip
            child.emit(dict(rec, **compiler_memory(job.compiled, rec["state_bytes"])))

    time_steps(headline)
    if child.left() < 30:
        _skip(child, "27b GDN, full and the delta rule", f"{child.left():.0f} s left")
        return
    jobs.update(step_jobs(per_kind))
    head_fn = jax.jit(lambda h, x: lm_head(h, x, cfg=mixed.lm_head_config()))
    for s in (1, W):
        hidden = jax.ShapeDtypeStruct((B, s, mixed.hidden_size), jnp.float32)
        jobs[("head", s)] = _job(("head", s), head_fn, abs_head, hidden)
    delta_in = {s: delta_inputs(11 + s, rows=s, **dshape) for s in (1, W)}
    for variant in variants:
        for s in (1, W):
            jobs[("delta", variant, s)] = _job(
                ("delta", variant, s), jax.jit(delta_variant(variant)), *delta_in[s]
            )
    _compile(
        child,
        {k: j for k, j in jobs.items() if j.compiled is None and not j.error},
        "27b GDN, full, delta",
    )
    time_steps(per_kind)
    for s in (1, W):
        job = jobs[("head", s)]
        if _ready(child, job, f"27b LM head rows={s}"):
            us = time_head(job.compiled, head, B, s, mixed.hidden_size, smoke=child.smoke)
            child.emit(dict(kernel="lm_head", section="27b", batch=B, rows=s, time_us=us))

    # The delta rule alone, at the GDN layer's shapes.
    for variant in variants:
        for s in (1, W):
            job = jobs[("delta", variant, s)]
            if not _ready(child, job, f"delta rule {variant} S={s}"):
                continue
            inputs = delta_in[s]
            us = harness.time_queued(
                functools.partial(job.compiled, *inputs),
                **(harness.SMOKE_CALLS if child.smoke else {}),
            )
            nbytes = delta_rule_bytes(rows=s, **dshape)
            rec = dict(
                kernel="delta_rule", section="27b", variant=variant, rows=s, **dshape,
                time_us=us, bytes=nbytes, roofline_us=nbytes / (gbps * 1e3),
                compile_s=job.compile_s,
            )  # fmt: skip
            rec["x_roofline"] = us / rec["roofline_us"]
            one, lib = jobs[("delta", variant, 1)], jobs[("delta", "library", s)]
            if s > 1 and one.compiled is not None:
                rec["window_exact"] = window_exact(job.compiled, one.compiled, inputs)
            if variant != "library" and lib.compiled is not None:
                pairs = zip(job.compiled(*inputs), lib.compiled(*inputs), strict=True)
                rec["max_abs_vs_library"] = max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs
                )
            child.emit(rec)

    # Where a step's time goes.
    for point in [p for p in o.profile.split(",") if p]:
        name, _, s = point.partition("/")
        s = int(s or W)
        job, what = jobs.get(("step", name, W, s)), f"profile {point}"
        if job is None:
            _skip(child, what, f"not a timed step: model/rows of {[p[::2] for p in per_kind]}")
            continue
        if not _ready(child, job, what, margin=20) or (name, W) not in states:
            continue
        tokens = host_tokens(s, (B, s), mixed.vocab_size)
        try:
            fields, states[(name, W)] = profile_step(
                job.compiled, models[name], head, states.pop((name, W)), tokens, start,
                calls=1 if child.smoke else 5, top=o.top,
            )  # fmt: skip
        except Exception as e:  # the profiler is a convenience: its failure loses no timing
            _skip(child, what, f"{type(e).__name__}: {str(e)[:600]}")
            continue
        layers = cfgs[name].num_hidden_layers
        child.emit(
            dict(kernel="profile", section="27b", model=name, rows=s, layers=layers, **fields)
        )


def section_08b(child) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks import propose as bp
    from mtpjax import hybrid
    from mtpjax.head import lm_head

    o = child.options
    bw = harness.copy_bandwidth(smoke=child.smoke)
    child.emit(dict(kernel="device_copy", **bw))
    gbps = bw["gbps"]
    cfg = config_08b(smoke=child.smoke)
    k, ctx = o.drafts, o.small_context
    W, max_len = k + 1, max(ctx, *o.prompts) + k + 1
    key = jax.random.key(1, impl=bp.prng_impl(child.smoke))
    init = jax.jit(lambda kk: hybrid.init(cfg, key=kk))
    abs_params, abs_head = jax.eval_shape(init, key)
    head_cfg = cfg.lm_head_config()
    head_fn = jax.jit(lambda h, x: lm_head(h, x, cfg=head_cfg))
    jobs = {("init",): _job(("init",), init, key)}
    fills = {}
    for b in o.batches:
        fills[b] = jax.jit(
            functools.partial(
                filled_state, cfg=cfg, batch=b, max_len=max_len, max_step=W, start=ctx
            )
        )
        jobs[("fill", b)] = _job(("fill", b), fills[b])
        abs_state = jax.eval_shape(fills[b])
        lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
        for t in o.prompts:
            tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
            jobs[("prefill", b, t)] = _job(
                ("prefill", b, t), prefill_fn(cfg), abs_params, abs_head, abs_state, tokens,
                lengths,
            )  # fmt: skip
        for s in (1, W):
            tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
            jobs[("step", b, s)] = _job(
                ("step", b, s), step_fn(cfg), abs_params, abs_head, abs_state, tokens, lengths
            )
            hidden = jax.ShapeDtypeStruct((b, s, cfg.hidden_size), jnp.float32)
            jobs[("head", b, s)] = _job(("head", b, s), head_fn, abs_head, hidden)
    _compile(child, jobs, "0.8b")

    if not _ready(child, jobs[("init",)], "0.8b init", margin=5):
        return
    params, head = jobs[("init",)].compiled(key)
    base = dict(section="0.8b", model="0.8b", layers=cfg.num_hidden_layers, copy_gbps=gbps)
    for b in o.batches:
        fjob = jobs[("fill", b)]
        if not _ready(child, fjob, f"0.8b B={b}"):
            continue
        state = fjob.compiled()
        for t in o.prompts:
            job = jobs[("prefill", b, t)]
            if not _ready(child, job, f"0.8b prefill B={b} T={t}"):
                continue
            tokens = host_tokens(t, (b, t), cfg.vocab_size)
            lengths = jnp.full((b,), t, jnp.int32)
            times, state = time_donating(
                job.compiled, params, head, state, tokens, lengths, smoke=child.smoke
            )
            rec = dict(kernel="prefill", batch=b, prompt=t, **times, compile_s=job.compile_s)
            rec["tokens_per_s"] = b * t / times["time_us"] * 1e6
            child.emit(dict(rec, **base))
        # The prefill left other contents than fill's: steps restart from a filled state.
        state = fjob.compiled()
        start = jnp.full((b,), ctx, jnp.int32)
        for s in (1, W):
            job, hjob = jobs[("step", b, s)], jobs[("head", b, s)]
            what = f"0.8b step B={b} S={s}"
            if not _ready(child, job, what):
                continue
            tokens = host_tokens(s, (b, s), cfg.vocab_size)
            times, state = time_donating(
                job.compiled, params, head, state, tokens, start, smoke=child.smoke
            )
            nbytes = step_bytes(cfg, params, batch=b, rows=s, context=ctx)
            roof = nbytes["total"] / (gbps * 1e3)
            rec = dict(
                kernel="step", batch=b, rows=s, snapshots=W, context=ctx, **times,
                compile_s=job.compile_s, bytes=nbytes, roofline_us=roof,
                frac_of_copy=roof / times["time_us"], state_bytes=harness.tree_bytes(state), **base,
            )  # fmt: skip
            rec.update(compiler_memory(job.compiled, rec["state_bytes"]))
            if hjob.compiled is not None:
                rec["lm_head_us"] = time_head(
                    hjob.compiled, head, b, s, cfg.hidden_size, smoke=child.smoke
                )
                rec["with_lm_head_us"] = rec["time_us"] + rec["lm_head_us"]
            child.emit(rec)


# ---------------------------------------------------------------------------------------------
# Parent: ratios, the table, the plot.
# ---------------------------------------------------------------------------------------------


def derive(records: list[dict]) -> list[dict]:
    """``vs_decode`` (a step against the same model's 1-row step from the same state layout),
    ``vs_plain_decode`` (against the 1-row step from a one-snapshot state, when timed), the same
    with the LM head for the 0.8B model, and for the 27B-like ``mixed`` model
    ``in_64_layers_vs_plain_decode_with_lm_head``: 64 layers' worth of each step plus the LM
    head on its rows, verify over plain decode (the whole target's ratio, estimated)."""
    steps = [r for r in records if r.get("kernel") == "step" and "time_us" in r]
    heads = {
        r["rows"]: r["time_us"]
        for r in records
        if r.get("kernel") == "lm_head" and r.get("section") == "27b" and "time_us" in r
    }
    one = {
        (r["section"], r["model"], r["batch"], r["snapshots"]): r for r in steps if r["rows"] == 1
    }
    for r in steps:
        if r["rows"] == 1:
            continue
        d = one.get((r["section"], r["model"], r["batch"], r["snapshots"]))
        p = one.get((r["section"], r["model"], r["batch"], 1))
        r["vs_decode"] = None if d is None else r["time_us"] / d["time_us"]
        r["vs_plain_decode"] = None if p is None else r["time_us"] / p["time_us"]
        if d is not None and "with_lm_head_us" in r and "with_lm_head_us" in d:
            r["vs_decode_with_lm_head"] = r["with_lm_head_us"] / d["with_lm_head_us"]
        if r["model"] == "mixed" and p is not None and r["rows"] in heads and 1 in heads:
            verify = r["in_64_layers_us"] + heads[r["rows"]]
            r["in_64_layers_vs_plain_decode_with_lm_head"] = verify / (
                p["in_64_layers_us"] + heads[1]
            )
    return records


def _f(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{format(v, spec):>{width}}"


def table(records: list[dict]) -> str:
    out = []
    copy = [r for r in records if r.get("kernel") == "device_copy"]
    if copy:
        out.append("device copy: " + ", ".join(f"{r['gbps']:.0f} GB/s" for r in copy))
    rows = [r for r in records if r.get("kernel") == "step" and r.get("section") == "27b"]
    if rows:
        r0 = rows[0]
        out.append(
            f"\nQwen3.5-27B-like step, B={r0['batch']}, context {r0['context']}: W = GDN "
            "snapshots kept; per layer = step / layers; '64-layer' = per layer x the layers of "
            "that kind in the 64-layer model (64 mixed, 48 GDN, 16 full); roof = bytes / copy "
            "bandwidth; temp/state = the compiler's temporaries over the donated state (in "
            "place: near 0)"
        )
        out.append(
            f"{'model':6}{'W':>3}{'rows':>5}{'step us':>10}{'/layer':>9}{'64-layer us':>12}"
            f"{'vs dec':>8}{'vs plain':>9}{'MB/layer':>10}{'roof/layer':>11}{'of copy':>8}"
            f"{'temp/state':>11}"
        )
        for r in rows:
            out.append(
                f"{r['model']:6}{r['snapshots']:>3}{r['rows']:>5}{_f(r['time_us'], '.0f', 10)}"
                f"{_f(r['per_layer_us'], '.1f', 9)}{_f(r['in_64_layers_us'], '.0f', 12)}"
                f"{_f(r.get('vs_decode'), '.3f', 8)}{_f(r.get('vs_plain_decode'), '.3f', 9)}"
                f"{_f(r['bytes_per_layer'] / 1e6, '.1f', 10)}"
                f"{_f(r['roofline_us'] / r['layers'], '.1f', 11)}"
                f"{_f(r['frac_of_copy'], '.2f', 8)}{_f(r.get('temp_over_state'), '.2f', 11)}"
            )
        target = [r for r in rows if r["model"] == "mixed" and r.get("vs_plain_decode")]
        for r in target:
            verdict = "meets" if r["vs_plain_decode"] <= 1.3 else "MISSES"
            out.append(
                f"verify ({r['rows']} rows) / plain decode = {r['vs_plain_decode']:.3f}: "
                f"{verdict} the <= 1.3 target"
            )
            whole = r.get("in_64_layers_vs_plain_decode_with_lm_head")
            if whole is not None:
                out.append(
                    f"  64 layers + the LM head (estimated from the per-layer times): {whole:.3f}"
                )
    delta = [r for r in records if r.get("kernel") == "delta_rule"]
    if delta:
        out.append("\nthe delta rule alone (GDN shapes): roof = its bytes / copy bandwidth")
        out.append(
            f"{'variant':10}{'rows':>5}{'us':>9}{'roof us':>9}{'x roof':>8}{'window-exact':>14}"
            f"{'max|d| vs lib':>15}"
        )
        for r in delta:
            exact = r.get("window_exact")
            out.append(
                f"{r['variant']:10}{r['rows']:>5}{_f(r['time_us'], '.1f', 9)}"
                f"{_f(r['roofline_us'], '.2f', 9)}{_f(r['x_roofline'], '.1f', 8)}"
                f"{'-' if exact is None else str(exact):>14}"
                f"{_f(r.get('max_abs_vs_library'), '.1e', 15)}"
            )
    for r in (r for r in records if r.get("kernel") == "profile"):
        out.append(
            f"\nprofile {r['model']} rows={r['rows']} ({r['layers']} layers): busy "
            f"{r['busy_us']:.0f} us/call, attributed {r['attributed_us']:.0f}, wall under the "
            f"profiler {r['wall_us']:.0f}; per layer:"
        )
        for cat, us in r["categories"].items():
            share = us / r["busy_us"] if r["busy_us"] else 0.0
            out.append(f"  {us / r['layers']:9.1f} us {share:6.1%}  {cat}")
    small = [r for r in records if r.get("section") == "0.8b" and r.get("kernel") == "prefill"]
    if small:
        out.append(f"\nQwen3.5-0.8B-shaped ({small[0]['layers']} layers) prefill")
        out.append(f"{'B':>3}{'prompt':>8}{'ms':>10}{'tokens/s':>12}")
        for r in small:
            out.append(
                f"{r['batch']:>3}{r['prompt']:>8}{_f(r['time_us'] / 1e3, '.2f', 10)}"
                f"{_f(r['tokens_per_s'], '.0f', 12)}"
            )
    steps = [r for r in records if r.get("section") == "0.8b" and r.get("kernel") == "step"]
    if steps:
        out.append(
            f"\nQwen3.5-0.8B-shaped ({steps[0]['layers']} layers) step at context "
            f"{steps[0]['context']}; + head: the LM head on the step's rows"
        )
        out.append(
            f"{'B':>3}{'rows':>5}{'step us':>10}{'+ head us':>11}{'vs dec':>8}{'vs dec+h':>9}"
            f"{'roof us':>9}{'of copy':>8}{'temp/state':>11}"
        )
        for r in steps:
            out.append(
                f"{r['batch']:>3}{r['rows']:>5}{_f(r['time_us'], '.0f', 10)}"
                f"{_f(r.get('with_lm_head_us'), '.0f', 11)}{_f(r.get('vs_decode'), '.3f', 8)}"
                f"{_f(r.get('vs_decode_with_lm_head'), '.3f', 9)}"
                f"{_f(r['roofline_us'], '.0f', 9)}{_f(r['frac_of_copy'], '.2f', 8)}"
                f"{_f(r.get('temp_over_state'), '.2f', 11)}"
            )
    for r in records:
        kern = r.get("kernel")
        if kern == "skipped":
            out.append(f"skipped {r['what']}: {r['reason']}")
        elif kern == "_section_error":
            out.append(f"SECTION ERROR {r.get('section')}: {r.get('error', '')[-800:]}")
        elif kern == "compile":
            bad = f", errors: {r['errors']}" if r["errors"] else ""
            out.append(f"compiled {r['jobs']} programs for {r['what']} in {r['wall_s']:.0f} s{bad}")
    return "\n".join(out)


def plot(records: list[dict], path: str | Path) -> None:
    """27B-like per-layer step time against its roofline; the 0.8B steps; the 0.8B prefill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    big = [r for r in records if r.get("kernel") == "step" and r.get("section") == "27b"]
    labels = [f"{r['model']}\nW={r['snapshots']} S={r['rows']}" for r in big]
    xs = range(len(big))
    ax = axes[0]
    ax.bar(xs, [r["per_layer_us"] for r in big], color="tab:blue", label="step / layers")
    ax.plot(xs, [r["roofline_us"] / r["layers"] for r in big], "k_", ms=20, mew=2,
            label="roofline (bytes / copy)")  # fmt: skip
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="µs per layer", title="Qwen3.5-27B-like, B=1: per layer")
    ax.legend(fontsize=8)
    small = [r for r in records if r.get("kernel") == "step" and r.get("section") == "0.8b"]
    ax = axes[1]
    for b in sorted({r["batch"] for r in small}):
        pts = sorted((r["rows"], r["time_us"], r.get("with_lm_head_us")) for r in small
                     if r["batch"] == b)  # fmt: skip
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"B={b} step")
        if all(p[2] for p in pts):
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label=f"B={b} + LM head")
    ax.set(xlabel="rows per sequence", ylabel="µs per step", title="Qwen3.5-0.8B-shaped step")
    ax.legend(fontsize=8)
    pre = [r for r in records if r.get("kernel") == "prefill"]
    ax = axes[2]
    for b in sorted({r["batch"] for r in pre}):
        pts = sorted((r["prompt"], r["time_us"] / 1e3) for r in pre if r["batch"] == b)
        ax.plot(*zip(*pts, strict=True), "o-", label=f"B={b}")
    ax.set(xlabel="prompt tokens", ylabel="ms", title="Qwen3.5-0.8B-shaped prefill")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _positive_ints(s: str) -> list[int]:
    """``"512,2048"`` -> [512, 2048]."""
    out = [int(x) for x in s.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise ValueError(s)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add = ap.add_argument
    add("--json", type=Path, default=harness.REPO / "benchmarks/results/hybrid_h200.json")
    add("--plot", type=Path, default=None, help="default: the JSON path as .png")
    add("--from-json", type=Path, default=None, help="only re-derive, print and plot a JSON")
    add("--sections", default=",".join(SECTIONS), help=f"from {','.join(SECTIONS)}")
    add("--drafts", type=int, default=3, help="k: the verify step takes k + 1 rows (3)")
    add("--context", type=int, default=None, help="27b: KV rows before the step (4096)")
    add("--small-context", type=int, default=None, help="0.8b: start of the steps (2048)")
    add("--prompts", type=_positive_ints, default=None, help="0.8b prefill lengths (512,2048)")
    add("--batches", type=_positive_ints, default=None, help="0.8b batches (1,8)")
    add("--profile", default=None,
        help="27b steps to profile, model/rows of GDN or full (GDN/1,GDN/4,full/4); '' for none")  # fmt: skip
    add("--top", type=int, default=30, help="kernels kept per profile")
    add("--compile-cache", type=Path, default=None,
        help="JAX persistent compilation cache: a second run skips the compiles")  # fmt: skip
    add("--compile-workers", type=int, default=None, help="default 8 on GPU, 1 on CPU")
    add("--budget-s", type=float, default=200.0, help="wall-clock budget of all sections")
    add("--smoke", action="store_true", help="tiny shapes on the CPU")
    harness.add_child_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    for name in ("context", "small_context", "prompts", "batches", "profile"):
        if getattr(args, name) is None:
            value = defaults[name]
            setattr(args, name, _positive_ints(value) if name in ("prompts", "batches") else value)
    if args.drafts < 1:
        ap.error("--drafts must be at least 1")
    if args.child:
        _configure_child(args)
        return harness.child_main(args, {"27b": section_27b, "0.8b": section_08b})
    plot_path = args.plot or (args.from_json or args.json).with_suffix(".png")
    if args.from_json:
        records = derive(harness.read_records(args.from_json))
    else:
        sections = [s for s in args.sections.split(",") if s]
        bad = [s for s in sections if s not in SECTIONS]
        if bad:
            ap.error(f"unknown sections {bad}; choose from {', '.join(SECTIONS)}")
        extra = _child_argv(args)
        with tempfile.TemporaryDirectory() as tmp:
            records = harness.run_sections(
                "benchmarks.hybrid",
                sections,
                budget_s=args.budget_s,
                extra=extra,
                workdir=tmp,
                weights={"27b": 1.2},
            )
        records = derive(records)
        env = next((r for r in records if r.get("kernel") == "_env"), {})
        run = harness.run_info("benchmarks.hybrid", argv, env=env, smoke=args.smoke)
        harness.write_records(args.json, records, run)
    try:
        plot(records, plot_path)
    except Exception as e:  # the plot is a convenience, never fatal
        print(f"no plot: {type(e).__name__}: {e}", file=sys.stderr)
    print(table(records))
    return 0


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The options a section's child process needs, as command-line arguments."""
    out = ["--drafts", str(args.drafts), "--context", str(args.context)]
    out += ["--small-context", str(args.small_context), "--top", str(args.top)]
    out += ["--prompts", ",".join(map(str, args.prompts))]
    out += ["--batches", ",".join(map(str, args.batches)), "--profile", args.profile]
    if args.compile_cache:
        out += ["--compile-cache", str(args.compile_cache)]
    if args.compile_workers:
        out += ["--compile-workers", str(args.compile_workers)]
    return out + ["--smoke"] * args.smoke


if __name__ == "__main__":
    sys.exit(main())
