"""Golden fixture for the DeepSeek-V3 MTP drafter (MLA + DeepSeek MoE), computed with
transformers' own modules.

The CPU tests have no torch; this script (run once, where torch and transformers are
installed) writes a small random DeepSeek-V3 checkpoint in the Hugging Face layout and what
transformers computes from it, in float32:

    tests/fixtures/deepseek_v3_mtp/   config.json, model.safetensors, golden.npz

The checkpoint has 2 dense target layers (``first_k_dense_replace = 2``)
and the MTP module at ``model.layers.2`` (``num_hidden_layers = 2``): ``enorm``, ``hnorm``,
``eh_proj``, one decoder layer, ``shared_head.norm``, plus the copies of the embedding and head
DeepSeek ships there (``embed_tokens``, ``shared_head.head``). Every feature of the real model
is kept at tiny widths: q_lora (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``), the latent KV
(``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``), interleaved RoPE on
``qk_rope_head_dim`` with YaRN (``mscale != mscale_all_dim``, so both the cos/sin factor and the
softmax-scale correction differ from 1), ``v_head_dim != qk_nope_head_dim``, 8 routed experts
in 4 groups (``topk_group = 2`` of them, top-2 experts), sigmoid scores with
``e_score_correction_bias``, ``routed_scaling_factor``, one shared expert, per-expert tensors
(``mlp.experts.{e}.{gate,up,down}_proj``) and FP8 block-128 weights as DeepSeek stores them
(``float8_e4m3fn`` with an f32 ``weight_scale_inv`` per 128 x 128 tile, some tiles ragged; the
router, norms, embedding and heads BF16, the correction bias F32).

The MTP module itself is not a transformers class: it is assembled here from transformers'
``DeepseekV3DecoderLayer``, ``DeepseekV3RMSNorm`` and ``DeepseekV3RotaryEmbedding`` as vLLM's
``deepseek_mtp`` runs it: the row at position 0 has its embedding zeroed, ``x = eh_proj(concat[
enorm(e), hnorm(h)])``, the decoder layer, then ``shared_head.norm`` and the LM head. Row ``i``
is the pair ``(t_{i+1}, h_i)`` at position ``i``. transformers runs in float32 on exactly the
stored values (FP8 codes times their scales, BF16 values), eager attention.

golden.npz (B = 2 sequences, T = 9 rows, K = 4 drafts, H hidden, V vocab; float32 unless int32):

    tokens, hidden      int32[B, T], [B, T, H]   random pairs (the target's hidden is random)
    forward_logits      [B, T, V]   teacher-forced MTP forward over the T rows, causal
    forward_h_out       [B, T, H]   after shared_head.norm
    forward_residual    [B, T, H]   the layer output before the norm
    prompt_rows         int32[B]    rows 0 .. n-1 committed per sequence (the anchor is n - 1)
    chain_{c}_tokens    int32[B, K] the drafts of a chain from the anchor, for the contracts
    chain_{c}_logits    [B, K, V]   c = post_norm, pre_norm, pinned: step s >= 1 appends the row
                                    (d_s, g_{s-1}) at position n - 1 + s, g = h_out, the
                                    residual, or the anchor's target hidden
    router_logits       [B*T, E]    the MTP layer's router input rows' logits, and the experts
    router_ids          int32[B*T, k] / router_weights [B*T, k] transformers' router chose

A seed is skipped (the next one tried) when a draft's top-2 logits are closer than 0.2 or a
routing choice is a near tie (biased scores of the last chosen and first unchosen expert, or of
the last kept and first dropped group, closer than 1e-3): goldens there would test luck. The
output is byte-identical from run to run.

Run (torch 2.13 CPU, transformers 5.24, safetensors, numpy; a few seconds):

    /work/torchenv/bin/python scripts/make_mla_fixtures.py
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepseek_v3_mtp"
B, T, K = 2, 9, 4
PROMPT_ROWS = (6, 4)  # committed rows per sequence; chains run from row n - 1
BLOCK = 128
E4M3_MAX = 448.0

CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 160,
    "hidden_size": 96,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc",
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    },
}
MTP = CONFIG["num_hidden_layers"]  # the MTP module's layer index


def hf_config() -> DeepseekV3Config:
    fields = {k: v for k, v in CONFIG.items() if k != "quantization_config"}
    cfg = DeepseekV3Config(**fields)
    cfg._attn_implementation = "eager"
    assert cfg.rope_parameters["rope_type"] == "yarn", cfg.rope_parameters
    return cfg


# --------------------------------------------------------------------------------------------
# Stored values.


def bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16)


def fp8_block(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 codes [N, K], f32 scale_inv [ceil(N/128), ceil(K/128)], dequantised f32 [N, K])."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = np.zeros((nb * BLOCK, kb * BLOCK), np.float32)
    padded[:n, :k] = w
    tiles = np.abs(padded.reshape(nb, BLOCK, kb, BLOCK)).max(axis=(1, 3))
    scale = np.where(tiles > 0, tiles / E4M3_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:n, :k]
    codes = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
    dequantised = codes.to(torch.float32) * torch.from_numpy(full)
    return codes, torch.from_numpy(scale), dequantised


class Store:
    """The checkpoint's tensors by name, and the float32 value transformers must use for each."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.tensors: dict[str, torch.Tensor] = {}

    def linear(self, name: str, shape: tuple[int, int], *, fp8: bool = True) -> torch.Tensor:
        w = self.rng.standard_normal(shape).astype(np.float32) / math.sqrt(shape[1])
        if not fp8:
            t = bf16(w)
            self.tensors[name + ".weight"] = t
            return t.to(torch.float32)
        codes, scale, value = fp8_block(w)
        self.tensors[name + ".weight"] = codes
        self.tensors[name + ".weight_scale_inv"] = scale
        return value

    def norm(self, name: str, size: int) -> torch.Tensor:
        t = bf16(1.0 + 0.2 * self.rng.standard_normal(size))
        self.tensors[name + ".weight"] = t
        return t.to(torch.float32)

    def array(self, name: str, a: np.ndarray) -> torch.Tensor:
        t = bf16(a)
        self.tensors[name] = t
        return t.to(torch.float32)


