"""The speculative generation loop on the shipped trained pair (its Qwen3.5-architecture hybrid
target, Gated DeltaNet layers rolled back by snapshot selection): greedy speculation equals plain
greedy decoding token for token on held-out code for k = 1..4, with a BF16 and an FP8 drafter;
sampling produces valid tokens; the loop traces once for any prompt lengths; every spelling of an
argument shares one program (on a small random hybrid pair, whose programs compile quickly)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from mtpjax import demo, hybrid
from mtpjax import drafter as drafter_lib
from mtpjax import generation as gen
from mtpjax.checkpoint import convert, load_drafter
from mtpjax.config import DrafterConfig
from mtpjax.drafter import supports_prefill
from mtpjax.weights import WeightFormat
from pallas_kernels.implementation import Implementation

ASSETS = demo.ASSET_DIR
T = 40  # padded prompt width
N = 24  # new tokens per prompt
MIN_PROMPTS = 16
MAX_STEP = 5  # rows of the widest target step: k + 1 for k = 4


# --------------------------------------------------------------------------------------------
# Fixtures: the pair, a converted FP8 drafter, held-out prompts.


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The hybrid target and the shipped MTP head through the converter at BF16."""
    tcfg = hybrid.HybridConfig.from_hf(ASSETS)
    target, head = hybrid.load(ASSETS, cfg=tcfg)
    out = tmp_path_factory.mktemp("converted") / "bf16"
    convert(ASSETS, out, precision="bf16", progress=False)
    dcfg, ckpt = load_drafter(out)
    return dict(tcfg=tcfg, target=target, head=head, dcfg=dcfg, drafter=ckpt.modules[0])


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """The shipped head through the converter at FP8: (drafter cfg, drafter, its FP8 head)."""
    out = tmp_path_factory.mktemp("converted") / "fp8"
    convert(ASSETS, out, precision="fp8", progress=False)
    dcfg, ckpt = load_drafter(out)
    return dcfg, ckpt.modules[0], ckpt.head


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(ASSETS / "tokenizer.json"))


def heldout_prompts(tokenizer, *, per_file: int = 1, width: int = T, seed: int = 0):
    """Windows of held-out stdlib files, ragged lengths 6..width: (int32[B, width], int32[B])."""
    rng = np.random.default_rng(seed)
    rows = []
    for path in demo.heldout_files():
        ids = tokenizer.encode(path.read_text(encoding="utf-8")).ids
        for _ in range(per_file):
            n = int(rng.integers(6, width + 1))
            if len(ids) <= n:
                continue
            start = int(rng.integers(0, len(ids) - n))
            rows.append(ids[start : start + n])
    prompts = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        prompts[i, : len(r)] = r
    return prompts, np.array([len(r) for r in rows], np.int32)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    p, lengths = heldout_prompts(tokenizer)
    assert len(p) >= MIN_PROMPTS, f"only {len(p)} held-out prompts"
    assert len(set(lengths.tolist())) > 10  # genuinely ragged
    return p, lengths


