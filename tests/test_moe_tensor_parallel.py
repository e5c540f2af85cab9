"""Qwen3-MoE under tensor parallelism (ranks emulated as threads, as tests/test_tensor_parallel.py): the
router whole on every rank, every expert cut like a dense MLP (gate/up column-parallel, down row-parallel
through the exact gemm_sums / round_sums); log-probs, logits, every sparse layer's expert choices and
the engine's tokens and recorded routing bitwise the TP = 1 ones; the sharded backward's gradients
TP 1's slices, and SFT and GRPO at TP 2 saving TP 1's weights on raw bits (load-balancing loss on too)."""

from __future__ import annotations

import numpy as np
import pytest

from test_moe_device import moe_config, scaled_weights
from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams
from rlportable.errors import InputError
from rlportable.model import backward
from rlportable.contract.exact import GEMM_K_CHUNK
from rlportable.model.forward import Model
from rlportable.model.parallel import TensorParallel, shard_tensor, shard_weights
from rlportable.model.synthetic import IdsOnlyTokenizer
from rlportable.ops import gemm
from rlportable.runtime import get_backend
from rlportable.runtime.collectives import SingleGroup, ThreadGroup, run_threads

CPU = get_backend("cpu")

CASES = [
    {"num_experts_per_tok": 2, "norm_topk_prob": True},
    # k = 3 without renormalisation, every second layer dense (intermediate_size cut as before)
    {"num_experts_per_tok": 3, "norm_topk_prob": False, "decoder_sparse_step": 2, "num_hidden_layers": 3},
]


