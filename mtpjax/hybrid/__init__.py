"""The Qwen3.5 / Qwen3-Next hybrid target: Gated DeltaNet and gated full-attention layers, in
pure JAX, from Hugging Face directories, with exact speculative rollback.

    cfg = hybrid.HybridConfig.from_hf(directory)          # or .tiny(...) for tests
    params, head = hybrid.load(directory)                 # or hybrid.init(cfg, key=key)
    state = hybrid.init_state(cfg, batch=B, max_len=L)    # max_step=k+1 GDN snapshots
    hidden, state = hybrid.prefill(params, head, state, tokens, lengths, cfg=cfg)
    hidden, state = hybrid.step(params, head, state, tokens, start, cfg=cfg)
    hidden, layers = hybrid.forward(params, head, tokens, cfg=cfg)
    model = hybrid.target_model(cfg, params, head)        # for mtpjax.generate / _baseline

A step keeps the GDN states after each of its rows; the next step, at the committed length,
continues from the right one by pure selection (``commit``), so rejected drafts are rolled back
by construction. ``_model``'s docstring states the state layout and its bytes per sequence.
"""

from mtpjax.hybrid._config import GdnLayout, HybridConfig, LayerType
from mtpjax.hybrid._delta import (
    causal_conv,
    chunked_delta_rule,
    l2_normalize,
    recurrent_delta_rule,
    tree_delta_rule,
)
from mtpjax.hybrid._load import load
from mtpjax.hybrid._model import (
    GdnState,
    HybridState,
    commit,
    commit_path,
    forward,
    init_state,
    prefill,
    step,
    target_model,
    tree_step,
)
from mtpjax.hybrid._params import GdnLayerParams, GdnParams, HybridParams, init, model_leaves

__all__ = [
    "GdnLayerParams",
    "GdnLayout",
    "GdnParams",
    "GdnState",
    "HybridConfig",
    "HybridParams",
    "HybridState",
    "LayerType",
    "causal_conv",
    "chunked_delta_rule",
    "commit",
    "commit_path",
    "forward",
    "init",
    "init_state",
    "l2_normalize",
    "load",
    "model_leaves",
    "prefill",
    "recurrent_delta_rule",
    "step",
    "target_model",
    "tree_delta_rule",
    "tree_step",
]
