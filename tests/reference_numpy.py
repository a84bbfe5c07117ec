"""An independent float64 numpy model of the Qwen3-Next / Qwen3.5 MTP drafter (DESIGN §4).

Written from the model definition, not from the JAX code: it imports nothing from mtpjax and
reads the config only through plain attributes. Weights come as a dict of float64 arrays
(dequantised), named as in ``tests/drafter_helpers.numpy_weights``.

Shapes: ``[T]`` rows of one sequence, ``H`` hidden.
"""

from __future__ import annotations

import numpy as np


def rms_norm_zc(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def rope_neox(x: np.ndarray, pos: np.ndarray, rotary: int, theta: float) -> np.ndarray:
    """x: [T, N, D]; rotate-halves RoPE on the first ``rotary`` dims at positions pos [T]."""
    half = rotary // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary)
    ang = pos.astype(np.float64)[:, None] * inv[None, :]  # [T, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rotary]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary] = x2 * cos + x1 * sin
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def swiglu(y: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(y @ gate.T) * (y @ up.T)) @ down.T


def moe(y: np.ndarray, w: dict, top_k: int, normalize: bool) -> np.ndarray:
    """Softmax router over all experts, top-k (renormalised), plus the gated shared expert."""
    logits = y @ w["router"].T  # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(y)
    for t in range(y.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen]
        if normalize:
            weights = weights / weights.sum()
        for e, g in zip(chosen, weights):
            out[t] += g * swiglu(
                y[t], w["experts_gate"][e], w["experts_up"][e], w["experts_down"][e]
            )
    if "shared_gate" in w:
        shared = swiglu(y, w["shared_gate"], w["shared_up"], w["shared_down"])
        if "shared_expert_gate" in w:
            shared = sigmoid(y @ w["shared_expert_gate"].T) * shared
        out = out + shared
    return out


def pair_inputs(w: dict, cfg, tokens: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """x = fc(concat[norm_e(embed(token)), norm_h(hidden)]): [T], [T, H] -> [T, H]."""
    eps = cfg.rms_norm_eps
    e = rms_norm_zc(w["embedding"][tokens], w["pre_fc_norm_embedding"], eps)
    h = rms_norm_zc(np.asarray(hidden, np.float64), w["pre_fc_norm_hidden"], eps)
    return np.concatenate([e, h], axis=-1) @ w["fc"].T


def qkv(w: dict, cfg, x: np.ndarray, pos: np.ndarray):
    """q [T, Nq, D], output gate [T, Nq, D], k, v [T, Nkv, D] of the layer input x [T, H]."""
    eps, D = cfg.rms_norm_eps, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    a = rms_norm_zc(x, w["input_layernorm"], eps)
    qg = (a @ w["q_proj"].T).reshape(len(x), nq, 2 * D)  # per head: [q_h, gate_h]
    q, gate = qg[..., :D], qg[..., D:]
    k = (a @ w["k_proj"].T).reshape(len(x), nkv, D)
    v = (a @ w["v_proj"].T).reshape(len(x), nkv, D)
    rot = cfg.rotary_dim
    q = rope_neox(rms_norm_zc(q, w["q_norm"], eps), pos, rot, cfg.rope_theta)
    k = rope_neox(rms_norm_zc(k, w["k_norm"], eps), pos, rot, cfg.rope_theta)
    return q, gate, k, v


def forward(w: dict, cfg, tokens: np.ndarray, hidden: np.ndarray, pos: np.ndarray | None = None):
    """One sequence of pairs: tokens [T] (token_{i+1}), hidden [T, H] (target hidden_i).

    Returns dict(h_out [T, H], residual [T, H], logits [T, V'], k, v [T, Nkv, D]).
    """
    T = len(tokens)
    pos = np.arange(T) if pos is None else np.asarray(pos)
    D, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    x = pair_inputs(w, cfg, tokens, hidden)
    q, gate, k, v = qkv(w, cfg, x, pos)
    attn = np.zeros((T, nq, D))
    group = nq // nkv
    for h in range(nq):
        kh, vh = k[:, h // group], v[:, h // group]
        scores = q[:, h] @ kh.T / np.sqrt(D)  # [T, T]
        scores = np.where(pos[None, :] <= pos[:, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        attn[:, h] = p @ vh
    x = x + (attn * sigmoid(gate)).reshape(T, nq * D) @ w["o_proj"].T
    y = rms_norm_zc(x, w["post_attention_layernorm"], cfg.rms_norm_eps)
    if cfg.moe is None:
        x = x + swiglu(y, w["gate_proj"], w["up_proj"], w["down_proj"])
    else:
        x = x + moe(y, w, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob)
    h_out = rms_norm_zc(x, w["norm"], cfg.rms_norm_eps)
    head = w["lm_head"][: cfg.draft_vocab_size]
    return dict(h_out=h_out, residual=x, logits=h_out @ head.T, k=k, v=v)
