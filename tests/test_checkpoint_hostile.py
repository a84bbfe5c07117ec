"""Hostile and careless input to the converter and the loader: every case is refused with one
line naming the file, the tensor and what was expected, and nothing is left half-written."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import checkpoint_fixtures as fx
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from mtpjax.checkpoint import (
    CheckpointError,
    SafetensorsFile,
    convert,
    convert_main,
    load_drafter,
    read_manifest,
)
from mtpjax.weights import Fp8BlockWeight, dequantize, quantize

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
INDEX = "model.safetensors.index.json"
Q_PROJ = "mtp.layers.0.self_attn.q_proj.weight"
NORM = "mtp.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A Qwen3.5 dense checkpoint (3 shards), untouched: tests copy it before damaging it."""
    directory = tmp_path_factory.mktemp("dense") / "src"
    fx.qwen_checkpoint(directory, moe=False)
    return directory


@pytest.fixture(scope="module")
def converted(dense, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "out"
    convert(dense, out, progress=False)
    return out


def copy(path: Path, tmp_path: Path, name: str = "src") -> Path:
    return Path(shutil.copytree(path, tmp_path / name))


def rewrite(src: Path, name: str, value: np.ndarray) -> None:
    """Replaces tensor ``name`` in its shard (the index stays as it is)."""
    shard = src / json.loads((src / INDEX).read_text())["weight_map"][name]
    with SafetensorsFile(shard) as f:
        tensors = {n: f.read(n) for n in f.tensors}
    tensors[name] = value
    save_file(tensors, str(shard))


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------------------------
# (2) An untied config never gets the embedding as its head.


def test_untied_config_without_lm_head_is_refused(tmp_path):
    fx.qwen_checkpoint(tmp_path / "src", moe=False, tied=True)  # no lm_head.weight
    config_file = tmp_path / "src" / "config.json"
    config = json.loads(config_file.read_text())
    config["tie_word_embeddings"] = False
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    msg = one_line(err)
    assert INDEX in msg and "'lm_head.weight'" in msg and "tie_word_embeddings: false" in msg
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# (3) Non-finite weights, (4) wrong dtypes.


@pytest.mark.parametrize(
    "bad, precision", [(np.inf, "fp8"), (np.inf, "nvfp4"), (np.nan, "nvfp4"), (-np.inf, "keep")]
)
def test_non_finite_weights_are_refused_before_quantising(tmp_path, dense, bad, precision):
    src = copy(dense, tmp_path)
    w = np.ones((fx.NQ * fx.D * 2, fx.H), np.float32)
    w[3, 5] = w[7, 1] = bad
    rewrite(src, Q_PROJ, w.astype(ml_dtypes.bfloat16))
    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(CheckpointError) as err:
        convert(src, out, precision=precision, progress=False)
    msg = one_line(err)
    assert f"tensor {Q_PROJ!r}" in msg and ".safetensors" in msg
    assert "holds 2 non-finite values" in msg and "the first at index [3, 5]" in msg
    # Nothing is left behind, not even the parent directories the conversion made.
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("dtype, name", [(np.int32, "I32"), (np.bool_, "BOOL")])
def test_norms_of_a_non_float_dtype_are_refused(tmp_path, dense, dtype, name):
    src = copy(dense, tmp_path)
    rewrite(src, NORM, np.ones((fx.H,), dtype))
    with pytest.raises(CheckpointError) as err:
        convert(src, tmp_path / "out", progress=False)
    msg = one_line(err)
    assert NORM in msg and "must be BF16 / F16 / F32" in msg and f"found {name}" in msg


# --------------------------------------------------------------------------------------------
# (5) The safetensors header is checked against the format.


def write_header(path: Path, header: str | dict, data: bytes) -> Path:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    "header, data_bytes, expected",
    [
        ({"a": entry(), "b": entry(offsets=(4, 12))}, 12, "'b' data_offsets [4, 12] overlaps"),
        ({"a": entry(), "b": entry(offsets=(0, 8))}, 8, "overlaps the tensor before it"),
        ({"a": entry(), "b": entry(offsets=(12, 20))}, 20, "leaves a gap of 4 bytes"),
        ({"a": entry()}, 12, "the tensors cover 8 bytes of a data section of 12"),
        ({"a": entry(offsets=(8, 16))}, 8, "truncated safetensors file: tensor 'a' ends"),
        ({"a": entry(shape=(-2,), offsets=(0, 0))}, 0, "tensor 'a' has shape [-2], expected"),
        ({"a": entry(shape=(2.0,))}, 8, "tensor 'a' has shape [2.0], expected"),
        ({"a": entry(shape=(True,), offsets=(0, 4))}, 4, "tensor 'a' has shape [True]"),
        ({"a": entry(offsets=(0, 8.0))}, 8, "tensor 'a' has data_offsets [0, 8.0], expected"),
        ({"a": entry(offsets=(-8, 0))}, 8, "tensor 'a' has data_offsets [-8, 0], expected"),
        (
            {"a": entry(shape=(4, 4), offsets=(0, 8))},
            8,
            "tensor 'a': shape [4, 4] of F32 needs 64 bytes, data_offsets [0, 8] span 8",
        ),
        (
            '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
            '"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
            16,
            "key 'a' appears twice",
        ),
    ],
)
def test_reader_rejects_headers_the_format_forbids(tmp_path, header, data_bytes, expected):
    path = write_header(tmp_path / "x.safetensors", header, bytes(data_bytes))
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile(path)
    msg = one_line(err)
    assert msg.startswith(f"{path}: ") and expected in msg, msg


