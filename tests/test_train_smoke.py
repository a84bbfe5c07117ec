"""scripts/train_tiny_pair.py end to end in --smoke mode: a few CPU steps into a directory in the
Qwen3.5 layout that the library then loads as a hybrid target + MTP pair; the gradient of the
chunked delta rule the training runs through."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from mtpjax import drafter as drafter_lib
from mtpjax import hybrid
from mtpjax.checkpoint import convert, load_drafter
from mtpjax.config import DrafterConfig, FfnKind
from mtpjax.head import lm_head

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny_pair.py"


@functools.cache
def _load_script():
    spec = importlib.util.spec_from_file_location("train_tiny_pair", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_heldout_split_is_fixed_by_path():
    script = _load_script()
    paths = [f"pkg{i}/module_{i}.py" for i in range(2000)]
    held = [p for p in paths if script.is_heldout(p)]
    assert 0.02 < len(held) / len(paths) < 0.06
    assert held == [p for p in paths if script.is_heldout(p)]  # a pure function of the path


def test_lr_schedule_warms_up_then_decays():
    script = _load_script()
    lrs = [script.lr_at(s, total=100, warmup=10, peak=1.0) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert abs(lrs[-1] - 0.1) < 1e-3


def _pair_names(cfg: hybrid.HybridConfig, dcfg: DrafterConfig) -> set[str]:
    """Every tensor name of a pair in the Qwen3.5 text layout (tied: no lm_head.weight)."""
    bare = ("A_log", "dt_bias")
    names = {"model.embed_tokens.weight"}
    names |= {
        f"model.{n}" + ("" if n.endswith(bare) else ".weight") for n, _ in hybrid.model_leaves(cfg)
    }
    return names | {f"{n}.weight" for n, _ in drafter_lib.module_leaves(dcfg, 0)}


def test_smoke_run_writes_a_loadable_pair(tmp_path):
    script = _load_script()
    out = tmp_path / "pair"
    argv = ["--smoke", "--out", str(out), "--steps", "6", "--max-files", "16", "--lr", "1e-2"]
    assert script.main(argv) == 0

    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "heldout_files.txt",
        "training_log.json",
        "loss_curve.png",
    ):
        assert (out / name).is_file(), name

    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and raw["architectures"] == ["Qwen3_5ForCausalLM"]
    assert raw["mtp_num_hidden_layers"] == 1 and raw["tie_word_embeddings"] is True
    assert raw["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert raw["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    cfg = hybrid.HybridConfig.from_hf(out)
    dcfg = DrafterConfig.from_hf_config(out)
    assert dcfg.ffn is FfnKind.DENSE and dcfg.runnable and dcfg.attn_output_gate
    with safe_open(str(out / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"BF16"}
    assert names == _pair_names(cfg, dcfg)

    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 6 and len(log["train_curve"]) == 6
    curve = log["train_curve"]
    for r in curve:  # the gradient through the chunked delta rule stays finite
        assert np.isfinite([r["main"], r["mtp"], r["mtp2"], r["grad_norm"]]).all(), r
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.05  # it learns
    assert log["heldout_curve"] and log["corpus"]["heldout_files"] >= 1
    assert log["programs"]["train_step"]["flops"] > 0
    held = (out / "heldout_files.txt").read_text().split()
    assert held and all(script.is_heldout(p) for p in held)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == raw["vocab_size"]

    params, head = hybrid.load(out, cfg=cfg)
    convert(out, tmp_path / "mtp", precision="bf16", progress=False)
    dcfg2, ckpt = load_drafter(tmp_path / "mtp")
    assert dcfg2 == dcfg
    ids = jnp.asarray([tok.encode(text).ids], jnp.int32)
    hidden, _ = hybrid.forward(params, head, ids, cfg=cfg)
    logits = lm_head(head, hidden, cfg=cfg.lm_head_config())
    out_d = drafter_lib.drafter_forward(ckpt.modules[0], head, ids[:, 1:], hidden[:, :-1], cfg=dcfg)
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert out_d.logits.shape == (1, ids.shape[1] - 1, cfg.vocab_size)
    assert bool(jnp.all(jnp.isfinite(logits))) and bool(jnp.all(jnp.isfinite(out_d.logits)))
    jax.clear_caches()


def test_chunked_delta_rule_gradient_is_the_recurrent_one():
    """Training differentiates the chunked form (prefill's); its gradient over several chunks,
    a padded tail and a nonzero start state equals the one-position-at-a-time recurrence's."""
    rng = np.random.default_rng(0)
    B, T, H, dk, dv = 2, 21, 3, 8, 4
    q, k = (hybrid.l2_normalize(rng.standard_normal((B, T, H, dk))) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 1.0, (B, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((B, H, dk, dv)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, H, dv)), jnp.float32)

    def loss(rule, *args):
        o, s = rule(*args)
        return jnp.sum(o * w) + jnp.sum(s[..., -1, :, :, :] if s.ndim == 5 else s)

    def chunked(*a):
        return hybrid.chunked_delta_rule(*a, chunk_size=8)

    args = (q, k, v, g, beta, s0)
    want = jax.grad(functools.partial(loss, hybrid.recurrent_delta_rule), argnums=range(6))(*args)
    got = jax.grad(functools.partial(loss, chunked), argnums=range(6))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4, err_msg=name)


ASSET = Path(__file__).resolve().parents[1] / "mtpjax" / "assets" / "tiny_pair"


def test_shipped_pair_is_small_and_its_drafter_agrees_with_the_target(tmp_path):
    if not (ASSET / "model.safetensors").is_file():
        pytest.skip("the shipped tiny pair is not in this checkout")
    size = sum((ASSET / n).stat().st_size for n in ("model.safetensors", "tokenizer.json"))
    assert size <= 32e6
    raw = json.loads((ASSET / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text"
    assert {"linear_attention", "full_attention"} <= set(raw["layer_types"])
    cfg = hybrid.HybridConfig.from_hf(ASSET)
    params, head = hybrid.load(ASSET, cfg=cfg)
    convert(ASSET, tmp_path / "mtp", precision="bf16", progress=False)
    dcfg, ckpt = load_drafter(tmp_path / "mtp")
    assert dcfg.ffn is FfnKind.DENSE and dcfg.runnable

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    held = (ASSET / "heldout_files.txt").read_text().split()
    assert "statistics.py" in held  # the split is a pure function of the path
    source = Path(_load_script().stdlib_root()) / "statistics.py"
    ids = tok.encode(source.read_text(encoding="utf-8")).ids
    ids = jnp.asarray([ids[len(ids) // 2 : len(ids) // 2 + 130]], jnp.int32)
    hidden, _ = hybrid.forward(params, head, ids[:, :-2], cfg=cfg)
    target_next = jnp.argmax(lm_head(head, hidden, cfg=cfg.lm_head_config()), -1)
    draft = jnp.argmax(
        drafter_lib.drafter_forward(ckpt.modules[0], head, ids[:, 1:-1], hidden, cfg=dcfg).logits,
        -1,
    )
    # Held-out code the pair never saw: how often the drafter's guess for token t+2 matches the
    # target's own greedy choice there.
    agree = float(jnp.mean(draft[:, :-1] == target_next[:, 1:]))
    assert agree > 0.3, agree
