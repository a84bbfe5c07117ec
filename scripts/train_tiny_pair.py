"""Train the shipped tiny target model and its MTP head jointly on the Python standard library.

The corpus is the ``.py`` source of the running interpreter's standard library (site-packages
excluded), text none of us wrote. Files are split into train / held-out by a hash of their
relative path, so the split is fixed across machines and runs; the held-out list is written out.
A byte-level BPE tokenizer is trained on the train files only.

The target is ``mtpjax.hybrid`` in the Qwen3.5 text architecture: per ``layer_types``, three of
every four layers are Gated DeltaNet (causal conv, gated delta rule, gated output norm) and the
fourth gated full attention (q/k norms, partial RoPE); zero-centred RMSNorms, dense SwiGLU FFNs,
tied embeddings. Its ``forward`` runs the chunked delta rule, which is differentiable. The MTP
head is the library's drafter (``mtpjax.drafter``), predicting token_{t+2} from (token_{t+1},
hidden_t), and, chained on its own output as it drafts at inference, token_{t+1+j} at step j:

    loss = CE(lm_head(h_t), x_{t+1}) + mtp_weight * sum_j CE(drafter_j, x_{t+1+j})

(DeepSeek-V3's MTP loss with mtp_weight 0.3; ``--mtp-steps`` chained steps, each reading the
previous step's post-norm ``h_out`` and the true next token, the train-time form of the drafts
2..k the head makes at inference). The MTP loss also trains the shared trunk, embedding and LM
head. AdamW with linear warmup and cosine decay; F32 master weights, BF16 matmuls on GPU.

The train and evaluation steps are compiled ahead of the loop, together, and their FLOPs and
device memory printed with a roofline floor of the step time on a known GPU. When ``--steps`` is
not given, the step count is chosen after timing a few steps so training fits ``--minutes`` (and
at most ``--max-epochs`` passes over the train tokens); the chosen count is written to the log,
and ``--steps N`` reproduces the run exactly.

Output (Hugging Face layout, what transformers' ``Qwen3_5ForCausalLM`` loads; it skips the
``mtp.*`` tensors, which ``mtpjax.checkpoint.convert`` reads): config.json (``qwen3_5_text``),
model.safetensors (bf16 ``model.*`` and ``mtp.*``), tokenizer.json, heldout_files.txt,
training_log.json, loss_curve.png.

    PYTHONPATH=. python3 scripts/train_tiny_pair.py --out /tmp/tiny_pair --size small --minutes 4.5
    PYTHONPATH=. python3 scripts/train_tiny_pair.py --out /tmp/smoke --smoke
    PYTHONPATH=. python3 scripts/train_tiny_pair.py --evaluate mtpjax/assets/tiny_pair
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import sys
import sysconfig
import tempfile
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

        @staticmethod
        def write(line):
            print(line, flush=True)


from mtpjax import drafter as drafter_lib
from mtpjax import generation as gen
from mtpjax import hybrid
from mtpjax.config import DrafterConfig, LMHeadConfig
from mtpjax.head import from_arrays, lm_head
from mtpjax.weights import Bf16Weight, Weight

EOS = "<|endoftext|>"
HELDOUT_PER_MILLE = 40  # ~4% of the files, chosen by a hash of their relative path
FULL_ATTENTION_INTERVAL = 4  # layer i is full attention iff (i + 1) % 4 == 0, as in Qwen3.5
PARTIAL_ROTARY_FACTOR = 0.25

SIZES: dict[str, dict[str, int]] = {
    # Seconds on a laptop CPU; only checks that everything runs end to end.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        intermediate_size=192,
        vocab_size=512,
    ),
    # The shipped pair: 3 GDN layers then 1 full-attention layer, wide FFNs, 13.6M parameters
    # with the MTP head, 27 MB in bf16. Four wide layers rather than more narrow ones: a GDN
    # layer is many small memory-bound ops, and the run has a few minutes of one GPU; a step
    # costs about what one of the 5-layer full-attention pair this replaces did.
    "small": dict(
        hidden_size=384,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=3,
        linear_num_value_heads=6,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        intermediate_size=1536,
        vocab_size=4096,
    ),
}

# Dense BF16 matmul rate and HBM bandwidth by the vendors' datasheets: the roofline floor of a
# step printed at startup on these devices.
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}


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


def hf_config(size: str, *, max_position_embeddings: int, eos_id: int | None) -> dict[str, Any]:
    """The pair's ``config.json``: a Qwen3.5 text model (``qwen3_5_text``, what
    ``Qwen3_5ForCausalLM`` reads) with one dense MTP layer and tied embeddings."""
    s = SIZES[size]
    L = s["num_hidden_layers"]
    half = int(s["head_dim"] * PARTIAL_ROTARY_FACTOR) // 2
    # M-RoPE's (temporal, height, width) split of the rotary pairs. Text positions are the same
    # in all three, so it does not change the rotation; it is written as Qwen3.5 writes it.
    width = half // 3
    height = (half - width) // 2
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **s,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
            "mrope_section": [half - height - width, height, width],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": 4,
        "layer_types": [
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(L)
        ],
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": "bfloat16",
    }


def make_configs(
    config: dict[str, Any], *, compute_dtype: str
) -> tuple[hybrid.HybridConfig, DrafterConfig, LMHeadConfig]:
    """The target, drafter and head configs, read from ``config`` as the loaders read it."""
    cfg = hybrid.HybridConfig.from_hf(config, compute_dtype=compute_dtype)
    return cfg, DrafterConfig.from_hf_config(config), cfg.lm_head_config()


def init_gates(params: hybrid.HybridParams, *, key: jax.Array) -> hybrid.HybridParams:
    """Spread the GDN decay rates over time scales, as Mamba-2 and FLA's GatedDeltaNet do:
    ``A ~ U(1, 16)``, ``dt ~ logU(1e-3, 1e-1)`` with ``dt_bias = softplus^-1(dt)``, so that
    ``g = -A * softplus(a + dt_bias)`` starts between -1.6 and -1e-3 (memories of a token to a
    thousand tokens) at ``a = 0``."""
    layers = []
    for p, layer in enumerate(params.layers):
        if isinstance(layer, hybrid.GdnLayerParams):
            gdn = layer.linear_attn
            k_a, k_dt = jax.random.split(jax.random.fold_in(key, p))
            A = jax.random.uniform(k_a, gdn.A_log.shape, minval=1.0, maxval=16.0)
            u = jax.random.uniform(k_dt, gdn.dt_bias.shape)
            dt = jnp.exp(math.log(1e-3) + u * (math.log(1e-1) - math.log(1e-3)))
            gdn = dataclasses.replace(
                gdn,
                A_log=jnp.log(A).astype(gdn.A_log.dtype),
                dt_bias=(dt + jnp.log(-jnp.expm1(-dt))).astype(gdn.dt_bias.dtype),
            )
            layer = dataclasses.replace(layer, linear_attn=gdn)
        layers.append(layer)
    return dataclasses.replace(params, layers=tuple(layers))


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def pair_losses(
    params, head, mtp, windows, *, cfg, dcfg, hcfg, mtp_steps: int = 1
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Main and MTP losses on windows int32[B, T + 1 + mtp_steps] (positions 0..T-1 are the
    inputs). Returns (main, the MTP losses summed over the chained steps, stats)."""
    T = windows.shape[1] - 1 - mtp_steps
    hidden, _ = hybrid.forward(params, head, windows[:, :T], cfg=cfg, implementation="xla")
    # The main head reads the hidden in the trunk's compute dtype (BF16 matmuls when training
    # on GPU); the drafter reads the F32 hidden, as at inference.
    logits = lm_head(head, hidden.astype(cfg.compute_dtype), cfg=hcfg, implementation="xla")
    main = _xent(logits, windows[:, 1 : T + 1])
    target_next = jnp.argmax(logits, -1)  # greedy prediction of x_{t+1}
    # Step j reads (x_{t+1+j}, the previous step's h_out at t) and predicts x_{t+2+j}; step 0
    # reads the target's hidden.
    h, losses, stats = hidden, [], {}
    for j in range(mtp_steps):
        out = drafter_lib.drafter_forward(
            mtp,
            head,
            windows[:, 1 + j : T + 1 + j],
            h,
            cfg=dcfg,
            head_cfg=hcfg,
            implementation="xla",
        )
        labels = windows[:, 2 + j : T + 2 + j]
        losses.append(jnp.mean(_xent(out.logits, labels)))
        if j == 0:
            draft = jnp.argmax(out.logits, -1)  # drafter's prediction of x_{t+2}
            stats = dict(
                target_acc=jnp.mean(target_next == windows[:, 1 : T + 1]),
                mtp_acc=jnp.mean(draft == labels),
                # What greedy verification checks: does the draft equal the target's own argmax?
                mtp_agree=jnp.mean(draft[:, :-1] == target_next[:, 1:]),
            )
        else:
            stats[f"mtp{j + 1}"] = losses[-1]
        h = out.h_out
    return jnp.mean(main), sum(losses), dict(stats, mtp1=losses[0])


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The steps over F32 master leaves of (target params, embedding, untied LM head or None,
    MTP head), cast to their dtypes; the LM head is rebuilt from them (tied: the embedding)."""

    treedef: Any
    dtypes: tuple[Any, ...]
    cfg: hybrid.HybridConfig
    dcfg: DrafterConfig
    hcfg: LMHeadConfig
    mtp_weight: float
    mtp_steps: int
    batch: int
    seq_len: int
    weight_decay: float
    clip: float

    @property
    def window(self) -> int:
        return self.seq_len + 1 + self.mtp_steps

    def unflatten(self, master):
        leaves = [m.astype(d) for m, d in zip(master, self.dtypes)]
        params, embedding, head_weight, mtp = jax.tree.unflatten(self.treedef, leaves)
        head = from_arrays(
            self.hcfg, lm_head=head_weight, embedding=embedding, final_norm=params.final_norm
        )
        return params, head, mtp

    def optimizer(self, master) -> optax.GradientTransformation:
        # AdamW with the learning rate applied outside (so the schedule's length can be set
        # after timing); decay only matrices, never norms or the GDN gates' parameters.
        mask = [m.ndim >= 2 for m in master]
        return optax.chain(
            optax.clip_by_global_norm(self.clip),
            optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
            optax.add_decayed_weights(self.weight_decay, mask=mask),
        )

    def loss(self, master, windows):
        params, head, mtp = self.unflatten(master)
        main, mtp_loss, stats = pair_losses(
            params,
            head,
            mtp,
            windows,
            cfg=self.cfg,
            dcfg=self.dcfg,
            hcfg=self.hcfg,
            mtp_steps=self.mtp_steps,
        )
        total = main + self.mtp_weight * mtp_loss
        return total, dict(loss=total, main=main, mtp=stats.pop("mtp1"), **stats)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def train_step(trainer: Trainer, master, opt_state, data, key, lr):
    starts = jax.random.randint(key, (trainer.batch,), 0, data.shape[0] - trainer.window)
    windows = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, trainer.window))(starts)
    (_, metrics), grads = jax.value_and_grad(trainer.loss, has_aux=True)(master, windows)
    updates, opt_state = trainer.optimizer(master).update(grads, opt_state, master)
    master = jax.tree.map(lambda p, u: p - lr * u, master, updates)
    metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))
    return master, opt_state, metrics


@functools.partial(jax.jit, static_argnums=0)
def eval_step(trainer: Trainer, master, windows):
    return trainer.loss(master, windows)[1]


def program_report(compiled, device: jax.Device, what: str) -> dict[str, float]:
    """FLOPs, bytes accessed and device memory of a compiled step, and its roofline floor on a
    device in ``PEAKS``; printed and returned for the log."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    out = dict(flops=float(cost.get("flops", 0.0)), bytes=float(cost.get("bytes accessed", 0.0)))
    if mem is not None:
        out["memory_bytes"] = float(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
    line = f"{what}: {out['flops'] / 1e12:.2f} TFLOP, {out['bytes'] / 1e9:.1f} GB accessed"
    if "memory_bytes" in out:
        line += f", {out['memory_bytes'] / 2**30:.2f} GiB device memory"
    peak = next((v for k, v in PEAKS.items() if k in device.device_kind), None)
    if peak is not None:
        out["roofline_s"] = max(out["flops"] / peak[0], out["bytes"] / peak[1])
        line += f"; roofline floor {1e3 * out['roofline_s']:.0f} ms on {device.device_kind}"
    print(line, flush=True)
    return out


def lr_at(step: int, *, total: int, warmup: int, peak: float, floor: float = 0.1) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def heldout_windows(tokens: np.ndarray, *, length: int, count: int) -> np.ndarray:
    """Up to ``count`` non-overlapping windows int32[n, length] spread evenly over the whole
    held-out stream (not its first files only: a few codec tables would dominate)."""
    fit = len(tokens) // length
    if fit == 0:
        raise RuntimeError(f"held-out text has {len(tokens)} tokens, fewer than one window")
    slots = np.unique(np.linspace(0, fit - 1, min(count, fit)).round().astype(int))
    return np.stack([tokens[i * length : (i + 1) * length] for i in slots])


def evaluate_windows(step, trainer: Trainer, master, windows: np.ndarray) -> dict[str, float]:
    """Mean stats over full batches of ``windows`` through ``step`` (compiled for one batch);
    fewer windows than a batch go through ``eval_step`` as one ragged call."""
    sums: dict[str, float] = {}
    n = 0
    for i in range(0, len(windows) - trainer.batch + 1, trainer.batch):
        m = jax.device_get(step(master, jnp.asarray(windows[i : i + trainer.batch])))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n += 1
    if n == 0:
        m = jax.device_get(eval_step(trainer, master, jnp.asarray(windows)))
        return {k: float(v) for k, v in m.items()}
    return {k: v / n for k, v in sums.items()}


# ------------------------------------------------------------------------------------------
# Saving: the Qwen3.5 text layout, mtp.* beside it.

# Checkpoint module names of the params dataclasses' fields where they differ.
_MODULE_NAMES = {"attention": "self_attn", "ffn": "mlp", "layer": "layers.0"}
_NO_WEIGHT_SUFFIX = ("A_log", "dt_bias")


def _tensors(node: Any, prefix: str) -> dict[str, jax.Array]:
    """Checkpoint name -> array for a params dataclass (one unstacked layer, or the MTP head)."""
    out: dict[str, jax.Array] = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        name = prefix + _MODULE_NAMES.get(field.name, field.name)
        if value is None:
            continue
        if isinstance(value, Weight):
            if not isinstance(value, Bf16Weight):
                raise TypeError(f"{name}: only BF16 weights are saved, got {type(value).__name__}")
            out[name + ".weight"] = value.w
        elif dataclasses.is_dataclass(value):
            out |= _tensors(value, name + ".")
        else:
            out[name + ("" if field.name in _NO_WEIGHT_SUFFIX else ".weight")] = value
    return out


def save_pair(
    directory: Path, *, config: dict[str, Any], cfg: hybrid.HybridConfig, params, head, mtp
) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (every tensor BF16): ``model.*`` as
    ``Qwen3_5ForCausalLM`` names them (``lm_head.weight`` only when untied), ``mtp.*`` as the
    released Qwen3.5 checkpoints do."""
    from safetensors.flax import save_file

    tensors = {"model.embed_tokens.weight": head.embedding, "model.norm.weight": params.final_norm}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = head.weight.w
    for i in range(cfg.num_hidden_layers):
        group, slot = divmod(i, cfg.period)  # layer i is group g's slot p
        layer = jax.tree.map(lambda a, g=group: a[g], params.layers[slot])
        tensors |= _tensors(layer, f"model.layers.{i}.")
    tensors |= _tensors(mtp, "mtp.")
    tensors = {k: jnp.asarray(v).astype(jnp.bfloat16) for k, v in sorted(tensors.items())}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ------------------------------------------------------------------------------------------
# Acceptance: greedy speculative decoding with k drafts, chained on the drafter's own h_out.


def speculative_acceptance(
    cfg, params, head, dcfg, mtp, prompts: np.ndarray, *, new_tokens: int, k: int = 3
) -> dict[str, Any]:
    """Greedy speculative decoding of ``prompts`` int32[B, P] with ``mtpjax.generate``, checked
    against plain greedy decoding token for token. Quality is measured on the XLA reference
    path, so a kernel under development elsewhere in the library cannot change the numbers."""
    B, P = prompts.shape
    model = hybrid.target_model(cfg, params, head, max_step=k + 1, implementation="xla")
    lengths = jnp.full((B,), P, jnp.int32)
    common = dict(head_cfg=cfg.lm_head_config(), max_new_tokens=new_tokens, implementation="xla")
    spec = jax.device_get(
        gen.generate(model, mtp, head, prompts, lengths, drafter_cfg=dcfg, num_drafts=k, **common)
    )
    base = jax.device_get(
        gen.generate_baseline(model, head, prompts, lengths, step_width=k + 1, **common)
    )
    m = spec.metrics
    return dict(
        k=k,
        sequences=B,
        prompt_len=P,
        new_tokens=new_tokens,
        rounds=int(m.num_drafts),
        mean_acceptance_length=float(m.mean_acceptance_length()),
        acceptance_rate_per_position=[float(r) for r in m.acceptance_rate_per_pos()],
        matches_plain_greedy=bool(
            np.array_equal(spec.tokens, base.tokens) and np.array_equal(spec.lengths, base.lengths)
        ),
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


def load_pair(directory: Path):
    """(cfg, params, head, drafter cfg, drafter) of a saved pair; the MTP head goes through the
    checkpoint converter at BF16, as a user's would."""
    from mtpjax.checkpoint import load_drafter
    from mtpjax.demo import converted_drafter

    cfg = hybrid.HybridConfig.from_hf(directory)
    params, head = hybrid.load(directory, cfg=cfg)
    with tempfile.TemporaryDirectory() as cache:
        path, _ = converted_drafter("bf16", cache_dir=Path(cache), source=directory, progress=False)
        dcfg, ckpt = load_drafter(path)
    return cfg, params, head, dcfg, ckpt.modules[0]


def measure_acceptance(directory: Path, *, snippets: int, prompt_len: int, new_tokens: int):
    """Teacher-forced and speculative greedy acceptance (k=3) of a saved pair on snippets of
    its held-out files, read from this interpreter's standard library."""
    from tokenizers import Tokenizer

    cfg, params, head, dcfg, mtp = load_pair(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    windows, files = acceptance_snippets(
        directory, tok, snippets=snippets, length=prompt_len + new_tokens + 2
    )
    losses = functools.partial(pair_losses, cfg=cfg, dcfg=dcfg, hcfg=cfg.lm_head_config())
    main, mtp_loss, stats = jax.jit(losses)(params, head, mtp, jnp.asarray(windows))
    return dict(
        files=files,
        teacher_forced=dict(
            main_loss=float(main),
            mtp_loss=float(mtp_loss),
            **{k: float(v) for k, v in stats.items() if k != "mtp1"},
        ),
        speculative=speculative_acceptance(
            cfg, params, head, dcfg, mtp, windows[:, :prompt_len], new_tokens=new_tokens
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
    ax.set_title(f"tiny Qwen3.5 pair ({log['size']}): {log['tokens_seen'] / 1e6:.0f}M tokens")
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
    p.add_argument("--mtp-steps", type=int, default=2, help="chained MTP steps trained (2)")
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
    if args.mtp_steps < 1:
        p.error(f"--mtp-steps must be >= 1, got {args.mtp_steps}")
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
    device = jax.devices()[0]
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
    config = hf_config(
        args.size,
        max_position_embeddings=max(2048, args.seq_len * 2),
        eos_id=tok.token_to_id(EOS),
    )
    cfg, dcfg, hcfg = make_configs(config, compute_dtype=compute_dtype)
    k_t, k_g, k_d, k_data = jax.random.split(jax.random.key(args.seed), 4)
    params, head = hybrid.init(cfg, key=k_t)
    params = init_gates(params, key=k_g)
    mtp = drafter_lib.init(dcfg, key=k_d)
    untied = None if cfg.tie_word_embeddings else head.weight
    leaves, treedef = jax.tree.flatten((params, head.embedding, untied, mtp))
    master = [jnp.asarray(leaf, jnp.float32) for leaf in leaves]
    trainer = Trainer(
        treedef=treedef,
        dtypes=tuple(leaf.dtype for leaf in leaves),
        cfg=cfg,
        dcfg=dcfg,
        hcfg=hcfg,
        mtp_weight=args.mtp_weight,
        mtp_steps=args.mtp_steps,
        batch=args.batch,
        seq_len=args.seq_len,
        weight_decay=args.weight_decay,
        clip=1.0,
    )
    n_params = sum(int(np.prod(m.shape)) for m in master)
    opt_state = trainer.optimizer(master).init(master)
    data = jnp.asarray(train_tokens)
    held = heldout_windows(held_tokens, length=trainer.window, count=args.eval_windows)
    tokens_per_step = args.batch * args.seq_len
    epoch_cap = max(1, int(args.max_epochs * len(train_tokens) / tokens_per_step))
    kinds = "".join("F" if t is hybrid.LayerType.FULL_ATTENTION else "G" for t in cfg.layer_types)
    print(
        f"target: Qwen3.5 text, {cfg.num_hidden_layers} layers {kinds} (G: Gated DeltaNet "
        f"{cfg.linear_num_key_heads}/{cfg.linear_num_value_heads} heads of "
        f"{cfg.linear_key_head_dim}, F: full attention {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads of {cfg.head_dim}), hidden {cfg.hidden_size}, "
        f"FFN {cfg.intermediate_size}, vocab {cfg.vocab_size}; one MTP layer trained over "
        f"{args.mtp_steps} chained steps; {n_params / 1e6:.2f}M parameters "
        f"({2 * n_params / 1e6:.1f} MB in bf16); {args.batch} x {args.seq_len} tokens per "
        f"step, {compute_dtype} matmuls on {device.device_kind}"
    )

    # ---- compile both steps ahead of the loop, concurrently ----
    t_compile = time.perf_counter()
    lr0 = jnp.float32(0.0)
    lowered = [
        train_step.lower(trainer, master, opt_state, data, k_data, lr0),
        eval_step.lower(trainer, master, jnp.asarray(held[: args.batch])),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        train_compiled, eval_compiled = pool.map(lambda low: low.compile(), lowered)
    t_compile = time.perf_counter() - t_compile
    print(f"compiled the train and evaluation steps in {t_compile:.1f}s")
    programs = dict(
        train_step=program_report(train_compiled, device, "train step"),
        eval_step=program_report(eval_compiled, device, "evaluation step"),
    )

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
    seconds_per_step = None
    bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=2.0)

    def flush() -> None:
        for s, m in jax.device_get(pending):
            train_curve.append({"step": s, **{k: float(v) for k, v in m.items()}})
        pending.clear()

    def run_eval(s: int) -> None:
        nonlocal best
        m = evaluate_windows(eval_compiled, trainer, master, held)
        heldout_curve.append({"step": s, **m})
        if m["loss"] < best[0]:
            best = (m["loss"], jax.device_get(master), s)
        bar.set_postfix(held_main=f"{m['main']:.3f}", held_mtp=f"{m['mtp']:.3f}")

    while step < total:
        if time.perf_counter() > deadline:
            stopped_by_clock = True
            break
        lr = lr_at(step, total=total, warmup=args.warmup, peak=args.lr)
        master, opt_state, metrics = train_compiled(
            master, opt_state, data, jax.random.fold_in(k_data, step), jnp.float32(lr)
        )
        pending.append((step, {**metrics, "lr": jnp.float32(lr)}))
        step += 1
        bar.update(1)
        if step == 3:
            jax.block_until_ready(master)
            t_calib = time.perf_counter()
        if step == 23:
            jax.block_until_ready(master)
            seconds_per_step = (time.perf_counter() - t_calib) / 20
            line = f"measured {seconds_per_step:.3f} s/step"
            if calibrate:
                # Leave room for the periodic evaluations and the final save.
                budget = deadline - time.perf_counter() - 20.0
                fit = step + int(0.93 * budget / seconds_per_step)
                total = max(step + 1, min(epoch_cap, fit))
                eval_every = args.eval_every or max(1, total // 25)
                bar.total = total
                bar.refresh()
                calibrate = False
                line += f": {total} steps planned, about {total * seconds_per_step:.0f}s"
            tqdm.write(line)
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
    params, head, mtp = jax.device_get(trainer.unflatten([jnp.asarray(m) for m in best_master]))
    save_pair(out, config=config, cfg=cfg, params=params, head=head, mtp=mtp)
    weights_mb = (out / "model.safetensors").stat().st_size / 1e6
    tok_mb = (out / "tokenizer.json").stat().st_size / 1e6

    final = heldout_curve[-1]
    at_best = next(r for r in heldout_curve if r["step"] == best_step)
    log: dict[str, Any] = dict(
        size=args.size,
        argv=sys.argv[1:] if argv is None else list(argv),
        seed=args.seed,
        backend=jax.default_backend(),
        device=str(device),
        compute_dtype=compute_dtype,
        config=config,
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
        mtp_steps=args.mtp_steps,
        data_seconds=t_data,
        compile_seconds=t_compile,
        programs=programs,
        seconds_per_step=seconds_per_step,
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
