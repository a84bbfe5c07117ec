"""Train the shipped tiny target model and its MTP head jointly on the Python standard library.

The corpus is the ``.py`` source of the running interpreter's standard library (site-packages
excluded), text none of us wrote. Files are split into train / held-out by a hash of their
relative path, so the split is fixed across machines and runs; the held-out list is written out.
A byte-level BPE tokenizer is trained on the train files only.

The target is ``mtpjax.reference.target`` (Qwen3-Next-style, dense); the MTP head is the
library's drafter (``mtpjax.drafter``), predicting token_{t+2} from (token_{t+1}, hidden_t):

    loss = CE(lm_head(h_t), x_{t+1}) + mtp_weight * CE(drafter(x_{t+1}, h_t), x_{t+2})

as in DeepSeek-V3 (mtp_weight 0.3). The MTP loss also trains the shared trunk, embedding and
LM head. AdamW with linear warmup and cosine decay; F32 master weights, BF16 matmuls on GPU.

When ``--steps`` is not given, the step count is chosen after timing a few steps so training
fits ``--minutes`` (and at most ``--max-epochs`` passes over the train tokens); the chosen count
is written to the log, and ``--steps N`` reproduces the run exactly.

Output (Hugging Face layout): config.json, model.safetensors (bf16 ``model.*``, ``lm_head``,
``mtp.*``), tokenizer.json, heldout_files.txt, training_log.json, loss_curve.png.

    PYTHONPATH=. python3 scripts/train_tiny_pair.py --out /tmp/tiny_pair --size small --minutes 5
    PYTHONPATH=. python3 scripts/train_tiny_pair.py --out /tmp/smoke --smoke
    PYTHONPATH=. python3 scripts/train_tiny_pair.py --evaluate mtpjax/assets/tiny_pair
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    from tqdm import tqdm
except ImportError:  # a bare GPU image: keep training, report progress in plain lines

    class tqdm:
        def __init__(self, total=None, desc="", **_):
            self.total, self.n, self.desc = total, 0, desc

        def update(self, n=1):
            self.n += n
            if self.n % 100 == 0:
                print(f"{self.desc} {self.n}/{self.total}", flush=True)

        def set_postfix(self, **kw):
            print(f"{self.desc} {self.n}/{self.total} {kw}", flush=True)

        def refresh(self):
            pass

        def close(self):
            pass


from mtpjax import drafter as drafter_lib
from mtpjax.config import DrafterConfig, LMHeadConfig
from mtpjax.head import init_lm_head, lm_head
from mtpjax.reference import hf_io
from mtpjax.reference import target as target_lib
from mtpjax.reference.target import TargetConfig

EOS = "<|endoftext|>"
HELDOUT_PER_MILLE = 40  # ~4% of the files, chosen by a hash of their relative path

SIZES: dict[str, dict[str, int]] = {
    # Seconds on a laptop CPU; only checks that everything runs end to end.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=192,
        vocab_size=512,
    ),
    # The shipped pair: ~14M parameters, under 32 MB in bf16 with the tokenizer.
    "small": dict(
        hidden_size=384,
        num_hidden_layers=5,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=4096,
    ),
}


# ------------------------------------------------------------------------------------------
# Corpus.


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_test_file(parts: tuple[str, ...]) -> bool:
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith(
        "test_"
    )


def is_heldout(rel: str) -> bool:
    """The fixed split: a file is held out iff its path hash falls in the first 4%."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def collect_files(
    root: Path, *, include_tests: bool, max_files: int | None
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], int]:
    """(train, heldout) lists of (relative path, text), and the count of undecodable files."""
    train, heldout, skipped = [], [], 0
    for path in sorted(root.rglob("*.py")):
        rel_parts = path.relative_to(root).parts
        if any(p in ("site-packages", "dist-packages") for p in rel_parts):
            continue
        if not include_tests and _is_test_file(rel_parts):
            continue
        rel = "/".join(rel_parts)
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1  # a few test fixtures are deliberately not UTF-8
            continue
        if not text.strip():
            continue
        (heldout if is_heldout(rel) else train).append((rel, text))
    if max_files is not None:
        # A small deterministic subset that keeps both sides non-empty (smoke runs).
        n_held = max(1, round(max_files * HELDOUT_PER_MILLE / 1000))
        train, heldout = train[: max_files - n_held], heldout[:n_held]
    if not train or not heldout:
        raise RuntimeError(f"no usable .py files under {root} (train={len(train)})")
    return train, heldout, skipped


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def pack(tok, texts: list[str]) -> np.ndarray:
    """All texts tokenized and concatenated, each followed by EOS: int32[N]."""
    eos = tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(texts):
        out.append(np.asarray(enc.ids, np.int32))
        out.append(np.asarray([eos], np.int32))
    return np.concatenate(out)