class CountingCalls:
    """A static callable that counts how often it is traced."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.fixture(scope="module")
def target(pair):
    """The hybrid target, its prefill and step wrapped to count their traces; its state keeps
    GDN snapshots for the widest verify step of the tests."""
    model = hybrid.target_model(pair["tcfg"], pair["target"], pair["head"], max_step=MAX_STEP)
    return gen.TargetModel(
        params=model.params,
        init_cache=model.init_cache,
        prefill=CountingCalls(model.prefill),
        step=CountingCalls(model.step),
    )


@pytest.fixture(scope="module")
def baseline(pair, target, prompts):
    """Plain greedy decoding, one compile per (step_width, eos_id), shared across drafters."""

    @functools.cache
    def run(step_width: int, eos_id: int | None):
        out = gen.generate_baseline(
            target,
            pair["head"],
            *prompts,
            head_cfg=pair["tcfg"].lm_head_config(),
            max_new_tokens=N,
            step_width=step_width,
            eos_id=eos_id,
        )
        return jax.device_get(out)

    return run


@pytest.fixture(scope="module")
def speculative(pair, fp8, target, prompts):
    """Greedy speculation with a BF16 or FP8 drafter, one run per (k, precision, eos_id), shared
    by the exactness and the tracing tests."""

    @functools.cache
    def run(k: int, precision: str, eos_id: int | None):
        if precision == "bf16":
            dcfg, drafter, dhead = pair["dcfg"], pair["drafter"], pair["head"]
        else:
            dcfg, drafter, dhead = fp8
        out = gen.generate(
            target,
            drafter,
            pair["head"],
            *prompts,
            drafter_cfg=dcfg,
            head_cfg=pair["tcfg"].lm_head_config(),
            max_new_tokens=N,
            num_drafts=k,
            drafter_head=dhead,
            eos_id=eos_id,
        )
        return jax.device_get(out)

    return run


def common_eos(tokenizer) -> int:
    """A frequent token (a newline with indentation) that stops many sequences early."""
    ids = tokenizer.encode("    x = 1\n    y = 2\n").ids
    return max(set(ids), key=ids.count)


# --------------------------------------------------------------------------------------------
# Exactness.


# Each k once on the trained pair (test_hybrid runs k = 1 and 4 on a random pair made to accept
# partially): the BF16 drafter at k = 1, 3 and 4 (with an eos that stops some sequences early),
# the FP8 drafter, whose prompt rows go through propose, at k = 2.
@pytest.mark.parametrize("k, precision", [(1, "bf16"), (2, "fp8"), (3, "bf16"), (4, "bf16")])
def test_greedy_speculation_equals_plain_greedy(
    pair, fp8, prompts, speculative, baseline, tokenizer, k, precision
):
    if precision == "bf16":
        assert supports_prefill(pair["drafter"])  # the drafter-prefill path
    else:
        _, drafter, dhead = fp8
        assert drafter.layer.attention.q_proj.format is WeightFormat.FP8
        assert dhead.weight.format is WeightFormat.FP8
        assert not supports_prefill(drafter)  # the prompt's rows go through propose
    eos_id = common_eos(tokenizer) if k == 4 else None
    B = prompts[0].shape[0]
    spec = speculative(k, precision, eos_id)
    base = baseline(k + 1, eos_id)

    np.testing.assert_array_equal(spec.tokens, base.tokens)
    np.testing.assert_array_equal(spec.lengths, base.lengths)
    np.testing.assert_array_equal(spec.kv_error, 0)

    # Output layout: valid ids before `lengths`, -1 after; eos only as the last token.
    cols = np.arange(N)[None, :]
    written = cols < spec.lengths[:, None]
    assert np.all((spec.tokens >= 0) == written)
    assert np.all(spec.tokens < pair["tcfg"].vocab_size)
    if eos_id is None:
        np.testing.assert_array_equal(spec.lengths, N)
        assert int(base.target_steps) == N - 1
    else:
        stopped = spec.lengths < N
        assert 0 < stopped.sum() < B  # the eos path is exercised, not everywhere
        last = spec.tokens[np.arange(B), spec.lengths - 1]
        assert np.all(last[stopped] == eos_id)
        assert not np.any((spec.tokens == eos_id) & (cols < spec.lengths[:, None] - 1))

    # Bookkeeping: every active round drafts k tokens and emits accepted + 1 of them.
    m = spec.metrics
    assert int(m.num_drafts) == int(spec.active_steps.sum())
    assert int(m.num_draft_tokens) == k * int(m.num_drafts)
    emitted = int(m.num_accepted_tokens) + int(m.num_drafts)
    assert int((spec.lengths - 1).sum()) <= emitted <= int((spec.lengths - 1).sum()) + B * k
    assert int(spec.target_steps) == int(spec.active_steps.max())
    assert int(spec.target_steps) < int(base.target_steps)  # speculation saves forwards
    assert m.mean_acceptance_length() > 1.3
    assert 0 < int(m.num_accepted_tokens) < int(m.num_draft_tokens)  # partial accepts too


# --------------------------------------------------------------------------------------------
# Sampling.


def test_sampled_generation_produces_valid_tokens(pair, target, prompts):
    p, lengths = prompts[0][:8], prompts[1][:8]
    V = pair["tcfg"].vocab_size
    kw = dict(head_cfg=pair["tcfg"].lm_head_config(), max_new_tokens=16, temperature=0.8)
    runs = {}
    for seed in (1, 2):
        runs["spec", seed] = gen.generate(
            target,
            pair["drafter"],
            pair["head"],
            p,
            lengths,
            drafter_cfg=pair["dcfg"],
            num_drafts=2,
            key=jax.random.key(seed),
            **kw,
        )
        runs["base", seed] = gen.generate_baseline(
            target, pair["head"], p, lengths, key=jax.random.key(seed), **kw
        )
    runs = jax.device_get(runs)
    for out in runs.values():
        np.testing.assert_array_equal(out.lengths, 16)
        assert np.all((out.tokens >= 0) & (out.tokens < V))
    for kind in ("spec", "base"):  # the key is used: other draws, other tokens
        assert np.any(runs[kind, 1].tokens != runs[kind, 2].tokens)
    m = runs["spec", 1].metrics
    assert int(m.num_drafts) == int(runs["spec", 1].active_steps.sum()) > 0
    assert 0 < int(m.num_accepted_tokens) <= int(m.num_draft_tokens)


def test_sampling_needs_a_key(pair, target, prompts):
    with pytest.raises(ValueError, match="key"):
        gen.generate_baseline(
            target,
            pair["head"],
            *prompts,
            head_cfg=pair["tcfg"].lm_head_config(),
            max_new_tokens=4,
            temperature=1.0,
        )


# --------------------------------------------------------------------------------------------
# Tracing.


def test_loop_traces_once_for_any_prompt_lengths(pair, target, prompts, speculative):
    """New prompts with other lengths (same batch and width) reuse the compiled loop."""
    kw = dict(
        drafter_cfg=pair["dcfg"],
        head_cfg=pair["tcfg"].lm_head_config(),
        max_new_tokens=N,
        num_drafts=1,
    )
    before = (target.prefill.calls, target.step.calls)
    first = speculative(1, "bf16", None)  # the same call: the BF16 drafter, its head the target's
    traced = (target.prefill.calls, target.step.calls)
    # Compiled here or by an earlier test; a compile traces the prefill and the round once.
    assert traced[0] - before[0] == traced[1] - before[1] in (0, 1)
    assert min(traced) >= 1
    for shift in (1, 2):
        # Other prompts in every slot, each cut shorter: new tokens and new lengths.
        p = np.roll(prompts[0], shift, axis=0)
        lengths = np.maximum(np.roll(prompts[1], shift) - 3 * shift, 1)
        lengths[shift] = 1  # a one-token prompt: no drafter prefill rows, the anchor alone
        assert np.any(lengths != prompts[1])
        out = gen.generate(target, pair["drafter"], pair["head"], p, lengths, **kw)
        assert (target.prefill.calls, target.step.calls) == traced, "retraced for new lengths"
        np.testing.assert_array_equal(out.lengths, N)
    assert np.any(np.asarray(out.tokens) != np.asarray(first.tokens))


# --------------------------------------------------------------------------------------------
# Argument checks.


def test_clear_errors(pair, target, prompts):
    kw = dict(drafter_cfg=pair["dcfg"], head_cfg=pair["tcfg"].lm_head_config())
    with pytest.raises(TypeError, match="TargetModel"):
        gen.generate(
            pair["target"],
            pair["drafter"],
            pair["head"],
            *prompts,
            max_new_tokens=4,
            num_drafts=1,
            **kw,
        )
    with pytest.raises(ValueError, match="num_drafts"):
        gen.generate(
            target, pair["drafter"], pair["head"], *prompts, max_new_tokens=4, num_drafts=0, **kw
        )
    with pytest.raises(ValueError, match="lengths"):
        gen.generate(
            target,
            pair["drafter"],
            pair["head"],
            prompts[0],
            prompts[1][:3],
            max_new_tokens=4,
            num_drafts=1,
            **kw,
        )
    with pytest.raises(ValueError, match="eos_id"):
        gen.generate(
            target,
            pair["drafter"],
            pair["head"],
            *prompts,
            max_new_tokens=4,
            num_drafts=1,
            eos_id=10**6,
            **kw,
        )
    with pytest.raises(ValueError, match="hidden_contract"):
        gen.generate(
            target,
            pair["drafter"],
            pair["head"],
            *prompts,
            max_new_tokens=4,
            num_drafts=1,
            hidden_contract="sideways",
            **kw,
        )


def test_prompts_and_lengths_out_of_range_name_the_sequence(pair, target, prompts):
    p, lengths = np.array(prompts[0][:4]), np.array(prompts[1][:4])
    V, width = pair["tcfg"].vocab_size, p.shape[1]
    head_cfg = pair["tcfg"].lm_head_config()
    spec = dict(drafter_cfg=pair["dcfg"], max_new_tokens=4, num_drafts=1)
    for bad, message in [
        (0, rf"lengths\[2\]=0: expected a prompt length in \[1, {width}\]"),
        (-3, rf"lengths\[2\]=-3: expected a prompt length in \[1, {width}\]"),
        (width + 1, rf"lengths\[2\]={width + 1}: expected a prompt length in \[1, {width}\]"),
    ]:
        for run in (
            lambda n: gen.generate(
                target, pair["drafter"], pair["head"], p, n, head_cfg=head_cfg, **spec
            ),
            lambda n: gen.generate_baseline(
                target, pair["head"], p, n, head_cfg=head_cfg, max_new_tokens=4
            ),
        ):
            with pytest.raises(ValueError, match=message):
                run(np.where(np.arange(4) == 2, bad, lengths))
    for bad in (-1, V):
        ids = p.copy()
        ids[1, lengths[1] - 1] = bad
        message = (
            rf"prompts\[1, {lengths[1] - 1}\]={bad} \(sequence 1, length {lengths[1]}\): "
            rf"expected a token id in \[0, {V}\)"
        )
        with pytest.raises(ValueError, match=message):
            gen.generate_baseline(
                target, pair["head"], ids, lengths, head_cfg=head_cfg, max_new_tokens=4
            )


def test_traced_prompts_are_clamped_into_range():
    prompts = np.array([[5, -2, 9, 300], [7, 8, 1, 2]], np.int32)
    ids, lengths = gen._prompt_rows(jnp.asarray(prompts), jnp.asarray([3, 0], jnp.int32), 256)
    np.testing.assert_array_equal(lengths, [3, 1])
    np.testing.assert_array_equal(ids, [[5, 0, 9, 0], [7, 0, 0, 0]])


def test_configs_and_implementation_errors(pair, target, prompts):
    dcfg, head_cfg = pair["dcfg"], pair["tcfg"].lm_head_config()
    with pytest.raises(TypeError, match="drafter_cfg and head_cfg must be passed by name"):
        gen.generate(target, pair["drafter"], pair["head"], *prompts, dcfg)
    with pytest.raises(TypeError, match="head_cfg must be passed by name"):
        gen.generate_baseline(target, pair["head"], *prompts, head_cfg)
    with pytest.raises(ValueError, match="unknown implementation 'gpu'; expected one of"):
        gen.generate_baseline(
            target,
            pair["head"],
            *prompts,
            head_cfg=head_cfg,
            max_new_tokens=4,
            implementation="gpu",
        )
    with pytest.raises(ValueError, match="unknown implementation 'gpu'; expected one of"):
        hybrid.target_model(pair["tcfg"], pair["target"], pair["head"], implementation="gpu")


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer random hybrid target (traces counted) and a random drafter: (target config,
    target, head, drafter config, drafter)."""
    cfg = hybrid.HybridConfig.tiny(num_hidden_layers=2, full_attention_interval=2)
    params, head = hybrid.init(cfg, key=jax.random.key(0))
    dcfg = DrafterConfig.tiny(vocab_size=cfg.vocab_size)
    drafter = drafter_lib.init(dcfg, key=jax.random.key(1))
    model = hybrid.target_model(cfg, params, head, max_step=3)
    target = gen.TargetModel(
        params=model.params,
        init_cache=model.init_cache,
        prefill=CountingCalls(model.prefill),
        step=CountingCalls(model.step),
    )
    return cfg, target, head, dcfg, drafter


