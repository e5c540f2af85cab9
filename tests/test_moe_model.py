"""Qwen3-MoE as a model: config fields, Hugging Face weight names, the forward on the cpu reference against
transformers, bitwise invariances, the engine's log-probs and expert choices, the backward against
transformers' autograd, and the one-line refusals of what is not built."""

import json

import numpy as np
import pytest

from rlportable.model.config import ModelConfig, ModelError
from rlportable.model.forward import Model
from rlportable.model.load import load_model, save_model
from rlportable.model.weights import expected_tensors
from rlportable.ops import moe as moe_op
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _config(**overrides):
    data = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 2}
    data.update(overrides)
    return ModelConfig.from_dict(data)


def test_moe_config_fields_and_sparse_layers():
    config = _config(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3], router_aux_loss_coef=0.01)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (6, 2, 16)
    assert config.norm_topk_prob and config.qk_norm and config.mlp_only_layers == (3,)
    assert [config.sparse_layer(i) for i in range(4)] == [False, True, False, False] and config.is_moe
    assert _config(num_experts=0).is_moe is False  # transformers: no experts, every layer dense
    # transformers 5 writes num_experts as num_local_experts; Qwen's files say num_experts
    assert _config(num_experts=None, num_local_experts=5).num_experts == 5
    defaults = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 16,
                                      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 8})
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size,
            defaults.norm_topk_prob, defaults.num_key_value_heads, defaults.head_dim) == (128, 8, 768, False, 4, 2)
    for bad, match in (({"num_experts_per_tok": 7}, "exceeds num_experts"), ({"mlp_only_layers": "1"}, "mlp_only"),
                       ({"decoder_sparse_step": 0}, "decoder_sparse_step")):
        with pytest.raises(ModelError, match=match):
            _config(**bad)
    # the canonical dict written back parses to the same config
    config = _config(norm_topk_prob=True, mlp_only_layers=[0])
    import dataclasses

    assert ModelConfig.from_dict(dataclasses.replace(config, raw={}).to_hf_dict()) == config


def test_the_load_balancing_loss_is_on_by_transformers_rule():
    """output_router_logits (default false, as transformers) and a nonzero router_aux_loss_coef turn it on;
    either alone leaves it off; both are written back."""
    import dataclasses

    assert _config().output_router_logits is False and _config().load_balancing is False
    on = _config(output_router_logits=True, router_aux_loss_coef=0.01)
    assert on.load_balancing and on.router_aux_loss_coef == 0.01
    assert not _config(output_router_logits=True, router_aux_loss_coef=0).load_balancing
    assert not _config(output_router_logits=False, router_aux_loss_coef=0.5).load_balancing
    assert not _config(output_router_logits=True, num_experts=0).load_balancing  # no sparse layer
    assert ModelConfig.from_dict(dataclasses.replace(on, raw={}).to_hf_dict()) == on
    with pytest.raises(ModelError, match="output_router_logits must be true or false"):
        _config(output_router_logits="yes")


def test_moe_weights_take_hugging_face_names():
    config = _config(mlp_only_layers=[1])
    names = expected_tensors(config)
    assert names["model.layers.0.mlp.gate.weight"] == (6, 32)
    assert names["model.layers.0.mlp.experts.5.gate_proj.weight"] == (16, 32)
    assert names["model.layers.0.mlp.experts.5.up_proj.weight"] == (16, 32)
    assert names["model.layers.0.mlp.experts.5.down_proj.weight"] == (32, 16)
    assert names["model.layers.1.mlp.gate_proj.weight"] == (48, 32)
    assert "model.layers.0.mlp.gate_proj.weight" not in names and "model.layers.1.mlp.gate.weight" not in names


# ---- against transformers (a float64 forward on the CPU)
# The criterion is the contract's (tests/test_model_forward.py): the log-probs' largest error against a
# float64 forward at most 1/10 of a bf16 forward's. The router logits are exact gemms of 23 x 15-bit
# operands; an expert choice can differ from float64's only where float64's k-th and (k+1)-th logits are
# closer than the logits' error, counted below (none here at these seeds).
ERROR_RATIO_TO_BF16 = 10
MARGIN = 1e-4  # above the router logits' error at these sizes (about 2^-15 of |h| |w_router| sqrt(H))


def _hf_moe(folder, **overrides):
    import torch
    import transformers

    from test_model_forward import write_test_tokenizer

    torch.manual_seed(0)
    settings = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                    initializer_range=0.15, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    settings.update(overrides)
    config = transformers.Qwen3MoeConfig(**settings)
    # eager experts: the default grouped_mm takes no float64
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                       experts_implementation="eager").eval()
    hf.save_pretrained(folder, safe_serialization=True)
    write_test_tokenizer(folder, config.vocab_size)
    return hf


