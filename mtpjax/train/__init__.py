"""Fine-tuning an MTP head on a frozen target, over the K recursive steps it drafts, with the
forward ``propose`` runs (FastMTP's recipe: self-distilled data, decaying step weights).

    trainable, master = train.Trainable.of(mtp)              # F32 masters of the head
    state = train.init_train_state(master, optim_cfg)
    state, metrics = train.train_step(state, head, tokens, hidden, mask, trainable=trainable,
                                      cfg=dcfg, loss_cfg=loss_cfg, optim_cfg=optim_cfg,
                                      head_cfg=hcfg)

``chain_forward`` is ``propose``'s chain teacher-forced over whole sequences; ``chain_loss``
the per-step weighted cross-entropy / distillation loss over it; ``hybrid_batch`` the frozen
target's outputs; ``self_distill`` / ``training_prompts`` the self-distilled sequences;
``write_model_dir`` the fine-tuned head written back in the Hugging Face layout and converted;
``CheckpointLog`` the train state's orbax checkpoints; ``acceptance`` held-out acceptance before
and after; ``finetune_main`` the command line (``mtpjax finetune``, whose docstring states the
memory of a Qwen3.5-27B-sized head).
"""

from mtpjax.train._chain import ChainOutput, chain_attention, chain_forward
from mtpjax.train._cli import INTERRUPTED
from mtpjax.train._cli import main as finetune_main
from mtpjax.train._data import heldout_prompts, self_distill, training_files, training_prompts
from mtpjax.train._evaluate import acceptance
from mtpjax.train._export import hf_tensors, write_model_dir
from mtpjax.train._loss import Batch, LossConfig, chain_loss, decaying_weights
from mtpjax.train._resume import CheckpointLog
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
    "INTERRUPTED",
    "Batch",
    "ChainOutput",
    "CheckpointLog",
    "LossConfig",
    "OptimConfig",
    "TrainState",
    "Trainable",
    "acceptance",
    "chain_attention",
    "chain_forward",
    "chain_loss",
    "decaying_weights",
    "finetune_main",
    "heldout_prompts",
    "hf_tensors",
    "hybrid_batch",
    "init_train_state",
    "make_optimizer",
    "self_distill",
    "train_step",
    "training_files",
    "training_prompts",
    "write_model_dir",
]
