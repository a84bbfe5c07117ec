"""``linear(x, w)``: ``x @ W.T`` for any weight format, one dispatch over the backends.

Backends, in order of preference (each says where it compiles and what it takes):

* Mosaic GPU (sm_90): NVFP4, FP8 per-row and FP8 block-128 weights with N % 8 == 0 and
  K % 256 (NVFP4) / K % 128 (FP8) == 0 — every real projection and head — at every row count.
* Triton (sm_89+): every format and shape; BF16 and FP8 per-row past one GEMV pass (128 rows)
  as one XLA dot on BF16 operands (see :class:`TritonLinear`).
* else the pure-jnp reference.

The kernels take BF16 activations (W4A16 / W8A16 / BF16): F32 activations are rounded to BF16
on the way in, so a Pallas path agrees with the F32 reference to BF16 activation rounding, not
bit for bit.

Stacked (MoE expert) weights ``[E, N, K]`` are the caller's ``jax.vmap``:
``jax.vmap(linear)(x_e, w_e)``, or ``jax.vmap(lambda w: linear(x, w))(w_e)``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common as C
from pallas_kernels._linear.base import LinearBackend, Weight
from pallas_kernels._linear.mosaic_gpu import MOSAIC_GPU
from pallas_kernels._linear.reference import check_inputs, reference_f32
from pallas_kernels._linear.triton import TRITON
from pallas_kernels.implementation import Implementation

#: The Pallas backends, most preferred first.
BACKENDS: tuple[LinearBackend, ...] = (MOSAIC_GPU, TRITON)


def linear_backend(
    rows: int,
    w: Weight,
    implementation: Implementation | str = Implementation.AUTO,
    *,
    device: Any = None,
    config: Any = None,
) -> LinearBackend | None:
    """The backend ``linear`` runs for ``rows`` rows of ``w`` on ``device``; None: the reference.

    AUTO: the first backend that compiles for ``device`` and takes the operands. PALLAS: the
    same, or off a GPU the first that takes them (interpret mode); NotImplementedError naming
    why none applies. A ``config`` narrows the choice to the backend it configures.
    ``device`` defaults to the first of JAX's default backend.
    """
    implementation = Implementation.parse(implementation)
    device = C.default_device() if device is None else device
    if implementation is Implementation.XLA:
        return None
    forced = {Implementation.TRITON: "triton", Implementation.MOSAIC_GPU: "mosaic_gpu"}
    candidates = [
        b
        for b in BACKENDS
        if (config is None or isinstance(config, b.config_type))
        and forced.get(implementation, b.name) == b.name
    ]
    if config is not None and not candidates:
        raise TypeError(f"config {type(config).__name__} configures no linear backend")
    reasons = []
    for backend in candidates:
        reason = backend.supports(rows, w)
        if reason is None and backend.supported_on(device):
            return backend
        reasons.append(f"{backend.name}: {reason or f'does not compile for {device}'}")
    if implementation is Implementation.AUTO:
        return None
    if getattr(device, "platform", None) != "gpu":  # PALLAS off a GPU: interpret mode
        for backend in candidates:
            if backend.supports(rows, w) is None:
                return backend
    raise NotImplementedError(
        f"no Pallas backend for {rows} rows of a {w.format.value} weight of shape {w.shape}: "
        + "; ".join(reasons)
    )


def linear(
    x: jax.Array,
    w: Weight,
    *,
    out_dtype: jnp.dtype | None = None,
    implementation: Implementation | str = Implementation.AUTO,
    config: Any = None,
) -> jax.Array:
    """``x: [..., K]`` times one weight ``[N, K]`` (transposed) -> ``[..., N]`` in ``out_dtype``
    (default x's).

    ``implementation``: AUTO (the best backend for the device and operands, else the
    reference), PALLAS (a Pallas backend, interpret mode off-GPU; NotImplementedError naming why
    none applies) or XLA (the reference). ``config``: a backend's tile config (None: its
    heuristic).
    """
    x = jnp.asarray(x)
    check_inputs(x, w)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    impl = Implementation.parse(implementation)
    rows = math.prod(x.shape[:-1])
    device = C.default_device()
    backend = linear_backend(rows, w, impl, device=device, config=config)
    if backend is None:
        return reference_f32(x, w).astype(out_dtype)
    n, k = w.shape
    xb = x.reshape(rows, k).astype(jnp.bfloat16)
    out = backend(xb, w, config=config, interpret=not backend.supported_on(device))
    return out.astype(out_dtype).reshape(*x.shape[:-1], n)
