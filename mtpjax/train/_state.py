"""What is trained and how: the MTP head's F32 master weights, AdamW with warm-up and cosine
decay and global-norm clipping, and the jitted train step.

Trainable: every leaf of the MTP module (``DrafterParams``: ``fc``, the two pre-fc norms, the
decoder layer's projections and norms, the final ``mtp.norm``, and a dedicated MTP embedding
when the config has one). Frozen: the target, its embedding and LM head (the drafter reads them
from ``LMHeadParams``, through ``stop_gradient``; they get no gradient and no optimizer state).
Master weights are F32; the forward casts them to the head's stored dtypes (BF16), so the loss
is computed by the very forward the converted BF16 head runs, and the gradient passes through
the cast to the F32 masters. AdamW keeps two F32 moments per master element: with the master
itself, 12 bytes per trainable parameter (plus 2 for the BF16 copy the forward reads).

Shapes: ``[B]`` sequences, ``[N]`` tokens per sequence, ``H`` hidden.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mtpjax.config import DrafterConfig, KeywordOnly, LMHeadConfig
from mtpjax.drafter._params import DrafterParams, projection_formats
from mtpjax.head import LMHeadParams, lm_head
from mtpjax.train._loss import Batch, LossConfig, chain_loss
from mtpjax.weights import WeightFormat

__all__ = [
    "OptimConfig",
    "TrainState",
    "Trainable",
    "init_train_state",
    "make_optimizer",
    "train_step",
]


@dataclasses.dataclass(frozen=True)
class Trainable:
    """How the F32 master leaves map back onto the head (static: hashable).

    Attributes:
      treedef: the ``DrafterParams`` tree structure.
      dtypes: each leaf's stored dtype (what the forward reads).
    """

    treedef: Any
    dtypes: tuple[Any, ...]

    @classmethod
    def of(cls, params: DrafterParams) -> tuple[Trainable, tuple[jax.Array, ...]]:
        """(spec, F32 master leaves) of a head whose projections are all BF16 (a quantised head
        cannot be trained: convert the checkpoint with ``precision="bf16"``)."""
        formats = projection_formats(params)
        bad = {k: f.value for k, f in formats.items() if f is not WeightFormat.BF16}
        if bad:
            raise ValueError(
                f"fine-tuning needs a BF16 MTP head (convert with precision='bf16'); these "
                f"projections are stored otherwise: {bad}"
            )
        leaves, treedef = jax.tree.flatten(params)
        for leaf in leaves:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ValueError(f"a trainable leaf must be floating point, got {leaf.dtype}")
        master = tuple(jnp.asarray(leaf, jnp.float32) for leaf in leaves)
        return cls(treedef=treedef, dtypes=tuple(jnp.dtype(x.dtype) for x in leaves)), master

    def params(self, master: tuple[jax.Array, ...]) -> DrafterParams:
        """The head the forward reads: every master leaf cast to its stored dtype."""
        return jax.tree.unflatten(self.treedef, [m.astype(d) for m, d in zip(master, self.dtypes)])


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig(KeywordOnly):
    """AdamW (b1 0.9, b2 0.95) on the masters; the learning rate warms up linearly from 0 to
    ``lr`` over ``warmup_steps`` and decays by a cosine to ``lr * end_lr_ratio`` at
    ``total_steps``; gradients clipped to global norm ``clip``; weight decay on matrices only
    (never on norms)."""

    lr: float = 1e-4
    total_steps: int = 1000
    warmup_steps: int = 50
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"OptimConfig needs 0 <= warmup_steps < total_steps, got {self.warmup_steps}, "
                f"{self.total_steps}"
            )
        if not self.clip > 0:
            raise ValueError(f"OptimConfig.clip must be > 0, got {self.clip}")

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.lr,
            warmup_steps=self.warmup_steps,
            decay_steps=self.total_steps,
            end_value=self.lr * self.end_lr_ratio,
        )


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """The ``OptimConfig``'s optimizer over a tuple of master leaves."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(
            cfg.schedule(),
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=cfg.weight_decay,
            mask=lambda master: tuple(m.ndim >= 2 for m in master),
        ),
    )


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["step", "master", "opt_state"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """step: int32[] steps taken; master: the F32 master leaves; opt_state: AdamW's state."""

    step: jax.Array
    master: tuple[jax.Array, ...]
    opt_state: Any


def init_train_state(master: tuple[jax.Array, ...], cfg: OptimConfig) -> TrainState:
    state = TrainState(
        step=jnp.zeros((), jnp.int32), master=master, opt_state=make_optimizer(cfg).init(master)
    )
    # A step's outputs are committed (to its committed inputs' devices): a state of uncommitted
    # leaves (the step, the optimizer's counts, a fresh head's masters) would make the first
    # train_step compile a program of its own. Each is placed with the committed masters, or
    # where it already lives.
    placed = next((m.sharding for m in master if m.committed), None)
    if isinstance(placed, jax.sharding.NamedSharding):
        placed = jax.sharding.NamedSharding(placed.mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(
        lambda x: x if x.committed else jax.device_put(x, placed or x.sharding), state
    )


@functools.partial(
    jax.jit,
    static_argnames=("trainable", "cfg", "loss_cfg", "optim_cfg", "head_cfg"),
    donate_argnames=("state",),
)
def train_step(
    state: TrainState,
    head: LMHeadParams,
    tokens: jax.Array,
    hidden: jax.Array,
    mask: jax.Array,
    *,
    trainable: Trainable,
    cfg: DrafterConfig,
    loss_cfg: LossConfig,
    optim_cfg: OptimConfig,
    head_cfg: LMHeadConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step on tokens int32[B, N] with the frozen target's hidden f32[B, N, H] (cached
    or just computed) and the label mask f32[B, N]; ``state`` is donated.

    With distillation (``loss_cfg.kl_weight > 0``) the target's logits are the LM head over its
    hidden, computed here under ``stop_gradient``. Returns the new state and the metrics
    (``loss``, ``grad_norm``, ``lr`` and the per-step ``ce`` / ``acc`` / ``kl`` / ``agree``).
    """
    head = jax.lax.stop_gradient(head)
    hidden = jax.lax.stop_gradient(hidden.astype(jnp.float32))
    logits = None
    if loss_cfg.kl_weight > 0:
        logits = lm_head(head, hidden, cfg=head_cfg, implementation="xla").astype(jnp.float32)
    batch = Batch(tokens=tokens, hidden=hidden, target_logits=logits, mask=mask)

    def loss_fn(master):
        return chain_loss(
            trainable.params(master), head, batch, cfg=cfg, loss_cfg=loss_cfg, head_cfg=head_cfg
        )

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.master)
    tx = make_optimizer(optim_cfg)
    updates, opt_state = tx.update(grads, state.opt_state, state.master)
    master = optax.apply_updates(state.master, updates)
    metrics = dict(
        metrics, loss=loss, grad_norm=optax.tree.norm(grads), lr=optim_cfg.schedule()(state.step)
    )
    return TrainState(step=state.step + 1, master=master, opt_state=opt_state), metrics
