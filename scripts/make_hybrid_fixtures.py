"""Golden fixtures for the Qwen3.5 / Qwen3-Next hybrid target, computed with transformers.

The CPU tests have no torch; this script (run once, in an environment that has torch and
transformers) writes small random checkpoints built with transformers' own classes and what
transformers computes from them, in float32:

    tests/fixtures/hybrid/qwen3_5_dense/    Qwen3.5 dense (``Qwen3_5ForConditionalGeneration``
                                            layout: nested ``text_config``, tensors under
                                            ``model.language_model.*``, split ``in_proj_qkv`` /
                                            ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``),
                                            tied embeddings, ``layer_types`` and
                                            ``rope_parameters`` as the real configs write them.
    tests/fixtures/hybrid/qwen3_next_moe/   Qwen3-Next MoE (``Qwen3NextForCausalLM``: packed
                                            ``in_proj_qkvz`` / ``in_proj_ba`` in the grouped
                                            per-key-head order, routed experts stored per
                                            expert, shared expert and its sigmoid gate), untied
                                            head, and a flat config as the real config.json
                                            writes it: no ``layer_types`` (derived from
                                            ``full_attention_interval``), top-level
                                            ``rope_theta`` / ``partial_rotary_factor``.

Each directory is an HF checkpoint (config.json, model.safetensors) and golden.npz. Both models
have 4 layers (3 ``linear_attention`` then 1 ``full_attention``), odd sizes, more value heads
than key heads, key head dim != value head dim, partial RoPE, and one MTP layer. transformers
drops ``mtp.*`` on load, so the MTP tensors are written here in the real checkpoints' names
(``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``,
``mtp.layers.0.*`` = one full-attention decoder layer of the model's own class, random values).
The Qwen3.5 directory holds no ``model.visual.*`` tensors (text only; transformers' vision
tower loads as missing). ``Qwen3_5ForCausalLM.save_pretrained`` would write ``model.layers.*``;
the real checkpoints' ``model.language_model.*`` is written instead, which transformers maps
back on load.

Every parameter is drawn with numpy from a fixed seed (never transformers' initialisers): norm
offsets, the gated norm's weight, ``A_log``, ``dt_bias`` and the conv weights are moved away from
their init so a wrong formula shows. Values are rounded to bfloat16 and stored as BF16 (as real
checkpoints are); transformers runs in float32 on exactly those values. Before writing the
goldens, the script reloads each directory with ``from_pretrained`` and checks every weight came
back bit-exact (so the directory is what transformers itself reads). A seed is skipped (the next
one tried) when a routing decision is a near tie (k-th and (k+1)-th router logits closer than
1e-3) or when transformers' own cached decode / cached 4-token window differ from its full
forward by more than 2e-5 of the logits' scale (a per-head gated-norm input near zero amplifies
float32 rounding): goldens there would test luck, not an implementation. The output is
byte-identical from run to run.

golden.npz (B = 3 prompts of lengths 11, 7, 16 right-padded to T = 16; L = 4 layers; H hidden,
V vocab; all float32 unless int32; rows past a prompt's length are zero). Every golden comes from
transformers run per sequence, unpadded, without an attention mask:

    tokens            int32[B, T]       the prompts, right-padded with 0
    lengths           int32[B]          11, 7, 16
    prefill_layers    [L + 1, B, T, H]  the input of each decoder layer, then the last layer's
                                        output (the residual before the final norm)
    prefill_hidden    [B, T, H]         after the final norm (output_hidden_states' last entry)
    prefill_logits    [B, T, V]
    prefill_conv_state      [NL, B, C, K - 1]   after the prompt, per linear layer: the last
                                        K - 1 pre-conv mixed q|k|v columns (C = 2*nk*dk + nv*dv,
                                        channels q|k|v head-major), as transformers' cache holds
    prefill_recurrent_state [NL, B, nv, dk, dv] after the prompt, per linear layer
    decode_tokens     int32[B, 6]       fed one at a time after the prompt: token j at position
                                        lengths[b] + j (fixed ids, not sampled)
    decode_logits     [B, 6, V]         transformers' cached decode, output at each of them
    decode_hidden     [B, 6, H]         after the final norm
    window_tokens     int32[B, 4]       a verify window (k + 1 = 4 tokens) at positions
                                        lengths[b] .. lengths[b] + 3
    window_logits     [B, 4, V]         the full forward over prompt + window, at the window
    window_hidden     [B, 4, H]
    rollback_accept   int32[B]          drafts accepted, a = 1, 0, 3 (window[0] is always
                                        committed; window[1 + a:] is rolled back)
    rollback_keep     int32[B]          window tokens committed, a + 1
    rollback_tokens   int32[B, 3]       decoded after the commit: token j at position
                                        lengths[b] + keep[b] + j
    rollback_logits   [B, 3, V]         the full forward over the committed sequence
                                        prompt + window[:keep] + rollback_tokens, at them
    rollback_hidden   [B, 3, H]
    transformers_spread  f32[]          the largest logit difference between transformers' own
                                        paths on these inputs (cached decode and cached window
                                        against the full forward): float32 rounding, the floor
                                        of any comparison
    versions          str               torch and transformers versions used

The JAX test runs ``prefill(tokens, lengths)``, ``step(window, start=lengths)``, then
``step(rollback_tokens, start=lengths + keep)`` and compares with ``rollback_logits``.

Run (the environment is outside the repository; transformers 5.24.0, torch 2.13.0+cpu,
safetensors 0.8.0, numpy 2.4.6, Python 3.11; about 25 s on 2 cores):

    python3 -m venv /work/torchenv
    /work/torchenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /work/torchenv/bin/python scripts/make_hybrid_fixtures.py --out tests/fixtures/hybrid
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import transformers
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

LENGTHS = (11, 7, 16)
DECODE = 6
WINDOW = 4  # k + 1 with k = 3 drafts
ACCEPT = (1, 0, 3)  # drafts accepted per sequence
FURTHER = 3
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
ROUTER_MARGIN = 1e-3  # smallest allowed gap between the k-th and (k+1)-th router logit
SPREAD = 2e-5  # largest allowed disagreement of transformers' own paths, relative to |logits|

# Shapes shared by the HF config and the generator. Sizes are odd on purpose: H != nh * hd,
# nv > nk, dk != dv, V and the FFN widths not powers of two.
QWEN3_5 = dict(
    vocab_size=251,
    hidden_size=72,
    intermediate_size=88,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=12,
    linear_value_head_dim=10,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    max_position_embeddings=512,
)
QWEN3_5_ROPE = dict(
    rope_type="default",
    rope_theta=10_000.0,
    partial_rotary_factor=0.25,  # 6 of 24 dims rotate
    mrope_section=[1, 1, 1],
    mrope_interleaved=True,
)
QWEN3_NEXT = dict(
    vocab_size=263,
    hidden_size=56,
    intermediate_size=104,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=36,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    hidden_act="silu",
    max_position_embeddings=512,
)
QWEN3_NEXT_ROPE = dict(rope_theta=10_000.0, partial_rotary_factor=0.5)  # 8 of 16 dims rotate


# --------------------------------------------------------------------------------------------
# Random parameters.


def _draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A value for parameter ``name`` (transformers' in-memory name) of ``shape``."""
    normal = rng.standard_normal(shape)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.3 * normal  # the gated norm multiplies by its weight itself
    if name.endswith("norm.weight"):
        return 0.3 * normal  # zero-centred norms multiply by (1 + weight)
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.05, 2.0, shape))
    if name.endswith("dt_bias"):
        return 0.5 * normal
    if name.endswith("conv1d.weight"):  # [C, 1, K]
        return 0.5 * normal
    if name.endswith("embed_tokens.weight"):  # also the tied head: logits of order 10
        return 0.25 * normal
    if name.endswith("mlp.gate.weight"):  # the router: sharp enough that top-k has margins
        return 3.0 * normal / np.sqrt(shape[-1])
    if name.endswith("lm_head.weight"):
        return 2.0 * normal / np.sqrt(shape[-1])
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return normal / np.sqrt(shape[-1])  # [E, N, K]
    if len(shape) == 2:  # a projection [out, in]
        return normal / np.sqrt(shape[1])
    raise ValueError(f"no draw rule for parameter {name!r} of shape {shape}")


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)


