"""Speculative generation: target prefill, drafter prefill, then rounds of propose / target
step / verify inside one ``jax.lax.while_loop``; and the plain decoding baseline.

    target = mtpjax.reference_target(tcfg, target_params, head)
    out = mtpjax.generate(target, drafter_params, head, prompts, lengths,
                          drafter_cfg=dcfg, head_cfg=tcfg.lm_head_config(),
                          max_new_tokens=128, num_drafts=3)
    base = mtpjax.generate_baseline(target, head, prompts, lengths,
                                    head_cfg=tcfg.lm_head_config(), max_new_tokens=128,
                                    step_width=3 + 1)
    out.tokens, out.lengths, out.metrics.mean_acceptance_length(), out.target_steps

The target is a function argument (``TargetModel``: its params and three callables), so any model
with that interface plugs in; ``reference_target`` wraps ``mtpjax.reference``. Each call is one
jit (traced once per batch shape and static options): prompts of different lengths share a
trace, ragged through ``lengths``, and so do all temperatures > 0 (the temperature is traced;
greedy is its own program). Concrete prompts and lengths are checked on the host before the jit;
nothing else syncs with the host until the result is read.

Round protocol (one sequence; committed tokens ``t_0 .. t_n``, the target's cache holding the
K/V of positions ``< n``):

1. ``propose`` writes the newly committed pairs and drafts ``d_1 .. d_K``;
2. the target runs the window ``[t_n, d_1, .., d_K]`` at positions ``n .. n+K`` (rejected rows
   are overwritten by the next step, which starts at the new committed length);
3. ``verify`` accepts ``a`` drafts and emits one target token ``b``, trims the drafter;
4. the next propose's window is the verify's own output: tokens ``[d_1 .. d_a, b]`` with the
   verify hidden at positions ``n .. n+a`` (``start = n``, ``count = a + 1``).

Exactness and the row window. Greedy speculation equals greedy decoding with the target alone
only if the target scores a position identically in a ``K+1``-row verify step and in a one-row
decode step. On XLA:CPU it does not, bit for bit: the summation order of a dot, of RMSNorm and
of the attention einsum depends on the call's shape (~1e-6 on the reference target's hidden
between ``[B, 1]`` and ``[B, 4]`` steps), while within one shape a row's result does not depend
on its index in the window (checked for B = 1, 3, 8 and windows of 2..5 rows). So
``generate_baseline`` runs each decode step over ``step_width`` rows, the token in row 0 and
padding after it (causal attention keeps it out of row 0). With ``step_width = num_drafts + 1``
every target call of the two runs has the same shape (both derive batch and cache length the
same way), so the outputs agree token for token by construction, not by argmax margins. The LM
head pads rows itself (``mtpjax.head``).

On a GPU the target steps run kernels whose rows do not depend on the row count or the cache
length (``pallas_kernels``: the row norms, the cache attention, the GEMVs with split-K slices cut
at fixed places and summed in order, one LM-head family for every width), so there a one-row
plain decoder (``step_width=1``) gives the speculative loop's tokens too: measured on the H200
for the reference target and the shipped hybrid pair, whose Gated DeltaNet steps run the delta
rule's kernel there (``pallas_kernels.recurrent_delta_rule``; BENCHMARKS.md).

Shapes: ``[B]`` sequences, ``[T]`` padded prompt width, ``[N]`` max_new_tokens, ``[K]`` drafts
per round, ``[W]`` target rows per step (``K + 1`` for speculation), ``H`` hidden, ``V`` vocab,
``Lmax = T + N + W`` rows of the target's cache and of the drafter's sequence capacity.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from mtpjax import drafter as drafter_lib
from mtpjax import reference
from mtpjax.config import DrafterConfig, HiddenContract, LMHeadConfig, configs_by_name
from mtpjax.draft_tree import TreeShape, as_tree
from mtpjax.drafter import DrafterModules, DrafterParams, Pairs
from mtpjax.head import LMHeadParams, lm_head
from mtpjax.target_model import TargetModel
from mtpjax.verify import SpecDecodeMetrics, verify
from mtpjax.verify import draft_length as draft_length_lib
from mtpjax.verify import metrics as metrics_lib
from mtpjax.verify.accept import check_temperature
from mtpjax.verify.tree import verify_tree
from mtpjax.weights import WeightFormat
from pallas_kernels.implementation import Implementation

__all__ = [
    "GenerateOutput",
    "TargetModel",
    "cache_length",
    "generate",
    "generate_baseline",
    "reference_target",
]


# ------------------------------------------------------------------------------------------
# The target as a function argument.


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ReferenceInitCache:
    cfg: reference.TargetConfig

    def __call__(self, batch: int, max_len: int) -> reference.TargetCache:
        return reference.init_cache(self.cfg, batch=batch, max_len=max_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ReferenceCall:
    """``reference.target_prefill`` (lengths) or ``target_step`` (start) on ``(params, head)``."""

    fn: Callable[..., tuple[jax.Array, reference.TargetCache]]
    cfg: reference.TargetConfig
    implementation: Implementation

    def __call__(self, params, cache, tokens, where):
        target, head = params
        return self.fn(
            target, head, cache, tokens, where, cfg=self.cfg, implementation=self.implementation
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ReferenceTreeCall:
    """``reference.target_tree_step`` on ``(params, head)``."""

    cfg: reference.TargetConfig
    implementation: Implementation

    def __call__(self, params, cache, tokens, start, parents):
        target, head = params
        return reference.target_tree_step(
            target, head, cache, tokens, start, parents, cfg=self.cfg,
            implementation=self.implementation,
        )  # fmt: skip


def _reference_commit(params, cache, start, path):
    return reference.commit_path(cache, start, path)


def reference_target(
    cfg: reference.TargetConfig,
    params: reference.TargetParams,
    head: LMHeadParams,
    *,
    implementation: Implementation | str = Implementation.AUTO,
) -> TargetModel:
    """The reference Qwen3-style target (``mtpjax.reference``) as a ``TargetModel``; its params
    are ``(params, head)`` (the head supplies the embedding)."""
    if not isinstance(cfg, reference.TargetConfig):
        raise TypeError(f"cfg must be a reference.TargetConfig, got {type(cfg).__name__}")
    implementation = Implementation.parse(implementation)
    return TargetModel(
        params=(params, head),
        init_cache=_ReferenceInitCache(cfg=cfg),
        prefill=_ReferenceCall(fn=reference.target_prefill, cfg=cfg, implementation=implementation),
        step=_ReferenceCall(fn=reference.target_step, cfg=cfg, implementation=implementation),
        tree_step=_ReferenceTreeCall(cfg=cfg, implementation=implementation),
        commit_path=_reference_commit,
    )


# ------------------------------------------------------------------------------------------
# Output.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOutput:
    """What one generation call returns (device arrays; nothing is read back).

    Attributes:
      tokens: int32[B, N] generated tokens (the prompt excluded), -1 from ``lengths`` on.
      lengths: int32[B] tokens generated: ``N``, or up to and including the first ``eos_id``.
      metrics: the acceptance counters over every round (``SpecDecodeMetrics`` over K
        positions); None for the baseline.
      target_steps: int32[] target forwards after the prefill (loop iterations; one forward
        serves the whole batch). Plain decoding of N tokens takes N - 1.
      active_steps: int32[B] the forwards each sequence took part in (its rounds).
      kv_error: int32[B] the drafter cache's ``KVError`` bits (0 = healthy; the pool is sized
        so this stays 0); zeros for the baseline.
    """

    tokens: jax.Array
    lengths: jax.Array
    metrics: SpecDecodeMetrics | None
    target_steps: jax.Array
    active_steps: jax.Array
    kv_error: jax.Array


def cache_length(prompt_width: int, max_new_tokens: int, step_width: int) -> int:
    """Lmax = T + N + W: rows of the target cache (and the drafter's sequence capacity).

    Speculation uses ``W = num_drafts + 1``; a baseline meant to match it bit for bit uses the
    same ``step_width`` and therefore the same cache shape.
    """
    return prompt_width + max_new_tokens + step_width


# ------------------------------------------------------------------------------------------
# Validation shared by both entry points.


def _check_static_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a Python int >= {minimum}, got {value!r}")
    return value


def _check_prompts(prompts: Any, lengths: Any, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Shapes always; on concrete inputs also each length in [1, T] and each prompt id (before
    its sequence's length) in [0, vocab), naming the first offender. Traced inputs are clamped
    into range inside the jit instead (`_prompt_rows`)."""
    prompts, lengths = (
        x if isinstance(x, jax.Array) else np.asarray(x) for x in (prompts, lengths)
    )
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts must be int[B, T], got {prompts.dtype}{list(prompts.shape)}")
    B, T = prompts.shape
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"lengths must be int[B] = int[{B}] (prompt lengths, 1..T), got "
            f"{lengths.dtype}{list(lengths.shape)}"
        )
    if not isinstance(prompts, jax.core.Tracer) and not isinstance(lengths, jax.core.Tracer):
        ids, n = np.asarray(prompts), np.asarray(lengths)
        bad = np.flatnonzero((n < 1) | (n > T))
        if bad.size:
            b = bad[0]
            raise ValueError(f"lengths[{b}]={n[b]}: expected a prompt length in [1, {T}]")
        bad = np.argwhere((np.arange(T)[None, :] < n[:, None]) & ((ids < 0) | (ids >= vocab)))
        if bad.size:
            b, t = bad[0]
            raise ValueError(
                f"prompts[{b}, {t}]={ids[b, t]} (sequence {b}, length {n[b]}): expected a token "
                f"id in [0, {vocab})"
            )
    return jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32)


