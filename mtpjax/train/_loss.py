"""The multi-step MTP loss over ``chain_forward``: per-step cross-entropy against the sequence's
tokens and, optionally, KL distillation against the target's own distribution.

    loss = sum_s w_s * (ce_weight * CE_s + kl_weight * tau^2 * KL(p_target^tau || q_draft^tau)_s)

``CE_s`` / ``KL_s`` are means over the counted label positions of step s (``Batch.mask``); the
default step weights are FastMTP's decaying ``0.6^s`` normalised to sum 1 (0.51 / 0.31 / 0.18
for three steps). The embedding and LM head are the target's and frozen: the loss reads them
through ``jax.lax.stop_gradient``, so only the MTP head's leaves get a gradient.

Shapes: ``[B]`` sequences, ``[N]`` tokens per sequence, ``[S]`` steps, ``H`` hidden, ``V``
vocab (``V'`` draft vocab).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, HiddenContract, KeywordOnly, LMHeadConfig
from mtpjax.drafter._params import DrafterParams
from mtpjax.head import LMHeadParams
from mtpjax.train._chain import chain_forward

__all__ = ["Batch", "LossConfig", "chain_loss", "decaying_weights"]

FASTMTP_DECAY = 0.6  # FastMTP's step-weight decay: 0.51 / 0.31 / 0.18 over three steps


def decaying_weights(num_steps: int, decay: float = FASTMTP_DECAY) -> tuple[float, ...]:
    """``decay^s`` for s < num_steps, normalised to sum 1."""
    raw = [decay**s for s in range(num_steps)]
    return tuple(w / sum(raw) for w in raw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig(KeywordOnly):
    """Static loss options (a jit static argument).

    Attributes:
      num_steps: S >= 1 recursive steps trained (the k the head drafts at inference).
      step_weights: S weights, or None for ``decaying_weights(S)``.
      ce_weight: weight of the cross-entropy against the sequence's tokens.
      kl_weight: weight of the KL against the target's distribution (needs target logits).
      temperature: tau of the distillation softmaxes (the KL is scaled by tau^2).
      hidden_contract: what steps 1.. read, as in ``propose``.
    """

    num_steps: int = 3
    step_weights: tuple[float, ...] | None = None
    ce_weight: float = 1.0
    kl_weight: float = 0.0
    temperature: float = 1.0
    hidden_contract: HiddenContract = HiddenContract.POST_NORM

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"LossConfig.num_steps must be an int >= 1, got {self.num_steps!r}")
        if self.step_weights is not None:
            if len(self.step_weights) != self.num_steps or min(self.step_weights) < 0:
                raise ValueError(
                    f"LossConfig.step_weights must be {self.num_steps} weights >= 0, got "
                    f"{self.step_weights!r}"
                )
            object.__setattr__(self, "step_weights", tuple(float(w) for w in self.step_weights))
        if self.ce_weight < 0 or self.kl_weight < 0 or self.ce_weight + self.kl_weight == 0:
            raise ValueError(
                f"LossConfig.ce_weight and kl_weight must be >= 0, not both 0; got "
                f"{self.ce_weight}, {self.kl_weight}"
            )
        if not self.temperature > 0:
            raise ValueError(f"LossConfig.temperature must be > 0, got {self.temperature}")
        if not isinstance(self.hidden_contract, HiddenContract):
            raise ValueError(
                f"LossConfig.hidden_contract must be a HiddenContract, got {self.hidden_contract!r}"
            )

    @property
    def weights(self) -> tuple[float, ...]:
        return self.step_weights or decaying_weights(self.num_steps)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "hidden", "target_logits", "mask"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """Sequences with the frozen target's outputs on them.

    Attributes:
      tokens: int32[B, N] the tokens x_0..x_{N-1}.
      hidden: f32[B, N, H] the target's hidden at each position (after its final norm).
      target_logits: f32[B, N, V] the target's logits at each position (position i predicts
        x_{i+1}), or None (no distillation).
      mask: f32[B, N] weight of the label at each position (0 = not counted: prompt, padding).
    """

    tokens: jax.Array
    hidden: jax.Array
    target_logits: jax.Array | None
    mask: jax.Array


def _shifted(x: jax.Array, shift: int, width: int, fill) -> jax.Array:
    """x[:, shift : shift + width] along axis 1, padded with ``fill`` past the end."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, max(0, shift + width - x.shape[1]))
    return jnp.pad(x, pad, constant_values=fill)[:, shift : shift + width]


