"""Synthetic Hugging Face checkpoints for the conversion tests: the real tensor names and config
keys of each family, tiny random shapes, sharded with a ``model.safetensors.index.json``.

Shards are written with the ``safetensors`` package itself (an independent writer for the
converter's own reader); ``write_raw`` writes the format by hand for what that package cannot
do cheaply: multi-hundred-MB filler tensors streamed to disk without holding them in memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from mtpjax import drafter
from mtpjax.config import DrafterConfig, FfnKind
from mtpjax.drafter import DrafterParams
from mtpjax.head import LMHeadParams
from mtpjax.layers import DenseFfnParams, MoeFfnParams
from mtpjax.weights import Bf16Weight, Fp8BlockWeight, Fp8RowWeight, Nvfp4Weight, Weight, quantize

H, V, NQ, NKV, D = 64, 128, 4, 2, 16
I_DENSE, E, I_EXPERT, I_SHARED = 96, 4, 32, 48

_ST_DTYPES = {
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int64): "I64",
}


# --------------------------------------------------------------------------------------------
# Configs (config.json dicts) whose DrafterConfig matches the tiny shapes above.


def _attention_keys() -> dict[str, Any]:
    return dict(
        hidden_size=H,
        vocab_size=V,
        num_attention_heads=NQ,
        num_key_value_heads=NKV,
        head_dim=D,
        partial_rotary_factor=0.5,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )


def _qwen_moe_keys() -> dict[str, Any]:
    return dict(
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=I_EXPERT,
        shared_expert_intermediate_size=I_SHARED,
        norm_topk_prob=True,
    )


def qwen3_next_config(*, num_mtp: int = 1, tied: bool = False) -> dict[str, Any]:
    return dict(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        num_hidden_layers=2,
        num_nextn_predict_layers=num_mtp,
        tie_word_embeddings=tied,
        **_attention_keys(),
        **_qwen_moe_keys(),
    )


def qwen3_5_config(*, moe: bool, num_mtp: int = 1, tied: bool = False) -> dict[str, Any]:
    text = dict(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        num_hidden_layers=2,
        mtp_num_hidden_layers=num_mtp,
        attn_output_gate=True,
        **_attention_keys(),
    )
    if moe:
        text.update(_qwen_moe_keys())
    else:
        text["intermediate_size"] = I_DENSE
    return dict(
        model_type="qwen3_5_moe" if moe else "qwen3_5",
        architectures=[
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        tie_word_embeddings=tied,
        text_config=text,
        vision_config={"depth": 1},
    )


def deepseek_v3_config(*, num_mtp: int = 1, num_layers: int = 3) -> dict[str, Any]:
    return dict(
        model_type="deepseek_v3",
        num_hidden_layers=num_layers,
        num_nextn_predict_layers=num_mtp,
        hidden_size=H,
        vocab_size=V,
        num_attention_heads=NQ,
        num_key_value_heads=NQ,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=I_EXPERT,
        n_shared_experts=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    )


def glm4_moe_config(*, num_mtp: int = 1, num_layers: int = 2) -> dict[str, Any]:
    return dict(
        model_type="glm4_moe",
        num_hidden_layers=num_layers,
        num_nextn_predict_layers=num_mtp,
        n_routed_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=I_EXPERT,
        n_shared_experts=1,
        attention_bias=True,
        use_qk_norm=False,
        **_attention_keys(),
    )


def mimo_config(*, num_mtp: int = 1) -> dict[str, Any]:
    return dict(
        model_type="mimo",
        num_hidden_layers=2,
        num_nextn_predict_layers=num_mtp,
        intermediate_size=I_DENSE,
        **_attention_keys(),
    )


def minimax_m2_config() -> dict[str, Any]:
    keys = _attention_keys()
    keys.pop("partial_rotary_factor")
    return dict(
        model_type="minimax_m2",
        num_hidden_layers=2,
        use_mtp=True,
        num_mtp_modules=3,
        mtp_transformer_layers=1,
        num_local_experts=E,
        num_experts_per_tok=2,
        intermediate_size=I_EXPERT,
        rotary_dim=8,
        scoring_func="sigmoid",
        use_routing_bias=True,
        **keys,
    )


NVFP4_QUANT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.35.0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head", "mtp*"],
    },
}


# --------------------------------------------------------------------------------------------
# Params -> tensors with the real names.


def _np(a: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a))


def weight_tensors(base: str, w: Weight, *, input_scale: bool = True) -> dict[str, np.ndarray]:
    """A projection as checkpoint tensors: ``{base}.weight`` plus its format's companions."""
    if isinstance(w, Bf16Weight):
        return {f"{base}.weight": _np(w.w)}
    if isinstance(w, Fp8BlockWeight):
        return {f"{base}.weight": _np(w.q), f"{base}.weight_scale_inv": _np(w.scale_inv)}
    if isinstance(w, Fp8RowWeight):
        return {f"{base}.weight": _np(w.q), f"{base}.weight_scale": _np(w.scale)}
    if isinstance(w, Nvfp4Weight):
        out = {
            f"{base}.weight": _np(w.packed),
            f"{base}.weight_scale": _np(w.scale),
            f"{base}.weight_scale_2": _np(w.scale_2),
        }
        if input_scale:  # ModelOpt's activation scale: present in real checkpoints, ignored
            out[f"{base}.input_scale"] = np.array(0.125, np.float32)
        return out
    raise TypeError(type(w))


