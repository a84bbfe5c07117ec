"""Greedy generation from the shipped pair in transformers and in mtpjax, token for token.

    python3 scripts/check_transformers_match.py --json $OUT/transformers_match.json

Needs one interpreter with jax, torch and transformers (the GPU machine's ``python3``; torch is
not a dependency of mtpjax). The pair directory (``--pair``, default ``mtpjax/assets/tiny_pair``)
is loaded twice, in float32: by transformers' ``Qwen3_5ForCausalLM`` (which skips the ``mtp.*``
tensors) and by ``mtpjax.hybrid`` (the BF16 values it stores, float32 activations; the MTP head
through the checkpoint converter at BF16). Matmuls run at full float32 precision on both sides
(no TF32). The prompts are ``--prompts`` held-out files of the pair (``heldout_files.txt``, read
from this interpreter's standard library), a ``--prompt-len``-token window from the middle of
each, spread over the list; they have the same length, so both libraries run them as one
unpadded batch. Each continues greedily for ``--new-tokens`` tokens, end-of-text ignored:

    transformers   model.generate(do_sample=False)
    baseline       mtpjax.generate_baseline (the target alone, one token per step)
    speculative    mtpjax.generate with k = ``--num-drafts`` drafts per round

All three must be equal token for token. The table gives, per prompt, the first position where
mtpjax differs from transformers (none when equal), the speculative run's mean acceptance
length, and the smallest gap between the top two logits along the generated tokens (how close a
tie came); below it, the largest difference between the two libraries' logits over the prompt
and its continuation, teacher-forced. The exit status is 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import Qwen3_5ForCausalLM

from mtpjax import demo, hybrid
from mtpjax import generation as gen
from mtpjax.checkpoint import load_drafter
from mtpjax.head import lm_head


def heldout_prompts(pair: Path, tokenizer, *, count: int, length: int, room: int):
    """(int32[count, length] prompts, their files): the middle window of held-out files with at
    least ``length + room`` tokens, ``count`` of them spread evenly over the list."""
    pool = []
    for path in demo.heldout_files(pair):
        ids = tokenizer.encode(path.read_text(encoding="utf-8")).ids
        if len(ids) >= length + room:
            start = (len(ids) - length) // 2
            pool.append((path.name, ids[start : start + length]))
    if len(pool) < count:
        raise SystemExit(f"only {len(pool)} held-out files have {length + room} tokens")
    pick = np.linspace(0, len(pool) - 1, count).round().astype(int)
    return np.asarray([pool[i][1] for i in pick], np.int32), [pool[i][0] for i in pick]


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pair", type=Path, default=demo.ASSET_DIR, help="the pair's directory")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts (4)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (64)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated (64)")
    p.add_argument("--num-drafts", type=int, default=3, help="k of the speculative run (3)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    jax.config.update("jax_default_matmul_precision", "highest")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    N, K = args.new_tokens, args.num_drafts

    tokenizer = Tokenizer.from_file(str(args.pair / "tokenizer.json"))
    prompts, files = heldout_prompts(
        args.pair, tokenizer, count=args.prompts, length=args.prompt_len, room=N
    )
    B, P = prompts.shape

    # ---- transformers ----
    model, info = Qwen3_5ForCausalLM.from_pretrained(
        str(args.pair), dtype=torch.float32, output_loading_info=True
    )
    model = model.to(device).eval()
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    loading = dict(
        missing=list(info["missing_keys"]),
        unexpected=unexpected,
        mismatched=[str(m) for m in info["mismatched_keys"]],
    )
    model.generation_config.eos_token_id = None  # 64 tokens whatever they are
    with torch.no_grad():
        ids = torch.from_numpy(prompts).long().to(device)
        hf_out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=N,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
        hf_tokens = hf_out[:, P:].cpu().numpy().astype(np.int32)
        hf_logits = model(hf_out[:, :-1]).logits.float().cpu().numpy()  # [B, P + N - 1, V]

    # ---- mtpjax ----
    cfg = hybrid.HybridConfig.from_hf(args.pair, compute_dtype="float32")
    params, head = hybrid.load(args.pair, cfg=cfg)
    with tempfile.TemporaryDirectory() as cache:
        path, _ = demo.converted_drafter(
            "bf16", cache_dir=Path(cache), source=args.pair, progress=False
        )
        dcfg, ckpt = load_drafter(path)
    target = hybrid.target_model(cfg, params, head, max_step=K + 1, implementation="xla")
    lengths = jnp.full((B,), P, jnp.int32)
    common = dict(head_cfg=cfg.lm_head_config(), max_new_tokens=N, implementation="xla")
    base = jax.device_get(gen.generate_baseline(target, head, prompts, lengths, **common))
    spec = jax.device_get(
        gen.generate(
            target,
            ckpt.modules[0],
            head,
            prompts,
            lengths,
            drafter_cfg=dcfg,
            num_drafts=K,
            drafter_head=ckpt.head,
            **common,
        )
    )
    sequence = jnp.asarray(np.concatenate([prompts, hf_tokens[:, :-1]], axis=1))
    hidden, _ = hybrid.forward(params, head, sequence, cfg=cfg, implementation="xla")
    jax_logits = np.asarray(lm_head(head, hidden, cfg=cfg.lm_head_config(), implementation="xla"))

    # ---- compare ----
    top2 = np.sort(hf_logits[:, P - 1 :], axis=-1)[..., -2:]  # at the generated positions
    margins = (top2[..., 1] - top2[..., 0]).min(axis=1)
    logit_diff = float(np.abs(jax_logits - hf_logits).max())
    logit_scale = float(np.abs(hf_logits).max())
    per_pos = [float(r) for r in spec.metrics.acceptance_rate_per_pos()]
    rows = []
    for b in range(B):
        rows.append(
            dict(
                file=files[b],
                transformers=hf_tokens[b].tolist(),
                baseline_first_difference=first_difference(base.tokens[b], hf_tokens[b]),
                speculative_first_difference=first_difference(spec.tokens[b], hf_tokens[b]),
                speculative_mean_acceptance_length=float(
                    (spec.lengths[b] - 1) / max(int(spec.active_steps[b]), 1)
                ),
                smallest_top2_gap=float(margins[b]),
                continuation=tokenizer.decode(hf_tokens[b].tolist()),
            )
        )
    equal = all(
        r["baseline_first_difference"] is None and r["speculative_first_difference"] is None
        for r in rows
    )
    clean_load = not (loading["missing"] or loading["unexpected"] or loading["mismatched"])

    def where(pos):
        return "equal" if pos is None else f"differs at {pos}"

    print(
        f"{B} held-out prompts of {P} tokens, {N} greedy tokens each; transformers "
        f"{transformers.__version__} / torch {torch.__version__} on {device}, jax "
        f"{jax.__version__} on {jax.devices()[0].platform}, float32\n"
    )
    print(f"| prompt | mtpjax baseline | mtpjax speculative k={K} | tokens/round | top-2 gap |")
    print("|---|---|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['file']} | {where(r['baseline_first_difference'])} | "
            f"{where(r['speculative_first_difference'])} | "
            f"{r['speculative_mean_acceptance_length']:.2f} | {r['smallest_top2_gap']:.3f} |"
        )
    print(
        f"\nteacher-forced logits over {P + N - 1} positions: max |mtpjax - transformers| = "
        f"{logit_diff:.2e} (logits up to {logit_scale:.1f}); speculative mean acceptance "
        f"length {float(spec.metrics.mean_acceptance_length()):.2f}, per position "
        + " ".join(f"{x:.2f}" for x in per_pos)
    )
    print(f"transformers loading: {'clean' if clean_load else loading} (mtp.* skipped)")
    print("MATCH: token for token" if equal and clean_load else "MISMATCH")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = dict(
            pair=str(args.pair),
            versions=dict(
                transformers=transformers.__version__,
                torch=torch.__version__,
                jax=jax.__version__,
                python=sys.version.split()[0],
            ),
            torch_device=device,
            jax_platform=jax.devices()[0].platform,
            prompt_len=P,
            new_tokens=N,
            num_drafts=K,
            loading=loading,
            equal=equal,
            max_logit_difference=logit_diff,
            max_logit=logit_scale,
            mean_acceptance_length=float(spec.metrics.mean_acceptance_length()),
            acceptance_rate_per_position=per_pos,
            prompts=rows,
        )
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if equal and clean_load else 1


if __name__ == "__main__":
    sys.exit(main())
