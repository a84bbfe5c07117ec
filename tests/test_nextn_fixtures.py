"""The GLM-4.5 NextN and MiMo drafters against transformers' goldens (tests/fixtures/nextn,
written by scripts/make_nextn_fixtures.py): each HF directory goes through the converter and
``load_drafter``; the teacher-forced forward of every module, module 0 chaining itself for
k = 1..4 drafts after a prefill (the family's default contract) and GLM's two modules under the
CLAMP schedule are compared with what transformers' decoder layers computed in float32 on the
same BF16 weights. Every hidden contract is checked against the dense forward run on the rows
the chain wrote.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax import drafter
from mtpjax.checkpoint import convert, load_drafter
from mtpjax.config import Architecture, HiddenContract

FIXTURES = Path(__file__).parent / "fixtures" / "nextn"
FAMILIES = {"glm4_moe": Architecture.GLM4_MOE, "mimo": Architecture.MIMO}
EPS = float(np.finfo(np.float32).eps)


def tol(golden: np.ndarray, hidden_size: int, rows: int) -> float:
    """Float32 rounding through one MTP layer, as an absolute bound on ``golden``'s scale:
    eps * sqrt(reduction length) for the dots over 2H (the input projection), H and the
    attention's sum over ``rows``, times 8 for the four norms that rescale the inputs."""
    reduction = math.sqrt(rows * 2 * hidden_size)
    return 8 * reduction * EPS * float(np.abs(golden).max())


def paged_tol(golden: np.ndarray) -> float:
    """The paged path (prefill, propose) stores K/V in BF16 (relative rounding <= 2^-9 each);
    through attention, the layer and the head that bounds its outputs by 4 * 2^-9 of their
    scale: 3-6x what is observed on these fixtures, far above float32 rounding."""
    return 4 * 2.0**-9 * float(np.abs(golden).max())


def close(found, golden, hidden_size: int, rows: int, what: str, *, paged=False) -> None:
    found, golden = np.asarray(found), np.asarray(golden)
    assert found.shape == golden.shape, what
    bound = paged_tol(golden) if paged else tol(golden, hidden_size, rows)
    err = float(np.abs(found - golden).max())
    assert err <= bound, f"{what}: max |diff| {err:.3e} > {bound:.3e}"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    """(family, cfg, checkpoint, goldens) of a fixture converted at its stored precision."""
    family = request.param
    out = tmp_path_factory.mktemp(family) / "converted"
    convert(FIXTURES / family, out, precision="keep", progress=False)
    cfg, ckpt = load_drafter(out)
    golden = dict(np.load(FIXTURES / family / "golden.npz"))
    return family, cfg, ckpt, golden


def test_config_and_layout(case):
    family, cfg, ckpt, g = case
    assert cfg.architecture is FAMILIES[family] and cfg.runnable
    assert ckpt.num_modules == cfg.num_mtp_modules == g["forward_logits"].shape[0]
    attn = ckpt.modules[0].layer.attention
    assert attn.q_bias is not None and attn.k_bias is not None and attn.v_bias is not None
    if family == "glm4_moe":
        assert cfg.qk_norm and cfg.rotary_dim == cfg.head_dim // 2
        moe = cfg.moe
        assert (moe.n_group, moe.topk_group) == (2, 1) and moe.score_correction_bias
        assert moe.routed_scaling_factor == 2.5 and moe.has_shared_expert
    else:
        assert cfg.rotary_dim == cfg.head_dim and not cfg.qk_norm
    assert cfg.default_hidden_contract is HiddenContract.POST_NORM


def test_teacher_forced_forward_of_every_module(case):
    _, cfg, ckpt, g = case
    H, T = cfg.hidden_size, g["forward_tokens"].shape[1]
    for m, module in enumerate(ckpt.modules):
        out = drafter.drafter_forward(
            module, ckpt.head, g["forward_tokens"], g["forward_hidden"], cfg=cfg
        )
        close(out.residual, g["forward_residual"][m], H, T, f"module {m} residual")
        close(out.h_out, g["forward_h_out"][m], H, T, f"module {m} h_out")
        close(out.logits, g["forward_logits"][m], H, T, f"module {m} logits")


