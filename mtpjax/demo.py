"""``python -m mtpjax demo`` and ``mtpjax generate``: speculative decoding on the shipped tiny
pair or on a Hugging Face directory (``--model DIR``), next to plain decoding with the target
alone (``DESCRIPTION`` is what the demo does and prints); and generation from a directory, with
or without speculation (``GENERATE_DESCRIPTION``).

Both load through ``mtpjax.pretrained``: the target is ``mtpjax.hybrid`` (the shipped pair is
its all-full-attention case), and the MTP head is converted into
``<cache-dir>/<directory name>-<precision>-<content key>-v<format>`` once and reused from there.
The drafter reads the converted head (embedding and LM head at the chosen precision, as a
quantised checkpoint ships them); the target verifies with its own head, so a quantised drafter
can change only how many drafts are accepted, never the output. Bad input (a missing or
misshapen tensor, a checkpoint without MTP tensors, a prompt that does not fit) is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpjax import pretrained

__all__ = [
    "ASSET_DIR",
    "DESCRIPTION",
    "GENERATE_DESCRIPTION",
    "PRECISIONS",
    "DemoResult",
    "HeldoutPrompt",
    "add_arguments",
    "add_generate_arguments",
    "converted_drafter",
    "default_prompt",
    "generate_main",
    "main",
    "run",
    "run_generate",
]

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "tiny_pair"
PRECISIONS = ("bf16", "fp8", "nvfp4")
PREFERRED_HELDOUT = "statistics.py"  # readable code with docstrings; any held-out file will do
PROMPT_TOKENS = 128
BAD_INPUT = 2  # the exit status for bad input, as argparse's


# ------------------------------------------------------------------------------------------
# Inputs: the converted drafter, the model and the prompt.


def converted_drafter(
    precision: str, *, cache_dir: Path, source: Path = ASSET_DIR, progress: bool = True
) -> tuple[Path, bool]:
    """The converted drafter of ``source`` (default: the shipped pair) at ``precision``:
    (directory, reused?); ``mtpjax.pretrained.converted_drafter`` names and caches it."""
    return pretrained.converted_drafter(
        source, precision=precision, cache_dir=cache_dir, progress=progress
    )


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
# Loading and decoding, shared by the demo and ``generate``.


def _json_clean(x: Any) -> Any:
    """NaN and infinities (no data: nothing drafted) become JSON null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_json_clean(v) for v in x]
    return x


def _check_counts(max_new_tokens: Any, num_drafts: Any) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    if not isinstance(num_drafts, int) or num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts!r}")


def _load(model: Path, **kwargs: Any) -> pretrained.Pretrained:
    """``pretrained.load(model, **kwargs)``; ``model`` must have a tokenizer (checked first,
    before any conversion)."""
    if model.is_dir() and not (model / pretrained.TOKENIZER_FILE).is_file():
        raise ValueError(
            f"{model}: no {pretrained.TOKENIZER_FILE}, so the prompt cannot be tokenized"
        )
    return pretrained.load(model, **kwargs)


def _prompt_ids(
    loaded: pretrained.Pretrained, text: str, *, max_new_tokens: int, num_drafts: int
) -> list[int]:
    """The prompt's token ids, checked to fit the model's positions with the new tokens."""
    ids = loaded.tokenizer.encode(text).ids
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    positions = loaded.cfg.max_position_embeddings
    limit = positions - max_new_tokens - num_drafts - 1
    if len(ids) > limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; with {max_new_tokens} new tokens and "
            f"{num_drafts} drafts at most {limit} fit the model's {positions} positions"
        )
    return ids


