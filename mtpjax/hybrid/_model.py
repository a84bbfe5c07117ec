"""The hybrid target's forward, prefill and step, its state, and its ``TargetModel``.

Every layer is pre-norm residual: ``x = x + mixer(input_layernorm(x))``, then
``x = x + ffn(post_attention_layernorm(x))`` (zero-centred RMSNorm in F32). The mixer is

- full attention (``mtpjax.layers``): gated GQA with q/k head norms and partial NeoX RoPE over a
  contiguous KV cache (row ``p`` holds position ``p``, as in ``mtpjax.reference``); or
- Gated DeltaNet, per token on ``a``: ``in_proj`` -> (mixed q|k|v [C], z [Hv, dv], b, a [Hv])
  (Qwen3-Next's packed projections are regrouped from their per-key-head order); a causal
  depthwise conv over time on the mixed q|k|v (kernel K, SiLU); q, k split into Hk heads,
  L2-normalised, q scaled by 1/sqrt(dk), both repeated to the Hv value heads (value head h reads
  key head h // (Hv / Hk)); ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``;
  the gated delta rule (``_delta``); per head ``rms_norm(o) * norm_weight * silu(z)`` (the
  weight multiplies directly, not ``1 + w``); ``out_proj``.

State and rollback. ``HybridState`` holds, per slot of the layer pattern (each leaf with a
leading [G] axis over the groups):
  full attention  ``TargetCache`` k, v: [G, B, Lmax, Nkv, D]
  GDN             ``GdnState`` conv: f32[G, B, K-1+W, C]: the conv inputs of the last step, after
                  the K-1 inputs before it; recurrent: f32[G, B, W, Hv, dk, dv]: the state after
                  each of the last step's rows
and ``base`` int32[B]: GDN snapshot ``j`` is the state after position ``base + j``, whose conv
state is ``conv[j + 1 : j + K]``. W (``max_step``) is the most rows a step may take. A step at
``start`` first commits by pure selection: it continues from snapshot ``j = start - 1 - base``
(``base < start <= base + S`` for the previous step's S rows; other values are clamped
into range, so a sequence stepped again at the same start, as ``generate`` does with finished
ones whose rows it discards, continues from snapshot 0), runs its S rows, keeps their S snapshots and sets ``base = start``. So, as for the KV
cache, rolling back rejected drafts is "the next step starts at the committed length": nothing
is recomputed. ``prefill`` leaves one snapshot, after each sequence's own length (padded
positions get beta = 0 and g = 0, so they leave the recurrent state unchanged), with
``base = lengths - 1``; a fresh ``init_state`` has ``base = -1`` and zero snapshots (the empty
sequence), so a step at 0 also works without a prefill.

Bytes per sequence at Qwen3.5-27B shapes (H 5120, 64 layers = 16 groups of 3 GDN + 1 full;
GDN 16 key / 48 value heads of 128, C = 10240, K = 4; full attention 4 KV heads of 256) for
k = 3 drafts (``max_step`` W = 4):
  recurrent snapshots  48 layers * 4 * 48 * 128 * 128 * 4 B = 603,979,776 B (576 MiB)
  conv windows         48 layers * (3 + 4) * 10240 * 4 B    =  13,762,560 B (13.1 MiB)
  KV cache             16 layers * 2 * 4 * 256 * 2 B (BF16) =      65,536 B per position
so 886,177,792 B (845 MiB) at ``max_len`` 4096 with a BF16 cache (1,154,613,248 B with the
default F32 one). The recurrent snapshots grow with W; the committed state alone would be W
times smaller.

Shapes: ``B`` sequences, ``T`` prompt positions, ``S`` rows of a step; the rest as in
``HybridConfig``'s glossary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mtpjax.config import check_int, configs_by_name
from mtpjax.draft_tree import ancestor_table, tree_depths
from mtpjax.head import LMHeadParams, embed
from mtpjax.hybrid._config import GdnLayout, HybridConfig, LayerType
from mtpjax.hybrid._delta import (
    causal_conv,
    chunked_delta_rule,
    l2_normalize,
    tree_delta_rule,
)
from mtpjax.hybrid._params import GdnParams, HybridParams, check_params, layer_view
from mtpjax.indexed_scan import indexed_scan
from mtpjax.layers import (
    attend,
    attend_cache,
    output_projection,
    project_kv,
    project_q,
    rms_norm,
)
from mtpjax.layers.decoder import apply_ffn
from mtpjax.reference import TargetCache
from mtpjax.reference.target import move_rows, tree_cache_mask
from mtpjax.target_model import TargetModel
from mtpjax.weights import layer_of, linear
from pallas_kernels import recurrent_delta_rule_stacked
from pallas_kernels.implementation import Implementation

__all__ = [
    "GdnState",
    "HybridState",
    "commit",
    "commit_path",
    "forward",
    "init_state",
    "prefill",
    "step",
    "target_model",
    "tree_step",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class GdnState:
    """One GDN slot's state. conv: f32[G, B, K-1+W, C] (the last step's conv inputs after the
    K-1 before them); recurrent: f32[G, B, W, Hv, dk, dv] (the state after each of its rows)."""

    conv: jax.Array
    recurrent: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridState:
    """The target's state for B sequences (see the module docstring).

    layers: per slot of the layer pattern, a ``TargetCache`` (full attention) or a
    ``GdnState``; base: int32[B], GDN snapshot ``j`` is the state after position ``base + j``.
    """

    layers: tuple[TargetCache | GdnState, ...]
    base: jax.Array

    @property
    def batch(self) -> int:
        return self.base.shape[0]

    @property
    def max_step(self) -> int | None:
        """W: the most rows a step may take (None when the model has no GDN layer)."""
        gdn = [s for s in self.layers if isinstance(s, GdnState)]
        return gdn[0].recurrent.shape[2] if gdn else None

    @property
    def max_len(self) -> int | None:
        """Lmax: KV cache rows per sequence (None when the model has no full-attention layer)."""
        kv = [s for s in self.layers if isinstance(s, TargetCache)]
        return kv[0].k.shape[2] if kv else None


def init_state(
    cfg: HybridConfig,
    *,
    batch: int,
    max_len: int,
    max_step: int = 4,
    kv_dtype: jnp.dtype = jnp.float32,
) -> HybridState:
    """An empty state for ``batch`` sequences of up to ``max_len`` positions whose steps take
    at most ``max_step`` rows (k + 1 for k drafts). GDN states are F32; the KV cache is
    ``kv_dtype``."""
    check_int("batch", batch, minimum=1)
    check_int("max_len", max_len, minimum=1)
    check_int("max_step", max_step, minimum=1)
    G, B, K = cfg.num_groups, batch, cfg.linear_conv_kernel_dim
    Hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    layers: list[TargetCache | GdnState] = []
    for p in range(cfg.period):
        if cfg.layer_types[p] is LayerType.FULL_ATTENTION:
            shape = (G, B, max_len, cfg.num_key_value_heads, cfg.head_dim)
            layers.append(TargetCache(k=jnp.zeros(shape, kv_dtype), v=jnp.zeros(shape, kv_dtype)))
        else:
            layers.append(
                GdnState(
                    conv=jnp.zeros((G, B, K - 1 + max_step, cfg.conv_dim), jnp.float32),
                    recurrent=jnp.zeros((G, B, max_step, Hv, dk, dv), jnp.float32),
                )
            )
    return HybridState(layers=tuple(layers), base=jnp.full((B,), -1, jnp.int32))


def _select(
    state: GdnState, j: jax.Array, K: int, group: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Snapshot ``j`` [B] of each sequence: (conv history f32[..., B, K-1, C] = the K-1 conv
    inputs up to it, recurrent f32[..., B, Hv, dk, dv]). With ``group`` int32[] only that group
    of the [G]-stacked state (gathered from the stack, no slice of it); by default the leading
    dims of the state pass through."""
    g = ... if group is None else group
    b = jnp.arange(j.shape[0])
    rows = j[:, None] + 1 + jnp.arange(K - 1, dtype=jnp.int32)  # [B, K-1]
    return state.conv[g, b[:, None], rows, :], state.recurrent[g, b, j, :, :, :]


