"""Verification: the acceptance rule of a speculative round, vLLM-compatible metrics and the
jit'd verify step.

`accept` turns K drafts and the target's K+1 verify rows into the tokens to commit (greedy or
lossless rejection sampling); `metrics` accumulates the acceptance counters across rounds;
`verify` is the whole round (LM head, accept, drafter trimming) as one jit.
"""

from mtpjax.verify import metrics
from mtpjax.verify.accept import PLACEHOLDER_TOKEN_ID, AcceptResult, accept
from mtpjax.verify.metrics import SpecDecodeMetrics
from mtpjax.verify.step import VerifyOutput, verify

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "AcceptResult",
    "SpecDecodeMetrics",
    "VerifyOutput",
    "accept",
    "metrics",
    "verify",
]