# ------------------------------------------------------------------------------------------
# Model, loss, steps.


def make_configs(
    size: str, *, max_position_embeddings: int, compute_dtype: str
) -> tuple[TargetConfig, DrafterConfig, LMHeadConfig]:
    tcfg = TargetConfig(
        **SIZES[size],
        partial_rotary_factor=0.25,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_position_embeddings,
        compute_dtype=compute_dtype,
    )
    return tcfg, tcfg.drafter_config(), tcfg.lm_head_config()


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def pair_losses(
    target, head, mtp, windows, *, tcfg, dcfg, hcfg
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Main and MTP losses on windows int32[B, T + 2] (positions 0..T-1 are the inputs)."""
    T = windows.shape[1] - 2
    inputs = windows[:, :T]
    hidden = target_lib.target_forward(target, head, inputs, cfg=tcfg, implementation="xla")
    # The main head reads the hidden in the trunk's compute dtype (BF16 matmuls when training
    # on GPU); the drafter reads the F32 hidden, as at inference.
    logits = lm_head(head, hidden.astype(tcfg.compute_dtype), cfg=hcfg, implementation="xla")
    main = _xent(logits, windows[:, 1 : T + 1])
    out = drafter_lib.drafter_forward(
        mtp, head, windows[:, 1 : T + 1], hidden, cfg=dcfg, head_cfg=hcfg, implementation="xla"
    )
    mtp_loss = _xent(out.logits, windows[:, 2 : T + 2])
    target_next = jnp.argmax(logits, -1)  # greedy prediction of x_{t+1}
    draft = jnp.argmax(out.logits, -1)  # drafter's prediction of x_{t+2}
    stats = dict(
        target_acc=jnp.mean(target_next == windows[:, 1 : T + 1]),
        mtp_acc=jnp.mean(draft == windows[:, 2 : T + 2]),
        # What greedy verification checks: does the draft equal the target's own argmax there?
        mtp_agree=jnp.mean(draft[:, :-1] == target_next[:, 1:]),
    )
    return jnp.mean(main), jnp.mean(mtp_loss), stats


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The jitted steps over F32 master leaves of (target, head, mtp) cast to their dtypes."""

    treedef: Any
    dtypes: tuple[Any, ...]
    tcfg: TargetConfig
    dcfg: DrafterConfig
    hcfg: LMHeadConfig
    mtp_weight: float
    batch: int
    seq_len: int
    weight_decay: float
    clip: float

    def unflatten(self, master):
        leaves = [m.astype(d) for m, d in zip(master, self.dtypes)]
        return jax.tree.unflatten(self.treedef, leaves)

    def optimizer(self, master) -> optax.GradientTransformation:
        # AdamW with the learning rate applied outside (so the schedule's length can be set
        # after timing); decay only matrices, never norms.
        mask = [m.ndim >= 2 for m in master]
        return optax.chain(
            optax.clip_by_global_norm(self.clip),
            optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
            optax.add_decayed_weights(self.weight_decay, mask=mask),
        )

    def loss(self, master, windows):
        target, head, mtp = self.unflatten(master)
        main, mtp_loss, stats = pair_losses(
            target, head, mtp, windows, tcfg=self.tcfg, dcfg=self.dcfg, hcfg=self.hcfg
        )
        return main + self.mtp_weight * mtp_loss, dict(main=main, mtp=mtp_loss, **stats)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
    def train_step(self, master, opt_state, data, key, lr):
        T = self.seq_len + 2
        starts = jax.random.randint(key, (self.batch,), 0, data.shape[0] - T)
        windows = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, T))(starts)
        (_, metrics), grads = jax.value_and_grad(self.loss, has_aux=True)(master, windows)
        updates, opt_state = self.optimizer(master).update(grads, opt_state, master)
        master = jax.tree.map(lambda p, u: p - lr * u, master, updates)
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))
        return master, opt_state, metrics

    @functools.partial(jax.jit, static_argnums=0)
    def eval_step(self, master, windows):
        return self.loss(master, windows)[1]


