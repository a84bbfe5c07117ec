"""A small Qwen3-Next-style target decoder with its own contiguous KV cache.

This is the model the speculative loop verifies drafts against in tests, notebooks and the
shipped tiny pair: every layer is full (gated, GQA) attention with q/k head norms and partial
NeoX RoPE, followed by a dense SwiGLU FFN; norms are zero-centred RMSNorm; a final norm produces
the hidden the LM head and the MTP drafter read. The embedding and LM head are the library's
``LMHeadParams``, shared with the drafter exactly as in a real checkpoint.

Shape glossary:
  B  batch (sequences)            T  tokens per call (prompt length, or S new tokens a step)
  L  num_hidden_layers            Lmax  rows of the KV cache per sequence
  H  hidden_size                  Nq / Nkv  query / KV heads,  D  head_dim
  I  intermediate_size            V  vocab_size

KV cache protocol: row ``p`` of sequence ``b`` holds the K/V of the token at position ``p``.
A step at ``start[b]`` writes rows ``start[b] .. start[b] + S - 1`` and its queries attend to
rows ``<= their own position``. Rows past a sequence's committed length are never read before
they are written again, so rolling back rejected speculative tokens is free: the next step
simply starts at the committed length and overwrites them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mtpjax.config import (
    DrafterConfig,
    KeywordOnly,
    LMHeadConfig,
    check_bool,
    check_divides,
    check_float,
    check_int,
    configs_by_name,
    fail,
    load_hf_config,
)
from mtpjax.draft_tree import ancestry_mask, tree_depths
from mtpjax.head import LMHeadParams, embed
from mtpjax.indexed_scan import indexed_scan
from mtpjax.layers import (
    AttentionParams,
    DenseFfnParams,
    attend,
    attend_cache,
    output_projection,
    project_kv,
    project_q,
    rms_norm,
)
from mtpjax.layers.decoder import DecoderLayerParams
from mtpjax.weights import Bf16Weight, StackedWeight, layer_of, linear
from pallas_kernels.implementation import Implementation

__all__ = [
    "TargetCache",
    "TargetConfig",
    "TargetParams",
    "commit_path",
    "init",
    "init_cache",
    "move_rows",
    "target_forward",
    "target_prefill",
    "target_step",
    "target_tree_step",
    "tree_cache_mask",
]

_COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig(KeywordOnly):
    """Static description of the reference target; a static jit argument (``cfg=``).

    Attribute names match what ``mtpjax.layers`` reads from a config. ``compute_dtype`` is the
    dtype activations are cast to before each projection: ``"float32"`` (the default) is exact
    and is what tests compare against; ``"bfloat16"`` runs BF16 x BF16 matmuls with F32
    accumulation, for training. Residuals, norms, RoPE and softmax stay F32 either way.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    zero_centered_norm: bool = True
    attn_output_gate: bool = True
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            check_int(key, getattr(self, key), minimum=1)
        check_divides(self, "num_key_value_heads", "num_attention_heads")
        check_float("partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor > 1:
            raise fail("partial_rotary_factor", self.partial_rotary_factor, "a value in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise fail(
                "partial_rotary_factor",
                self.partial_rotary_factor,
                f"a factor giving an even rotary dim >= 2 for head_dim={self.head_dim}",
            )
        check_float("rope_theta", self.rope_theta)
        check_float("rms_norm_eps", self.rms_norm_eps)
        for key in ("zero_centered_norm", "attn_output_gate", "qk_norm", "tie_word_embeddings"):
            check_bool(key, getattr(self, key))
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise fail("compute_dtype", self.compute_dtype, f"one of {_COMPUTE_DTYPES}")

    @property
    def rotary_dim(self) -> int:
        """R: leading dims of each q/k head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_proj_width(self) -> int:
        return self.num_attention_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def lm_head_config(self, *, f32_logits: bool = True) -> LMHeadConfig:
        """The config of the embedding / LM head this target shares with its drafter."""
        return LMHeadConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            f32_logits=f32_logits,
            tie_word_embeddings=self.tie_word_embeddings,
        )

    def num_parameters(self, *, mtp_layers: int = 0) -> int:
        """Parameter count: layers, final norm, embedding, LM head (+ dense MTP modules)."""
        H, I = self.hidden_size, self.intermediate_size
        attn = H * (self.q_proj_width + 2 * self.kv_width) + self.num_attention_heads * (
            self.head_dim * H
        )
        norms = 2 * H + (2 * self.head_dim if self.qk_norm else 0)
        layer = attn + 3 * H * I + norms
        head = self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        mtp = mtp_layers * (layer + 2 * H * H + 3 * H)
        return self.num_hidden_layers * layer + H + head + mtp

    # ---- Hugging Face config.json -----------------------------------------------------------

    def to_hf_config(self, *, num_mtp_layers: int = 1, **extra: Any) -> dict[str, Any]:
        """A ``qwen3_next`` ``config.json`` dict for this model with dense (expert-free) FFNs.

        Every layer is ``full_attention`` and, with ``num_experts: 0`` and every layer listed
        in ``mlp_only_layers``, uses the dense MLP in both transformers and vLLM; the MTP layer
        (``num_nextn_predict_layers``) is dense for the same reason. ``extra`` keys (token ids,
        ``torch_dtype``...) are added verbatim.
        """
        if not (self.zero_centered_norm and self.qk_norm and self.attn_output_gate):
            raise ValueError(
                "a qwen3_next config.json always means zero-centred norms, q/k norms and a gated "
                f"attention output; this config has zero_centered_norm={self.zero_centered_norm}, "
                f"qk_norm={self.qk_norm}, attn_output_gate={self.attn_output_gate}"
            )
        L = self.num_hidden_layers
        config: dict[str, Any] = {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": L,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": self.rms_norm_eps,
            "use_cache": True,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": ["full_attention"] * L,
            "full_attention_interval": 1,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(L)),
            "num_experts": 0,
            "num_experts_per_tok": 0,
            "moe_intermediate_size": 0,
            "shared_expert_intermediate_size": 0,
            "norm_topk_prob": True,
            "num_nextn_predict_layers": num_mtp_layers,
        }
        config.update(extra)
        return config

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | str | os.PathLike, *, compute_dtype: str = "float32"
    ) -> TargetConfig:
        """Build from a ``qwen3_next`` ``config.json`` (dict, file, or its directory).

        Only the subset this reference implements is accepted: every layer full attention and
        a dense FFN everywhere. Anything else raises ValueError naming the key.
        """
        raw = load_hf_config(config)
        model_type = raw.get("model_type")
        if model_type != "qwen3_next":
            raise fail("model_type", model_type, "'qwen3_next' for the reference target")

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ValueError(f"config key {key!r} is missing")
            return raw[key]

        layers = need("num_hidden_layers")
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            bad = sorted({t for t in layer_types if t != "full_attention"})
            if bad or len(layer_types) != layers:
                raise fail(
                    "layer_types",
                    layer_types,
                    f"{layers} entries, all 'full_attention' (the reference target has no "
                    "linear-attention layers)",
                )
        elif raw.get("full_attention_interval", 4) != 1:
            raise fail(
                "full_attention_interval",
                raw.get("full_attention_interval", 4),
                "1 (every layer full attention) when layer_types is absent",
            )
        experts = raw.get("num_experts", 0) or 0
        mlp_only = set(raw.get("mlp_only_layers") or [])
        if experts > 0 and not set(range(layers)) <= mlp_only:
            raise fail(
                "num_experts",
                experts,
                "0, or every layer in mlp_only_layers (the reference target has dense FFNs)",
            )
        rope = raw.get("rope_parameters") or {}
        theta = raw.get("rope_theta", rope.get("rope_theta"))
        factor = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            partial_rotary_factor=float(factor),
            rope_theta=float(theta if theta is not None else need("rope_theta")),
            rms_norm_eps=float(need("rms_norm_eps")),
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            compute_dtype=compute_dtype,
        )

    def drafter_config(self, *, num_mtp_layers: int = 1) -> DrafterConfig:
        """The dense MTP drafter config a checkpoint of this target declares."""
        return DrafterConfig.from_hf_config(self.to_hf_config(num_mtp_layers=num_mtp_layers))


# ------------------------------------------------------------------------------------------
# Parameters and cache.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetParams:
    """layers: one ``DecoderLayerParams`` whose every leaf is stacked on a leading [L] axis
    (scanned); final_norm: [H] (zero-centred). Embedding and LM head live in ``LMHeadParams``."""

    layers: DecoderLayerParams
    final_norm: jax.Array

    @property
    def num_layers(self) -> int:
        return self.layers.input_layernorm.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetCache:
    """Contiguous KV cache. k, v: [L, B, Lmax, Nkv, D] (K already normed and rotated)."""

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(
    cfg: TargetConfig, *, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32
) -> TargetCache:
    """An all-zero cache for ``batch`` sequences of up to ``max_len`` positions."""
    check_int("batch", batch, minimum=1)
    check_int("max_len", max_len, minimum=1)
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return TargetCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def _normal(key: jax.Array, shape: tuple[int, ...], std: float) -> Bf16Weight:
    return Bf16Weight(w=(std * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16))


@functools.partial(jax.jit, static_argnames=("cfg", "std"))
def init(cfg: TargetConfig, *, key: jax.Array, std: float = 0.02) -> TargetParams:
    """Random BF16 layer stack (N(0, std); residual outputs scaled by 1/sqrt(2L)) and zero
    norms (the identity for zero-centred RMSNorm). The head is initialised separately."""
    L, H, I = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    out_std = std / math.sqrt(2 * L)
    keys = iter(jax.random.split(key, 7))
    zeros = functools.partial(jnp.zeros, dtype=jnp.bfloat16)
    attention = AttentionParams(
        q_proj=_normal(next(keys), (L, cfg.q_proj_width, H), std),
        k_proj=_normal(next(keys), (L, cfg.kv_width, H), std),
        v_proj=_normal(next(keys), (L, cfg.kv_width, H), std),
        o_proj=_normal(next(keys), (L, H, cfg.num_attention_heads * cfg.head_dim), out_std),
        q_norm=zeros((L, cfg.head_dim)) if cfg.qk_norm else None,
        k_norm=zeros((L, cfg.head_dim)) if cfg.qk_norm else None,
    )
    ffn = DenseFfnParams(
        gate_proj=_normal(next(keys), (L, I, H), std),
        up_proj=_normal(next(keys), (L, I, H), std),
        down_proj=_normal(next(keys), (L, H, I), out_std),
    )
    layers = DecoderLayerParams(
        input_layernorm=zeros((L, H)),
        attention=attention,
        post_attention_layernorm=zeros((L, H)),
        ffn=ffn,
    )
    return TargetParams(layers=layers, final_norm=zeros((H,)))


# ------------------------------------------------------------------------------------------
# Forward.


def _norm(x: jax.Array, w: jax.Array, cfg: TargetConfig, implementation: str) -> jax.Array:
    return rms_norm(
        x,
        w,
        eps=cfg.rms_norm_eps,
        zero_centered=cfg.zero_centered_norm,
        implementation=implementation,
    )


def _lin(
    x: jax.Array, w: Bf16Weight | StackedWeight, cfg: TargetConfig, implementation: str
) -> jax.Array:
    return linear(
        x.astype(cfg.compute_dtype), w, out_dtype=jnp.float32, implementation=implementation
    )


def _layer(
    lp: DecoderLayerParams,
    x: jax.Array,
    positions: jax.Array,
    attention: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]],
    cfg: TargetConfig,
    implementation: str,
) -> tuple[jax.Array, Any]:
    """One residual decoder layer on x: f32[B, T, H].

    ``attention(q, k, v) -> (o f32[B, T, Nq, D], kept)`` attends the T queries to what they
    see (their own rows in a full forward or prefill, the cache after this step's rows are
    written) and says what the layer hands back (the rows, or the updated cache). Every norm
    takes ``implementation`` too: on a GPU its kernel, whose rows do not depend on the row
    count. Returns (x, kept).
    """
    cd = cfg.compute_dtype
    kw = dict(implementation=implementation, norm_implementation=implementation)
    a = _norm(x, lp.input_layernorm, cfg, implementation).astype(cd)
    q, gate = project_q(lp.attention, a, positions, cfg, **kw)
    k, v = project_kv(lp.attention, a, positions, cfg, **kw)
    o, kept = attention(q, k, v)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    x = x + output_projection(lp.attention, o.astype(cd), None, implementation=implementation)
    y = _norm(x, lp.post_attention_layernorm, cfg, implementation)
    g = _lin(y, lp.ffn.gate_proj, cfg, implementation)
    u = _lin(y, lp.ffn.up_proj, cfg, implementation)
    x = x + _lin(jax.nn.silu(g) * u, lp.ffn.down_proj, cfg, implementation)
    return x, kept


def _check_tokens(tokens: jax.Array, name: str = "tokens") -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be int[B, T], got {tokens.dtype}{list(tokens.shape)}")


def _causal_stack(params, head, tokens, positions, cfg, implementation):
    """Embedding, the layers attending within the call's own rows (row i sees rows j with
    positions[j] <= positions[i]), final norm: (hidden f32[B, T, H], (k, v) [L, B, T, Nkv, D])."""
    mask = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
    x = embed(head, tokens, cfg=cfg.lm_head_config()).astype(jnp.float32)

    def body(x, i):
        lp = layer_of(params.layers, i)
        return _layer(
            lp, x, positions, lambda q, k, v: (attend(q, k, v, mask), (k, v)), cfg, implementation
        )

    x, kv = indexed_scan(body, x, params.num_layers)
    return _norm(x, params.final_norm, cfg, implementation), kv


@configs_by_name
def target_forward(
    params: TargetParams,
    head: LMHeadParams,
    tokens: jax.Array,
    *,
    cfg: TargetConfig,
    positions: jax.Array | None = None,
    implementation: Implementation | str = Implementation.AUTO,
) -> jax.Array:
    """Full causal forward (training, oracles). tokens: int32[B, T] -> post-norm f32[B, T, H].

    ``positions`` (int32[B, T], default ``arange(T)``) also define the causal mask. One jit;
    ``implementation`` (an ``Implementation`` or its name, any case) is parsed before it.
    """
    impl = Implementation.parse(implementation).value
    return _target_forward(params, head, tokens, positions, cfg=cfg, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def _target_forward(params, head, tokens, positions, *, cfg, implementation):
    _check_tokens(tokens)
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return _causal_stack(params, head, tokens, positions, cfg, implementation)[0]


@configs_by_name
def target_prefill(
    params: TargetParams,
    head: LMHeadParams,
    cache: TargetCache,
    tokens: jax.Array,
    lengths: jax.Array,
    *,
    cfg: TargetConfig,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, TargetCache]:
    """Runs each prompt from position 0 and writes its KV rows 0..T-1. Donates ``cache``.

    tokens: int32[B, T] (right-padded); lengths: int32[B] prompt lengths (1..T).
    Returns (hidden f32[B, T, H] post-final-norm, zero at padded positions >= lengths, cache).
    Padded rows written to the cache are overwritten by the first step at ``start = lengths``.
    One jit, as ``target_forward``.
    """
    impl = Implementation.parse(implementation).value
    return _target_prefill(params, head, cache, tokens, lengths, cfg=cfg, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"), donate_argnames=("cache",))
def _target_prefill(params, head, cache, tokens, lengths, *, cfg, implementation):
    _check_tokens(tokens)
    B, T = tokens.shape
    if cache.max_len < T:
        raise ValueError(f"prompt length T={T} exceeds the cache's max_len={cache.max_len}")
    if cache.batch != B:
        raise ValueError(f"tokens have batch {B}, the cache {cache.batch}")
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, (k, v) = _causal_stack(params, head, tokens, positions, cfg, implementation)
    k_new = jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), 0, 2)
    v_new = jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), 0, 2)
    valid = positions < jnp.asarray(lengths, jnp.int32)[:, None]
    return jnp.where(valid[..., None], hidden, 0.0), TargetCache(k=k_new, v=v_new)


@configs_by_name
def target_step(
    params: TargetParams,
    head: LMHeadParams,
    cache: TargetCache,
    tokens: jax.Array,
    start: jax.Array,
    *,
    cfg: TargetConfig,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, TargetCache]:
    """Runs S new tokens per sequence at positions ``start[b] .. start[b] + S - 1``.

    tokens: int32[B, S] (S = k + 1 at verify); start: int32[B], the number of rows already
    valid for each sequence (its committed length). Writes the S rows' K/V, then each query
    attends to cache rows at positions <= its own. Rows at positions >= max_len are dropped
    (keep ``start + S <= max_len``). Returns (hidden f32[B, S, H] post-final-norm, cache).
    Donates ``cache``; ``start`` is an array, so new values never retrace. One jit, as
    ``target_forward``.
    """
    impl = Implementation.parse(implementation).value
    return _target_step(params, head, cache, tokens, start, cfg=cfg, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"), donate_argnames=("cache",))
def _target_step(params, head, cache, tokens, start, *, cfg, implementation):
    _check_tokens(tokens)
    B, S = tokens.shape
    if cache.batch != B:
        raise ValueError(f"tokens have batch {B}, the cache {cache.batch}")
    start = jnp.asarray(start, jnp.int32)
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [B, S]

    def causal(q, k_stack, v_stack, i):  # each row attends to the rows up to its position
        return attend_cache(
            q, k_stack, v_stack, positions + 1, layer=i, implementation=implementation
        )

    return _run_step(params, head, cache, tokens, positions, positions, causal, cfg, implementation)


def tree_cache_mask(start: jax.Array, parents: jax.Array, max_len: int) -> jax.Array:
    """bool[B, S, Lmax]: tree row i (written at cache row ``start + i``) attends to the rows
    before ``start`` (the committed positions) and to the rows of its ancestors, itself
    included. start: int32[B]; parents: int32[S] (``mtpjax.draft_tree``)."""
    S = parents.shape[0]
    anc = ancestry_mask(parents)  # [S, S]
    rel = jnp.arange(max_len, dtype=jnp.int32)[None, :] - start[:, None]  # [B, Lmax]
    in_tree = (rel >= 0) & (rel < S)
    tree_part = anc[jnp.arange(S)[None, :, None], jnp.clip(rel, 0, S - 1)[:, None, :]]
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_part)


def _run_step(params, head, cache, tokens, positions, slots, attention, cfg, implementation):
    """The layers over S rows per sequence at RoPE ``positions`` [B, S], written at cache rows
    ``slots`` [B, S]; ``attention(q, k_stack, v_stack, layer)`` attends the queries to layer
    ``layer`` of the stacked cache [L, B, Lmax, Nkv, D] after this step's rows are written."""
    B = tokens.shape[0]
    batch_idx = jnp.arange(B)[:, None]
    x = embed(head, tokens, cfg=cfg.lm_head_config()).astype(jnp.float32)

    # The stacked cache [L, B, Lmax, Nkv, D] is carried through the scan and each layer writes
    # its S rows in place at [i, b, slot]: a donated cache is never copied whole per step.
    def body(carry, i):
        x, k_stack, v_stack = carry
        lp = layer_of(params.layers, i)

        def write_and_attend(q, k, v):
            k_stack_new = k_stack.at[i, batch_idx, slots].set(k.astype(k_stack.dtype), mode="drop")
            v_stack_new = v_stack.at[i, batch_idx, slots].set(v.astype(v_stack.dtype), mode="drop")
            o = attention(q, k_stack_new, v_stack_new, i)
            return o, (k_stack_new, v_stack_new)

        x, (k_stack, v_stack) = _layer(lp, x, positions, write_and_attend, cfg, implementation)
        return (x, k_stack, v_stack), None

    (x, k_new, v_new), _ = indexed_scan(body, (x, cache.k, cache.v), cache.k.shape[0])
    return _norm(x, params.final_norm, cfg, implementation), TargetCache(k=k_new, v=v_new)


