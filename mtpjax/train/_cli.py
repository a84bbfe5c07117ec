"""``mtpjax finetune`` (and ``scripts/finetune_mtp.py``): self-distilled multi-step fine-tuning
of a checkpoint's MTP head on its frozen target, from a Hugging Face directory to a fine-tuned
one, with held-out acceptance before and after.

    mtpjax finetune --out runs/ft                        # the shipped pair, the stdlib split
    mtpjax finetune --model DIR --prompts corpus/ --out runs/ft --steps 2000 --batch 32
    mtpjax finetune --out runs/v --init-head random --num-steps 1 --steps 3000 --lr 1e-3
    mtpjax finetune --model runs/v/hf --out runs/v3 --num-steps 3   # that head, 3 steps

1. The target (``mtpjax.hybrid``) and the MTP head, converted at BF16 (``OUT/source-bf16``:
   the head before fine-tuning, kept so the comparison can be reproduced). Training starts from
   that head, or with ``--init-head random`` from a fresh one of its shape (``drafter.init`` at
   the drafter config, keyed by ``--seed``; the frozen embedding and LM head are the
   checkpoint's either way). "Before" is the checkpoint's head in both cases, so a vanilla
   one-step head (``--init-head random --num-steps 1``) is the "before" of a second run that
   fine-tunes it (``--model RUN1/hf``: ``OUT/hf`` is a complete source directory).
2. Self-distilled data (``OUT/selfdistill.npz``, made once): ``--num-prompts`` windows of
   ``--prompt-len`` tokens from ``--prompts`` (default: the standard-library files outside the
   pair's ``heldout_files.txt``, the pair's training split), each continued by the target for
   ``--new-tokens`` tokens, greedy, or sampled at ``--sample-temperature`` for a
   ``--sampled-fraction`` of them. The loss counts the generated tokens (``--loss-on-prompt``:
   the prompt's too). The target's hidden states on these sequences are computed once.
3. Training (``mtpjax.train.train_step``): the K = ``--num-steps`` chain of ``propose``
   teacher-forced, step weights ``--step-weights`` (default FastMTP's 0.6^s normalised),
   ``--ce-weight`` x CE on the target's tokens + ``--kl-weight`` x KL to its distribution at
   ``--temperature``; AdamW on F32 masters of the head only. A progress bar on a terminal, a log
   line every ``--log-every`` steps; the train state saved (orbax, ``OUT/train_state``) every
   ``--save-every`` steps; a run finds its newest checkpoint there and resumes from it with the
   same batches (``--stop-after N`` ends a run after N steps of it, as an interruption would,
   exit status 3).
4. Output: ``OUT/hf`` (the source directory with the fine-tuned ``mtp.*`` tensors: ``mtpjax demo
   --model OUT/hf``), ``OUT/drafter-bf16`` (the converter's format: ``mtpjax.load_drafter``),
   ``OUT/loss_curve.png``, ``OUT/train_curve.json``, and ``OUT/finetune.json``: the settings,
   timings and the held-out greedy acceptance (k = ``--eval-ks``) of the head before and after,
   measured by one function (``mtpjax.train._evaluate.acceptance``) on the held-out prompts, at
   each of ``--eval-precisions`` (the converter's names; default ``bf16``): both heads are
   converted at it, embedding and LM head too (``OUT/source-<p>``, ``OUT/drafter-<p>``), and
   ``finetune.json``'s ``eval`` maps each precision to its ``before`` / ``after`` records (its
   top-level ``before`` / ``after`` are the BF16 ones when ``bf16`` is evaluated).

Memory (one H200, 141 GiB), a Qwen3.5-27B-sized head (hidden 5120, 24 / 4 heads of 256, FFN
17408): 424.7M trainable parameters (fc 52.4M, attention 104.9M, FFN 267.4M, norms); F32 masters
1.70 GB + F32 gradients 1.70 GB + AdamW moments 3.40 GB + the BF16 copy the forward reads 0.85
GB = 7.6 GB. Frozen: the embedding and LM head (248320 x 5120 each, 2.54 GB each in BF16, one
table when tied) and the 27B target (54 GB in BF16; with ``OUT``'s cached hidden states it is
only needed to make the data). The activations are dominated by the draft and target logits,
4 B x V per row and step: 8 sequences x 1024 tokens x 3 steps = 24.4 GB of F32 draft logits,
so B x N ~ 8k tokens per step fits beside the target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import demo, drafter, hybrid
from mtpjax.checkpoint import (
    MANIFEST_FILE,
    PRECISIONS,
    convert,
    load_drafter,
    parse_target_precision,
)
from mtpjax.config import HiddenContract
from mtpjax.train._data import heldout_prompts, self_distill, training_files, training_prompts
from mtpjax.train._evaluate import acceptance
from mtpjax.train._export import write_model_dir
from mtpjax.train._loss import LossConfig
from mtpjax.train._resume import CheckpointLog
from mtpjax.train._state import OptimConfig, Trainable, init_train_state, train_step
from mtpjax.train._target import hybrid_batch

__all__ = ["main", "parse_args"]

INTERRUPTED = 3  # exit status of a run ended by --stop-after (resume it with the same command)
# The converter's precisions but ``keep`` (a fine-tuned head is stored BF16: ``keep`` is ``bf16``).
EVAL_PRECISIONS = tuple(p for p in PRECISIONS if parse_target_precision(p) is not None)
_INIT_STREAM = 1 << 20  # folded into the seed's key for --init-head random (apart from the data's)
# The modules a run imports only where it first needs them (module: its pip package), looked
# for before the run starts so that a missing one does not end it after the data or training.
_DEFERRED_MODULES = {
    "orbax": "orbax-checkpoint",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
}
# The settings a resumed run must share with the run that wrote its checkpoints.
_RUN_KEYS = (
    "model",
    "prompts",
    "num_prompts",
    "prompt_len",
    "new_tokens",
    "sampled_fraction",
    "sample_temperature",
    "loss_on_prompt",
    "num_steps",
    "step_weights",
    "ce_weight",
    "kl_weight",
    "temperature",
    "hidden_contract",
    "init_head",
    "steps",
    "batch",
    "lr",
    "warmup",
    "weight_decay",
    "clip",
    "seed",
)


def _floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _ints(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _precisions(s: str) -> tuple[str, ...]:
    """``bf16,fp8,...`` -> the converter's names, each once, in the order given."""
    names = [x.strip() for x in s.split(",") if x.strip()]
    try:
        formats = [parse_target_precision(n) for n in names]
    except ValueError:
        formats = [None]
    if not names or None in formats:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(EVAL_PRECISIONS)} (fp4 is an alias "
            f"of nvfp4), got {s!r}"
        )
    return tuple(dict.fromkeys(f.value for f in formats))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=demo.ASSET_DIR, help="HF directory (shipped pair)")
    p.add_argument("--out", type=Path, required=True, help="run directory (resumed if it has one)")
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="a text file or a directory of .py/.txt files; default: the standard "
        "library files outside MODEL/heldout_files.txt",
    )
    g = p.add_argument_group("self-distilled data")
    g.add_argument("--num-prompts", type=int, default=256)
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--new-tokens", type=int, default=96, help="tokens the target generates")
    g.add_argument("--sampled-fraction", type=float, default=0.5, help="share sampled, not greedy")
    g.add_argument("--sample-temperature", type=float, default=1.0)
    g.add_argument("--gen-batch", type=int, default=32, help="prompts per generation call")
    g.add_argument("--loss-on-prompt", action="store_true", help="count the prompts' labels too")
    g = p.add_argument_group("loss")
    g.add_argument("--num-steps", type=int, default=3, help="K recursive steps trained (3)")
    g.add_argument("--step-weights", type=_floats, default=None, help="K weights (FastMTP's)")
    g.add_argument("--ce-weight", type=float, default=1.0)
    g.add_argument("--kl-weight", type=float, default=1.0, help="distillation weight (1.0)")
    g.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    g.add_argument(
        "--hidden-contract",
        choices=[c.value for c in HiddenContract],
        default=HiddenContract.POST_NORM.value,
    )
    g.add_argument(
        "--init-head",
        choices=("checkpoint", "random"),
        default="checkpoint",
        help="start from the checkpoint's head, or from a fresh random one of its shape (seeded "
        "by --seed); the frozen embedding and LM head are the checkpoint's either way",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=300)
    g.add_argument("--batch", type=int, default=8, help="sequences per step")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--warmup", type=int, default=30)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("run")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--save-every", type=int, default=50)
    g.add_argument("--stop-after", type=int, default=None, help="end after N steps of this run")
    g.add_argument("--eval-ks", type=_ints, default=(1, 2, 3, 4))
    g.add_argument("--eval-snippets", type=int, default=None, help="held-out prompts (all)")
    g.add_argument("--eval-prompt-len", type=int, default=64)
    g.add_argument("--eval-new-tokens", type=int, default=128)
    g.add_argument(
        "--eval-precisions",
        type=_precisions,
        default=("bf16",),
        help="both heads converted at each and evaluated: a comma list of "
        f"{','.join(EVAL_PRECISIONS)} (bf16)",
    )
    g.add_argument("--no-eval", action="store_true", help="skip the acceptance evaluation")


