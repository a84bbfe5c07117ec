"""``mtpjax.pretrained`` and the ``demo --model`` / ``generate`` commands on copies of the small
Qwen3.5 fixture directory (tests/fixtures/hybrid, MTP tensors included): the demo on it, the
converted-drafter cache (its key, and nothing left behind by a conversion that fails midway),
and bad input: missing or misshapen GDN tensors, a checkpoint without MTP tensors (which
``--no-speculation`` still decodes), each one line on stderr and exit status 2.

Every decoding run uses one prompt, k and token count, so the speculative and the plain loop
each compile once for the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

import mtpjax.checkpoint._convert as convert_lib
from mtpjax import demo, pretrained
from mtpjax.__main__ import main
from mtpjax.checkpoint import MANIFEST_FILE, CheckpointError

FIXTURE = Path(__file__).parent / "fixtures" / "hybrid" / "qwen3_5_dense"  # vocab 251
GDN0 = "model.language_model.layers.0.linear_attn."
PROMPT = "def mean(data):\n    return sum(data) / len(data)\n"
ARGS = ["--prompt", PROMPT, "--max-new-tokens", "6", "--num-drafts", "3"]


def write_char_tokenizer(path: Path) -> None:
    """A character-level ``tokenizer.json``: printable ASCII, newline and tab, 98 ids (the
    fixtures' vocab is 251)."""
    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    vocab = {"[UNK]": 0} | {c: i + 1 for i, c in enumerate(chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path / pretrained.TOKENIZER_FILE))


def copy_fixture(dst: Path, edit=None) -> Path:
    """The fixture with a tokenizer, its tensors passed through ``edit(tensors)``."""
    dst.mkdir(parents=True)
    shutil.copy(FIXTURE / "config.json", dst / "config.json")
    write_char_tokenizer(dst)
    if edit is None:
        shutil.copy(FIXTURE / "model.safetensors", dst / "model.safetensors")
        return dst
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def drop_mtp(tensors: dict) -> None:
    for name in [n for n in tensors if n.startswith("mtp.")]:
        del tensors[name]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(argv)
    return status, stdout.getvalue(), capsys.readouterr().err


def assert_nothing_half_written(cache_dir: Path) -> None:
    """Every entry of the cache is a complete conversion (no staging directory, no entry
    without its manifest, which the converter writes last)."""
    for entry in cache_dir.iterdir() if cache_dir.exists() else ():
        assert not entry.name.startswith("."), entry
        assert (entry / MANIFEST_FILE).is_file(), entry


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return copy_fixture(tmp_path_factory.mktemp("fixtures") / "qwen3_5_dense")


@pytest.fixture(scope="module")
def demo_run(model_dir, tmp_path_factory):
    """``demo --model DIR --json`` on the fixture copy; (its JSON, the cache directory)."""
    cache_dir = tmp_path_factory.mktemp("cache")
    argv = ["demo", "--model", str(model_dir), *ARGS, "--json", "--cache-dir", str(cache_dir)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(argv)
    assert status == 0
    return json.loads(stdout.getvalue()), cache_dir


def test_demo_on_a_fixture_directory(demo_run, model_dir):
    data, cache_dir = demo_run
    assert data["identical"] is True and data["model"] == str(model_dir)
    assert data["speculative_tokens"] == data["baseline_tokens"] == 6
    assert data["speculative_text"] == data["baseline_text"]
    assert len(data["per_position_acceptance"]) == 3
    assert data["target_forwards_speculative"] <= data["target_forwards_baseline"] == 5
    assert data["checkpoint_reused"] is False
    assert Path(data["checkpoint"]).parent == cache_dir
    fields = set(demo.DemoResult.__dataclass_fields__)
    text = demo.report(demo.DemoResult(**{k: v for k, v in data.items() if k in fields}))
    assert text.startswith(f"mtpjax demo: MTP speculative decoding on {model_dir}\n")
    assert "identical to the target alone   yes" in text
    assert "small demonstration model" not in text  # the shipped pair's caveat


# --------------------------------------------------------------------------------------------
# The cache.


def test_the_key_changes_when_a_file_changes(tmp_path):
    path = copy_fixture(tmp_path / "m")
    key = pretrained.content_key(path)
    assert pretrained.content_key(path) == key and len(key) == 16
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config))  # same content, other bytes
    assert pretrained.content_key(path) != key
    key = pretrained.content_key(path)
    weights = path / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as f:  # one byte of the last tensor, rewritten in place
        f.seek(stat.st_size - 1)
        byte = f.read(1)
        f.seek(stat.st_size - 1)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert weights.stat().st_size == stat.st_size
    assert pretrained.content_key(path) != key


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_a_conversion_that_fails_midway_leaves_nothing(tmp_path, monkeypatch, failure):
    path = copy_fixture(tmp_path / "m")
    cache_dir = tmp_path / "cache" / "mtpjax"
    convert_entry = convert_lib._convert_entry
    converted = []

    def failing(*args, **kwargs):
        if len(converted) == 6:
            # Six tensors written (a tied head is stored as the embedding's twin: one fewer).
            staged = list((tmp_path / "cache" / "mtpjax").glob(".*.tmp-*/params/*"))
            assert len(staged) >= 5, staged
            raise failure
        converted.append(args[1].name)
        return convert_entry(*args, **kwargs)

    monkeypatch.setattr(convert_lib, "GROUP_BYTES", 1)  # each tensor saved as it comes
    monkeypatch.setattr(convert_lib, "_convert_entry", failing)
    with pytest.raises(type(failure)):
        pretrained.converted_drafter(path, cache_dir=cache_dir, progress=False)
    assert not (tmp_path / "cache").exists()  # the directories the conversion created, too
    monkeypatch.setattr(convert_lib, "_convert_entry", convert_entry)
    out, reused = pretrained.converted_drafter(path, cache_dir=cache_dir, progress=False)
    assert not reused and (out / MANIFEST_FILE).is_file()
    assert [p.name for p in cache_dir.iterdir()] == [out.name]
    assert pretrained.converted_drafter(path, cache_dir=cache_dir, progress=False) == (out, True)


