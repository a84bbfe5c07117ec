"""Safetensors I/O for the reference target and its MTP head in the Hugging Face layout.

One ``model.safetensors`` (torch layout ``[out, in]``, BF16) plus ``config.json``:

  model.embed_tokens.weight                      [V, H]
  model.layers.{i}.input_layernorm.weight        [H]
  model.layers.{i}.self_attn.q_proj.weight       [Nq*2D, H]  (per head [q_h, gate_h])
  model.layers.{i}.self_attn.{k,v}_proj.weight   [Nkv*D, H]
  model.layers.{i}.self_attn.o_proj.weight       [H, Nq*D]
  model.layers.{i}.self_attn.{q,k}_norm.weight   [D]
  model.layers.{i}.post_attention_layernorm.weight
  model.layers.{i}.mlp.{gate,up}_proj.weight     [I, H];  mlp.down_proj.weight [H, I]
  model.norm.weight                              [H]
  lm_head.weight                                 [V, H]   (absent when tied)
  mtp.fc.weight                                  [H, 2H]
  mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,norm}.weight
  mtp.layers.0.<the layer names above without the model. prefix>

Only BF16 weights are written or read here: this is the format of the shipped tiny pair, not a
general checkpoint loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from mtpjax.config import DrafterConfig
from mtpjax.drafter import DrafterParams
from mtpjax.head import LMHeadParams, from_arrays
from mtpjax.layers import AttentionParams, DenseFfnParams
from mtpjax.layers.decoder import DecoderLayerParams
from mtpjax.reference.target import TargetConfig, TargetParams
from mtpjax.weights import Bf16Weight

__all__ = ["load_hf", "load_target", "save_hf"]

WEIGHTS_FILE = "model.safetensors"


def _layer_tensors(layer: DecoderLayerParams, prefix: str) -> dict[str, jax.Array]:
    """Checkpoint names -> arrays for one (unstacked) dense decoder layer."""
    attn, ffn = layer.attention, layer.ffn
    if not isinstance(ffn, DenseFfnParams):
        raise TypeError(f"{prefix}: only dense FFN layers are saved, got {type(ffn).__name__}")
    out = {
        f"{prefix}.input_layernorm.weight": layer.input_layernorm,
        f"{prefix}.post_attention_layernorm.weight": layer.post_attention_layernorm,
    }
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"{prefix}.self_attn.{name}.weight"] = _bf16_matrix(getattr(attn, name), prefix, name)
    for name in ("q_norm", "k_norm"):
        if getattr(attn, name) is not None:
            out[f"{prefix}.self_attn.{name}.weight"] = getattr(attn, name)
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{prefix}.mlp.{name}.weight"] = _bf16_matrix(getattr(ffn, name), prefix, name)
    return out


def _bf16_matrix(w: Any, prefix: str, name: str) -> jax.Array:
    if not isinstance(w, Bf16Weight):
        raise TypeError(f"{prefix}.{name}: only BF16 weights are saved, got {type(w).__name__}")
    return w.w


def save_hf(
    directory: str | os.PathLike,
    *,
    cfg: TargetConfig,
    target: TargetParams,
    head: LMHeadParams,
    drafter: DrafterParams | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` (all tensors BF16) into ``directory``.

    ``config.json`` is ``cfg.to_hf_config`` (qwen3_next, dense, ``num_nextn_predict_layers`` 1
    with a drafter, 0 without) plus ``extra_config``. Returns the directory.
    """
    from safetensors.flax import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, jax.Array] = {
        "model.embed_tokens.weight": head.embedding,
        "model.norm.weight": target.final_norm,
    }
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = _bf16_matrix(head.weight, "lm_head", "weight")
    for i in range(cfg.num_hidden_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], target.layers)
        tensors.update(_layer_tensors(layer, f"model.layers.{i}"))
    if drafter is not None:
        if drafter.embed_tokens is not None:
            raise ValueError("a dedicated MTP embedding is not part of this layout")
        tensors |= {
            "mtp.fc.weight": _bf16_matrix(drafter.fc, "mtp", "fc"),
            "mtp.pre_fc_norm_embedding.weight": drafter.pre_fc_norm_embedding,
            "mtp.pre_fc_norm_hidden.weight": drafter.pre_fc_norm_hidden,
            "mtp.norm.weight": drafter.norm,
        }
        tensors.update(_layer_tensors(drafter.layer, "mtp.layers.0"))
    tensors = {k: jnp.asarray(v).astype(jnp.bfloat16) for k, v in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = cfg.to_hf_config(num_mtp_layers=1 if drafter is not None else 0)
    config.update(extra_config or {})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


class _Tensors:
    """Looks tensors up by name, with errors that name what is missing or misshapen."""

    def __init__(self, path: Path) -> None:
        from safetensors.flax import load_file

        if not path.is_file():
            raise FileNotFoundError(f"no {WEIGHTS_FILE} at {str(path)!r}")
        self.path = path
        self.tensors = load_file(str(path))

    def get(self, name: str, shape: tuple[int, ...]) -> jax.Array:
        if name not in self.tensors:
            raise KeyError(f"tensor {name!r} is missing from {str(self.path)!r}")
        t = self.tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.astype(jnp.bfloat16)

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.tensors)