def _expert(w: Weight, e: int) -> Weight:
    return jax.tree.map(lambda a: a[e], w)


def _dense_tensors(base: str, ffn: DenseFfnParams) -> dict[str, np.ndarray]:
    out = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out |= weight_tensors(f"{base}.{proj}", getattr(ffn, proj))
    return out


def _qwen_layer_tensors(L: str, params: DrafterParams, *, packed: bool) -> dict[str, np.ndarray]:
    layer = params.layer
    attn = layer.attention
    out = {
        f"{L}.input_layernorm.weight": _np(layer.input_layernorm),
        f"{L}.post_attention_layernorm.weight": _np(layer.post_attention_layernorm),
    }
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out |= weight_tensors(f"{L}.self_attn.{proj}", getattr(attn, proj))
    if attn.q_norm is not None:
        out[f"{L}.self_attn.q_norm.weight"] = _np(attn.q_norm)
        out[f"{L}.self_attn.k_norm.weight"] = _np(attn.k_norm)
    ffn = layer.ffn
    if isinstance(ffn, DenseFfnParams):
        return out | _dense_tensors(f"{L}.mlp", ffn)
    assert isinstance(ffn, MoeFfnParams)
    out |= weight_tensors(f"{L}.mlp.gate", ffn.router)
    experts = ffn.experts
    if packed:
        # Qwen3.6: one [E, 2I, H] tensor, each expert's gate rows first, then its up rows.
        gate, up, down = (getattr(experts, p) for p in ("gate_proj", "up_proj", "down_proj"))
        assert all(isinstance(w, Bf16Weight) for w in (gate, up, down))
        out[f"{L}.mlp.experts.gate_up_proj"] = _np(np.concatenate([_np(gate.w), _np(up.w)], axis=1))
        out[f"{L}.mlp.experts.down_proj"] = _np(down.w)
    else:
        for e in range(ffn.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                w = _expert(getattr(experts, proj), e)
                out |= weight_tensors(f"{L}.mlp.experts.{e}.{proj}", w)
    if ffn.shared_expert is not None:
        out |= _dense_tensors(f"{L}.mlp.shared_expert", ffn.shared_expert)
    if ffn.shared_expert_gate is not None:
        out |= weight_tensors(f"{L}.mlp.shared_expert_gate", ffn.shared_expert_gate)
    return out


def qwen_tensors(
    modules: Sequence[DrafterParams],
    head: LMHeadParams,
    *,
    text_prefix: str,
    packed_experts: bool = False,
    tied: bool = False,
) -> dict[str, np.ndarray]:
    """Qwen3-Next (``text_prefix="model."``) / Qwen3.5 (``"model.language_model."``) tensors.

    The modules share fc and the norms (module 0's are written); module ``i`` is
    ``mtp.layers.{i}``.
    """
    first = modules[0]
    out = {
        f"{text_prefix}embed_tokens.weight": _np(head.embedding),
        "mtp.pre_fc_norm_embedding.weight": _np(first.pre_fc_norm_embedding),
        "mtp.pre_fc_norm_hidden.weight": _np(first.pre_fc_norm_hidden),
        "mtp.norm.weight": _np(first.norm),
    }
    if head.final_norm is not None:
        out[f"{text_prefix}norm.weight"] = _np(head.final_norm)
    if not tied:
        out |= weight_tensors("lm_head", head.weight)
    out |= weight_tensors("mtp.fc", first.fc)
    for i, module in enumerate(modules):
        out |= _qwen_layer_tensors(f"mtp.layers.{i}", module, packed=packed_experts)
    return out


def qwen_modules(
    cfg: DrafterConfig, *, precision: str = "bf16", seed: int = 0
) -> list[DrafterParams]:
    """``cfg.num_mtp_modules`` modules sharing module 0's fc and norms (as Qwen's do)."""
    first = drafter.init(cfg, key=jax.random.PRNGKey(seed), precision=precision)
    modules = [first]
    for i in range(1, cfg.num_mtp_modules):
        other = drafter.init(cfg, key=jax.random.PRNGKey(seed + 100 + i), precision=precision)
        modules.append(
            DrafterParams(
                fc=first.fc,
                pre_fc_norm_embedding=first.pre_fc_norm_embedding,
                pre_fc_norm_hidden=first.pre_fc_norm_hidden,
                layer=other.layer,
                norm=first.norm,
            )
        )
    return modules


def random_head(cfg: DrafterConfig, *, seed: int = 7, tied: bool = False) -> LMHeadParams:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    embedding = (jax.random.normal(k1, (cfg.vocab_size, cfg.hidden_size))).astype("bfloat16")
    weight = jax.random.normal(k2, (cfg.vocab_size, cfg.hidden_size)) * 4 * cfg.hidden_size**-0.5
    norm = (0.1 * jax.random.normal(k3, (cfg.hidden_size,))).astype("bfloat16")
    w = Bf16Weight(w=embedding) if tied else quantize(weight, "bf16")
    return LMHeadParams(weight=w, embedding=embedding, final_norm=norm)


# --------------------------------------------------------------------------------------------
# Generic-family tensors (DeepSeek-V3 / GLM-4.5 / MiMo): real names, random values.


def _rand(
    rng: np.random.Generator, shape: Sequence[int], dtype: Any = ml_dtypes.bfloat16
) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.1).astype(dtype)


