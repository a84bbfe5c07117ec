"""Verification: the acceptance rule of a speculative round and vLLM-compatible metrics.

`accept` turns K drafts and the target's K+1 verify rows into the tokens to commit (greedy or
lossless rejection sampling); `metrics` accumulates the acceptance counters across rounds.
"""

from mtpjax.verify import metrics
from mtpjax.verify.accept import PLACEHOLDER_TOKEN_ID, AcceptResult, accept
from mtpjax.verify.metrics import SpecDecodeMetrics

__all__ = ["PLACEHOLDER_TOKEN_ID", "AcceptResult", "SpecDecodeMetrics", "accept", "metrics"]