def _prompt_rows(prompts: jax.Array, lengths: jax.Array, vocab: int):
    """Traced prompts into range: lengths clamped to [1, T], ids to [0, V), and the padding
    after each length set to 0 (it is never attended to, so valid rows do not change)."""
    T = prompts.shape[1]
    lengths = jnp.clip(lengths, 1, T)
    in_prompt = jnp.arange(T, dtype=jnp.int32)[None, :] < lengths[:, None]
    return jnp.where(in_prompt, jnp.clip(prompts, 0, vocab - 1), 0), lengths


def _check_target(target: Any) -> None:
    if not isinstance(target, TargetModel):
        raise TypeError(
            f"target must be a TargetModel (see reference_target), got {type(target).__name__}"
        )


def _parse_contract(contract: Any) -> HiddenContract:
    try:
        return HiddenContract(contract)
    except ValueError:
        accepted = ", ".join(c.value for c in HiddenContract)
        raise ValueError(
            f"hidden_contract must be a HiddenContract or one of: {accepted}; got {contract!r}"
        ) from None


def _check_eos(eos_id: Any, vocab: int) -> int | None:
    if eos_id is None:
        return None
    if isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id must be None or a token id in [0, {vocab}), got {eos_id!r}")
    return eos_id


# ------------------------------------------------------------------------------------------
# Pieces of both loops.