def _randomise(model: torch.nn.Module, rng: np.random.Generator) -> None:
    """Every parameter from ``rng``, rounded to bfloat16, held in float32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_bf16(_draw(name, tuple(p.shape), rng)).to(torch.float32))


# --------------------------------------------------------------------------------------------
# Checkpoint directories.


def _config_json(kind: str, tied: bool, num_layers: int) -> dict[str, Any]:
    if kind == "qwen3_5":
        text = dict(
            model_type="qwen3_5_text",
            num_hidden_layers=num_layers,
            layer_types=LAYER_TYPES,
            full_attention_interval=4,
            attn_output_gate=True,
            mtp_num_hidden_layers=1,
            mtp_use_dedicated_embeddings=False,
            rope_parameters=QWEN3_5_ROPE,
            tie_word_embeddings=tied,
            attention_bias=False,
            dtype="bfloat16",
            **QWEN3_5,
        )
        return dict(
            architectures=["Qwen3_5ForConditionalGeneration"],
            model_type="qwen3_5",
            tie_word_embeddings=tied,
            text_config=text,
            vision_config=dict(
                model_type="qwen3_5",
                depth=1,
                hidden_size=32,
                num_heads=2,
                intermediate_size=64,
                out_hidden_size=QWEN3_5["hidden_size"],
            ),
            dtype="bfloat16",
        )
    return dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        num_hidden_layers=num_layers,
        full_attention_interval=4,
        num_nextn_predict_layers=1,
        tie_word_embeddings=tied,
        attention_bias=False,
        rope_scaling=None,
        dtype="bfloat16",
        **QWEN3_NEXT_ROPE,
        **QWEN3_NEXT,
    )


def _hf_config(kind: str, tied: bool, num_layers: int, layer_types: list[str]):
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            rope_parameters=dict(QWEN3_5_ROPE),
            tie_word_embeddings=tied,
            **QWEN3_5,
        )
    return Qwen3NextConfig(
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        tie_word_embeddings=tied,
        **QWEN3_NEXT_ROPE,
        **QWEN3_NEXT,
    )


def _model_class(kind: str):
    return Qwen3_5ForCausalLM if kind == "qwen3_5" else Qwen3NextForCausalLM


def _saved_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes (its on-disk names: experts per expert)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return dict(safetensors.torch.load_file(str(Path(tmp) / "model.safetensors")))


def write_checkpoint(out: Path, kind: str, *, tied: bool, seed: int) -> dict[str, torch.Tensor]:
    """Build the model with one extra full-attention layer (the MTP layer's tensors), randomise,
    write the directory in the real layout; returns the tensors written (BF16)."""
    L = len(LAYER_TYPES)
    rng = np.random.default_rng(seed)
    cfg = _hf_config(kind, tied, L + 1, [*LAYER_TYPES, "full_attention"])
    model = _model_class(kind)(cfg).eval()
    _randomise(model, rng)
    saved = _saved_tensors(model)
    H = cfg.hidden_size
    text = "model.language_model." if kind == "qwen3_5" else "model."
    tensors: dict[str, torch.Tensor] = {}
    mtp_layer = f"model.layers.{L}."
    for name, t in saved.items():
        if name.startswith(mtp_layer):
            tensors["mtp.layers.0." + name[len(mtp_layer) :]] = t
        elif name.startswith("model."):
            tensors[text + name[len("model.") :]] = t
        else:
            tensors[name] = t
    assert ("lm_head.weight" in tensors) != tied, sorted(tensors)[:4]
    tensors["mtp.fc.weight"] = _bf16(rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H))
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = _bf16(0.3 * rng.standard_normal(H))
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = _config_json(kind, tied, L)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tensors


def load_checked(out: Path, kind: str, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``from_pretrained`` on the directory, checking every weight arrived bit-exact."""
    model, info = _model_class(kind).from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    if info["missing_keys"] or info["mismatched_keys"]:
        raise AssertionError(f"{out}: transformers did not load {info}")
    assert model.config.layer_types == LAYER_TYPES, model.config.layer_types
    # Saving a loaded model writes the names it was loaded from (transformers reverts its
    # ``language_model`` prefix change), so the round trip must give back the directory's names.
    reloaded = _saved_tensors(model)
    for name, t in reloaded.items():
        if name not in tensors or not torch.equal(t.to(torch.bfloat16), tensors[name]):
            raise AssertionError(f"{out}: {name} did not load bit-exact")
    expected = {n for n in tensors if not n.startswith("mtp.")}
    assert set(reloaded) == expected, sorted(expected ^ set(reloaded))
    return model


# --------------------------------------------------------------------------------------------
# Goldens.


class _Recorder:
    """Inputs of every decoder layer and the last layer's output; router logits."""

    def __init__(self, model: torch.nn.Module):
        self.layers: list[torch.Tensor] = []
        self.router: list[torch.Tensor] = []
        decoder = model.model.layers
        self.handles = [
            layer.register_forward_pre_hook(self._pre, with_kwargs=True) for layer in decoder
        ]
        self.handles.append(decoder[-1].register_forward_hook(self._post))
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                self.handles.append(module.register_forward_hook(self._route))

    def _pre(self, module, args, kwargs):
        self.layers.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    def _post(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        self.layers.append(out.detach().clone())

    def _route(self, module, args, output):
        self.router.append(output[0].float().detach().clone())

    def take(self) -> list[torch.Tensor]:
        layers, self.layers = self.layers, []
        return layers


def _cache_of(out: Any):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _run(model, ids: list[int], cache=None, hidden: bool = False):
    x = torch.tensor([ids], dtype=torch.long)
    return model(
        input_ids=x, cache=cache, use_cache=True, output_hidden_states=hidden, return_dict=True
    )


def goldens(
    model: torch.nn.Module, cfg_json: dict[str, Any], seed: int
) -> tuple[dict[str, np.ndarray], dict[str, float], float | None]:
    """The golden arrays, transformers' self-consistency checks (max logit differences) and
    the smallest top-k router-logit gap (None without MoE)."""
    text = cfg_json.get("text_config", cfg_json)
    V, H, K = text["vocab_size"], text["hidden_size"], text["linear_conv_kernel_dim"]
    L = len(LAYER_TYPES)
    linear = [i for i, t in enumerate(LAYER_TYPES) if t == "linear_attention"]
    B, T = len(LENGTHS), max(LENGTHS)
    rng = np.random.default_rng(seed + 1000)
    tokens = np.zeros((B, T), np.int32)
    for b, n in enumerate(LENGTHS):
        tokens[b, :n] = rng.integers(0, V, n)
    decode_tokens = rng.integers(0, V, (B, DECODE)).astype(np.int32)
    window_tokens = rng.integers(0, V, (B, WINDOW)).astype(np.int32)
    rollback_tokens = rng.integers(0, V, (B, FURTHER)).astype(np.int32)
    accept = np.array(ACCEPT, np.int32)
    keep = accept + 1

    g: dict[str, np.ndarray] = dict(
        tokens=tokens,
        lengths=np.array(LENGTHS, np.int32),
        prefill_layers=np.zeros((L + 1, B, T, H), np.float32),
        prefill_hidden=np.zeros((B, T, H), np.float32),
        prefill_logits=np.zeros((B, T, V), np.float32),
        decode_tokens=decode_tokens,
        decode_logits=np.zeros((B, DECODE, V), np.float32),
        decode_hidden=np.zeros((B, DECODE, H), np.float32),
        window_tokens=window_tokens,
        window_logits=np.zeros((B, WINDOW, V), np.float32),
        window_hidden=np.zeros((B, WINDOW, H), np.float32),
        rollback_accept=accept,
        rollback_keep=keep,
        rollback_tokens=rollback_tokens,
        rollback_logits=np.zeros((B, FURTHER, V), np.float32),
        rollback_hidden=np.zeros((B, FURTHER, H), np.float32),
    )
    conv, recurrent = [], []
    checks = dict(decode_vs_full=0.0, window_cached_vs_full=0.0, hidden_states_vs_hooks=0.0)
    rec = _Recorder(model)

    def last(out, n):
        return out.logits[0, -n:].numpy(), out.hidden_states[-1][0, -n:].numpy()

    with torch.no_grad():
        for b, n in enumerate(LENGTHS):
            prompt = tokens[b, :n].tolist()
            out = _run(model, prompt, hidden=True)
            layers = rec.take()
            assert len(layers) == L + 1
            for i in range(L):
                d = (layers[i] - out.hidden_states[i]).abs().max().item()
                checks["hidden_states_vs_hooks"] = max(checks["hidden_states_vs_hooks"], d)
            g["prefill_layers"][:, b, :n] = torch.cat(layers).numpy()
            g["prefill_hidden"][b, :n] = out.hidden_states[-1][0].numpy()
            g["prefill_logits"][b, :n] = out.logits[0].numpy()
            cache = _cache_of(out)
            conv.append([cache.get_conv_state(i)[0, :, -(K - 1) :].clone().numpy() for i in linear])
            recurrent.append([cache.get_recurrent_state(i)[0].clone().numpy() for i in linear])

            # Token-by-token decode with transformers' cache (its single-token recurrent path).
            for j in range(DECODE):
                out = _run(model, [int(decode_tokens[b, j])], cache=cache, hidden=True)
                cache = _cache_of(out)
                g["decode_logits"][b, j], g["decode_hidden"][b, j] = last(out, 1)
            full = _run(model, prompt + decode_tokens[b].tolist())
            d = np.abs(full.logits[0, n:].numpy() - g["decode_logits"][b]).max()
            checks["decode_vs_full"] = max(checks["decode_vs_full"], float(d))

            # The verify window: full forward, and transformers' cached multi-token call.
            out = _run(model, prompt + window_tokens[b].tolist(), hidden=True)
            g["window_logits"][b], g["window_hidden"][b] = last(out, WINDOW)
            cached = _run(model, prompt)
            cached = _run(model, window_tokens[b].tolist(), cache=_cache_of(cached))
            d = np.abs(cached.logits[0].numpy() - g["window_logits"][b]).max()
            checks["window_cached_vs_full"] = max(checks["window_cached_vs_full"], float(d))

            # Rollback: the committed sequence is prompt + window[:keep] + further tokens.
            committed = prompt + window_tokens[b, : keep[b]].tolist() + rollback_tokens[b].tolist()
            out = _run(model, committed, hidden=True)
            g["rollback_logits"][b], g["rollback_hidden"][b] = last(out, FURTHER)
            rec.take()

    g["prefill_conv_state"] = np.stack([np.stack(c) for c in zip(*conv)]).astype(np.float32)
    g["prefill_recurrent_state"] = np.stack([np.stack(r) for r in zip(*recurrent)])
    g["prefill_recurrent_state"] = g["prefill_recurrent_state"].astype(np.float32)
    margin = None
    if rec.router:
        k = text["num_experts_per_tok"]
        logits = torch.cat([r.reshape(-1, r.shape[-1]) for r in rec.router])
        top = torch.sort(logits, dim=-1, descending=True).values
        margin = float((top[:, k - 1] - top[:, k]).min())
    for h in rec.handles:
        h.remove()
    g["versions"] = np.array(f"torch {torch.__version__}, transformers {transformers.__version__}")
    return g, checks, margin


def build(out: Path, kind: str, *, tied: bool, seed: int) -> None:
    """Write ``out``, skipping seeds whose goldens sit on a routing near-tie or where
    transformers' own cached and uncached paths disagree by more than float32 rounding (a
    per-head gated-norm input close to zero amplifies rounding): a comparison there would
    measure luck, not the implementation."""
    for s in range(seed, seed + 20):
        if out.exists():
            shutil.rmtree(out)
        tensors = write_checkpoint(out, kind, tied=tied, seed=s)
        model = load_checked(out, kind, tensors)
        cfg_json = json.loads((out / "config.json").read_text())
        g, checks, margin = goldens(model, cfg_json, s)
        assert checks.pop("hidden_states_vs_hooks") == 0.0
        scale = float(np.abs(g["prefill_logits"]).max())
        spread = max(checks.values())
        if margin is not None and margin < ROUTER_MARGIN:
            print(f"{out.name}: seed {s}: routing near-tie ({margin:.1e}); next seed")
        elif spread > SPREAD * scale:
            print(f"{out.name}: seed {s}: transformers' paths differ by {spread:.1e}; next seed")
        else:
            break
    else:
        raise RuntimeError(f"{out.name}: no acceptable seed in [{seed}, {seed + 20})")
    g["transformers_spread"] = np.float32(spread)
    np.savez_compressed(out / "golden.npz", **g)
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(f"{out.name}: seed {s}, |logits| <= {scale:.1f}, {checks}, routing gap {margin}")
    print(f"{out.name}: bytes {sizes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/hybrid"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    build(args.out / "qwen3_5_dense", "qwen3_5", tied=True, seed=35)
    build(args.out / "qwen3_next_moe", "qwen3_next", tied=False, seed=80)


if __name__ == "__main__":
    main()
