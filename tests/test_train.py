"""mtpjax.train: the K-step chain loss on a tiny random head. The chain equals the paged
``propose`` on the same inputs (drafts and handed-over hidden, every contract); one step is the
single-step MTP loss over ``drafter_forward``; the distillation term is the KL it says; only the
head's leaves get a gradient; a train step lowers the loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from drafter_helpers import make, new_state, np_tree, pairs, random_pairs, tiny_cfg

from mtpjax import drafter, hybrid, train
from mtpjax.config import HiddenContract

K = 3
P = 6  # committed positions before the anchor's token


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    params, head = make(cfg)
    tokens, hidden = random_pairs(np.random.default_rng(3), (2, P + K))
    return cfg, params, head, tokens, hidden


@pytest.mark.parametrize("contract", list(HiddenContract))
def test_chain_equals_paged_propose(setup, contract):
    # propose from the anchor (x_P, h_{P-1}) after a prefill of the pairs before it; the chain
    # teacher-forced on [x_1..x_P, d_1..d_{K-1}] (the drafts in place of the true tokens) must
    # give propose's drafts and hidden at the anchor e = P - 1. The chain rounds K/V to BF16 as
    # the pool stores them, so the two agree to F32 rounding.
    cfg, params, head, tokens, hidden = setup
    B = tokens.shape[0]
    state = new_state(cfg, B)
    state = drafter.prefill(
        params, head, state, pairs(tokens[:, 1:P], hidden[:, : P - 1], [P - 1] * B, [0] * B),
        cfg=cfg,
    )  # fmt: skip
    anchor = pairs(tokens[:, P : P + 1], hidden[:, P - 1 : P], [1] * B, [P - 1] * B)
    out, _ = drafter.propose(
        params, head, state, anchor, cfg=cfg, num_drafts=K, hidden_contract=contract,
        return_logits=True,
    )  # fmt: skip
    out = np_tree(out)
    seq = np.concatenate([tokens[:, 1 : P + 1], out.tokens[:, : K - 1]], axis=1)  # [B, P+K-1]
    hid = np.concatenate([hidden[:, :P], np.zeros_like(hidden[:, : K - 1])], axis=1)
    chain = np_tree(
        train.chain_forward(
            params,
            head,
            seq,
            hid,
            cfg=cfg,
            num_steps=K,
            hidden_contract=contract,
            kv_dtype=jnp.bfloat16,
        )
    )
    assert chain.logits.shape == (B, K, P, cfg.vocab_size)
    np.testing.assert_array_equal(chain.logits[:, :, P - 1].argmax(-1), out.tokens)
    # Steps 0 and 1 agree to F32 rounding. From step 2 on, an F32 difference of 1e-7 before a
    # K/V element's BF16 rounding can flip that rounding (2^-8 relative), which moves the
    # logits (|l| ~ 8) by up to ~1e-4; the paged path against an unrounded forward differs by
    # 5e-2 (test_propose.py::test_paged_path_equals_drafter_forward).
    np.testing.assert_allclose(chain.logits[:, :2, P - 1], out.logits[:, :2], rtol=0, atol=1e-5)
    np.testing.assert_allclose(chain.hidden[:, :2, P - 1], out.hidden[:, :2], rtol=0, atol=2e-6)
    np.testing.assert_allclose(chain.logits[:, :, P - 1], out.logits, rtol=0, atol=2e-4)
    np.testing.assert_allclose(chain.hidden[:, :, P - 1], out.hidden, rtol=0, atol=5e-5)


def _batch(cfg, head, tokens, hidden, *, logits=False, mask=None):
    hidden = jnp.asarray(hidden, jnp.float32)
    target_logits = None
    if logits:
        target_logits = jax.random.normal(jax.random.key(5), (*tokens.shape, cfg.vocab_size))
    if mask is None:
        mask = np.ones(tokens.shape, np.float32)
    return train.Batch(
        tokens=jnp.asarray(tokens), hidden=hidden, target_logits=target_logits, mask=mask
    )


def test_one_step_is_the_single_step_mtp_loss(setup):
    # k = 1: the cross-entropy of drafter_forward's logits (row i = (x_{i+1}, h_i)) against
    # x_{i+2}, over the counted labels.
    cfg, params, head, tokens, hidden = setup
    mask = np.ones(tokens.shape, np.float32)
    mask[:, :3] = 0.0
    mask[1, -2:] = 0.0
    loss, metrics = train.chain_loss(
        params, head, _batch(cfg, head, tokens, hidden, mask=mask), cfg=cfg,
        loss_cfg=train.LossConfig(num_steps=1),
    )  # fmt: skip
    ref = drafter.drafter_forward(params, head, tokens[:, 1:-1], hidden[:, :-2], cfg=cfg)
    ce = optax.softmax_cross_entropy_with_integer_labels(ref.logits, tokens[:, 2:])
    m = mask[:, 2:]
    want = float(np.sum(np.asarray(ce) * m) / m.sum())
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["ce"][0]), want, rtol=1e-5)


def test_steps_are_weighted_and_distillation_is_the_kl(setup):
    cfg, params, head, tokens, hidden = setup
    batch = _batch(cfg, head, tokens, hidden, logits=True)
    assert np.allclose(train.decaying_weights(3), [0.5102, 0.3061, 0.1837], atol=1e-4)
    tau = 2.0
    lcfg = train.LossConfig(num_steps=K, ce_weight=0.5, kl_weight=0.25, temperature=tau)
    loss, metrics = train.chain_loss(params, head, batch, cfg=cfg, loss_cfg=lcfg)
    chain = np_tree(train.chain_forward(params, head, tokens[:, 1:], hidden[:, :-1], cfg=cfg,
                                        num_steps=K))  # fmt: skip
    N = tokens.shape[1]
    R = N - K
    target = np.asarray(batch.target_logits)
    total = 0.0
    for s, w in enumerate(lcfg.weights):
        # Anchors e < R; anchor e's step s predicts x_{e+s+2}, which exists for e + s + 2 < N.
        n = min(R, N - s - 2)
        logq = np.asarray(jax.nn.log_softmax(chain.logits[:, s, :n]))
        ce = -np.take_along_axis(logq, tokens[:, s + 2 : s + 2 + n, None], -1).mean()
        p = np.asarray(jax.nn.log_softmax(target[:, s + 1 : s + 1 + n] / tau))
        q = np.asarray(jax.nn.log_softmax(chain.logits[:, s, :n] / tau))
        kl = tau**2 * (np.exp(p) * (p - q)).sum(-1).mean()
        np.testing.assert_allclose(metrics["ce"][s], ce, rtol=1e-5)
        np.testing.assert_allclose(metrics["kl"][s], kl, rtol=1e-4)
        total += w * (0.5 * ce + 0.25 * kl)
    np.testing.assert_allclose(float(loss), total, rtol=1e-5)


def test_only_the_head_gets_a_gradient():
    # Through the target's own forward: the target's layers, its embedding and its LM head get
    # exactly zero gradient; every MTP leaf gets one.
    tcfg = hybrid.HybridConfig.tiny()
    target, head = hybrid.init(tcfg, key=jax.random.key(0))
    dcfg = tiny_cfg()
    mtp = drafter.init(dcfg, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, tcfg.vocab_size)
    mask = jnp.ones(tokens.shape)
    lcfg = train.LossConfig(num_steps=2, kl_weight=1.0)

    def loss(mtp, target, head):
        batch = train.hybrid_batch(target, head, tokens, mask, cfg=tcfg, with_logits=True)
        return train.chain_loss(mtp, head, batch, cfg=dcfg, loss_cfg=lcfg)[0]

    g_mtp, g_target, g_head = jax.grad(loss, argnums=(0, 1, 2))(mtp, target, head)
    for g in jax.tree.leaves((g_target, g_head)):
        assert not np.any(np.asarray(g, np.float32)), "a frozen leaf got a gradient"
    assert all(np.any(np.asarray(g, np.float32)) for g in jax.tree.leaves(g_mtp))


def test_train_step_lowers_the_loss_and_keeps_f32_masters(setup):
    cfg, params, head, tokens, hidden = setup
    trainable, master = train.Trainable.of(params)
    assert all(m.dtype == jnp.float32 for m in master)
    master = jax.device_put(master, jax.devices()[0])  # committed, as a loaded head's are
    ocfg = train.OptimConfig(lr=3e-3, total_steps=20, warmup_steps=2)
    lcfg = train.LossConfig(num_steps=K)
    state = train.init_train_state(master, ocfg)
    kw = dict(trainable=trainable, cfg=cfg, loss_cfg=lcfg, optim_cfg=ocfg,
              head_cfg=cfg.lm_head_config())  # fmt: skip
    mask = jnp.ones(tokens.shape)
    losses, programs = [], train.train_step._cache_size()
    for _ in range(8):
        state, m = train.train_step(state, head, tokens, hidden, mask, **kw)
        losses.append(float(m["loss"]))
    assert int(state.step) == 8 and losses[-1] < 0.9 * losses[0]
    assert train.train_step._cache_size() == programs + 1  # the first step's serves the rest
    back = trainable.params(state.master)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert [x.dtype for x in jax.tree.leaves(back)] == [x.dtype for x in jax.tree.leaves(params)]


def test_a_quantised_head_is_refused():
    cfg = tiny_cfg()
    params, _ = make(cfg, "fp8")
    with pytest.raises(ValueError, match="BF16 MTP head"):
        train.Trainable.of(params)