def test_every_spelling_of_an_argument_shares_one_program(tiny):
    """``implementation`` by enum or name in any case, the default ``refeed`` given or not,
    and any spelling of a temperature: one program for greedy, one for sampling (the
    temperature is traced), for ``generate`` and ``generate_baseline`` alike."""
    cfg, target, head, dcfg, drafter = tiny
    rng = np.random.default_rng(5)
    p = rng.integers(0, cfg.vocab_size, (3, 6)).astype(np.int32)
    lengths = np.array([2, 6, 4], np.int32)
    head_cfg = cfg.lm_head_config()
    greedy = [
        {},
        dict(implementation="AUTO"),
        dict(implementation=Implementation.AUTO),
        dict(temperature=0.0, key=jax.random.key(0)),
        dict(temperature=np.float32(0)),
    ]
    key = jax.random.key(1)
    sampling = [dict(temperature=t, key=key) for t in (0.8, np.float32(0.8), jnp.float32(0.8), 1.2)]
    runs = {
        "spec": lambda **kw: gen.generate(
            target,
            drafter,
            head,
            p,
            lengths,
            drafter_cfg=dcfg,
            head_cfg=head_cfg,
            max_new_tokens=3,
            num_drafts=2,
            **kw,
        ),
        "base": lambda **kw: gen.generate_baseline(
            target, head, p, lengths, head_cfg=head_cfg, max_new_tokens=3, **kw
        ),
    }
    for name, run in runs.items():
        before = target.prefill.calls
        spellings = greedy + ([dict(refeed=False)] if name == "spec" else [])
        outs = [jax.device_get(run(**kw)) for kw in spellings]
        assert target.prefill.calls - before == 1, name
        for out in outs[1:]:
            np.testing.assert_array_equal(out.tokens, outs[0].tokens)
        outs = [jax.device_get(run(**kw)) for kw in sampling]
        assert target.prefill.calls - before == 2, name
        for out in outs[1:3]:
            np.testing.assert_array_equal(out.tokens, outs[0].tokens)