def _snapshot_index(state: HybridState, start: jax.Array) -> jax.Array:
    W = state.max_step or 1
    return jnp.clip(jnp.asarray(start, jnp.int32) - 1 - state.base, 0, W - 1)


def commit(
    state: HybridState, start: jax.Array, *, cfg: HybridConfig
) -> tuple[tuple[jax.Array, jax.Array] | None, ...]:
    """The GDN states a step at ``start`` [B] continues from, per slot: (conv state f32[G, B,
    K-1, C], recurrent state f32[G, B, Hv, dk, dv]), None for full-attention slots. This is the
    selection every step makes first; after a prefill ``start = lengths`` gives the states after
    each prompt."""
    j = _snapshot_index(state, start)
    K = cfg.linear_conv_kernel_dim
    return tuple(_select(s, j, K) if isinstance(s, GdnState) else None for s in state.layers)


# ------------------------------------------------------------------------------------------
# Layer pieces.


def _norm(x: jax.Array, w: jax.Array, cfg: HybridConfig, implementation: str) -> jax.Array:
    """The zero-centred RMSNorm; on a GPU (AUTO) a kernel whose rows do not depend on the row
    count, as every norm of the target's steps."""
    return rms_norm(x, w, eps=cfg.rms_norm_eps, zero_centered=True, implementation=implementation)


