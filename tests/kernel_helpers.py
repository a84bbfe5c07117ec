"""Shared helpers for the Pallas kernel tests: random leaves, an independent E2M1 oracle, and a
tiny PTX interpreter for the inline-asm nibble decoder (which cannot run on the CPU)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import Bf16Weight, Fp8BlockWeight, Fp8RowWeight, Nvfp4Weight

#: Kernel tests run the kernels compiled on a GPU and in interpret mode elsewhere.
INTERPRET = jax.default_backend() != "gpu"

E2M1 = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64
)


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def leaves(fmt: str, n: int, k: int, rng: np.random.Generator):
    """Random leaves for one weight (``fmt``: bf16, fp8 / fp8_row, fp8_block, nvfp4)."""
    if fmt == "bf16":
        return (jnp.asarray(rng.standard_normal((n, k)) * 0.1, jnp.bfloat16),)
    if fmt in ("fp8", "fp8_row", "fp8_block"):
        q = np.clip(rng.standard_normal((n, k)) * 64, -448, 448)
        # Include E4M3 subnormals (|q| < 2**-6) so the exact-dequantisation claim is exercised.
        q[:, ::7] *= 2.0**-10
        q = jnp.asarray(q.astype(ml_dtypes.float8_e4m3fn))
        if fmt != "fp8_block":
            return q, jnp.asarray(rng.uniform(1e-3, 2e-2, n), jnp.float32)
        s = rng.uniform(1e-3, 2e-2, (-(-n // 128), -(-k // 128)))
        return q, jnp.asarray(s, jnp.float32)
    packed = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)
    scale = rng.uniform(0, 448, (n, k // 16))
    scale[:, ::5] = rng.uniform(0, 2.0**-6, scale[:, ::5].shape)  # E4M3 subnormal block scales
    return packed, jnp.asarray(scale.astype(ml_dtypes.float8_e4m3fn)), jnp.float32(0.0123)


def numpy_dequant(fmt: str, *lv) -> np.ndarray:
    """Independent float64 dequantisation straight from the leaves (the oracle of the oracles)."""
    if fmt == "bf16":
        return np.asarray(lv[0], np.float64)
    if fmt in ("fp8", "fp8_row"):
        q, s = lv
        return np.asarray(q, np.float64) * np.asarray(s, np.float64)[:, None]
    if fmt == "fp8_block":
        q, s = lv
        q = np.asarray(q, np.float64)
        n, k = q.shape
        idx_n = np.arange(n) // 128
        idx_k = np.arange(k) // 128
        return q * np.asarray(s, np.float64)[idx_n][:, idx_k]
    packed, scale, s2 = lv
    p = np.asarray(packed)
    codes = np.empty((p.shape[0], p.shape[1] * 2), np.int64)
    codes[:, 0::2] = p & 0xF
    codes[:, 1::2] = p >> 4
    s = np.repeat(np.asarray(scale, np.float64), 16, axis=1)
    return E2M1[codes] * s * float(s2)


def weight(fmt: str, *lv):
    """The weight pytree of :func:`leaves`' leaves."""
    if fmt == "bf16":
        return Bf16Weight(w=lv[0])
    if fmt in ("fp8", "fp8_row"):
        return Fp8RowWeight(q=lv[0], scale=lv[1])
    if fmt == "fp8_block":
        return Fp8BlockWeight(q=lv[0], scale_inv=lv[1])
    return Nvfp4Weight(packed=lv[0], scale=lv[1], scale_2=lv[2])


# ---------------------------------------------------------------------------------------------
# A PTX interpreter for exactly the instructions of the E2M1 inline asm.
# ---------------------------------------------------------------------------------------------


def _prmt(a: int, b: int, c: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        if sel & 8:
            raise NotImplementedError("sign-replicate prmt mode")
        out |= src[sel] << (8 * i)
    return out


def _f16x2_mul(a: int, b: int) -> int:
    av = np.array([a & 0xFFFF, a >> 16], np.uint16).view(np.float16)
    bv = np.array([b & 0xFFFF, b >> 16], np.uint16).view(np.float16)
    r = (av * bv).astype(np.float16).view(np.uint16)
    return int(r[0]) | (int(r[1]) << 16)


def run_ptx(asm: str, operands: dict[str, int]) -> dict[str, int]:
    """Interpret ``asm`` (mov/prmt/shl/shr/and/or/mul.rn.f16x2 on .b32) over ``$i`` operands."""
    regs = dict(operands)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0)

    for raw in asm.splitlines():
        line = raw.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        m = re.match(r"([a-z0-9.]+)\s+(.*)", line)
        assert m, line
        op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
        if op == "mov.b32":
            res = val(args[1])
        elif op == "prmt.b32":
            res = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "shl.b32":
            res = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
        elif op == "shr.b32":
            res = val(args[1]) >> val(args[2])
        elif op == "and.b32":
            res = val(args[1]) & val(args[2])
        elif op == "or.b32":
            res = val(args[1]) | val(args[2])
        elif op == "mul.rn.f16x2":
            res = _f16x2_mul(val(args[1]), val(args[2]))
        else:
            raise NotImplementedError(op)
        regs[args[0]] = res
    return regs
