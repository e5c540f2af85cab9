"""What tests/test_moe_tensor_parallel.py and tests/test_moe_expert_parallel.py share: the cases, the packed
sequences, one forward or backward on the host, the engine and the trainers run at one parallel size, each
comparison against the one-device run on raw bits. `kind` is "tp" or "ep": the Model / run_sft / run_grpo
group argument (tp_group or ep_group) each rank's group is passed as."""

from __future__ import annotations

import numpy as np
import pytest

from test_moe_device import moe_config, scaled_weights
from rlportable.engine.llm import LLM
from rlportable.model import backward
from rlportable.model.forward import Model
from rlportable.model.synthetic import IdsOnlyTokenizer
from rlportable.runtime import get_backend
from rlportable.runtime.collectives import SingleGroup, run_threads

CPU = get_backend("cpu")

CASES = [
    {"num_experts_per_tok": 2, "norm_topk_prob": True},
    # k = 3 without renormalisation, every second layer dense (TP: intermediate_size cut as before)
    {"num_experts_per_tok": 3, "norm_topk_prob": False, "decoder_sparse_step": 2, "num_hidden_layers": 3},
]


def raw(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def packed(vocab: int, lengths=(1, 6, 23)):
    """Packed sequences of `lengths` tokens (by default three, of 1, 6 and 23)."""
    rng = np.random.default_rng(11)
    return rng.integers(0, vocab, sum(lengths)).astype(np.int32), np.concatenate([[0], np.cumsum(lengths)])


def forward(model: Model, tokens, cu):
    """(log-probs, every row's logits, each sparse layer's experts) on the host."""
    fwd = backward.forward(model, tokens, cu, keep_attention=False)
    logits = model.logits(model.hidden_states(tokens, cu))
    return model.backend.to_numpy(fwd.logp), model.backend.to_numpy(logits), fwd.routing


def check_forward_is_one_devices(kind: str, size: int, overrides: dict):
    """Log-probs, logits and every sparse layer's expert choices at `size` ranks of `kind`: every rank returns
    one device's bits. Returns (the config, one device's routing)."""
    config = moe_config(**overrides)
    weights = scaled_weights(config, seed=size + len(overrides))
    tokens, cu = packed(config.vocab_size)
    want_lp, want_logits, want_routing = forward(Model(CPU, config, weights), tokens, cu)
    assert max(np.unique(layer).size for layer in want_routing) > config.num_experts_per_tok  # tokens spread
    results = run_threads(CPU, size, lambda group: forward(Model(CPU, config, weights, **_group(kind, group)),
                                                           tokens, cu))
    for lp, logits, routing in results:
        assert np.array_equal(raw(lp), raw(want_lp))
        assert np.array_equal(raw(logits), raw(want_logits))
        assert len(routing) == len(want_routing) and all(np.array_equal(g, w) for g, w in zip(routing, want_routing))
    return config, want_routing


def gradients(model: Model, tokens, cu, aux_scale: float):
    """Every weight's gradient (host, by Hugging Face name) and the aux loss of one backward."""
    fwd = backward.forward(model, tokens, cu)
    grad_logp = np.linspace(-1.0, 1.0, fwd.rows.size).astype(np.float32)
    grads = backward.backward(model, fwd, grad_logp, aux_scale=aux_scale)
    return {name: model.backend.to_numpy(a) for name, a in grads.named_tensors(model.config).items()}, fwd.aux_loss


def _group(kind: str, group) -> dict:
    return {f"{kind}_group": group}


def generate(kind: str, size: int, config, weights, prompts, params, **engine):
    """Every rank's engine outputs at `size` ranks of `kind` (one device at size 1)."""
    def work(group):
        model = Model(CPU, config, weights, **_group(kind, group))
        llm = LLM(device=CPU, loaded=(model, IdsOnlyTokenizer()), **engine)
        return llm.generate(prompts, params, seed=6)

    return run_threads(CPU, size, work) if size > 1 else [work(SingleGroup())]


def check_engine_at_2_is_one_devices(kind: str, config, weights, prompts, params, **engine):
    """The engine at 2 ranks: sampled tokens, log-prob bits and recorded expert choices equal one device's,
    and the trainer forward's recomputed choices and log-probs at those rows."""
    (want,) = generate(kind, 1, config, weights, prompts, params, **engine)
    trainer = Model(CPU, config, weights)
    for got in generate(kind, 2, config, weights, prompts, params, **engine):
        for w, g in zip(want, got):
            for ws, gs in zip(w.outputs, g.outputs):
                assert list(gs.token_ids) == list(ws.token_ids)
                assert np.array_equal(raw(gs.logprobs), raw(ws.logprobs))
                recorded = np.stack(gs.routing)
                assert np.array_equal(recorded, np.stack(ws.routing))
                ids = np.array(g.prompt_token_ids + list(gs.token_ids), dtype=np.int32)
                rows = np.arange(len(g.prompt_token_ids) - 1, ids.size - 1)
                fwd = backward.forward(trainer, ids, np.array([0, ids.size]), rows=rows)
                assert np.array_equal(recorded, np.stack([layer[rows] for layer in fwd.routing], axis=1))
                assert np.array_equal(raw(fwd.logp), raw(gs.logprobs))


def hf_folder(tmp_path_factory, request, prefix: str):
    """The tiny transformers Qwen3-MoE of tests/test_moe_train.py; "aux": with the load-balancing loss on."""
    pytest.importorskip("transformers")
    from test_moe_model import _hf_moe

    folder = tmp_path_factory.mktemp(f"{prefix}-{request.param}")
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.5) if request.param == "aux" else {}
    _hf_moe(folder, num_hidden_layers=2, decoder_sparse_step=1, **aux)
    return folder, request.param == "aux"