def parse_args(argv: list[str] | None, *, prog: str = "mtpjax finetune") -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    args = p.parse_args(argv)
    for name in (
        "num_prompts",
        "prompt_len",
        "new_tokens",
        "gen_batch",
        "num_steps",
        "steps",
        "batch",
        "log_every",
        "save_every",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.sampled_fraction <= 1:
        p.error(f"--sampled-fraction must be in [0, 1], got {args.sampled_fraction}")
    if args.batch > args.num_prompts:
        p.error(f"--batch {args.batch} is larger than --num-prompts {args.num_prompts}")
    return args


# ------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for key in _RUN_KEYS:
        value = getattr(args, key)
        out[key] = str(value) if isinstance(value, Path) else value
    if out["step_weights"] is not None:
        out["step_weights"] = list(out["step_weights"])
    return out


def _prompt_source(args, tokenizer) -> np.ndarray:
    """The ``--num-prompts`` training windows (module docstring, step 2)."""
    if args.prompts is None:
        files = training_files(args.model)
    elif args.prompts.is_dir():
        files = sorted(f for f in args.prompts.rglob("*") if f.suffix in (".py", ".txt"))
    else:
        files = [args.prompts]
    if not files:
        raise ValueError(f"--prompts {args.prompts}: no .py or .txt files")
    return training_prompts(
        tokenizer, files, count=args.num_prompts, prompt_len=args.prompt_len, seed=args.seed
    )


def _make_data(args, tcfg, target, head, tokenizer) -> np.ndarray:
    prompts = _prompt_source(args, tokenizer)
    n_sampled = round(args.sampled_fraction * len(prompts))
    model = hybrid.target_model(tcfg, target, head, max_step=1)
    key = jax.random.key(args.seed)
    parts = []
    for temperature, chunk in (
        (0.0, prompts[: len(prompts) - n_sampled]),
        (args.sample_temperature, prompts[len(prompts) - n_sampled :]),
    ):
        if len(chunk):
            parts.append(
                self_distill(
                    model,
                    head,
                    chunk,
                    head_cfg=tcfg.lm_head_config(),
                    new_tokens=args.new_tokens,
                    temperature=temperature,
                    key=jax.random.fold_in(key, len(parts)),
                    batch=min(args.gen_batch, len(chunk)),
                )
            )
    return np.concatenate(parts)


def _target_hidden(tcfg, target, head, sequences: np.ndarray, batch: int) -> np.ndarray:
    """The frozen target's hidden f32[n, L, H] on the sequences, computed once."""
    out = []
    mask = jnp.ones((batch, sequences.shape[1]), jnp.float32)
    for i in range(0, len(sequences), batch):
        chunk = sequences[i : i + batch]
        real = len(chunk)
        if real < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, axis=0)])
        b = hybrid_batch(target, head, jnp.asarray(chunk), mask, cfg=tcfg, with_logits=False)
        out.append(np.asarray(jax.device_get(b.hidden))[:real])
    return np.concatenate(out)