def _recording_block(monkeypatch):
    """Record every sparse layer's expert choices, in call order (layer by layer)."""
    calls = []
    block = moe_op.block

    def recording(backend, h, weight, encoded=None):
        out = block(backend, h, weight, encoded=encoded)
        calls.append(np.array(out[1]))
        return out

    monkeypatch.setattr(moe_op, "block", recording)
    return calls


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "decoder_sparse_step": 2},
                                       {"mlp_only_layers": [0], "num_experts_per_tok": 3}])
def test_logprobs_and_expert_choices_match_transformers(overrides, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_model_forward import _hf_logprobs

    hf = _hf_moe(tmp_path, **overrides)
    config, weights, _ = load_model(str(tmp_path))
    assert config.is_moe and config.num_experts == 8
    model = Model(CPU, config, weights)
    calls = _recording_block(monkeypatch)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 80).astype(np.int32)
    (ours,) = model.logprobs(tokens, np.array([0, tokens.size]))

    reference = _hf_logprobs(hf, tokens, torch.float64)
    with torch.no_grad():  # float64's router logits, one [T, E] per sparse layer
        routers = hf.double()(torch.tensor(tokens[None].astype(np.int64)), output_router_logits=True).router_logits
    sparse = [i for i in range(config.num_hidden_layers) if config.sparse_layer(i)]
    assert len(calls) == len(routers) == len(sparse)
    k, disagreements, close = config.num_experts_per_tok, 0, 0
    for ours_experts, logits in zip(calls, routers):
        z = logits.numpy()
        top = np.argsort(-z, axis=1, kind="stable")[:, :k]
        ordered = -np.sort(-z, axis=1)
        clear = ordered[:, k - 1] - ordered[:, k] > MARGIN
        close += int((~clear).sum())
        disagreements += int((np.sort(ours_experts, 1) != np.sort(top, 1)).any(axis=1)[clear].sum())
    assert disagreements == 0, (disagreements, close)

    bf16 = _hf_logprobs(hf, tokens, torch.bfloat16)
    ours_error = np.abs(ours.astype(np.float64) - reference).max()
    bf16_error = np.abs(bf16 - reference).max()
    assert ours_error * ERROR_RATIO_TO_BF16 <= bf16_error, (ours_error, bf16_error)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("moe")
    _hf_moe(folder)
    return folder, load_model(str(folder))


def test_a_sequence_has_the_same_bits_alone_and_packed(tiny_moe):
    _, (config, weights, _) = tiny_moe
    model = Model(CPU, config, weights)
    rng = np.random.default_rng(0)
    target = rng.integers(0, config.vocab_size, 19).astype(np.int32)
    (alone,) = model.logprobs(target, np.array([0, target.size]))
    for before in (1, 30):
        other = rng.integers(0, config.vocab_size, before).astype(np.int32)
        tokens = np.concatenate([other, target, other[:5]])
        packed = model.logprobs(tokens, np.array([0, before, before + target.size, tokens.size]))
        assert np.array_equal(bits(packed[1]), bits(alone))


def test_the_engine_records_the_forwards_log_probs(tiny_moe):
    """Decode steps route each token alone; the trainer's forward routes it inside the whole sequence:
    the same experts and the same log-prob bits (the rollout-equals-training promise, for MoE)."""
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams

    folder, loaded = tiny_moe
    llm = LLM(str(folder), device="cpu", loaded=loaded, max_num_seqs=4, block_size=4)
    prompts = ["w1 w2 w3", "w7 w8", "w4 w5 w6 w9 w10"]
    outputs = llm.generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=1.0, ignore_eos=True), seed=3)
    model = llm.model
    for prompt, output in zip(prompts, outputs):
        for sample in output.outputs:
            ids = np.array(output.prompt_token_ids + list(sample.token_ids), dtype=np.int32)
            (lp,) = model.logprobs(ids, np.array([0, ids.size]))
            assert np.array_equal(bits(lp[-len(sample.token_ids):]), bits(np.array(sample.logprobs, np.float32)))


@pytest.mark.parametrize("settings", [dict(max_num_seqs=1), dict(max_num_seqs=3, cuda_graphs=True),
                                      dict(max_num_seqs=64, max_num_batched_tokens=5, enable_prefix_caching=True)])