def fill_layer(store: Store, layer: DeepseekV3DecoderLayer, prefix: str, cfg) -> None:
    """Random stored values for one decoder layer, copied into ``layer`` (experts per expert)."""
    H, N = cfg.hidden_size, cfg.num_attention_heads
    a = layer.self_attn
    with torch.no_grad():
        a.q_a_proj.weight.copy_(store.linear(f"{prefix}self_attn.q_a_proj", (cfg.q_lora_rank, H)))
        a.q_a_layernorm.weight.copy_(
            store.norm(f"{prefix}self_attn.q_a_layernorm", cfg.q_lora_rank)
        )
        a.q_b_proj.weight.copy_(
            store.linear(f"{prefix}self_attn.q_b_proj", (N * cfg.qk_head_dim, cfg.q_lora_rank))
        )
        kv_a = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
        a.kv_a_proj_with_mqa.weight.copy_(
            store.linear(f"{prefix}self_attn.kv_a_proj_with_mqa", kv_a)
        )
        a.kv_a_layernorm.weight.copy_(
            store.norm(f"{prefix}self_attn.kv_a_layernorm", cfg.kv_lora_rank)
        )
        kv_b = (N * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        a.kv_b_proj.weight.copy_(store.linear(f"{prefix}self_attn.kv_b_proj", kv_b))
        a.o_proj.weight.copy_(store.linear(f"{prefix}self_attn.o_proj", (H, N * cfg.v_head_dim)))
        layer.input_layernorm.weight.copy_(store.norm(f"{prefix}input_layernorm", H))
        layer.post_attention_layernorm.weight.copy_(
            store.norm(f"{prefix}post_attention_layernorm", H)
        )
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            mlp.gate.weight.copy_(store.linear(f"{prefix}mlp.gate", (E, H), fp8=False))
            # Spread the bias so it changes choices (the scores are sigmoids in (0, 1)).
            bias = torch.from_numpy(0.3 * store.rng.standard_normal(E).astype(np.float32))
            store.tensors[f"{prefix}mlp.gate.e_score_correction_bias"] = bias
            mlp.gate.e_score_correction_bias.copy_(bias)
            for e in range(E):
                g = store.linear(f"{prefix}mlp.experts.{e}.gate_proj", (I, H))
                u = store.linear(f"{prefix}mlp.experts.{e}.up_proj", (I, H))
                d = store.linear(f"{prefix}mlp.experts.{e}.down_proj", (H, I))
                mlp.experts.gate_up_proj[e].copy_(torch.cat([g, u]))
                mlp.experts.down_proj[e].copy_(d)
            S = cfg.n_shared_experts * I
            for proj, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
                value = store.linear(f"{prefix}mlp.shared_experts.{proj}", shape)
                getattr(mlp.shared_experts, proj).weight.copy_(value)
        else:
            I = cfg.intermediate_size
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                getattr(mlp, proj).weight.copy_(store.linear(f"{prefix}mlp.{proj}", shape))


class Mtp(torch.nn.Module):
    """DeepSeek's MTP module (vLLM's ``DeepSeekMultiTokenPredictorLayer``) on transformers'
    layer, with the target's embedding and LM head."""

    def __init__(self, cfg, store: Store) -> None:
        super().__init__()
        H, V = cfg.hidden_size, cfg.vocab_size
        p = f"model.layers.{MTP}."
        self.embed = store.array("model.embed_tokens.weight", store.rng.standard_normal((V, H)))
        # Scaled so the drafts' top-2 logits are well apart.
        head = 3.0 * store.rng.standard_normal((V, H)) / math.sqrt(H)
        self.head = store.array("lm_head.weight", head)
        store.tensors[p + "embed_tokens.weight"] = store.tensors[
            "model.embed_tokens.weight"
        ].clone()
        store.tensors[p + "shared_head.head.weight"] = store.tensors["lm_head.weight"].clone()
        store.norm("model.norm", H)
        self.enorm = DeepseekV3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.shared_norm = DeepseekV3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.layer = DeepseekV3DecoderLayer(cfg, layer_idx=MTP)
        self.rotary = DeepseekV3RotaryEmbedding(cfg)
        with torch.no_grad():
            self.enorm.weight.copy_(store.norm(p + "enorm", H))
            self.hnorm.weight.copy_(store.norm(p + "hnorm", H))
            self.eh_proj.weight.copy_(store.linear(p + "eh_proj", (H, 2 * H)))
            fill_layer(store, self.layer, p, cfg)
            self.shared_norm.weight.copy_(store.norm(p + "shared_head.norm", H))

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """tokens [1, T], hidden [1, T, H] at positions [1, T] (causal over the T rows) ->
        (residual, h_out, logits)."""
        e = self.embed[tokens]
        e = torch.where((positions == 0)[..., None], 0.0, e)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        n = tokens.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )
        h_out = self.shared_norm(x)
        return x, h_out, h_out @ self.head.T