def _lin(x: jax.Array, w, cfg: HybridConfig, implementation: str) -> jax.Array:
    return linear(
        x.astype(cfg.compute_dtype), w, out_dtype=jnp.float32, implementation=implementation
    )


def _gdn_inputs(p: GdnParams, a: jax.Array, cfg: HybridConfig, implementation: str):
    """a: [B, T, H] -> (mixed q|k|v f32[B, T, C], z [B, T, Hv, dv], b [B, T, Hv], a [B, T, Hv])."""
    lin = functools.partial(_lin, cfg=cfg, implementation=implementation)
    lead = a.shape[:-1]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.value_heads_per_key_head
    if cfg.gdn_layout is GdnLayout.SPLIT:
        mixed = lin(a, p.in_proj_qkv)
        z = lin(a, p.in_proj_z).reshape(*lead, Hv, dv)
        return mixed, z, lin(a, p.in_proj_b), lin(a, p.in_proj_a)
    # Packed rows are grouped per key head: [q_h, k_h, v_h (r heads), z_h (r heads)] and
    # [b_h (r), a_h (r)]; regrouped here into q | k | v and value-head order.
    qkvz = lin(a, p.in_proj_qkvz).reshape(*lead, Hk, 2 * dk + 2 * r * dv)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v, z = qkvz[..., 2 * dk : 2 * dk + r * dv], qkvz[..., 2 * dk + r * dv :]
    mixed = jnp.concatenate(
        [q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)], axis=-1
    )
    ba = lin(a, p.in_proj_ba).reshape(*lead, Hk, 2 * r)
    b, alpha = ba[..., :r].reshape(*lead, Hv), ba[..., r:].reshape(*lead, Hv)
    return mixed, z.reshape(*lead, Hv, dv), b, alpha


def _gdn_core_inputs(p: GdnParams, conv_out, b, alpha, cfg: HybridConfig, implementation: str):
    """The delta rule's q, k [B, T, Hv, dk], v [B, T, Hv, dv], g, beta [B, T, Hv] from the conv
    output f32[B, T, C] and the gate inputs."""
    lead = conv_out.shape[:-1]
    kd, dk, r = cfg.key_dim, cfg.linear_key_head_dim, cfg.value_heads_per_key_head
    q = conv_out[..., :kd].reshape(*lead, -1, dk)
    k = conv_out[..., kd : 2 * kd].reshape(*lead, -1, dk)
    v = conv_out[..., 2 * kd :].reshape(*lead, cfg.linear_num_value_heads, -1)
    q = jnp.repeat(l2_normalize(q, implementation=implementation) * dk**-0.5, r, axis=-2)
    k = jnp.repeat(l2_normalize(k, implementation=implementation), r, axis=-2)
    beta = jax.nn.sigmoid(b)
    decay_rate = jnp.exp(p.A_log.astype(jnp.float32))
    g = -decay_rate * jax.nn.softplus(alpha + p.dt_bias.astype(jnp.float32))
    return q, k, v, g, beta


