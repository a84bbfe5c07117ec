"""Self-distilled training data: prompts cut from the training split of the pair's corpus, and
continuations the frozen target generates from them (greedy and sampled), which the head then
learns to predict; and the held-out prompts acceptance is measured on.

The shipped pair was trained on the ``.py`` files of the Python standard library and holds out
the files its ``heldout_files.txt`` lists (``scripts/train_tiny_pair.py`` splits by a hash of the
path). Training prompts come only from the other files; evaluation prompts only from the
held-out ones (``mtpjax.demo.heldout_files``: codec tables under ``encodings/`` left out), one
window from the middle of each, as ``scripts/measure_acceptance.py`` takes them.

Shapes: ``[n]`` sequences, ``[P]`` prompt tokens, ``[M]`` generated tokens.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import demo
from mtpjax import generation as gen
from mtpjax.config import LMHeadConfig
from mtpjax.head import LMHeadParams
from mtpjax.target_model import TargetModel

__all__ = ["heldout_prompts", "self_distill", "training_files", "training_prompts"]


def training_files(source: Path) -> list[Path]:
    """The standard library's ``.py`` files outside ``source/heldout_files.txt`` (third-party
    ``site-packages`` left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = source / "heldout_files.txt"
    if not listing.is_file():
        raise ValueError(f"{source}: no heldout_files.txt, so the training split is unknown")
    held = set(listing.read_text().split())
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.as_posix() in held or any(
            p in ("site-packages", "dist-packages") for p in rel.parts
        ):
            continue
        out.append(path)
    if not out:
        raise ValueError(f"no training files under {root} outside {listing}")
    return out


def training_prompts(
    tokenizer: Any, files: list[Path], *, count: int, prompt_len: int, seed: int
) -> np.ndarray:
    """int32[count, prompt_len]: windows at random offsets of random training files (files
    shorter than a window are skipped), a pure function of ``seed`` and the files."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for _ in range(100 * count):
        if len(out) == count:
            break
        path = files[int(rng.integers(len(files)))]
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = np.asarray(tokenizer.encode(text).ids, np.int32)
        if len(ids) < prompt_len:
            continue
        start = int(rng.integers(len(ids) - prompt_len + 1))
        out.append(ids[start : start + prompt_len])
    if len(out) < count:
        raise ValueError(
            f"found {len(out)} training windows of {prompt_len} tokens, wanted {count}"
        )
    return np.stack(out)


def self_distill(
    target: TargetModel,
    head: LMHeadParams,
    prompts: np.ndarray,
    *,
    head_cfg: LMHeadConfig,
    new_tokens: int,
    temperature: float,
    key: jax.Array,
    batch: int,
) -> np.ndarray:
    """The target's continuations of prompts int32[n, P]: int32[n, P + M] (prompt, then M
    tokens the target generated, greedy at temperature 0, else sampled), in batches of
    ``batch`` prompts (a last short batch is padded with repeats, one compiled shape)."""
    n, P = prompts.shape
    out = []
    for i in range(0, n, batch):
        chunk = prompts[i : i + batch]
        real = len(chunk)
        if real < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, axis=0)])
        res = gen.generate_baseline(
            target,
            head,
            jnp.asarray(chunk),
            jnp.full((batch,), P, jnp.int32),
            head_cfg=head_cfg,
            max_new_tokens=new_tokens,
            temperature=temperature,
            key=jax.random.fold_in(key, i),
        )
        tokens = np.asarray(jax.device_get(res.tokens))[:real]
        out.append(np.concatenate([chunk[:real], tokens], axis=1))
    return np.concatenate(out).astype(np.int32)


def heldout_prompts(
    tokenizer: Any,
    *,
    source: Path = demo.ASSET_DIR,
    prompt_len: int,
    new_tokens: int,
    max_snippets: int | None,
) -> tuple[np.ndarray, list[str]]:
    """(int32[B, prompt_len] prompts, file names): a window from the middle of each held-out
    file with at least ``prompt_len + new_tokens + 2`` tokens, at most ``max_snippets`` of them
    spread evenly over the list (``scripts/measure_acceptance.py``'s selection)."""
    length = prompt_len + new_tokens + 2
    pool = []
    for path in demo.heldout_files(source):
        ids = np.asarray(tokenizer.encode(path.read_text(encoding="utf-8")).ids, np.int32)
        if len(ids) >= length:
            start = (len(ids) - length) // 2
            pool.append((path.name, ids[start : start + prompt_len]))
    if not pool:
        raise ValueError(f"no held-out file of {source} has {length} tokens")
    count = len(pool) if max_snippets is None else min(max_snippets, len(pool))
    pick = np.unique(np.linspace(0, len(pool) - 1, count).round().astype(int))
    return np.stack([pool[i][1] for i in pick]), [pool[i][0] for i in pick]
