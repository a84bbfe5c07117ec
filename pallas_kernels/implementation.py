"""``implementation=``: which path an op takes, parsed in one place for the whole project.

Every op with kernels (the quantised linear, paged attention) and every library step that calls
them takes ``implementation: Implementation | str``. Strings are parsed case-insensitively by
:meth:`Implementation.parse`, which jitted entry points call *before* the value reaches a static
argument, so ``"AUTO"``, ``"auto"`` and ``Implementation.AUTO`` share one compiled program.
"""

from __future__ import annotations

import enum

__all__ = ["Implementation"]


class Implementation(enum.Enum):
    """Which path an op takes."""

    AUTO = "auto"  # the best backend that supports the device and the operands, else XLA
    XLA = "xla"  # the pure-jnp reference
    PALLAS = "pallas"  # a Pallas backend (interpret mode off-GPU); an error if none applies
    TRITON = "triton"  # PALLAS restricted to the Triton backend
    MOSAIC_GPU = "mosaic_gpu"  # PALLAS restricted to the Mosaic GPU backend

    @classmethod
    def parse(cls, value: Implementation | str) -> Implementation:
        """``value`` as an ``Implementation``; ValueError naming the accepted values otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        accepted = ", ".join(i.value for i in cls)
        raise ValueError(f"unknown implementation {value!r}; expected one of: {accepted}")
