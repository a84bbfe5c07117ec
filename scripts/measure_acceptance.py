"""Mean acceptance length of the shipped tiny pair on held-out code, per drafter precision,
hidden contract and number of drafts k.

    .venv/bin/python scripts/measure_acceptance.py \\
        --json benchmarks/results/acceptance_cpu.json

Inputs. The target is the shipped pair's (``mtpjax/assets/tiny_pair``), a Qwen3.5-architecture
model run by ``mtpjax.hybrid``. The drafters are its MTP head converted with
``mtpjax.checkpoint.convert`` into a temporary directory at each precision (BF16 keeps the
stored values); they read the converted embedding and LM head, as a quantised checkpoint ships
them, while the target verifies with its own BF16 head. The prompts are one window of
``--prompt-len`` tokens from the middle of each held-out standard-library file
(``mtpjax.demo.heldout_files``: the pair never saw them in training; the codec tables under
``encodings/`` are left out), keeping only files with room for the continuation;
``--max-snippets`` keeps that many, spread evenly over the list. All snippets decode as one batch.

What is measured. For every (k, precision, contract) the prompts are decoded greedily for
``--new-tokens`` tokens with ``mtpjax.generation.generate``, and once per k with
``generate_baseline(step_width=k + 1)``: the target alone, every target call shaped like a
verify step, so the two outputs must agree token for token (the module docstring of
``mtpjax/generation.py`` says why the step width matters). Each JSON record holds the mean
acceptance length (tokens emitted per round, the bonus token included), the per-position
acceptance rates, the draft acceptance rate, the target forwards after the prefill of both runs
and their difference, and whether the outputs are identical. A table of mean acceptance lengths
(rows precision x contract, columns k) is printed last. The exit status is 1 if any speculative
output differs from its baseline or the drafter's KV cache reports an error.

Two more modes, on the first given precision and contract (default BF16, post-norm):

``--mode sampled`` (``--temperatures 0.7,1.0``, ``--seeds``): the same prompts sampled at each
temperature with argmax drafts (one-hot ``q``: a draft is accepted with probability ``p(x)``)
and with sampled drafts (``generate(draft_sampling=True)``: drafts from the drafter's top
``--draft-top-k`` at the temperature, accepted with ``min(1, p/q)``). Both are exact, so there
is no baseline to match; each record holds the acceptance of one (k, temperature, drafts,
seed).

``--mode adaptive``: greedy, fixed k = 1..4 against the adaptive draft length
(``mtpjax.verify.draft_length``) with each K >= 2 of them, under each cost model. Step costs are measured first on this CPU at
B = 1 (shortest wall time of 30 calls of the target step plus LM head over n rows, n = 1..K+1, and of a
propose of k drafts), and a second, illustrative cost model has a verify linear in its rows (one
unit per row, the compute-bound limit) and a propose of 0.1 unit per draft. Each record holds the tokens per target forward (per
sequence: generated tokens after the first over the forwards it took part in) and the modelled
goodput (those tokens over the modelled cost of every sequence's rounds,
``draft_length.modelled_cost``); every run must equal the plain greedy output.

    .venv/bin/python scripts/measure_acceptance.py --mode sampled \\
        --json benchmarks/results/acceptance_sampled_cpu.json
    .venv/bin/python scripts/measure_acceptance.py --mode adaptive \\
        --json benchmarks/results/acceptance_adaptive_cpu.json

The JSON list is rewritten after every configuration, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from mtpjax import demo, hybrid, lm_head
from mtpjax import drafter as drafter_lib
from mtpjax import generation as gen
from mtpjax.checkpoint import convert, load_drafter
from mtpjax.config import HiddenContract
from mtpjax.train import heldout_prompts
from mtpjax.verify import draft_length

PRECISIONS = demo.PRECISIONS  # bf16, fp8, nvfp4
CONTRACTS = tuple(c.value for c in HiddenContract)


# ------------------------------------------------------------------------------------------
# Inputs.


def heldout_snippets(
    tokenizer: Any, *, prompt_len: int, new_tokens: int, max_snippets: int | None
) -> tuple[np.ndarray, list[str]]:
    """(int32[B, prompt_len] prompts, their file names): one window from the middle of each
    held-out file with at least ``prompt_len + new_tokens + 2`` tokens, at most ``max_snippets``
    of them spread evenly over the list (``mtpjax.train.heldout_prompts``, which the
    fine-tuning's before/after evaluation uses too)."""
    return heldout_prompts(
        tokenizer, prompt_len=prompt_len, new_tokens=new_tokens, max_snippets=max_snippets
    )


def load_drafters(precisions: list[str], *, scratch: Path) -> dict[str, tuple]:
    """precision -> (drafter config, drafter params, the head the drafter reads): the shipped
    head converted into ``scratch`` at each precision."""
    out = {}
    for precision in precisions:
        convert(demo.ASSET_DIR, scratch / precision, precision=precision, progress=False)
        dcfg, ckpt = load_drafter(scratch / precision)
        out[precision] = (dcfg, ckpt.modules[0], ckpt.head)
    return out


# ------------------------------------------------------------------------------------------
# Presentation.


def _finite(x: float, digits: int = 4) -> float | None:
    return round(float(x), digits) if math.isfinite(x) else None


def _acceptance(m) -> dict[str, Any]:
    """The acceptance fields of a record, from ``SpecDecodeMetrics``."""
    return dict(
        mean_acceptance_length=_finite(m.mean_acceptance_length()),
        per_position_acceptance=[_finite(x) for x in m.acceptance_rate_per_pos()],
        draft_acceptance_rate=_finite(m.draft_acceptance_rate()),
    )


def table(records: list[dict[str, Any]]) -> str:
    """Markdown table of mean acceptance lengths: rows precision x contract, columns k. A cell
    whose speculative output differed from the baseline is marked ``(differs!)``."""
    ks = sorted({r["k"] for r in records})
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        rows.setdefault((r["precision"], r["contract"]), {})[r["k"]] = r
    lines = [
        "| precision | contract | " + " | ".join(f"k={k}" for k in ks) + " |",
        "|---|---|" + "---:|" * len(ks),
    ]
    for (precision, contract), by_k in rows.items():
        cells = []
        for k in ks:
            r = by_k.get(k)
            if r is None:
                cells.append("")
                continue
            mal = r["mean_acceptance_length"]
            cell = "n/a" if mal is None else f"{mal:.2f}"
            cells.append(cell if r["identical"] else f"{cell} (differs!)")
        lines.append(f"| {precision} | {contract} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Driver.


def _names(allowed: tuple[str, ...]):
    def parse(s: str) -> list[str]:
        out = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in out if x not in allowed]
        if bad or not out:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(allowed)}"
            )
        return out

    return parse


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _floats(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {s!r}")
    return out


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    p.add_argument(
        "--mode",
        choices=("greedy", "sampled", "adaptive"),
        default="greedy",
        help="greedy: the precision x contract x k table (default); sampled: argmax against "
        "sampled drafts at --temperatures; adaptive: fixed k against the adaptive draft length",
    )
    p.add_argument(
        "--temperatures", type=_floats, default=[0.7, 1.0], help="sampled mode (0.7,1.0)"
    )
    p.add_argument("--seeds", type=_positive, default=2, help="sampled mode: runs per point (2)")
    p.add_argument(
        "--cost-repeats", type=_positive, default=30,
        help="adaptive mode: timed calls per step cost, the fastest kept (30)",
    )  # fmt: skip
    p.add_argument("--draft-top-k", type=_positive, default=64, help="sampled drafts' support (64)")
    p.add_argument("--ks", type=_ints, default=[1, 2, 3, 4], help="drafts per round (1,2,3,4)")
    p.add_argument(
        "--precisions",
        type=_names(PRECISIONS),
        default=list(PRECISIONS),
        help=f"drafter precisions ({','.join(PRECISIONS)})",
    )
    p.add_argument(
        "--contracts",
        type=_names(CONTRACTS),
        default=list(CONTRACTS),
        help=f"hidden contracts ({','.join(CONTRACTS)})",
    )
    p.add_argument("--prompt-len", type=_positive, default=64, help="prompt tokens (64)")
    p.add_argument("--new-tokens", type=_positive, default=128, help="tokens generated (128)")
    p.add_argument(
        "--max-snippets", type=_positive, default=None, help="at most this many prompts (all)"
    )
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------
# Sampled drafts and the adaptive draft length.


def _write(args, records):
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")


def run_sampled(args, tcfg, target, head, drafters, prompts, lengths, common) -> int:
    """Argmax against sampled drafts at each temperature and k; returns the exit status."""
    precision, contract = args.precisions[0], args.contracts[0]
    dcfg, params, drafter_head = drafters[precision]
    records: list[dict[str, Any]] = []
    B = prompts.shape[0]
    total = len(args.ks) * len(args.temperatures) * 2 * args.seeds
    with tqdm(total=total, desc="configurations", unit="cfg") as bar:
        for k in args.ks:
            model = hybrid.target_model(tcfg, target, head, max_step=k + 1)
            for temperature in args.temperatures:
                for drafts in ("argmax", "sampled"):
                    for seed in range(args.seeds):
                        t0 = time.perf_counter()
                        out = jax.device_get(
                            gen.generate(
                                model, params, head, prompts, lengths, drafter_cfg=dcfg,
                                num_drafts=k, drafter_head=drafter_head,
                                hidden_contract=contract, temperature=temperature,
                                key=jax.random.key(seed), draft_sampling=drafts == "sampled",
                                draft_top_k=args.draft_top_k, **common,
                            )
                        )  # fmt: skip
                        m = out.metrics
                        records.append(
                            dict(
                                mode="sampled",
                                precision=precision,
                                contract=contract,
                                k=k,
                                temperature=temperature,
                                drafts=drafts,
                                draft_top_k=args.draft_top_k if drafts == "sampled" else None,
                                seed=seed,
                                **_acceptance(m),
                                num_drafts=int(m.num_drafts),
                                target_steps=int(out.target_steps),
                                num_snippets=B,
                                prompt_len=args.prompt_len,
                                new_tokens=args.new_tokens,
                                seconds=round(time.perf_counter() - t0, 2),
                            )
                        )
                        _write(args, records)
                        bar.update()
    print(f"\nMean acceptance length, {precision} {contract}, mean over {args.seeds} seeds:\n")
    print("| k | T | argmax drafts | sampled drafts |\n|---:|---:|---:|---:|")
    for k in args.ks:
        for t in args.temperatures:
            cells = []
            for drafts in ("argmax", "sampled"):
                v = [
                    r["mean_acceptance_length"]
                    for r in records
                    if (r["k"], r["temperature"], r["drafts"]) == (k, t, drafts)
                ]
                cells.append(f"{np.mean(v):.2f}")
            print(f"| {k} | {t} | " + " | ".join(cells) + " |")
    return 0


def _fastest_ms(fn, state, repeats: int):
    """Shortest wall time (ms) of ``state = fn(state)`` after warm-up calls: on a CPU shared
    with other work the minimum is the stable estimate of the call's own cost."""
    for _ in range(3):
        state = jax.block_until_ready(fn(state))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        times.append(1e3 * (time.perf_counter() - t0))
    return float(np.min(times))


def measure_costs(
    tcfg, target, head, drafter, prompt, *, max_k: int, repeats: int
) -> dict[str, Any]:
    """CPU step costs at B = 1 (ms), each the fastest of ``repeats`` calls: verify[n] = the
    target step plus its LM head over n + 1 rows (n = 0..K; a model keeping n + 1 snapshots, as
    a run of k = n uses), propose[k] = a propose of k drafts (k = 1..K)."""
    dcfg, params, drafter_head = drafter
    head_cfg = tcfg.lm_head_config()
    P = prompt.shape[1]
    lengths = jnp.full((1,), P, jnp.int32)
    verify = []
    for rows in range(1, max_k + 2):
        model = hybrid.target_model(tcfg, target, head, max_step=rows)
        cache = model.init_cache(1, P + rows + 1)
        hidden, cache = model.prefill(model.params, cache, prompt, lengths)
        window = jnp.broadcast_to(prompt[:, -1:], (1, rows))

        # The weights and the window are arguments, as in generate's loop: closed over (or
        # bound as defaults), XLA folds them into the program as constants, which costs
        # seconds of compilation per step and is not the step generate runs.
        @jax.jit
        def step(weights, head, cache, window, call=model.step):
            h, cache = call(weights, cache, window, lengths)
            logits = lm_head(head, h.reshape(-1, h.shape[-1]), cfg=head_cfg)
            return cache, jnp.sum(logits)

        run = functools.partial(step, model.params, head, window=window)
        verify.append(_fastest_ms(lambda c, run=run: run(c[0]), (cache, 0.0), repeats))
    pool = drafter_lib.pool_config(dcfg, precision="bf16", max_seq_len=P + 8, max_seqs=1)
    propose = []
    for k in range(1, max_k + 1):
        # Committed like the states propose returns: the first call compiles the timed program.
        state = jax.device_put(drafter_lib.init_state(pool, num_seqs=1), jax.devices()[0])
        window = drafter_lib.Pairs(
            tokens=prompt[:, -1:], hidden=hidden[:, -1:], count=jnp.ones((1,), jnp.int32),
            start=lengths - 1,
        )  # fmt: skip

        def call(state, k=k, window=window):
            return drafter_lib.propose(params, drafter_head, state, window, cfg=dcfg, num_drafts=k)[
                1
            ]

        propose.append(_fastest_ms(call, state, repeats))
    return dict(verify_ms=[round(v, 4) for v in verify], propose_ms=[round(v, 4) for v in propose])


def run_adaptive(args, tcfg, target, head, drafters, prompts, lengths, common) -> int:
    """Greedy: fixed k against the adaptive draft length under two cost models."""
    precision, contract = args.precisions[0], args.contracts[0]
    dcfg, params, drafter_head = drafters[precision]
    K = max(args.ks)
    costs = measure_costs(
        tcfg, target, head, drafters[precision], prompts[:1], max_k=K, repeats=args.cost_repeats
    )
    print(f"CPU costs at B = 1 (ms): {costs}", file=sys.stderr, flush=True)
    models = {
        "cpu": lambda k: draft_length.DraftLengthPolicy(
            verify_cost=tuple(costs["verify_ms"][: k + 1]), propose_cost=costs["propose_ms"][k - 1]
        ),
        "linear": lambda k: draft_length.DraftLengthPolicy(
            verify_cost=tuple(float(n + 1) for n in range(k + 1)), propose_cost=0.1 * k
        ),
    }
    B = prompts.shape[0]
    runs = [("fixed", k, None) for k in args.ks]
    runs += [("adaptive", k, m) for k in args.ks if k > 1 for m in models]
    records: list[dict[str, Any]] = []
    ok = True
    bases = {}
    for policy_name, k, cost_model in tqdm(runs, desc="configurations", unit="cfg"):
        model = hybrid.target_model(tcfg, target, head, max_step=k + 1)
        if k not in bases:
            bases[k] = jax.device_get(
                gen.generate_baseline(model, head, prompts, lengths, step_width=k + 1, **common)
            )
        t0 = time.perf_counter()
        policy = None if cost_model is None else models[cost_model](k)
        out = jax.device_get(
            gen.generate(
                model, params, head, prompts, lengths, drafter_cfg=dcfg, num_drafts=k,
                drafter_head=drafter_head, hidden_contract=contract, draft_length=policy,
                **common,
            )
        )  # fmt: skip
        identical = bool(np.array_equal(out.tokens, bases[k].tokens))
        ok &= identical
        m = out.metrics
        tokens = int(np.sum(out.lengths) - B)  # after the prefill's token
        forwards = int(np.sum(out.active_steps))
        record = dict(
            mode="adaptive",
            policy=policy_name,
            cost_model=cost_model,
            k=k,
            precision=precision,
            contract=contract,
            tokens=tokens,
            sequence_forwards=forwards,
            target_steps=int(out.target_steps),
            tokens_per_target_forward=round(tokens / forwards, 4),
            num_proposed_tokens=int(m.num_proposed_tokens),
            num_draft_tokens=int(m.num_draft_tokens),
            num_accepted_tokens=int(m.num_accepted_tokens),
            num_rounds_per_sent=np.asarray(m.num_rounds_per_sent).tolist(),
            identical=identical,
            num_snippets=B,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            costs_ms=costs,
            seconds=round(time.perf_counter() - t0, 2),
        )
        for name, make in models.items():
            cost = draft_length.modelled_cost(m.num_rounds_per_sent, policy=make(k))
            record[f"goodput_{name}"] = round(tokens / cost, 5)
        records.append(record)
        _write(args, records)
    print(f"\nGreedy, {precision} {contract}; goodput in tokens per modelled unit:\n")
    print(
        "| run | tokens / forward | drafts sent / proposed | goodput (CPU ms) | goodput (linear) |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in records:
        name = (
            f"k={r['k']}" if r["policy"] == "fixed" else f"adaptive K={r['k']} ({r['cost_model']})"
        )
        sent = r["num_draft_tokens"] / max(r["num_proposed_tokens"], 1)
        print(
            f"| {name} | {r['tokens_per_target_forward']:.2f} | {sent:.2f} | "
            f"{r['goodput_cpu']:.4f} | {r['goodput_linear']:.4f} |"
        )
    if not ok:
        print("FAILED: an adaptive or fixed-k output differs from greedy decoding")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = Tokenizer.from_file(str(demo.ASSET_DIR / "tokenizer.json"))
    snippets, files = heldout_snippets(
        tokenizer,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        max_snippets=args.max_snippets,
    )
    B = len(files)
    print(f"{B} held-out snippets: {', '.join(files)}", file=sys.stderr, flush=True)
    prompts = jnp.asarray(snippets)  # [B, P]
    lengths = jnp.full((B,), args.prompt_len, jnp.int32)

    tcfg = hybrid.HybridConfig.from_hf(demo.ASSET_DIR)
    target, head = hybrid.load(demo.ASSET_DIR, cfg=tcfg)
    common = dict(head_cfg=tcfg.lm_head_config(), max_new_tokens=args.new_tokens)

    if args.mode != "greedy":
        with tempfile.TemporaryDirectory(prefix="mtpjax-acceptance-") as scratch:
            drafters = load_drafters(args.precisions[:1], scratch=Path(scratch))
            run = run_sampled if args.mode == "sampled" else run_adaptive
            return run(args, tcfg, target, head, drafters, prompts, lengths, common)

    records: list[dict[str, Any]] = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="mtpjax-acceptance-") as scratch:
        drafters = load_drafters(args.precisions, scratch=Path(scratch))
        total = len(args.ks) * len(args.precisions) * len(args.contracts)
        with tqdm(total=total, desc="configurations", unit="cfg") as bar:
            for k in args.ks:
                # The state keeps the GDN layers' states after each of a step's k + 1 rows.
                model = hybrid.target_model(tcfg, target, head, max_step=k + 1)
                base = jax.device_get(
                    gen.generate_baseline(model, head, prompts, lengths, step_width=k + 1, **common)
                )
                for precision in args.precisions:
                    dcfg, params, drafter_head = drafters[precision]
                    for contract in args.contracts:
                        bar.set_postfix_str(f"k={k} {precision} {contract}")
                        t0 = time.perf_counter()
                        out = jax.device_get(
                            gen.generate(
                                model,
                                params,
                                head,
                                prompts,
                                lengths,
                                drafter_cfg=dcfg,
                                num_drafts=k,
                                drafter_head=drafter_head,
                                hidden_contract=contract,
                                **common,
                            )
                        )
                        identical = bool(
                            np.array_equal(out.tokens, base.tokens)
                            and np.array_equal(out.lengths, base.lengths)
                        )
                        kv_ok = not np.any(out.kv_error)
                        ok &= identical and kv_ok
                        m = out.metrics
                        records.append(
                            dict(
                                precision=precision,
                                contract=contract,
                                k=k,
                                **_acceptance(m),
                                target_steps=int(out.target_steps),
                                baseline_steps=int(base.target_steps),
                                target_forwards_saved=int(base.target_steps - out.target_steps),
                                identical=identical,
                                kv_error=not kv_ok,
                                num_snippets=B,
                                prompt_len=args.prompt_len,
                                new_tokens=args.new_tokens,
                                seconds=round(time.perf_counter() - t0, 2),
                            )
                        )
                        if not identical:
                            tqdm.write(f"k={k} {precision} {contract}: differs from the baseline")
                        if args.json is not None:
                            args.json.parent.mkdir(parents=True, exist_ok=True)
                            args.json.write_text(json.dumps(records, indent=1) + "\n")
                        bar.update()

    print(
        f"\nMean acceptance length (tokens per round, bonus included), greedy, {B} held-out "
        f"snippets, {args.prompt_len} prompt + {args.new_tokens} new tokens:\n"
    )
    print(table(records))
    if args.json is not None:
        print(f"\nwrote {len(records)} records to {args.json}")
    if not ok:
        print("FAILED: a speculative output differs from greedy decoding or the KV cache erred")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
