"""mtpjax: pure-functional JAX/Pallas multi-token-prediction (MTP) speculative decoding.

Every step is `f(params, state, inputs, *, cfg) -> (outputs, new_state)` over explicit pytrees;
each public step is one `jax.jit`. The most used names are re-exported here; each concern lives
in its own subpackage:

    mtpjax.config      typed configs built from Hugging Face config.json
    mtpjax.weights     BF16 / FP8 / FP8 block-128 / NVFP4 weights, quantize, linear
    mtpjax.kv          paged KV pool, functional block allocator, drafter state
    mtpjax.layers      norms, RoPE, gated GQA attention, FFN/MoE, the parameter description
    mtpjax.drafter     the MTP drafter: init, drafter_forward, propose, after_verify, prefill
    mtpjax.head        the target LM head and embedding (replicated and vocab-parallel)
    mtpjax.verify      the verify step; its modules accept (the rule) and metrics (vLLM's)
    mtpjax.checkpoint  Hugging Face checkpoint conversion and load_drafter
    mtpjax.target_model  TargetModel: what generation needs of a target (params, 3 callables)
    mtpjax.generation  speculative generation (one while_loop) and the plain baseline
    mtpjax.pretrained  a Qwen3.5 / Qwen3-Next Hugging Face directory loaded for generate
    mtpjax.hybrid      the Qwen3.5 / Qwen3-Next target (Gated DeltaNet + full attention)
    mtpjax.reference   the full-attention reference target (benchmarks, tests)

The verify step is `mtpjax.verify.verify` and the acceptance rule `mtpjax.accept`.
"""

from mtpjax import hybrid, verify
from mtpjax.checkpoint import DrafterCheckpoint, load_drafter
from mtpjax.config import DrafterConfig, HiddenContract, LMHeadConfig
from mtpjax.drafter import (
    DrafterParams,
    Pairs,
    ProposeOutput,
    after_verify,
    drafter_forward,
    prefill,
    propose,
    rows_to_trim,
)
from mtpjax.generation import (
    GenerateOutput,
    TargetModel,
    generate,
    generate_baseline,
    reference_target,
)
from mtpjax.head import LMHeadParams, lm_head
from mtpjax.kv import DrafterState, init_state
from mtpjax.verify import SpecDecodeMetrics, VerifyOutput
from mtpjax.verify.accept import accept
from mtpjax.weights import Precision, dequantize, linear, parse_precision, quantize

__version__ = "0.1.0"

__all__ = [
    "DrafterCheckpoint",
    "DrafterConfig",
    "DrafterParams",
    "DrafterState",
    "GenerateOutput",
    "HiddenContract",
    "LMHeadConfig",
    "LMHeadParams",
    "Pairs",
    "Precision",
    "ProposeOutput",
    "SpecDecodeMetrics",
    "TargetModel",
    "VerifyOutput",
    "__version__",
    "accept",
    "after_verify",
    "dequantize",
    "drafter_forward",
    "generate",
    "generate_baseline",
    "hybrid",
    "init_state",
    "linear",
    "lm_head",
    "load_drafter",
    "parse_precision",
    "prefill",
    "propose",
    "quantize",
    "reference_target",
    "rows_to_trim",
    "verify",
]
