"""``python -m mtpjax demo``: speculative decoding with the shipped tiny pair, next to plain
decoding with the target alone (``DESCRIPTION`` is what it does and prints).

The MTP head is converted into ``<cache-dir>/tiny_pair-<precision>-<hash of the source files>``
and reused from there. The drafter reads the converted head (embedding and LM head at the chosen
precision, as a quantised checkpoint ships them); the target verifies with its own BF16 head, so
a quantised drafter can change only how many drafts are accepted, never the output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ASSET_DIR",
    "DESCRIPTION",
    "PRECISIONS",
    "DemoResult",
    "HeldoutPrompt",
    "add_arguments",
    "converted_drafter",
    "default_prompt",
    "main",
    "run",
]

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "tiny_pair"
PRECISIONS = ("bf16", "fp8", "nvfp4")
DEFAULT_CACHE_DIR = Path("~/.cache/mtpjax")
SOURCE_FILES = ("config.json", "model.safetensors")
PREFERRED_HELDOUT = "statistics.py"  # readable code with docstrings; any held-out file will do
PROMPT_TOKENS = 128


# ------------------------------------------------------------------------------------------
# Inputs: the converted drafter and the held-out prompt.


def source_hash(source: Path = ASSET_DIR) -> str:
    """12 hex digits of SHA-256 over the pair's config and weights: the cache key."""
    digest = hashlib.sha256()
    for name in SOURCE_FILES:
        with open(source / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:12]


def converted_drafter(
    precision: str, *, cache_dir: Path, source: Path = ASSET_DIR, progress: bool = True
) -> tuple[Path, bool]:
    """The converted drafter of ``source`` at ``precision``: (directory, reused?).

    Converts with ``mtpjax.checkpoint.convert`` on first use; the directory name carries the
    precision, the source hash and the checkpoint format version, so neither a changed source
    nor an older converter's output is ever reused.
    """
    from mtpjax.checkpoint import FORMAT_VERSION, MANIFEST_FILE, CheckpointError, convert

    name = f"{source.name}-{precision}-{source_hash(source)}-v{FORMAT_VERSION}"
    out = Path(cache_dir).expanduser() / name
    if (out / MANIFEST_FILE).is_file():
        return out, True
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        convert(source, out, precision=precision, progress=progress)
    except CheckpointError:
        if not (out / MANIFEST_FILE).is_file():  # not another process finishing first
            raise
        return out, True
    return out, False


@dataclass(frozen=True, kw_only=True)
class HeldoutPrompt:
    """A prompt cut from a held-out standard-library file: its text and where it came from."""

    text: str
    file: str
    first_line: int  # 1-based


