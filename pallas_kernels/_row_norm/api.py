"""``rms_norm`` and ``l2_normalize`` over the last axis, one dispatch over the backends.

AUTO takes the Triton kernel on a GPU (a row's result independent of the row count, see
``triton``), else the reference; PALLAS (or TRITON) the kernel, in interpret mode off a GPU; XLA
the reference, which XLA fuses with its neighbours (fewer kernels, but its rounding may depend
on how many rows share the call).

Shapes: x [..., N], weight [N] -> f32[..., N].
"""

from __future__ import annotations

import jax

from pallas_kernels import _common as C
from pallas_kernels._row_norm import triton
from pallas_kernels._row_norm.reference import row_norm_reference
from pallas_kernels.implementation import Implementation


def _row_norm(x, weight, *, eps, mean, zero_centered, implementation) -> jax.Array:
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} does not match x's last axis {x.shape[-1]}"
        )
    kw = dict(eps=eps, mean=mean, zero_centered=zero_centered)
    if not C.runs_triton_kernel(implementation, None, op="the row norm"):
        return row_norm_reference(x, weight, **kw)
    return triton.row_norm(x, weight, interpret=not triton.supported_on(C.default_device()), **kw)


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    zero_centered: bool,
    implementation: Implementation | str = Implementation.AUTO,
) -> jax.Array:
    """``x / rms(x) * (1 + weight)`` (``zero_centered``) or ``* weight``, in F32."""
    return _row_norm(
        x, weight, eps=eps, mean=True, zero_centered=zero_centered, implementation=implementation
    )


def l2_normalize(
    x: jax.Array, *, eps: float, implementation: Implementation | str = Implementation.AUTO
) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)``, in F32."""
    return _row_norm(
        x, None, eps=eps, mean=False, zero_centered=False, implementation=implementation
    )
