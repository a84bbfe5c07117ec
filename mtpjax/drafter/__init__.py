"""The functional MTP drafter: params, teacher-forced forward, the paged propose step over one or
more MTP modules, after-verify trimming and the attention-free prefill.

    params = drafter.init(cfg, key=key, precision="bf16")     # or DrafterModules for N modules
    state = drafter.init_state(drafter.pool_config(cfg, precision="bf16", max_seq_len=4096,
                                                   max_seqs=B), num_seqs=B)
    state = drafter.prefill(params, head, state, prompt_pairs, cfg=cfg)
    out, state = drafter.propose(params, head, state, anchor_pairs, cfg=cfg, num_drafts=k)
    ... verify ...
    trimmed, state = drafter.after_verify(state, num_accepted, refeed=True)
    out, state = drafter.propose(params, head, state, verify_pairs, cfg=cfg, num_drafts=k)
"""

from mtpjax.drafter._forward import DrafterOutput, drafter_forward, kv_rows
from mtpjax.drafter._parallel import drafter_shardings, parallel_rules, shard_drafter
from mtpjax.drafter._params import (
    DrafterModules,
    DrafterParams,
    ModuleSchedule,
    check_prefill_support,
    check_runnable,
    effective_num_drafts,
    from_named,
    init,
    init_modules,
    kv_row_spec,
    module_leaves,
    module_prefix,
    partition_specs,
    pool_config,
    projection_formats,
    supports_prefill,
)
from mtpjax.drafter._propose import (
    Pairs,
    ProposeOutput,
    paged_attention,
    prefill,
    propose,
    unpack_bitmask,
)
from mtpjax.drafter._sampling import DEFAULT_DRAFT_TOP_K, DraftProbs
from mtpjax.drafter._tree import TreeDrafts, propose_tree
from mtpjax.drafter._trim import after_verify, free, module_trims, rows_to_trim, rows_written
from mtpjax.kv.state import DrafterState, WindowError, init_state, raise_on_state_error

__all__ = [
    "DEFAULT_DRAFT_TOP_K",
    "DraftProbs",
    "DrafterModules",
    "DrafterOutput",
    "DrafterParams",
    "DrafterState",
    "ModuleSchedule",
    "Pairs",
    "ProposeOutput",
    "TreeDrafts",
    "WindowError",
    "after_verify",
    "check_prefill_support",
    "check_runnable",
    "drafter_forward",
    "drafter_shardings",
    "effective_num_drafts",
    "free",
    "from_named",
    "init",
    "init_modules",
    "init_state",
    "kv_row_spec",
    "kv_rows",
    "module_leaves",
    "module_prefix",
    "module_trims",
    "paged_attention",
    "parallel_rules",
    "partition_specs",
    "pool_config",
    "prefill",
    "projection_formats",
    "propose",
    "propose_tree",
    "raise_on_state_error",
    "rows_to_trim",
    "rows_written",
    "shard_drafter",
    "supports_prefill",
    "unpack_bitmask",
]