def heldout_files(source: Path = ASSET_DIR) -> list[Path]:
    """The held-out files (``heldout_files.txt``) present in this Python's standard library,
    codec tables under ``encodings/`` left out (data, not code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = (source / "heldout_files.txt").read_text().split()
    return [root / n for n in names if not n.startswith("encodings/") and (root / n).is_file()]


def default_prompt(tokenizer: Any, *, source: Path = ASSET_DIR, tokens: int = PROMPT_TOKENS):
    """A ``HeldoutPrompt``: the first top-level ``def`` past 40% of a held-out file
    (``statistics.py`` when present), whole lines up to about ``tokens`` tokens."""
    files = heldout_files(source)
    files.sort(key=lambda p: p.name != PREFERRED_HELDOUT)
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        start = next(
            (i for i in range(int(0.4 * len(lines)), len(lines)) if lines[i].startswith("def ")),
            None,
        )
        if start is None:
            continue
        text = ""
        for line in lines[start:]:
            text += line
            if len(tokenizer.encode(text).ids) >= tokens:
                break
        root = Path(sysconfig.get_paths()["stdlib"])
        return HeldoutPrompt(
            text=text, file=path.relative_to(root).as_posix(), first_line=start + 1
        )
    raise RuntimeError(
        f"none of the held-out files listed in {source / 'heldout_files.txt'} is in this "
        f"Python's standard library ({sysconfig.get_paths()['stdlib']}); pass --prompt"
    )


# ------------------------------------------------------------------------------------------
# The run.


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """Everything the demo reports (``to_json`` is the ``--json`` object)."""

    prompt: str
    prompt_source: str
    prompt_tokens: int
    speculative_text: str
    baseline_text: str
    identical: bool
    speculative_tokens: int
    baseline_tokens: int
    mean_acceptance_length: float
    per_position_acceptance: list[float]
    draft_acceptance_rate: float
    target_forwards_speculative: int
    target_forwards_baseline: int
    num_drafts: int
    temperature: float
    precision: str
    hidden_contract: str
    seed: int
    checkpoint: str
    checkpoint_reused: bool
    device: str
    seconds_speculative: float  # the first call: compilation plus one run
    seconds_baseline: float
    steady_seconds_speculative: float  # a second, compiled run
    steady_seconds_baseline: float

    @property
    def target_forwards_saved(self) -> int:
        return self.target_forwards_baseline - self.target_forwards_speculative

    @property
    def tokens_per_second_speculative(self) -> float:
        return self.speculative_tokens / self.steady_seconds_speculative

    @property
    def tokens_per_second_baseline(self) -> float:
        return self.baseline_tokens / self.steady_seconds_baseline

    @property
    def speedup(self) -> float:
        """Steady-state tokens per second, speculative over plain."""
        return self.tokens_per_second_speculative / self.tokens_per_second_baseline

    def to_json(self) -> dict[str, Any]:
        def clean(x):
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        data = {k: clean(v) for k, v in self.__dict__.items()}
        data["target_forwards_saved"] = self.target_forwards_saved
        data["tokens_per_second_speculative"] = round(self.tokens_per_second_speculative, 2)
        data["tokens_per_second_baseline"] = round(self.tokens_per_second_baseline, 2)
        data["speedup"] = round(self.speedup, 3)
        return data


def _decode(tokenizer: Any, ids) -> str:
    return tokenizer.decode([int(t) for t in ids])


def run(
    *,
    prompt: str | None = None,
    max_new_tokens: int = 128,
    num_drafts: int = 3,
    temperature: float = 0.0,
    precision: str = "bf16",
    hidden_contract: str = "post_norm",
    seed: int = 0,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    progress: bool = True,
    log=None,
) -> DemoResult:
    """Converts (or reuses), loads, generates both ways; returns the ``DemoResult``.

    ``log`` (a callable taking a string) receives progress lines; None prints nothing.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tokenizers import Tokenizer

    from mtpjax import generation as gen
    from mtpjax import reference
    from mtpjax.checkpoint import load_drafter
    from mtpjax.config import HiddenContract, load_hf_config

    say = log or (lambda _: None)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    contract = HiddenContract(hidden_contract)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    if not isinstance(num_drafts, int) or num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts!r}")

    ckpt_dir, reused = converted_drafter(precision, cache_dir=cache_dir, progress=progress)
    say(f"drafter checkpoint: {ckpt_dir} ({'reused' if reused else 'converted now'})")
    tcfg, target, head = reference.load_target(ASSET_DIR)
    dcfg, ckpt = load_drafter(ckpt_dir)
    eos_id = load_hf_config(ASSET_DIR).get("eos_token_id")
    tokenizer = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json"))

    if prompt is None:
        held = default_prompt(tokenizer)
        prompt, source = held.text, f"held-out stdlib file {held.file}, line {held.first_line}"
    else:
        source = "--prompt"
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    limit = tcfg.max_position_embeddings - max_new_tokens - num_drafts - 1
    if len(ids) > limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; with {max_new_tokens} new tokens and "
            f"{num_drafts} drafts at most {limit} fit the model's "
            f"{tcfg.max_position_embeddings} positions"
        )
    prompts = jnp.asarray([ids], jnp.int32)
    lengths = jnp.asarray([len(ids)], jnp.int32)
    hcfg = tcfg.lm_head_config()
    model = gen.reference_target(tcfg, target, head)
    common = dict(
        head_cfg=hcfg,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        eos_id=eos_id,
    )
    key_spec, key_base = jax.random.split(jax.random.key(seed))

    def speculative():
        return gen.generate(
            model,
            ckpt.modules[0],
            head,
            prompts,
            lengths,
            drafter_cfg=dcfg,
            num_drafts=num_drafts,
            drafter_head=ckpt.head,
            key=key_spec,
            hidden_contract=contract,
            **common,
        )

    def plain():
        return gen.generate_baseline(
            model, head, prompts, lengths, step_width=num_drafts + 1, key=key_base, **common
        )

    def timed(decode):
        t0 = time.perf_counter()
        out = jax.device_get(decode())
        return out, time.perf_counter() - t0

    device = jax.devices()[0]
    say(f"speculative decoding, k={num_drafts}, on {device.device_kind} (compiles once)...")
    spec, first_spec = timed(speculative)
    say("plain decoding with the target alone (compiles once)...")
    base, first_base = timed(plain)
    say("steady state: each once more, compiled...")
    steady_spec = timed(speculative)[1]
    steady_base = timed(plain)[1]
    if np.any(spec.kv_error):
        raise RuntimeError(f"the drafter's KV cache reported errors {spec.kv_error}")

    spec_ids = spec.tokens[0, : spec.lengths[0]]
    base_ids = base.tokens[0, : base.lengths[0]]
    metrics = spec.metrics
    return DemoResult(
        prompt=prompt,
        prompt_source=source,
        prompt_tokens=len(ids),
        speculative_text=_decode(tokenizer, spec_ids),
        baseline_text=_decode(tokenizer, base_ids),
        identical=bool(np.array_equal(spec_ids, base_ids)),
        speculative_tokens=int(spec.lengths[0]),
        baseline_tokens=int(base.lengths[0]),
        mean_acceptance_length=float(metrics.mean_acceptance_length()),
        per_position_acceptance=[float(r) for r in metrics.acceptance_rate_per_pos()],
        draft_acceptance_rate=float(metrics.draft_acceptance_rate()),
        target_forwards_speculative=int(spec.target_steps),
        target_forwards_baseline=int(base.target_steps),
        num_drafts=num_drafts,
        temperature=float(temperature),
        precision=precision,
        hidden_contract=contract.value,
        seed=seed,
        checkpoint=str(ckpt_dir),
        checkpoint_reused=reused,
        device=f"{device.device_kind} ({device.platform})",
        seconds_speculative=round(first_spec, 2),
        seconds_baseline=round(first_base, 2),
        steady_seconds_speculative=round(steady_spec, 4),
        steady_seconds_baseline=round(steady_base, 4),
    )


