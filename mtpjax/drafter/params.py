"""Weights of one Qwen3-Next / Qwen3.5 MTP head and its random initialiser.

The head owns ``fc`` and its norms, one decoder layer and the final ``mtp.norm``; the embedding
and the LM head are the target's, passed separately as ``mtpjax.head.LMHeadParams`` (a head with
``mtp_use_dedicated_embeddings`` carries its own embedding table here).

Shapes: ``H`` hidden, ``V`` vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig, FfnKind
from mtpjax.kv import KVDtype, PoolConfig
from mtpjax.layers.decoder import (
    DecoderLayerParams,
    build_decoder_layer,
    init_norm,
    init_projection,
    with_normal_draws,
)
from mtpjax.weights import (
    Precision,
    Projection,
    Weight,
    WeightFormat,
    parse_precision,
    supports_drafter_prefill,
)

__all__ = [
    "DrafterParams",
    "check_runnable",
    "init",
    "pool_config",
    "projection_formats",
    "supports_prefill",
]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "fc",
        "pre_fc_norm_embedding",
        "pre_fc_norm_hidden",
        "layer",
        "norm",
        "embed_tokens",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterParams:
    """One MTP head (checkpoint names in brackets).

    Attributes:
      fc: [H, 2H] over ``concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]`` (mtp.fc).
      pre_fc_norm_embedding: [H] (mtp.pre_fc_norm_embedding).
      pre_fc_norm_hidden: [H] (mtp.pre_fc_norm_hidden).
      layer: the decoder layer (mtp.layers.0.*).
      norm: [H] final norm producing h_out (mtp.norm).
      embed_tokens: bf16[V, H] dedicated MTP embedding, or None to use the target's
        (``mtp_use_dedicated_embeddings``).
    """

    fc: Weight
    pre_fc_norm_embedding: jax.Array
    pre_fc_norm_hidden: jax.Array
    layer: DecoderLayerParams
    norm: jax.Array
    embed_tokens: jax.Array | None = None


def check_runnable(cfg: DrafterConfig) -> None:
    """Raises ValueError when the drafter does not implement ``cfg`` (names the reason)."""
    if not isinstance(cfg, DrafterConfig):
        raise TypeError(f"cfg must be a DrafterConfig, got {type(cfg).__name__}")
    if not cfg.runnable:
        raise ValueError(f"cannot run a {cfg.architecture.value} drafter: {cfg.unsupported_reason}")


def init(
    cfg: DrafterConfig, *, key: jax.Array, precision: Precision | str = Precision.BF16
) -> DrafterParams:
    """Random head weights for ``cfg``, each projection stored per ``projection_format``.

    Projections have std ``1/sqrt(fan_in)`` and read normed inputs, so activations stay O(1);
    norm weights are small (zero-centred: ``1 + w`` near 1). ``precision`` is
    ``nvfp4 | fp4 | fp8 | bf16`` (a dense head asked for NVFP4 keeps fc/k/v BF16). Runs as one
    jitted program (weights are generated and quantised on device).
    """
    check_runnable(cfg)
    return _init(cfg, key, parse_precision(precision))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init(cfg: DrafterConfig, key: jax.Array, precision: Precision) -> DrafterParams:
    H = cfg.hidden_size

    def build(draw) -> DrafterParams:
        fc = init_projection(
            draw, (H, 2 * H), Projection.FC, precision, dense_ffn=cfg.ffn is FfnKind.DENSE
        )
        pre_e, pre_h, norm = (init_norm(draw, H) for _ in range(3))
        embed_tokens = None
        if cfg.mtp_use_dedicated_embeddings:
            embed_tokens = draw((cfg.vocab_size, H)).astype(jnp.bfloat16)
        return DrafterParams(
            fc=fc,
            pre_fc_norm_embedding=pre_e,
            pre_fc_norm_hidden=pre_h,
            layer=build_decoder_layer(cfg, draw, precision),
            norm=norm,
            embed_tokens=embed_tokens,
        )

    return with_normal_draws(key, build)


def projection_formats(params: DrafterParams) -> dict[str, WeightFormat]:
    """Storage format of the head's attention and input projections, by checkpoint name."""
    attn = params.layer.attention
    return {
        "fc": params.fc.format,
        "q_proj": attn.q_proj.format,
        "k_proj": attn.k_proj.format,
        "v_proj": attn.v_proj.format,
        "o_proj": attn.o_proj.format,
    }


def supports_prefill(params: DrafterParams) -> bool:
    """True iff the drafter prefill can run on these weights (fc, k_proj, v_proj all BF16)."""
    return supports_drafter_prefill(projection_formats(params))


def pool_config(
    cfg: DrafterConfig,
    *,
    precision: Precision | str,
    max_seq_len: int,
    max_seqs: int,
    block_size: int = 16,
    main_kv_blocks: int | None = None,
    kv_dtype: KVDtype | None = None,
) -> PoolConfig:
    """The drafter's paged KV pool: BF16 rows for BF16/FP8 heads, FP8 for NVFP4 heads.

    Sized by the pool rule (``PoolConfig.for_sequences``); ``kv_dtype`` overrides the default.
    """
    if kv_dtype is None:
        nvfp4 = parse_precision(precision) is Precision.NVFP4
        kv_dtype = KVDtype.FP8 if nvfp4 else KVDtype.BF16
    return PoolConfig.for_sequences(
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_seq_len=max_seq_len,
        max_seqs=max_seqs,
        block_size=block_size,
        kv_dtype=kv_dtype,
        main_kv_blocks=main_kv_blocks,
    )
