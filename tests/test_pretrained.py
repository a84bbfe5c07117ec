"""A Qwen3.5-0.8B-shaped Hugging Face directory end to end on the CPU: ``demo --model DIR`` and
``mtpjax generate DIR`` (with and without speculation) load the hybrid target, convert the MTP
head once into the cache and reuse it, and greedy speculation equals plain greedy decoding.

The checkpoint has Qwen3.5-0.8B's layer widths (hidden 1024, full attention 8 query / 2 KV heads
of 256, Gated DeltaNet 16 key / 16 value heads of 128, FFN 3584, tied embeddings, one MTP layer)
at 4 layers (3 GDN, 1 full attention) of random BF16 weights, written once per session. Its
vocabulary is 16384 rows, not the model's 248320: the shipped tokenizer has 4096 ids, and the
full table (half a gigabyte in BF16, converted into the drafter, saved and widened on every CPU
call) would double the file's time without reaching any other code.
Every run uses one prompt, one k and one token count, so the speculative and the plain loop each
compile once for the whole file.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from checkpoint_fixtures import Filler, write_raw

import mtpjax.pretrained
from mtpjax import demo
from mtpjax.__main__ import main

LIN, FULL = "linear_attention", "full_attention"
V, H, I = 16384, 1024, 3584  # vocab, hidden, FFN width
NQ, NKV, D = 8, 2, 256  # full attention: query / KV heads, head dim
HK, HV, DK, DV, CONV = 16, 16, 128, 128, 4  # GDN: key / value heads and dims, conv kernel
LAYER_TYPES = [LIN, LIN, LIN, FULL]
PROMPT = "def mean(data):\n    return sum(data) / len(data)\n"
NEW_TOKENS, K = 2, 2


def config() -> dict:
    """Qwen3.5-0.8B's config.json (``Qwen3_5ForConditionalGeneration``) at 4 layers."""
    text = dict(
        model_type="qwen3_5_text",
        hidden_size=H,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        full_attention_interval=4,
        vocab_size=V,
        max_position_embeddings=262144,
        intermediate_size=I,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        num_attention_heads=NQ,
        num_key_value_heads=NKV,
        head_dim=D,
        attn_output_gate=True,
        attention_bias=False,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=CONV,
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10_000_000,
            partial_rotary_factor=0.25,
            mrope_section=[11, 11, 10],
            mrope_interleaved=True,
        ),
        tie_word_embeddings=True,
        eos_token_id=V - 1,
        dtype="bfloat16",
    )
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        tie_word_embeddings=True,
        text_config=text,
    )


def shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint by its Hugging Face name."""
    out: dict[str, tuple[int, ...]] = {
        "model.language_model.embed_tokens.weight": (V, H),
        "model.language_model.norm.weight": (H,),
    }

    def full_attention(base: str) -> None:
        out.update({
            f"{base}.self_attn.q_proj.weight": (2 * NQ * D, H),  # queries and their gates
            f"{base}.self_attn.k_proj.weight": (NKV * D, H),
            f"{base}.self_attn.v_proj.weight": (NKV * D, H),
            f"{base}.self_attn.o_proj.weight": (H, NQ * D),
            f"{base}.self_attn.q_norm.weight": (D,),
            f"{base}.self_attn.k_norm.weight": (D,),
        })  # fmt: skip

    def decoder_rest(base: str) -> None:
        out.update({
            f"{base}.input_layernorm.weight": (H,),
            f"{base}.post_attention_layernorm.weight": (H,),
            f"{base}.mlp.gate_proj.weight": (I, H),
            f"{base}.mlp.up_proj.weight": (I, H),
            f"{base}.mlp.down_proj.weight": (H, I),
        })  # fmt: skip

    conv = 2 * HK * DK + HV * DV
    for i, kind in enumerate(LAYER_TYPES):
        base = f"model.language_model.layers.{i}"
        decoder_rest(base)
        if kind == FULL:
            full_attention(base)
            continue
        gdn = f"{base}.linear_attn"
        out.update({
            f"{gdn}.in_proj_qkv.weight": (conv, H),
            f"{gdn}.in_proj_z.weight": (HV * DV, H),
            f"{gdn}.in_proj_b.weight": (HV, H),
            f"{gdn}.in_proj_a.weight": (HV, H),
            f"{gdn}.conv1d.weight": (conv, 1, CONV),
            f"{gdn}.norm.weight": (DV,),
            f"{gdn}.out_proj.weight": (H, HV * DV),
            f"{gdn}.A_log": (HV,),
            f"{gdn}.dt_bias": (HV,),
        })  # fmt: skip
    out.update({
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
    })  # fmt: skip
    decoder_rest("mtp.layers.0")
    full_attention("mtp.layers.0")
    return out


def random_bf16(block: np.ndarray, shape: tuple[int, ...]) -> Filler:
    """BF16 of magnitude in [2^-6, 2^-5) with random signs and mantissas: ``block`` (random
    bits of a prime length, so no two rows of a tensor repeat each other) repeated over
    ``shape``, written in pieces; seconds for the whole checkpoint, where drawing 357M values
    would take minutes."""
    return Filler("BF16", shape, pattern=block.astype("<u2").tobytes())


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory):
    """The checkpoint directory (with the shipped pair's tokenizer, 4096 ids)."""
    path = tmp_path_factory.mktemp("Qwen3.5-0.8B-4-layers")
    (path / "config.json").write_text(json.dumps(config(), indent=1))
    bits = np.frombuffer(np.random.default_rng(0).bytes(2 * 1_000_003), np.uint16)
    block = (bits & 0x807F) | 0x3C80  # sign and mantissa random, biased exponent 121
    write_raw(path / "model.safetensors", {n: random_bf16(block, s) for n, s in shapes().items()})
    shutil.copy(demo.ASSET_DIR / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mtpjax-cache")


def run_cli(argv: list[str]) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(argv)
    return status, stdout.getvalue()


COMMON = ["--max-new-tokens", str(NEW_TOKENS), "--num-drafts", str(K), "--json"]


@pytest.fixture(scope="module")
def demo_run(qwen3_5_dir, cache_dir):
    """``demo --model DIR --json`` (the first run: it converts the MTP head)."""
    argv = ["demo", "--model", str(qwen3_5_dir), "--prompt", PROMPT, *COMMON]
    status, out = run_cli([*argv, "--cache-dir", str(cache_dir)])
    assert status == 0
    return json.loads(out)


def test_demo_on_the_directory_is_identical_to_the_target_alone(demo_run, qwen3_5_dir, cache_dir):
    assert demo_run["model"] == str(qwen3_5_dir)
    assert demo_run["identical"] is True
    assert demo_run["speculative_tokens"] == demo_run["baseline_tokens"] == NEW_TOKENS
    assert len(demo_run["per_position_acceptance"]) == K
    assert 1.0 <= demo_run["mean_acceptance_length"] <= K + 1
    assert demo_run["checkpoint_reused"] is False
    entries = [p.name for p in cache_dir.iterdir()]
    key = mtpjax.pretrained.content_key(qwen3_5_dir)
    assert entries == [Path(demo_run["checkpoint"]).name]
    assert entries[0].startswith(f"{qwen3_5_dir.name}-bf16-{key}-v")


@pytest.fixture(scope="module")
def generate_runs(demo_run, qwen3_5_dir, cache_dir):
    """``mtpjax generate DIR`` with and without speculation, after the demo, with the converter
    made to fail: the first needs the cached drafter, the second no drafter at all."""

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached drafter was converted again")

    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mtpjax.pretrained, "convert", no_conversion)
        for mode in ([], ["--no-speculation"]):
            argv = ["generate", str(qwen3_5_dir), "--prompt", PROMPT, *COMMON, *mode]
            status, out = run_cli([*argv, "--precision", "bf16", "--cache-dir", str(cache_dir)])
            assert status == 0
            runs[bool(mode)] = json.loads(out)
    return runs[False], runs[True]


def test_generate_with_and_without_speculation_agree(generate_runs, demo_run):
    spec, plain = generate_runs
    assert spec["speculation"] is True and plain["speculation"] is False
    assert spec["tokens"] == plain["tokens"] and spec["num_tokens"] == NEW_TOKENS
    assert spec["text"] == plain["text"] == demo_run["speculative_text"]
    assert len(spec["per_position_acceptance"]) == K
    assert spec["target_forwards"] <= plain["target_forwards"] == NEW_TOKENS - 1
    assert plain["mean_acceptance_length"] is None and plain["checkpoint"] is None


def test_a_second_run_reuses_the_converted_drafter(generate_runs, demo_run, cache_dir):
    spec, _ = generate_runs
    assert spec["checkpoint_reused"] is True
    assert spec["checkpoint"] == demo_run["checkpoint"]
    assert len(list(cache_dir.iterdir())) == 1
