"""benchmarks.propose end to end in --smoke mode (tiny heads on the CPU). The records must be
complete and consistent, and the HLO scan must tell a clean program from one with a host
callback. The pure helpers are tested apart; the drafts against the PyTorch reference are
tests/test_gpu_propose.py's."""

from __future__ import annotations

import importlib.util
import json
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import propose as bp


def _torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def test_star_and_full_grids():
    assert bp.grid_points([1, 3, 5], [1, 8, 64], "star") == [
        (1, 8),
        (3, 1),
        (3, 8),
        (3, 64),
        (5, 8),
    ]
    assert len(bp.grid_points([1, 3, 5], [1, 8, 64], "full")) == 9
    assert bp.grid_points([2], [4], "star") == [(2, 4)]


def test_expected_distinct_experts():
    assert bp.expected_distinct_experts(512, 10, 1) == pytest.approx(10.0)
    # Many rows touch nearly every expert, never more.
    assert 511 < bp.expected_distinct_experts(512, 10, 2000) <= 512
    # Against a simulation of uniform top-10 routing for 8 rows.
    rng = np.random.default_rng(0)
    sims = [
        len({e for _ in range(8) for e in rng.choice(512, 10, replace=False)}) for _ in range(2000)
    ]
    assert bp.expected_distinct_experts(512, 10, 8) == pytest.approx(np.mean(sims), rel=0.01)


def test_kv_bytes_count_every_row_attended():
    from mtpjax.kv import KVDtype

    cfg = bp.head_config("dense", smoke=False)
    row = bp.kv_row_bytes(cfg, KVDtype.BF16)
    assert row == 2 * 4 * 256 * 2  # K and V, 4 KV heads of 256, BF16
    assert bp.kv_row_bytes(cfg, KVDtype.FP8) == 2 * 4 * 256 + 2 * 4 * 4  # codes + F32 scales
    # Step j of K attends context + j rows.
    assert bp.kv_attended_bytes(cfg, KVDtype.BF16, k=3, batch=8, context=4096) == (
        8 * (4096 + 4097 + 4098) * row
    )


def test_real_shapes_are_the_issue_s():
    dense = bp.head_config("dense", smoke=False)
    assert (dense.hidden_size, dense.q_proj_width, dense.kv_width) == (5120, 12288, 1024)
    assert (dense.intermediate_size, dense.vocab_size, dense.rotary_dim) == (17408, 248320, 64)
    moe = bp.head_config("moe", smoke=False)
    assert (moe.hidden_size, moe.num_attention_heads, moe.num_key_value_heads) == (2048, 16, 2)
    assert (moe.moe.num_experts, moe.moe.num_experts_per_tok) == (512, 10)
    assert (moe.moe.moe_intermediate_size, moe.moe.shared_expert_intermediate_size) == (512, 512)
    assert moe.vocab_size == 151936


def test_hlo_scan_flags_host_callbacks():
    x = jnp.ones((4,), jnp.float32)

    def clean(x):
        return jnp.sin(x) * 2

    def with_callback(x):
        y = jax.pure_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return y + 1

    ok = bp.scan_hlo(jax.jit(clean).lower(x).compile().as_text())
    assert ok["host_transfer_free"]
    bad = bp.scan_hlo(jax.jit(with_callback).lower(x).compile().as_text())
    assert not bad["host_transfer_free"]
    assert bad["host_custom_calls"]


