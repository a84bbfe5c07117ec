"""mtpjax: pure-functional JAX/Pallas multi-token-prediction speculative decoding.

The public API is re-exported here; each concern lives in its own module (see README).
"""

__version__ = "0.1.0"