def target_layers(store: Store, cfg) -> None:
    """Random stored tensors for the target's own layers (the converter must skip them)."""
    for i in range(MTP):
        layer = DeepseekV3DecoderLayer(cfg, layer_idx=i)
        fill_layer(store, layer, f"model.layers.{i}.", cfg)


# --------------------------------------------------------------------------------------------
# Goldens.


def _margin(logits: np.ndarray) -> float:
    top = np.sort(logits, axis=-1)[..., -2:]
    return float((top[..., 1] - top[..., 0]).min())


def _router_gap(gate, rows: torch.Tensor, cfg) -> float:
    """Smallest gap at a routing decision of transformers' router on ``rows`` [R, H]: between
    the last kept and first dropped group, and the last chosen and first unchosen expert."""
    E, G, k, tg = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok, cfg.topk_group
    with torch.no_grad():
        choice = torch.sigmoid(rows @ gate.weight.T) + gate.e_score_correction_bias
        groups = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)  # [R, G]
        ranked = groups.sort(-1, descending=True)[0]
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(1, groups.topk(tg, dim=-1)[1], True)
        masked = choice.masked_fill(~keep.repeat_interleave(E // G, 1), float("-inf"))
        masked = masked.sort(-1, descending=True)[0]
        gaps = torch.cat([ranked[:, tg - 1] - ranked[:, tg], masked[:, k - 1] - masked[:, k]])
    return float(gaps.min())


def goldens(mtp: Mtp, cfg, rng: np.random.Generator) -> dict[str, np.ndarray] | None:
    H, V = cfg.hidden_size, cfg.vocab_size
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    hidden = rng.standard_normal((B, T, H)).astype(np.float32)
    positions = torch.arange(T)[None]
    out: dict[str, np.ndarray] = dict(tokens=tokens, hidden=hidden)
    rows, res, hs, lg = [], [], [], []
    with torch.no_grad():
        for b in range(B):
            t, h = torch.from_numpy(tokens[b : b + 1]).long(), torch.from_numpy(hidden[b : b + 1])
            x, h_out, logits = mtp(t, h, positions)
            res.append(x[0].numpy())
            hs.append(h_out[0].numpy())
            lg.append(logits[0].numpy())
            # The MTP layer's router input: post_attention_layernorm of the attention residual.
            e = torch.where((positions == 0)[..., None], 0.0, mtp.embed[t])
            x0 = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1))
            attn, _ = mtp.layer.self_attn(
                mtp.layer.input_layernorm(x0),
                position_embeddings=mtp.rotary(x0, positions),
                attention_mask=torch.full((T, T), float("-inf")).triu(1)[None, None],
            )
            rows.append(mtp.layer.post_attention_layernorm(x0 + attn)[0])
    out.update(
        forward_logits=np.stack(lg), forward_h_out=np.stack(hs), forward_residual=np.stack(res)
    )
    router_rows = torch.cat(rows)
    gate = mtp.layer.mlp.gate
    with torch.no_grad():
        logits_r, weights, ids = gate(router_rows)
    order = torch.argsort(ids, dim=-1)  # transformers' topk is unsorted: sort by expert id
    out.update(
        router_logits=logits_r.numpy(),
        router_ids=torch.gather(ids, 1, order).numpy().astype(np.int32),
        router_weights=torch.gather(weights, 1, order).numpy(),
    )
    if _router_gap(gate, router_rows, cfg) < 1e-3:
        return None
    out["prompt_rows"] = np.asarray(PROMPT_ROWS, np.int32)
    margins = [_margin(out["forward_logits"])]
    for contract in ("post_norm", "pre_norm", "pinned"):
        drafts, chain_logits = [], []
        for b, n in enumerate(PROMPT_ROWS):
            tok, hid = list(tokens[b, :n]), [hidden[b, i] for i in range(n)]
            anchor = hidden[b, n - 1]
            ds, ls = [], []
            for _ in range(K):
                t = torch.tensor([tok]).long()
                h = torch.from_numpy(np.stack(hid)[None])
                with torch.no_grad():
                    x, h_out, logits = mtp(t, h, torch.arange(len(tok))[None])
                last = logits[0, -1].numpy()
                d = int(last.argmax())
                ds.append(d)
                ls.append(last)
                g = {"post_norm": h_out[0, -1].numpy(), "pre_norm": x[0, -1].numpy(),
                     "pinned": anchor}[contract]  # fmt: skip
                tok.append(d)
                hid.append(g)
            drafts.append(ds)
            chain_logits.append(np.stack(ls))
        out[f"chain_{contract}_tokens"] = np.asarray(drafts, np.int32)
        out[f"chain_{contract}_logits"] = np.stack(chain_logits).astype(np.float32)
        margins.append(_margin(out[f"chain_{contract}_logits"]))
    if min(margins) < 0.2:
        return None
    return out


def build(out: Path, seed: int) -> int:
    cfg = hf_config()
    torch.manual_seed(0)  # module construction draws initial values, all overwritten
    while True:
        rng = np.random.default_rng(seed)
        store = Store(rng)
        mtp = Mtp(cfg, store).eval()
        target_layers(store, cfg)
        golden = goldens(mtp, cfg, rng)
        if golden is not None:
            break
        seed += 1
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.contiguous() for k, v in sorted(store.tensors.items())}
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    np.savez_compressed(out / "golden.npz", **golden)
    for f in out.iterdir():
        f.chmod(0o644)
    return seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seed = build(args.out, args.seed)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} (seed {seed}, {size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
