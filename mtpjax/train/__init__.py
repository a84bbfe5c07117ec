"""Fine-tuning an MTP head on a frozen target, over the K recursive steps it drafts, with the
forward ``propose`` runs (FastMTP's recipe: self-distilled data, decaying step weights).

    trainable, master = train.Trainable.of(mtp)              # F32 masters of the head
    state = train.init_train_state(master, optim_cfg)
    state, metrics = train.train_step(state, head, tokens, hidden, mask, trainable=trainable,
                                      cfg=dcfg, loss_cfg=loss_cfg, optim_cfg=optim_cfg,
                                      head_cfg=hcfg)

``chain_forward`` is ``propose``'s chain teacher-forced over whole sequences; ``chain_loss``
the per-step weighted cross-entropy / distillation loss over it; ``hybrid_batch`` the frozen
target's outputs; ``_data`` the self-distilled sequences; ``_export`` the fine-tuned head
written back in the Hugging Face layout and converted; ``_evaluate`` held-out acceptance;
``finetune_main`` the command line (``mtpjax finetune``).
"""

from mtpjax.train._chain import ChainOutput, chain_attention, chain_forward
from mtpjax.train._loss import Batch, LossConfig, chain_loss, decaying_weights
from mtpjax.train._state import (
    OptimConfig,
    Trainable,
    TrainState,
    init_train_state,
    make_optimizer,
    train_step,
)
from mtpjax.train._target import hybrid_batch

__all__ = [
    "Batch",
    "ChainOutput",
    "LossConfig",
    "OptimConfig",
    "TrainState",
    "Trainable",
    "chain_attention",
    "chain_forward",
    "chain_loss",
    "decaying_weights",
    "hybrid_batch",
    "init_train_state",
    "make_optimizer",
    "train_step",
]