@configs_by_name
def target_tree_step(
    params: TargetParams,
    head: LMHeadParams,
    cache: TargetCache,
    tokens: jax.Array,
    start: jax.Array,
    parents: jax.Array,
    *,
    cfg: TargetConfig,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, TargetCache]:
    """Runs a draft tree of S rows per sequence after its committed length ``start`` int32[B].

    tokens: int32[B, S], row i the token of tree node i; parents: int32[S] the tree
    (``mtpjax.draft_tree``: ``parents[0] = -1``, ``parents[i] < i``). Row i is at position
    ``start + depth(i)``, is written at cache row ``start + i`` and attends to the rows before
    ``start`` and to its ancestors' rows (itself included). A chain (``parents = i - 1``) is
    ``target_step``. Returns (hidden f32[B, S, H] post-final-norm, cache); ``commit_path``
    then moves the accepted path's rows to their positions. Donates ``cache``; one jit.
    """
    impl = Implementation.parse(implementation).value
    return _target_tree_step(
        params, head, cache, tokens, start, parents, cfg=cfg, implementation=impl
    )


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"), donate_argnames=("cache",))
def _target_tree_step(params, head, cache, tokens, start, parents, *, cfg, implementation):
    _check_tokens(tokens)
    B, S = tokens.shape
    if cache.batch != B:
        raise ValueError(f"tokens have batch {B}, the cache {cache.batch}")
    if parents.shape != (S,):
        raise ValueError(f"parents must be int32[S={S}], got shape {tuple(parents.shape)}")
    start = jnp.asarray(start, jnp.int32)
    parents = jnp.asarray(parents, jnp.int32)
    positions = start[:, None] + tree_depths(parents)[None, :]  # [B, S]
    slots = start[:, None] + jnp.arange(S, dtype=jnp.int32)
    mask = tree_cache_mask(start, parents, cache.max_len)

    def over_tree(q, k_stack, v_stack, i):
        return attend(q, k_stack[i], v_stack[i], mask)

    return _run_step(params, head, cache, tokens, positions, slots, over_tree, cfg, implementation)