def test_smoke_run(tmp_path):
    out = tmp_path / "propose.json"
    argv = ["--smoke", "--json", str(out), "--precisions", "bf16-nvfp4head"]
    assert bp.main(argv) == 0
    data = json.loads(out.read_text())
    assert (tmp_path / "propose.png").stat().st_size > 0
    run, records = data["run"], data["records"]
    assert run["smoke"] and run["points"] == [[2, 4]]
    kinds = Counter(r["kind"] for r in records)
    assert not kinds["skipped"], [r for r in records if r["kind"] == "skipped"]

    (copy,) = [r for r in records if r["kind"] == "copy_bandwidth"]
    assert copy["gbps"] > 0 and copy["gbps"] == run["copy_gbps"]

    propose = [r for r in records if r["kind"] == "propose"]
    assert {(r["head"], r["precision"], r["k"], r["batch"]) for r in propose} == {
        ("dense", "bf16-nvfp4head", 2, 4),
        ("moe", "bf16-nvfp4head", 2, 4),
    }
    for r in propose:
        assert not r.get("error"), r.get("error")
        for field in (
            "time_us",
            "xla_time_us",
            "verify_us",
            "xla_verify_us",
            "weight_bytes",
            "kv_bytes",
            "roofline_us",
            "roofline_ratio",
            "pipelined_us",
            "pipelined_roofline_ratio",
        ):
            assert r[field] > 0, field
        assert r["per_draft_us"] == pytest.approx(r["time_us"] / r["k"])
        assert r["pipelined_roofline_ratio"] == pytest.approx(r["pipelined_us"] / r["roofline_us"])
        assert r["bytes"] == r["weight_bytes"] + r["kv_bytes"]
        assert r["weight_bytes"] == r["k"] * (
            r["drafter_bytes_per_draft"] + r["head_bytes_per_draft"]
        )
        assert r["roofline_ratio"] == pytest.approx(
            r["time_us"] / (r["bytes"] / (copy["gbps"] * 1e3))
        )
        # verify with refeed trimmed the chain rows: every call started from the same context.
        assert r["context_kept"] and r["xla_context_kept"] and r["kv_errors"] == 0
        assert r["hlo"]["host_transfer_free"], r["hlo"]
        tokens = np.asarray(r["drafts_sample"])
        assert tokens.shape[1] == r["k"] and (tokens >= 0).all() and (tokens < 512).all()
    moe = next(r for r in propose if r["head"] == "moe")
    parts = moe["drafter_bytes_parts"]
    # The tiny MoE: 4 experts, top-2, 4 rows.
    assert parts["experts_touched"] == pytest.approx(bp.expected_distinct_experts(4, 2, 4))
    assert parts["total"] == moe["drafter_bytes_per_draft"]

    pools = [r for r in records if r["kind"] == "pool_10x"]
    assert {r["head"] for r in pools} == {"dense", "moe"}
    for r in pools:
        assert r["time_us"] > 0 and r["pool_1x_time_us"] > 0 and r["context_kept"]
        assert r["pool_bytes"] >= 9 * r["pool_1x_bytes"]
        assert r["hlo"]["host_transfer_free"]
        # A BF16 pool is donated and updated in place: no temporaries grow with the pool.
        assert r["kv_dtype"] == "bf16" and r["in_place"], r

    if _torch_available():
        timed = [r for r in records if r["kind"] == "torch"]
        assert {r["head"] for r in timed} == {"dense", "moe"}
        for r in timed:
            assert r["eager"]["time_us"] > 0
        for r in propose:
            assert r["torch_eager_us"] > 0
            assert r["torch_eager_per_draft_us"] == pytest.approx(r["torch_eager_us"] / r["k"])
    else:
        assert not kinds["torch_check"]
        assert any("PyTorch" in n for n in run["notes"])

    # --merge: the same file twice is one table and plot over twice the records.
    merged_png = tmp_path / "merged.png"
    merged = bp.merge([out, out], merged_png, k=2, context=40)
    assert len(merged) == 2 * len(records) and merged_png.stat().st_size > 0
    with pytest.raises(SystemExit, match=r"not a benchmarks\.propose result"):
        bp.merge([tmp_path / "propose.png"], merged_png, k=2, context=40)

    if jax.device_count() >= 2:
        heads = [r for r in records if r["kind"] == "sharded_lm_head"]
        assert heads and all(not r.get("error") and r["tokens_match"] for r in heads)
        sharded = [r for r in records if r["kind"] == "sharded_propose"]
        assert sharded, "B=4 splits over two devices"
        for r in sharded:
            assert not r.get("error"), r.get("error")
            assert r["two_gpu_us"] > 0 and r["context_kept"] and r["one_gpu_us"] > 0
            assert math.isfinite(r["speedup"])
            # Each device holds half of the one-device batch (same rows, same pairs).
            assert r["draft_agreement"] == 1.0
        # The tensor-parallel section: the tiny dense head has 2 KV heads, so 1 and 2 devices.
        par = {r["devices"]: r for r in records if r["kind"] == "parallel_propose"}
        assert set(par) == {1, 2}, par.keys()
        assert any("dense not sharded 4 ways: cfg.num_key_value_heads=2" in n for n in run["notes"])
        _check_parallel(par[1], par[2], copy["gbps"])
        # TP splits everything but fc, the norms and the embedding rows: the LM head and the KV
        # rows halve.
        one, two = par[1]["per_device_bytes_parts"], par[2]["per_device_bytes_parts"]
        # (the NVFP4 head's one F32 global scale is on every device)
        assert two["lm_head"] == (one["lm_head"] - 4) / 2 + 4 and two["kv"] * 2 == one["kv"]
        assert two["ffn"] * 2 == one["ffn"] and two["fc"] == one["fc"]