def lr_at(step: int, *, total: int, warmup: int, peak: float, floor: float = 0.1) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def heldout_windows(tokens: np.ndarray, *, seq_len: int, count: int) -> np.ndarray:
    """Up to ``count`` non-overlapping windows int32[n, seq_len + 2] spread evenly over the
    whole held-out stream (not its first files only: a few codec tables would dominate)."""
    T = seq_len + 2
    fit = len(tokens) // T
    if fit == 0:
        raise RuntimeError(f"held-out text has {len(tokens)} tokens, fewer than one window")
    slots = np.unique(np.linspace(0, fit - 1, min(count, fit)).round().astype(int))
    return np.stack([tokens[i * T : (i + 1) * T] for i in slots])


def evaluate_windows(trainer: Trainer, master, windows: np.ndarray) -> dict[str, float]:
    sums: dict[str, float] = {}
    n = 0
    for i in range(0, len(windows) - trainer.batch + 1, trainer.batch):
        m = jax.device_get(trainer.eval_step(master, jnp.asarray(windows[i : i + trainer.batch])))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n += 1
    if n == 0:  # fewer windows than a batch: one ragged call
        m = jax.device_get(trainer.eval_step(master, jnp.asarray(windows)))
        return {k: float(v) for k, v in m.items()}
    return {k: v / n for k, v in sums.items()}


# ------------------------------------------------------------------------------------------
# Acceptance: greedy speculative decoding with k drafts, chained on the drafter's own h_out.

# Quality is measured on the XLA reference path so a kernel under development elsewhere in the
# library cannot change the numbers.
XLA = dict(implementation="xla")


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "hcfg", "k"))
def _spec_round(target, head, mtp, cache, toks, hid, n, *, tcfg, dcfg, hcfg, k):
    """One propose + verify round for every sequence.

    toks: int32[B, M] committed tokens x_0..x_n (n[b] indexes the newest, whose hidden is not
    computed yet); hid: f32[B, M, H] the target's hidden at positions < n. Drafter row i is the
    pair (x_{i+1}, h_i); rows past the committed ones get padding positions so nothing sees them.
    Returns (toks, hid, n, cache, accepted int32[B]).
    """
    B, M = toks.shape
    b = jnp.arange(B)
    idx = jnp.arange(M)[None]
    row_tok = jnp.roll(toks, -1, axis=1)
    row_hid = hid
    drafts = []
    for j in range(k):
        positions = jnp.where(idx < (n + j)[:, None], idx, M + idx)
        out = drafter_lib.drafter_forward(
            mtp, head, row_tok, row_hid, cfg=dcfg, positions=positions, head_cfg=hcfg, **XLA
        )
        last = n - 1 + j
        d = jnp.argmax(out.logits[b, last], -1).astype(jnp.int32)
        drafts.append(d)
        row_tok = row_tok.at[b, n + j].set(d, mode="drop")
        row_hid = row_hid.at[b, n + j].set(out.h_out[b, last], mode="drop")
    drafts = jnp.stack(drafts, 1)  # [B, k]
    verify = jnp.concatenate([toks[b, n][:, None], drafts], 1)  # [B, k + 1]
    h, cache = target_lib.target_step(target, head, cache, verify, n, cfg=tcfg, **XLA)
    g = jnp.argmax(lm_head(head, h, cfg=hcfg, **XLA), -1).astype(
        jnp.int32
    )  # g_j predicts x_{n+1+j}
    accepted = jnp.sum(jnp.cumprod(drafts == g[:, :k], axis=1), axis=1).astype(jnp.int32)
    # Accepted drafts equal the target's argmax, so the new tokens are g_0..g_a.
    cols = n[:, None] + jnp.arange(k + 1)[None]
    toks = toks.at[b[:, None], cols + 1].set(g, mode="drop")
    hid = hid.at[b[:, None], cols].set(h, mode="drop")
    return toks, hid, n + accepted + 1, cache, accepted


