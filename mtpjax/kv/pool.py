"""The paged KV pool: storage, sizing rule and row-level reads and writes.

One pool per drafter module. Rows live in blocks of `block_size`; a row is addressed by
`(block, slot)`. FP8 pools keep one F32 scale per (row, kv head): rows are written one step at a
time, so a scale shared by a whole block could not be fixed when its first row is written.

Row layouts (`PoolConfig.value_dim`): a GQA row is a key and a value of `[H, D]` each; an MLA
row (`value_dim` set) is one `[H, D]` key row whose first `value_dim` dims are also its value
(DeepSeek: the 512-wide latent, then the 64-wide RoPE key; H = 1), so it has no V buffer.

Shapes: `[P]` pool blocks, `[S]` slots per block (block_size), `[H]` KV heads, `[D]` head dim,
`[R]` rows addressed in one call.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp

from mtpjax.config import KeywordOnly

E4M3_MAX = 448.0


class KVDtype(enum.Enum):
    """Storage type of the pool: BF16, or FP8 E4M3 with per-(row, head) F32 scales."""

    BF16 = "bf16"
    FP8 = "fp8"


def pool_num_blocks(
    *, max_seq_len: int, max_seqs: int, block_size: int = 16, main_kv_blocks: int | None = None
) -> int:
    """The pool-sizing rule: `per_seq * max_seqs`, capped at `max(main_kv_blocks, per_seq)`.

    `per_seq = max_seq_len // block_size + 1` (the extra block holds the rows a sequence writes
    past its last full block).
    """
    for name, value in (
        ("max_seq_len", max_seq_len),
        ("max_seqs", max_seqs),
        ("block_size", block_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    per_seq = max_seq_len // block_size + 1
    blocks = per_seq * max_seqs
    if main_kv_blocks is not None:
        if main_kv_blocks < 1:
            raise ValueError(f"main_kv_blocks must be >= 1, got {main_kv_blocks}")
        blocks = min(blocks, max(main_kv_blocks, per_seq))
    return blocks


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolConfig(KeywordOnly):
    """Static description of one paged KV pool (a static jit argument).

    Attributes:
      num_kv_heads, head_dim: per-row key shape (and value shape, without ``value_dim``).
      num_blocks: blocks in the pool (P).
      max_blocks_per_seq: block-table width; a sequence holds at most this many blocks.
      block_size: rows per block (S).
      kv_dtype: storage type.
      value_dim: None for separate K and V rows; for latent rows (MLA) the leading dims of each
        key row that are its value (``0 < value_dim < head_dim``), with no V buffer.
    """

    num_kv_heads: int
    head_dim: int
    num_blocks: int
    max_blocks_per_seq: int
    block_size: int = 16
    kv_dtype: KVDtype = KVDtype.BF16
    value_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "num_blocks", "max_blocks_per_seq", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PoolConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.kv_dtype, KVDtype):
            raise ValueError(f"PoolConfig.kv_dtype must be a KVDtype, got {self.kv_dtype!r}")
        if self.value_dim is not None and (
            not isinstance(self.value_dim, int) or not 0 < self.value_dim < self.head_dim
        ):
            raise ValueError(
                f"PoolConfig.value_dim must be None or an int in (0, head_dim={self.head_dim}), "
                f"got {self.value_dim!r}"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes one row (one token) of the pool holds: K (and V), plus FP8's F32 scales."""
        buffers = 1 if self.value_dim is not None else 2
        width = 1 if self.kv_dtype is KVDtype.FP8 else 2
        scales = 4 * self.num_kv_heads if self.kv_dtype is KVDtype.FP8 else 0
        return buffers * (self.num_kv_heads * self.head_dim * width + scales)

    @classmethod
    def for_sequences(
        cls,
        *,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        max_seqs: int,
        block_size: int = 16,
        kv_dtype: KVDtype = KVDtype.BF16,
        main_kv_blocks: int | None = None,
        value_dim: int | None = None,
    ) -> PoolConfig:
        """A pool sized by `pool_num_blocks` for `max_seqs` sequences of `max_seq_len` rows."""
        return cls(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_blocks=pool_num_blocks(
                max_seq_len=max_seq_len,
                max_seqs=max_seqs,
                block_size=block_size,
                main_kv_blocks=main_kv_blocks,
            ),
            max_blocks_per_seq=max_seq_len // block_size + 1,
            block_size=block_size,
            kv_dtype=kv_dtype,
            value_dim=value_dim,
        )

    @property
    def max_rows_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "k_scale", "v_scale"],
    meta_fields=["value_dim"],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVPool:
    """Pool storage.

    Attributes:
      k, v: [P, S, H, D] bf16 or float8_e4m3fn; v is None for latent rows.
      k_scale, v_scale: f32[P, S, H] for FP8 pools (value = code * scale), None for BF16 (and
        v_scale for latent rows, whose values are dequantised with the keys' scales).
      value_dim: static; None, or for latent rows the leading dims of k that are the value.
    """

    k: jax.Array
    v: jax.Array | None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    value_dim: int | None = None

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