def _check_parallel(one: dict, r: dict, gbps: float) -> None:
    """A sharded point against the one-device point of the same (head, K, B)."""
    for rec in (one, r):
        assert not rec.get("error"), rec.get("error")
        assert rec["time_us"] > 0 and rec["pipelined_us"] > 0 and rec["impl"] == "xla"
        assert rec["context_kept"] and rec["kv_errors"] == 0 and rec["hlo"]["host_transfer_free"]
        parts = rec["per_device_bytes_parts"]
        per_draft = sum(v for key, v in parts.items() if key not in ("kv", "total"))
        assert rec["per_device_bytes"] == parts["total"] == rec["k"] * per_draft + parts["kv"]
        roof = rec["per_device_bytes"] / (gbps * 1e3)
        assert rec["roofline_ratio"] == pytest.approx(rec["time_us"] / roof)
    assert not one["collectives"] and r["collectives"].get("all-reduce")
    # The activations cross the devices, never a weight: all of a program's collectives return
    # less than the expert / FFN weights one device reads.
    weights = r["per_device_bytes_parts"].get("experts") or r["per_device_bytes_parts"]["ffn"]
    assert 0 < r["collective_bytes"] < weights
    assert r["per_device_bytes"] < one["per_device_bytes"]
    assert r["speedup"] == pytest.approx(one["time_us"] / r["time_us"])
    assert r["draft_agreement"] == 1.0  # fixed seeds: the same drafts on any mesh


def test_parallel_section_runs_deepseek_sharded(tmp_path):
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices)")
    out = tmp_path / "propose.json"
    argv = ["--smoke", "--json", str(out), "--heads", "deepseek", "--precisions", "bf16"]
    assert bp.main([*argv, "--skip-torch", "--parallel-only"]) == 0
    records = json.loads(out.read_text())["records"]
    assert not [r for r in records if r["kind"] == "skipped"]
    par = {(r["devices"], r["split"]): r for r in records if r["kind"] == "parallel_propose"}
    assert set(par) == {(1, None), (2, "experts"), (4, "experts"), (2, "width"), (4, "width")}
    gbps = json.loads(out.read_text())["run"]["copy_gbps"]
    for (n, _), r in par.items():
        if n > 1:
            _check_parallel(par[(1, None)], r, gbps)
            parts, one = r["per_device_bytes_parts"], par[(1, None)]["per_device_bytes_parts"]
            # MLA's latent rows are replicated: every device reads all of them.
            assert parts["kv"] == one["kv"] and parts["experts"] * n == one["experts"]
    # Experts split over devices: the router splits with them; split by width, it replicates.
    assert (
        par[(4, "experts")]["per_device_bytes_parts"]["router"] * 4
        == (par[(1, None)]["per_device_bytes_parts"]["router"])
    )
    assert (
        par[(4, "width")]["per_device_bytes_parts"]["router"]
        == (par[(1, None)]["per_device_bytes_parts"]["router"])
    )


def test_parallel_section_skips_on_one_device(monkeypatch):
    bench = bp.Bench(bp.parse_args(["--smoke", "--json", "/dev/null"]))
    monkeypatch.setattr(bp.jax, "device_count", lambda: 1)
    bench.parallel_section(bp.head_config("dense", smoke=True), None, None, dict(head="dense"))
    assert bench.meta["notes"] == ["tensor-parallel section not run: one device"]
    assert not bench.records


def test_deepseek_shapes_and_latent_rows():
    from mtpjax.kv import KVDtype

    cfg = bp.head_config("deepseek", smoke=False)
    m, moe = cfg.mla, cfg.moe
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (7168, 128, 129280)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim) == (1536, 512, 64)
    assert (m.qk_nope_head_dim, m.v_head_dim) == (128, 128)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.n_group, moe.topk_group) == (256, 8, 8, 4)
    assert (moe.moe_intermediate_size, moe.shared_expert_intermediate_size) == (2048, 2048)
    # The latent row: (512 + 64) BF16 values per token, not 128 heads of expanded K and V.
    assert bp.kv_row_bytes(cfg, KVDtype.BF16) == 576 * 2
    assert bp.kv_attended_bytes(cfg, KVDtype.BF16, k=3, batch=8, context=4096) == (
        8 * (4096 + 4097 + 4098) * 1152
    )


def test_deepseek_smoke_run(tmp_path):
    from mtpjax.kv import KVDtype

    out = tmp_path / "propose.json"
    argv = ["--smoke", "--json", str(out), "--heads", "deepseek", "--precisions", "fp8-block"]
    assert bp.main([*argv, "--skip-torch"]) == 0
    records = json.loads(out.read_text())["records"]
    assert not [r for r in records if r["kind"] == "skipped"]
    (r,) = [r for r in records if r["kind"] == "propose"]
    assert (r["head"], r["precision"], r["kv_dtype"]) == ("deepseek", "fp8-block", "bf16")
    assert not r.get("error") and r["context_kept"] and r["kv_errors"] == 0
    for field in ("time_us", "pipelined_us", "roofline_ratio", "pipelined_roofline_ratio"):
        assert r[field] > 0, field
    cfg = bp.head_config("deepseek", smoke=True)
    assert r["kv_bytes"] == bp.kv_attended_bytes(
        cfg, KVDtype.BF16, k=r["k"], batch=r["batch"], context=40
    )
    parts = r["drafter_bytes_parts"]
    assert parts["experts_touched"] == pytest.approx(bp.expected_distinct_experts(8, 2, 4))
    assert r["bytes"] == r["weight_bytes"] + r["kv_bytes"]