@functools.partial(jax.jit, static_argnames=("tcfg", "hcfg"))
def _greedy_step(target, head, cache, last, pos, *, tcfg, hcfg):
    h, cache = target_lib.target_step(target, head, cache, last[:, None], pos, cfg=tcfg, **XLA)
    return jnp.argmax(lm_head(head, h[:, 0], cfg=hcfg, **XLA), -1).astype(jnp.int32), cache


def speculative_acceptance(
    target, head, mtp, prompts: np.ndarray, *, tcfg, dcfg, hcfg, new_tokens: int, k: int = 3
) -> dict[str, Any]:
    """Greedy speculative decoding of ``prompts`` int32[B, P]; also checks it equals plain
    greedy decoding token for token. Returns mean acceptance length and per-position rates."""
    B, P = prompts.shape
    M = P + new_tokens + k + 2
    cache = target_lib.init_cache(tcfg, batch=B, max_len=M)
    lengths = jnp.full((B,), P, jnp.int32)
    h, cache = target_lib.target_prefill(
        target, head, cache, jnp.asarray(prompts), lengths, cfg=tcfg, **XLA
    )
    first = jnp.argmax(lm_head(head, h[:, -1], cfg=hcfg, **XLA), -1).astype(jnp.int32)
    toks = jnp.zeros((B, M), jnp.int32).at[:, :P].set(prompts).at[:, P].set(first)
    hid = jnp.zeros((B, M, tcfg.hidden_size), jnp.float32).at[:, :P].set(h)
    n = jnp.full((B,), P, jnp.int32)
    accepted_hist = []
    while int(jnp.min(n)) < P + new_tokens:
        toks, hid, n, cache, acc = _spec_round(
            target, head, mtp, cache, toks, hid, n, tcfg=tcfg, dcfg=dcfg, hcfg=hcfg, k=k
        )
        active = np.asarray(n - acc - 1) < P + new_tokens  # rounds that started in range
        accepted_hist.append(np.where(active, np.asarray(acc), -1))
    acc = np.stack(accepted_hist, 1)  # [B, rounds], -1 = sequence already done
    valid = acc >= 0
    spec = np.asarray(toks)[:, : P + new_tokens + 1]

    # Plain greedy with the same target, for the exactness check.
    cache = target_lib.init_cache(tcfg, batch=B, max_len=M)
    _, cache = target_lib.target_prefill(
        target, head, cache, jnp.asarray(prompts), lengths, cfg=tcfg, **XLA
    )
    greedy = [prompts, np.asarray(first)[:, None]]
    last = first
    for pos in range(P, P + new_tokens):
        last, cache = _greedy_step(
            target, head, cache, last, jnp.full((B,), pos, jnp.int32), tcfg=tcfg, hcfg=hcfg
        )
        greedy.append(np.asarray(last)[:, None])
    greedy = np.concatenate(greedy, 1)
    per_pos = [float(np.mean(acc[valid] > j)) for j in range(k)]
    return dict(
        k=k,
        sequences=B,
        prompt_len=P,
        new_tokens=new_tokens,
        rounds=int(valid.sum()),
        mean_acceptance_length=float(1 + acc[valid].mean()),
        acceptance_rate_per_position=per_pos,
        matches_plain_greedy=bool(np.array_equal(spec, greedy)),
    )