def train(kind: str, trainer: str, tmp_path, folder, size: int) -> list[dict]:
    """Two SFT or GRPO (`trainer`) steps at `size` ranks of `kind`, saved under tmp_path / f"{kind}{size}";
    rank 0's step records."""
    from test_moe_train import REWARD, _options
    from rlportable.train import prepare
    from rlportable.train.grpo import GRPOConfig
    from rlportable.train.sft import SFTConfig

    (tmp_path / "reward.py").write_text(REWARD)
    name = f"{kind}{size}"

    def rank(group):
        options = _options(tmp_path, folder, name)
        if trainer == "sft":
            config = SFTConfig(steps=2, batch_size=4, learning_rate=3e-3, seed=1)
            return prepare.run_sft(CPU, options, config, lambda r: None, None, **_group(kind, group))
        config = GRPOConfig(steps=2, prompts_per_step=2, num_generations=3, max_completion_length=4,
                            learning_rate=3e-3, seed=5, mini_batches=2, micro_batch_tokens=40)
        return prepare.run_grpo(CPU, options, config, [(f"{tmp_path / 'reward.py'}:varied", 1.0)], lambda r: None,
                                None, **_group(kind, group))

    return run_threads(CPU, size, rank)[0] if size > 1 else rank(None)


def check_training_at_2_is_one_devices(kind: str, trainer: str, tmp_path, hf_folder):
    """Two SFT or GRPO steps at 2 ranks of `kind`: the same losses (and load-balancing losses) as one device,
    0 log-prob and 0 routing mismatches, every saved weight (gathered whole) one device's bits, and
    the routers moved. Returns (the step records at 1 and at 2, the weights saved at 1 and at 2, the model's config,
    the moved weights' names)."""
    from test_moe_train import _weights
    from rlportable.model.load import load_model

    folder, aux = hf_folder
    want, got = train(kind, trainer, tmp_path, folder, 1), train(kind, trainer, tmp_path, folder, 2)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for w, g in zip(want, got):
        assert g["loss"] == w["loss"] and g.get("aux_loss") == w.get("aux_loss")
        assert (g.get("aux_loss") is not None) == aux
        if trainer == "grpo":
            assert g["logp_mismatches"] == g["routing_mismatches"] == 0 and g["routing_compared"] > 0
    single, sharded = _weights(tmp_path / f"{kind}1"), _weights(tmp_path / f"{kind}2")
    assert single.keys() == sharded.keys()
    for name in single:
        assert np.array_equal(sharded[name], single[name]), name
    config, weights, _ = load_model(str(folder))
    moved = [name for name, array in weights.named_tensors(config).items()
             if not np.array_equal(single[name], array.view(np.uint32))]
    assert any(name.endswith("mlp.gate.weight") for name in moved)
    return (want, got), (single, sharded), config, moved
