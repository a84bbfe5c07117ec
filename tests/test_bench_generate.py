"""benchmarks.generate on the CPU: the --smoke run end to end (one B, two K), the forced
acceptance against the MAL its rates predict, the forced loop's round against generate's, the
exactness check at tiny shapes, and the command-buffer options (GPU only)."""

from __future__ import annotations

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import generate as bg
from benchmarks import propose as bp
from mtpjax import hybrid, reference
from mtpjax.head import lm_head

# The smoke run's shapes (SMOKE_DEFAULTS): the exactness check below reuses its programs.
B, T, N, KS = 4, 8, 40, (1, 2)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("generate")
    argv = ["--smoke", "--rates", "coding", "--rates", "1,0", "--json", str(out / "g.json")]
    argv += ["--plot", str(out / "g.png")]
    assert bg.main(argv) == 0
    data = json.loads((out / "g.json").read_text())
    return out, data


def test_smoke_run_records(smoke):
    out, data = smoke
    assert data["run"]["command"].startswith("python -m benchmarks.generate --smoke")
    records = data["records"]
    assert not [r for r in records if r.get("kind") in ("compile_error", "skipped")]
    assert not [r["error"] for r in records if r.get("kernel") == "_section_error"]
    (plain,) = [r for r in records if r.get("kind") == "plain"]
    assert plain["batch"] == B and plain["steps"] == N - 1
    assert plain["t_plain_step_us"] > 0 and plain["t_plain_step_synced_us"] > 0
    assert plain["tokens_per_s"] > 0 and plain["plain_step_bytes"] > 0
    spec = {(r["k"], r["rates_name"]): r for r in records if r.get("kind") == "spec"}
    assert set(spec) == {(k, name) for k in KS for name in ("coding", "1,0")}
    for r in spec.values():
        assert r["all_done"] and r["rounds"] > 0 and r["tokens_per_s"] > 0
        for f in ("t_propose_us", "t_verify_us", "t_propose_synced_us", "t_verify_synced_us"):
            assert r[f] > 0, f
        assert r["ideal_speedup"] == pytest.approx(
            r["mal"] * plain["t_plain_step_us"] / (r["t_verify_us"] + r["t_propose_us"])
        )
        assert r["measured_speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
    # Rates 1 then 0: exactly one draft accepted every round, so MAL = 2 and N - 1 = 39 tokens
    # after the first take ceil(39 / 2) = 20 rounds.
    for k in KS:
        r = spec[(k, "1,0")]
        assert r["mal"] == 2.0 and r["mal_expected"] == 2.0 and r["rounds"] == 20
        assert r["acceptance_per_pos"][:1] == [1.0]
    check = next(r for r in records if r.get("kind") == "generate_check")
    assert check["k"] == bp.center(list(KS)) and check["rounds_forced"] == N - 1
    assert 1 <= check["rounds_generate"] <= N - 1 and check["t_generate_s"] > 0
    assert (out / "g.png").stat().st_size > 0
    assert "generate vs forced loop at rates 0" in bg.table(records)


def test_smoke_run_on_the_hybrid_target(tmp_path):
    """--target hybrid: the speed section's records on the random hybrid target, whose state
    keeps one GDN snapshot for plain decoding and K + 1 for speculation; the exact section's
    forward (the section itself is the reference target's code with this target and forward)."""
    out = tmp_path / "h.json"
    argv = ["--smoke", "--target", "hybrid", "--ks", "1", "--rates", "1", "--json", str(out)]
    assert bg.main(argv) == 0
    records = json.loads(out.read_text())["records"]
    assert not [r for r in records if r.get("kind") in ("compile_error", "skipped")]
    assert not [r["error"] for r in records if r.get("kernel") == "_section_error"]
    (setup,) = [r for r in records if r.get("kind") == "setup"]
    assert setup["target"] == "hybrid" and setup["target_bytes"] > 0
    (plain,) = [r for r in records if r.get("kind") == "plain"]
    assert plain["target"] == "hybrid" and plain["steps"] == N - 1 and plain["tokens_per_s"] > 0
    (spec,) = [r for r in records if r.get("kind") == "spec"]
    # Rate 1 at K = 1: every round accepts its draft, so 39 tokens after the first take 20.
    assert spec["target"] == "hybrid" and spec["mal"] == 2.0 and spec["rounds"] == 20
    assert spec["t_verify_us"] > 0 and spec["t_propose_us"] > 0
    setup_ = bg.build_setup(layers=2, heads=["bf16"], smoke=True, kind="hybrid")
    assert setup_.target("bf16", rows=1).init_cache.max_step == 1
    assert setup_.target("bf16", rows=3).init_cache.max_step == 3
    head = setup_.heads["bf16"]
    prompts, _ = bg.random_prompts(2, 4, setup_.head_cfg.vocab_size, 0)
    want = hybrid.forward(setup_.layers, head, prompts, cfg=setup_.tcfg)[0]
    np.testing.assert_array_equal(setup_.forward("bf16")(prompts), want)
    with pytest.raises(ValueError, match="a multiple of 2, got 3"):
        bg.target_config(layers=3, smoke=True, kind="hybrid")


def test_forced_acceptance_gives_the_rates_mal(smoke):
    """Coding rates: the MAL measured over every (round, sequence) is within sampling error of
    1 + sum_j prod_{i<=j} r_i, and the conditional rate of the first draft near r_1."""
    _, data = smoke
    for r in (r for r in data["records"] if r.get("rates_name") == "coding"):
        expected, _ = bg.mal_expected(bg.RATE_SETS["coding"][: r["k"]])
        assert r["mal_expected"] == pytest.approx(expected)
        assert r["samples"] >= 60
        assert abs(r["mal_z"]) < 4.0, r
        assert abs(r["acceptance_conditional"][0] - 0.80) < 4 * np.sqrt(0.16 / r["samples"])


def test_mal_expected_matches_a_simulation():
    rates = (0.8, 0.62, 0.5, 0.4)
    rng = np.random.default_rng(0)
    u = rng.random((200_000, 4)) < np.asarray(rates)
    accepted = np.cumprod(u, axis=1).sum(axis=1)
    mean, sd = bg.mal_expected(rates)
    assert mean == pytest.approx(1 + accepted.mean(), abs=0.01)
    assert sd == pytest.approx(accepted.std(), abs=0.01)
    assert bg.mal_expected((1.0, 1.0)) == (3.0, 0.0)
    assert bg.mal_expected((0.0, 0.9)) == (1.0, 0.0)


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def _round_body(jaxpr):
    """The body of the first while loop in a jaxpr (nested jits included): the round."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            return eqn.params["body_jaxpr"].jaxpr
        for sub in _sub_jaxprs(eqn):
            if (body := _round_body(sub)) is not None:
                return body
    return None


def _work(jaxpr, acc=None) -> collections.Counter:
    """Every matmul, argmax and scan of a jaxpr with its operand shapes, and the jits it calls."""
    acc = collections.Counter() if acc is None else acc
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("pjit", "jit"):
            acc["jit", eqn.params["name"]] += 1
        elif name in ("dot_general", "argmax", "scan", "pallas_call"):
            acc[name, tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.invars)] += 1
        for sub in _sub_jaxprs(eqn):
            _work(sub, acc)
    return acc


def test_forced_round_is_generates_round():
    """Tracing only: the forced loop's round runs generate's propose, target step, LM head and
    trim at the same shapes; only verify's acceptance is replaced by a draw."""
    setup = bg.build_setup(layers=2, heads=["bf16"], smoke=True)
    target, head = setup.target("bf16", rows=3), setup.heads["bf16"]
    prompts, lengths = bg.random_prompts(B, T, setup.head_cfg.vocab_size, 0)
    k = 2
    gen_fn = bg.generate_fn(setup.dcfg, setup.head_cfg, N, k, "auto")
    loop_fn = bg.loop_fn(setup.dcfg, setup.head_cfg, N, k, "auto")
    g = _work(
        _round_body(jax.make_jaxpr(gen_fn)(target, setup.drafter, head, prompts, lengths).jaxpr)
    )
    args = (jnp.full((k,), 0.5), jnp.int32(N), jax.random.key(0))
    f = _work(
        _round_body(
            jax.make_jaxpr(loop_fn)(target, setup.drafter, head, prompts, lengths, *args).jaxpr
        )
    )
    assert sum(n for key, n in g.items() if key[0] == "dot_general") >= 10
    for key in ("_propose", "_target_step", "_after_verify"):
        assert g["jit", key] == f["jit", key] == 1, key
    assert g["jit", "_lm_head"] == f["jit", "_lm_head"] == k + 1  # K drafts, one verify
    only_generate = {key for key in g - f if key[0] != "jit"}
    only_forced = {key for key in f - g if key[0] != "jit"}
    assert not only_generate and not only_forced, (only_generate, only_forced)
    assert {key[1] for key in g - f} <= {"_verify", "_accept", "clip"}


def test_exact_check_at_tiny_shapes():
    """The smoke run's generate and width-1 baseline (same shapes: compiled once per suite) and
    the width K+1 baseline: speculation equals the baseline of its own width token for token."""
    setup = bg.build_setup(layers=2, heads=["bf16"], smoke=True, seed=1)
    target, head = setup.target("bf16", rows=3), setup.heads["bf16"]
    prompts, lengths = bg.random_prompts(B, T, setup.head_cfg.vocab_size, 3)
    k = bp.center(list(KS))
    forward = setup.forward("bf16")
    (rec,) = bg.check_exact(
        target, forward, setup.drafter, head, setup.tcfg, setup.dcfg, prompts, lengths, ks=[k],
        max_new_tokens=N,
    )  # fmt: skip
    assert rec["k"] == k and rec["batch"] == B and rec["new_tokens"] == N
    assert rec["match_same_width"] and rec["first_difference_same_width"] == [-1] * B
    assert rec["match_width1"] == (rec["first_difference_width1"] == [-1] * B)
    assert rec["rounds"] <= N - 1 and rec["mal"] >= 1.0
    for first, margin in zip(
        rec["first_difference_width1"], rec["margin_at_first_difference"], strict=True
    ):
        assert (margin is None) == (first < 0) and (margin is None or margin >= 0)
    # The gap where a token is predicted: teacher-forced over any continuation.
    tokens = np.asarray(bg.random_prompts(B, N, setup.head_cfg.vocab_size, 4)[0])
    gaps = bg.top2_gaps(forward, head, setup.tcfg, prompts, tokens, [(0, 0), (2, 5)])
    assert len(gaps) == 2 and all(np.isfinite(g) and g >= 0 for g in gaps)


def test_shipped_pair_gaps_come_from_its_hybrid_forward():
    """The exactness section's shipped pair: the hybrid target with snapshots for the widest
    step, its converted head, and gaps from the teacher-forced forward's own logits."""
    tcfg, target, head, dcfg, drafter, forward = bg.shipped_pair(3)
    assert target.init_cache.max_step == 3 and dcfg.vocab_size == tcfg.vocab_size
    assert drafter.fc.in_features == 2 * tcfg.hidden_size
    prompts, _, _ = bg.text_prompts(tcfg, 2, 8, seed=0)
    tokens = np.asarray(bg.random_prompts(2, 4, tcfg.vocab_size, 1)[0])
    (gap,) = bg.top2_gaps(forward, head, tcfg, prompts, tokens, [(1, 2)])
    seq = jnp.concatenate([prompts[1], jnp.asarray(tokens[1, :2])])[None]
    logits = np.asarray(lm_head(head, forward(seq)[0, -1], cfg=tcfg.lm_head_config()))
    top = np.sort(logits)[::-1]
    # The shorter sequence's forward sums in another order (XLA:CPU: ~1e-7 of the logits).
    assert gap == pytest.approx(float(top[0] - top[1]), abs=1e-5 * float(np.abs(top[0])))


def test_init_target_has_reference_init_s_layout_and_scales():

    cfg = bg.target_config(layers=2, smoke=True)  # the smoke run's program
    ours = bg.init_target(cfg, jax.random.key(0))
    ref = jax.eval_shape(lambda: reference.init(cfg, key=jax.random.key(0)))
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    std = lambda w: float(jnp.std(w.w.astype(jnp.float32)))  # noqa: E731
    att, ffn = ours.layers.attention, ours.layers.ffn
    assert std(att.q_proj) == pytest.approx(0.02, rel=0.05)
    for w in (att.o_proj, ffn.down_proj):  # residual outputs: 0.02 / sqrt(2L)
        assert std(w) == pytest.approx(0.02 / np.sqrt(4), rel=0.05)
    assert not np.array_equal(att.q_proj.w[0], att.q_proj.w[1])  # a key per layer


def test_exact_jobs_have_one_program_each():
    """Every K's generate and width K+1 baseline, and the width-1 baseline, under keys of their
    own (``compile_jobs`` keys its lowerings by them)."""
    jobs = bg.exact_jobs(None, None, None, bg.target_config(layers=2, smoke=True), None, None,
                         None, ks=[1, 2, 3, 4], n=N)  # fmt: skip
    assert len({job.key for job in jobs.values()}) == len(jobs) == 9
    assert set(jobs) == {("baseline", w) for w in range(1, 6)} | {
        ("generate", k) for k in range(1, 5)
    }
    assert all(job.key == name for name, job in jobs.items())


@pytest.mark.parametrize("noisy", [False, True])
def test_time_limits_subtracts_the_one_token_call(monkeypatch, noisy):
    """t(run(hi)) - t(run(1)) from the least of each; a difference that is not positive (run(1)
    disturbed every time) raises, except in a smoke run, which takes t(run(hi))."""
    costs = {1: [0.009, 0.008, 0.010] if noisy else [0.002, 0.001, 0.003], 40: [0.007, 0.006]}
    calls = collections.defaultdict(int)

    def wall(fn):
        n = fn()
        t = costs[n][calls[n] % len(costs[n])]
        calls[n] += 1
        return t, n

    monkeypatch.setattr(bg, "_wall", wall)
    if noisy:
        with pytest.raises(RuntimeError, match=r"no longer than run\(1\) at 8\.00 ms: timing"):
            bg.time_limits(lambda n: n, hi=40, reps=3)
        assert bg.time_limits(lambda n: n, hi=40, reps=3, smoke=True) == (0.006, 40)
    else:
        dt, out = bg.time_limits(lambda n: n, hi=40, reps=3, smoke=True)
        assert dt == pytest.approx(0.006 - 0.001) and out == 40


def test_first_difference():
    a = np.array([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    b = np.array([[1, 2, 3], [1, 9, 3], [0, 5, 7]])
    np.testing.assert_array_equal(bg.first_difference(a, b), [-1, 1, 0])


def test_text_prompts_are_heldout_windows():
    tcfg = hybrid.HybridConfig.from_hf(bg.demo.ASSET_DIR)
    prompts, lengths, source = bg.text_prompts(tcfg, 3, 16, seed=0)
    assert source == "heldout" and prompts.shape == (3, 16)
    np.testing.assert_array_equal(lengths, 16)
    assert int(prompts.min()) >= 0 and int(prompts.max()) < tcfg.vocab_size
    assert len({tuple(row) for row in np.asarray(prompts).tolist()}) == 3


def test_command_buffer_options_only_on_gpu():
    for variant in bg.COMMAND_BUFFERS:
        assert bg.compiler_options(variant, gpu=False) is None
        assert bg.compiler_options(variant, gpu=False, profiling=True) is None
    assert bg.compiler_options("off", gpu=True) == {"xla_gpu_enable_command_buffer": ""}
    assert bg.compiler_options("off", gpu=True, profiling=True) == {
        "xla_gpu_enable_command_buffer": ""
    }
    assert bg.compiler_options("default", gpu=True) is None
    assert bg.compiler_options("default", gpu=True, profiling=True) == {
        "xla_enable_command_buffers_during_profiling": True
    }
    loops = bg.compiler_options("loops", gpu=True)
    assert loops["xla_gpu_graph_min_graph_size"] == 1
    commands = loops["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUSTOM_CALL"} <= set(commands)
    with pytest.raises(ValueError, match="command-buffer variant 'graphs'"):
        bg.compiler_options("graphs", gpu=True)


def test_command_buffer_options_parse_in_this_jaxlib():
    """The options are DebugOptions fields (shared by every backend: XLA:CPU parses and ignores
    the GPU ones), so a bad name or value fails here, not on the GPU."""
    lowered = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(4))
    for variant in bg.COMMAND_BUFFERS:
        options = bg.compiler_options(variant, gpu=True, profiling=True)
        np.testing.assert_allclose(
            lowered.compile(compiler_options=options)(jnp.ones(4)), 2 * np.sin(1)
        )
    with pytest.raises(Exception, match="not a valid enum value"):
        lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": "+WHILE"})


class _Lowered:
    def __init__(self, seen):
        self.seen = seen

    def compile(self, compiler_options=None):
        self.seen.append(compiler_options)
        return "compiled"


class _Fn:
    def __init__(self, seen):
        self.seen = seen

    def lower(self, *args):
        return _Lowered(self.seen)


def test_compile_all_applies_the_options_on_gpu_only():
    for gpu, expected in ((False, None), (True, {"xla_gpu_enable_command_buffer": ""})):
        seen = []
        jobs = [bp.Job(key=("j", i), fn=_Fn(seen), args=()) for i in range(2)]
        used = bg.compile_all(jobs, variant="off", gpu=gpu, workers=1, desc="test")
        assert used == expected and seen == [expected, expected]
        assert all(job.compiled == "compiled" and job.error is None for job in jobs)


def test_arguments():
    args = bg.parse_args(["--smoke", "--rates", "0.5,0.25", "--check-exact"])
    assert args.sections == ["exact"] and args.rates == [("0.5,0.25", (0.5, 0.25))]
    assert args.batches == [B] and args.ks == list(KS) and args.heads == ["bf16"]
    assert bg.parse_args([]).heads == ["nvfp4", "bf16"]
    with pytest.raises(SystemExit):
        bg.parse_args(["--rates", "0.5,1.5"])
    with pytest.raises(SystemExit):  # K up to 4 needs four rates
        bg.parse_args(["--rates", "0.5,0.4"])
    assert bg.grid_points([1, 2, 3, 4], [1, 8, 32], "star") == [
        (1, 1), (2, 1), (3, 1), (4, 1), (3, 8), (3, 32)
    ]  # fmt: skip
    assert len(bg.grid_points([1, 2, 3, 4], [1, 8, 32], "full")) == 12
