"""The hybrid target against transformers' goldens (tests/fixtures/hybrid, written by
scripts/make_hybrid_fixtures.py): a Qwen3.5 dense and a Qwen3-Next MoE checkpoint loaded from
their HF directories, per-layer hidden states and logits over ragged prompts, token-by-token
decode, and a verify window with a partial accept followed by further tokens (the rollback).

transformers ran each prompt unpadded in float32 on the BF16 weights stored in the directory;
here the same prompts run as one right-padded batch of B = 3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax import hybrid
from mtpjax.weights import dequantize

FIXTURES = Path(__file__).parent / "fixtures" / "hybrid"
NAMES = ("qwen3_5_dense", "qwen3_next_moe")
MAX_LEN, MAX_STEP = 32, 4
EPS = float(np.finfo(np.float32).eps)


def tol(golden: np.ndarray, cfg, positions: int) -> float:
    """Float32 rounding through the stack, as an absolute bound on ``golden``'s scale: eps *
    sqrt(reduction length) per layer (the dots over H, the delta rule's and attention's sums
    over ``positions``), twice for the norms that rescale each layer's input. At these shapes it
    is ~3e-4 on logits of scale ~10: 3-7x what is observed, and above the largest difference
    between transformers' own cached and full paths on the same inputs (~7e-5)."""
    reduction = math.sqrt(positions * cfg.hidden_size)
    return 2 * cfg.num_hidden_layers * reduction * EPS * float(np.abs(golden).max())


def close(found, golden: np.ndarray, cfg, positions: int, what: str) -> None:
    found = np.asarray(found)
    assert found.shape == golden.shape, (what, found.shape, golden.shape)
    bound = tol(golden, cfg, positions)
    err = float(np.abs(found - golden).max())
    assert err <= bound, f"{what}: max |error| {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    directory = FIXTURES / request.param
    g = dict(np.load(directory / "golden.npz"))
    cfg = hybrid.HybridConfig.from_hf(json.loads((directory / "config.json").read_text()))
    params, head = hybrid.load(directory)
    # The head's matmul in numpy float64: one compiled program fewer per hidden shape (the head
    # itself is tested elsewhere).
    weight = np.asarray(dequantize(head.weight), np.float64)  # [V, H]

    def logits(hidden):
        return (np.asarray(hidden, np.float64) @ weight.T).astype(np.float32)

    return request.param, g, cfg, params, head, logits


def _valid(g: dict[str, np.ndarray]) -> np.ndarray:
    T = g["tokens"].shape[1]
    return np.arange(T)[None, :] < g["lengths"][:, None]  # [B, T]


def test_config_dialects(case):
    """Qwen3.5's nested text_config with layer_types / rope_parameters, and Qwen3-Next's flat
    config with full_attention_interval and top-level rope keys, read to the same fields."""
    name, g, cfg, *_ = case
    assert [t.value for t in cfg.layer_types] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.tie_word_embeddings is (name == "qwen3_5_dense")
    assert cfg.partial_rotary_factor == (0.25 if name == "qwen3_5_dense" else 0.5)
    assert cfg.linear_num_value_heads > cfg.linear_num_key_heads
    assert cfg.vocab_size == g["prefill_logits"].shape[-1]
    # The goldens are only as exact as transformers' own paths agree; the bounds sit above.
    spread = float(g["transformers_spread"])
    assert spread < tol(g["decode_logits"], cfg, g["tokens"].shape[1]) / 2


def test_forward_per_layer(case):
    """Every decoder layer's input, the pre-norm residual, the normed output and the logits
    over each prompt (teacher-forced; padded positions are not compared)."""
    name, g, cfg, params, head, logits = case
    valid = _valid(g)
    hidden, layers = hybrid.forward(params, head, jnp.asarray(g["tokens"]), cfg=cfg)
    T = g["tokens"].shape[1]
    layers = np.asarray(layers)
    close(layers[:, valid], g["prefill_layers"][:, valid], cfg, T, f"{name} layers")
    close(np.asarray(hidden)[valid], g["prefill_hidden"][valid], cfg, T, f"{name} hidden")
    close(logits(hidden)[valid], g["prefill_logits"][valid], cfg, T, f"{name} logits")