def batch_indices(seed: int, step: int, n: int, batch: int) -> np.ndarray:
    """The sequences of step ``step``: a pure function of (seed, step), so a resumed run draws
    the batches the uninterrupted one would."""
    return np.sort(np.random.default_rng([seed, step]).choice(n, batch, replace=False))


def _smooth(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over ``window`` steps (shorter at the start)."""
    c = np.cumsum(np.asarray(values, np.float64))
    lo = np.concatenate([np.zeros(window), c[:-window]]) if len(c) > window else np.zeros(len(c))
    return (c - lo[: len(c)]) / np.minimum(np.arange(1, len(c) + 1), window)


def _plot(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per-batch losses (faint) and their trailing means over ~5% of the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in curve]
    window = max(1, len(curve) // 20)
    series = [("weighted loss", [r["loss"] for r in curve], "black", "-")]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for key, ls in (("ce", "-"), ("kl", "--")):
        if key in curve[0]:
            for s in range(len(curve[0][key])):
                label = f"{key.upper()} step {s + 1}"
                series.append((label, [r[key][s] for r in curve], colors[s % len(colors)], ls))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, values, color, ls in series:
        ax.plot(steps, values, color=color, ls=ls, lw=0.6, alpha=0.2)
        ax.plot(steps, _smooth(values, window), color=color, ls=ls, lw=1.4, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"nats / token (faint: per batch; lines: mean of {window} steps)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cell(record: dict[str, Any]) -> str:
    mal = record["mean_acceptance_length"]  # None when no round was measured
    return ("-" if mal is None else f"{mal:.2f}") + ("" if record["identical"] else " (differs!)")


def _table(evals: dict[str, dict[str, list[dict[str, Any]]]], ks: tuple[int, ...]) -> str:
    """Markdown: a row per (precision, head), a column per k; a cell is the mean acceptance
    length, flagged when the speculative output differed from greedy decoding."""
    lines = [
        "| head | precision | " + " | ".join(f"k={k}" for k in ks) + " |",
        "|---|---|" + "---:|" * len(ks),
    ]
    for precision, by_head in evals.items():
        for name, records in by_head.items():
            lines.append(f"| {name} | {precision} | " + " | ".join(map(_cell, records)) + " |")
    return "\n".join(lines)


def _converted(model: Path, out: Path, precision: str = "bf16") -> Path:
    """The source head converted at ``precision`` into ``out`` (once: the source is the run's)."""
    if not (out / MANIFEST_FILE).is_file():
        convert(model, out, precision=precision, force=True, progress=False)
    return out


def main(argv: list[str] | None = None, *, prog: str = "mtpjax finetune") -> int:
    args = parse_args(argv, prog=prog)
    missing = [pkg for m, pkg in _DEFERRED_MODULES.items() if importlib.util.find_spec(m) is None]
    if missing:
        _log(f"{prog} needs {', '.join(missing)}: pip install {' '.join(missing)}")
        return 2
    t0 = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    settings = _run_settings(args)
    run_file = out / "run.json"
    if run_file.is_file():
        held = json.loads(run_file.read_text())
        changed = {k: (held.get(k), v) for k, v in settings.items() if held.get(k) != v}
        if changed:
            _log(
                f"{prog}: {out} holds a run with other settings (saved, given): {changed}; "
                "use another --out"
            )
            return 2
    run_file.write_text(json.dumps(settings, indent=1) + "\n")

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    tcfg = hybrid.HybridConfig.from_hf(args.model)
    target, head = hybrid.load(args.model, cfg=tcfg)
    dcfg, before = load_drafter(_converted(args.model, out / "source-bf16"))
    mtp, drafter_head = before.modules[0], before.head
    if args.init_head == "random":  # the drafter's own init; the frozen LM head stays
        key = jax.random.fold_in(jax.random.key(args.seed), _INIT_STREAM)
        mtp = drafter.init(dcfg, key=key, precision="bf16")
    hcfg = dcfg.lm_head_config()

    # ---- data ----
    data_file = out / "selfdistill.npz"
    if data_file.is_file():
        sequences = np.load(data_file)["tokens"]
    else:
        t = time.perf_counter()
        sequences = _make_data(args, tcfg, target, head, tokenizer)
        np.savez(data_file, tokens=sequences, prompt_len=args.prompt_len)
        _log(
            f"self-distilled {sequences.shape[0]} sequences of {args.prompt_len} + "
            f"{args.new_tokens} tokens in {time.perf_counter() - t:.1f}s"
        )
    t = time.perf_counter()
    hidden = _target_hidden(tcfg, target, head, sequences, min(args.gen_batch, len(sequences)))
    t_data = time.perf_counter() - t0
    _log(
        f"target hidden states cached ({hidden.nbytes / 2**20:.0f} MiB) in "
        f"{time.perf_counter() - t:.1f}s"
    )
    mask = np.ones(sequences.shape, np.float32)
    if not args.loss_on_prompt:
        mask[:, : args.prompt_len] = 0.0

    # ---- train state ----
    loss_cfg = LossConfig(
        num_steps=args.num_steps,
        step_weights=args.step_weights,
        ce_weight=args.ce_weight,
        kl_weight=args.kl_weight,
        temperature=args.temperature,
        hidden_contract=HiddenContract(args.hidden_contract),
    )
    optim_cfg = OptimConfig(
        lr=args.lr,
        total_steps=args.steps,
        warmup_steps=min(args.warmup, args.steps - 1),
        weight_decay=args.weight_decay,
        clip=args.clip,
    )
    trainable, master = Trainable.of(mtp)
    n_train = sum(int(m.size) for m in master)
    state = init_train_state(master, optim_cfg)
    ckpts = CheckpointLog(out / "train_state")
    curve_file = out / "train_curve.json"
    curve: list[dict[str, Any]] = []
    if ckpts.latest_step() is not None:
        state = ckpts.restore(state)
        start = int(state.step)
        if curve_file.is_file():
            curve = [r for r in json.loads(curve_file.read_text()) if r["step"] < start]
        _log(f"resumed from the checkpoint at step {start}")
    start = int(state.step)
    init = "a random init" if args.init_head == "random" else "the checkpoint's head"
    _log(
        f"training {n_train / 1e6:.2f}M parameters of the MTP head from {init} (F32 masters, "
        f"AdamW), frozen target / embedding / LM head; K = {args.num_steps} steps, weights "
        f"{[round(w, 3) for w in loss_cfg.weights]}, {args.batch} x {sequences.shape[1]} tokens "
        f"per step, steps {start}..{args.steps} on {jax.devices()[0].device_kind}"
    )

    from tqdm.auto import tqdm

    kw = dict(trainable=trainable, cfg=dcfg, loss_cfg=loss_cfg, optim_cfg=optim_cfg, head_cfg=hcfg)
    bar = tqdm(
        total=args.steps,
        initial=start,
        desc="finetune",
        unit="step",
        disable=not sys.stderr.isatty(),
        mininterval=1.0,
    )
    pending: list[tuple[int, dict]] = []
    t_train = time.perf_counter()

    def flush() -> None:
        for s, m in jax.device_get(pending):
            row = {"step": s}
            for k, v in m.items():
                v = np.asarray(v)
                row[k] = v.tolist() if v.ndim else float(v)
            curve.append(row)
        pending.clear()

    def checkpoint() -> None:
        flush()
        ckpts.save(state)
        curve_file.write_text(json.dumps(curve) + "\n")

    ran = 0
    try:
        for step in range(start, args.steps):
            idx = batch_indices(args.seed, step, len(sequences), args.batch)
            state, metrics = train_step(
                state,
                drafter_head,
                jnp.asarray(sequences[idx]),
                jnp.asarray(hidden[idx]),
                jnp.asarray(mask[idx]),
                **kw,
            )
            pending.append((step, metrics))
            ran += 1
            bar.update(1)
            done = step + 1
            if done % args.log_every == 0 or done == args.steps:
                flush()
                r = curve[-1]
                rate = (time.perf_counter() - t_train) / ran
                line = (
                    f"step {done}/{args.steps} loss {r['loss']:.4f} ce "
                    f"{'/'.join(f'{x:.3f}' for x in r['ce'])} acc "
                    f"{'/'.join(f'{x:.3f}' for x in r['acc'])} lr {r['lr']:.2e} "
                    f"|g| {r['grad_norm']:.3f} {rate:.2f}s/step"
                )
                bar.set_postfix(loss=f"{r['loss']:.4f}")
                if bar.disable:
                    _log(line)
                else:
                    bar.write(line)
            if done % args.save_every == 0 or done == args.steps:
                checkpoint()
            if args.stop_after is not None and ran >= args.stop_after and done < args.steps:
                checkpoint()
                bar.close()
                _log(
                    f"stopped after {ran} steps at step {done} (--stop-after); the same "
                    "command resumes"
                )
                return INTERRUPTED
    except KeyboardInterrupt:
        bar.close()
        try:  # the state is whole unless the interrupt came inside a step (its input donated)
            checkpoint()
            _log(
                f"interrupted at step {int(state.step)}; checkpoint saved, the same command resumes"
            )
        except Exception:  # any failure leaves the newest checkpoint on disk
            _log(
                f"interrupted inside a step; the same command resumes from step {ckpts.latest_step()}"
            )
        ckpts.close()
        return INTERRUPTED
    bar.close()
    ckpts.close()
    t_train = time.perf_counter() - t_train

    # ---- outputs ----
    params = jax.device_get(trainable.params(state.master))
    write_model_dir(args.model, out / "hf", params, dcfg, drafter_out=out / "drafter-bf16")
    _plot(
        curve,
        out / "loss_curve.png",
        f"MTP head fine-tune: K = {args.num_steps}, {args.steps} steps of {args.batch} "
        "self-distilled sequences",
    )
    result: dict[str, Any] = dict(
        settings=settings,
        device=jax.devices()[0].device_kind,
        trainable_parameters=n_train,
        sequences=list(sequences.shape),
        data_seconds=round(t_data, 1),
        train_seconds_this_run=round(t_train, 1),
        steps_this_run=ran,
        final=curve[-1] if curve else None,
    )
    if not args.no_eval:
        prompts, files = heldout_prompts(
            tokenizer,
            source=args.model,
            prompt_len=args.eval_prompt_len,
            new_tokens=args.eval_new_tokens,
            max_snippets=args.eval_snippets,
        )
        t = time.perf_counter()
        evals: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for precision in args.eval_precisions:
            after_dir = out / f"drafter-{precision}"
            if precision != "bf16":  # OUT/drafter-bf16 was converted with OUT/hf
                convert(out / "hf", after_dir, precision=precision, force=True, progress=False)
            heads = (
                ("before", _converted(args.model, out / f"source-{precision}", precision)),
                ("after", after_dir),
            )
            evals[precision] = {}
            for name, directory in heads:
                cfg_p, ckpt = load_drafter(directory)
                evals[precision][name] = acceptance(
                    tcfg,
                    target,
                    head,
                    cfg_p,
                    ckpt.modules[0],
                    ckpt.head,
                    prompts,
                    ks=args.eval_ks,
                    new_tokens=args.eval_new_tokens,
                    hidden_contract=HiddenContract(args.hidden_contract),
                )
        result |= dict(
            heldout_files=files,
            eval_precisions=list(args.eval_precisions),
            eval_seconds=round(time.perf_counter() - t, 1),
            eval=evals,
            **evals.get("bf16", {}),  # top-level "before" / "after": the BF16 drafters' records
        )
        print(
            "Held-out mean acceptance length (greedy; each head converted at the precision, "
            "its embedding and LM head too):\n" + _table(evals, args.eval_ks)
        )
        records = [r for v in evals.values() for rs in v.values() for r in rs]
        if not all(r["identical"] and not r["kv_error"] for r in records):
            (out / "finetune.json").write_text(json.dumps(result, indent=1) + "\n")
            _log("FAILED: a speculative output differs from greedy decoding")
            return 1
    (out / "finetune.json").write_text(json.dumps(result, indent=1) + "\n")
    precisions = dict.fromkeys(("bf16", *(() if args.no_eval else args.eval_precisions)))
    written = [out / "hf", *(out / f"drafter-{p}" for p in precisions), out / "finetune.json"]
    _log(f"wrote {', '.join(map(str, written))} ({time.perf_counter() - t0:.0f}s)")
    return 0