def test_reader_accepts_empty_tensors_and_out_of_order_offsets(tmp_path):
    header = {"b": entry(offsets=(8, 16)), "a": entry(), "e": entry(shape=(0, 3), offsets=(16, 16))}
    data = np.arange(4, dtype=np.float32).tobytes()
    with SafetensorsFile(write_header(tmp_path / "x.safetensors", header, data)) as f:
        assert f.read("b").tolist() == [2.0, 3.0] and f.read("e").shape == (0, 3)


# --------------------------------------------------------------------------------------------
# (8) Integrity: a sha256 per stored array, checked on load.


def test_flipped_bytes_fail_loading_naming_the_array(tmp_path, converted):
    out = copy(converted, tmp_path, "out")
    names = {t.name for t in read_manifest(out).tensors}
    biggest = max((p for p in (out / "params").rglob("*") if p.is_file()), key=os.path.getsize)
    data = bytearray(biggest.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    biggest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        load_drafter(out)
    msg = one_line(err)
    assert "damaged" in msg and any(f"array {n}." in msg or f"'{n}." in msg for n in names), msg


def test_a_hash_mismatch_names_the_array_and_verify_false_skips_it(tmp_path, converted):
    out = copy(converted, tmp_path, "out")
    manifest = json.loads((out / "manifest.json").read_text())
    record = next(t for t in manifest["tensors"] if t["name"] == "mtp.fc")
    record["sha256"]["w"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"array mtp\.fc\.w does not match the sha256"):
        load_drafter(out)
    load_drafter(out, verify=False)


# --------------------------------------------------------------------------------------------
# (9) The output never overwrites the source.


def test_out_inside_or_over_the_source_is_refused(tmp_path, dense):
    src = copy(dense, tmp_path)
    shard = next(src.glob("*.safetensors"))
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out in (shard, src / "converted", src, src / INDEX):
        with pytest.raises(CheckpointError, match="the source checkpoint") as err:
            convert(src, out, force=True, progress=False)
        one_line(err)
    # A shard symlinked from elsewhere (the Hugging Face cache layout) is a source file too.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    linked = copy(dense, tmp_path, "linked")
    target = next(linked.glob("*.safetensors"))
    shutil.move(target, blobs / target.name)
    target.symlink_to(blobs / target.name)
    with pytest.raises(CheckpointError, match="lies inside the source checkpoint"):
        convert(linked, blobs / target.name / "out", force=True, progress=False)
    assert convert_main([str(src), str(shard), "--force", "--quiet"]) == 1
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before and shard.is_file()
    # OUT an existing file, or under a file.
    file = tmp_path / "a_file"
    file.write_text("mine")
    with pytest.raises(CheckpointError, match="is an existing file"):
        convert(src, file, force=True, progress=False)
    with pytest.raises(CheckpointError) as err:
        convert(src, file / "out", progress=False)
    assert one_line(err) == f"{file / 'out'}: {file} is a file, not a directory"
    assert file.read_text() == "mine"


# --------------------------------------------------------------------------------------------
# (11) Interrupted conversions leave nothing behind.

_SLOW = textwrap.dedent(
    """
    import sys, time
    import mtpjax.checkpoint._convert as c
    from mtpjax.checkpoint import convert_main

    c.GROUP_BYTES = 1  # every tensor saved as it comes: the staging directory fills up
    real, seen = c._convert_entry, []

    def slow(*args, **kw):
        seen.append(1)
        if len(seen) == 4:  # three groups written: wait for the signal
            print("ready", flush=True)
            time.sleep(60)
        return real(*args, **kw)

    c._convert_entry = slow
    sys.exit(convert_main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_mid_conversion_leaves_nothing_and_says_so_once(tmp_path, dense, signum, code):
    out = tmp_path / "made" / "by" / "convert" / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW, str(dense), str(out), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        staged = [p for p in out.parent.iterdir() if p.name.startswith(".out.tmp-")]
        assert staged and any((staged[0] / "params").iterdir())  # groups were written
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code
    assert stderr == f"interrupted: nothing was written to {out}\n"
    assert not (tmp_path / "made").exists()


# --------------------------------------------------------------------------------------------
# (12) Loading a damaged checkpoint: one line.


def test_damaged_directory_fails_loading_in_one_line(tmp_path, converted):
    out = copy(converted, tmp_path, "out")
    biggest = max((p for p in (out / "params").rglob("*") if p.is_file()), key=os.path.getsize)
    biggest.unlink()
    script = "import sys; from mtpjax.checkpoint import load_drafter; load_drafter(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(out)], capture_output=True, text=True, env=ENV
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("mtpjax.checkpoint._safetensors_io.CheckpointError: ") and "damaged" in last
    )
    for noise in (
        "Task exception was never retrieved",
        "Exception ignored",
        "Event loop is closed",
    ):
        assert noise not in proc.stderr
    assert proc.stderr.count("\n") < 12, proc.stderr


def test_missing_manifest_fields_and_records_are_named(tmp_path, converted):
    out = copy(converted, tmp_path, "out")
    file = out / "manifest.json"
    manifest = json.loads(file.read_text())
    broken = json.loads(json.dumps(manifest))
    del broken["tensors"][2]["group"]
    file.write_text(json.dumps(broken))
    name = manifest["tensors"][2]["name"]
    with pytest.raises(CheckpointError) as err:
        load_drafter(out)
    assert one_line(err) == f"{file}: tensor record 2 ({name!r}) lacks 'group'"
    broken = json.loads(json.dumps(manifest))
    broken["tensors"] = [t for t in broken["tensors"] if t["name"] != "mtp.fc"]
    file.write_text(json.dumps(broken))
    with pytest.raises(CheckpointError, match=r"manifest\.json: no record of tensor 'mtp\.fc'"):
        load_drafter(out)


def test_a_twin_record_must_name_a_stored_tensor_of_its_bytes(tmp_path, converted):
    """``same_as`` (a tensor stored once under another record) pointing nowhere, at another
    twin, or at a tensor of other bytes is named, never loaded as some other tensor."""
    out = copy(converted, tmp_path, "out")
    file = out / "manifest.json"
    manifest = json.loads(file.read_text())
    assert not any(t["same_as"] for t in manifest["tensors"])  # untied: nothing stored twice
    for twin in ("mtp.nothing", "head.embedding"):  # absent; stored, but other bytes
        broken = json.loads(json.dumps(manifest))
        record = next(t for t in broken["tensors"] if t["name"] == "head.weight")
        record["same_as"] = twin
        file.write_text(json.dumps(broken))
        with pytest.raises(CheckpointError) as err:
            load_drafter(out)
        assert one_line(err) == (
            f"{file}: tensor 'head.weight' is recorded as stored under {twin!r}, which is not a "
            "stored tensor of the same dtype, shape and sha256; convert the checkpoint again"
        )


def test_a_record_that_disagrees_with_the_config_is_named(tmp_path, converted):
    out = copy(converted, tmp_path, "out")
    file = out / "manifest.json"
    manifest = json.loads(file.read_text())
    record = next(t for t in manifest["tensors"] if t["name"] == "mtp.norm")
    (leaf,) = record["leaves"].values()
    size = leaf["shape"][0]
    leaf["shape"] = [size + 1]
    file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as err:
        load_drafter(out)
    assert one_line(err) == (
        f"{file}: tensor 'mtp.norm' is recorded as [{size + 1}], but config.json gives [{size}] "
        "[hidden_size]; convert the checkpoint again"
    )


def test_sharding_of_the_wrong_type_is_a_clear_type_error(converted):
    with pytest.raises(TypeError, match=r"sharding must be a jax\.sharding\.Sharding.*got str"):
        load_drafter(converted, sharding="cpu")


# --------------------------------------------------------------------------------------------
# (14, 16) The command line in the package; precisions; progress without a terminal.


def test_convert_main_help_documents_every_precision(capsys):
    with pytest.raises(SystemExit) as exit_:
        convert_main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in ("keep", "bf16", "fp8", "fp8_block", "nvfp4", "alias fp4", "128x128"):
        assert name in text


def test_fp8_block_precision_stores_block_128_projections(tmp_path, dense):
    manifest = convert(dense, tmp_path / "out", precision="fp8_block", progress=False)
    formats = {t.name: t.format for t in manifest.tensors if t.kind == "weight"}
    assert set(formats.values()) == {"fp8_block"} and manifest.precision == "fp8_block"
    _, ckpt = load_drafter(tmp_path / "out")
    convert(dense, tmp_path / "keep", progress=False)
    _, bf16 = load_drafter(tmp_path / "keep")
    assert isinstance(ckpt.modules[0].fc, Fp8BlockWeight)
    want = quantize(dequantize(bf16.modules[0].fc), "fp8_block")
    assert np.asarray(ckpt.modules[0].fc.q).tobytes() == np.asarray(want.q).tobytes()


def test_progress_is_logged_when_stderr_is_not_a_terminal(tmp_path, dense, caplog):
    with caplog.at_level(logging.INFO, logger="mtpjax.checkpoint"):
        convert(dense, tmp_path / "out", progress=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "mtpjax.checkpoint"]
    assert lines and lines[-1].startswith("converted ") and "source tensors" in lines[-1]
    total = lines[-1].split()[1].split("/")
    assert total[0] == total[1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mtpjax.checkpoint"):
        convert(dense, tmp_path / "quiet", progress=False)
    assert not [r for r in caplog.records if r.name == "mtpjax.checkpoint"]