def test_the_engine_records_the_trainers_expert_choices(tiny_moe, settings):
    """Each sampled token's recorded expert choices (those of the row that gave its log-prob) equal the
    trainer's forward's at that row, at max batch 1, 3 (padded decode steps) and 64 with chunked prefill
    and prefix caching: no routing replay is needed."""
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams
    from rlportable.model import backward

    folder, (config, weights, tokenizer) = tiny_moe
    model = Model(CPU, config, weights, trainable=True)
    llm = LLM(str(folder), device="cpu", loaded=(model, tokenizer), block_size=4, **settings)
    prompts = ["w1 w2 w3", "w1 w2 w3 w8", "w4 w5 w6 w9 w10"]
    outputs = llm.generate(prompts, SamplingParams(n=2, max_tokens=5, temperature=1.0, ignore_eos=True), seed=4)
    sparse = sum(config.sparse_layer(i) for i in range(config.num_hidden_layers))
    for output in outputs:
        for sample in output.outputs:
            ids = np.array(output.prompt_token_ids + list(sample.token_ids), dtype=np.int32)
            rows = np.arange(len(output.prompt_token_ids) - 1, ids.size - 1)
            fwd = backward.forward(model, ids, np.array([0, ids.size]), rows=rows)
            trainer = np.stack([layer[rows] for layer in fwd.routing], axis=1)  # [tokens, layers, k]
            recorded = np.stack(sample.routing)
            assert recorded.shape == (len(sample.token_ids), sparse, config.num_experts_per_tok)
            assert np.array_equal(recorded, trainer)
            assert np.array_equal(bits(fwd.logp), bits(np.array(sample.logprobs, np.float32)))


def test_save_and_load_round_trip_the_moe_checkpoint(tiny_moe, tmp_path):
    folder, (config, weights, tokenizer) = tiny_moe
    save_model(tmp_path, config, weights, tokenizer, dtype="fp32")
    again, weights_again, _ = load_model(str(tmp_path))
    assert again == config and json.loads((tmp_path / "config.json").read_text())["architectures"] == \
        ["Qwen3MoeForCausalLM"]
    for layer, other in zip(weights.layers, weights_again.layers):
        if layer.router is not None:
            assert np.array_equal(bits(layer.router), bits(other.router))
            assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(layer.expert_down, other.expert_down))


