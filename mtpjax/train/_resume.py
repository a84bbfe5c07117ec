"""Orbax checkpoints of the train state every N steps, and resuming from the newest one.

The state (``TrainState``: step, F32 masters, AdamW moments) is the whole of what a run carries
from step to step: batches are a pure function of (seed, step) and the self-distilled data is
saved once beside the checkpoints, so a run resumed from step n continues exactly as the
uninterrupted run would have (the same parameters at the end, bit for bit on one machine).
"""

from __future__ import annotations

from pathlib import Path

import jax

from mtpjax.train._state import TrainState

__all__ = ["CheckpointLog"]


class CheckpointLog:
    """The train-state checkpoints under ``directory`` (an orbax ``CheckpointManager``: saves
    are written to a temporary name and renamed when complete; the newest ``keep`` are kept)."""

    def __init__(self, directory: Path, *, keep: int = 2) -> None:
        import orbax.checkpoint as ocp  # deferred: only training needs it

        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            Path(directory).resolve(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state: TrainState) -> None:
        """Saves ``state`` under its step and waits until it is on disk."""
        step = int(jax.device_get(state.step))
        self._manager.save(step, args=self._ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()

    def restore(self, like: TrainState) -> TrainState:
        """The newest saved state, in the structure, shapes and dtypes of ``like``."""
        step = self._manager.latest_step()
        if step is None:
            raise FileNotFoundError("no train-state checkpoint to resume from")
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
        return self._manager.restore(step, args=self._ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self._manager.close()