# ------------------------------------------------------------------------------------------
# Presentation.


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True)) or prefix


def report(r: DemoResult) -> str:
    """The human-readable report: a header, the texts, a metrics block."""
    greedy = r.temperature == 0
    mode = "greedy" if greedy else f"sampled at temperature {r.temperature:g} (seed {r.seed})"
    rule = "-" * 72
    lines = [
        "mtpjax demo: MTP speculative decoding on the shipped tiny Qwen3-Next-style pair",
        f"  drafter   MTP head converted to {r.precision.upper()} ({r.hidden_contract} chain)",
        f"  decoding  {mode}, k={r.num_drafts} drafts per round",
        f"  prompt    {r.prompt_tokens} tokens from {r.prompt_source}",
        f"  device    {r.device}",
        rule,
        "prompt:",
        _indent(r.prompt.rstrip("\n")),
        f"speculative continuation ({r.speculative_tokens} tokens):",
        _indent(r.speculative_text.rstrip("\n")),
    ]
    if r.identical:
        lines.append(
            f"target-alone continuation ({r.baseline_tokens} tokens): the same, token for token"
        )
    else:
        lines += [
            f"target-alone continuation ({r.baseline_tokens} tokens):",
            _indent(r.baseline_text.rstrip("\n")),
        ]
    per_pos = "  ".join(f"{p:.2f}" for p in r.per_position_acceptance)
    saved = r.target_forwards_saved
    share = saved / r.target_forwards_baseline if r.target_forwards_baseline else float("nan")
    if greedy:
        identical = "yes" if r.identical else "NO (a bug: greedy speculation must match)"
    else:
        identical = f"{'yes' if r.identical else 'no'} (sampled: the draws differ by design)"
    lines += [
        rule,
        f"  identical to the target alone   {identical}",
        f"  mean acceptance length          {r.mean_acceptance_length:.2f} tokens per round",
        f"  per-position acceptance         {per_pos}",
        f"  draft acceptance rate           {100 * r.draft_acceptance_rate:.1f}%",
        f"  target forwards after prefill   {r.target_forwards_speculative} speculative vs "
        f"{r.target_forwards_baseline} plain: {saved} saved ({100 * share:.0f}%)",
        f"  compile + first run             {r.seconds_speculative:.1f} s speculative, "
        f"{r.seconds_baseline:.1f} s plain",
        f"  steady state, tokens/s          {r.tokens_per_second_speculative:.0f} speculative, "
        f"{r.tokens_per_second_baseline:.0f} plain: speed-up {r.speedup:.2f}x on {r.device}",
        "  (plain decoding runs the target at the verify step's shape, k+1 rows, so the outputs",
        "  compare bit for bit. The shipped pair is a small demonstration model: its speed-up",
        "  says little about a real model, whose target forward costs far more than a draft.)",
    ]
    return "\n".join(lines)


DESCRIPTION = """\
Speculative decoding with the shipped tiny Qwen3-Next-style pair, next to decoding with the
target alone. The MTP head is converted at --precision into --cache-dir (reused afterwards);
the default prompt is code from a standard-library file held out of the pair's training.
Greedy speculation must reproduce the target's own output token for token; the exit status is 1
if it does not. Speed is reported for the first call of each (compilation included) and in steady
state (tokens per second, speed-up) on the default JAX device; the pair is a small demonstration
model, so its speed-up says little about real models."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line flags."""
    parser.add_argument("--prompt", default=None, help="prompt text (default: held-out code)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens to generate (default 128)"
    )
    parser.add_argument("--num-drafts", type=int, default=3, help="k, drafts per round (default 3)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="bf16", help="drafter weights (default bf16)"
    )
    parser.add_argument(
        "--hidden-contract",
        choices=("post_norm", "pre_norm", "pinned"),
        default="post_norm",
        help="the hidden draft steps 2.. consume (default post_norm)",
    )
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed when sampling (default 0)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help=f"where converted drafters are kept (default {DEFAULT_CACHE_DIR})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args: argparse.Namespace) -> int:
    """Runs the demo for parsed ``args``; returns the exit status."""
    as_json = args.json

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    result = run(
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        num_drafts=args.num_drafts,
        temperature=args.temperature,
        precision=args.precision,
        hidden_contract=args.hidden_contract,
        seed=args.seed,
        cache_dir=args.cache_dir,
        progress=not as_json,
        log=None if as_json else log,
    )
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(report(result))
    return 0 if result.identical or result.temperature > 0 else 1