def _pick(logits: jax.Array, temperature: jax.Array, key: jax.Array | None) -> jax.Array:
    """Next token from logits [B, V]: argmax without a key (greedy), else a sample at
    ``temperature`` (traced f32[]; the argmax where it is 0)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        return greedy
    sampling = temperature > 0
    scaled = logits.astype(jnp.float32) / jnp.where(sampling, temperature, 1.0)
    return jnp.where(sampling, jax.random.categorical(key, scaled).astype(jnp.int32), greedy)


def _split(key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    if key is None:
        return None, None
    key, sub = jax.random.split(key)
    return key, sub


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]]: [B, R, ...] x int32[B] -> [B, ...]."""
    idx = jnp.clip(index, 0, x.shape[1] - 1).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Output:
    """The growing output: tokens int32[B, N] (-1 unwritten), num_generated int32[B], done
    bool[B] (reached N tokens or emitted eos)."""

    tokens: jax.Array
    num_generated: jax.Array
    done: jax.Array


def _start_output(first: jax.Array, max_new_tokens: int, eos_id: int | None) -> _Output:
    B = first.shape[0]
    tokens = jnp.full((B, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    done = jnp.full((B,), max_new_tokens <= 1)
    if eos_id is not None:
        done = done | (first == eos_id)
    return _Output(tokens=tokens, num_generated=jnp.ones((B,), jnp.int32), done=done)


def _commit(out: _Output, new: jax.Array, count: jax.Array, eos_id: int | None) -> _Output:
    """Appends the first ``count[b]`` of ``new`` [B, R] to each sequence, cut after the first
    eos and at N tokens; sequences with ``count == 0`` are unchanged."""
    B, R = new.shape
    N = out.tokens.shape[1]
    j = jnp.arange(R, dtype=jnp.int32)[None, :]
    emitted = j < count[:, None]
    hit_eos = jnp.zeros((B,), bool)
    if eos_id is not None:
        is_eos = emitted & (new == eos_id)
        hit_eos = jnp.any(is_eos, axis=1)
        count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1).astype(jnp.int32) + 1, count)
    count = jnp.minimum(count, N - out.num_generated)
    index = jnp.where(j < count[:, None], out.num_generated[:, None] + j, N)  # N: dropped
    tokens = out.tokens.at[jnp.arange(B)[:, None], index].set(new, mode="drop")
    num_generated = out.num_generated + count
    return _Output(
        tokens=tokens, num_generated=num_generated, done=out.done | hit_eos | (num_generated >= N)
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Loop:
    """Loop carry of both loops. position int32[B]: position n of the newest committed token
    ``last`` int32[B] (the target's cache holds positions < n); steps int32[], active_steps
    int32[B]. Speculation only: the drafter ``state``, ``pairs`` (the next propose's window,
    width W) and the running ``metrics``; None for plain decoding."""

    cache: Any
    position: jax.Array
    last: jax.Array
    out: _Output
    key: jax.Array | None
    steps: jax.Array
    active_steps: jax.Array
    state: drafter_lib.DrafterState | None = None
    pairs: Pairs | None = None
    metrics: SpecDecodeMetrics | None = None


def _first_module(drafter: DrafterParams | DrafterModules) -> DrafterParams:
    return drafter.modules[0] if isinstance(drafter, DrafterModules) else drafter


def _kv_precision(params: DrafterParams) -> str:
    """The pool precision rule's input: NVFP4 heads get an FP8 pool, others BF16."""
    q_format = drafter_lib.projection_formats(params)["q_proj"]
    return "nvfp4" if q_format is WeightFormat.NVFP4 else "bf16"


# ------------------------------------------------------------------------------------------
# The loop.


def _start(
    target: TargetModel,
    drafter: DrafterParams | DrafterModules | None,
    head: LMHeadParams,
    drafter_head: LMHeadParams | None,
    prompts: jax.Array,
    lengths: jax.Array,
    temperature: jax.Array,
    key: jax.Array | None,
    *,
    drafter_cfg: DrafterConfig | None,
    head_cfg: LMHeadConfig,
    max_new_tokens: int,
    step_width: int,
    eos_id: int | None,
    implementation: str,
) -> _Loop:
    """The carry before the first round: the target's prefill and the first token; with a
    drafter also the drafter's rows of the prompt, the first window (the anchor alone) and empty
    metrics over ``K = step_width - 1`` positions."""
    prompts, lengths = _prompt_rows(prompts, lengths, head_cfg.vocab_size)
    B, T = prompts.shape
    N, W = max_new_tokens, step_width
    key, first_key = _split(key)
    max_len = cache_length(T, N, W)
    cache = target.init_cache(B, max_len)
    hidden, cache = target.prefill(target.params, cache, prompts, lengths)
    chex.assert_rank(hidden, 3)
    h_last = _take_rows(hidden, lengths - 1)  # [B, H]
    logits = lm_head(head, h_last, cfg=head_cfg, implementation=implementation)
    first = _pick(logits, temperature, first_key)
    loop = _Loop(
        cache=cache,
        position=lengths,
        last=first,
        out=_start_output(first, N, eos_id),
        key=key,
        steps=jnp.zeros((), jnp.int32),
        active_steps=jnp.zeros((B,), jnp.int32),
    )
    if drafter is None:  # plain decoding
        return loop

    # The drafter's rows of the prompt: pairs (t_{i+1}, h_i) for i = 0 .. P-2, in module 0 (the
    # other modules hold only the rows their own draft steps write).
    first_module = _first_module(drafter)
    pool = drafter_lib.pool_config(
        drafter_cfg, precision=_kv_precision(first_module), max_seq_len=max_len, max_seqs=B
    )
    num_modules = drafter.num_modules if isinstance(drafter, DrafterModules) else 1
    state = drafter_lib.init_state(pool, num_seqs=B, num_modules=num_modules)
    dkw = dict(cfg=drafter_cfg, implementation=implementation)
    if T > 1:
        prompt_pairs = Pairs(
            tokens=prompts[:, 1:],
            hidden=hidden[:, :-1],
            count=lengths - 1,
            start=jnp.zeros((B,), jnp.int32),
        )
        if drafter_lib.supports_prefill(first_module):
            state = drafter_lib.prefill(drafter, drafter_head, state, prompt_pairs, **dkw)
        else:
            # Heads without BF16 fc/k/v catch up through propose, whose window takes any number
            # of pairs; its single draft is discarded, and the next propose keeps the rows.
            _, state = drafter_lib.propose(
                drafter, drafter_head, state, prompt_pairs, num_drafts=1, **dkw
            )

    # The first window: the anchor (t_P, h_{P-1}) alone.
    pad = ((0, 0), (0, W - 1))
    pairs = Pairs(
        tokens=jnp.pad(loop.last[:, None], pad),
        hidden=jnp.pad(h_last[:, None], (*pad, (0, 0))),
        count=jnp.ones((B,), jnp.int32),
        start=lengths - 1,
    )
    return dataclasses.replace(loop, state=state, pairs=pairs, metrics=metrics_lib.empty(W - 1))


def _advance(c: _Loop, result, hidden, cache, state, key, active, eos_id) -> _Loop:
    """The loop after a verified round: ``result``'s committed tokens [B, W] (-1 padding) and
    their target ``hidden`` [B, W, H] become the next window, the output and the position."""
    count = result.num_output  # 0 for finished sequences
    new = jnp.maximum(result.output_tokens, 0)  # -1 padding -> a valid id
    return _Loop(
        cache=cache,
        state=state,
        pairs=Pairs(tokens=new, hidden=hidden, count=count, start=c.position),
        position=c.position + count,
        last=jnp.where(count > 0, _take_rows(new, count - 1), c.last),
        out=_commit(c.out, new, count, eos_id),
        metrics=result.metrics,
        key=key,
        steps=c.steps + 1,
        active_steps=c.active_steps + active.astype(jnp.int32),
    )


def _spec_round(
    c: _Loop,
    *,
    target: TargetModel,
    drafter: DrafterParams | DrafterModules,
    head: LMHeadParams,
    drafter_head: LMHeadParams,
    temperature: jax.Array,
    drafter_cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
    eos_id: int | None,
    hidden_contract: HiddenContract,
    refeed: bool,
    implementation: str,
    verify_step: Callable[..., tuple[Any, drafter_lib.DrafterState]] = verify,
    draft_sampling: bool = False,
    draft_top_k: int = drafter_lib.DEFAULT_DRAFT_TOP_K,
    draft_cost: jax.Array | None = None,
) -> _Loop:
    """One speculative round: propose, the target's step over the ``K + 1``-row window, then
    ``verify_step`` (``verify``'s signature and outputs) and the commit. With
    ``draft_sampling`` and a key the drafts are sampled (``propose(temperature=, key=)``);
    with ``draft_cost`` (``draft_length.round_costs``, f32[K+1]) each sequence sends only the
    drafts its goodput estimate picks."""
    B, W = c.pairs.tokens.shape
    active = ~c.out.done
    loop_key, sampled = c.key, {}
    if draft_sampling and c.key is not None:
        loop_key, draft_key = _split(c.key)
        sampled = dict(temperature=temperature, key=draft_key, draft_top_k=draft_top_k)
    drafts, state = drafter_lib.propose(
        drafter,
        drafter_head,
        c.state,
        dataclasses.replace(c.pairs, active=active),
        num_drafts=W - 1,
        hidden_contract=hidden_contract,
        cfg=drafter_cfg,
        implementation=implementation,
        **sampled,
    )
    proposed = {}
    if draft_cost is not None:
        proposed = dict(num_proposed=drafts.num_valid)
        drafts = draft_length_lib.send(drafts, draft_length_lib.choose_by_cost(drafts, draft_cost))
    window = jnp.concatenate([c.last[:, None], jnp.maximum(drafts.tokens, 0)], axis=1)
    verify_hidden, cache = target.step(target.params, c.cache, window, c.position)
    chex.assert_shape(verify_hidden, (B, W, c.pairs.hidden.shape[-1]))
    key, sub = _split(loop_key)
    result, state = verify_step(
        head,
        state,
        verify_hidden,
        drafts,
        cfg=head_cfg,
        temperature=temperature,
        key=sub,
        refeed=refeed,
        metrics=c.metrics,
        active=active,
        implementation=implementation,
        **proposed,
    )
    return _advance(c, result, verify_hidden, cache, state, key, active, eos_id)


def _tree_round(
    c: _Loop,
    *,
    tree: TreeShape,
    target: TargetModel,
    drafter: DrafterParams | DrafterModules,
    head: LMHeadParams,
    drafter_head: LMHeadParams,
    temperature: jax.Array,
    drafter_cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
    eos_id: int | None,
    hidden_contract: HiddenContract,
    implementation: str,
) -> _Loop:
    """One tree round: ``propose_tree``, the target's tree step over the S tree rows, the
    longest accepted path (``verify_tree``), the target's ``commit_path``, and the commit. The
    next window is the path's tokens with the target's hidden of the path's rows."""
    B = c.last.shape[0]
    active = ~c.out.done
    drafts, state = drafter_lib.propose_tree(
        drafter,
        drafter_head,
        c.state,
        dataclasses.replace(c.pairs, active=active),
        tree=tree,
        hidden_contract=hidden_contract,
        cfg=drafter_cfg,
        implementation=implementation,
    )
    window = jnp.concatenate([c.last[:, None], jnp.maximum(drafts.tokens, 0)], axis=1)  # [B, S]
    parents = jnp.asarray(tree.parents())
    tree_hidden, cache = target.tree_step(target.params, c.cache, window, c.position, parents)
    chex.assert_shape(tree_hidden, (B, tree.num_rows, c.pairs.hidden.shape[-1]))
    key, sub = _split(c.key)
    result = verify_tree(
        head,
        tree_hidden,
        drafts,
        cfg=head_cfg,
        tree=tree,
        temperature=temperature,
        key=sub,
        metrics=c.metrics,
        active=active,
        implementation=implementation,
    )
    cache = target.commit_path(target.params, cache, c.position, result.path)
    path_hidden = jnp.take_along_axis(tree_hidden, result.path[..., None], axis=1)
    return _advance(c, result, path_hidden, cache, state, key, active, eos_id)


@functools.partial(
    jax.jit,
    static_argnames=(
        "drafter_cfg",
        "head_cfg",
        "max_new_tokens",
        "step_width",
        "eos_id",
        "hidden_contract",
        "refeed",
        "implementation",
        "draft_sampling",
        "draft_top_k",
        "tree",
    ),
)
def _generate(
    target: TargetModel,
    drafter: DrafterParams | DrafterModules | None,
    head: LMHeadParams,
    drafter_head: LMHeadParams | None,
    prompts: jax.Array,
    lengths: jax.Array,
    temperature: jax.Array,
    key: jax.Array | None,
    *,
    drafter_cfg: DrafterConfig | None,
    head_cfg: LMHeadConfig,
    max_new_tokens: int,
    step_width: int,
    eos_id: int | None,
    hidden_contract: HiddenContract,
    refeed: bool,
    implementation: str,
    draft_sampling: bool = False,
    draft_top_k: int = drafter_lib.DEFAULT_DRAFT_TOP_K,
    draft_cost: jax.Array | None = None,
    tree: TreeShape | None = None,
) -> GenerateOutput:
    """Both loops: speculation with ``K = step_width - 1`` drafts per round (a ``tree``: its
    S = ``step_width`` rows), or plain decoding when ``drafter`` is None. ``draft_cost``
    (f32[K+1], traced) turns on the adaptive draft length."""
    loop = _start(
        target,
        drafter,
        head,
        drafter_head,
        prompts,
        lengths,
        temperature,
        key,
        drafter_cfg=drafter_cfg,
        head_cfg=head_cfg,
        max_new_tokens=max_new_tokens,
        step_width=step_width,
        eos_id=eos_id,
        implementation=implementation,
    )
    # What every speculative round takes, chain or tree.
    shared = dict(
        target=target,
        drafter=drafter,
        head=head,
        drafter_head=drafter_head,
        temperature=temperature,
        drafter_cfg=drafter_cfg,
        head_cfg=head_cfg,
        eos_id=eos_id,
        hidden_contract=hidden_contract,
        implementation=implementation,
    )
    if tree is not None:
        D = tree.depth
        window = dataclasses.replace(
            loop.pairs, tokens=loop.pairs.tokens[:, : D + 1], hidden=loop.pairs.hidden[:, : D + 1]
        )
        loop = dataclasses.replace(loop, pairs=window, metrics=metrics_lib.empty(D))
        return _run(functools.partial(_tree_round, tree=tree, **shared), loop)
    if drafter is not None:
        round_ = functools.partial(
            _spec_round,
            refeed=refeed,
            draft_sampling=draft_sampling,
            draft_top_k=draft_top_k,
            draft_cost=draft_cost,
            **shared,
        )
        return _run(round_, loop)

    B, W = loop.last.shape[0], step_width
    padding = jnp.zeros((B, W - 1), jnp.int32)

    def plain_step(c: _Loop) -> _Loop:
        active = ~c.out.done
        window = jnp.concatenate([c.last[:, None], padding], axis=1)  # [B, W]
        hidden, cache = target.step(target.params, c.cache, window, c.position)
        logits = lm_head(head, hidden[:, 0], cfg=head_cfg, implementation=implementation)
        key, sub = _split(c.key)
        token = _pick(logits, temperature, sub)
        count = active.astype(jnp.int32)
        return dataclasses.replace(
            c,
            cache=cache,
            position=c.position + count,
            last=jnp.where(active, token, c.last),
            out=_commit(c.out, token[:, None], count, eos_id),
            key=key,
            steps=c.steps + 1,
            active_steps=c.active_steps + count,
        )

    return _run(plain_step, loop)


def _run(round_: Callable[[_Loop], _Loop], loop: _Loop) -> GenerateOutput:
    """Runs ``round_`` until every sequence is done."""
    loop = jax.lax.while_loop(lambda c: jnp.any(~c.out.done), round_, loop)
    return GenerateOutput(
        tokens=loop.out.tokens,
        lengths=loop.out.num_generated,
        metrics=loop.metrics,
        target_steps=loop.steps,
        active_steps=loop.active_steps,
        kv_error=jnp.zeros_like(loop.position) if loop.state is None else loop.state.error,
    )


@configs_by_name
def generate(
    target: TargetModel,
    drafter: DrafterParams | DrafterModules,
    head: LMHeadParams,
    prompts: jax.Array,
    lengths: jax.Array,
    *,
    drafter_cfg: DrafterConfig,
    head_cfg: LMHeadConfig,
    max_new_tokens: int,
    num_drafts: int,
    drafter_head: LMHeadParams | None = None,
    temperature: float | jax.Array = 0.0,
    key: jax.Array | None = None,
    eos_id: int | None = None,
    hidden_contract: HiddenContract | str | None = None,
    refeed: bool = False,
    implementation: Implementation | str = Implementation.AUTO,
    draft_sampling: bool = True,
    draft_top_k: int = drafter_lib.DEFAULT_DRAFT_TOP_K,
    draft_length: draft_length_lib.DraftLengthPolicy | None = None,
    tree: TreeShape | tuple[int, ...] | None = None,
) -> GenerateOutput:
    """Speculative generation of ``max_new_tokens`` tokens per prompt; one jit.

    Args:
      target: the target model (``reference_target`` or any ``TargetModel``).
      drafter: the MTP head's params (``DrafterParams``: one module, which chains itself for
        every draft) or ``DrafterModules`` (draft s from module s under CLAMP, where K is
        ``min(num_drafts, N)``; module s mod N under CYCLE), in whatever precision they were
        loaded at (when module 0's fc/k_proj/v_proj are BF16 the prompt's rows take the drafter
        prefill; else they go through ``propose``). Every module's KV pool follows
        ``drafter.pool_config``'s rule for module 0's precision.
      head: the target's embedding / LM head: the verify rows and the first token.
      prompts: int[B, T] right-padded prompts, ids in [0, V) before each length (the padding is
        ignored); lengths: int[B] their lengths in [1, T]. Concrete values out of range are a
        ValueError naming the sequence; traced ones are clamped into range.
      drafter_cfg: static drafter config. head_cfg: static config of the target's LM head.
      max_new_tokens: static N >= 1. num_drafts: static K >= 1, drafts per round (clamped to
        the module count by the CLAMP schedule).
      drafter_head: the head the drafter reads (embedding + draft LM head), e.g. a quantised
        copy from a converted checkpoint; default ``head``.
      temperature: a real scalar, traced (one program for every value > 0); 0.0 is greedy
        (token for token the same as greedy decoding with the target alone), > 0 lossless
        rejection sampling with ``key``.
      key: PRNG key, required when temperature > 0.
      eos_id: static; a sequence stops after emitting it (it is kept in the output).
      hidden_contract: static ``HiddenContract`` (or its value) for draft steps 1..K-1; None:
        ``drafter_cfg.default_hidden_contract``.
      refeed: static; rebuild accepted chain rows from the target's hidden after each verify.
      implementation: ``Implementation`` (or its name, any case) of the drafter and the head.
      draft_sampling: static; at temperature > 0, sample each draft from the drafter's top
        ``draft_top_k`` tokens at the temperature (``propose``) and accept with
        ``min(1, p/q)``; False drafts by argmax (one-hot ``q``: accepted with probability
        ``p(x)``). Both are exact; sampling is the default because it accepts more wherever the
        drafter's tempered distribution is close to the target's (BENCHMARKS.md, acceptance),
        as vLLM, SGLang and TensorRT-LLM draft. Greedy runs and trees are untouched by it.
      draft_top_k: static int >= 1, the support of each sampled draft's proposal.
      draft_length: a ``verify.draft_length.DraftLengthPolicy`` for K drafts: each round each
        sequence sends the drafts its goodput estimate picks (``metrics`` counts the proposed
        and the sent); None sends every valid draft. Its costs are traced: one program serves
        every policy for the same K.
      tree: static; None drafts chains. A ``TreeShape`` (or its branching, e.g. ``(2, 2, 1)``)
        drafts that tree each round (``drafter.propose_tree``; one MTP module) and verifies it
        in one target ``tree_step`` of S rows (``verify.tree``: the longest accepted path,
        greedy or lossless multi-candidate sampling), then the target's ``commit_path``. The
        target must provide both; ``num_drafts`` must equal the tree's depth D (metrics count
        D positions a round); ``refeed`` does not apply (the path is always rebuilt). Greedy, it
        matches ``generate_baseline(step_width=S)`` token for token.

    Returns:
      ``GenerateOutput``: tokens [B, N], lengths [B], metrics over K positions, target_steps
      (forwards after the prefill), active_steps [B], kv_error [B].
    """
    _check_target(target)
    if not isinstance(drafter, (DrafterParams, DrafterModules)):
        raise TypeError(
            "drafter must be DrafterParams (one MTP module) or DrafterModules, got "
            f"{type(drafter).__name__}"
        )
    num_drafts = _check_static_int("num_drafts", num_drafts, 1)
    if isinstance(drafter, DrafterModules):
        num_drafts = drafter_lib.effective_num_drafts(
            drafter.num_modules, num_drafts, drafter.schedule
        )
    prompts, lengths = _check_prompts(prompts, lengths, head_cfg.vocab_size)
    temperature, key = check_temperature(temperature, key)
    if hidden_contract is None:
        hidden_contract = drafter_cfg.default_hidden_contract
    contract = _parse_contract(hidden_contract)
    if not isinstance(refeed, bool):
        raise TypeError(f"refeed must be a Python bool, got {refeed!r}")
    step_width = num_drafts + 1
    if tree is not None:
        tree = as_tree(tree)
        if num_drafts != tree.depth:
            raise ValueError(
                f"num_drafts={num_drafts} must equal the depth {tree.depth} of tree "
                f"{tree.branching}"
            )
        if target.tree_step is None or target.commit_path is None:
            raise ValueError("tree drafting needs a TargetModel with tree_step and commit_path")
        step_width = tree.num_rows
    if not isinstance(draft_sampling, bool):
        raise TypeError(f"draft_sampling must be a Python bool, got {draft_sampling!r}")
    draft_top_k = _check_static_int("draft_top_k", draft_top_k, 1)
    if draft_length is not None:
        if not isinstance(draft_length, draft_length_lib.DraftLengthPolicy):
            raise TypeError(
                "draft_length must be a verify.draft_length.DraftLengthPolicy or None, got "
                f"{type(draft_length).__name__}"
            )
        if draft_length.num_drafts != num_drafts:
            raise ValueError(
                f"draft_length has costs for K={draft_length.num_drafts} drafts, the run drafts "
                f"K={num_drafts}"
            )
    sampling = draft_sampling and key is not None and tree is None  # trees: their own rule
    if tree is not None and draft_length is not None:
        raise ValueError("draft_length applies to chains; a tree verifies all its rows")
    return _generate(
        target,
        drafter,
        head,
        head if drafter_head is None else drafter_head,
        prompts,
        lengths,
        temperature,
        key,
        drafter_cfg=drafter_cfg,
        head_cfg=head_cfg,
        max_new_tokens=_check_static_int("max_new_tokens", max_new_tokens, 1),
        step_width=step_width,
        eos_id=_check_eos(eos_id, head_cfg.vocab_size),
        hidden_contract=contract,
        refeed=refeed,
        implementation=Implementation.parse(implementation).value,
        # Greedy (no key) runs one program whatever the sampling options say.
        draft_sampling=sampling,
        draft_top_k=draft_top_k if sampling else drafter_lib.DEFAULT_DRAFT_TOP_K,
        draft_cost=None
        if draft_length is None
        else jnp.asarray(draft_length_lib.round_costs(draft_length)),
        tree=tree,
    )


@configs_by_name
def generate_baseline(
    target: TargetModel,
    head: LMHeadParams,
    prompts: jax.Array,
    lengths: jax.Array,
    *,
    head_cfg: LMHeadConfig,
    max_new_tokens: int,
    step_width: int = 1,
    temperature: float | jax.Array = 0.0,
    key: jax.Array | None = None,
    eos_id: int | None = None,
    implementation: Implementation | str = Implementation.AUTO,
) -> GenerateOutput:
    """Plain decoding with the target alone: one token per target forward; one jit.

    Args:
      target, head, prompts, lengths, head_cfg, max_new_tokens, temperature, key, eos_id,
        implementation: as in ``generate``.
      step_width: static W >= 1, rows of each target step: the token in row 0, padding after
        it (causal attention keeps the padding out of row 0). Pass ``num_drafts + 1`` to compare
        with ``generate`` bit for bit: every target call then has the shape of a verify step
        (see the module docstring); 1 is the cheapest.

    Returns:
      ``GenerateOutput`` with ``metrics=None``; ``target_steps`` = N - 1 without eos.
    """
    _check_target(target)
    prompts, lengths = _check_prompts(prompts, lengths, head_cfg.vocab_size)
    temperature, key = check_temperature(temperature, key)
    return _generate(
        target,
        None,
        head,
        None,
        prompts,
        lengths,
        temperature,
        key,
        drafter_cfg=None,
        head_cfg=head_cfg,
        max_new_tokens=_check_static_int("max_new_tokens", max_new_tokens, 1),
        step_width=_check_static_int("step_width", step_width, 1),
        eos_id=_check_eos(eos_id, head_cfg.vocab_size),
        hidden_contract=HiddenContract.POST_NORM,
        refeed=False,
        implementation=Implementation.parse(implementation).value,
    )