def acceptance_snippets(
    directory: Path, tok, *, snippets: int, length: int
) -> tuple[np.ndarray, list[str]]:
    """One window int32[length] from the middle of each of up to ``snippets`` held-out files,
    spread evenly over the list. The codec tables under ``encodings/`` are left out: they are
    data, and their near-perfect predictability would inflate the numbers."""
    held = (directory / "heldout_files.txt").read_text().split()
    root = stdlib_root()
    pool = []
    for rel in held:
        if rel.startswith("encodings/") or not (root / rel).is_file():
            continue
        ids = np.asarray(tok.encode((root / rel).read_text(encoding="utf-8")).ids, np.int32)
        if len(ids) >= length:
            start = (len(ids) - length) // 2
            pool.append((rel, ids[start : start + length]))
    if not pool:
        raise RuntimeError(f"no held-out file under {root} has {length} tokens")
    pick = np.unique(np.linspace(0, len(pool) - 1, min(snippets, len(pool))).round().astype(int))
    return np.stack([pool[i][1] for i in pick]), [pool[i][0] for i in pick]


def measure_acceptance(directory: Path, *, snippets: int, prompt_len: int, new_tokens: int):
    """Teacher-forced and speculative greedy acceptance (k=3) of a saved pair on snippets of
    its held-out files, read from this interpreter's standard library."""
    from tokenizers import Tokenizer

    tcfg, target, head, dcfg, mtp = hf_io.load_hf(directory)
    hcfg = tcfg.lm_head_config()
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    windows, files = acceptance_snippets(
        directory, tok, snippets=snippets, length=prompt_len + new_tokens + 2
    )
    main, mtp_loss, stats = jax.jit(
        functools.partial(pair_losses, tcfg=tcfg, dcfg=dcfg, hcfg=hcfg)
    )(target, head, mtp, jnp.asarray(windows))
    return dict(
        files=files,
        teacher_forced=dict(
            main_loss=float(main),
            mtp_loss=float(mtp_loss),
            **{k: float(v) for k, v in stats.items()},
        ),
        speculative=speculative_acceptance(
            target,
            head,
            mtp,
            windows[:, :prompt_len],
            tcfg=tcfg,
            dcfg=dcfg,
            hcfg=hcfg,
            new_tokens=new_tokens,
        ),
    )


# ------------------------------------------------------------------------------------------
# Driver.


