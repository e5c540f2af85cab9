"""Qwen3-MoE on a device backend: the HIP sources on the CPU (hip-cpu, a 64-lane wavefront) give the cpu
reference's bits for the forward (log-probs, logits, expert choices: the router's exact gemm, moe_route,
the row gather, each expert's gemms and SwiGLU, moe_combine), in the packed forward and in the engine,
and for the backward (moe_combine_backward, moe_route_backward, the experts' dX and dW products,
swiglu_backward, d h as moe_combine of 2k + 1 rows): the block's gradients, and SFT and GRPO steps'
trained weights.

The same tests run the CUDA sources where a CUDA GPU answers (skipped elsewhere). A machine without
HIP-CPU (RLPORTABLE_HIP_CPU unset) skips the hip-cpu tests, except in CI. The shapes
are tiny: the kernels compile once (cached), each forward takes a fraction of a second."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import hip_cpu_backend
from rlportable.conform.moe import random_block
from rlportable.contract import moe as moe_ref
from rlportable.model import backward
from rlportable.model.config import ModelConfig
from rlportable.model.forward import Model
from rlportable.model.synthetic import IdsOnlyTokenizer, random_weights
from rlportable.ops import moe as moe_op
from rlportable.runtime import get_backend, probe

CPU = get_backend("cpu")
EXPERTS = 8


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def same(a, b) -> bool:
    """Equal shapes and raw bits (float32 as uint32: NaN payloads and signed zeros count)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32 or b.dtype == np.float32:
        return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))
    return a.shape == b.shape and np.array_equal(a, b)


def moe_config(**overrides) -> ModelConfig:
    """A tiny Qwen3-MoE (the fields of model/synthetic.py's qwen3-30b-a3b shape at toy sizes)."""
    data = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "moe_intermediate_size": 16, "num_experts": EXPERTS, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}
    data.update(overrides)
    return ModelConfig.from_dict(data)


def scaled_weights(config: ModelConfig, seed: int):
    """Seeded random weights with routers 50x the 0.02 default, so that the router logits are spread
    and tokens pick different experts."""
    weights = random_weights(config, seed)
    for layer in weights.layers:
        if layer.router is not None:
            layer.router = (layer.router * 50).astype(np.float32)
    return weights


@pytest.fixture(scope="module", params=["hip-cpu", "cuda"])
def device(request):
    """The HIP sources on HIP-CPU (everywhere; CI fails without it) and the CUDA sources where a GPU
    answers (skipped elsewhere: CI has none)."""
    if request.param == "hip-cpu":
        return hip_cpu_backend()
    available, reason = probe("cuda")
    if not available:
        pytest.skip(reason)
    return get_backend("cuda")


@pytest.fixture(scope="module")
def tokens():
    """Three packed sequences of 1, 4 and 21 tokens, and one sequence of 3 tokens alone."""
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 64, 26).astype(np.int32)
    return (packed, np.array([0, 1, 5, 26])), (rng.integers(0, 64, 3).astype(np.int32), np.array([0, 3]))


def _forward(model: Model, tokens, cu):
    """(log-probs [R], every row's logits [T, V], each sparse layer's experts [T, k]) of packed sequences."""
    fwd = backward.forward(model, tokens, cu, keep_attention=False)
    logits = model.logits(model.hidden_states(tokens, cu))
    return model.backend.to_numpy(fwd.logp), model.backend.to_numpy(logits), fwd.routing


@pytest.mark.parametrize("overrides", [
    {"num_experts_per_tok": 1, "norm_topk_prob": True},    # w = 1 exactly
    {"num_experts_per_tok": 1, "norm_topk_prob": False},   # the softmax over all 8, read at one
    {"num_experts_per_tok": 2, "norm_topk_prob": True},
    {"num_experts_per_tok": 3, "norm_topk_prob": False, "decoder_sparse_step": 2, "num_hidden_layers": 3},
])
def test_the_forward_on_a_device_has_the_cpu_references_bits(device, tokens, overrides):
    config = moe_config(**overrides)
    weights = scaled_weights(config, seed=len(json.dumps(overrides)))
    on_cpu, on_device = Model(CPU, config, weights), Model(device, config, weights)
    sparse = [i for i in range(config.num_hidden_layers) if config.sparse_layer(i)]
    k = config.num_experts_per_tok
    for ids, cu in tokens:
        want_lp, want_logits, want_routing = _forward(on_cpu, ids, cu)
        got_lp, got_logits, got_routing = _forward(on_device, ids, cu)
        assert same(got_lp, want_lp) and same(got_logits, want_logits)
        assert len(got_routing) == len(want_routing) == len(sparse)
        assert all(same(g, w) for g, w in zip(got_routing, want_routing))
        used = [np.unique(layer).size for layer in want_routing]
        if ids.size == 26:  # the tokens are spread over the experts, not all in one
            assert min(used) > k
        elif k < 3:  # 3 tokens choose at most 3 k < 8 experts: the others get no token and run nothing
            assert max(used) <= 3 * k < EXPERTS


