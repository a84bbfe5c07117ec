"""``implementation=``: which path an op takes, parsed in one place for the whole project.

Every op with kernels (the quantised linear, paged attention) and every library step that calls
them takes ``implementation: Implementation | str``. Strings are parsed case-insensitively by
:meth:`Implementation.parse`, which jitted entry points call *before* the value reaches a static
argument, so ``"AUTO"``, ``"auto"`` and ``Implementation.AUTO`` share one compiled program.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = ["Implementation", "parse_enum"]


def parse_enum[E: enum.Enum](
    kind: type[E], value: E | str, what: str, aliases: Mapping[str, E] | None = None
) -> E:
    """``value`` as a ``kind`` member: the member, or its value or an alias in any case;
    ValueError naming ``what`` and every accepted name (each alias after its member) otherwise."""
    aliases = aliases or {}
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        name = value.lower()
        try:
            return aliases[name] if name in aliases else kind(name)
        except ValueError:
            pass
    accepted = ", ".join(
        n for m in kind for n in [m.value, *(a for a in aliases if aliases[a] is m)]
    )
    raise ValueError(f"unknown {what} {value!r}; expected one of: {accepted}")


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
        return parse_enum(cls, value, "implementation")
