"""Qwen3-MoE's forward on a device backend: the HIP sources on the CPU (hip-cpu, a 64-lane wavefront) give
the cpu reference's bits for the log-probs, the logits and the expert choices (the router's exact gemm,
moe_route, the row gather, each expert's gemms and SwiGLU, moe_combine), in the packed forward and in
the engine; the device backward is refused in one line before any work.

A machine without HIP-CPU (RLPORTABLE_HIP_CPU unset) skips the hip-cpu tests, except in CI. The shapes
are tiny: the kernels compile once (cached), each forward takes a fraction of a second."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import clean_exit, hip_cpu_backend
from rlportable.conform.moe import random_block
from rlportable.contract import moe as moe_ref
from rlportable.errors import BackendUnavailable
from rlportable.model import backward
from rlportable.model.config import ModelConfig, ModelError
from rlportable.model.forward import Model
from rlportable.model.synthetic import IdsOnlyTokenizer, random_weights
from rlportable.ops import moe as moe_op
from rlportable.runtime import get_backend

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


@pytest.fixture(scope="module")
def hip_cpu():
    return hip_cpu_backend()


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
def test_the_forward_on_hip_cpu_has_the_cpu_references_bits(hip_cpu, tokens, overrides):
    config = moe_config(**overrides)
    weights = scaled_weights(config, seed=len(json.dumps(overrides)))
    on_cpu, on_device = Model(CPU, config, weights), Model(hip_cpu, config, weights)
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


def test_the_block_op_on_hip_cpu_is_the_reference(hip_cpu):
    """ops.moe.block on hip-cpu against contract.moe.moe_block: no token, one token, a non-finite row
    (experts 0..k-1 and NaN weights: a NaN output row), k = E, and the expert ids on the host."""
    rng = np.random.default_rng(5)
    router, gate, up, down = random_block(rng, hidden=24, inner=16, experts=6, scale=1.0)
    device = [[hip_cpu.asarray(w) for w in ws] for ws in (gate, up, down)]
    for t, k, norm in ((0, 2, True), (1, 1, False), (7, 2, True), (9, 6, False)):
        h = rng.standard_normal((t, 24)).astype(np.float32)
        if t == 7:
            h[3, 5] = np.nan
        weight = moe_op.encode(hip_cpu, hip_cpu.asarray(router), *device, k, norm)
        got = [hip_cpu.to_numpy(x) for x in moe_op.block(hip_cpu, hip_cpu.asarray(h), weight)]
        want = moe_ref.moe_block(h, router, gate, up, down, k, norm)
        assert all(same(g, w) for g, w in zip(got, want)), (t, k, norm)
        # the last token alone: its own bits (a batch of one, every group of one row)
        if t:
            one = [hip_cpu.to_numpy(x) for x in moe_op.block(hip_cpu, hip_cpu.asarray(h[t - 1:t]), weight)]
            assert all(same(g[0], w[-1]) for g, w in zip(one, want))


def test_the_engine_on_hip_cpu_samples_the_cpu_engines_tokens_and_bits(hip_cpu):
    """LLM.generate on hip-cpu (decode steps padded to buckets, run eagerly) draws the cpu engine's
    tokens with its log-prob bits and expert choices, and those are the trainer forward's."""
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams

    config = moe_config(num_experts_per_tok=2, norm_topk_prob=False)
    weights = scaled_weights(config, seed=3)
    prompts = [[5, 9, 2], [7, 7, 1, 30, 4]]
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, ignore_eos=True)
    runs = []
    for backend in (CPU, hip_cpu):
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


BACKWARD_REFUSAL = (r"^Qwen3-MoE on the {} backend runs the forward only \(generate, log-probs\): its backward "
                    r"has no kernels there \(contracts/moe.toml\); train it with --device cpu$")


def test_the_device_backward_is_refused_in_one_line_before_any_work():
    class Device:  # a backend that is not the reference; any use of it would raise AttributeError
        runs_reference, label = False, "cuda"

    config = moe_config()
    weights = random_weights(config, 0)
    with pytest.raises(ModelError, match=BACKWARD_REFUSAL.format("cuda")) as caught:
        Model(Device(), config, weights, trainable=True)
    assert "\n" not in str(caught.value)
    # the op itself refuses too (the ops layer never falls back to the host)
    h = np.zeros((2, 32), np.float32)
    with pytest.raises(BackendUnavailable, match="^moe.block_backward: no kernel on the cuda backend"):
        moe_op.block_backward(Device(), h, weights.layers[0].router, weights.layers[0].expert_gate,
                              weights.layers[0].expert_up, weights.layers[0].expert_down, 2, True, h)


def test_training_on_hip_cpu_is_refused_by_the_cli_in_one_line(hip_cpu, tmp_path):
    pytest.importorskip("tokenizers")
    from click.testing import CliRunner

    from rlportable.cli import main
    from rlportable.model.weights import save_safetensors
    from test_model_forward import write_test_tokenizer

    config = moe_config()
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_safetensors(random_weights(config, 0), config, tmp_path, dtype="fp32")
    write_test_tokenizer(tmp_path, config.vocab_size)
    with pytest.raises(ModelError, match=BACKWARD_REFUSAL.format(r"hip-cpu \(HIP sources on HIP-CPU, wavefront 64\)")):
        Model(hip_cpu, config, random_weights(config, 0), trainable=True)
    result = CliRunner().invoke(main, ["sft", "--model", str(tmp_path), "--device", "hip-cpu", "--steps", "1",
                                       "--batch-size", "2", "--out", str(tmp_path / "sft")])
    assert result.exit_code != 0 and clean_exit(result), result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "runs the forward only" in lines[0], result.output
    assert not (tmp_path / "sft").exists() or not any((tmp_path / "sft").glob("step-*"))