def test_the_block_op_on_a_device_is_the_reference(device):
    """ops.moe.block on the device against contract.moe.moe_block: no token, one token, a non-finite row
    (experts 0..k-1 and NaN weights: a NaN output row), k = E, and the expert ids on the host."""
    rng = np.random.default_rng(5)
    router, gate, up, down = random_block(rng, hidden=24, inner=16, experts=6, scale=1.0)
    experts = [[device.asarray(w) for w in ws] for ws in (gate, up, down)]
    for t, k, norm in ((0, 2, True), (1, 1, False), (7, 2, True), (9, 6, False)):
        h = rng.standard_normal((t, 24)).astype(np.float32)
        if t == 7:
            h[3, 5] = np.nan
        weight = moe_op.encode(device, device.asarray(router), *experts, k, norm)
        got = [device.to_numpy(x) for x in moe_op.block(device, device.asarray(h), weight)]
        want = moe_ref.moe_block(h, router, gate, up, down, k, norm)
        assert all(same(g, w) for g, w in zip(got, want)), (t, k, norm)
        # the last token alone: its own bits (a batch of one, every group of one row)
        if t:
            one = [device.to_numpy(x) for x in moe_op.block(device, device.asarray(h[t - 1:t]), weight)]
            assert all(same(g[0], w[-1]) for g, w in zip(one, want))


def test_the_engine_on_a_device_samples_the_cpu_engines_tokens_and_bits(device):
    """LLM.generate on the device (decode steps padded to buckets, run eagerly) draws the cpu engine's
    tokens with its log-prob bits and expert choices, and those are the trainer forward's."""
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams

    config = moe_config(num_experts_per_tok=2, norm_topk_prob=False)
    weights = scaled_weights(config, seed=3)
    prompts = [[5, 9, 2], [7, 7, 1, 30, 4]]
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, ignore_eos=True)
    runs = []
    for backend in (CPU, device):
        model = Model(backend, config, weights)
        llm = LLM(device=backend, loaded=(model, IdsOnlyTokenizer()), max_num_seqs=3, block_size=4,
                  cuda_graphs=True)
        runs.append((model, llm.generate(prompts, params, seed=2)))
    (_, want), (device_model, got) = runs
    for w, g in zip(want, got):
        for ws, gs in zip(w.outputs, g.outputs):
            assert list(gs.token_ids) == list(ws.token_ids)
            assert same(np.array(gs.logprobs, np.float32), np.array(ws.logprobs, np.float32))
            assert same(np.stack(gs.routing), np.stack(ws.routing))
            ids = np.array(g.prompt_token_ids + list(gs.token_ids), dtype=np.int32)
            (lp,) = device_model.logprobs(ids, np.array([0, ids.size]))
            assert same(lp[-len(gs.token_ids):], np.array(gs.logprobs, np.float32))


def _gradients(result) -> list:
    return [result.d_h, result.d_router, result.d_logits, result.d_weights, *result.d_gate, *result.d_up,
            *result.d_down]


@pytest.mark.parametrize("t,k,norm", [(0, 2, True), (1, 1, True), (1, 1, False), (2, 2, True), (9, 2, False),
                                      (12, 3, True), (12, 3, False), (5, 6, True)])
def test_the_block_backward_on_a_device_is_the_reference(device, t, k, norm):
    """ops.moe.block_backward on the device against contract.moe.moe_block_backward on raw bits: every
    gradient (d h, the router's, each expert's gate, up and down, d logits, d weights); k = 1 (with
    norm_topk_prob its weight is 1 and the router gets +0), 2, 3 and k = E; no token, one token, 2 tokens
    (experts without a token: +0 gradients), a NaN in an h row (route's undefined row) and an upstream
    row of zeros (a token not trained on)."""
    rng = np.random.default_rng(10 * t + k + norm)
    weights = random_block(rng, hidden=24, inner=16, experts=6, scale=1.0)
    router, gate, up, down = weights
    h = rng.standard_normal((t, 24)).astype(np.float32)
    d_out = rng.standard_normal((t, 24)).astype(np.float32)
    if t >= 9:
        h[2, 7] = np.nan
        d_out[5] = 0.0
    want = moe_ref.moe_block_backward(h, router, gate, up, down, k, norm, d_out)
    put = device.asarray
    got = moe_op.block_backward(device, put(h), put(router), [put(w) for w in gate], [put(w) for w in up],
                                [put(w) for w in down], k, norm, put(d_out))
    assert all(same(device.to_numpy(g), w) for g, w in zip(_gradients(got), _gradients(want)))
    assert np.array_equal(got.experts, want.experts)
    if t == 2:
        assert np.unique(want.experts).size < 6  # some expert got no token
    if t >= 9:
        assert np.isnan(want.d_h[2]).all() and (bits(want.d_logits[5]) == 0).all()


