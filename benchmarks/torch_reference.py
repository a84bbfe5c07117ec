"""A PyTorch reference of the Qwen3-Next / Qwen3.5 MTP drafter's propose step.

It is the baseline that ``benchmarks.propose`` times against the JAX ``propose``, and
``tests/test_gpu_propose.py`` checks that it drafts the same tokens on the same weights. The math
of one draft step, written once more, independently of ``mtpjax``:

    e = embed[t];  x = fc(concat[norm_e(e), norm_h(h)]);  a = input_layernorm(x)
    q, gate = q_proj(a) (interleaved per head);  q/k head norms, NeoX RoPE on the first R dims
    x = x + o_proj(attn(q, K, V) * sigmoid(gate))            (GQA over the sequence's rows)
    x = x + ffn(post_attention_layernorm(x))                  (SwiGLU, or routed MoE + shared)
    h_out = norm(x);  draft = argmax(lm_head(h_out))

A propose of K drafts is K such steps. Step 0 is the anchor: its K/V row is already in the cache,
so it writes nothing. Step j >= 1 feeds back (draft j, h_out of step j-1) (the POST_NORM
contract), appends that row's K/V, then attends over every row. Every shape is static: the cache
is a dense ``[B, Nkv, L, D]`` buffer, and a per-sequence ``length`` masks it. So the whole
propose can be captured in a CUDA graph (or run through ``torch.compile``).

Weights come from the JAX params dequantised (``weights_from_jax``):

- to bf16 for timing, which is what a PyTorch deployment of these checkpoints runs;
- to f32 for the token check, where the math must match the JAX XLA path (F32 activations,
  exact weights). In that mode, rows written to the cache are rounded the way the JAX pool stores
  them (BF16, or FP8 E4M3 with one amax/448 scale per row and head).

Shapes: ``[B]`` sequences, ``H`` hidden, ``Nq``/``Nkv``/``D`` heads / KV heads / head dim,
``L`` cache rows, ``E``/``I`` experts / expert width, ``V`` vocab.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "Dims",
    "TorchDrafter",
    "Weights",
    "kv_cache_from_rows",
    "to_torch",
    "weights_from_jax",
]

E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dims:
    """The static shape and options of one head (read off a ``DrafterConfig``)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float
    top_k: int = 0  # 0: dense FFN
    norm_topk_prob: bool = True

    @classmethod
    def from_config(cls, cfg) -> Dims:
        moe = cfg.moe
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rotary_dim=cfg.rotary_dim,
            rope_theta=cfg.rope_theta,
            eps=cfg.rms_norm_eps,
            top_k=0 if moe is None else moe.num_experts_per_tok,
            norm_topk_prob=True if moe is None else moe.norm_topk_prob,
        )


@dataclasses.dataclass(kw_only=True)
class Weights:
    """Dequantised tensors of one head plus the target's embedding and LM head.

    Projections are ``[N, K]`` (``y = x @ W.T``); experts are stacked ``[E, I, H]`` (gate, up)
    and ``[E, H, I]`` (down). Norm weights are ``[H]`` / ``[D]`` in F32 (zero-centred: the
    norm multiplies by ``1 + w``).
    """

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    fc: torch.Tensor  # [H, 2H]
    pre_fc_norm_embedding: torch.Tensor
    pre_fc_norm_hidden: torch.Tensor
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    q_proj: torch.Tensor  # [Nq * 2D, H], per head [q_h, gate_h]
    k_proj: torch.Tensor  # [Nkv * D, H]
    v_proj: torch.Tensor
    o_proj: torch.Tensor  # [H, Nq * D]
    gate_proj: torch.Tensor | None = None  # dense FFN [I, H]
    up_proj: torch.Tensor | None = None
    down_proj: torch.Tensor | None = None
    router: torch.Tensor | None = None  # MoE [E, H]
    experts_gate: torch.Tensor | None = None  # [E, I, H]
    experts_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None  # [E, H, I]
    shared_gate: torch.Tensor | None = None  # [Is, H]
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, H]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.device

    def to(self, device) -> Weights:
        """The same weights on ``device``."""
        fields = (f.name for f in dataclasses.fields(self))
        return dataclasses.replace(
            self, **{n: getattr(self, n).to(device) for n in fields if getattr(self, n) is not None}
        )