# --------------------------------------------------------------------------------------------
# Bad input.


def test_missing_or_misshapen_gdn_tensors_are_one_line_and_exit_2(tmp_path, capsys):
    missing = copy_fixture(tmp_path / "missing", lambda t: t.pop(GDN0 + "in_proj_a.weight"))
    cache_dir = tmp_path / "cache"
    argv = ["generate", str(missing), *ARGS, "--cache-dir", str(cache_dir)]
    status, out, err = run_cli(argv, capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("mtpjax generate: error: ")
    assert f"tensor '{GDN0}in_proj_a.weight' is missing, expected [4, 72]" in err
    assert "[linear_num_value_heads, hidden_size]" in err
    assert_nothing_half_written(cache_dir)

    def short_kernel(t):
        t[GDN0 + "conv1d.weight"] = t[GDN0 + "conv1d.weight"][..., :3].copy()

    bad = copy_fixture(tmp_path / "conv", short_kernel)
    argv = ["demo", "--model", str(bad), *ARGS, "--cache-dir", str(cache_dir)]
    status, out, err = run_cli(argv, capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("mtpjax demo: error: ")
    assert f"tensor '{GDN0}conv1d.weight' is of shape [88, 1, 3], expected [88, 1, 4]" in err
    assert_nothing_half_written(cache_dir)


def test_a_checkpoint_without_mtp_tensors(tmp_path, capsys, demo_run):
    path = copy_fixture(tmp_path / "no_mtp", drop_mtp)
    cache_dir = tmp_path / "cache"
    argv = ["generate", str(path), *ARGS, "--cache-dir", str(cache_dir), "--json"]
    status, out, err = run_cli(argv, capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and "this checkpoint ships no MTP weights" in err
    assert not cache_dir.exists()
    with pytest.raises(CheckpointError, match="ships no MTP weights"):
        pretrained.load(path, cache_dir=cache_dir, progress=False)
    # The target alone still decodes, as the demo's plain run did on the same target weights.
    status, out, err = run_cli([*argv, "--no-speculation"], capsys)
    assert status == 0
    data = json.loads(out)
    assert data["speculation"] is False and data["checkpoint"] is None
    assert data["text"] == demo_run[0]["baseline_text"] and data["num_tokens"] == 6
    assert not cache_dir.exists()


def test_a_directory_without_a_tokenizer_fails_before_converting(tmp_path, capsys):
    path = copy_fixture(tmp_path / "m")
    (path / pretrained.TOKENIZER_FILE).unlink()
    cache_dir = tmp_path / "cache"
    status, out, err = run_cli(
        ["generate", str(path), *ARGS, "--cache-dir", str(cache_dir)], capsys
    )
    assert (status, out) == (2, "")
    assert (
        err
        == f"mtpjax generate: error: {path}: no tokenizer.json, so the prompt cannot be tokenized\n"
    )
    assert not cache_dir.exists()
    assert pretrained.load(path, drafter=False).tokenizer is None  # the library does not need it
