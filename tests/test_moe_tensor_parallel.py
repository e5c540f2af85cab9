"""Qwen3-MoE under tensor parallelism (ranks emulated as threads, as tests/test_tensor_parallel.py): the
router whole on every rank, every expert cut like a dense MLP (gate/up column-parallel, down row-parallel
through the exact gemm_sums / round_sums); log-probs, logits, every sparse layer's expert choices and
the engine's tokens and recorded routing bitwise the TP = 1 ones; the sharded backward's gradients
TP 1's slices, and SFT and GRPO at TP 2 saving TP 1's weights on raw bits (load-balancing loss on too)."""

from __future__ import annotations

import numpy as np
import pytest

import moe_parallel
from moe_parallel import CASES, CPU, gradients, packed, raw
from test_moe_device import moe_config, scaled_weights
from rlportable.engine.sequence import SamplingParams
from rlportable.errors import InputError
from rlportable.contract.exact import GEMM_K_CHUNK
from rlportable.model.forward import Model
from rlportable.model.parallel import TensorParallel, shard_tensor, shard_weights
from rlportable.ops import gemm
from rlportable.runtime.collectives import ThreadGroup, run_threads


@pytest.mark.parametrize("overrides", CASES)
@pytest.mark.parametrize("size", [2, 4])
def test_logprobs_logits_and_routing_at_tp_equal_tp1(size, overrides):
    """Every rank returns the single device's bits, routing included: one array per sparse layer."""
    config, want_routing = moe_parallel.check_forward_is_one_devices("tp", size, overrides)
    assert len(want_routing) == sum(config.sparse_layer(i) for i in range(config.num_hidden_layers))


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
    moe_parallel.check_engine_at_2_is_one_devices("tp", config, weights, prompts, params, **engine)


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
@pytest.mark.parametrize("aux_scale", [0.0, 0.25])
@pytest.mark.parametrize("overrides", CASES)
@pytest.mark.parametrize("size", [2, 4])
def test_gradients_at_tp_are_the_tp1_gradients_shards(size, overrides, aux_scale):
    """Every rank's gradients are its shards of TP 1's on raw bits: the router's whole (the same on every
    rank), each expert's gate/up rows and down columns; the load-balancing loss's value too."""
    config = moe_config(**overrides, num_key_value_heads=size)  # training: whole KV heads per rank
    weights = scaled_weights(config, seed=3 + size)
    tokens, cu = packed(config.vocab_size)
    want, want_aux = gradients(Model(CPU, config, weights, trainable=True), tokens, cu, aux_scale)
    assert any(np.any(g) for name, g in want.items() if ".experts." in name)
    results = run_threads(CPU, size, lambda group: gradients(
        Model(CPU, config, weights, trainable=True, tp_group=group), tokens, cu, aux_scale))
    for rank, (got, aux) in enumerate(results):
        assert aux == want_aux and (aux is None) == (aux_scale == 0.0)
        plan = TensorParallel(rank, size)
        for name, whole in want.items():
            assert np.array_equal(raw(got[name]), raw(shard_tensor(config, plan, name, whole))), (rank, name)


@pytest.fixture(scope="module", params=["plain", "aux"])
def hf_folder(tmp_path_factory, request):
    return moe_parallel.hf_folder(tmp_path_factory, request, "tiny-moe")


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_training_at_tp2_saves_tp1s_weights_on_raw_bits(tmp_path, hf_folder, kind):
    """Two SFT or GRPO steps at TP 2 (threads): the same losses (and load-balancing losses) as TP 1, 0
    log-prob and 0 routing mismatches, and every saved weight (gathered whole) TP 1's bits; the routers
    and the experts moved."""
    _, _, _, moved = moe_parallel.check_training_at_2_is_one_devices("tp", kind, tmp_path, hf_folder)
    assert any(".experts." in name and "down_proj" in name for name in moved)
    assert any(".experts." in name and "gate_proj" in name for name in moved)
