"""Golden fixtures for the GLM-4.5 NextN and MiMo MTP drafters, computed with transformers.

The CPU tests have no torch; this script (run once, in an environment that has torch and
transformers) writes small random checkpoints in each family's Hugging Face layout and what the
MTP modules compute from them, in float32:

    tests/fixtures/nextn/glm4_moe/   GLM-4.5 / 4.6 (``model_type: glm4_moe``): two NextN modules
                                     at ``model.layers.{num_hidden_layers + i}`` (``enorm``,
                                     ``hnorm``, ``eh_proj``, a ``Glm4MoeDecoderLayer``,
                                     ``shared_head.norm``). Every feature on: partial RoPE
                                     (half of each head), QK norm, q/k/v bias, sigmoid router
                                     with ``e_score_correction_bias``, n_group = 2 /
                                     topk_group = 1, routed_scaling_factor, norm_topk_prob, a
                                     shared expert; routed experts stored per expert, as the
                                     published checkpoints do.
    tests/fixtures/nextn/mimo/       MiMo-7B (``model_type: mimo``): one module at
                                     ``model.mtp_layers.0`` (``token_layernorm``,
                                     ``hidden_layernorm``, ``input_proj`` over
                                     ``concat[hidden, token]``, a ``Qwen2DecoderLayer`` with q/k/v
                                     bias and full RoPE, ``final_layernorm``).

Each directory holds config.json, model.safetensors (the embedding, the LM head, the final norm
and the MTP modules; the target's own decoder layers are left out, the converter never reads
them) and golden.npz.

transformers has no MTP wrapper for either family (it drops the MTP tensors on load), so the
wrappers are built here in torch around transformers' own modules (``Glm4MoeDecoderLayer``,
``Glm4MoeRMSNorm``, ``Glm4MoeRotaryEmbedding``; ``Qwen2DecoderLayer``, ``Qwen2RMSNorm``,
``Qwen2RotaryEmbedding``) the way vLLM's ``glm4_moe_mtp.py`` / ``mimo_mtp.py`` and SGLang's
``glm4_moe_nextn.py`` wire them: the token embedding is zeroed at position 0, normed and
concatenated with the normed hidden (GLM: embedding first; MiMo: hidden first), projected, run
through the decoder layer, then the final norm (``h_out``) and the target's LM head. Draft
steps after the first chain ``h_out`` (the post-norm hidden: the families' default contract,
``DrafterConfig.default_hidden_contract``).

Every parameter is drawn with numpy from a fixed seed, rounded to bfloat16 and stored as BF16;
torch runs in float32 on exactly those values. A seed is skipped (the next one tried) when a
routing decision (group choice or expert top-k, with the correction bias) is a near tie (gap
< 1e-3), or a draft's top two logits are closer than 0.05 (the drafter's BF16 KV cache moves
them by ~1e-2): goldens there would test luck. The output is byte-identical from run to
run.

golden.npz (N modules, B = 2 sequences, H hidden, V vocab; float32 unless int32):

    forward_tokens     int32[B, T]      T = 7 pairs (t_{i+1}, h_i) at positions 0..T-1
    forward_hidden     [B, T, H]        random target hidden states
    forward_h_out      [N, B, T, H]     each module's teacher-forced causal forward: h_out
    forward_residual   [N, B, T, H]     the residual before the final norm
    forward_logits     [N, B, T, V]     the LM head over h_out
    prompt_tokens      int32[B, P]      committed pairs of each sequence, right-padded (P = 6)
    prompt_hidden      [B, P, H]
    lengths            int32[B]         pairs committed: 6, 4 (the anchor is the last)
    chain_tokens       int32[B, 4]      module 0 chaining itself (post-norm), from the anchor:
                                        draft s + 1 reads the rows (committed pairs, then
                                        (d_1, h_out_0) .. (d_s, h_out_{s-1})) causally
    chain_logits       [B, 4, V]
    clamp_tokens       int32[B, N]      (N > 1 only) module s drafts step s: module 0 at the
    clamp_logits       [B, N, V]        anchor, module m >= 1 over the rows it wrote itself
                                        ((d_m, h_out of step m - 1) at key anchor + m alone)
    versions           str              torch and transformers versions used

Run (transformers 5.24.0, torch 2.13.0+cpu, Python 3.11; a few seconds):

    /work/torchenv/bin/python scripts/make_nextn_fixtures.py --out tests/fixtures/nextn
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import transformers
from torch import nn
from transformers import Glm4MoeConfig, Qwen2Config
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeDecoderLayer,
    Glm4MoeRMSNorm,
    Glm4MoeRotaryEmbedding,
)
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)

B, T, P, CHAIN = 2, 7, 6, 4
LENGTHS = (6, 4)
MARGIN = 1e-3  # smallest allowed gap of a routing choice
# Smallest allowed top-1 / top-2 logit gap of a draft: the drafter's paged path stores K/V in
# BF16, which moves these logits by ~1e-2, and the tests compare draft tokens exactly.
DRAFT_MARGIN = 0.05

GLM = dict(
    vocab_size=97,
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    num_hidden_layers=1,
    num_nextn_predict_layers=2,
    attention_bias=True,
    use_qk_norm=True,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
GLM_ROPE = dict(rope_theta=10_000.0, partial_rotary_factor=0.5)  # 8 of 16 dims rotate
MIMO = dict(
    vocab_size=89,
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,  # head_dim = 48 / 4 = 12, full RoPE
    intermediate_size=40,
    num_hidden_layers=1,
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_theta=640_000.0,
)


# --------------------------------------------------------------------------------------------
# The MTP modules, from transformers' parts.


class NextNModule(nn.Module):
    """GLM-4.5's NextN module: eh_proj(concat[enorm(e), hnorm(h)]), a decoder layer,
    shared_head.norm."""

    hidden_first = False

    def __init__(self, config: Glm4MoeConfig, layer_idx: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = Glm4MoeRMSNorm(H, eps), Glm4MoeRMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = Glm4MoeDecoderLayer(config, layer_idx)
        self.final_norm = Glm4MoeRMSNorm(H, eps)
        self.rotary = Glm4MoeRotaryEmbedding(config)
        self.names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj"}
        self.names |= {"final_norm": "shared_head.norm"}

    def fuse(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))


class MiMoModule(nn.Module):
    """MiMo's MTP layer: input_proj(concat[hidden_layernorm(h), token_layernorm(e)]), a Qwen2
    decoder layer, final_layernorm."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = Qwen2RMSNorm(H, eps), Qwen2RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = Qwen2DecoderLayer(config, 0)
        self.final_norm = Qwen2RMSNorm(H, eps)
        self.rotary = Qwen2RotaryEmbedding(config)
        self.names = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm"}
        self.names |= {"eh_proj": "input_proj", "final_norm": "final_layernorm"}

    def fuse(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1))


