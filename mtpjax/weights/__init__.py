"""Weight formats (BF16, FP8 per-row, FP8 block-128, NVFP4), quantisation, precision rules and
``linear``, the one entry point that multiplies activations by any of them.

The weight pytrees and ``linear`` are ``pallas_kernels``' (the op's operand contract); they are
re-exported here with the quantisation and precision rules built on them.
"""

from mtpjax.weights._precision import (
    Precision,
    Projection,
    parse_precision,
    parse_projection,
    projection_format,
    supports_drafter_prefill,
)
from mtpjax.weights._quantize import dequantize, encode_e2m1, pack_e2m1, quantize
from mtpjax.weights._stack import layer_of
from pallas_kernels import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    FP8_BLOCK,
    NVFP4_BLOCK,
    Bf16Weight,
    Fp8BlockWeight,
    Fp8RowWeight,
    Implementation,
    Nvfp4Weight,
    StackedWeight,
    Weight,
    WeightFormat,
    decode_e2m1,
    linear,
    linear_reference,
    unpack_e2m1,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_BLOCK",
    "NVFP4_BLOCK",
    "Bf16Weight",
    "Fp8BlockWeight",
    "Fp8RowWeight",
    "Implementation",
    "Nvfp4Weight",
    "Precision",
    "Projection",
    "StackedWeight",
    "Weight",
    "WeightFormat",
    "decode_e2m1",
    "dequantize",
    "encode_e2m1",
    "layer_of",
    "linear",
    "linear_reference",
    "pack_e2m1",
    "parse_precision",
    "parse_projection",
    "projection_format",
    "quantize",
    "supports_drafter_prefill",
    "unpack_e2m1",
]
