"""`python -m mtpjax demo`: the JSON report of a short run with an NVFP4 drafter (converted into
a temporary cache), the human-readable report, the conversion cache and the held-out prompt."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tokenizers import Tokenizer

from mtpjax import demo, pretrained
from mtpjax.__main__ import main
from mtpjax.checkpoint import FORMAT_VERSION

NEW_TOKENS = 16
REQUIRED = (
    "speculative_text",
    "baseline_text",
    "identical",
    "mean_acceptance_length",
    "per_position_acceptance",
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mtpjax-cache")


@pytest.fixture(scope="module")
def demo_json(cache_dir):
    """One in-process `demo --json` run (module-scoped: it compiles two loops)."""
    import contextlib
    import io

    stdout = io.StringIO()
    argv = [
        "demo",
        "--json",
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--num-drafts",
        "3",
        "--precision",
        "nvfp4",
        "--cache-dir",
        str(cache_dir),
    ]
    with contextlib.redirect_stdout(stdout):
        status = main(argv)
    return status, stdout.getvalue()


def test_json_output_has_the_fields_and_is_identical(demo_json, cache_dir):
    status, text = demo_json
    assert status == 0
    data = json.loads(text)  # stdout is one JSON object and nothing else
    for key in REQUIRED:
        assert key in data, key
    assert data["identical"] is True
    assert data["speculative_text"] == data["baseline_text"]
    assert data["speculative_text"].strip()
    assert data["speculative_tokens"] == data["baseline_tokens"] <= NEW_TOKENS
    assert 1.0 <= data["mean_acceptance_length"] <= 4.0
    assert len(data["per_position_acceptance"]) == 3
    rates = data["per_position_acceptance"]
    assert all(0.0 <= r <= 1.0 for r in rates) and rates == sorted(rates, reverse=True)
    assert data["precision"] == "nvfp4" and data["num_drafts"] == 3
    assert data["target_forwards_saved"] == (
        data["target_forwards_baseline"] - data["target_forwards_speculative"]
    )
    assert data["target_forwards_speculative"] < data["target_forwards_baseline"]
    assert data["checkpoint"].startswith(str(cache_dir))
    assert "held-out stdlib file" in data["prompt_source"]


def test_conversion_is_cached_by_precision_and_content_key(demo_json, cache_dir):
    path, reused = demo.converted_drafter("nvfp4", cache_dir=cache_dir, progress=False)
    assert reused
    key = pretrained.content_key(demo.ASSET_DIR)
    assert path.name == f"tiny_pair-nvfp4-{key}-v{FORMAT_VERSION}"
    assert json.loads(demo_json[1])["checkpoint"] == str(path)


def test_human_report(demo_json):
    data = json.loads(demo_json[1])
    fields = {f.name for f in dataclasses.fields(demo.DemoResult)}
    result = demo.DemoResult(**{k: v for k, v in data.items() if k in fields})
    text = demo.report(result)
    assert result.speculative_text.strip().splitlines()[0] in text
    assert "identical to the target alone   yes" in text
    assert f"mean acceptance length          {result.mean_acceptance_length:.2f}" in text
    assert f"{result.target_forwards_saved} saved" in text


def test_speed_is_steady_state_per_device(demo_json):
    """Both runs are timed twice: the first call (compilation included) apart, then steady-state
    tokens per second; the device and the demonstration-model caveat are named."""
    import jax

    data = json.loads(demo_json[1])
    device = jax.devices()[0]
    assert data["device"] == f"{device.device_kind} ({device.platform})"
    for run in ("speculative", "baseline"):
        steady, first = data[f"steady_seconds_{run}"], data[f"seconds_{run}"]
        assert 0 < steady < first  # the first call compiles
        assert data[f"tokens_per_second_{run}"] == pytest.approx(
            data[f"{run}_tokens"] / steady, rel=1e-3
        )
    assert data["speedup"] == pytest.approx(
        data["tokens_per_second_speculative"] / data["tokens_per_second_baseline"], rel=1e-2
    )
    fields = {f.name for f in dataclasses.fields(demo.DemoResult)}
    result = demo.DemoResult(**{k: v for k, v in data.items() if k in fields})
    text = demo.report(result)
    assert f"  device    {data['device']}" in text
    assert "compile + first run" in text
    # The JSON's speed-up is rounded to 3 digits; the report formats the result's own.
    assert f"speed-up {result.speedup:.2f}x on {data['device']}" in text
    assert "small demonstration model" in text


def test_default_prompt_is_held_out_code():
    tokenizer = Tokenizer.from_file(str(demo.ASSET_DIR / "tokenizer.json"))
    prompt = demo.default_prompt(tokenizer)
    listed = (demo.ASSET_DIR / "heldout_files.txt").read_text().split()
    assert prompt.file in listed
    assert prompt.text.startswith("def ")
    assert len(tokenizer.encode(prompt.text).ids) >= demo.PROMPT_TOKENS


def test_bad_precision_is_refused():
    with pytest.raises(SystemExit):
        main(["demo", "--precision", "int4"])