def test_the_backward_ops_on_a_device_are_the_reference(device):
    """route_backward and combine_backward (the family's kernels) on their edge rows: ties, -inf logits,
    an undefined row, upstream all zero (+0 even on the undefined row), a non-finite upstream, zero
    weights with inf and NaN outputs."""
    put, host = device.asarray, device.to_numpy
    logits = np.array([[1.0, 3.0, 3.0, -np.inf, 0.5], [0.0, -0.0, 2.0, 2.0, 1.0], [np.nan, 1.0, 0.0, 0.0, 0.0],
                       [np.nan, 1.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0]], dtype=np.float32)
    g = np.array([[0.5, -1.5], [2.0, 0.25], [0.0, -0.0], [1.0, 1.0], [np.inf, 1.0]], dtype=np.float32)
    for norm in (False, True):
        chosen, w = moe_ref.route(logits, 2, norm)
        want = moe_ref.route_backward(logits, chosen, w, g, norm)
        assert same(host(moe_op.route_backward(device, put(logits), put(chosen), put(w), put(g), norm)), want)
    d_out = np.array([[1.0, -2.0, 3.0], [0.5, np.inf, 1.0]], dtype=np.float32)
    outputs = np.array([[[1.0, 2.0, 3.0], [np.inf, np.nan, 1.0]], [[1.0, -1.0, 2.0], [3.0, 0.0, -0.0]]],
                       dtype=np.float32)
    w = np.array([[0.75, 0.0], [0.5, 0.5]], dtype=np.float32)
    got = moe_op.combine_backward(device, put(d_out), put(w), put(outputs))
    assert all(same(host(a), b) for a, b in zip(got, moe_ref.combine_backward(d_out, w, outputs)))


@pytest.mark.parametrize("t,k,norm", [(0, 2, True), (1, 1, True), (9, 2, False), (12, 3, True), (5, 6, False)])
def test_the_block_backward_with_the_load_balancing_loss_on_a_device_is_the_reference(device, t, k, norm):
    """block_backward with aux (the loss's per-expert coefficients) on the device against the reference on
    raw bits, every gradient; the loss reaches d logits (k = 1 renormalised: d logits is the loss's alone),
    a NaN h row stays NaN, and load_balancing_backward alone on edge rows (ties, -inf, an undefined row)."""
    rng = np.random.default_rng(20 * t + k + norm)
    router, gate, up, down = random_block(rng, hidden=24, inner=16, experts=6, scale=1.0)
    h = rng.standard_normal((t, 24)).astype(np.float32)
    d_out = rng.standard_normal((t, 24)).astype(np.float32)
    if t >= 9:
        h[2, 7] = np.nan
        d_out[5] = 0.0
    aux = moe_ref.load_balancing_coefficients([moe_ref.route(moe_ref.router_logits(h, router), k, norm)[0]], 6, 0.3)
    want = moe_ref.moe_block_backward(h, router, gate, up, down, k, norm, d_out, aux=aux)
    put = device.asarray
    got = moe_op.block_backward(device, put(h), put(router), [put(w) for w in gate], [put(w) for w in up],
                                [put(w) for w in down], k, norm, put(d_out), aux=aux)
    assert all(same(device.to_numpy(g), w) for g, w in zip(_gradients(got), _gradients(want)))
    assert same(device.to_numpy(got.logits), want.logits)
    plain = moe_ref.moe_block_backward(h, router, gate, up, down, k, norm, d_out)
    if t and k < 6:  # at k = E every count is T: the loss is the constant k, its gradient rounding noise
        assert not same(want.d_logits, plain.d_logits) and not same(want.d_h, plain.d_h)
    if t >= 9:
        assert np.isnan(want.d_logits[2]).all() and not np.isnan(want.d_logits[5]).any()
    logits = np.array([[1.0, 3.0, 3.0, -np.inf, 0.5, 0.0], [0.0, -0.0, 2.0, 2.0, 1.0, 1.0],
                       [np.nan, 1.0, 0.0, 0.0, 0.0, 0.0], [80.0, -80.0, 0.0, 1.0, 2.0, 3.0]], dtype=np.float32)
    for coefficients in (aux, np.zeros(6, np.float32)):
        assert same(device.to_numpy(moe_op.load_balancing_backward(device, put(logits), coefficients)),
                    moe_ref.load_balancing_backward(logits, coefficients))