def run_module(module, embed, tokens, hidden, positions):
    """One causal forward over pairs tokens int[T], hidden [T, H] at positions int[T]:
    (residual, h_out) [T, H]."""
    e = embed[tokens].clone()
    e[positions == 0] = 0.0  # vLLM's MTP modules: no embedding at position 0
    x = module.fuse(e, hidden)[None]
    pos = positions[None]
    n = len(tokens)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    cos_sin = module.rotary(x, pos)
    x = module.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    x = x[0] if isinstance(x, tuple) else x
    return x[0], module.final_norm(x[0])


# --------------------------------------------------------------------------------------------
# Random parameters, the checkpoint on disk.


def _draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    normal = rng.standard_normal(shape)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * normal
    if name.endswith(".bias"):
        return 0.3 * normal
    if name.endswith("norm.weight"):
        return 1.0 + 0.3 * normal  # plain RMSNorm multiplies by its weight
    if name.endswith("mlp.gate.weight"):  # the router: sharp enough that top-k has margins
        return 3.0 * normal / np.sqrt(shape[-1])
    if len(shape) >= 2:  # a projection [..., out, in]
        return normal / np.sqrt(shape[-1])
    raise ValueError(f"no draw rule for parameter {name!r} of shape {shape}")


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)


def _randomise(module: nn.Module, rng: np.random.Generator) -> None:
    """Every parameter and the correction-bias buffer from ``rng``, rounded to bfloat16."""
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if "rotary" in name:
                continue
            p.copy_(_bf16(_draw(name, tuple(p.shape), rng)).to(torch.float32))


