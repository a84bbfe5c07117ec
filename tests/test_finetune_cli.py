"""``mtpjax finetune`` end to end on a tiny random pair in the Hugging Face layout: it writes a
loadable fine-tuned directory, the converted drafter, the curves and the before/after
acceptance; a run stopped after a checkpoint and resumed ends with the parameters of an
uninterrupted run with the same seed, bit for bit. A head trained from a random init
(``--init-head random``) starts at the drafter's own seeded init; its output directory is the
source of a second run, whose "before" is the first run's "after"; ``--eval-precisions``
converts both heads at each precision and evaluates them."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open

from mtpjax import demo, drafter, hybrid
from mtpjax.__main__ import main as cli
from mtpjax.checkpoint import load_drafter, read_manifest
from mtpjax.config import DrafterConfig
from mtpjax.train import INTERRUPTED, hf_tensors
from mtpjax.train._cli import _INIT_STREAM, parse_args

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny_pair.py"


@functools.cache
def _train_script():
    spec = importlib.util.spec_from_file_location("train_tiny_pair", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory) -> Path:
    """A random pair of train_tiny_pair's "tiny" size with the shipped tokenizer's vocab, its
    tokenizer and its held-out list (so the training split is the shipped pair's)."""
    script = _train_script()
    path = tmp_path_factory.mktemp("tiny-pair")
    config = script.hf_config("tiny", max_position_embeddings=512, eos_id=0)
    config["vocab_size"] = 4096
    cfg = hybrid.HybridConfig.from_hf(config)
    params, head = hybrid.init(cfg, key=jax.random.key(0))
    mtp = drafter.init(DrafterConfig.from_hf_config(config), key=jax.random.key(1))
    script.save_pair(path, config=config, cfg=cfg, params=params, head=head, mtp=mtp)
    for name in ("tokenizer.json", "heldout_files.txt"):
        shutil.copy(demo.ASSET_DIR / name, path / name)
    return path


ARGS = [
    "--num-prompts", "4", "--prompt-len", "8", "--new-tokens", "8", "--gen-batch", "4",
    "--num-steps", "2", "--steps", "6", "--batch", "2", "--warmup", "1", "--lr", "1e-3",
    "--log-every", "2", "--save-every", "2",
]  # fmt: skip


def _mtp_tensors(directory: Path) -> dict[str, np.ndarray]:
    with safe_open(str(directory / "model.safetensors"), "flax") as f:
        return {
            n: np.asarray(f.get_tensor(n), np.float32)
            for n in sorted(f.keys())
            if n.startswith("mtp.")
        }


def test_finetune_writes_a_loadable_pair_and_resumes_exactly(pair_dir, tmp_path, capsys):
    full = tmp_path / "full"
    eval_args = ["--eval-snippets", "1", "--eval-new-tokens", "4", "--eval-ks", "1,2"]
    assert cli(["finetune", "--model", str(pair_dir), "--out", str(full), *ARGS, *eval_args]) == 0
    printed = capsys.readouterr().out
    assert "| before |" in printed and "| after |" in printed

    for name in ("finetune.json", "loss_curve.png", "train_curve.json", "selfdistill.npz"):
        assert (full / name).is_file(), name
    result = json.loads((full / "finetune.json").read_text())
    assert result["steps_this_run"] == 6 and result["final"]["step"] == 5
    for name in ("before", "after"):
        assert [r["k"] for r in result[name]] == [1, 2]
        assert all(r["identical"] and not r["kv_error"] for r in result[name])
    curve = json.loads((full / "train_curve.json").read_text())
    assert [r["step"] for r in curve] == list(range(6)) and len(curve[0]["ce"]) == 2
    data = np.load(full / "selfdistill.npz")["tokens"]
    assert data.shape == (4, 16) and data.min() >= 0

    # The fine-tuned tensors are in the HF directory, the target's as the source stores them,
    # and the converted drafter holds the same values; the head changed.
    dcfg, ckpt = load_drafter(full / "drafter-bf16")
    written = _mtp_tensors(full / "hf")
    source = _mtp_tensors(pair_dir)
    assert written.keys() == source.keys()
    converted = hf_tensors(ckpt.modules[0], dcfg)
    assert converted.keys() == written.keys()
    for name, value in written.items():
        np.testing.assert_array_equal(np.asarray(converted[name], np.float32), value)
    assert any(not np.array_equal(written[n], source[n]) for n in written)
    with (
        safe_open(str(full / "hf" / "model.safetensors"), "flax") as a,
        safe_open(str(pair_dir / "model.safetensors"), "flax") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for n in sorted(b.keys()):
            if not n.startswith("mtp."):
                np.testing.assert_array_equal(
                    np.asarray(a.get_tensor(n)), np.asarray(b.get_tensor(n))
                )
    hybrid.load(full / "hf", cfg=hybrid.HybridConfig.from_hf(full / "hf"))

    # Stopped after 3 steps (the checkpoint of step 2 and the one written on stopping), then
    # resumed by the same command: the final head is the uninterrupted run's, bit for bit.
    part = tmp_path / "part"
    argv = ["finetune", "--model", str(pair_dir), "--out", str(part), *ARGS, "--no-eval"]
    assert cli([*argv, "--stop-after", "3"]) == INTERRUPTED
    assert not (part / "hf").exists()
    capsys.readouterr()
    assert cli(argv) == 0
    assert "resumed from the checkpoint at step 3" in capsys.readouterr().err
    resumed = _mtp_tensors(part / "hf")
    for name, value in written.items():
        np.testing.assert_array_equal(resumed[name], value)
    curve_part = json.loads((part / "train_curve.json").read_text())
    assert [r["step"] for r in curve_part] == list(range(6))
    np.testing.assert_array_equal([r["loss"] for r in curve_part], [r["loss"] for r in curve])

    # Another setting in the same run directory is refused.
    assert cli([*argv, "--lr", "5e-4"]) == 2


def _valid_mals(records, ks):
    assert [r["k"] for r in records] == list(ks)
    for r in records:
        assert r["identical"] and not r["kv_error"]
        assert 1.0 <= r["mean_acceptance_length"] <= r["k"] + 1


def test_a_random_init_head_trains_and_its_output_is_the_next_runs_source(pair_dir, tmp_path):
    # Run 1: a vanilla one-step head from the drafter's seeded init, every batch the whole data
    # (so the curve's losses are on one batch), evaluated at three precisions.
    run1, lr, steps = tmp_path / "vanilla", 1e-3, 6
    tiny = [*ARGS[:8], "--steps", str(steps), "--batch", "4", "--warmup", "1", "--lr", str(lr)]
    tiny += ["--save-every", "6", "--eval-snippets", "1", "--eval-new-tokens", "4"]
    tiny += ["--eval-ks", "1"]
    argv = ["finetune", "--model", str(pair_dir), "--out", str(run1), *tiny]
    precisions = ("bf16", "fp8", "nvfp4")
    vanilla = [*argv, "--init-head", "random", "--num-steps", "1"]
    assert cli([*vanilla, "--eval-precisions", ",".join(precisions)]) == 0

    curve = json.loads((run1 / "train_curve.json").read_text())
    assert curve[-1]["loss"] < curve[0]["loss"]
    # The trained head is within the steps' reach of the seeded random init (AdamW moves an
    # element by about lr a step) and far from the checkpoint's head it did not start from.
    dcfg = DrafterConfig.from_hf_config(pair_dir)
    key = jax.random.fold_in(jax.random.key(0), _INIT_STREAM)
    init = {
        n: np.asarray(v, np.float32)
        for n, v in hf_tensors(drafter.init(dcfg, key=key, precision="bf16"), dcfg).items()
    }
    trained, source = _mtp_tensors(run1 / "hf"), _mtp_tensors(pair_dir)
    assert trained.keys() == init.keys() == source.keys()
    for name, value in trained.items():
        np.testing.assert_allclose(value, init[name], atol=3 * steps * lr, rtol=1e-2, err_msg=name)
    assert max(float(np.abs(trained[n] - source[n]).max()) for n in trained) > 30 * steps * lr

    # Each precision: both heads converted at it (the before head from the source, the after
    # head from OUT/hf), the quantised leaves stored so, and valid mean acceptance lengths.
    result = json.loads((run1 / "finetune.json").read_text())
    assert result["settings"]["init_head"] == "random"
    assert result["eval_precisions"] == list(precisions) and list(result["eval"]) == list(
        precisions
    )
    stored = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "nvfp4": "uint8"}
    for precision in precisions:
        for name, directory, src in (
            ("before", run1 / f"source-{precision}", pair_dir),
            ("after", run1 / f"drafter-{precision}", run1 / "hf"),
        ):
            _valid_mals(result["eval"][precision][name], (1,))
            manifest = read_manifest(directory)
            assert (manifest.precision, manifest.source) == (precision, str(src))
            _, ckpt = load_drafter(directory)
            o_proj = ckpt.modules[0].layer.attention.o_proj
            assert jax.tree.leaves(o_proj)[0].dtype == np.dtype(stored[precision]), precision
    for name in ("before", "after"):  # the top-level records are the BF16 drafters'
        assert result[name] == result["eval"]["bf16"][name]

    # Run 2: run 1's OUT/hf as the model, two chained steps from its head: its "before" is
    # run 1's "after" (the same head, prompts and measurement), its head moved on.
    run2 = tmp_path / "chain"
    argv2 = ["finetune", "--model", str(run1 / "hf"), "--out", str(run2), *tiny]
    argv2 += ["--batch", "2"]  # the first test's batch: its compiled train step serves this run
    assert cli([*argv2, "--num-steps", "2"]) == 0
    result2 = json.loads((run2 / "finetune.json").read_text())
    assert result2["before"] == result["after"]
    assert result2["heldout_files"] == result["heldout_files"]
    _, before2 = load_drafter(run2 / "source-bf16")
    _, after1 = load_drafter(run1 / "drafter-bf16")
    for a, b in zip(jax.tree.leaves(before2.modules[0]), jax.tree.leaves(after1.modules[0])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    chained = _mtp_tensors(run2 / "hf")
    assert any(not np.array_equal(chained[n], trained[n]) for n in trained)
    # A resume with the other init is refused (init_head is a run setting).
    assert cli([*argv2, "--num-steps", "2", "--init-head", "random"]) == 2


@pytest.mark.parametrize("value", ["fp16", "bf16,int4", "keep", ","])
def test_an_unknown_eval_precision_is_a_one_line_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", "x", "--eval-precisions", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mtpjax finetune: error: argument --eval-precisions:")
    assert "bf16, fp8, fp8_block, nvfp4" in err and repr(value) in err
    assert parse_args(["--out", "x", "--eval-precisions", "FP8,fp4,bf16,fp8"]).eval_precisions == (
        "fp8",
        "nvfp4",
        "bf16",
    )


def test_a_missing_module_is_named_before_the_run_starts(tmp_path, monkeypatch, capsys):
    from mtpjax.train import _cli

    monkeypatch.setitem(_cli._DEFERRED_MODULES, "mtpjax_no_such_module", "no-such-package")
    assert cli(["finetune", "--out", str(tmp_path / "run")]) == 2
    assert "needs no-such-package" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_script_runs_from_a_checkout(tmp_path):
    # PYTHONPATH = the checkout, from another directory: the checkout's flags are there.
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "finetune_mtp.py"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "usage: scripts/finetune_mtp.py" in run.stdout
    assert "--init-head" in run.stdout and "--eval-precisions" in run.stdout


def test_the_training_split_excludes_the_heldout_files():
    from mtpjax.train import training_files

    files = training_files(demo.ASSET_DIR)
    held = {p.resolve() for p in demo.heldout_files()}
    assert files and held and not held & {p.resolve() for p in files}


def test_a_sharded_source_gets_one_new_shard_for_the_head(pair_dir, tmp_path):
    # The source split in two shards with an index: the output links both, adds one shard with
    # the head's tensors and maps them to it; the converter then reads the new values.
    from safetensors.flax import save_file

    from mtpjax.checkpoint import SafetensorsCheckpoint, convert
    from mtpjax.train import write_model_dir

    src = tmp_path / "sharded"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "heldout_files.txt"):
        shutil.copy(pair_dir / name, src / name)
    with safe_open(str(pair_dir / "model.safetensors"), "flax") as f:
        tensors = {n: f.get_tensor(n) for n in sorted(f.keys())}
    shards = {"a.safetensors": {}, "b.safetensors": {}}
    for i, (n, t) in enumerate(tensors.items()):
        shards["a.safetensors" if i % 2 else "b.safetensors"][n] = t
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, str(src / shard))
        weight_map |= dict.fromkeys(part, shard)
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    dcfg = DrafterConfig.from_hf_config(src)
    mtp = drafter.init(dcfg, key=jax.random.key(9))
    out = tmp_path / "out"
    write_model_dir(src, out, mtp, dcfg)
    assert (out / "a.safetensors").is_symlink() and (out / "b.safetensors").is_symlink()
    ckpt = SafetensorsCheckpoint(out)
    new = hf_tensors(mtp, dcfg)
    assert {ckpt.shard_of(n) for n in new} == {"model-mtp-finetuned.safetensors"}
    assert {ckpt.shard_of(n) for n in tensors if n not in new} <= set(shards)
    convert(out, tmp_path / "converted", precision="bf16", progress=False)
    _, loaded = load_drafter(tmp_path / "converted")
    for name, value in hf_tensors(loaded.modules[0], dcfg).items():
        np.testing.assert_array_equal(
            np.asarray(value, np.float32), np.asarray(new[name], np.float32)
        )

    # The output as the source of another head: its head shard is rewritten in the new
    # directory (a file, not a link into the first), and the first keeps its own head.
    again = drafter.init(dcfg, key=jax.random.key(10))
    write_model_dir(out, tmp_path / "out2", again, dcfg)
    assert not (tmp_path / "out2" / "model-mtp-finetuned.safetensors").is_symlink()
    for directory, params in ((out, mtp), (tmp_path / "out2", again)):
        ckpt = SafetensorsCheckpoint(directory)
        for name, value in hf_tensors(params, dcfg).items():
            np.testing.assert_array_equal(
                np.asarray(ckpt.read(name), np.float32), np.asarray(value, np.float32)
            )
