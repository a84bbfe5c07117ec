"""Verification: the acceptance rule of a speculative round, vLLM-compatible metrics and the
verify step.

`accept.accept` turns K drafts and the target's K+1 verify rows into the tokens to commit
(greedy or lossless rejection sampling); `metrics` accumulates the acceptance counters across
rounds; `verify` is the whole round (LM head, accept, drafter trimming) as one jit;
`draft_length` chooses per sequence how many drafts to send (an adaptive draft length from
measured costs). The modules `accept`, `draft_length` and `metrics` are public; the accept
function is also `mtpjax.accept`.
"""

from mtpjax.verify import accept, draft_length, metrics, tree
from mtpjax.verify._step import VerifyOutput, verify
from mtpjax.verify.accept import PLACEHOLDER_TOKEN_ID, AcceptResult
from mtpjax.verify.metrics import SpecDecodeMetrics

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "AcceptResult",
    "SpecDecodeMetrics",
    "VerifyOutput",
    "accept",
    "draft_length",
    "metrics",
    "tree",
    "verify",
]