def to_torch(x, dtype: torch.dtype) -> torch.Tensor:
    """A JAX array as a torch tensor on the same device: DLPack (zero-copy), numpy as fallback."""
    try:
        return torch.from_dlpack(x).to(dtype)
    except Exception:  # a device or dtype DLPack cannot carry
        import numpy as np

        return torch.from_numpy(np.asarray(x, np.float32)).to(dtype)


def weights_from_jax(params, head, cfg, *, dtype: torch.dtype) -> Weights:
    """Dequantises an ``mtpjax`` head (``DrafterParams``) and ``LMHeadParams`` into ``Weights``.

    Each weight is dequantised exactly in JAX (``mtpjax.weights.dequantize``), then cast to
    ``dtype`` in the same jitted program and handed over through DLPack.
    """
    import jax
    import jax.numpy as jnp

    from mtpjax.layers import DenseFfnParams, MoeFfnParams
    from mtpjax.weights import dequantize

    jdtype = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]
    if cfg.mtp_use_dedicated_embeddings:
        raise NotImplementedError("the reference reads the target's embedding only")
    layer = params.layer
    attn = layer.attention
    ffn = layer.ffn
    mats = dict(
        lm_head=head.weight,
        fc=params.fc,
        q_proj=attn.q_proj,
        k_proj=attn.k_proj,
        v_proj=attn.v_proj,
        o_proj=attn.o_proj,
    )
    if isinstance(ffn, DenseFfnParams):
        mats.update(gate_proj=ffn.gate_proj, up_proj=ffn.up_proj, down_proj=ffn.down_proj)
    elif isinstance(ffn, MoeFfnParams):
        mats.update(
            router=ffn.router,
            experts_gate=ffn.experts.gate_proj,
            experts_up=ffn.experts.up_proj,
            experts_down=ffn.experts.down_proj,
        )
        if ffn.shared_expert is not None:
            mats.update(
                shared_gate=ffn.shared_expert.gate_proj,
                shared_up=ffn.shared_expert.up_proj,
                shared_down=ffn.shared_expert.down_proj,
            )
        if ffn.shared_expert_gate is not None:
            mats.update(shared_expert_gate=ffn.shared_expert_gate)
    else:
        raise TypeError(f"unknown FFN params {type(ffn).__name__}")
    norms = dict(
        pre_fc_norm_embedding=params.pre_fc_norm_embedding,
        pre_fc_norm_hidden=params.pre_fc_norm_hidden,
        input_layernorm=layer.input_layernorm,
        post_attention_layernorm=layer.post_attention_layernorm,
        norm=params.norm,
        q_norm=attn.q_norm,
        k_norm=attn.k_norm,
    )

    @jax.jit
    def convert(mats, norms, embedding):
        return (
            {n: dequantize(w).astype(jdtype) for n, w in mats.items()},
            {n: x.astype(jnp.float32) for n, x in norms.items()},
            embedding.astype(jdtype),
        )

    mats, norms, embedding = jax.block_until_ready(convert(mats, norms, head.embedding))
    return Weights(
        embed=to_torch(embedding, dtype),
        **{n: to_torch(x, dtype) for n, x in mats.items()},
        **{n: to_torch(x, torch.float32) for n, x in norms.items()},
    )