@functools.partial(jax.jit, static_argnames=("cfg", "loss_cfg", "head_cfg", "implementation"))
def chain_loss(
    params: DrafterParams,
    head: LMHeadParams,
    batch: Batch,
    *,
    cfg: DrafterConfig,
    loss_cfg: LossConfig,
    head_cfg: LMHeadConfig | None = None,
    implementation: str = "xla",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of the module docstring and per-step metrics.

    Step s of anchor e (pair ``(x_{e+1}, h_e)``) predicts x_{e+s+2}; it counts with weight
    ``mask[e + s + 2]`` (0 past the end). Returns (loss f32[], metrics: ``ce``, ``kl`` (with
    target logits), ``acc`` (draft argmax == label) and ``agree`` (draft argmax == the target's
    argmax, what greedy verification checks), each f32[S]).
    """
    S = loss_cfg.num_steps
    B, N = batch.tokens.shape
    chex.assert_shape(batch.hidden, (B, N, cfg.hidden_size))
    chex.assert_shape(batch.mask, (B, N))
    if N < S + 2:
        raise ValueError(
            f"Batch.tokens must have at least num_steps + 2 = {S + 2} positions, got {N}"
        )
    if loss_cfg.kl_weight > 0 and batch.target_logits is None:
        raise ValueError("LossConfig.kl_weight > 0 needs Batch.target_logits")
    head = jax.lax.stop_gradient(head)  # the target's embedding and LM head are frozen
    hidden = jax.lax.stop_gradient(batch.hidden)
    out = chain_forward(
        params,
        head,
        batch.tokens[:, 1:],
        hidden[:, :-1],
        cfg=cfg,
        num_steps=S,
        hidden_contract=loss_cfg.hidden_contract,
        head_cfg=head_cfg,
        implementation=implementation,
    )
    R = N - S  # anchors e = 0..R-1
    tau = loss_cfg.temperature
    total = jnp.float32(0.0)
    metrics: dict[str, list[jax.Array]] = {"ce": [], "acc": []}
    if batch.target_logits is not None:
        metrics |= {"kl": [], "agree": []}
    for s, w in enumerate(loss_cfg.weights):
        labels = _shifted(batch.tokens, s + 2, R, 0)  # [B, R]
        mask = _shifted(batch.mask.astype(jnp.float32), s + 2, R, 0.0)
        count = jnp.maximum(jnp.sum(mask), 1.0)
        logits = out.logits[:, s]  # [B, R, V']
        logp = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        ce = jnp.sum(ce * mask) / count
        draft = jnp.argmax(logits, axis=-1)
        metrics["ce"].append(ce)
        metrics["acc"].append(jnp.sum((draft == labels) * mask) / count)
        step = loss_cfg.ce_weight * ce
        if batch.target_logits is not None:
            target = jax.lax.stop_gradient(batch.target_logits)
            target = _shifted(target, s + 1, R, 0.0)[..., : logits.shape[-1]].astype(jnp.float32)
            p_logp = jax.nn.log_softmax(target / tau, axis=-1)
            q_logp = jax.nn.log_softmax(logits / tau, axis=-1)
            kl = jnp.sum(jnp.exp(p_logp) * (p_logp - q_logp), axis=-1)
            kl = tau**2 * jnp.sum(kl * mask) / count
            metrics["kl"].append(kl)
            metrics["agree"].append(jnp.sum((draft == jnp.argmax(target, -1)) * mask) / count)
            step = step + loss_cfg.kl_weight * kl
        total = total + w * step
    return total, {k: jnp.stack(v) for k, v in metrics.items()}