def _prefilled(g, cfg, params, head):
    state = hybrid.init_state(cfg, batch=len(g["lengths"]), max_len=MAX_LEN, max_step=MAX_STEP)
    tokens, lengths = jnp.asarray(g["tokens"]), jnp.asarray(g["lengths"])
    return hybrid.prefill(params, head, state, tokens, lengths, cfg=cfg)


def test_prefill_then_decode(case):
    """prefill over the ragged batch (its hidden, and every GDN layer's conv and recurrent state
    after each prompt), then six one-token steps: transformers' cached decode."""
    name, g, cfg, params, head, logits = case
    valid = _valid(g)
    hidden, state = _prefilled(g, cfg, params, head)
    T = g["tokens"].shape[1]
    close(np.asarray(hidden)[valid], g["prefill_hidden"][valid], cfg, T, f"{name} prefill")
    # The GDN states after each prompt, in layer order: transformers' conv state is [C, K-1].
    conv, recurrent = {}, {}
    for slot, selected in enumerate(hybrid.commit(state, jnp.asarray(g["lengths"]), cfg=cfg)):
        for group in range(0 if selected is None else cfg.num_hidden_layers // cfg.period):
            conv[group * cfg.period + slot] = np.asarray(selected[0][group])
            recurrent[group * cfg.period + slot] = np.asarray(selected[1][group])
    order = sorted(conv)
    golden_conv = np.swapaxes(g["prefill_conv_state"], -1, -2)
    close(np.stack([conv[i] for i in order]), golden_conv, cfg, T, f"{name} conv state")
    golden_recurrent = g["prefill_recurrent_state"]
    found_recurrent = np.stack([recurrent[i] for i in order])
    close(found_recurrent, golden_recurrent, cfg, T, f"{name} recurrent state")
    found = []
    for j in range(g["decode_tokens"].shape[1]):
        start = jnp.asarray(g["lengths"] + j)
        tokens = jnp.asarray(g["decode_tokens"][:, j : j + 1])
        hidden, state = hybrid.step(params, head, state, tokens, start, cfg=cfg)
        found.append(logits(hidden)[:, 0])
    n = T + len(found)
    close(np.stack(found, axis=1), g["decode_logits"], cfg, n, f"{name} decode")


def test_verify_window_then_rollback(case):
    """A 4-token verify window after each prompt, ``a`` = 1, 0, 3 drafts accepted, then three
    further tokens from the committed length: the logits equal transformers' full forward over
    prompt + window[:a + 1] + further, so the rejected rows left no trace in any state."""
    name, g, cfg, params, head, logits = case
    _, state = _prefilled(g, cfg, params, head)
    lengths = g["lengths"]
    window = jnp.asarray(g["window_tokens"])
    hidden, state = hybrid.step(params, head, state, window, jnp.asarray(lengths), cfg=cfg)
    n = g["tokens"].shape[1] + MAX_STEP
    close(logits(hidden), g["window_logits"], cfg, n, f"{name} window")
    # The further tokens ride in a window-sized step (one compiled program): the last row is
    # filler past them, and nothing is read after it.
    further = g["rollback_tokens"]
    filler = np.zeros((len(lengths), MAX_STEP - further.shape[1]), np.int32)
    tokens = jnp.asarray(np.concatenate([further, filler], axis=1))
    start = jnp.asarray(lengths + g["rollback_keep"])
    hidden, _ = hybrid.step(params, head, state, tokens, start, cfg=cfg)
    found = logits(hidden)[:, : further.shape[1]]
    close(found, g["rollback_logits"], cfg, n + further.shape[1], f"{name} rollback")