def kv_cache_from_rows(
    k: torch.Tensor, v: torch.Tensor, *, capacity: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense caches ``[B, Nkv, capacity, D]`` holding rows ``k, v: [B, L, Nkv, D]`` first."""
    B, L, Nkv, D = k.shape
    kc = torch.zeros((B, Nkv, capacity, D), dtype=dtype, device=k.device)
    vc = torch.zeros_like(kc)
    kc[:, :, :L] = k.permute(0, 2, 1, 3).to(dtype)
    vc[:, :, :L] = v.permute(0, 2, 1, 3).to(dtype)
    return kc, vc


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm in F32 over the last axis: ``x / rms(x) * (1 + w)``."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _round_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """What an FP8 pool row reads back as: E4M3 codes times one amax/448 scale per row."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class TorchDrafter:
    """The drafter step and propose over a dense, length-masked KV cache.

    ``kv_round``: "bf16" or "fp8" rounds each written row as the JAX pool stores it (use it
    with an F32 cache in the token check); None stores rows in the cache's own dtype.
    """

    def __init__(self, weights: Weights, dims: Dims, *, kv_round: str | None = None):
        if kv_round not in (None, "bf16", "fp8"):
            raise ValueError(f"kv_round must be None, 'bf16' or 'fp8', got {kv_round!r}")
        self.w = weights
        self.d = dims
        self.kv_round = kv_round
        r = dims.rotary_dim
        exponent = torch.arange(0, r, 2, dtype=torch.float32, device=weights.device) / r
        self.inv_freq = 1.0 / (dims.rope_theta**exponent)  # [R/2]

    # -- pieces --------------------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.to(w.dtype) @ w.T

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """NeoX rotate-halves on the first R dims: x [B, N, D] f32 at positions [B]."""
        angles = pos.float()[:, None] * self.inv_freq  # [B, R/2]
        cos, sin = torch.cos(angles)[:, None], torch.sin(angles)[:, None]
        half = self.d.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        rest = x[..., 2 * half :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def _round_kv(self, x: torch.Tensor) -> torch.Tensor:
        if self.kv_round == "bf16":
            return x.to(torch.bfloat16).float()
        if self.kv_round == "fp8":
            return _round_fp8_rows(x)
        return x

    def _swiglu(self, y, gate, up, down) -> torch.Tensor:
        g = self._linear(y, gate)
        u = self._linear(y, up)
        return self._linear(torch.nn.functional.silu(g) * u, down)

    def _moe(self, y: torch.Tensor) -> torch.Tensor:
        """Softmax router over all experts in F32, top-k, renormalised; plus the gated shared
        expert. Few rows gather only the chosen experts; many rows run every expert (as JAX)."""
        w, d = self.w, self.d
        B, k = y.shape[0], d.top_k
        E = w.router.shape[0]
        probs = torch.softmax(self._linear(y, w.router).float(), dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)  # [B, k]
        if d.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        yc = y.to(w.dtype)
        if B * k <= E:
            flat = ids.reshape(-1)
            rows = yc.repeat_interleave(k, dim=0)[:, :, None]  # [B*k, H, 1]
            g = torch.bmm(w.experts_gate[flat], rows)[..., 0]  # [B*k, I]
            u = torch.bmm(w.experts_up[flat], rows)[..., 0]
            h = (torch.nn.functional.silu(g) * u)[:, :, None]
            out = torch.bmm(w.experts_down[flat], h)[..., 0].view(B, k, -1)  # [B, k, H]
            routed = (weights[..., None] * out.float()).sum(1)
        else:
            g = torch.einsum("eih,bh->ebi", w.experts_gate, yc)
            u = torch.einsum("eih,bh->ebi", w.experts_up, yc)
            every = torch.einsum("ehi,ebi->ebh", w.experts_down, torch.nn.functional.silu(g) * u)
            dense = torch.zeros((B, E), dtype=torch.float32, device=y.device)
            dense.scatter_(1, ids, weights)
            routed = torch.einsum("be,ebh->bh", dense, every.float())
        if w.shared_gate is not None:
            shared = self._swiglu(y, w.shared_gate, w.shared_up, w.shared_down).float()
            if w.shared_expert_gate is not None:
                shared = torch.sigmoid(self._linear(y, w.shared_expert_gate).float()) * shared
            routed = routed + shared
        return routed

    # -- one step and the propose chain --------------------------------------------------------

    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        length: torch.Tensor,
        *,
        write: bool,
    ):
        """One row per sequence: tokens [B] long, hidden [B, H], positions [B] long.

        With ``write`` the row's K/V go to cache row ``length[b]`` (updated in place) first.
        Returns (draft [B] long, its softmax probability [B] f32, h_out [B, H] f32).
        """
        w, d = self.w, self.d
        B = tokens.shape[0]
        cd = w.dtype
        e = w.embed[tokens]
        x = self._linear(
            torch.cat(
                [
                    _rms(e, w.pre_fc_norm_embedding, d.eps),
                    _rms(hidden, w.pre_fc_norm_hidden, d.eps),
                ],
                dim=-1,
            ),
            w.fc,
        )
        a = _rms(x, w.input_layernorm, d.eps).to(cd)
        qg = self._linear(a, w.q_proj).view(B, d.num_heads, 2 * d.head_dim)
        q, gate = qg[..., : d.head_dim], qg[..., d.head_dim :]
        q = self._rope(_rms(q, w.q_norm, d.eps), positions)  # [B, Nq, D] f32
        if write:
            k = self._linear(a, w.k_proj).view(B, d.num_kv_heads, d.head_dim)
            v = self._linear(a, w.v_proj).view(B, d.num_kv_heads, d.head_dim)
            k = self._round_kv(self._rope(_rms(k, w.k_norm, d.eps), positions))
            v = self._round_kv(v.float())
            rows = torch.arange(B, device=tokens.device)
            k_cache[rows, :, length] = k.to(k_cache.dtype)
            v_cache[rows, :, length] = v.to(v_cache.dtype)
            length += 1
        # GQA attention over rows < length: query head h reads KV head h // G.
        G = d.num_heads // d.num_kv_heads
        L = k_cache.shape[2]
        qh = q.view(B, d.num_kv_heads, G, d.head_dim).to(k_cache.dtype)
        scores = torch.matmul(qh, k_cache.transpose(-1, -2)).float() * d.head_dim**-0.5
        valid = torch.arange(L, device=tokens.device)[None, :] < length[:, None]  # [B, L]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(v_cache.dtype)
        ctx = torch.matmul(p, v_cache).float().view(B, d.num_heads, d.head_dim)
        ctx = (ctx * torch.sigmoid(gate.float())).view(B, -1)
        x = x.float() + self._linear(ctx, w.o_proj).float()
        y = _rms(x, w.post_attention_layernorm, d.eps)
        if d.top_k:
            ffn = self._moe(y)
        else:
            ffn = self._swiglu(y, w.gate_proj, w.up_proj, w.down_proj).float()
        x = x + ffn
        h_out = _rms(x, w.norm, d.eps)
        logits = self._linear(h_out, w.lm_head).float()
        token = torch.argmax(logits, dim=-1)
        prob = 1.0 / torch.exp(logits - logits.amax(-1, keepdim=True)).sum(-1)
        return token, prob, h_out

    def propose(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        anchor_key: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        length: torch.Tensor,
        *,
        num_drafts: int,
    ):
        """K drafts from the anchor pair (tokens [B], hidden [B, H] at key ``anchor_key`` [B],
        whose row the cache already holds). ``length`` [B] is advanced in place by K - 1.

        Returns (drafts long[B, K], probs f32[B, K], hidden f32[B, K, H]) where ``hidden[:, j]``
        is step j's h_out.
        """
        drafts, probs, hiddens = [], [], []
        tok, hid = tokens, hidden
        for j in range(num_drafts):
            tok, p, hid = self.step(tok, hid, anchor_key + j, k_cache, v_cache, length, write=j > 0)
            drafts.append(tok)
            probs.append(p)
            hiddens.append(hid)
        return torch.stack(drafts, 1), torch.stack(probs, 1), torch.stack(hiddens, 1)
