"""The drafter's propose against the independent PyTorch reference (``benchmarks.torch_reference``)
on the weights and KV rows ``benchmarks.propose`` times: the F32 reference must draft exactly the
tokens of the XLA path, chain and all. The body runs on the tiny heads on the CPU and, marked
``gpu``, at the real shapes (``pytest -m gpu``). Skips without torch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import propose as bp

ON_GPU = jax.default_backend() == "gpu"
GPU = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]
#: The heads the PyTorch reference implements (it has no MLA attention: the DeepSeek head's
#: numerics are checked against transformers' modules in tests/test_mla.py instead).
TORCH_HEADS = tuple(h for h in bp.HEADS if bp.head_config(h, smoke=True).mla is None)
#: (head, precision, K, B, context, real shapes).
CASES = [
    pytest.param(head, prec, 2, 4, 40, False, id=f"tiny-{head}-{prec}")
    for head in TORCH_HEADS
    for prec in ("bf16-nvfp4head", "nvfp4")
] + [
    pytest.param(head, "nvfp4", 5, 8, 4096, True, id=f"gpu-{head}-nvfp4", marks=GPU)
    for head in TORCH_HEADS
]


def compare_drafts(jt, jp, jh, tt, tp, th) -> dict:
    """Agreement of two draft chains (tokens [B, K], probs [B, K], hidden [B, K, H]).

    After the first disagreement a chain legitimately diverges, so agreement is the common
    prefix per sequence; probabilities are compared over that prefix, hidden states at step 0.
    """
    _, K = jt.shape
    same = jt == tt
    prefix = np.where(same.all(1), K, np.argmin(same, axis=1))
    mask = np.arange(K)[None, :] < prefix[:, None]
    hid0 = float(np.linalg.norm(th[:, 0] - jh[:, 0]) / max(np.linalg.norm(jh[:, 0]), 1e-30))
    prob_err = float(np.max(np.abs(tp - jp)[mask] / np.abs(jp)[mask])) if mask.any() else None
    return dict(
        all_match=bool((prefix == K).all()),
        first_draft_match=float(np.mean(prefix >= 1)),
        chain_match=float(prefix.mean() / K),
        hidden_rel_err=hid0,
        prob_rel_err=prob_err,
    )


@pytest.mark.parametrize(("head_name", "prec", "k", "b", "context", "real"), CASES)
def test_propose_drafts_the_pytorch_reference_tokens(head_name, prec, k, b, context, real):
    torch = pytest.importorskip("torch")
    from benchmarks import torch_reference as ref
    from mtpjax import drafter
    from mtpjax.head import init_lm_head

    cfg = bp.head_config(head_name, smoke=not real)
    dprec, hprec = bp.PRECISIONS[prec]
    key = jax.random.key(0)
    params = drafter.init(cfg, key=jax.random.fold_in(key, 1), precision=dprec)
    head = init_lm_head(cfg.lm_head_config(), key=jax.random.fold_in(key, 2), precision=hprec)
    pool_cfg = drafter.pool_config(cfg, precision=dprec, max_seq_len=context + k + 1, max_seqs=b)
    state_key = jax.random.fold_in(key, 3)
    pairs = bp.make_pairs(jax.random.fold_in(key, 4), cfg, k=k, batch=b, context=context)

    def drafts(impl: str):
        state = bp.filled_state(state_key, pool_cfg=pool_cfg, num_seqs=b, context=context)
        with jax.default_matmul_precision("highest"):
            out, _ = bp.propose_fn(cfg, k, impl)(params, head, state, pairs)
        return [np.asarray(x) for x in (out.tokens, out.probs, out.hidden)]

    dev = "cuda" if ON_GPU and torch.cuda.is_available() else "cpu"
    state = bp.filled_state(state_key, pool_cfg=pool_cfg, num_seqs=b, context=context)
    kk, vv = jax.block_until_ready(bp.held_rows(state.kv[0], context))
    kc, vc = ref.kv_cache_from_rows(
        ref.to_torch(kk, torch.float32).to(dev),
        ref.to_torch(vv, torch.float32).to(dev),
        capacity=context + k,
        dtype=torch.float32,
    )
    del state
    weights = ref.weights_from_jax(params, head, cfg, dtype=torch.float32).to(dev)
    model = ref.TorchDrafter(weights, ref.Dims.from_config(cfg), kv_round=pool_cfg.kv_dtype.value)
    tok = torch.from_numpy(np.array(pairs.tokens[:, 0], np.int64)).to(dev)
    hid = torch.from_numpy(np.array(pairs.hidden[:, 0].astype(jnp.float32))).to(dev)
    length = torch.full((b,), context, dtype=torch.long, device=dev)
    anchor = torch.full((b,), context - 1, dtype=torch.long, device=dev)
    old = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")  # F32 matmuls without TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            want = model.propose(tok, hid, anchor, kc, vc, length, num_drafts=k)
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cuda.matmul.allow_tf32 = old[1]
    want = [x.cpu().numpy() for x in want]

    xla = compare_drafts(*drafts("xla"), *want)
    assert xla["all_match"] and xla["chain_match"] == 1.0, xla
    assert xla["hidden_rel_err"] < 1e-5 and xla["prob_rel_err"] < 1e-4, xla
    # The default path (the Pallas kernels on the GPU, BF16 activations into them) drafts the
    # same first token; near-tied random logits may part the chains after it.
    auto = compare_drafts(*drafts("auto"), *want)
    if ON_GPU:
        assert auto["first_draft_match"] == 1.0 and auto["hidden_rel_err"] < 1e-2, auto
    else:
        assert auto == xla
