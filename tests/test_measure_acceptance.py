"""scripts/measure_acceptance.py end to end at a tiny size: one configuration on two held-out
snippets must write a complete, consistent record whose speculative output equals greedy
decoding with the target alone, and print the markdown table."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "measure_acceptance.py"


@functools.cache
def _load_script():
    spec = importlib.util.spec_from_file_location("measure_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_one_configuration_matches_greedy(tmp_path, capsys):
    ma = _load_script()
    out = tmp_path / "acceptance.json"
    argv = ["--ks", "1", "--precisions", "bf16", "--contracts", "post_norm", "--max-snippets"]
    argv += ["2", "--new-tokens", "8", "--prompt-len", "16", "--json", str(out)]
    assert ma.main(argv) == 0

    (r,) = json.loads(out.read_text())
    assert r["precision"] == "bf16" and r["contract"] == "post_norm" and r["k"] == 1
    assert r["identical"] is True and r["kv_error"] is False
    assert (r["num_snippets"], r["prompt_len"], r["new_tokens"]) == (2, 16, 8)
    # Plain decoding of N tokens takes N - 1 forwards after the prefill; speculation no more.
    assert r["baseline_steps"] == 7
    assert 1 <= r["target_steps"] <= 7
    assert r["target_forwards_saved"] == r["baseline_steps"] - r["target_steps"]
    assert len(r["per_position_acceptance"]) == 1
    assert 0.0 <= r["draft_acceptance_rate"] <= 1.0
    # With k = 1 each round emits 1 + (draft accepted) tokens.
    assert r["mean_acceptance_length"] == pytest.approx(1 + r["draft_acceptance_rate"], abs=1e-3)
    assert r["per_position_acceptance"][0] == pytest.approx(r["draft_acceptance_rate"], abs=1e-3)

    printed = capsys.readouterr().out
    assert "| precision | contract | k=1 |" in printed
    assert f"| bf16 | post_norm | {r['mean_acceptance_length']:.2f} |" in printed


def test_table_marks_a_differing_output():
    ma = _load_script()
    rec = dict(precision="fp8", contract="pinned", identical=False, mean_acceptance_length=2.5)
    text = ma.table([dict(rec, k=1), dict(rec, k=3, identical=True, mean_acceptance_length=None)])
    assert text.splitlines()[0] == "| precision | contract | k=1 | k=3 |"
    assert text.splitlines()[-1] == "| fp8 | pinned | 2.50 (differs!) | n/a |"


_TINY = ["--precisions", "bf16", "--contracts", "post_norm", "--max-snippets", "2"]
_TINY += ["--new-tokens", "8", "--prompt-len", "16"]


def test_sampled_mode_records_both_kinds_of_draft(tmp_path, capsys):
    ma = _load_script()
    out = tmp_path / "sampled.json"
    argv = ["--mode", "sampled", "--ks", "1", "--temperatures", "1.0", "--seeds", "1"]
    assert ma.main([*argv, *_TINY, "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["drafts"] for r in records] == ["argmax", "sampled"]
    for r in records:
        assert (r["k"], r["temperature"], r["seed"]) == (1, 1.0, 0)
        assert r["mean_acceptance_length"] == pytest.approx(
            1 + r["draft_acceptance_rate"], abs=1e-3
        )
    assert "| 1 | 1.0 |" in capsys.readouterr().out


def test_adaptive_mode_prices_every_run_and_matches_greedy(tmp_path):
    ma = _load_script()
    out = tmp_path / "adaptive.json"
    argv = ["--mode", "adaptive", "--ks", "2", "--cost-repeats", "3", *_TINY, "--json", str(out)]
    assert ma.main(argv) == 0
    records = json.loads(out.read_text())
    assert [(r["policy"], r["cost_model"]) for r in records] == [
        ("fixed", None), ("adaptive", "cpu"), ("adaptive", "linear")
    ]  # fmt: skip
    for r in records:
        assert r["identical"] is True
        hist = r["num_rounds_per_sent"]
        assert sum(hist) == r["sequence_forwards"]
        assert sum(n * c for n, c in enumerate(hist)) == r["num_draft_tokens"]
        assert r["num_draft_tokens"] <= r["num_proposed_tokens"] == 2 * sum(hist)
        assert len(r["costs_ms"]["verify_ms"]) == 3 and len(r["costs_ms"]["propose_ms"]) == 2
    fixed = records[0]
    assert fixed["num_rounds_per_sent"][:2] == [0, 0]
    assert fixed["goodput_linear"] == pytest.approx(
        fixed["tokens"] / (fixed["sequence_forwards"] * (3 + 0.2)), rel=1e-4
    )