def _load_layer(t: _Tensors, prefix: str, cfg: TargetConfig | DrafterConfig) -> DecoderLayerParams:
    H, D = cfg.hidden_size, cfg.head_dim
    I = cfg.intermediate_size

    def w(name: str, shape: tuple[int, int]) -> Bf16Weight:
        return Bf16Weight(w=t.get(f"{prefix}.{name}.weight", shape))

    attention = AttentionParams(
        q_proj=w("self_attn.q_proj", (cfg.q_proj_width, H)),
        k_proj=w("self_attn.k_proj", (cfg.kv_width, H)),
        v_proj=w("self_attn.v_proj", (cfg.kv_width, H)),
        o_proj=w("self_attn.o_proj", (H, cfg.num_attention_heads * D)),
        q_norm=t.get(f"{prefix}.self_attn.q_norm.weight", (D,)) if cfg.qk_norm else None,
        k_norm=t.get(f"{prefix}.self_attn.k_norm.weight", (D,)) if cfg.qk_norm else None,
    )
    return DecoderLayerParams(
        input_layernorm=t.get(f"{prefix}.input_layernorm.weight", (H,)),
        attention=attention,
        post_attention_layernorm=t.get(f"{prefix}.post_attention_layernorm.weight", (H,)),
        ffn=DenseFfnParams(
            gate_proj=w("mlp.gate_proj", (I, H)),
            up_proj=w("mlp.up_proj", (I, H)),
            down_proj=w("mlp.down_proj", (H, I)),
        ),
    )


def _load_target(t: _Tensors, cfg: TargetConfig) -> tuple[TargetParams, LMHeadParams]:
    H, V = cfg.hidden_size, cfg.vocab_size
    layers = [_load_layer(t, f"model.layers.{i}", cfg) for i in range(cfg.num_hidden_layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    final_norm = t.get("model.norm.weight", (H,))
    head = from_arrays(
        cfg.lm_head_config(),
        lm_head=None if cfg.tie_word_embeddings else t.get("lm_head.weight", (V, H)),
        embedding=t.get("model.embed_tokens.weight", (V, H)),
        final_norm=final_norm,
    )
    return TargetParams(layers=stacked, final_norm=final_norm), head


def load_target(
    directory: str | os.PathLike, *, compute_dtype: str = "float32"
) -> tuple[TargetConfig, TargetParams, LMHeadParams]:
    """Reads a directory written by ``save_hf`` (or any dense, all-full-attention qwen3_next
    checkpoint in one BF16 file): (cfg, target params, LM head params with final_norm set)."""
    directory = Path(directory)
    cfg = TargetConfig.from_hf_config(directory, compute_dtype=compute_dtype)
    target, head = _load_target(_Tensors(directory / WEIGHTS_FILE), cfg)
    return cfg, target, head


def load_hf(
    directory: str | os.PathLike, *, compute_dtype: str = "float32"
) -> tuple[TargetConfig, TargetParams, LMHeadParams, DrafterConfig, DrafterParams]:
    """Target and MTP head from one directory: (cfg, target, head, drafter cfg, drafter)."""
    directory = Path(directory)
    cfg = TargetConfig.from_hf_config(directory, compute_dtype=compute_dtype)
    dcfg = DrafterConfig.from_hf_config(directory)
    t = _Tensors(directory / WEIGHTS_FILE)
    if not t.has_prefix("mtp."):
        raise ValueError(f"{str(t.path)!r} holds no mtp.* tensors: there is no MTP head to load")
    target, head = _load_target(t, cfg)
    H = dcfg.hidden_size
    drafter = DrafterParams(
        fc=Bf16Weight(w=t.get("mtp.fc.weight", (H, 2 * H))),
        pre_fc_norm_embedding=t.get("mtp.pre_fc_norm_embedding.weight", (H,)),
        pre_fc_norm_hidden=t.get("mtp.pre_fc_norm_hidden.weight", (H,)),
        layer=_load_layer(t, "mtp.layers.0", dcfg),
        norm=t.get("mtp.norm.weight", (H,)),
    )
    return cfg, target, head, dcfg, drafter