def raw(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def _packed(vocab: int):
    """Three packed sequences of 1, 6 and 23 tokens."""
    rng = np.random.default_rng(11)
    return rng.integers(0, vocab, 30).astype(np.int32), np.array([0, 1, 7, 30])


def _forward(model: Model, tokens, cu):
    """(log-probs, every row's logits, each sparse layer's experts) on the host."""
    fwd = backward.forward(model, tokens, cu, keep_attention=False)
    logits = model.logits(model.hidden_states(tokens, cu))
    return model.backend.to_numpy(fwd.logp), model.backend.to_numpy(logits), fwd.routing


@pytest.mark.parametrize("overrides", CASES)
@pytest.mark.parametrize("size", [2, 4])
def test_logprobs_logits_and_routing_at_tp_equal_tp1(size, overrides):
    config = moe_config(**overrides)
    weights = scaled_weights(config, seed=size + len(overrides))
    tokens, cu = _packed(config.vocab_size)
    want_lp, want_logits, want_routing = _forward(Model(CPU, config, weights), tokens, cu)
    sparse = sum(config.sparse_layer(i) for i in range(config.num_hidden_layers))
    assert len(want_routing) == sparse
    assert max(np.unique(layer).size for layer in want_routing) > config.num_experts_per_tok  # tokens spread
    results = run_threads(CPU, size, lambda group: _forward(Model(CPU, config, weights, tp_group=group), tokens, cu))
    for lp, logits, routing in results:  # every rank returns the single device's bits
        assert np.array_equal(raw(lp), raw(want_lp))
        assert np.array_equal(raw(logits), raw(want_logits))
        assert len(routing) == sparse and all(np.array_equal(g, w) for g, w in zip(routing, want_routing))


def test_expert_shards_keep_the_whole_rows_exponents():
    """gate/up: each rank holds I / TP whole rows of every expert (their own exponents); down: a K-shard
    of every row, encoded with the MAX over the shards, which is the unsharded row's exponent; the router
    is whole on every rank."""
    config = moe_config()
    weights = scaled_weights(config, seed=5)
    size, inner = 2, config.moe_intermediate_size
    layer = weights.layers[0]
    # every expert's down rows get their largest element on rank 1's half, so rank 0's own exponents differ
    for e, down in enumerate(layer.expert_down):
        down[:, inner // 2 + e % (inner // 2)] = 4.0
    single = Model(CPU, config, weights).layers[0].moe
    ranks = run_threads(CPU, size, lambda group: Model(CPU, config, weights, tp_group=group).layers[0].moe)
    for rank, sharded in enumerate(ranks):
        cut = slice(rank * inner // size, (rank + 1) * inner // size)
        shard = shard_weights(weights, config, TensorParallel(rank, size)).layers[0]
        assert np.array_equal(shard.router, layer.router)
        assert np.array_equal(raw(sharded.router.encoded.exponents), raw(single.router.encoded.exponents))
        for e in range(config.num_experts):
            assert np.array_equal(shard.expert_gate[e], layer.expert_gate[e][cut])
            assert np.array_equal(shard.expert_down[e], layer.expert_down[e][:, cut])
            assert np.array_equal(np.asarray(sharded.down[e].encoded.exponents),
                                  np.asarray(single.down[e].encoded.exponents))
            own = np.asarray(gemm.encode_weight(CPU, shard.expert_down[e]).encoded.exponents)
            assert rank == 1 or not np.array_equal(own, np.asarray(single.down[e].encoded.exponents))


def _generate(size: int, config, weights, prompts, params, **engine):
    def work(group):
        model = Model(CPU, config, weights, tp_group=group)
        llm = LLM(device=CPU, loaded=(model, IdsOnlyTokenizer()), **engine)
        return llm.generate(prompts, params, seed=6)

    return run_threads(CPU, size, work) if size > 1 else [work(SingleGroup())]


@pytest.mark.parametrize("engine", [dict(max_num_seqs=3, block_size=4),
                                    dict(max_num_seqs=64, block_size=2, max_num_batched_tokens=5,
                                         enable_prefix_caching=True)])
def test_the_engine_at_tp2_records_tp1s_tokens_and_routing_and_the_trainers(engine):
    """Routing invariance at TP 2: the engine's sampled tokens, log-prob bits and recorded expert choices
    (CompletionOutput.routing) equal TP 1's, and the trainer forward's recomputed choices at those rows."""
    config = moe_config(num_experts_per_tok=2, norm_topk_prob=False)
    weights = scaled_weights(config, seed=9)
    prompts = [[5, 9, 2], [7, 7, 1, 30, 4], [5, 9, 2, 11]]
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, ignore_eos=True)
    (want,) = _generate(1, config, weights, prompts, params, **engine)
    trainer = Model(CPU, config, weights)
    for got in _generate(2, config, weights, prompts, params, **engine):
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


def test_what_tp_cannot_cut_is_one_line():
    config = moe_config(moe_intermediate_size=6)  # 6 experts' columns over 4 ranks
    weights = scaled_weights(config, seed=1)
    with pytest.raises(InputError, match="^tensor parallelism: moe_intermediate_size=6 is not divisible by the "
                                         "TP size 4$"):
        Model(CPU, config, weights, tp_group=ThreadGroup.create(CPU, 4)[0])
    wide = moe_config(moe_intermediate_size=GEMM_K_CHUNK + 2)  # dX(d g, G_e) would be two chunks
    with pytest.raises(InputError, match="moe_intermediate_size, heads x head_dim "):
        wide_weights = scaled_weights(moe_config(), seed=1)
        Model(CPU, wide, wide_weights, trainable=True, tp_group=ThreadGroup.create(CPU, 2)[0])


# ---- training: the sparse layers' backward sharded
def _gradients(model: Model, tokens, cu, aux_scale: float):
    """Every weight's gradient (host, by Hugging Face name) and the aux loss of one backward."""
    fwd = backward.forward(model, tokens, cu)
    grad_logp = np.linspace(-1.0, 1.0, fwd.rows.size).astype(np.float32)
    grads = backward.backward(model, fwd, grad_logp, aux_scale=aux_scale)
    return {name: model.backend.to_numpy(a) for name, a in grads.named_tensors(model.config).items()}, fwd.aux_loss


@pytest.mark.parametrize("aux_scale", [0.0, 0.25])
@pytest.mark.parametrize("overrides", CASES)
@pytest.mark.parametrize("size", [2, 4])
def test_gradients_at_tp_are_the_tp1_gradients_shards(size, overrides, aux_scale):
    """Every rank's gradients are its shards of TP 1's on raw bits: the router's whole (the same on every
    rank), each expert's gate/up rows and down columns; the load-balancing loss's value too."""
    config = moe_config(**overrides, num_key_value_heads=size)  # training: whole KV heads per rank
    weights = scaled_weights(config, seed=3 + size)
    tokens, cu = _packed(config.vocab_size)
    want, want_aux = _gradients(Model(CPU, config, weights, trainable=True), tokens, cu, aux_scale)
    assert any(np.any(g) for name, g in want.items() if ".experts." in name)
    results = run_threads(CPU, size, lambda group: _gradients(
        Model(CPU, config, weights, trainable=True, tp_group=group), tokens, cu, aux_scale))
    for rank, (got, aux) in enumerate(results):
        assert aux == want_aux and (aux is None) == (aux_scale == 0.0)
        plan = TensorParallel(rank, size)
        for name, whole in want.items():
            assert np.array_equal(raw(got[name]), raw(shard_tensor(config, plan, name, whole))), (rank, name)


@pytest.fixture(scope="module", params=["plain", "aux"])
def hf_folder(tmp_path_factory, request):
    """The tiny transformers Qwen3-MoE of tests/test_moe_train.py; "aux": with the load-balancing loss on."""
    pytest.importorskip("transformers")
    from test_moe_model import _hf_moe

    folder = tmp_path_factory.mktemp(f"tiny-moe-{request.param}")
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.5) if request.param == "aux" else {}
    _hf_moe(folder, num_hidden_layers=2, decoder_sparse_step=1, **aux)
    return folder, request.param == "aux"


def _train(kind: str, tmp_path, folder, tp: int) -> list[dict]:
    from test_moe_train import REWARD, _options
    from rlportable.train import prepare
    from rlportable.train.grpo import GRPOConfig
    from rlportable.train.sft import SFTConfig

    (tmp_path / "reward.py").write_text(REWARD)
    name = f"tp{tp}"

    def rank(group):
        options = _options(tmp_path, folder, name)
        if kind == "sft":
            config = SFTConfig(steps=2, batch_size=4, learning_rate=3e-3, seed=1)
            return prepare.run_sft(CPU, options, config, lambda r: None, None, group)
        config = GRPOConfig(steps=2, prompts_per_step=2, num_generations=3, max_completion_length=4,
                            learning_rate=3e-3, seed=5, mini_batches=2, micro_batch_tokens=40)
        return prepare.run_grpo(CPU, options, config, [(f"{tmp_path / 'reward.py'}:varied", 1.0)], lambda r: None,
                                None, group)

    return run_threads(CPU, tp, rank)[0] if tp > 1 else rank(None)


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_training_at_tp2_saves_tp1s_weights_on_raw_bits(tmp_path, hf_folder, kind):
    """Two SFT or GRPO steps at TP 2 (threads): the same losses (and load-balancing losses) as TP 1, 0
    log-prob and 0 routing mismatches, and every saved weight (gathered whole) TP 1's bits; the routers
    and the experts moved."""
    from test_moe_train import _weights
    from rlportable.model.load import load_model

    folder, aux = hf_folder
    want, got = _train(kind, tmp_path, folder, 1), _train(kind, tmp_path, folder, 2)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for w, g in zip(want, got):
        assert g["loss"] == w["loss"] and g.get("aux_loss") == w.get("aux_loss")
        assert (g.get("aux_loss") is not None) == aux
        if kind == "grpo":
            assert g["logp_mismatches"] == g["routing_mismatches"] == 0 and g["routing_compared"] > 0
    single, sharded = _weights(tmp_path / "tp1"), _weights(tmp_path / "tp2")
    assert single.keys() == sharded.keys()
    for name in single:
        assert np.array_equal(sharded[name], single[name]), name
    config, weights, _ = load_model(str(folder))
    moved = [name for name, array in weights.named_tensors(config).items()
             if not np.array_equal(single[name], array.view(np.uint32))]
    assert any(name.endswith("mlp.gate.weight") for name in moved)
    assert any(".experts." in name and "down_proj" in name for name in moved)
    assert any(".experts." in name and "gate_proj" in name for name in moved)