def init_pool(cfg: PoolConfig) -> KVPool:
    """A zero-filled pool for `cfg`."""
    shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    latent = cfg.value_dim is not None
    dtype = jnp.bfloat16 if cfg.kv_dtype is KVDtype.BF16 else jnp.float8_e4m3fn
    scale = None if cfg.kv_dtype is KVDtype.BF16 else jnp.ones(shape[:-1], jnp.float32)
    return KVPool(
        k=jnp.zeros(shape, dtype),
        v=None if latent else jnp.zeros(shape, dtype),
        k_scale=scale,
        v_scale=None if latent or scale is None else jnp.ones(shape[:-1], jnp.float32),
        value_dim=cfg.value_dim,
    )


def quantize_rows_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (float8_e4m3fn[..., D], f32[...]) with one amax/448 scale per row."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def _scatter_fp8(dst: jax.Array, block: jax.Array, slot: jax.Array, rows: jax.Array) -> jax.Array:
    # Scatter the codes as bytes: XLA may lower a float8 scatter by converting the whole pool to
    # a wider float and back, which copies the pool on every write instead of updating in place.
    bits = jax.lax.bitcast_convert_type(dst, jnp.uint8)
    bits = bits.at[block, slot].set(jax.lax.bitcast_convert_type(rows, jnp.uint8), mode="drop")
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)


def write_rows(
    pool: KVPool, block: jax.Array, slot: jax.Array, k: jax.Array, v: jax.Array | None
) -> KVPool:
    """Writes rows into the pool.

    Args:
      block, slot: int32[R] row addresses; a block id outside [0, P) drops that row, which is how
        callers discard rows they must not write.
      k, v: [R, H, D] rows, any float dtype; v is None for latent rows (and only then).
    """
    if (v is None) != (pool.v is None):
        raise ValueError(
            "write_rows: latent pools (value_dim set) take key rows only (v=None); others take "
            f"both; got v={'None' if v is None else 'rows'} for value_dim={pool.value_dim}"
        )
    if pool.k_scale is None:
        return dataclasses.replace(
            pool,
            k=pool.k.at[block, slot].set(k.astype(pool.k.dtype), mode="drop"),
            v=None
            if v is None
            else pool.v.at[block, slot].set(v.astype(pool.v.dtype), mode="drop"),
        )
    kq, ks = quantize_rows_fp8(k)
    pool = dataclasses.replace(
        pool,
        k=_scatter_fp8(pool.k, block, slot, kq),
        k_scale=pool.k_scale.at[block, slot].set(ks, mode="drop"),
    )
    if v is None:
        return pool
    vq, vs = quantize_rows_fp8(v)
    return dataclasses.replace(
        pool,
        v=_scatter_fp8(pool.v, block, slot, vq),
        v_scale=pool.v_scale.at[block, slot].set(vs, mode="drop"),
    )


def read_rows(pool: KVPool, block: jax.Array, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dequantised rows at `(block, slot)` (any index shape [...]): k f32[..., H, D] and v
    f32[..., H, D] (latent rows: the first `value_dim` dims of k, f32[..., H, value_dim])."""
    k = pool.k[block, slot].astype(jnp.float32)
    if pool.k_scale is not None:
        k = k * pool.k_scale[block, slot][..., None]
    if pool.v is None:
        return k, k[..., : pool.value_dim]
    v = pool.v[block, slot].astype(jnp.float32)
    if pool.v_scale is not None:
        v = v * pool.v_scale[block, slot][..., None]
    return k, v