def _timed_decode(
    loaded: pretrained.Pretrained,
    ids: list[int],
    *,
    speculative: bool,
    max_new_tokens: int,
    num_drafts: int,
    temperature: float,
    hidden_contract: str,
    seed: int,
):
    """Decodes one prompt, speculative or with the target alone: (``GenerateOutput`` on the
    host, seconds).

    Plain decoding runs every target step at the verify step's shape (``num_drafts + 1`` rows),
    so the two compare bit for bit; both always take a PRNG key, so the demo and ``generate``
    share their compiled programs.
    """
    import jax
    import jax.numpy as jnp

    from mtpjax import generation as gen

    m = loaded
    prompts = jnp.asarray([ids], jnp.int32)
    lengths = jnp.asarray([len(ids)], jnp.int32)
    key_spec, key_base = jax.random.split(jax.random.key(seed))
    common = dict(
        head_cfg=m.head_cfg,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        eos_id=m.eos_id,
    )
    t0 = time.perf_counter()
    if speculative:
        out = gen.generate(
            m.target,
            m.drafter,
            m.head,
            prompts,
            lengths,
            drafter_cfg=m.drafter_cfg,
            num_drafts=num_drafts,
            drafter_head=m.drafter_head,
            key=key_spec,
            hidden_contract=hidden_contract,
            **common,
        )
    else:
        step_width = num_drafts + 1
        out = gen.generate_baseline(
            m.target, m.head, prompts, lengths, step_width=step_width, key=key_base, **common
        )
    out = jax.device_get(out)
    seconds = time.perf_counter() - t0
    if out.kv_error.any():
        raise RuntimeError(f"the drafter's KV cache reported errors {out.kv_error}")
    return out, seconds


def _device() -> str:
    import jax

    device = jax.devices()[0]
    return f"{device.device_kind} ({device.platform})"


# ------------------------------------------------------------------------------------------
# The demo.


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """Everything the demo reports (``to_json`` is the ``--json`` object)."""

    model: str
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
    def shipped_pair(self) -> bool:
        return self.model == str(ASSET_DIR)

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
        data = {k: _json_clean(v) for k, v in self.__dict__.items()}
        data["target_forwards_saved"] = self.target_forwards_saved
        data["tokens_per_second_speculative"] = round(self.tokens_per_second_speculative, 2)
        data["tokens_per_second_baseline"] = round(self.tokens_per_second_baseline, 2)
        data["speedup"] = round(self.speedup, 3)
        return data


def _decode(tokenizer: Any, ids) -> str:
    return tokenizer.decode([int(t) for t in ids])


