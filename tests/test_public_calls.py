"""benchmarks.public_calls: a CPU smoke run prints a run's times and the host probes."""

from __future__ import annotations

import json

from benchmarks import public_calls


def test_smoke_run_prints_both_steps_for_each_k(capsys):
    assert public_calls.main(["after", "--smoke"]) == 0
    run, host = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert run["tree"] == "after"
    for k in ("K=1", "K=3"):
        t = run[k]
        assert 0 < t["propose_dispatch_us"] <= t["propose_sync_us"]
        assert 0 < t["verify_dispatch_us"] <= t["verify_sync_us"]
    assert host["python_loop_1000_us"] > 0 and host["flatten_state_us"] > 0