def test_a_trainable_moe_model_builds_at_every_tp_size(tiny_moe):
    _, (config, weights, _) = tiny_moe
    # forward and backward run on devices (tests/test_moe_device.py) and at TP > 1
    # (tests/test_moe_tensor_parallel.py: the backward's shards are TP 1's gradients' bits)
    assert Model(CPU, config, weights, trainable=True).params.layers[0].router is not None  # trains on cpu
    from rlportable.runtime.collectives import run_threads

    ranks = run_threads(CPU, 2, lambda group: Model(CPU, config, weights, True, group).params.layers[0])
    assert all(layer.expert_gate[0].shape[0] == config.moe_intermediate_size // 2 for layer in ranks)


# ---- training: the backward through the model against transformers' autograd
# As tests/test_model_backward.py: each weight's relative L2 error against float64 autograd below
# GRAD_TOLERANCE, and the worst at most 1/10 of bf16 autograd's worst.


def _hf_names(grads: dict, config) -> dict:
    """transformers 5's fused expert tensors (gate_up_proj [E, 2I, H], gate first; down_proj [E, H, I])
    under the checkpoint's per-expert names, which ours use."""
    out = {}
    inner = config.moe_intermediate_size
    for name, value in grads.items():
        prefix, _, last = name.rpartition(".experts.")
        if last == "gate_up_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = value[e, :inner]
                out[f"{prefix}.experts.{e}.up_proj.weight"] = value[e, inner:]
        elif last == "down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "decoder_sparse_step": 2}])
def test_gradients_match_transformers_autograd(overrides, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from rlportable.model import backward
    from test_model_backward import GRAD_TOLERANCE, _rel_error, gradient_case, torch_gradients

    hf = _hf_moe(tmp_path, **overrides)
    config, weights, _ = load_model(str(tmp_path))
    model = Model(CPU, config, weights, trainable=True)
    tokens, cu, rows, g = gradient_case(config.vocab_size)
    fwd = backward.forward(model, tokens, cu, rows=rows)
    grads = backward.backward(model, fwd, g).named_tensors(config)
    reference, bf16 = (_hf_names(named, config) for named in torch_gradients(hf, tokens, cu, rows, g))
    assert set(grads) == set(reference), set(grads) ^ set(reference)
    worst = worst_bf16 = 0.0
    for name, ref in reference.items():
        error = _rel_error(grads[name], ref)
        assert error < GRAD_TOLERANCE, (name, error, _rel_error(bf16[name], ref))
        worst, worst_bf16 = max(worst, error), max(worst_bf16, _rel_error(bf16[name], ref))
    dense = [name for name in reference if ".experts." not in name]  # bf16 may route some tokens elsewhere
    print(f"worst relative error {worst:.2e}, bf16 autograd {worst_bf16:.2e}; outside the experts "
          f"{max(_rel_error(grads[n], reference[n]) for n in dense):.2e} against "
          f"{max(_rel_error(bf16[n], reference[n]) for n in dense):.2e}; routers "
          f"{max(_rel_error(grads[n], reference[n]) for n in dense if n.endswith('mlp.gate.weight')):.2e} against "
          f"{max(_rel_error(bf16[n], reference[n]) for n in dense if n.endswith('mlp.gate.weight')):.2e}")
    assert worst * ERROR_RATIO_TO_BF16 <= worst_bf16, (worst, worst_bf16)


def _torch_grads_with_aux(hf, tokens, cu, rows, g, coef: float, dtype) -> tuple[dict, float]:
    """_torch_grads' sum_r g_r logp_r plus coef x transformers' load_balancing_loss_func over the router
    logits of both sequences (one forward's rows, as one padded batch with its attention mask: no padding
    row counts), and the loss's value."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = hf.to(dtype)
    model.zero_grad()
    total, layers = 0, []
    for start, stop in zip(cu[:-1], cu[1:]):
        ids = torch.tensor(tokens[start:stop][None].astype(np.int64))
        out = model(ids, output_router_logits=True)
        logp = torch.log_softmax(out.logits[0].double(), dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        picked = (rows >= start) & (rows < stop - 1)
        total = total + (logp[torch.tensor(rows[picked] - start)] * torch.tensor(g[picked].astype(np.float64))).sum()
        layers.append(out.router_logits)
    aux = load_balancing_loss_func(tuple(torch.cat(per_layer) for per_layer in zip(*layers)),
                                   model.config.num_experts, model.config.num_experts_per_tok)
    (total + coef * aux).backward()
    return {name: p.grad.double().numpy() for name, p in model.named_parameters() if p.grad is not None}, aux.item()


# With the loss on, the same rule as above: every gradient within GRAD_TOLERANCE of float64 autograd and
# the worst 10x below bf16 autograd's, the routers' too (the loss reaches the model through them); the
# loss's value 10x closer to float64's than bf16's. Measured: routers 1.8e-4 to 3.6e-4 against bf16's 9.1e-2
# to 0.16; the value 4.8e-7 and 1.6e-5 relative against bf16's 1.4e-3 and 4.6e-3.
# upstream scales the log-probs' gradient: 0.05 puts both terms on the routers at one size
@pytest.mark.parametrize("overrides,upstream", [({}, 0.05), ({"norm_topk_prob": False, "decoder_sparse_step": 2}, 0.05),
                                                ({}, 0.0)])
def test_load_balancing_gradients_match_transformers_autograd(overrides, upstream, tmp_path):
    """router_aux_loss_coef x aux on (output_router_logits true): beside the log-probs' gradient, and alone
    (upstream 0: every gradient is the loss's, through the routers into the layers below)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from rlportable.model import backward
    from rlportable.train.trainer import load_balancing_scale
    from test_model_backward import GRAD_TOLERANCE, _rel_error

    hf = _hf_moe(tmp_path, output_router_logits=True, router_aux_loss_coef=0.5, **overrides)
    config, weights, _ = load_model(str(tmp_path))
    assert config.load_balancing and config.router_aux_loss_coef == 0.5
    model = Model(CPU, config, weights, trainable=True)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, config.vocab_size, 40).astype(np.int32)
    cu = np.array([0, 17, 40])
    rows = np.array([3, 4, 5, 10, 15, 20, 30, 31, 38])
    g = (upstream * rng.normal(size=rows.size)).astype(np.float32)
    fwd = backward.forward(model, tokens, cu, rows=rows)
    grads = backward.backward(model, fwd, g, aux_scale=load_balancing_scale(config, 1)).named_tensors(config)
    reference, value = _torch_grads_with_aux(hf, tokens, cu, rows, g, 0.5, torch.float64)
    bf16, bf16_value = _torch_grads_with_aux(hf, tokens, cu, rows, g, 0.5, torch.bfloat16)
    reference, bf16 = _hf_names(reference, config), _hf_names(bf16, config)
    assert set(grads) == set(reference)
    errors = {name: (_rel_error(grads[name], ref), _rel_error(bf16[name], ref)) for name, ref in reference.items()}
    assert all(ours < GRAD_TOLERANCE for ours, _ in errors.values()), errors
    routers = [name for name in reference if name.endswith("mlp.gate.weight")]
    for name in routers:
        ours, theirs = errors[name]
        assert ours * ERROR_RATIO_TO_BF16 <= theirs, (name, ours, theirs)
    worst, worst_bf16 = max(e for e, _ in errors.values()), max(b for _, b in errors.values())
    assert worst * ERROR_RATIO_TO_BF16 <= worst_bf16, (worst, worst_bf16)
    assert abs(fwd.aux_loss - value) * ERROR_RATIO_TO_BF16 <= abs(bf16_value - value), (fwd.aux_loss, value, bf16_value)
    # the loss moved the routers' gradients by far more than our error (for upstream 0 it is all of them)
    plain = backward.backward(model, backward.forward(model, tokens, cu, rows=rows), g).named_tensors(config)
    for name in routers:
        assert _rel_error(plain[name], reference[name]) > 100 * errors[name][0], name
    print("routers (ours, bf16):", {n: tuple(f"{e:.1e}" for e in errors[n]) for n in routers},
          f"worst {worst:.1e} bf16 {worst_bf16:.1e}; aux {fwd.aux_loss:.7f} float64 {value:.7f} bf16 {bf16_value:.7f}")


# Without the loss (output_router_logits false, or a zero coefficient) the gradients are the bits the code
# gave before the loss existed: these digests were computed at dde0689 (the commit before it).
BEFORE_THE_LOSS = {
    "norm": "3b66bc90d6a192332dfe1775a47d30790cd1eaab8ed5a79991844f4088215d15",
    "step2": "3482ac4e9b44ee4af3688bc22b40799a10797db0b1088adbea4d1722373f4725",
}


def _gradient_digest(config, aux_scale: float) -> str:
    """SHA-256 of every gradient's raw bits (names sorted) of one backward on a seeded random-weight model."""
    import hashlib

    from rlportable.model import backward
    from rlportable.model.synthetic import random_weights

    weights = random_weights(config, 4)
    for layer in weights.layers:
        if layer.router is not None:
            layer.router = (layer.router * 50).astype(np.float32)  # spread logits: tokens pick different experts
    model = Model(CPU, config, weights, trainable=True)
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 64, 30).astype(np.int32)
    fwd = backward.forward(model, tokens, np.array([0, 12, 30]), rows=np.array([2, 3, 8, 20, 25, 28]))
    grads = backward.backward(model, fwd, rng.normal(size=6).astype(np.float32), aux_scale=aux_scale)
    digest = hashlib.sha256()
    for name, value in sorted(grads.named_tensors(config).items()):
        digest.update(np.ascontiguousarray(value, dtype=np.float32).view(np.uint32).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("case,overrides", [("norm", {"norm_topk_prob": True, "mlp_only_layers": [0]}),
                                            ("step2", {"decoder_sparse_step": 2})])
def test_without_the_load_balancing_loss_the_gradients_keep_their_bits(case, overrides):
    from rlportable.train.trainer import load_balancing_scale

    for switches in ({}, {"output_router_logits": True, "router_aux_loss_coef": 0.0},
                     {"output_router_logits": False, "router_aux_loss_coef": 0.5}):
        config = _config(**overrides, **switches)
        assert not config.load_balancing and load_balancing_scale(config, 2) == 0.0
        assert _gradient_digest(config, load_balancing_scale(config, 2)) == BEFORE_THE_LOSS[case], switches
    on = _config(**overrides, output_router_logits=True, router_aux_loss_coef=0.5)
    assert load_balancing_scale(on, 2) == 0.25 and _gradient_digest(on, 0.25) != BEFORE_THE_LOSS[case]


def test_the_synthetic_qwen3_30b_a3b_shape_has_its_published_size():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (Qwen's model card), every layer sparse; the tensors
    counted from the config alone (a full random-weight model is 122 GB of float32)."""
    from rlportable.model.synthetic import qwen3_moe_config
    from rlportable.model.weights import expected_tensors

    config = qwen3_moe_config()
    shapes = expected_tensors(config)
    total = sum(int(np.prod(shape)) for shape in shapes.values())
    experts = sum(int(np.prod(shape)) for name, shape in shapes.items() if ".experts." in name)
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9
    assert all(config.sparse_layer(i) for i in range(config.num_hidden_layers)) and config.num_hidden_layers == 48
    assert qwen3_moe_config(layers=2).num_hidden_layers == 2
