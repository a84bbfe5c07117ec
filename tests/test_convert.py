"""Checkpoint conversion: synthetic HF checkpoints with the real tensor names in every layout,
converted and loaded, against params built directly from the same weights."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import checkpoint_fixtures as fx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtpjax import checkpoint
from mtpjax.checkpoint import CheckpointError, DrafterCheckpoint, convert, load_drafter
from mtpjax.checkpoint._formats import SourceFormat, convert_weight, detect
from mtpjax.checkpoint._safetensors_io import SafetensorsCheckpoint, SafetensorsFile
from mtpjax.config import DrafterConfig, FfnKind
from mtpjax.drafter import DrafterParams, drafter_forward
from mtpjax.head import LMHeadParams
from mtpjax.layers import AttentionParams, DenseFfnParams, MoeFfnParams
from mtpjax.layers.decoder import DecoderLayerParams
from mtpjax.weights import (
    Bf16Weight,
    Fp8BlockWeight,
    Nvfp4Weight,
    Projection,
    WeightFormat,
    dequantize,
    projection_format,
    quantize,
)

REPO = Path(__file__).resolve().parents[1]
# The module, not the function `mtpjax.checkpoint.convert` that the package exports.
convert_module = importlib.import_module("mtpjax.checkpoint._convert")
CLI = REPO / "scripts" / "convert_checkpoint.py"
# A script's own folder comes first on its sys.path: point the child at this checkout's mtpjax.
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


# --------------------------------------------------------------------------------------------
# Helpers.


def assert_bits_equal(got, want) -> None:
    """Same tree (weight types included), same dtypes and shapes, same bytes in every leaf."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        where = jax.tree_util.keystr(path)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.tobytes() == b.tobytes(), where


def forward_all(ckpt: DrafterCheckpoint, cfg: DrafterConfig):
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
    return [drafter_forward(m, ckpt.head, tokens, hidden, cfg=cfg) for m in ckpt.modules]


def assert_same_forward(got: DrafterCheckpoint, want: DrafterCheckpoint, cfg: DrafterConfig):
    # Loaded leaves are committed to the first device; placing the reference there too lets the
    # two forwards share one compilation.
    want = jax.device_put(want, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    for a, b in zip(forward_all(got, cfg), forward_all(want, cfg), strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def requantized(modules, head: LMHeadParams, cfg: DrafterConfig, precision: str, head_fmt):
    """The expected tree: every projection quantised directly (whole stacks at once) from the
    F32 value of the source weights, per projection_format; the embedding stays as is."""
    dense = cfg.ffn is FfnKind.DENSE

    def q(w, role):
        return quantize(dequantize(w), projection_format(role, precision, dense_ffn=dense))

    def ffn_q(f: DenseFfnParams, roles) -> DenseFfnParams:
        return DenseFfnParams(
            gate_proj=q(f.gate_proj, roles[0]),
            up_proj=q(f.up_proj, roles[1]),
            down_proj=q(f.down_proj, roles[2]),
        )

    out = []
    for m in modules:
        a, ffn = m.layer.attention, m.layer.ffn
        if isinstance(ffn, MoeFfnParams):
            three = (Projection.SHARED_EXPERT,) * 3
            new_ffn = MoeFfnParams(
                router=q(ffn.router, Projection.ROUTER),
                experts=ffn_q(ffn.experts, (Projection.EXPERTS,) * 3),
                shared_expert=ffn_q(ffn.shared_expert, three),
                shared_expert_gate=q(ffn.shared_expert_gate, Projection.SHARED_EXPERT_GATE),
            )
        else:
            new_ffn = ffn_q(ffn, (Projection.GATE_PROJ, Projection.UP_PROJ, Projection.DOWN_PROJ))
        layer = DecoderLayerParams(
            input_layernorm=m.layer.input_layernorm,
            attention=AttentionParams(
                q_proj=q(a.q_proj, Projection.Q_PROJ),
                k_proj=q(a.k_proj, Projection.K_PROJ),
                v_proj=q(a.v_proj, Projection.V_PROJ),
                o_proj=q(a.o_proj, Projection.O_PROJ),
                q_norm=a.q_norm,
                k_norm=a.k_norm,
            ),
            post_attention_layernorm=m.layer.post_attention_layernorm,
            ffn=new_ffn,
        )
        out.append(
            DrafterParams(
                fc=q(m.fc, Projection.FC),
                pre_fc_norm_embedding=m.pre_fc_norm_embedding,
                pre_fc_norm_hidden=m.pre_fc_norm_hidden,
                layer=layer,
                norm=m.norm,
            )
        )
    head_w = quantize(dequantize(head.weight), head_fmt)
    new_head = LMHeadParams(weight=head_w, embedding=head.embedding, final_norm=head.final_norm)
    return DrafterCheckpoint(modules=tuple(out), head=new_head)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CLI), *map(str, args), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=SUBPROCESS_ENV,
    )


