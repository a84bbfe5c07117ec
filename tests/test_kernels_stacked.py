"""``linear`` on one entry of a stacked ``[L, N, K]`` weight (``StackedWeight``): each Pallas
backend reads the stack in place and gives bit for bit what it gives for the entry sliced out,
under a traced index (a ``lax.scan`` over layers); the Mosaic GPU kernel's CUDA lowering takes
the whole stack as its operand, so XLA makes no per-layer copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import INTERPRET

from mtpjax.weights import dequantize, linear, quantize
from pallas_kernels import MOSAIC_GPU, TRITON, Nvfp4Weight, StackedWeight, linear_backend
from pallas_kernels._linear import mosaic_gpu as GM

L = 3


def _stack(fmt: str, n: int, k: int):
    """A stacked [L, n, k] weight of ``fmt`` and its L entries as separate weights."""
    dense = jax.random.normal(jax.random.key(n + k), (L, n, k)) * 0.05
    entries = [quantize(dense[i], fmt) for i in range(L)]
    return jax.tree.map(lambda *a: jnp.stack(a), *entries), entries


def _scan_rows(backend, x, stack):
    """Every entry's product from a scan whose index is traced: f32[L, M, N]."""

    def body(_, i):
        return None, backend(x, StackedWeight(stack=stack, index=i), interpret=INTERPRET)

    return jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32))[1]


def _expected(backend, x, w):
    """What ``backend`` gives for the entry ``w`` alone (the same kernel at every row count)."""
    return backend(x, w, interpret=INTERPRET)


# [256, 512]: aligned for the Mosaic TMA copies; [200, 384] for the Triton GEMV with a K tail.
@pytest.mark.parametrize(
    "backend, fmt, rows, shape",
    [(MOSAIC_GPU, f, r, (256, 512)) for f in ("nvfp4", "fp8", "fp8_block") for r in (1, 8)]
    + [(TRITON, f, r, (200, 384)) for f in ("bf16", "fp8", "fp8_block", "nvfp4") for r in (1, 4)]
    # BF16 and FP8 per-row entries stay on the GEMV up to one pass (128 rows); from 129 rows
    # they take the XLA dot on the sliced entry.
    + [(TRITON, f, r, (200, 384)) for f in ("bf16", "fp8") for r in (16, 40, 128, 129)],
    ids=lambda v: getattr(v, "name", v),
)
def test_entry_of_a_stack_equals_the_entry_alone(backend, fmt, rows, shape):
    stack, entries = _stack(fmt, *shape)
    x = jax.random.normal(jax.random.key(rows), (rows, shape[1])).astype(jnp.bfloat16)
    got = np.asarray(_scan_rows(backend, x, stack))
    for i, w in enumerate(entries):
        np.testing.assert_array_equal(got[i], np.asarray(_expected(backend, x, w)))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "nvfp4"])
def test_linear_on_an_entry_is_linear_on_the_slice(fmt):
    stack, entries = _stack(fmt, 64, 128)
    x = jax.random.normal(jax.random.key(1), (2, 5, 128))
    for impl in ("xla", "pallas"):
        for i in (0, L - 1):
            entry = StackedWeight(stack=stack, index=jnp.int32(i))
            np.testing.assert_array_equal(
                np.asarray(linear(x, entry, implementation=impl)),
                np.asarray(linear(x, entries[i], implementation=impl)),
            )


