"""Layer math shared by the drafter and the reference target: norms, RoPE, attention, FFN."""

from mtpjax.layers._spec import (
    Leaf,
    Rules,
    init_leaf,
    layer_from_named,
    layer_leaves,
    partition_spec,
    with_normal_draws,
)
from mtpjax.layers.attention import (
    AttentionParams,
    attend,
    attend_cache,
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
    "Leaf",
    "MoeFfnParams",
    "Rules",
    "apply_rope",
    "attend",
    "attend_cache",
    "causal_self_attention",
    "decoder_layer",
    "dense_ffn",
    "init_leaf",
    "layer_from_named",
    "layer_leaves",
    "moe_ffn",
    "output_projection",
    "partition_spec",
    "project_kv",
    "project_q",
    "rms_norm",
    "rope_cos_sin",
    "route",
    "with_normal_draws",
]