def leftovers(parent: Path, out: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.")]


# --------------------------------------------------------------------------------------------
# Reader.


def test_reader_matches_the_safetensors_package(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "bf16": rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
        "f32": rng.standard_normal((3,)).astype(np.float32),
        "u8": rng.integers(0, 256, (4, 6), dtype=np.uint8),
        "e4m3": rng.standard_normal((8, 4)).astype(ml_dtypes.float8_e4m3fn),
        "scalar": np.array(2.5, np.float32),
    }
    fp8 = {"e4m3": tensors.pop("e4m3")}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file(fp8, str(tmp_path / "b.safetensors"))  # the package cannot read FP8 into numpy
    ref = load_file(str(tmp_path / "a.safetensors"))
    with SafetensorsFile(tmp_path / "b.safetensors") as f:
        got = f.read("e4m3")
        assert got.dtype == fp8["e4m3"].dtype and got.tobytes() == fp8["e4m3"].tobytes()
    with SafetensorsFile(tmp_path / "a.safetensors") as f:
        for name, want in tensors.items():
            got = f.read(name)
            assert (got.dtype, got.shape) == (want.dtype, want.shape)
            assert got.tobytes() == want.tobytes() == ref[name].tobytes()
        part = np.empty((2, 7), ml_dtypes.bfloat16)
        f.read_flat("bf16", 14, part)  # rows 2..3
        assert part.tobytes() == tensors["bf16"][2:4].tobytes()


def test_format_detection_from_each_tensors_own_dtype(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    nv = quantize(w, "nvfp4")
    blk = quantize(w, "fp8_block")
    row = quantize(w, "fp8")
    q_tensor = (w / 0.05).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    tensors = {
        "f32.weight": w,
        "bf16.weight": w.astype(ml_dtypes.bfloat16),
        **fx.weight_tensors("nv", nv),
        **fx.weight_tensors("blk", blk),
        "row.weight": np.asarray(row.q),
        "row.weight_scale": np.asarray(row.scale)[:, None],  # [N, 1] as compressed-tensors do
        "tensor.weight": q_tensor,
        "tensor.weight_scale": np.array(0.05, np.float32),
        "orphan.weight": q_tensor,
    }
    fx.write_checkpoint(tmp_path, {}, tensors, shards=1)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        formats = {
            n: detect(ckpt, f"{n}.weight").format
            for n in ("f32", "bf16", "nv", "blk", "row", "tensor")
        }
        assert formats == {
            "f32": SourceFormat.F32,
            "bf16": SourceFormat.BF16,
            "nv": SourceFormat.NVFP4,
            "blk": SourceFormat.FP8_BLOCK,
            "row": SourceFormat.FP8_ROW,
            "tensor": SourceFormat.FP8_TENSOR,
        }
        assert detect(ckpt, "nv.weight").shape == (32, 64)  # logical, not the packed [32, 32]
        assert_bits_equal(convert_weight(ckpt, detect(ckpt, "nv.weight"), None), nv)
        assert_bits_equal(convert_weight(ckpt, detect(ckpt, "blk.weight"), None), blk)
        assert_bits_equal(convert_weight(ckpt, detect(ckpt, "row.weight"), None), row)
        per_tensor = convert_weight(ckpt, detect(ckpt, "tensor.weight"), None)
        np.testing.assert_array_equal(
            np.asarray(dequantize(per_tensor)), q_tensor.astype(np.float32) * np.float32(0.05)
        )
        # F32 sources are quantised from their own values, not from a BF16 rounding of them.
        assert_bits_equal(convert_weight(ckpt, detect(ckpt, "f32.weight"), WeightFormat.NVFP4), nv)
        kept = convert_weight(ckpt, detect(ckpt, "f32.weight"), None)
        assert_bits_equal(kept, Bf16Weight(w=w.astype(ml_dtypes.bfloat16)))
        with pytest.raises(CheckpointError, match=r"orphan\.weight.*F8_E4M3 weight without"):
            detect(ckpt, "orphan.weight")


def test_chunked_requantisation_is_bit_identical_to_whole_matrices(tmp_path):
    """Large matrices are requantised in row chunks; every source/target pair must give exactly
    quantize(whole F32 matrix) (NVFP4's global scale included, ragged block-128 edges too)."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((300, 64)) * np.linspace(0.1, 3, 300)[:, None]).astype(np.float32)
    sources = {
        "f32": w,
        "bf16": w.astype(ml_dtypes.bfloat16),
        "nv": quantize(w, "nvfp4"),
        "blk": quantize(w, "fp8_block"),
        "row": quantize(w, "fp8"),
    }
    tensors = {}
    for name, value in sources.items():
        if isinstance(value, np.ndarray):
            tensors[f"{name}.weight"] = value
        else:
            tensors |= fx.weight_tensors(name, value)
    fx.write_checkpoint(tmp_path, {}, tensors, shards=1)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        for name, value in sources.items():
            f32 = value.astype(np.float32) if isinstance(value, np.ndarray) else dequantize(value)
            for fmt in WeightFormat:
                src = detect(ckpt, f"{name}.weight")
                got = convert_weight(ckpt, src, fmt, chunk_elements=64 * 50)
                kept = not isinstance(value, np.ndarray) and value.format is fmt
                assert_bits_equal(got, value if kept else quantize(f32, fmt))


# --------------------------------------------------------------------------------------------
# Qwen layouts: BF16 keep is bit-exact, and so is the drafter forward.


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    """A Qwen3.5 MoE checkpoint (per-expert layout) and the params it was written from."""
    directory = tmp_path_factory.mktemp("moe") / "src"
    return (directory, *fx.qwen_checkpoint(directory, moe=True))


@pytest.fixture(scope="module")
def dense_source(tmp_path_factory):
    """A Qwen3.5 dense checkpoint and the params it was written from."""
    directory = tmp_path_factory.mktemp("dense") / "src"
    return (directory, *fx.qwen_checkpoint(directory, moe=False))


def copy_source(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def check_keep(src: Path, out: Path, cfg, modules, head, *, forward: bool) -> DrafterCheckpoint:
    manifest = convert(src, out, precision="keep")
    assert manifest.runnable and manifest.unsupported_reason is None
    assert manifest.num_mtp_modules == cfg.num_mtp_modules
    # The target body (model...layers.*) is never read.
    assert not any(
        ".layers." in s for t in manifest.tensors for s in t.sources if s.startswith("model.")
    )
    got_cfg, got = load_drafter(out)
    assert got_cfg == cfg
    want = DrafterCheckpoint(modules=tuple(modules), head=head)
    assert_bits_equal(got, want)
    if forward:
        assert_same_forward(got, want, cfg)
    return got


@pytest.mark.parametrize("which", ["moe_source", "dense_source"])
def test_qwen3_5_keep_is_bit_exact(tmp_path, request, which):
    src, cfg, modules, head = request.getfixturevalue(which)
    check_keep(src, tmp_path / "out", cfg, modules, head, forward=which == "dense_source")


QWEN_CASES = {
    "qwen3_next_moe": dict(family="qwen3_next"),
    "qwen3_5_dense_tied": dict(moe=False, tied=True),
    "qwen3_5_moe_two_modules": dict(moe=True, num_mtp=2),
    "qwen3_5_dense_single_file": dict(moe=False, shards=1),
}


@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_qwen_layouts_keep_is_bit_exact(tmp_path, case):
    kw = QWEN_CASES[case]
    cfg, modules, head = fx.qwen_checkpoint(tmp_path / "src", **kw)
    got = check_keep(
        tmp_path / "src",
        tmp_path / "out",
        cfg,
        modules,
        head,
        forward=case == "qwen3_5_moe_two_modules",
    )
    manifest = checkpoint.read_manifest(tmp_path / "out")
    assert manifest.tied_embeddings == kw.get("tied", False)
    if kw.get("tied"):
        assert manifest.tensor("head.weight").sources == (
            "model.language_model.embed_tokens.weight",
        )
        # Kept at the embedding's BF16, the head is the embedding's bytes: stored once.
        record = manifest.tensor("head.weight")
        assert record.same_as == "head.embedding"
        table = manifest.tensor("head.embedding")
        assert table.same_as is None and record.group == table.group
        assert record.sha256["w"] == table.sha256["value"]
        np.testing.assert_array_equal(np.asarray(got.head.weight.w), np.asarray(got.head.embedding))
    assert sum(r.same_as is not None for r in manifest.tensors) == int(bool(kw.get("tied")))
    if cfg.num_mtp_modules > 1:
        # Qwen modules share fc and the norms; each has its own layer.
        a, b = got.modules
        np.testing.assert_array_equal(np.asarray(a.fc.w), np.asarray(b.fc.w))
        assert not np.array_equal(
            np.asarray(a.layer.attention.q_proj.w), np.asarray(b.layer.attention.q_proj.w)
        )


def test_packed_experts_equal_the_per_expert_layout(tmp_path, moe_source):
    per_expert, _, modules, head = moe_source
    tensors = fx.qwen_tensors(
        modules, head, text_prefix="model.language_model.", packed_experts=True
    )
    fx.write_checkpoint(tmp_path / "packed", fx.qwen3_5_config(moe=True), tensors)
    names = json.loads((tmp_path / "packed" / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    assert names["mtp.layers.0.mlp.experts.gate_up_proj"]
    assert not any(".experts.0." in n for n in names)
    for precision in ("keep", "nvfp4"):
        m1 = convert(per_expert, tmp_path / f"a_{precision}", precision=precision)
        m2 = convert(tmp_path / "packed", tmp_path / f"b_{precision}", precision=precision)
        assert (m1.layout, m2.layout) == ("qwen", "qwen_packed_experts")
        assert_bits_equal(
            load_drafter(tmp_path / f"b_{precision}")[1],
            load_drafter(tmp_path / f"a_{precision}")[1],
        )
    got = load_drafter(tmp_path / "b_keep")[1]
    assert_bits_equal(got, DrafterCheckpoint(modules=tuple(modules), head=head))


# --------------------------------------------------------------------------------------------
# Requantisation equals quantising the same weights directly.


@pytest.mark.parametrize(
    "which, precision, head_precision",
    [("moe_source", "nvfp4", "bf16"), ("dense_source", "nvfp4", None), ("moe_source", "fp8", None)],
)
def test_requantised_equals_direct_quantisation(
    tmp_path, request, which, precision, head_precision
):
    src, cfg, modules, head = request.getfixturevalue(which)
    manifest = convert(src, tmp_path / "out", precision=precision, head_precision=head_precision)
    head_fmt = WeightFormat(head_precision or precision)
    want = requantized(modules, head, cfg, precision, head_fmt)
    _, got = load_drafter(tmp_path / "out")
    assert_bits_equal(got, want)
    if precision == "nvfp4":
        assert_same_forward(got, want, cfg)
    formats = {t.name: t.format for t in manifest.tensors}
    if cfg.ffn is FfnKind.MOE:
        assert formats["mtp.layers.0.mlp.gate"] == "bf16"  # the router is always BF16
        assert formats["mtp.layers.0.mlp.experts.gate_proj"] == WeightFormat(precision).value
    else:  # the dense NVFP4 rule: fc/k/v stay BF16 so the drafter prefill can run
        assert formats["mtp.fc"] == formats["mtp.layers.0.self_attn.k_proj"] == "bf16"
        assert formats["mtp.layers.0.self_attn.q_proj"] == "nvfp4"
    assert formats["head.weight"] == head_fmt.value


# --------------------------------------------------------------------------------------------
# Native quantised tensors are kept bit for bit.


def test_native_nvfp4_kept_bit_exact_through_orbax(tmp_path, moe_source):
    _, cfg, bf16_modules, bf16_head = moe_source
    native = requantized(bf16_modules, bf16_head, cfg, "nvfp4", WeightFormat.BF16)
    modules, head = native.modules, native.head
    assert isinstance(modules[0].layer.ffn.experts.gate_proj, Nvfp4Weight)
    tensors = fx.qwen_tensors(modules, head, text_prefix="model.language_model.")
    assert tensors["mtp.fc.weight"].dtype == np.uint8 and "mtp.fc.input_scale" in tensors
    fx.write_checkpoint(tmp_path / "src", fx.qwen3_5_config(moe=True), tensors)
    manifest = convert(tmp_path / "src", tmp_path / "out", precision="keep")
    record = manifest.tensor("mtp.layers.0.mlp.experts.gate_proj")
    assert (record.source_format, record.format) == ("nvfp4", "nvfp4")
    assert record.leaves["packed"] == ("uint8", (fx.E, fx.I_EXPERT, fx.H // 2))
    assert record.leaves["scale"] == ("float8_e4m3fn", (fx.E, fx.I_EXPERT, fx.H // 16))
    assert record.leaves["scale_2"] == ("float32", (fx.E,))
    _, got = load_drafter(tmp_path / "out")
    assert_bits_equal(got, native)
    assert_same_forward(got, native, cfg)


def test_native_fp8_block_kept_bit_exact(tmp_path):
    cfg = DrafterConfig.from_hf_config(fx.qwen3_5_config(moe=False))
    bf16 = fx.qwen_modules(cfg)[0]

    def blk(w):
        return quantize(dequantize(w), "fp8_block")

    a, ffn = bf16.layer.attention, bf16.layer.ffn
    module = DrafterParams(
        fc=blk(bf16.fc),
        pre_fc_norm_embedding=bf16.pre_fc_norm_embedding,
        pre_fc_norm_hidden=bf16.pre_fc_norm_hidden,
        layer=DecoderLayerParams(
            input_layernorm=bf16.layer.input_layernorm,
            attention=AttentionParams(
                q_proj=blk(a.q_proj),
                k_proj=blk(a.k_proj),
                v_proj=blk(a.v_proj),
                o_proj=blk(a.o_proj),
                q_norm=a.q_norm,
                k_norm=a.k_norm,
            ),
            post_attention_layernorm=bf16.layer.post_attention_layernorm,
            ffn=DenseFfnParams(
                gate_proj=blk(ffn.gate_proj), up_proj=blk(ffn.up_proj), down_proj=blk(ffn.down_proj)
            ),
        ),
        norm=bf16.norm,
    )
    head = fx.random_head(cfg)
    head = LMHeadParams(
        weight=blk(head.weight), embedding=head.embedding, final_norm=head.final_norm
    )
    tensors = fx.qwen_tensors([module], head, text_prefix="model.language_model.")
    assert tensors["mtp.fc.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert "mtp.fc.weight_scale_inv" in tensors
    fx.write_checkpoint(tmp_path / "src", fx.qwen3_5_config(moe=False), tensors)
    manifest = convert(tmp_path / "src", tmp_path / "out", precision="keep")
    assert manifest.tensor("mtp.fc").format == "fp8_block"
    assert manifest.tensor("head.weight").format == "fp8_block"
    _, got = load_drafter(tmp_path / "out")
    want = DrafterCheckpoint(modules=(module,), head=head)
    assert_bits_equal(got, want)
    assert isinstance(got.modules[0].fc, Fp8BlockWeight)


def test_nvfp4_quant_config_with_bf16_mtp_tensors(tmp_path, moe_source):
    """The global config says NVFP4, but the MTP tensors are BF16: formats come per tensor."""
    _, _, modules, head = moe_source
    text = "model.language_model."
    tensors = fx.qwen_tensors(modules, head, text_prefix=text)
    tensors |= fx.nvfp4_body(text, np.random.default_rng(0))
    fx.write_checkpoint(
        tmp_path / "src",
        fx.qwen3_5_config(moe=True),
        tensors,
        quant_config=fx.NVFP4_QUANT_CONFIG,
    )
    names = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    assert "model.language_model.layers.0.mlp.down_proj.weight_scale_2" in names  # NVFP4 body
    manifest = convert(tmp_path / "src", tmp_path / "out", precision="keep")
    assert manifest.quant_config == fx.NVFP4_QUANT_CONFIG
    assert {t.source_format for t in manifest.tensors if t.kind == "weight"} == {"bf16"}
    assert {t.format for t in manifest.tensors if t.kind == "weight"} == {"bf16"}
    _, got = load_drafter(tmp_path / "out")
    assert_bits_equal(got, DrafterCheckpoint(modules=tuple(modules), head=head))


# --------------------------------------------------------------------------------------------
# DeepSeek-V3.2: a named tensor tree, reported as not runnable (GLM-4.5 and MiMo run: below).


def _generic_source(tmp_path: Path, family: str, num_mtp: int):
    rng = np.random.default_rng(5)
    if family.startswith("deepseek"):
        config, layers = fx.deepseek_v3_config(num_mtp=num_mtp), 3
        if family == "deepseek_v32":  # DeepSeek-V3's layout, with DSA sparse attention
            config |= dict(model_type="deepseek_v32", index_topk=2048)
        prefixes = [f"model.layers.{layers + i}." for i in range(num_mtp)]
        make = fx.deepseek_module_tensors
    elif family == "glm4_moe":
        config, layers = fx.glm4_moe_config(num_mtp=num_mtp), 2
        prefixes = [f"model.layers.{layers + i}." for i in range(num_mtp)]
        make = fx.glm_module_tensors
    else:
        config = fx.mimo_config(num_mtp=num_mtp)
        prefixes = [f"model.mtp_layers.{i}." for i in range(num_mtp)]
        make = fx.mimo_module_tensors
    tensors = fx.target_tensors(rng, layers=2)
    for p in prefixes:
        tensors |= make(p, rng)
    fx.write_checkpoint(tmp_path / "src", config, tensors)
    return config, prefixes, tensors


def test_deepseek_v32_converts_to_a_named_tree(tmp_path):
    config, prefixes, tensors = _generic_source(tmp_path, "deepseek_v32", 2)
    cfg = DrafterConfig.from_hf_config(config)
    manifest = convert(tmp_path / "src", tmp_path / "out", precision="keep")
    assert not manifest.runnable and manifest.unsupported_reason == cfg.unsupported_reason
    assert manifest.mtp_prefixes == tuple(prefixes)
    with pytest.raises(CheckpointError, match="allow_unrunnable") as err:
        load_drafter(tmp_path / "out")
    assert cfg.unsupported_reason in str(err.value)
    _, named = load_drafter(tmp_path / "out", allow_unrunnable=True)
    for p in prefixes:
        fc = p + "eh_proj"
        assert isinstance(named[fc], Fp8BlockWeight)
        np.testing.assert_array_equal(
            np.asarray(named[fc].q).view(np.uint8), tensors[fc + ".weight"].view(np.uint8)
        )
        np.testing.assert_array_equal(
            np.asarray(named[fc].scale_inv), tensors[fc + ".weight_scale_inv"]
        )
        assert (p + "self_attn.kv_a_proj_with_mqa") in named
        assert (p + "eh_proj.weight_scale_inv") not in named  # folded into the weight
        experts = named[p + "mlp.experts.gate_proj"]
        assert experts.shape == (fx.E, fx.I_EXPERT, fx.H)
        base = p + "mlp.experts.2.gate_proj.weight"  # expert 2 of the stack is the source's
        np.testing.assert_array_equal(
            np.asarray(experts.q[2]).view(np.uint8), tensors[base].view(np.uint8)
        )
        np.testing.assert_array_equal(
            np.asarray(experts.scale_inv[2]), tensors[base + "_scale_inv"]
        )
        bias = named[p + "mlp.gate.e_score_correction_bias"]
        np.testing.assert_array_equal(
            np.asarray(bias), tensors[p + "mlp.gate.e_score_correction_bias"]
        )
        assert p + "shared_head.head" in named
    assert named["head.embedding"].dtype == jnp.bfloat16
    # Requantising a non-runnable family works too (MLA projections count as plain ones).
    convert(tmp_path / "src", tmp_path / "bf16", precision="bf16")
    _, requant = load_drafter(tmp_path / "bf16", allow_unrunnable=True)
    fc = prefixes[0] + "eh_proj"
    assert isinstance(requant[fc], Bf16Weight)
    assert_bits_equal(requant[fc], quantize(dequantize(named[fc]), "bf16"))


def _bits(a) -> bytes:
    return np.asarray(a).view(np.uint16).tobytes()


@pytest.mark.parametrize("family, num_mtp", [("glm4_moe", 2), ("mimo", 1)])
def test_glm_and_mimo_load_as_runnable_drafters(tmp_path, family, num_mtp):
    """Each source tensor lands in its drafter field, module by module (GLM's NextN names and
    MiMo's, the reversed input order's fc included)."""
    _, prefixes, tensors = _generic_source(tmp_path, family, num_mtp)
    manifest = convert(tmp_path / "src", tmp_path / "out", precision="keep")
    assert manifest.runnable and manifest.unsupported_reason is None
    assert manifest.mtp_prefixes == tuple(prefixes)
    cfg, ckpt = load_drafter(tmp_path / "out")
    assert ckpt.num_modules == num_mtp == cfg.num_mtp_modules
    mimo = family == "mimo"
    names = (
        ("fc", "input_proj" if mimo else "eh_proj"),
        ("pre_fc_norm_embedding", "token_layernorm" if mimo else "enorm"),
        ("pre_fc_norm_hidden", "hidden_layernorm" if mimo else "hnorm"),
        ("norm", "final_layernorm" if mimo else "shared_head.norm"),
    )
    for p, module in zip(prefixes, ckpt.modules):
        for field, source in names:
            value = getattr(module, field)
            got = value.w if field == "fc" else value
            assert _bits(got) == tensors[p + source + ".weight"].view(np.uint16).tobytes()
        attn = module.layer.attention
        for proj in "qkv":
            bias = getattr(attn, f"{proj}_bias")
            assert (
                _bits(bias) == tensors[f"{p}self_attn.{proj}_proj.bias"].view(np.uint16).tobytes()
            )
        ffn = module.layer.ffn
        if mimo:
            assert (
                _bits(ffn.up_proj.w) == tensors[p + "mlp.up_proj.weight"].view(np.uint16).tobytes()
            )
        else:
            np.testing.assert_array_equal(
                np.asarray(ffn.score_correction_bias),
                tensors[p + "mlp.gate.e_score_correction_bias"],
            )
            shared = tensors[p + "mlp.shared_experts.down_proj.weight"]
            assert _bits(ffn.shared_expert.down_proj.w) == shared.view(np.uint16).tobytes()
            assert ffn.shared_expert_gate is None


# --------------------------------------------------------------------------------------------
# Bad input.


def test_minimax_without_mtp_weights_names_what_is_missing(tmp_path):
    rng = np.random.default_rng(0)
    fx.write_checkpoint(tmp_path / "src", fx.minimax_m2_config(), fx.target_tensors(rng))
    with pytest.raises(CheckpointError) as err:
        convert(tmp_path / "src", tmp_path / "out")
    msg = str(err.value)
    assert msg.startswith(
        "config.json declares 3 MTP modules (num_mtp_modules) but model.safetensors.index.json has no tensor under 'mtp.layers.0...'"
    )
    assert "'model.layers.2...'" in msg and msg.endswith("this checkpoint ships no MTP weights")
    assert not (tmp_path / "out").exists()
    proc = run_cli(tmp_path / "src", tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "ships no MTP weights" in proc.stderr


def _qwen_source(tmp_path: Path, dense_source) -> tuple[Path, dict]:
    """A private copy of the dense source (these tests damage it) and its index."""
    copy_source(dense_source[0], tmp_path)
    index_file = tmp_path / "src" / "model.safetensors.index.json"
    return index_file, json.loads(index_file.read_text())


def _rewrite_shard(directory: Path, index: dict, name: str, new: np.ndarray | None) -> None:
    """Replaces (or with None, drops) one tensor in its shard, keeping the index as it is."""
    shard = directory / index["weight_map"][name]
    tensors = {k: v for k, v in _read_all(shard).items() if k != name}
    if new is not None:
        tensors[name] = new
    save_file(tensors, str(shard))


def _read_all(path: Path) -> dict[str, np.ndarray]:
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}


def test_wrong_shape_names_tensor_expected_and_found(tmp_path, dense_source):
    _, index = _qwen_source(tmp_path, dense_source)
    name = "mtp.layers.0.self_attn.k_proj.weight"
    _rewrite_shard(tmp_path / "src", index, name, np.zeros((24, fx.H), ml_dtypes.bfloat16))
    with pytest.raises(CheckpointError) as err:
        convert(tmp_path / "src", tmp_path / "out")
    msg = str(err.value)
    assert name in msg and "expected shape [32, 64]" in msg and "found [24, 64]" in msg
    assert "num_key_value_heads * head_dim" in msg
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path, tmp_path / "out")


def test_truncated_and_corrupt_shards_are_named(tmp_path, dense_source):
    _, index = _qwen_source(tmp_path, dense_source)
    shard = tmp_path / "src" / index["weight_map"]["mtp.fc.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated safetensors file: tensor"):
        convert(tmp_path / "src", tmp_path / "out")
    shard.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt safetensors header"):
        convert(tmp_path / "src", tmp_path / "out")
    shard.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: not a safetensors file"):
        convert(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path, tmp_path / "out")
    proc = run_cli(tmp_path / "src", tmp_path / "out")
    assert proc.returncode == 1 and shard.name in proc.stderr and "Traceback" not in proc.stderr


def test_tensor_listed_in_the_index_but_missing_from_its_shard(tmp_path, dense_source):
    index_file, index = _qwen_source(tmp_path, dense_source)
    name = "mtp.layers.0.self_attn.v_proj.weight"
    _rewrite_shard(tmp_path / "src", index, name, None)
    with pytest.raises(CheckpointError) as err:
        convert(tmp_path / "src", tmp_path / "out")
    assert (
        f"maps {name!r} to {index['weight_map'][name]!r}, but that file has no such tensor"
        in str(err.value)
    )
    # And a tensor absent from the index altogether.
    del index["weight_map"][name]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"lacks 1 tensor the conversion needs: '{name}'"):
        convert(tmp_path / "src", tmp_path / "out")


def test_config_declaring_more_modules_than_the_weights_hold(tmp_path, dense_source):
    _qwen_source(tmp_path, dense_source)
    config_file = tmp_path / "src" / "config.json"
    config = json.loads(config_file.read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 2
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        convert(tmp_path / "src", tmp_path / "out")
    assert str(err.value) == (
        "config.json declares 2 MTP modules (text_config.mtp_num_hidden_layers) but "
        "model.safetensors.index.json has no tensor under 'mtp.layers.1...' (MTP module 1)"
    )


def test_existing_out_dir_is_refused_or_replaced_atomically(tmp_path, monkeypatch, dense_source):
    _qwen_source(tmp_path, dense_source)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        convert(tmp_path / "src", out)
    assert (out / "keep.txt").read_text() == "mine"
    proc = run_cli(tmp_path / "src", out)
    assert proc.returncode == 1 and "--force" in proc.stderr and proc.stderr.count("\n") == 1
    assert (out / "keep.txt").read_text() == "mine"

    # A conversion failing while writing leaves the old directory untouched and no temporaries.
    def broken_save(directory, tree):
        directory.mkdir()
        (directory / "partial").write_text("x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert_module, "_save_params", broken_save)
    with pytest.raises(OSError, match="No space left"):
        convert(tmp_path / "src", out, force=True)
    assert (out / "keep.txt").read_text() == "mine" and not leftovers(tmp_path, out)
    with pytest.raises(OSError):
        convert(tmp_path / "src", tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists() and not leftovers(tmp_path, tmp_path / "fresh")
    monkeypatch.undo()

    proc = run_cli(tmp_path / "src", out, "--force", "--precision", "fp8")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "keep.txt").exists() and (out / "manifest.json").is_file()
    assert checkpoint.read_manifest(out).precision == "fp8"
    assert not leftovers(tmp_path, out)
    with pytest.raises(CheckpointError, match="holds the source checkpoint"):
        convert(tmp_path / "src", tmp_path, force=True)


def test_bad_precision_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match="keep, bf16, fp8, fp8_block, nvfp4"):
        convert(tmp_path, tmp_path / "out", precision="int4")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        convert(tmp_path, tmp_path / "out")


# --------------------------------------------------------------------------------------------
# Loading onto shardings.


def test_load_onto_a_sharding(tmp_path, moe_source, monkeypatch):
    # Small orbax groups: the tensors are spread over several checkpoints under params/.
    monkeypatch.setattr(convert_module, "GROUP_BYTES", 16 * 1024)
    manifest = convert(moe_source[0], tmp_path / "out")
    groups = {t.group for t in manifest.tensors}
    assert len(groups) > 3 and sorted(
        p.name for p in (tmp_path / "out" / "params").iterdir()
    ) == sorted(groups)
    devices = np.array(jax.devices()[:4])  # 4 experts, 4 ways
    mesh = jax.sharding.Mesh(devices, ("tp",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    _, ckpt = load_drafter(tmp_path / "out", sharding=replicated)
    assert all(leaf.sharding == replicated for leaf in jax.tree.leaves(ckpt))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp"))
    seen = []

    def by_path(path: str):
        seen.append(path)
        return (
            rows if path in ("head.embedding", "modules.0.layer.ffn.experts.gate_proj.w") else None
        )

    _, ckpt = load_drafter(tmp_path / "out", sharding=by_path)
    _, _, modules, head = moe_source
    assert_bits_equal(ckpt, DrafterCheckpoint(modules=tuple(modules), head=head))
    assert "modules.0.layer.attention.q_proj.w" in seen
    assert ckpt.head.embedding.sharding == rows
    assert ckpt.modules[0].layer.ffn.experts.gate_proj.w.sharding == rows
    assert ckpt.modules[0].fc.w.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


# --------------------------------------------------------------------------------------------
# Memory: the target body is skipped, never read.

_MEASURE = textwrap.dedent(
    """
    import json, sys
    import orbax.checkpoint  # imported before the baseline: the write needs it anyway
    from mtpjax.checkpoint import convert

    def status_kib(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    base = status_kib("VmRSS")
    convert(sys.argv[1], sys.argv[2], precision=sys.argv[3], progress=False)
    # VmHWM is this process's own high-water mark (ru_maxrss can carry the parent's across exec).
    print(json.dumps({"base_kib": base, "peak_kib": status_kib("VmHWM")}))
    """
)


def test_peak_memory_stays_far_below_the_source_size(tmp_path, moe_source):
    _, _, modules, head = moe_source
    tensors = fx.qwen_tensors(modules, head, text_prefix="model.language_model.")
    # 12 body tensors of 32 MiB spread over the same shards as the MTP module.
    body = {
        f"model.language_model.layers.{j}.mlp.experts.{k}.down_proj.weight": fx.Filler(
            "BF16", (4096, 4096)
        )
        for j in range(4)
        for k in range(3)
    }
    fx.write_checkpoint(tmp_path / "src", fx.qwen3_5_config(moe=True), tensors, big=body)
    source_bytes = sum(f.stat().st_size for f in (tmp_path / "src").glob("*.safetensors"))
    assert source_bytes > 384 * 2**20
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "src"), str(tmp_path / "out"), "keep"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = (figures["peak_kib"] - figures["base_kib"]) * 1024
    kept = sum(
        np.prod(s) * np.dtype(d).itemsize
        for t in checkpoint.read_manifest(tmp_path / "out").tensors
        for d, s in t.leaves.values()
    )
    print(
        f"source {source_bytes / 2**20:.0f} MiB, kept {kept / 2**20:.2f} MiB, peak RSS growth {growth / 2**20:.1f} MiB"
    )
    assert growth < min(kept + 32 * 2**20, 0.1 * source_bytes), figures
