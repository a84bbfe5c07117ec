"""Shared builders for the drafter tests: tiny configs, random heads, pools, numpy weight dumps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import drafter, kv
from mtpjax.config import DrafterConfig, FfnKind
from mtpjax.drafter._forward import pair_rows
from mtpjax.drafter._propose import decode_row
from mtpjax.head import LMHeadParams, from_arrays
from mtpjax.layers import DenseFfnParams
from mtpjax.weights import dequantize

H = 64
V = 128


def tiny_cfg(ffn: FfnKind = FfnKind.DENSE, **overrides) -> DrafterConfig:
    """hidden 64, 4 q heads / 2 kv heads of 16, rotary 8, vocab 128."""
    return DrafterConfig.tiny(ffn=ffn, vocab_size=V, **overrides)


@functools.cache
def make_head(cfg: DrafterConfig, seed: int = 7) -> LMHeadParams:
    """A random BF16 target head: embedding rows ~N(0, 1), projection std 1/sqrt(H)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    embedding = jax.random.normal(k1, (cfg.vocab_size, cfg.hidden_size)).astype(jnp.bfloat16)
    weight = jax.random.normal(k2, (cfg.vocab_size, cfg.hidden_size)) * cfg.hidden_size**-0.5
    # Scaled up so the draft distribution is peaked enough for the confidence tests.
    return from_arrays(
        cfg.lm_head_config(), lm_head=weight * 4.0, embedding=embedding, precision="bf16"
    )


@functools.cache
def make(cfg: DrafterConfig, precision: str = "bf16", seed: int = 0):
    """(params, head) for cfg; cached (params are never donated, so tests may share them)."""
    return drafter.init(cfg, key=jax.random.PRNGKey(seed), precision=precision), make_head(cfg)


def pool(cfg: DrafterConfig, *, max_seqs: int, max_seq_len: int = 40, block_size: int = 4):
    """A small pool: blocks of 4 rows so a few drafts cross block boundaries."""
    return drafter.pool_config(
        cfg,
        precision="bf16",
        max_seq_len=max_seq_len,
        max_seqs=max_seqs,
        block_size=block_size,
    )


def new_state(cfg: DrafterConfig, num_seqs: int, **kw) -> kv.DrafterState:
    return drafter.init_state(pool(cfg, max_seqs=num_seqs, **kw), num_seqs=num_seqs)


@jax.jit
def clone(tree):
    """A copy whose buffers survive donation of the original."""
    return jax.tree.map(lambda x: x.copy(), tree)


@jax.jit
def _all_rows(cache: kv.PagedKVCache):
    return kv.gather(cache, cache.max_rows_per_seq)[:2]


