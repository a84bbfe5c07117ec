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
