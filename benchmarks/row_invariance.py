"""Does a row's result depend on how many rows share the call? Op by op, then whole steps.

Greedy speculation is exact against plain decoding when the target's verify step (K + 1 rows a
sequence) computes its first row bit for bit as the plain step (one row) does. Each op of a
target step is checked here at real shapes: the op over ``B x W`` rows against the same op over
each of the ``W`` row positions alone (``B`` rows), compared bit for bit. Ops without a
cross-row dependence (norms, projections, RoPE, the LM head, attention over a fixed cache)
are compared at every row; whole target steps at their first row (the committed token), which
causal attention keeps independent of the rows after it.

    python -m benchmarks.row_invariance --json $OUT/row_invariance_h200.json
    python -m benchmarks.row_invariance --smoke --json /tmp/ri.json   # CPU, tiny shapes

Each record: ``what`` (the op or step), ``width`` W, ``rows`` (B x W), ``equal`` (every compared
element bit for bit), ``mismatches`` (elements that differ), ``max_abs_diff`` and the largest
magnitude compared (``max_abs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import generate as bg
from benchmarks import harness
from mtpjax.head import lm_head
from mtpjax.hybrid._delta import causal_conv, l2_normalize, recurrent_delta_rule
from mtpjax.layers import attend, attend_cache, rms_norm
from mtpjax.layers.rope import apply_rope
from mtpjax.weights import layer_of, linear

SMOKE = dict(batch=2, op_widths=(2,), widths=(2, 5), context=64, layers=2)
GPU = dict(batch=8, op_widths=(2, 5), widths=(2, 3, 4, 5), context=4096, layers=4)


def compare(what: str, width: int, rows: int, together, alone) -> dict:
    """Bitwise comparison of two arrays of one shape."""
    a, b = np.asarray(together, np.float32), np.asarray(alone, np.float32)
    diff = a != b
    return dict(
        what=what,
        width=width,
        rows=rows,
        equal=not bool(diff.any()),
        mismatches=int(diff.sum()),
        max_abs_diff=float(np.abs(a - b).max()) if diff.any() else 0.0,
        max_abs=float(np.abs(b).max()),
    )


def rowwise(what: str, fn: Callable, args: tuple, width: int, consts: tuple = ()) -> dict:
    """``fn(*args, *consts)`` over args [B, W, ...] against ``fn`` over each row
    ``args[:, r:r+1]`` alone, every row; ``consts`` are passed whole (as arguments: a closure
    over device arrays would make them constants of the program)."""
    f = jax.jit(fn)
    together = f(*args, *consts)
    alone = [f(*(a[:, r : r + 1] for a in args), *consts) for r in range(width)]
    return compare(what, width, args[0].shape[0] * width, together, jnp.concatenate(alone, 1))


@dataclasses.dataclass
class Shapes:
    batch: int
    op_widths: tuple[int, ...]  # the ops'
    widths: tuple[int, ...]  # the whole steps' and the GDN ops'
    context: int
    layers: int


def reference_ops(setup: bg.Setup, shapes: Shapes, key: jax.Array, emit) -> None:
    """The reference target's ops at its shapes, layer 0's weights read as a step reads them;
    the norms and the attention both as XLA fuses them (``_xla``) and as the steps run them."""
    cfg, B = setup.tcfg, shapes.batch
    H, D, Nq, Nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    att, ffn = setup.layers.layers.attention, setup.layers.layers.ffn
    ks = (jax.random.fold_in(key, i) for i in range(10**6))
    Lmax = shapes.context + max(shapes.op_widths)
    cache_k = jax.random.normal(next(ks), (B, Lmax, Nkv, D), jnp.float32)
    cache_v = jax.random.normal(next(ks), (B, Lmax, Nkv, D), jnp.float32)
    norm_w = 0.1 * jax.random.normal(next(ks), (H,), jnp.float32)

    def lin(x, stack):
        # The index is traced, as in the step's scan: the kernels read the stack in place.
        w = layer_of(stack, jnp.int32(0))
        return linear(x.astype(cfg.compute_dtype), w, out_dtype=jnp.float32)

    def norm(impl):
        return lambda v, w: rms_norm(v, w, eps=1e-6, zero_centered=True, implementation=impl)

    def attention_xla(q, lengths, k, v):
        mask = jnp.arange(k.shape[1])[None, None, :] < lengths[:, :, None]
        return attend(q, k, v, mask)

    def attention(q, lengths, k, v):
        return attend_cache(q, k, v, lengths)

    for W in shapes.op_widths:
        x = jax.random.normal(next(ks), (B, W, H), jnp.float32)
        pos = shapes.context + jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
        q = jax.random.normal(next(ks), (B, W, Nq, D), jnp.float32)
        o_in = jax.random.normal(next(ks), (B, W, Nq * D), jnp.float32)
        ffn_in = jax.random.normal(next(ks), (B, W, cfg.intermediate_size), jnp.float32)
        ops = {
            "rms_norm_xla": (norm("xla"), (x,), (norm_w,)),
            "rms_norm": (norm("auto"), (x,), (norm_w,)),
            "q_proj": (lin, (x,), (att.q_proj,)),
            "k_proj": (lin, (x,), (att.k_proj,)),
            "o_proj": (lin, (o_in,), (att.o_proj,)),
            "gate_proj": (lin, (x,), (ffn.gate_proj,)),
            "down_proj": (lin, (ffn_in,), (ffn.down_proj,)),
            "rope": (
                lambda v, p: apply_rope(v, p, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta),
                (q, pos),
                (),
            ),
            "attend_xla": (attention_xla, (q, pos + 1), (cache_k, cache_v)),
            "attend_cache": (attention, (q, pos + 1), (cache_k, cache_v)),
        }
        for prec, head in setup.heads.items():
            ops[f"lm_head_{prec}"] = (
                lambda v, h: lm_head(h, v, cfg=cfg.lm_head_config()),
                (x,),
                (head,),
            )
        for name, (fn, args, consts) in ops.items():
            emit(rowwise(name, fn, args, W, consts))


def steps_row0(target, lm, head_cfg, prompts, lengths, first, shapes, key, name, emit, **extra):
    """Row 0 of W-row steps (token ``first`` [B], random tokens after it) against the one-row
    step, from one prefill of ``prompts``: the hidden and its logits, bit for bit."""
    B, T = prompts.shape
    state = target.init_cache(B, T + 2 * max(shapes.widths))
    _, state = target.prefill(target.params, state, prompts, lengths)
    for W in (1, *shapes.widths):
        tokens = jax.random.randint(jax.random.fold_in(key, W), (B, W), 0, head_cfg.vocab_size)
        tokens = tokens.at[:, 0].set(first)
        hidden, _ = target.step(target.params, jax.tree.map(jnp.copy, state), tokens, lengths)
        logits = lm_head(lm, hidden[:, 0], cfg=head_cfg)
        if W == 1:
            one_hidden, one_logits = hidden[:, 0], logits
            continue
        emit(dict(compare(f"{name}_hidden", W, B * W, hidden[:, 0], one_hidden), **extra))
        emit(dict(compare(f"{name}_logits", W, B * W, logits, one_logits), **extra))


def reference_steps(setup: bg.Setup, shapes: Shapes, key: jax.Array, emit) -> None:
    """The reference target's whole step: row 0 of a W-row step against the one-row step."""
    cfg, B = setup.tcfg, shapes.batch
    prompts, lengths = bg.random_prompts(B, shapes.context, cfg.vocab_size, 0)
    for prec, head in setup.heads.items():
        target = bg.gen.reference_target(cfg, setup.layers, head)
        hcfg = cfg.lm_head_config()
        steps_row0(target, head, hcfg, prompts, lengths, 7, shapes, key, "step", emit, head=prec)


