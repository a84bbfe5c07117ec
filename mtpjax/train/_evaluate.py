"""Held-out acceptance of a drafter on the hybrid target: greedy speculative decoding with k
drafts per round for each k, checked token for token against the target alone
(``scripts/measure_acceptance.py``'s measurement, for any drafter, so a head before and after
fine-tuning are measured by the same code).

Shapes: ``[B]`` prompts, ``[P]`` prompt tokens.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import generation as gen
from mtpjax import hybrid
from mtpjax.config import DrafterConfig, HiddenContract
from mtpjax.drafter import DrafterParams
from mtpjax.head import LMHeadParams

__all__ = ["acceptance"]


def _finite(x: float) -> float | None:
    return round(float(x), 4) if math.isfinite(x) else None


def acceptance(
    cfg: hybrid.HybridConfig,
    target: hybrid.HybridParams,
    head: LMHeadParams,
    drafter_cfg: DrafterConfig,
    mtp: DrafterParams,
    drafter_head: LMHeadParams,
    prompts: np.ndarray,
    *,
    ks: tuple[int, ...] = (1, 2, 3, 4),
    new_tokens: int,
    hidden_contract: HiddenContract = HiddenContract.POST_NORM,
) -> list[dict[str, Any]]:
    """One record per k: mean acceptance length (tokens per round, bonus included), the
    per-position acceptance rates, the target forwards of both runs and whether the speculative
    output equals greedy decoding with the target alone (``step_width = k + 1``, bit for bit)."""
    B, P = prompts.shape
    prompts_d = jnp.asarray(prompts, jnp.int32)
    lengths = jnp.full((B,), P, jnp.int32)
    common = dict(head_cfg=cfg.lm_head_config(), max_new_tokens=new_tokens)
    records = []
    for k in ks:
        model = hybrid.target_model(cfg, target, head, max_step=k + 1)
        base = jax.device_get(
            gen.generate_baseline(model, head, prompts_d, lengths, step_width=k + 1, **common)
        )
        out = jax.device_get(
            gen.generate(
                model,
                mtp,
                head,
                prompts_d,
                lengths,
                drafter_cfg=drafter_cfg,
                num_drafts=k,
                drafter_head=drafter_head,
                hidden_contract=hidden_contract,
                **common,
            )
        )
        m = out.metrics
        records.append(
            dict(
                k=k,
                mean_acceptance_length=_finite(m.mean_acceptance_length()),
                per_position_acceptance=[_finite(x) for x in m.acceptance_rate_per_pos()],
                draft_acceptance_rate=_finite(m.draft_acceptance_rate()),
                target_steps=int(out.target_steps),
                baseline_steps=int(base.target_steps),
                identical=bool(
                    np.array_equal(out.tokens, base.tokens)
                    and np.array_equal(out.lengths, base.lengths)
                ),
                kv_error=bool(np.any(out.kv_error)),
                num_snippets=B,
                prompt_len=P,
                new_tokens=new_tokens,
            )
        )
    return records