def _module_tensors(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The module's tensors under the published checkpoints' names (experts per expert)."""
    out: dict[str, torch.Tensor] = {}
    for local, target in module.names.items():
        out[f"{prefix}{target}.weight"] = getattr(module, local).weight
    for name, t in [*module.layer.named_parameters(), *module.layer.named_buffers()]:
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows first
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[prefix + name] = t
    return out


def _config_json(family: str) -> dict[str, Any]:
    if family == "glm4_moe":
        return dict(
            architectures=["Glm4MoeForCausalLM"],
            model_type="glm4_moe",
            **GLM,
            **GLM_ROPE,
            dtype="bfloat16",
        )
    return dict(architectures=["MiMoForCausalLM"], model_type="mimo", **MIMO, dtype="bfloat16")


def _modules(family: str) -> tuple[list[nn.Module], list[str]]:
    if family == "glm4_moe":
        config = Glm4MoeConfig(**GLM, rope_parameters=dict(rope_type="default", **GLM_ROPE))
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"  # transformers' per-expert loop
        L = GLM["num_hidden_layers"]
        n = GLM["num_nextn_predict_layers"]
        modules = [NextNModule(config, L + i) for i in range(n)]
        return modules, [f"model.layers.{L + i}." for i in range(n)]
    fields = {k: v for k, v in MIMO.items() if k not in ("num_nextn_predict_layers", "rope_theta")}
    config = Qwen2Config(**fields, rope_parameters=dict(rope_type="default", rope_theta=640_000.0))
    config._attn_implementation = "eager"
    return [MiMoModule(config)], ["model.mtp_layers.0."]


# --------------------------------------------------------------------------------------------
# Goldens.


class RouterMargins:
    """Records the smallest gap of every routing decision of the GLM routers it watches."""

    def __init__(self, modules):
        self.smallest = float("inf")
        for m in modules:
            gate = getattr(m.layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.register_forward_hook(self._hook)

    def _hook(self, gate, args, output):
        x = args[0].reshape(-1, gate.hidden_dim).float()
        scores = torch.sigmoid(x @ gate.weight.float().T) + gate.e_score_correction_bias
        groups = scores.view(len(x), gate.num_group, -1)
        value = groups.topk(2, dim=-1)[0].sum(-1)  # [T, G]
        ranked = value.sort(dim=-1, descending=True)[0]
        if gate.num_group > gate.topk_group:
            gap = ranked[:, gate.topk_group - 1] - ranked[:, gate.topk_group]
            self.smallest = min(self.smallest, float(gap.min()))
        best = value.topk(gate.topk_group, dim=-1)[1]
        keep = torch.zeros_like(value, dtype=torch.bool).scatter_(1, best, True)
        allowed = scores.masked_fill(~keep.repeat_interleave(groups.shape[-1], 1), -1e9)
        top = allowed.sort(dim=-1, descending=True)[0]
        gap = top[:, gate.top_k - 1] - top[:, gate.top_k]
        self.smallest = min(self.smallest, float(gap.min()))


def _argmax(logits: torch.Tensor) -> tuple[int, float]:
    top = logits.topk(2)[0]
    return int(logits.argmax()), float(top[0] - top[1])


def goldens(modules, embed, head, rng) -> tuple[dict[str, np.ndarray], float]:
    """The golden arrays and the smallest argmax gap of the drafts."""
    H = embed.shape[1]
    V = embed.shape[0]
    g: dict[str, Any] = {}
    tokens = torch.from_numpy(rng.integers(0, V, (B, T)))
    hidden = _bf16(rng.standard_normal((B, T, H))).float()
    g["forward_tokens"], g["forward_hidden"] = tokens, hidden
    outs = [
        [run_module(m, embed, tokens[b], hidden[b], torch.arange(T)) for b in range(B)]
        for m in modules
    ]
    g["forward_residual"] = torch.stack([torch.stack([o[0] for o in per]) for per in outs])
    g["forward_h_out"] = torch.stack([torch.stack([o[1] for o in per]) for per in outs])
    g["forward_logits"] = g["forward_h_out"] @ head.T

    prompt_tokens = torch.from_numpy(rng.integers(0, V, (B, P)))
    prompt_hidden = _bf16(rng.standard_normal((B, P, H))).float()
    smallest = float("inf")
    chain_tokens, chain_logits, clamp_tokens, clamp_logits = [], [], [], []
    for b, n in enumerate(LENGTHS):
        prompt_tokens[b, n:], prompt_hidden[b, n:] = 0, 0.0
        toks, hid = prompt_tokens[b, :n].clone(), prompt_hidden[b, :n].clone()
        drafts, logits = [], []
        for _ in range(CHAIN):
            _, h_out = run_module(modules[0], embed, toks, hid, torch.arange(len(toks)))
            lg = h_out[-1] @ head.T
            d, gap = _argmax(lg)
            smallest = min(smallest, gap)
            drafts.append(d)
            logits.append(lg)
            toks = torch.cat([toks, torch.tensor([d])])
            hid = torch.cat([hid, h_out[-1:]])
        chain_tokens.append(drafts)
        chain_logits.append(torch.stack(logits))
        if len(modules) > 1:
            # Module 0's first step is the chain's; module m holds its own row alone.
            tokens_m, logits_m = [drafts[0]], [logits[0]]
            _, h_out = run_module(modules[0], embed, toks[:n], hid[:n], torch.arange(n))
            carry = h_out[-1:]
            for m, module in enumerate(modules[1:], start=1):
                key = torch.tensor([n - 1 + m])
                _, h_out = run_module(module, embed, torch.tensor([tokens_m[-1]]), carry, key)
                lg = h_out[-1] @ head.T
                d, gap = _argmax(lg)
                smallest = min(smallest, gap)
                tokens_m.append(d)
                logits_m.append(lg)
                carry = h_out[-1:]
            clamp_tokens.append(tokens_m[: len(modules)])
            clamp_logits.append(torch.stack(logits_m[: len(modules)]))
    g["prompt_tokens"], g["prompt_hidden"] = prompt_tokens, prompt_hidden
    g["lengths"] = torch.tensor(LENGTHS)
    g["chain_tokens"], g["chain_logits"] = torch.tensor(chain_tokens), torch.stack(chain_logits)
    if clamp_tokens:
        g["clamp_tokens"], g["clamp_logits"] = torch.tensor(clamp_tokens), torch.stack(clamp_logits)
    arrays = {
        k: v.numpy().astype(np.int32 if not v.is_floating_point() else np.float32)
        for k, v in g.items()
    }
    return arrays, smallest


def build(out: Path, family: str) -> None:
    cfg = _config_json(family)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    for seed in range(100):
        rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        modules, prefixes = _modules(family)
        for m in modules:
            _randomise(m, rng)
            m.eval()
        embed = _bf16(rng.standard_normal((V, H))).float()
        head = _bf16(2.0 * rng.standard_normal((V, H)) / np.sqrt(H)).float()
        final_norm = _bf16(1.0 + 0.3 * rng.standard_normal(H)).float()
        margins = RouterMargins(modules)
        with torch.no_grad():
            arrays, draft_gap = goldens(modules, embed, head, rng)
        if draft_gap >= DRAFT_MARGIN and margins.smallest >= MARGIN:
            break
        print(
            f"{family}: seed {seed} skipped (draft gap {draft_gap:.2e}, router gap "
            f"{margins.smallest:.2e})"
        )
    else:
        raise RuntimeError(f"{family}: no seed without near ties")
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": final_norm,
    }
    for m, prefix in zip(modules, prefixes):
        tensors |= _module_tensors(m, prefix)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    with open(out / "golden.npz", "wb") as f:
        np.savez(f, versions=np.array(versions), **arrays)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: seed {seed}, {len(tensors)} tensors, {size / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/nextn"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # summation order fixed: the goldens are byte-identical per run
    for family in ("glm4_moe", "mimo"):
        build(args.out / family, family)


if __name__ == "__main__":
    main()