def pair_ops_and_steps(shapes: Shapes, key: jax.Array, emit) -> None:
    """The shipped pair's GDN ops at its shapes, and its whole step at row 0."""
    tcfg, target, head, _, _, _ = bg.shipped_pair(max(shapes.widths))
    B = shapes.batch
    ks = (jax.random.fold_in(key, i) for i in range(10**6))
    Hv, dk, dv = tcfg.linear_num_value_heads, tcfg.linear_key_head_dim, tcfg.linear_value_head_dim
    C, Kc = tcfg.conv_dim, tcfg.linear_conv_kernel_dim
    conv_w = 0.3 * jax.random.normal(next(ks), (C, 1, Kc), jnp.float32)
    s0 = 0.1 * jax.random.normal(next(ks), (B, Hv, dk, dv), jnp.float32)
    hist = jax.random.normal(next(ks), (B, Kc - 1, C), jnp.float32)
    for W in shapes.widths:
        qk = jax.random.normal(next(ks), (B, W, Hv, dk), jnp.float32)
        mixed = jax.random.normal(next(ks), (B, W, C), jnp.float32)
        for impl in ("xla", "auto"):
            fn = functools.partial(l2_normalize, implementation=impl)
            emit(rowwise(f"gdn_l2_normalize_{impl}", fn, (qk,), W))
        # The conv reads the history before each row; row r alone sees the rows before it as
        # history, so compare row 0 (the committed token's) only.
        conv = jax.jit(lambda m: causal_conv(jnp.concatenate([hist, m], axis=1), conv_w))
        emit(compare("gdn_causal_conv_row0", W, B * W, conv(mixed)[:, 0], conv(mixed[:, :1])[:, 0]))
        q = l2_normalize(qk)
        k = l2_normalize(jax.random.normal(next(ks), (B, W, Hv, dk), jnp.float32))
        v = jax.random.normal(next(ks), (B, W, Hv, dv), jnp.float32)
        g = -jnp.abs(jax.random.normal(next(ks), (B, W, Hv), jnp.float32))
        beta = jax.nn.sigmoid(jax.random.normal(next(ks), (B, W, Hv), jnp.float32))
        for impl in ("xla", "auto"):
            rule = jax.jit(functools.partial(recurrent_delta_rule, implementation=impl))
            o_all, st_all = rule(q, k, v, g, beta, s0)
            o_one, st_one = rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], s0)
            name = f"gdn_delta_rule_{impl}_row0"
            emit(compare(f"{name}_out", W, B * W, o_all[:, 0], o_one[:, 0]))
            emit(compare(f"{name}_state", W, B * W, st_all[:, 0], st_one[:, 0]))

    prompts, lengths, _ = bg.text_prompts(tcfg, B, 64, 0)
    hcfg, first = tcfg.lm_head_config(), prompts[:, -1]
    steps_row0(target, head, hcfg, prompts, lengths, first, shapes, key, "pair_step", emit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--sections", default="ops,steps,pair")
    ap.add_argument("--layers", type=int, default=None, help="reference target layers")
    args = ap.parse_args(argv)
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    shapes = Shapes(**(SMOKE if args.smoke else GPU))
    if args.layers:
        shapes.layers = args.layers
    sections = args.sections.split(",")
    records: list[dict] = []
    run = harness.run_info("benchmarks.row_invariance", sys.argv[1:] if argv is None else argv)

    def emit(rec):
        records.append(rec)
        mark = "equal" if rec.get("equal") else f"DIFFER ({rec.get('mismatches')})"
        print(f"{rec['what']:28s} W={rec['width']} rows={rec['rows']:4d} {mark}", flush=True)
        harness.write_records(args.json, records, run)

    key = jax.random.key(0)
    t0 = time.time()
    if "ops" in sections or "steps" in sections:
        setup = bg.build_setup(layers=shapes.layers, heads=["bf16", "nvfp4"], smoke=args.smoke)
        if "ops" in sections:
            reference_ops(setup, shapes, key, emit)
        if "steps" in sections:
            reference_steps(setup, shapes, key, emit)
        del setup
    if "pair" in sections:
        pair_ops_and_steps(shapes, key, emit)
    print(f"{len(records)} records in {time.time() - t0:.0f} s")
    harness.write_records(args.json, records, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