def _gdn_output(p: GdnParams, o, z, cfg: HybridConfig, implementation: str) -> jax.Array:
    """Gated norm per value head, then out_proj: o, z [B, T, Hv, dv] -> f32[B, T, H]."""
    y = rms_norm(
        o, p.norm, eps=cfg.rms_norm_eps, zero_centered=False, implementation=implementation
    )
    y = y * jax.nn.silu(z)
    return _lin(y.reshape(*y.shape[:-2], -1), p.out_proj, cfg, implementation)


def _attention_residual(lp, x, positions, attention, cfg: HybridConfig, implementation: str):
    """x + gated attention on x: f32[B, T, H]; ``attention(q, k, v) -> (o f32[B, T, Nq, D],
    kept)`` attends the T queries to what they see (their own rows, or the cache after this
    step's rows are written) and says what to keep. Returns (x, kept)."""
    cd = cfg.compute_dtype
    kw = dict(implementation=implementation, norm_implementation=implementation)
    a = _norm(x, lp.input_layernorm, cfg, implementation).astype(cd)
    q, gate = project_q(lp.attention, a, positions, cfg, **kw)
    k, v = project_kv(lp.attention, a, positions, cfg, **kw)
    o, kept = attention(q, k, v)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    out = output_projection(lp.attention, o.astype(cd), None, implementation=implementation)
    return x + out, kept


def _ffn_residual(lp, x, layer: int, cfg: HybridConfig, implementation: str) -> jax.Array:
    y = _norm(x, lp.post_attention_layernorm, cfg, implementation).astype(cfg.compute_dtype)
    view = layer_view(cfg, layer)
    return x + apply_ffn(lp.ffn, y, cfg=view, implementation=implementation)


def _check_tokens(tokens: jax.Array) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be int[B, T], got {tokens.dtype}{list(tokens.shape)}")


def _check_call(params: HybridParams, cfg: HybridConfig) -> None:
    if not isinstance(cfg, HybridConfig):
        raise TypeError(f"cfg must be a HybridConfig, got {type(cfg).__name__}")
    check_params(params, cfg)


def _scan_groups(params: HybridParams, x, state: tuple, slot: Callable, cfg: HybridConfig):
    """Runs the layers: a ``lax.scan`` over the G groups, the P slots unrolled in each.

    ``slot(p, layer_params, g, x, slot_state) -> (x, slot_state, slot_out)`` runs slot ``p``
    of group ``g`` (layer ``g * P + p``; ``g`` int32[]). ``state`` is a tuple of per-slot
    stacks with a leading [G] axis (or None entries), carried through the scan: a slot reads
    group g's entry and writes only what it changes with indexed updates on the stack, which
    XLA keeps in place in the loop (a donated state is never copied whole per step). Returns
    (x, state, per-slot outputs with a leading [G] axis, the input of every layer f32[L, B, T,
    H]).
    """

    def body(carry, g):
        x, state = carry
        # The group's weights are read in place from the stacks (no per-group copy on a GPU).
        layers = layer_of(params.layers, g)
        state, outs, inputs = list(state), [], []
        for p in range(cfg.period):
            inputs.append(x)
            x, state[p], out = slot(p, layers[p], g, x, state[p])
            outs.append(out)
        return (x, tuple(state)), (tuple(outs), jnp.stack(inputs))

    (x, state), (outs, inputs) = indexed_scan(body, (x, state), cfg.num_groups)
    return x, state, outs, inputs.reshape(-1, *inputs.shape[2:])


# ------------------------------------------------------------------------------------------
# Prefill and forward: every position of the prompt at once (the chunked delta rule).


