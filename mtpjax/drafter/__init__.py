"""The functional MTP drafter (Qwen3-Next / Qwen3.5 head): params, teacher-forced forward, the
paged propose step, after-verify trimming and the attention-free prefill.

    params = drafter.init(cfg, key=key, precision="bf16")
    state = drafter.init_state(drafter.pool_config(cfg, precision="bf16", max_seq_len=4096,
                                                   max_seqs=B), num_seqs=B)
    state = drafter.prefill(params, head, state, prompt_pairs, cfg=cfg)
    out, state = drafter.propose(params, head, state, anchor_pairs, cfg=cfg, num_drafts=k)
    ... verify ...
    trimmed, state = drafter.after_verify(state, num_accepted, refeed=True)
    out, state = drafter.propose(params, head, state, verify_pairs, cfg=cfg, num_drafts=k)
"""

from mtpjax.drafter.after_verify import after_verify, free, rows_to_trim
from mtpjax.drafter.forward import DrafterOutput, drafter_forward, kv_rows
from mtpjax.drafter.multi_module import (
    ModuleSchedule,
    MultiDrafterParams,
    MultiDrafterState,
    after_verify_multi,
    effective_num_drafts,
    free_multi,
    init_multi,
    init_multi_state,
    module_trims,
    prefill_multi,
    propose_multi,
)
from mtpjax.drafter.params import (
    DrafterParams,
    check_runnable,
    init,
    pool_config,
    projection_formats,
    supports_prefill,
)
from mtpjax.drafter.prefill import check_prefill_support, prefill
from mtpjax.drafter.propose import (
    Pairs,
    ProposeOutput,
    StepOutput,
    draft_step,
    paged_attention,
    propose,
    unpack_bitmask,
)
from mtpjax.kv import DrafterState, init_state

__all__ = [
    "DrafterOutput",
    "DrafterParams",
    "DrafterState",
    "ModuleSchedule",
    "MultiDrafterParams",
    "MultiDrafterState",
    "Pairs",
    "ProposeOutput",
    "StepOutput",
    "after_verify",
    "after_verify_multi",
    "check_prefill_support",
    "check_runnable",
    "draft_step",
    "drafter_forward",
    "effective_num_drafts",
    "free",
    "free_multi",
    "init",
    "init_multi",
    "init_multi_state",
    "init_state",
    "kv_rows",
    "module_trims",
    "paged_attention",
    "pool_config",
    "prefill",
    "prefill_multi",
    "projection_formats",
    "propose",
    "propose_multi",
    "rows_to_trim",
    "supports_prefill",
    "unpack_bitmask",
]