def _start(cfg, ckpt, g, *, num_modules: int = 1):
    """A state holding each sequence's committed pairs but the anchor (the drafter prefill),
    and the anchor window (the last committed pair)."""
    B = g["prompt_tokens"].shape[0]
    n = jnp.asarray(g["lengths"])
    pool = drafter.pool_config(cfg, precision="bf16", max_seq_len=32, max_seqs=B)
    state = drafter.init_state(pool, num_seqs=B, num_modules=num_modules)
    prompt = drafter.Pairs(
        tokens=jnp.asarray(g["prompt_tokens"]),
        hidden=jnp.asarray(g["prompt_hidden"]),
        count=n - 1,
        start=jnp.zeros((B,), jnp.int32),
    )
    params = ckpt.modules[0]
    if num_modules > 1:
        params = drafter.DrafterModules(modules=ckpt.modules)
    state = drafter.prefill(params, ckpt.head, state, prompt, cfg=cfg)
    last = (jnp.arange(B), n - 1)
    anchor = drafter.Pairs(
        tokens=jnp.asarray(g["prompt_tokens"])[last][:, None],
        hidden=jnp.asarray(g["prompt_hidden"])[last][:, None],
        count=jnp.ones((B,), jnp.int32),
        start=n - 1,
    )
    return params, state, anchor


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_chain_of_module_0_matches_transformers(case, k):
    _, cfg, ckpt, g = case
    params, state, anchor = _start(cfg, ckpt, g)
    out, _ = drafter.propose(
        params, ckpt.head, state, anchor, cfg=cfg, num_drafts=k, return_logits=True
    )
    np.testing.assert_array_equal(out.tokens, g["chain_tokens"][:, :k])
    rows = int(g["lengths"].max()) + k
    close(out.logits, g["chain_logits"][:, :k], cfg.hidden_size, rows, f"k={k}", paged=True)


def test_modules_under_clamp_match_transformers(case):
    family, cfg, ckpt, g = case
    if cfg.num_mtp_modules == 1:
        pytest.skip(f"{family}'s fixture has one module")
    params, state, anchor = _start(cfg, ckpt, g, num_modules=cfg.num_mtp_modules)
    out, _ = drafter.propose(
        params, ckpt.head, state, anchor, cfg=cfg, num_drafts=4, return_logits=True
    )
    assert out.tokens.shape[1] == cfg.num_mtp_modules  # clamped
    np.testing.assert_array_equal(out.tokens, g["clamp_tokens"])
    rows = int(g["lengths"].max())
    close(out.logits, g["clamp_logits"], cfg.hidden_size, rows, "clamp logits", paged=True)
    assert np.any(out.tokens[:, 1] != g["chain_tokens"][:, 1])  # module 1 is not module 0


@pytest.mark.parametrize("contract", list(HiddenContract))
def test_every_contract_chains_the_hidden_it_names(case, contract):
    """propose's chain equals the dense forward over the committed pairs followed by the rows
    (d_s, g_{s-1}), g the contract's hidden of the step before; the contracts disagree."""
    _, cfg, ckpt, g = case
    K = 3
    params, state, anchor = _start(cfg, ckpt, g)
    out, _ = drafter.propose(
        params,
        ckpt.head,
        state,
        anchor,
        cfg=cfg,
        num_drafts=K,
        hidden_contract=contract,
        return_logits=True,
    )
    for b, n in enumerate(g["lengths"]):
        tokens = list(g["prompt_tokens"][b, :n])
        hidden = list(g["prompt_hidden"][b, :n])
        for s in range(K):
            ref = drafter.drafter_forward(
                params, ckpt.head, np.array(tokens, np.int32), np.stack(hidden), cfg=cfg
            )
            logits = np.asarray(ref.logits[-1])
            what = f"{contract} step {s}"
            close(out.logits[b, s], logits, cfg.hidden_size, len(tokens), what, paged=True)
            draft = int(np.argmax(logits))
            assert int(out.tokens[b, s]) == draft
            handed = {
                HiddenContract.POST_NORM: ref.h_out[-1],
                HiddenContract.PRE_NORM: ref.residual[-1],
                HiddenContract.PINNED: g["prompt_hidden"][b, n - 1],
            }[contract]
            close(out.hidden[b, s], handed, cfg.hidden_size, len(tokens), what, paged=True)
            tokens.append(draft)
            hidden.append(np.asarray(handed))
    if contract is not cfg.default_hidden_contract:
        default, _ = drafter.propose(
            params,
            ckpt.head,
            _start(cfg, ckpt, g)[1],
            anchor,
            cfg=cfg,
            num_drafts=K,
            return_logits=True,
        )
        assert not np.allclose(default.logits[:, 1:], out.logits[:, 1:], atol=1e-3)


def test_zero_embedding_at_key_0_is_what_transformers_reads(case):
    """The golden forward starts at position 0; dropping the rule changes row 0's output."""
    _, cfg, ckpt, g = case
    other = dataclasses.replace(cfg, zero_embedding_at_position_0=False)
    tokens, hidden = g["forward_tokens"], g["forward_hidden"]
    out = drafter.drafter_forward(ckpt.modules[0], ckpt.head, tokens, hidden, cfg=other)
    assert float(jnp.abs(out.logits[:, 0] - g["forward_logits"][0][:, 0]).max()) > 1e-2
    # Rows past key 0 still differ through attention to row 0, but the rule applies there only.
    positions = jnp.broadcast_to(jnp.arange(1, tokens.shape[1] + 1), tokens.shape)
    shifted = drafter.drafter_forward(
        ckpt.modules[0], ckpt.head, tokens, hidden, cfg=cfg, positions=positions
    )
    assert not np.allclose(np.asarray(shifted.logits[:, 0]), g["forward_logits"][0][:, 0])