def _prompt_stack(params, head, tokens, lengths, cfg: HybridConfig, implementation: str):
    """The prompt through every layer from an empty state.

    Returns (x f32[B, T, H] before the final norm, per-slot outputs with a leading [G] axis:
    (k, v) [B, T, Nkv, D] for full attention, (conv state f32[B, K-1, C] after each length,
    recurrent state f32[B, Hv, dk, dv]) for GDN, layer inputs f32[L, B, T, H]).
    """
    B, T = tokens.shape
    K = cfg.linear_conv_kernel_dim
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = positions < lengths[:, None]  # [B, T]
    mask = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
    state0 = jnp.zeros(
        (B, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        jnp.float32,
    )
    history_rows = lengths[:, None] + jnp.arange(K - 1, dtype=jnp.int32)  # [B, K-1]

    def slot(p, lp, g, x, st):
        if cfg.layer_types[p] is LayerType.FULL_ATTENTION:
            x, kv = _attention_residual(
                lp,
                x,
                positions,
                lambda q, k, v: (attend(q, k, v, mask), (k, v)),
                cfg,
                implementation,
            )
            return _ffn_residual(lp, x, p, cfg, implementation), st, kv
        gdn = lp.linear_attn
        a = _norm(x, lp.input_layernorm, cfg, implementation)
        mixed, z, b, alpha = _gdn_inputs(gdn, a, cfg, implementation)
        xp = jnp.pad(mixed, ((0, 0), (K - 1, 0), (0, 0)))  # [B, K-1+T, C]
        conv = causal_conv(xp, gdn.conv1d)
        q, k, v, g, beta = _gdn_core_inputs(gdn, conv, b, alpha, cfg, implementation)
        g, beta = (jnp.where(valid[..., None], t, 0.0) for t in (g, beta))
        o, s = chunked_delta_rule(q, k, v, g, beta, state0, chunk_size=cfg.gdn_chunk_size)
        x = x + _gdn_output(gdn, o, z, cfg, implementation)
        # The conv state after each length: its last K-1 inputs (xp row t + K-1 is input t).
        history = jnp.take_along_axis(xp, history_rows[:, :, None], axis=1)
        return _ffn_residual(lp, x, p, cfg, implementation), st, (history, s)

    x = embed(head, tokens, cfg=cfg.lm_head_config()).astype(jnp.float32)
    x, _, outs, inputs = _scan_groups(params, x, (None,) * cfg.period, slot, cfg)
    return x, outs, inputs


@configs_by_name
def forward(
    params: HybridParams,
    head: LMHeadParams,
    tokens: jax.Array,
    *,
    cfg: HybridConfig,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced causal forward over whole sequences (training, oracles).

    tokens: int32[B, T]. Returns (hidden f32[B, T, H] after the final norm, layers f32[L + 1,
    B, T, H]: the input of every decoder layer, then the residual before the final norm, what
    transformers' ``output_hidden_states`` gives before its last norm). One jit;
    ``implementation`` (an ``Implementation`` or its name, any case) is parsed before it.
    """
    impl = Implementation.parse(implementation).value
    return _forward(params, head, tokens, cfg=cfg, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def _forward(params, head, tokens, *, cfg, implementation):
    _check_call(params, cfg)
    _check_tokens(tokens)
    B, T = tokens.shape
    lengths = jnp.full((B,), T, jnp.int32)
    x, _, inputs = _prompt_stack(params, head, tokens, lengths, cfg, implementation)
    layers = jnp.concatenate([inputs, x[None]], axis=0)
    return _norm(x, params.final_norm, cfg, implementation), layers


@configs_by_name
def prefill(
    params: HybridParams,
    head: LMHeadParams,
    state: HybridState,
    tokens: jax.Array,
    lengths: jax.Array,
    *,
    cfg: HybridConfig,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, HybridState]:
    """Runs each prompt from position 0 into ``state`` (any earlier contents are replaced).

    tokens: int32[B, T] right-padded; lengths: int32[B] prompt lengths (1..T). Writes KV rows
    0..T-1 (padded rows are overwritten by the first step at ``start = lengths``) and leaves
    each GDN layer's state after each sequence's own length. Returns (hidden f32[B, T, H] after
    the final norm, zero at padded positions, state). Donates ``state``; one jit, as
    ``forward``.
    """
    impl = Implementation.parse(implementation).value
    return _prefill(params, head, state, tokens, lengths, cfg=cfg, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"), donate_argnames=("state",))
def _prefill(params, head, state, tokens, lengths, *, cfg, implementation):
    _check_call(params, cfg)
    _check_tokens(tokens)
    B, T = tokens.shape
    if state.batch != B:
        raise ValueError(f"tokens have batch {B}, the state {state.batch}")
    if state.max_len is not None and state.max_len < T:
        raise ValueError(f"prompt length T={T} exceeds the state's max_len={state.max_len}")
    lengths = jnp.asarray(lengths, jnp.int32)
    x, outs, _ = _prompt_stack(params, head, tokens, lengths, cfg, implementation)
    K = cfg.linear_conv_kernel_dim
    layers = []
    for old, out in zip(state.layers, outs):
        if isinstance(old, TargetCache):
            k, v = (jax.lax.dynamic_update_slice_in_dim(o, n.astype(o.dtype), 0, axis=2)
                    for o, n in ((old.k, out[0]), (old.v, out[1])))  # fmt: skip
            layers.append(TargetCache(k=k, v=v))
        else:
            history, s = out
            conv = old.conv.at[:, :, 1:K].set(history)
            layers.append(GdnState(conv=conv, recurrent=old.recurrent.at[:, :, 0].set(s)))
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    hidden = jnp.where(valid[..., None], _norm(x, params.final_norm, cfg, implementation), 0.0)
    return hidden, HybridState(layers=tuple(layers), base=lengths - 1)


# ------------------------------------------------------------------------------------------
# Step: S rows per sequence after its committed length (the recurrent delta rule).


@configs_by_name
def step(
    params: HybridParams,
    head: LMHeadParams,
    state: HybridState,
    tokens: jax.Array,
    start: jax.Array,
    *,
    cfg: HybridConfig,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, HybridState]:
    """Runs S new tokens per sequence at positions ``start[b] .. start[b] + S - 1``.

    tokens: int32[B, S] (S = 1 to decode, k + 1 to verify, at most the state's ``max_step``);
    start: int32[B], the committed length: the step continues from the GDN snapshot after
    position ``start - 1`` (which the previous step or the prefill kept; see the module
    docstring) and attends to KV rows at positions up to each query's own. Rows at positions
    >= max_len are dropped. Returns (hidden f32[B, S, H] after the final norm, state, holding
    the GDN states after each of the S rows). Donates ``state``; ``start`` is an array, so new
    values never retrace. One jit, as ``forward``.
    """
    impl = Implementation.parse(implementation).value
    return _step(params, head, state, tokens, start, cfg=cfg, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"), donate_argnames=("state",))
def _step(params, head, state, tokens, start, *, cfg, implementation):
    return _run_step(params, head, state, tokens, start, None, cfg, implementation)


def _run_step(params, head, state, tokens, start, parents, cfg, implementation):
    """A chain step (``parents`` None: row i at position ``start + i``) or a tree step
    (``parents`` int32[S]: row i at ``start + depth(i)``, over its ancestors only)."""
    _check_call(params, cfg)
    _check_tokens(tokens)
    B, S = tokens.shape
    if state.batch != B:
        raise ValueError(f"tokens have batch {B}, the state {state.batch}")
    if state.max_step is not None and state.max_step < S:
        raise ValueError(
            f"tokens have S={S} rows, but the state keeps GDN snapshots for at most "
            f"max_step={state.max_step}; make it with init_state(..., max_step={S}) (or "
            f"target_model(..., max_step={S}))"
        )
    K = cfg.linear_conv_kernel_dim
    start = jnp.asarray(start, jnp.int32)
    j = _snapshot_index(state, start)
    slots = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [B, S] cache rows written
    batch_idx = jnp.arange(B)[:, None]
    if parents is None:
        positions, conv_rows = slots, None
        lengths = positions + 1  # each row attends to the rows up to its position
    else:
        parents = jnp.asarray(parents, jnp.int32)
        depth = tree_depths(parents)
        positions = start[:, None] + depth[None, :]
        # Tap t of node i reads the input m = K-1-t steps up its path: its m-th ancestor's row
        # of the step when m <= depth(i), else history row K-1 - (m - depth(i)).
        up = ancestor_table(parents, K - 1)[::-1]  # [K, S], tap order
        steps_up = (K - 1 - jnp.arange(K, dtype=jnp.int32))[:, None]
        conv_rows = jnp.where(up >= 0, K - 1 + up, K - 1 + depth[None, :] - steps_up).T

    # ``st`` is a slot's whole [G]-stacked state, carried through the scan: group ``group``
    # writes only its S KV rows, conv inputs and snapshots into it, in place.
    def slot(p, lp, group, x, st):
        if isinstance(st, TargetCache):

            def write_and_attend(q, k, v):
                where = (group, batch_idx, slots)
                k_all = st.k.at[where].set(k.astype(st.k.dtype), mode="drop")
                v_all = st.v.at[where].set(v.astype(st.v.dtype), mode="drop")
                if parents is None:
                    o = attend_cache(
                        q, k_all, v_all, lengths, layer=group, implementation=implementation
                    )
                else:
                    mask = tree_cache_mask(start, parents, st.k.shape[2])
                    o = attend(q, k_all[group], v_all[group], mask)
                return o, TargetCache(k=k_all, v=v_all)

            x, new = _attention_residual(lp, x, positions, write_and_attend, cfg, implementation)
            return _ffn_residual(lp, x, p, cfg, implementation), new, None
        gdn = lp.linear_attn
        history, s0 = _select(st, j, K, group)
        a = _norm(x, lp.input_layernorm, cfg, implementation)
        mixed, z, b, alpha = _gdn_inputs(gdn, a, cfg, implementation)
        xp = jnp.concatenate([history, mixed], axis=1)  # [B, K-1+S, C]
        conv = causal_conv(xp, gdn.conv1d, conv_rows)
        q, k, v, g, beta = _gdn_core_inputs(gdn, conv, b, alpha, cfg, implementation)
        if parents is None:
            # The kernel reads snapshot j and writes the S new ones inside the stack itself
            # (s0 above is then unused and compiled away).
            o, recurrent = recurrent_delta_rule_stacked(
                q, k, v, g, beta, st.recurrent, layer=group, select=j,
                implementation=implementation,
            )  # fmt: skip
        else:
            o, states = tree_delta_rule(q, k, v, g, beta, s0, parents)
            recurrent = st.recurrent.at[group, :, :S].set(states)
        x = x + _gdn_output(gdn, o, z, cfg, implementation)
        new = GdnState(conv=st.conv.at[group, :, : K - 1 + S].set(xp), recurrent=recurrent)
        return _ffn_residual(lp, x, p, cfg, implementation), new, None

    x = embed(head, tokens, cfg=cfg.lm_head_config()).astype(jnp.float32)
    x, layers, _, _ = _scan_groups(params, x, state.layers, slot, cfg)
    return _norm(x, params.final_norm, cfg, implementation), HybridState(layers=layers, base=start)


@configs_by_name
def tree_step(
    params: HybridParams,
    head: LMHeadParams,
    state: HybridState,
    tokens: jax.Array,
    start: jax.Array,
    parents: jax.Array,
    *,
    cfg: HybridConfig,
    implementation: Implementation | str = Implementation.AUTO,
) -> tuple[jax.Array, HybridState]:
    """Runs a draft tree of S rows per sequence after its committed length ``start`` int32[B].

    tokens: int32[B, S], row i the token of tree node i; parents: int32[S] (``mtpjax.draft_tree``:
    ``parents[0] = -1``, ``parents[i] < i``). Row i is at position ``start + depth(i)``. Full
    attention: written at KV row ``start + i``, it attends to the rows before ``start`` and to
    its ancestors'. GDN, per branch: node i's conv reads the inputs along its own path (its
    ancestors', then the committed history) and its recurrent state continues from its
    parent's, so every root-to-leaf path gets exactly a chain step's recurrence; the S
    per-node states are kept as the snapshots. ``commit_path`` then makes the state a chain
    step over the accepted path would have left. Needs ``max_step >= S``. Donates ``state``.
    """
    impl = Implementation.parse(implementation).value
    return _tree_step(params, head, state, tokens, start, parents, cfg=cfg, implementation=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"), donate_argnames=("state",))
def _tree_step(params, head, state, tokens, start, parents, *, cfg, implementation):
    if parents.shape != (tokens.shape[1],):
        raise ValueError(
            f"parents must be int32[S={tokens.shape[1]}], got shape {tuple(parents.shape)}"
        )
    return _run_step(params, head, state, tokens, start, parents, cfg, implementation)


def commit_path(
    state: HybridState, start: jax.Array, path: jax.Array, *, cfg: HybridConfig
) -> HybridState:
    """After ``tree_step`` at ``start`` int32[B]: the accepted path (node numbers int32[B, P],
    root first, ``path[:, d]`` at depth d) becomes the step's rows 0..P-1: KV rows and GDN
    conv inputs and snapshots are moved there, so the state is the one a chain step over the
    path's tokens leaves and the next step at ``start + accepted + 1`` selects the snapshot
    after the last accepted node. Donates ``state``; one jit."""
    return _commit_path(state, jnp.asarray(start, jnp.int32), jnp.asarray(path, jnp.int32), cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _commit_path(state, start, path, *, cfg):
    K = cfg.linear_conv_kernel_dim
    P = path.shape[1]
    b = jnp.arange(path.shape[0])[:, None]
    d = jnp.arange(P, dtype=jnp.int32)[None, :]
    layers = []
    for st in state.layers:
        if isinstance(st, TargetCache):
            layers.append(move_rows(st, start, path))
        else:
            conv = st.conv.at[:, b, K - 1 + d].set(st.conv[:, b, K - 1 + path])
            recurrent = st.recurrent.at[:, b, d].set(st.recurrent[:, b, path])
            layers.append(GdnState(conv=conv, recurrent=recurrent))
    return HybridState(layers=tuple(layers), base=state.base)


# ------------------------------------------------------------------------------------------
# As the generation loop's target.


@dataclasses.dataclass(frozen=True, kw_only=True)
class _InitState:
    cfg: HybridConfig
    max_step: int
    kv_dtype: jnp.dtype

    def __call__(self, batch: int, max_len: int) -> HybridState:
        return init_state(
            self.cfg, batch=batch, max_len=max_len, max_step=self.max_step, kv_dtype=self.kv_dtype
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Call:
    """``prefill`` (lengths) or ``step`` (start) on ``(params, head)``."""

    fn: Callable[..., tuple[jax.Array, HybridState]]
    cfg: HybridConfig
    implementation: Implementation

    def __call__(self, params, state, tokens, where):
        model, head = params
        return self.fn(
            model, head, state, tokens, where, cfg=self.cfg, implementation=self.implementation
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TreeCall:
    """``tree_step`` on ``(params, head)``."""

    cfg: HybridConfig
    implementation: Implementation

    def __call__(self, params, state, tokens, start, parents):
        model, head = params
        return tree_step(
            model, head, state, tokens, start, parents, cfg=self.cfg,
            implementation=self.implementation,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CommitPath:
    cfg: HybridConfig

    def __call__(self, params, state, start, path):
        return commit_path(state, start, path, cfg=self.cfg)


def target_model(
    cfg: HybridConfig,
    params: HybridParams,
    head: LMHeadParams,
    *,
    max_step: int = 4,
    kv_dtype: jnp.dtype = jnp.float32,
    implementation: Implementation | str = Implementation.AUTO,
) -> TargetModel:
    """The hybrid target as a ``mtpjax.TargetModel`` for ``generate`` / ``generate_baseline``;
    its params are ``(params, head)``. ``max_step`` bounds the rows of a step (``num_drafts +
    1``, or the baseline's ``step_width``): the state keeps that many GDN snapshots; its KV
    cache is ``kv_dtype``."""
    if not isinstance(cfg, HybridConfig):
        raise TypeError(f"cfg must be a HybridConfig, got {type(cfg).__name__}")
    check_params(params, cfg)
    check_int("max_step", max_step, minimum=1)
    implementation = Implementation.parse(implementation)
    return TargetModel(
        params=(params, head),
        init_cache=_InitState(cfg=cfg, max_step=max_step, kv_dtype=jnp.dtype(kv_dtype)),
        prefill=_Call(fn=prefill, cfg=cfg, implementation=implementation),
        step=_Call(fn=step, cfg=cfg, implementation=implementation),
        tree_step=_TreeCall(cfg=cfg, implementation=implementation),
        commit_path=_CommitPath(cfg=cfg),
    )