def move_rows(cache: TargetCache, start: jax.Array, path: jax.Array) -> TargetCache:
    """The cache with row ``start + d`` set to row ``start + path[:, d]`` for d < P: a tree
    step's accepted path (node numbers path int32[B, P], ``path[:, d]`` at depth d, each
    ``>= d``) moved to the rows of its positions. Works on any [..., B, Lmax, ...] stack."""
    start = jnp.asarray(start, jnp.int32)
    P = path.shape[1]
    b = jnp.arange(path.shape[0])[:, None]
    src = start[:, None] + path
    dst = start[:, None] + jnp.arange(P, dtype=jnp.int32)[None, :]

    def move(x):
        return x.at[:, b, dst].set(x[:, b, src], mode="drop")

    return TargetCache(k=move(cache.k), v=move(cache.v))


def commit_path(cache: TargetCache, start: jax.Array, path: jax.Array) -> TargetCache:
    """After ``target_tree_step`` at ``start`` int32[B]: the accepted path (node numbers
    int32[B, P], root first) moved to the cache rows of its positions ``start .. start + P -
    1`` (``move_rows``); rows past the committed length hold whatever they held. Donates
    ``cache``; one jit."""
    return _commit_path(cache, jnp.asarray(start, jnp.int32), jnp.asarray(path, jnp.int32))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _commit_path(cache, start, path):
    return move_rows(cache, start, path)