def fp8_block(rng: np.random.Generator, shape: Sequence[int]) -> Fp8BlockWeight:
    return quantize(rng.standard_normal(shape).astype(np.float32), "fp8_block")


def deepseek_module_tensors(prefix: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A DeepSeek-V3 NextN layer: MLA attention + routed MoE, projections FP8 block-128."""
    out: dict[str, np.ndarray] = {}

    def fp8(name: str, shape: Sequence[int]) -> None:
        out.update(weight_tensors(prefix + name, fp8_block(rng, shape)))

    for norm in (
        "enorm",
        "hnorm",
        "input_layernorm",
        "post_attention_layernorm",
        "shared_head.norm",
    ):
        out[f"{prefix}{norm}.weight"] = _rand(rng, (H,))
    fp8("eh_proj", (H, 2 * H))
    out[f"{prefix}embed_tokens.weight"] = _rand(rng, (V, H))
    out[f"{prefix}shared_head.head.weight"] = _rand(rng, (V, H))
    fp8("self_attn.q_a_proj", (32, H))
    out[f"{prefix}self_attn.q_a_layernorm.weight"] = _rand(rng, (32,))
    fp8("self_attn.q_b_proj", (NQ * 24, 32))
    fp8("self_attn.kv_a_proj_with_mqa", (16 + 8, H))
    out[f"{prefix}self_attn.kv_a_layernorm.weight"] = _rand(rng, (16,))
    fp8("self_attn.kv_b_proj", (NQ * (16 + 16), 16))
    fp8("self_attn.o_proj", (H, NQ * 16))
    out[f"{prefix}mlp.gate.weight"] = _rand(rng, (E, H))
    out[f"{prefix}mlp.gate.e_score_correction_bias"] = _rand(rng, (E,), np.float32)
    for e in range(E):
        fp8(f"mlp.experts.{e}.gate_proj", (I_EXPERT, H))
        fp8(f"mlp.experts.{e}.up_proj", (I_EXPERT, H))
        fp8(f"mlp.experts.{e}.down_proj", (H, I_EXPERT))
    for proj, shape in (
        ("gate_proj", (I_EXPERT, H)),
        ("up_proj", (I_EXPERT, H)),
        ("down_proj", (H, I_EXPERT)),
    ):
        fp8(f"mlp.shared_experts.{proj}", shape)
    return out


def glm_module_tensors(prefix: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A GLM-4.5 NextN layer: GQA with q/k/v bias + routed MoE, BF16."""
    out: dict[str, np.ndarray] = {}
    for norm in (
        "enorm",
        "hnorm",
        "input_layernorm",
        "post_attention_layernorm",
        "shared_head.norm",
    ):
        out[f"{prefix}{norm}.weight"] = _rand(rng, (H,))
    out[f"{prefix}eh_proj.weight"] = _rand(rng, (H, 2 * H))
    out[f"{prefix}shared_head.head.weight"] = _rand(rng, (V, H))
    for proj, n in (("q_proj", NQ * D), ("k_proj", NKV * D), ("v_proj", NKV * D)):
        out[f"{prefix}self_attn.{proj}.weight"] = _rand(rng, (n, H))
        out[f"{prefix}self_attn.{proj}.bias"] = _rand(rng, (n,))
    out[f"{prefix}self_attn.o_proj.weight"] = _rand(rng, (H, NQ * D))
    out[f"{prefix}mlp.gate.weight"] = _rand(rng, (E, H), np.float32)
    out[f"{prefix}mlp.gate.e_score_correction_bias"] = _rand(rng, (E,), np.float32)
    for e in range(E):
        out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = _rand(rng, (I_EXPERT, H))
        out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = _rand(rng, (I_EXPERT, H))
        out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = _rand(rng, (H, I_EXPERT))
    for proj, shape in (
        ("gate_proj", (I_EXPERT, H)),
        ("up_proj", (I_EXPERT, H)),
        ("down_proj", (H, I_EXPERT)),
    ):
        out[f"{prefix}mlp.shared_experts.{proj}.weight"] = _rand(rng, shape)
    return out


def mimo_module_tensors(prefix: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A MiMo MTP layer: token/hidden norms, input_proj over concat[hidden, token], a Qwen2 layer."""
    out: dict[str, np.ndarray] = {}
    for norm in (
        "token_layernorm",
        "hidden_layernorm",
        "final_layernorm",
        "input_layernorm",
        "post_attention_layernorm",
    ):
        out[f"{prefix}{norm}.weight"] = _rand(rng, (H,))
    out[f"{prefix}input_proj.weight"] = _rand(rng, (H, 2 * H))
    for proj, n in (("q_proj", NQ * D), ("k_proj", NKV * D), ("v_proj", NKV * D)):
        out[f"{prefix}self_attn.{proj}.weight"] = _rand(rng, (n, H))
        out[f"{prefix}self_attn.{proj}.bias"] = _rand(rng, (n,))
    out[f"{prefix}self_attn.o_proj.weight"] = _rand(rng, (H, NQ * D))
    out[f"{prefix}mlp.gate_proj.weight"] = _rand(rng, (I_DENSE, H))
    out[f"{prefix}mlp.up_proj.weight"] = _rand(rng, (I_DENSE, H))
    out[f"{prefix}mlp.down_proj.weight"] = _rand(rng, (H, I_DENSE))
    return out


def target_tensors(
    rng: np.random.Generator, *, text_prefix: str = "model.", layers: int = 2, tied: bool = False
) -> dict[str, np.ndarray]:
    """The target's embedding, final norm, LM head and a small body the converter must skip."""
    out = {
        f"{text_prefix}embed_tokens.weight": _rand(rng, (V, H)),
        f"{text_prefix}norm.weight": _rand(rng, (H,)),
    }
    if not tied:
        out["lm_head.weight"] = _rand(rng, (V, H))
    for j in range(layers):
        out[f"{text_prefix}layers.{j}.self_attn.o_proj.weight"] = _rand(rng, (H, H))
        out[f"{text_prefix}layers.{j}.input_layernorm.weight"] = _rand(rng, (H,))
    return out


def nvfp4_body(
    text_prefix: str, rng: np.random.Generator, layers: int = 2
) -> dict[str, np.ndarray]:
    """Target-body projections in ModelOpt NVFP4 (what the global quant config describes)."""
    out = {}
    for j in range(layers):
        w = quantize(rng.standard_normal((H, H)).astype(np.float32), "nvfp4")
        out |= weight_tensors(f"{text_prefix}layers.{j}.mlp.down_proj", w)
    return out


# --------------------------------------------------------------------------------------------
# Writing.


class Filler:
    """A large tensor written by ``write_raw`` in chunks, never held in memory whole: ``pattern``
    repeated from its first byte (by default a fixed 4 MiB byte sequence)."""

    def __init__(
        self, dtype: str, shape: Sequence[int], itemsize: int = 2, pattern: bytes | None = None
    ) -> None:
        self.dtype, self.shape, self.itemsize = dtype, tuple(shape), itemsize
        self.pattern = pattern

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def write_raw(path: Path, tensors: Mapping[str, np.ndarray | Filler]) -> int:
    """Writes a safetensors file by hand (header + data in order); returns its size in bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if isinstance(t, Filler):
            dtype, shape, nbytes = t.dtype, list(t.shape), t.nbytes
        else:
            dtype, shape, nbytes = _ST_DTYPES[t.dtype], list(t.shape), t.nbytes
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    chunk = (np.arange(1 << 22, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            if isinstance(t, Filler):
                pattern = chunk if t.pattern is None else t.pattern
                left = t.nbytes
                while left:
                    piece = pattern[: min(left, len(pattern))]
                    f.write(piece)
                    left -= len(piece)
            else:
                f.write(np.ascontiguousarray(t).tobytes())
    return path.stat().st_size


def write_checkpoint(
    directory: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    shards: int = 3,
    quant_config: Mapping[str, Any] | None = None,
    big: Mapping[str, Filler] | None = None,
) -> Path:
    """Writes ``config.json`` and the tensors: one ``model.safetensors`` when ``shards == 1``,
    else ``shards`` files ``model-0000i-of-0000n.safetensors`` plus the index (names sorted and
    dealt round-robin, so every module spans several shards). ``big`` filler tensors are spread
    over the shards too (written with ``write_raw``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    if quant_config is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(quant_config))
    names = sorted(tensors)
    big = dict(big or {})
    if shards == 1 and not big:
        save_file({n: tensors[n] for n in names}, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    total = 0
    big_names = sorted(big)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        big_part = {n: big[n] for n in big_names[s::shards]}
        if big_part:
            total += write_raw(directory / file, {**part, **big_part})
        else:
            save_file(part, str(directory / file))
            total += (directory / file).stat().st_size
        weight_map.update(dict.fromkeys([*part, *big_part], file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return directory


def qwen_checkpoint(
    directory: Path,
    *,
    family: str = "qwen3_5",
    moe: bool = True,
    num_mtp: int = 1,
    precision: str = "bf16",
    packed_experts: bool = False,
    tied: bool = False,
    shards: int = 3,
    quant_config: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> tuple[DrafterConfig, list[DrafterParams], LMHeadParams]:
    """Writes a Qwen-family checkpoint built from known params; returns (cfg, modules, head)."""
    if family == "qwen3_next":
        config = qwen3_next_config(num_mtp=num_mtp, tied=tied)
        text = "model."
    else:
        config = qwen3_5_config(moe=moe, num_mtp=num_mtp, tied=tied)
        text = "model.language_model."
    cfg = DrafterConfig.from_hf_config(config)
    assert cfg.ffn is (FfnKind.MOE if moe or family == "qwen3_next" else FfnKind.DENSE)
    modules = qwen_modules(cfg, precision=precision, seed=seed)
    head = random_head(cfg, seed=seed + 7, tied=tied)
    tensors = qwen_tensors(
        modules, head, text_prefix=text, packed_experts=packed_experts, tied=tied
    )
    rng = np.random.default_rng(seed)
    for j in range(2):  # a small target body the converter must skip
        tensors[f"{text}layers.{j}.self_attn.o_proj.weight"] = _rand(rng, (H, H))
    if quant_config is not None:
        tensors |= nvfp4_body(text, rng)
    write_checkpoint(directory, config, tensors, shards=shards, quant_config=quant_config)
    return cfg, modules, head
