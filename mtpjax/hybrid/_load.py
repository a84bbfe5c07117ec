"""Loading the hybrid target from a Hugging Face directory, tensor by tensor.

The directory holds ``config.json`` and ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Text-model tensors sit under ``model.language_model.``
(Qwen3.5 / Qwen3.6) or ``model.`` (Qwen3-Next, and text-only saves); ``lm_head.weight`` is
absent when the embeddings are tied. ``mtp.*`` (the MTP head: ``mtpjax.checkpoint.convert``)
and ``model.visual.*`` are not read. Names, relative to the text prefix:

  embed_tokens.weight, norm.weight
  layers.{i}.{input_layernorm, post_attention_layernorm}.weight
  layers.{i}.self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm}.weight   (full)
  layers.{i}.linear_attn.{in_proj_qkvz, in_proj_ba | in_proj_qkv, in_proj_z, in_proj_b,
      in_proj_a, conv1d, norm, out_proj}.weight, linear_attn.{A_log, dt_bias}         (GDN)
  layers.{i}.mlp.{gate_proj, up_proj, down_proj}.weight                             (dense)
  layers.{i}.mlp.{gate, shared_expert.*, shared_expert_gate}.weight and the experts, per
      expert (mlp.experts.{e}.{gate,up,down}_proj.weight) or packed
      (mlp.experts.gate_up_proj [E, 2I, H], gate rows first; mlp.experts.down_proj [E, H, I])

Each projection keeps the format its checkpoint stores (BF16; FP8 per-row or block-128; NVFP4),
detected from its own dtype and companion tensors; float projections are rounded to BF16. Norms
and the GDN arrays keep BF16 or F32 (F16 becomes F32). A missing or misshapen tensor raises one
``CheckpointError`` line naming it, the expected shape (and how config.json gives it) and the
found one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.checkpoint import CheckpointError, SafetensorsCheckpoint
from mtpjax.checkpoint._formats import (
    check_dtype,
    convert_packed_slices,
    convert_stacked,
    detect,
    read_embedding,
    read_native,
)
from mtpjax.checkpoint._layouts import text_prefix
from mtpjax.head import LMHeadParams, from_arrays
from mtpjax.hybrid._config import HybridConfig
from mtpjax.hybrid._params import HybridParams, from_named, model_leaves
from mtpjax.layers import Leaf

__all__ = ["load"]

_NO_WEIGHT_SUFFIX = ("linear_attn.A_log", "linear_attn.dt_bias")


class _Reader:
    """Reads described leaves from ``ckpt`` under the text prefix, checking each shape."""

    def __init__(self, ckpt: SafetensorsCheckpoint, directory: Path) -> None:
        self.ckpt = ckpt
        self.where = directory
        self.text = text_prefix(set(ckpt.names))

    def _fail(self, name: str, found: Any, leaf: Leaf, shape: tuple[int, ...] | None = None):
        want = list(leaf.shape if shape is None else shape)
        found = "missing" if found is None else f"of shape {list(found)}"
        return CheckpointError(
            f"{self.where}: tensor {name!r} is {found}, expected {want} {leaf.what}"
        )

    def _present(self, name: str, leaf: Leaf, shape: tuple[int, ...] | None = None) -> None:
        if name not in self.ckpt:
            raise self._fail(name, None, leaf, shape)

    def tensor_name(self, name: str) -> str:
        suffix = "" if name.endswith(_NO_WEIGHT_SUFFIX) else ".weight"
        return self.text + name + suffix

    def array(self, name: str, leaf: Leaf) -> jax.Array:
        full = self.tensor_name(name)
        self._present(full, leaf)
        info = self.ckpt.info(full)
        if info.shape != leaf.shape:
            raise self._fail(full, info.shape, leaf)
        check_dtype(info, "norm or GDN parameter")
        a = self.ckpt.read(full)
        return jnp.asarray(a.astype(np.float32) if a.dtype == np.float16 else a)

    def weight(self, full: str, leaf: Leaf, shape: tuple[int, ...] | None = None):
        """A projection stored as ``full``, in its own format (numpy-backed)."""
        self._present(full, leaf, shape)
        src = detect(self.ckpt, full)
        want = leaf.shape if shape is None else shape
        if tuple(src.shape) != want:
            raise self._fail(full, src.shape, leaf, want)
        return read_native(self.ckpt, src)

    def experts(self, name: str, leaf: Leaf):
        """``...mlp.experts.{proj}`` [E, N, K]: stacked per expert, or sliced from packed."""
        base, _, proj = (self.text + name).rpartition(".")
        E, N, K = leaf.shape
        packed = [f"{base}.gate_up_proj", f"{base}.gate_up_proj.weight"]
        packed = next((n for n in packed if n in self.ckpt), None)
        if packed is None:
            srcs = []
            for e in range(E):
                full = f"{base}.{e}.{proj}.weight"
                self.weight(full, leaf, (N, K))
                srcs.append(detect(self.ckpt, full))
            return convert_stacked(self.ckpt, srcs, None, what=f"{base}.*.{proj}")
        if proj == "down_proj":
            full = packed.replace("gate_up_proj", "down_proj")
            rows = (0, N)
            want = leaf.shape
        else:
            full = packed
            rows = (0, N) if proj == "gate_proj" else (N, 2 * N)
            want = (E, 2 * N, K)
        self._present(full, leaf, want)
        info = self.ckpt.info(full)
        if info.shape != want:
            raise self._fail(full, info.shape, leaf, want)
        return convert_packed_slices(self.ckpt, info, rows=rows, fmt=None)

    def leaf(self, name: str, leaf: Leaf) -> Any:
        if leaf.role is None:
            value = self.array(name, leaf)
        elif ".mlp.experts." in name:
            value = self.experts(name, leaf)
        else:
            value = self.weight(self.tensor_name(name), leaf)
        return jax.tree.map(jnp.asarray, value)


def load(
    directory: str | os.PathLike, *, cfg: HybridConfig | None = None
) -> tuple[HybridParams, LMHeadParams]:
    """``(params, head)`` from a Hugging Face directory (see the module docstring).

    ``cfg`` defaults to ``HybridConfig.from_hf(directory)``. The head's ``final_norm`` is the
    model's final norm, for the drafter's use.
    """
    directory = Path(directory)
    cfg = HybridConfig.from_hf(directory) if cfg is None else cfg
    V, H = cfg.vocab_size, cfg.hidden_size
    with SafetensorsCheckpoint(directory) as ckpt:
        reader = _Reader(ckpt, directory)
        named = {name: reader.leaf(name, leaf) for name, leaf in model_leaves(cfg)}
        embed = reader.text + "embed_tokens.weight"
        head_leaf = Leaf(name="lm_head", shape=(V, H), what="[vocab_size, hidden_size]", axes=())
        reader._present(embed, head_leaf)
        if ckpt.info(embed).shape != (V, H):
            raise reader._fail(embed, ckpt.info(embed).shape, head_leaf)
        embedding = read_embedding(ckpt, embed)
        lm_head = None
        if not cfg.tie_word_embeddings:
            if "lm_head.weight" not in ckpt:
                raise CheckpointError(
                    f"{directory}: tensor 'lm_head.weight' is missing and config.json sets "
                    "tie_word_embeddings: false (the LM head is its own tensor); refusing to "
                    "use the embedding as the head"
                )
            lm_head = jax.tree.map(jnp.asarray, reader.weight("lm_head.weight", head_leaf))
    params = from_named(named, cfg)
    head = from_arrays(
        cfg.lm_head_config(), lm_head=lm_head, embedding=embedding, final_norm=params.final_norm
    )
    return params, head