def _moe_folder(folder, config, seed: int = 0):
    """A Qwen3-MoE checkpoint directory (config, fp32 weights, a test tokenizer)."""
    from rlportable.model.weights import save_safetensors
    from test_model_forward import write_test_tokenizer

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_safetensors(scaled_weights(config, seed), config, folder, dtype="fp32")
    write_test_tokenizer(folder, config.vocab_size)
    return folder


def _trained(folder) -> dict:
    from rlportable.train import checkpoint

    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(folder))
    return {name: np.array(v).view(np.uint32) for name, v in ckpt.weights.named_tensors(ckpt.config).items()}


def test_a_trainable_moe_model_builds_on_a_device(device):
    config = moe_config()
    model = Model(device, config, random_weights(config, 0), trainable=True)
    assert model.params.layers[0].router is not None and len(model.params.layers[0].expert_gate) == EXPERTS


@pytest.mark.parametrize("aux", [False, True])
def test_sft_and_grpo_on_a_device_train_the_cpu_runs_bits(device, tmp_path, aux):
    """`rlportable sft` and `grpo --device hip-cpu|cuda` on a tiny Qwen3-MoE (2 sparse layers, 8 experts, 2
    active) against the same commands on cpu: after 2 steps every trained weight has the cpu run's raw
    bits, the routers and experts moved, and GRPO saw 0 log-prob and 0 routing mismatches. aux: the
    load-balancing loss on (output_router_logits, coefficient 0.5): both trainers log its value, the
    same on both backends."""
    pytest.importorskip("tokenizers")
    from click.testing import CliRunner

    from rlportable.cli import main

    switches = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if aux else {}
    folder = _moe_folder(tmp_path / "model", moe_config(**switches))
    (tmp_path / "reward.py").write_text(
        "def varied(completions, completion_ids, **columns):\n"
        "    return [float(sum(1 for t in ids if t % 2 == 0)) for ids in completion_ids]\n")
    runner = CliRunner()
    runs = {}
    for where in ("cpu", device.name):
        sft = ["sft", "--model", str(folder), "--device", where, "--steps", "2", "--batch-size", "2",
               "--out", str(tmp_path / f"sft-{where}"), "--log-jsonl", str(tmp_path / f"sft-{where}.jsonl")]
        grpo = ["grpo", "--model", str(folder), "--device", where, "--steps", "2", "--prompts-per-step", "2",
                "-G", "3", "--max-completion-length", "4", "--lr", "3e-3",
                "--reward", f"{tmp_path / 'reward.py'}:varied", "--out", str(tmp_path / f"grpo-{where}"),
                "--log-jsonl", str(tmp_path / f"grpo-{where}.jsonl")]
        for name, args in (("sft", sft), ("grpo", grpo)):
            result = runner.invoke(main, args)
            assert result.exit_code == 0, result.output
            runs[name, where] = _trained(tmp_path / f"{name}-{where}")
        records = [json.loads(line) for line in (tmp_path / f"grpo-{where}.jsonl").read_text().splitlines()]
        steps = [r for r in records if "logp_mismatches" in r]
        assert len(steps) == 2 and all(r["logp_mismatches"] == 0 and r["routing_mismatches"] == 0 for r in steps)
        for name in ("sft", "grpo"):
            logged = [json.loads(line) for line in (tmp_path / f"{name}-{where}.jsonl").read_text().splitlines()]
            runs[name, where, "aux"] = [r["aux_loss"] for r in logged if "aux_loss" in r]
            assert len(runs[name, where, "aux"]) == (2 if aux else 0), name
    start = scaled_weights(moe_config(), 0).named_tensors(moe_config())  # the switches change no weight
    for name in ("sft", "grpo"):
        want, got = runs[name, "cpu"], runs[name, device.name]
        assert runs[name, "cpu", "aux"] == runs[name, device.name, "aux"], name
        assert want.keys() == got.keys() and all(np.array_equal(want[key], got[key]) for key in want), name
        moved = [key for key in want if not np.array_equal(want[key], start[key].view(np.uint32))]
        assert any(key.endswith("mlp.gate.weight") for key in moved), name
        assert any(".experts." in key for key in moved), name