def held_rows(
    state: kv.DrafterState | kv.PagedKVCache, b: int, module: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's rows 0..seq_len-1 of a cache (or a state's module) as f32 numpy (k, v)."""
    cache = state.kv[module] if isinstance(state, kv.DrafterState) else state
    n = int(np.asarray(cache.seq_len)[b])
    k, v = np_tree(_all_rows(cache))
    return k[b, :n], v[b, :n]


@functools.partial(jax.jit, static_argnames=("cfg",))
def draft_step(params, head, cache, tokens, hidden, positions, *, cfg, active=None):
    """The single-row reference for propose: one paged row per sequence (write the pair's K/V
    where ``active``, attend over the paged context). Returns (DrafterOutput [B, ...], cache)."""
    head_cfg = cfg.lm_head_config()
    B = tokens.shape[0]
    active = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
    positions = jnp.asarray(positions, jnp.int32)
    x, a, k, v = pair_rows(
        params, head, jnp.asarray(tokens, jnp.int32)[:, None], jnp.asarray(hidden)[:, None],
        positions[:, None], cfg=cfg, head_cfg=head_cfg,
    )  # fmt: skip
    cache, _ = kv.append(cache, k, v, active.astype(jnp.int32))
    out = decode_row(
        params, head, cache, x[:, 0], a[:, 0], positions, cfg=cfg, head_cfg=head_cfg,
        implementation="auto",
    )  # fmt: skip
    return out, cache


def random_pairs(rng: np.random.Generator, shape: tuple[int, ...], vocab: int = V):
    """Random tokens int32[*shape] and target hidden bf16[*shape, H] (as a target emits it), as
    numpy arrays: tests index and slice them on the host, which compiles nothing."""
    tokens = rng.integers(0, vocab, shape).astype(np.int32)
    hidden = rng.standard_normal((*shape, H)).astype(jnp.bfloat16)
    return tokens, hidden


def np_tree(tree):
    """Every leaf as a numpy array (host-side indexing in tests compiles nothing)."""
    return jax.tree.map(np.asarray, tree)


def pairs(tokens, hidden, count, start, active=None) -> drafter.Pairs:
    return drafter.Pairs(
        tokens=jnp.asarray(tokens, jnp.int32),
        hidden=jnp.asarray(hidden),
        count=jnp.asarray(count, jnp.int32),
        start=jnp.asarray(start, jnp.int32),
        active=None if active is None else jnp.asarray(active, bool),
    )


_dequantize = jax.jit(dequantize)


def numpy_weights(params: drafter.DrafterParams, head: LMHeadParams) -> dict:
    """Every weight dequantised to float64 numpy, keyed for tests/reference_numpy.py."""

    def f64(x):
        return np.asarray(x).astype(np.float64)

    def w(x):
        return np.asarray(_dequantize(x), np.float64)

    layer, attn = params.layer, params.layer.attention
    out = dict(
        embedding=f64(head.embedding),
        lm_head=w(head.weight),
        fc=w(params.fc),
        pre_fc_norm_embedding=f64(params.pre_fc_norm_embedding),
        pre_fc_norm_hidden=f64(params.pre_fc_norm_hidden),
        input_layernorm=f64(layer.input_layernorm),
        post_attention_layernorm=f64(layer.post_attention_layernorm),
        q_proj=w(attn.q_proj),
        k_proj=w(attn.k_proj),
        v_proj=w(attn.v_proj),
        o_proj=w(attn.o_proj),
        q_norm=f64(attn.q_norm),
        k_norm=f64(attn.k_norm),
        norm=f64(params.norm),
    )
    ffn = layer.ffn
    if isinstance(ffn, DenseFfnParams):
        out.update(gate_proj=w(ffn.gate_proj), up_proj=w(ffn.up_proj), down_proj=w(ffn.down_proj))
    else:
        out.update(
            router=w(ffn.router),
            experts_gate=w(ffn.experts.gate_proj),
            experts_up=w(ffn.experts.up_proj),
            experts_down=w(ffn.experts.down_proj),
        )
        if ffn.shared_expert is not None:
            out.update(
                shared_gate=w(ffn.shared_expert.gate_proj),
                shared_up=w(ffn.shared_expert.up_proj),
                shared_down=w(ffn.shared_expert.down_proj),
            )
        if ffn.shared_expert_gate is not None:
            out.update(shared_expert_gate=w(ffn.shared_expert_gate))
    return out


def propose_default(params, head, state, window, cfg, *, bitmask=None, threshold=None, **kw):
    """propose with a no-op grammar mask and confidence threshold unless given, K=3 and the
    logits returned: the call structure most drafter tests share, so they share a compilation.
    The output comes back as numpy."""
    B = state.num_seqs
    if bitmask is None:
        bitmask = np.full((B, -(-V // 32)), -1, np.int32)
    if threshold is None:
        threshold = np.zeros((B,), np.float32)
    kw.setdefault("num_drafts", 3)
    kw.setdefault("return_logits", True)
    out, state = drafter.propose(
        params,
        head,
        state,
        window,
        cfg=cfg,
        bitmask=bitmask,
        confidence_threshold=np.asarray(threshold, np.float32),
        **kw,
    )
    return np_tree(out), state