def plot_losses(log: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    train = log["train_curve"]
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["main"] for r in train], lw=1, alpha=0.8, label="train main (next token)")
    ax.plot(steps, [r["mtp"] for r in train], lw=1, alpha=0.8, label="train MTP (token t+2)")
    held = log["heldout_curve"]
    hs = [r["step"] for r in held]
    ax.plot(hs, [r["main"] for r in held], "o-", ms=3, label="held-out main")
    ax.plot(hs, [r["mtp"] for r in held], "s-", ms=3, label="held-out MTP")
    ax.axvline(log["saved_step"], color="grey", ls=":", lw=1, label="saved (best held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.set_title(f"tiny pair ({log['size']}): {log['tokens_seen'] / 1e6:.0f}M tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="output directory (Hugging Face layout)")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=None, help="default: fit --minutes")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock cap of the run")
    p.add_argument("--max-epochs", type=float, default=20.0, help="cap on passes over the data")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=None, help="default: ~25 evaluations")
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--no-tests", action="store_true", help="leave the stdlib test suites out")
    p.add_argument("--max-files", type=int, default=None, help="a deterministic file subset")
    p.add_argument("--measure-snippets", type=int, default=32, help="held-out acceptance runs")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--smoke", action="store_true", help="seconds on CPU: tiny model, few steps")
    p.add_argument("--evaluate", type=Path, default=None, help="measure a saved pair and exit")
    args = p.parse_args(argv)
    if args.smoke:
        args.size = "tiny"
        args.steps = args.steps or 6
        args.batch, args.seq_len = 4, 64
        args.max_files = args.max_files or 24
        args.warmup, args.eval_windows = 2, 4
        args.eval_every = args.eval_every or 3
    if args.evaluate is None and args.out is None:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.evaluate is not None:
        small = args.smoke
        result = measure_acceptance(
            args.evaluate,
            snippets=2 if small else args.measure_snippets,
            prompt_len=16 if small else 64,
            new_tokens=8 if small else 128,
        )
        print(json.dumps(result, indent=2))
        return 0

    t_start = time.perf_counter()
    deadline = t_start + 60 * args.minutes
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    compute_dtype = args.compute_dtype or ("bfloat16" if on_gpu else "float32")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    # ---- data ----
    root = stdlib_root()
    train_files, held_files, skipped = collect_files(
        root, include_tests=not args.no_tests, max_files=args.max_files
    )
    vocab = SIZES[args.size]["vocab_size"]
    tok = train_tokenizer([t for _, t in train_files], vocab)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab}")
    tok.save(str(out / "tokenizer.json"))
    (out / "heldout_files.txt").write_text("".join(f"{rel}\n" for rel, _ in held_files))
    train_tokens = pack(tok, [t for _, t in train_files])
    held_tokens = pack(tok, [t for _, t in held_files])
    t_data = time.perf_counter() - t_start
    print(
        f"corpus {root}: {len(train_files)} train / {len(held_files)} held-out files, "
        f"{len(train_tokens) / 1e6:.2f}M / {len(held_tokens) / 1e6:.2f}M tokens, "
        f"{sum(len(t) for _, t in train_files) / len(train_tokens):.2f} chars/token, "
        f"{t_data:.1f}s"
    )

    # ---- model ----
    tcfg, dcfg, hcfg = make_configs(
        args.size, max_position_embeddings=max(2048, args.seq_len * 2), compute_dtype=compute_dtype
    )
    k_t, k_h, k_d, k_data = jax.random.split(jax.random.key(args.seed), 4)
    target = target_lib.init(tcfg, key=k_t)
    head = init_lm_head(hcfg, key=k_h)
    mtp = drafter_lib.init(dcfg, key=k_d)
    leaves, treedef = jax.tree.flatten((target, head, mtp))
    master = [jnp.asarray(leaf, jnp.float32) for leaf in leaves]
    trainer = Trainer(
        treedef=treedef,
        dtypes=tuple(leaf.dtype for leaf in leaves),
        tcfg=tcfg,
        dcfg=dcfg,
        hcfg=hcfg,
        mtp_weight=args.mtp_weight,
        batch=args.batch,
        seq_len=args.seq_len,
        weight_decay=args.weight_decay,
        clip=1.0,
    )
    n_params = sum(int(np.prod(m.shape)) for m in master)
    opt_state = trainer.optimizer(master).init(master)
    data = jnp.asarray(train_tokens)
    held = heldout_windows(held_tokens, seq_len=args.seq_len, count=args.eval_windows)
    tokens_per_step = args.batch * args.seq_len
    epoch_cap = max(1, int(args.max_epochs * len(train_tokens) / tokens_per_step))

    # ---- train ----
    total = args.steps if args.steps is not None else epoch_cap
    calibrate = args.steps is None
    eval_every = args.eval_every or max(1, total // 25)
    train_curve: list[dict[str, float]] = []
    heldout_curve: list[dict[str, float]] = []
    pending: list[tuple[int, dict[str, jax.Array]]] = []
    best = (math.inf, None, -1)
    stopped_by_clock = False
    step = 0
    t_calib = None
    bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=2.0)

    def flush() -> None:
        for s, m in jax.device_get(pending):
            train_curve.append({"step": s, **{k: float(v) for k, v in m.items()}})
        pending.clear()

    def run_eval(s: int) -> None:
        nonlocal best
        m = evaluate_windows(trainer, master, held)
        heldout_curve.append({"step": s, **m})
        score = m["main"] + args.mtp_weight * m["mtp"]
        if score < best[0]:
            best = (score, jax.device_get(master), s)
        bar.set_postfix(held_main=f"{m['main']:.3f}", held_mtp=f"{m['mtp']:.3f}")

    while step < total:
        if time.perf_counter() > deadline:
            stopped_by_clock = True
            break
        lr = lr_at(step, total=total, warmup=args.warmup, peak=args.lr)
        master, opt_state, metrics = trainer.train_step(
            master, opt_state, data, jax.random.fold_in(k_data, step), jnp.float32(lr)
        )
        pending.append((step, {**metrics, "lr": jnp.float32(lr)}))
        step += 1
        bar.update(1)
        if calibrate and step == 3:
            jax.block_until_ready(master)
            t_calib = time.perf_counter()
        if calibrate and step == 23:
            jax.block_until_ready(master)
            per_step = (time.perf_counter() - t_calib) / 20
            # Leave room for the periodic evaluations and the final save.
            budget = deadline - time.perf_counter() - 20.0
            fit = step + int(0.93 * budget / per_step)
            total = max(step + 1, min(epoch_cap, fit))
            eval_every = args.eval_every or max(1, total // 25)
            bar.total = total
            bar.refresh()
            calibrate = False
        if len(pending) >= 10:
            flush()
        if step % eval_every == 0 or step == total:
            flush()
            run_eval(step)
    flush()
    bar.close()
    if not heldout_curve or heldout_curve[-1]["step"] != step:
        run_eval(step)
    t_train = time.perf_counter() - t_start - t_data

    # ---- save the best held-out checkpoint ----
    _, best_master, best_step = best
    target, head, mtp = trainer.unflatten([jnp.asarray(m) for m in best_master])
    target, head, mtp = jax.device_get((target, head, mtp))
    hf_io.save_hf(
        out,
        cfg=dataclasses.replace(tcfg, compute_dtype="float32"),
        target=target,
        head=head,
        drafter=mtp,
        extra_config=dict(
            bos_token_id=tok.token_to_id(EOS),
            eos_token_id=tok.token_to_id(EOS),
            torch_dtype="bfloat16",
        ),
    )
    weights_mb = (out / "model.safetensors").stat().st_size / 1e6
    tok_mb = (out / "tokenizer.json").stat().st_size / 1e6

    final = heldout_curve[-1]
    at_best = next(r for r in heldout_curve if r["step"] == best_step)
    log: dict[str, Any] = dict(
        size=args.size,
        argv=sys.argv[1:] if argv is None else list(argv),
        seed=args.seed,
        backend=jax.default_backend(),
        device=str(jax.devices()[0]),
        compute_dtype=compute_dtype,
        target_config=dataclasses.asdict(tcfg),
        parameters=n_params,
        weights_mb=weights_mb,
        tokenizer_mb=tok_mb,
        corpus=dict(
            root=str(root),
            python=sys.version.split()[0],
            include_tests=not args.no_tests,
            train_files=len(train_files),
            heldout_files=len(held_files),
            undecodable_files_skipped=skipped,
            train_tokens=len(train_tokens),
            heldout_tokens=len(held_tokens),
            vocab_size=vocab,
        ),
        steps=step,
        planned_steps=total,
        stopped_by_clock=stopped_by_clock,
        batch=args.batch,
        seq_len=args.seq_len,
        tokens_seen=step * tokens_per_step,
        epochs=step * tokens_per_step / len(train_tokens),
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        mtp_weight=args.mtp_weight,
        data_seconds=t_data,
        train_seconds=t_train,
        saved_step=best_step,
        heldout_at_saved_step=at_best,
        heldout_final=final,
        train_curve=train_curve,
        heldout_curve=heldout_curve,
    )
    plot_losses(log, out / "loss_curve.png")
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    if not args.smoke and args.measure_snippets > 0:
        # After everything is saved, so a failure here cannot lose the trained pair.
        try:
            log["acceptance"] = measure_acceptance(
                out, snippets=args.measure_snippets, prompt_len=64, new_tokens=128
            )
            print("acceptance:", json.dumps(log["acceptance"]))
        except Exception as err:  # report, keep the run's outputs
            log["acceptance_error"] = repr(err)
            print(f"acceptance measurement failed: {err!r}")
        (out / "training_log.json").write_text(json.dumps(log, indent=1))
    print(
        f"{step} steps ({log['epochs']:.1f} epochs, {t_train:.0f}s); saved step {best_step}: "
        f"held-out main {at_best['main']:.3f}, MTP {at_best['mtp']:.3f}, "
        f"MTP agrees with target {at_best['mtp_agree']:.3f}; "
        f"{weights_mb:.1f} MB weights + {tok_mb:.2f} MB tokenizer -> {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
