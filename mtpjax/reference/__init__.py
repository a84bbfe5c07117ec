"""Reference models: a small Qwen3-Next-style target with a contiguous KV cache, and its
safetensors I/O in the Hugging Face layout (target + MTP head).

    cfg, target, head, dcfg, mtp = reference.load_hf(directory)
    cache = reference.init_cache(cfg, batch=B, max_len=L)
    hidden, cache = reference.target_prefill(target, head, cache, prompts, lengths, cfg=cfg)
    hidden, cache = reference.target_step(target, head, cache, tokens, start, cfg=cfg)
"""

from mtpjax.reference.hf_io import load_hf, load_target, save_hf
from mtpjax.reference.target import (
    TargetCache,
    TargetConfig,
    TargetParams,
    commit_path,
    init,
    init_cache,
    target_forward,
    target_prefill,
    target_step,
    target_tree_step,
)

__all__ = [
    "TargetCache",
    "TargetConfig",
    "TargetParams",
    "commit_path",
    "init",
    "init_cache",
    "load_hf",
    "load_target",
    "save_hf",
    "target_forward",
    "target_prefill",
    "target_step",
    "target_tree_step",
]