def test_stacked_weight_names_what_is_wrong():
    stack, entries = _stack("bf16", 64, 128)
    with pytest.raises(ValueError, match=r"one stacked \[L, N, K\] weight, got a bf16 weight"):
        StackedWeight(stack=entries[0], index=jnp.int32(0))
    with pytest.raises(ValueError, match=r"index must be an integer scalar, got float32\[\]"):
        StackedWeight(stack=stack, index=jnp.float32(0))
    with pytest.raises(ValueError, match=r"got int32\[2\]"):
        StackedWeight(stack=stack, index=jnp.zeros(2, jnp.int32))
    w = StackedWeight(stack=stack, index=jnp.int32(1))
    assert (w.shape, w.out_features, w.in_features) == ((64, 128), 64, 128)
    assert w.nbytes == entries[1].nbytes


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_block"])
def test_mosaic_lowering_takes_the_whole_stack(fmt):
    """Lowered for CUDA on the CPU inside a scan over layers: the custom call's operand is the
    [L, N, .] stack itself, and no dynamic slice of it comes before."""
    n, k = 1024, 2048
    stack, _ = _stack(fmt, 8, 256)  # only the pytree structure; shapes below are abstract
    codes = (L, n, k // 2) if fmt == "nvfp4" else (L, n, k)
    shapes = {
        "nvfp4": dict(packed=(codes, jnp.uint8), scale=((L, n, k // 16), jnp.float8_e4m3fn)),
        "fp8": dict(q=(codes, jnp.float8_e4m3fn), scale=((L, n), jnp.float32)),
        "fp8_block": dict(q=(codes, jnp.float8_e4m3fn), scale_inv=((L, 8, 16), jnp.float32)),
    }[fmt]
    if isinstance(stack, Nvfp4Weight):
        shapes["scale_2"] = ((L,), jnp.float32)
    abstract = {f: jax.ShapeDtypeStruct(s, d) for f, (s, d) in shapes.items()}

    def layers(x, leaves):
        w = type(stack)(**leaves)

        def body(x, i):
            return x, GM.gemv(x, StackedWeight(stack=w, index=i))

        return jax.lax.scan(body, x, jnp.arange(L, dtype=jnp.int32))[1]

    x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    text = jax.jit(layers).trace(x, abstract).lower(lowering_platforms=("cuda",)).as_text()
    dtype = "ui8" if fmt == "nvfp4" else "f8E4M3FN"
    stack_type = f"tensor<{L}x{n}x{codes[2]}x{dtype}>"
    assert "mosaic_gpu" in text and stack_type in text
    slices = [line for line in text.splitlines() if "dynamic_slice" in line]
    assert not [line for line in slices if f"{n}x{codes[2]}" in line], slices


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt, rows, n",
    [
        ("bf16", 1, 4096),
        ("bf16", 4, 4096),
        ("bf16", 32, 4096),
        ("fp8", 1, 4096),
        ("nvfp4", 4, 4096),
        ("nvfp4", 96, 4096),
        # 128 rows in one pass: split-K partial sums of 34 MB, so an entry of 128 MB.
        ("bf16", 128, 8192),
    ],
)
def test_a_scan_over_layers_copies_no_layer_on_gpu(fmt, rows, n):
    """Compiled for the GPU, the scan's temporaries stay below one layer's weight (a sliced-out
    layer would be copied whole before the kernel), and every entry's product is the entry
    alone's on the same kernel."""
    k = n
    stack, entries = _stack(fmt, n, k)
    x = jax.random.normal(jax.random.key(0), (rows, k)).astype(jnp.bfloat16)

    def layers(x, stack):
        def body(_, i):
            return None, linear(x, StackedWeight(stack=stack, index=i), out_dtype=jnp.float32)

        return jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32))[1]

    compiled = jax.jit(layers).lower(x, stack).compile()
    # A copied layer would take a whole entry; the kernels' own temporaries (split-K partial
    # sums, split x rows x N F32: 8 MB at 32 rows, 34 MB at 128) stay well below it.
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < entries[0].nbytes // 2, (temp, entries[0].nbytes)
    got = np.asarray(compiled(x, stack))
    backend = linear_backend(rows, entries[0])
    for i, w in enumerate(entries):
        # The kernel is the entry alone's, but XLA may order the sum of its split-K partials
        # differently in the two programs: a few F32 ulps of sum |x * w|.
        bound = 1e-5 * np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(dequantize(w))).T
        diff = np.abs(got[i] - np.asarray(_expected(backend, x, w)))
        assert np.all(diff <= bound + 1e-6), diff.max()