def run(
    *,
    model: str | Path | None = None,
    prompt: str | None = None,
    max_new_tokens: int = 128,
    num_drafts: int = 3,
    temperature: float = 0.0,
    precision: str = "bf16",
    hidden_contract: str = "post_norm",
    seed: int = 0,
    cache_dir: Path = pretrained.DEFAULT_CACHE_DIR,
    progress: bool = True,
    log=None,
) -> DemoResult:
    """Converts (or reuses), loads, generates both ways; returns the ``DemoResult``.

    ``model`` is a Hugging Face directory (``mtpjax.pretrained.load``; it needs MTP tensors and
    a ``tokenizer.json``); None runs the shipped pair. ``log`` (a callable taking a string)
    receives progress lines; None prints nothing. Bad input raises ValueError (or OSError).
    """
    import numpy as np

    from mtpjax.config import HiddenContract

    say = log or (lambda _: None)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    contract = HiddenContract(hidden_contract)
    _check_counts(max_new_tokens, num_drafts)
    source = ASSET_DIR if model is None else Path(model)
    loaded = _load(
        source, num_drafts=num_drafts, precision=precision, cache_dir=cache_dir, progress=progress
    )
    reused = "reused" if loaded.checkpoint_reused else "converted now"
    say(f"drafter checkpoint: {loaded.checkpoint} ({reused})")
    if prompt is None:
        held = default_prompt(loaded.tokenizer)
        held_out = "held-out " if model is None else ""
        prompt = held.text
        prompt_source = f"{held_out}stdlib file {held.file}, line {held.first_line}"
    else:
        prompt_source = "--prompt"
    ids = _prompt_ids(loaded, prompt, max_new_tokens=max_new_tokens, num_drafts=num_drafts)
    decode = functools.partial(
        _timed_decode,
        loaded,
        ids,
        max_new_tokens=max_new_tokens,
        num_drafts=num_drafts,
        temperature=temperature,
        hidden_contract=contract.value,
        seed=seed,
    )
    device = _device()
    say(f"speculative decoding, k={num_drafts}, on {device} (compiles once)...")
    spec, first_spec = decode(speculative=True)
    say("plain decoding with the target alone (compiles once)...")
    base, first_base = decode(speculative=False)
    say("steady state: each once more, compiled...")
    steady_spec = decode(speculative=True)[1]
    steady_base = decode(speculative=False)[1]

    spec_ids = spec.tokens[0, : spec.lengths[0]]
    base_ids = base.tokens[0, : base.lengths[0]]
    metrics = spec.metrics
    return DemoResult(
        model=str(source),
        prompt=prompt,
        prompt_source=prompt_source,
        prompt_tokens=len(ids),
        speculative_text=_decode(loaded.tokenizer, spec_ids),
        baseline_text=_decode(loaded.tokenizer, base_ids),
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
        checkpoint=str(loaded.checkpoint),
        checkpoint_reused=loaded.checkpoint_reused,
        device=device,
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
    what = "the shipped tiny Qwen3-Next-style pair" if r.shipped_pair else r.model
    lines = [
        f"mtpjax demo: MTP speculative decoding on {what}",
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
    ]
    if r.shipped_pair:
        lines += [
            "  compare bit for bit. The shipped pair is a small demonstration model: its speed-up",
            "  says little about a real model, whose target forward costs far more than a draft.)",
        ]
    else:
        lines.append("  compare bit for bit.)")
    return "\n".join(lines)


DESCRIPTION = """\
Speculative decoding with the shipped tiny Qwen3-Next-style pair, or with the Qwen3.5 / Qwen3.6 /
Qwen3-Next checkpoint directory given by --model (it needs MTP tensors and a tokenizer.json),
next to decoding with the target alone. The MTP head is converted at --precision into
--cache-dir (reused afterwards); the default prompt is code from a standard-library file held
out of the pair's training. Greedy speculation must reproduce the target's own output token for
token; the exit status is 1 if it does not, 2 for bad input. Speed is reported for the first
call of each (compilation included) and in steady state (tokens per second, speed-up) on the
default JAX device; the shipped pair is a small demonstration model, so its speed-up says little
about real models."""


def _add_common(parser: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help=f"tokens to generate (default {max_new_tokens})",
    )
    parser.add_argument("--num-drafts", type=int, default=3, help="k, drafts per round (default 3)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed when sampling (default 0)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=pretrained.DEFAULT_CACHE_DIR,
        help=f"where converted drafters are kept (default {pretrained.DEFAULT_CACHE_DIR})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line flags."""
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="a Hugging Face checkpoint directory (default: the shipped tiny pair)",
    )
    parser.add_argument("--prompt", default=None, help="prompt text (default: held-out code)")
    _add_common(parser, max_new_tokens=128)
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="bf16", help="drafter weights (default bf16)"
    )
    parser.add_argument(
        "--hidden-contract",
        choices=("post_norm", "pre_norm", "pinned"),
        default="post_norm",
        help="the hidden draft steps 2.. consume (default post_norm)",
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _bad_input(prog: str, err: BaseException) -> int:
    """One line on stderr for bad input; the exit status."""
    reason = " ".join(str(err).split()) or type(err).__name__
    print(f"{prog}: error: {reason}", file=sys.stderr)
    return BAD_INPUT


def main(args: argparse.Namespace) -> int:
    """Runs the demo for parsed ``args``; returns the exit status."""
    as_json = args.json
    try:
        result = run(
            model=args.model,
            prompt=args.prompt,
            max_new_tokens=args.max_new_tokens,
            num_drafts=args.num_drafts,
            temperature=args.temperature,
            precision=args.precision,
            hidden_contract=args.hidden_contract,
            seed=args.seed,
            cache_dir=args.cache_dir,
            progress=not as_json,
            log=None if as_json else _log,
        )
    except (ValueError, OSError) as err:
        return _bad_input("mtpjax demo", err)
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(report(result))
    return 0 if result.identical or result.temperature > 0 else 1


# ------------------------------------------------------------------------------------------
# ``mtpjax generate DIR --prompt TEXT``.


def run_generate(
    model: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    num_drafts: int = 3,
    speculation: bool = True,
    temperature: float = 0.0,
    precision: str = "keep",
    seed: int = 0,
    cache_dir: Path = pretrained.DEFAULT_CACHE_DIR,
    progress: bool = True,
) -> dict[str, Any]:
    """Generates a continuation of ``prompt`` with the checkpoint directory ``model``; returns
    what ``mtpjax generate --json`` prints. Without ``speculation`` the target decodes alone and
    the MTP head is neither converted nor needed; its steps are ``num_drafts + 1`` rows wide,
    the verify step's shape, so greedy output equals speculation's token for token. Bad input
    raises ValueError (or OSError)."""
    _check_counts(max_new_tokens, num_drafts)
    loaded = _load(
        Path(model),
        drafter=speculation,
        num_drafts=num_drafts,
        precision=precision,
        cache_dir=cache_dir,
        progress=progress,
    )
    ids = _prompt_ids(loaded, prompt, max_new_tokens=max_new_tokens, num_drafts=num_drafts)
    out, seconds = _timed_decode(
        loaded,
        ids,
        speculative=speculation,
        max_new_tokens=max_new_tokens,
        num_drafts=num_drafts,
        temperature=temperature,
        hidden_contract="post_norm",
        seed=seed,
    )
    tokens = [int(t) for t in out.tokens[0, : out.lengths[0]]]
    acceptance: dict[str, Any] = dict.fromkeys(
        ("mean_acceptance_length", "per_position_acceptance", "draft_acceptance_rate")
    )
    if out.metrics is not None:
        acceptance = dict(
            mean_acceptance_length=float(out.metrics.mean_acceptance_length()),
            per_position_acceptance=[float(r) for r in out.metrics.acceptance_rate_per_pos()],
            draft_acceptance_rate=float(out.metrics.draft_acceptance_rate()),
        )
    result = dict(
        model=str(model),
        speculation=speculation,
        prompt=prompt,
        prompt_tokens=len(ids),
        text=_decode(loaded.tokenizer, tokens),
        tokens=tokens,
        num_tokens=len(tokens),
        num_drafts=num_drafts,
        **acceptance,
        target_forwards=int(out.target_steps),
        temperature=float(temperature),
        precision=precision if speculation else None,
        checkpoint=None if loaded.checkpoint is None else str(loaded.checkpoint),
        checkpoint_reused=loaded.checkpoint_reused,
        device=_device(),
        seconds=round(seconds, 2),  # compilation included
    )
    return {k: _json_clean(v) for k, v in result.items()}


GENERATE_DESCRIPTION = """\
Generate a continuation of --prompt with a Qwen3.5 / Qwen3.6 / Qwen3-Next Hugging Face
checkpoint directory (config.json, the safetensors weights, tokenizer.json). With speculation
(the default) the checkpoint's MTP head drafts --num-drafts tokens per round, converted once at
--precision into --cache-dir; --no-speculation decodes with the target alone and needs no MTP
tensors. Prints the continuation on stdout and the acceptance metrics on stderr (--json: one
JSON object on stdout). Exit status 2 for bad input, with one line naming what is wrong."""


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """``mtpjax generate``'s arguments."""
    from mtpjax.checkpoint import PRECISIONS as CONVERT_PRECISIONS

    parser.add_argument("model", type=Path, metavar="DIR", help="Hugging Face checkpoint directory")
    parser.add_argument("--prompt", required=True, help="prompt text")
    _add_common(parser, max_new_tokens=64)
    parser.add_argument(
        "--no-speculation",
        action="store_true",
        help="decode with the target alone (steps of num-drafts + 1 rows, so the output equals "
        "speculation's token for token); needs no MTP tensors",
    )
    parser.add_argument(
        "--precision",
        choices=CONVERT_PRECISIONS,
        default="keep",
        type=str.lower,
        help="drafter weights, as `mtpjax convert` (default keep: the stored formats)",
    )


def generate_main(args: argparse.Namespace) -> int:
    """Runs ``mtpjax generate`` for parsed ``args``; returns the exit status."""
    try:
        result = run_generate(
            args.model,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            num_drafts=args.num_drafts,
            speculation=not args.no_speculation,
            temperature=args.temperature,
            precision=args.precision,
            seed=args.seed,
            cache_dir=args.cache_dir,
            progress=not args.json,
        )
    except (ValueError, OSError) as err:
        return _bad_input("mtpjax generate", err)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(result["text"])
    n, steps = result["num_tokens"], result["target_forwards"]
    summary = f"{n} tokens, {steps} target forwards after the prefill"
    if result["mean_acceptance_length"] is not None:  # speculation that drafted
        summary += (
            f", k={result['num_drafts']}: mean acceptance length "
            f"{result['mean_acceptance_length']:.2f}, draft acceptance "
            f"{100 * result['draft_acceptance_rate']:.1f}%"
        )
    _log(f"{summary}; {result['seconds']:.1f} s with compilation on {result['device']}")
    return 0
