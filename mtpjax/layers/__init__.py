"""Layer math shared by the drafter and the reference target: norms, RoPE, attention, FFN."""

from mtpjax.layers.attention import (
    AttentionParams,
    attend,
    causal_self_attention,
    output_projection,
    project_kv,
    project_q,
)
from mtpjax.layers.decoder import DecoderLayerParams, decoder_layer
from mtpjax.layers.ffn import DenseFfnParams, MoeFfnParams, dense_ffn, moe_ffn, route
from mtpjax.layers.norms import rms_norm
from mtpjax.layers.rope import apply_rope, rope_cos_sin

__all__ = [
    "AttentionParams",
    "DecoderLayerParams",
    "DenseFfnParams",
    "MoeFfnParams",
    "apply_rope",
    "attend",
    "causal_self_attention",
    "decoder_layer",
    "dense_ffn",
    "moe_ffn",
    "output_projection",
    "project_kv",
    "project_q",
    "rms_norm",
    "rope_cos_sin",
    "route",
]
