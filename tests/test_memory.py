"""The memory model (train/memory.py) against what the code allocates, and `bench memory`."""

import numpy as np
import pytest
from click.testing import CliRunner

from rlportable.cli import main
from rlportable.errors import InputError
from rlportable.model.load import load_model
from rlportable.train import memory


def test_weights_and_optimiser_match_the_tensors_the_trainer_allocates():
    from rlportable.model.forward import Model
    from rlportable.runtime import get_backend
    from rlportable.runtime.collectives import run_threads
    from rlportable.train.optimizer import Optimizer, Schedule
    from rlportable.train.sft import SFTConfig

    cpu = get_backend("cpu")
    config, weights, _ = load_model("tiny")
    params = sum(int(np.asarray(a).size) for a in weights.named_tensors(config).values())
    parts = memory.components(config, memory.Layout(1, 3), memory.Workload(64, 0))
    assert parts["weights"] == 4 * params
    layer = sum(int(np.asarray(a).size) for n, a in weights.named_tensors(config).items() if ".layers.0." in n)
    assert parts["gradient"] == 4 * (params - (config.num_hidden_layers - 1) * layer)  # one layer at a time
    optimisers = run_threads(cpu, 3, lambda dp_group: Optimizer(Model(cpu, config, weights, trainable=True),
                                                                SFTConfig().hyper(), Schedule(), dp_group))
    largest_rank = max(sum(opt.m[name].size for name in opt.names) for opt in optimisers)
    # m, v and the gradient piece: 12 bytes an element of the largest rank's pieces (the model rounds the
    # whole count up once, the code each tensor: at most one element a tensor apart)
    optimiser = parts["moments"] + parts["accumulated gradient"]
    assert abs(optimiser - 12 * largest_rank) <= 12 * len(optimisers[0].names)


def test_sharding_divides_the_optimiser_and_tensor_parallelism_the_weights():
    config = memory.qwen3_config("qwen3-8b")
    one = memory.components(config, memory.Layout(1, 1), memory.Workload())
    dp8 = memory.components(config, memory.Layout(1, 8), memory.Workload())
    tp8 = memory.components(config, memory.Layout(8, 1), memory.Workload())
    assert dp8["moments"] * 8 == pytest.approx(one["moments"], rel=1e-6)
    assert dp8["weights"] == one["weights"]
    assert tp8["weights"] < one["weights"] / 7  # the norms stay whole on every rank
    assert tp8["whole lm head"] == 4 * config.vocab_size * config.hidden_size and one["whole lm head"] == 0
    assert memory.peak(one) > 141e9  # an 8B model does not train on one GPU


def test_a_layout_that_does_not_divide_names_the_field():
    config = memory.qwen3_config("qwen3-0.6b")
    with pytest.raises(InputError, match="num_attention_heads=16 is not divisible by the TP size 3"):
        memory.components(config, memory.Layout(3, 1), memory.Workload())
    with pytest.raises(InputError, match="training needs num_key_value_heads \\(8\\) divisible by the TP size \\(16\\)"):
        memory.components(config, memory.Layout(16, 1), memory.Workload())  # the engine could share KV heads
    with pytest.raises(InputError, match="tp must be a positive integer"):
        memory.Layout(0, 1)


def test_bench_memory_prints_the_table():
    result = CliRunner().invoke(main, ["bench", "memory", "--model", "qwen3-8b,qwen3-1.7b", "--layouts", "8x1,1x8"])
    assert result.exit_code == 0, result.output
    assert "qwen3-8b" in result.output and "qwen3-1.7b" in result.output and "peak_gib" in result.output
    bad = CliRunner().invoke(main, ["bench", "memory", "--layouts", "8by1"])
    assert bad.exit_code != 0 and "TPxDP or TPxEPxDP" in bad.output


# ---------------------------------------------------------------------------- Qwen3-MoE


def _moe_config(**overrides):
    from rlportable.model.config import ModelConfig

    # every width a multiple of 64 (the encodings' K padding), so that the stacked and the per-weight
    # counts of the transposed encodings agree; layer 0 dense, the others sparse
    data = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
            "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "mlp_only_layers": [0], "max_position_embeddings": 256, "tie_word_embeddings": False}
    data.update(overrides)
    return ModelConfig.from_dict(data)


def _digit_bytes(encoded) -> int:
    """Bytes of the int8 digits of an encoding (a GemmWeight, a stacked one, a MoE layer's, a list)."""
    from rlportable.ops import gemm, moe

    if encoded is None:
        return 0
    if isinstance(encoded, (list, tuple)):
        return sum(_digit_bytes(item) for item in encoded)
    if isinstance(encoded, gemm.StackedWeight):
        return _digit_bytes(encoded.whole)
    if isinstance(encoded, moe.MoeWeight):
        return _digit_bytes([encoded.router, encoded.gate_up, encoded.down])
    assert isinstance(encoded, gemm.GemmWeight), type(encoded)
    return int(encoded.encoded.digits.nbytes)


def _model_encodings(model) -> int:
    return sum(_digit_bytes([layer.qkv, layer.o, layer.gate_up, layer.down, layer.moe]) for layer in model.layers) \
        + _digit_bytes(model.lm_head)


def _transposed_encodings(cpu, named: dict) -> int:
    """Digit bytes of the encoded transposes (Model.transposed_weight) of every matrix in `named` but the
    embedding (a row gather)."""
    from rlportable.ops import gemm

    matrices = [a for n, a in named.items() if np.asarray(a).ndim == 2 and "embed_tokens" not in n]
    return sum(_digit_bytes(gemm.encode_transposed(cpu, cpu.asarray(a), 0, a.shape[0])) for a in matrices)


def _largest_layer_and_rest(named: dict, layers: int = 3) -> tuple[int, int]:
    """(the elements of the largest of `layers` decoder layers, those outside every layer) in `named`."""
    layer = max(sum(int(np.asarray(a).size) for n, a in named.items() if f".layers.{i}." in n) for i in range(layers))
    return layer, sum(int(np.asarray(a).size) for n, a in named.items() if ".layers." not in n)


def test_moe_weights_encodings_and_gradient_match_the_arrays():
    """Router and every expert's gate/up/down in the weights, both encodings and one layer's gradient,
    against the tiny MoE model's own arrays (a dense layer and two sparse ones)."""
    from rlportable.model.forward import Model
    from rlportable.model.synthetic import random_weights
    from rlportable.runtime import get_backend

    cpu = get_backend("cpu")
    config = _moe_config()
    weights = random_weights(config, seed=0)
    named = weights.named_tensors(config)
    assert any(".mlp.experts.3.down_proj" in n for n in named) and any(".mlp.gate.weight" in n for n in named)
    parts = memory.components(config, memory.Layout(1, 1), memory.Workload(64, 0))
    assert parts["weights"] == 4 * sum(int(np.asarray(a).size) for a in named.values())
    assert parts["encodings"] == _model_encodings(Model(cpu, config, weights, trainable=True))
    # dX = dY W takes each weight's transpose, encoded (Model.transposed_weight): every projection, the
    # router, every expert's gate, up and down, and the LM head (not the embedding: a row gather)
    assert parts["transposed encodings"] == _transposed_encodings(cpu, named)
    # the gradient: the largest layer's (a sparse one: all experts, zeros for those no token chose) at once
    layer, rest = _largest_layer_and_rest(named)
    assert parts["gradient"] == 4 * (layer + rest)
    sparse = sum(int(np.asarray(a).size) for n, a in named.items() if ".layers.1." in n)
    assert layer == sparse > sum(int(np.asarray(a).size) for n, a in named.items() if ".layers.0." in n)


def test_tensor_parallelism_halves_the_experts_but_not_the_router():
    """At TP 2 the counts equal rank 0's own shards and encodings; the experts' bytes halve, the router's not."""
    from rlportable.model.forward import Model
    from rlportable.model.parallel import TensorParallel, shard_weights
    from rlportable.model.synthetic import random_weights
    from rlportable.runtime import get_backend
    from rlportable.runtime.collectives import run_threads

    cpu = get_backend("cpu")
    config = _moe_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    weights = random_weights(config, seed=0)
    models = {tp: run_threads(cpu, tp, lambda group: Model(cpu, config, weights, trainable=False, tp_group=group))[0]
              for tp in (1, 2)}
    one, two = (memory.components(config, memory.Layout(tp, 1), memory.Workload(64, 0)) for tp in (1, 2))
    shard = shard_weights(weights, config, TensorParallel(0, 2)).named_tensors(config)
    assert two["weights"] == 4 * sum(int(np.asarray(a).size) for a in shard.values())
    assert two["encodings"] == _model_encodings(models[2])
    assert one["encodings"] == _model_encodings(models[1])
    for index in (1, 2):
        whole, half = models[1].layers[index].moe, models[2].layers[index].moe
        assert _digit_bytes(half.router) == _digit_bytes(whole.router) > 0
        assert 2 * _digit_bytes([half.gate_up, half.down]) == _digit_bytes([whole.gate_up, whole.down])
    h, e, inner = config.hidden_size, config.num_experts, config.moe_intermediate_size
    assert shard["model.layers.1.mlp.gate.weight"].shape == (e, h)
    assert shard["model.layers.1.mlp.experts.0.up_proj.weight"].shape == (inner // 2, h)
    layer, rest = _largest_layer_and_rest(shard)
    assert two["gradient"] == 4 * (layer + rest)


def test_expert_parallelism_divides_the_experts_but_not_the_router():
    """At EP 2 (TPxEPxDP 1x2x1) the counts equal rank 0's own arrays and encodings: half the experts in the
    weights, both encodings, one layer's gradient and the optimiser state, the router whole."""
    from rlportable.model.expert_parallel import ExpertParallel
    from rlportable.model.forward import Model
    from rlportable.model.synthetic import random_weights
    from rlportable.runtime import get_backend
    from rlportable.runtime.collectives import run_threads

    cpu = get_backend("cpu")
    config = _moe_config()
    weights = random_weights(config, seed=0)
    model = run_threads(cpu, 2, lambda group: Model(cpu, config, weights, trainable=False, ep_group=group))[0]
    (layout,) = memory.parse_layouts("1x2x1")
    assert (layout.tp, layout.ep, layout.dp, layout.gpus) == (1, 2, 1, 2)
    one, two = (memory.components(config, lay, memory.Workload(64, 0)) for lay in (memory.Layout(1, 1), layout))
    mine = ExpertParallel(0, 2).shard_weights(weights, config).named_tensors(config)
    assert {n.split(".experts.")[1].split(".")[0] for n in mine if ".experts." in n} == {"0", "1"}
    params = sum(int(np.asarray(a).size) for a in mine.values())
    assert two["weights"] == 4 * params < one["weights"]
    assert two["encodings"] == _model_encodings(model)
    assert two["transposed encodings"] == _transposed_encodings(cpu, mine)
    layer, rest = _largest_layer_and_rest(mine)
    assert two["gradient"] == 4 * (layer + rest)
    assert two["moments"] == 2 * 4 * params and two["accumulated gradient"] == 4 * params
    assert _digit_bytes(model.layers[1].moe.router) == _digit_bytes(
        Model(cpu, config, weights).layers[1].moe.router) > 0
    assert memory.moe_block_activations(config, 1, 2) < memory.moe_block_activations(config)
    with pytest.raises(InputError, match="^expert parallelism: num_experts=4 is not divisible by the EP size 3$"):
        memory.components(config, memory.Layout(1, 1, ep=3), memory.Workload())


def test_moe_block_activations_match_what_the_backward_holds():
    """The sparse block's bytes a token against the bytes alive (tracemalloc, cpu) at the last step of
    the device-path backward (ops/moe.py composed_block_backward, which runs on the cpu backend too):
    the difference between 1024 and 2048 tokens, so that the weights and caches cancel."""
    import tracemalloc

    from rlportable.model.synthetic import random_weights
    from rlportable.ops import moe
    from rlportable.runtime import get_backend

    cpu = get_backend("cpu")
    for k, experts, inner in ((2, 4, 128), (3, 8, 48)):
        config = _moe_config(num_experts_per_tok=k, num_experts=experts, moe_intermediate_size=inner)
        layer = random_weights(config, seed=0).layers[1]
        router = (layer.router * 50).astype(np.float32)  # spread logits: tokens pick different experts
        encoded = moe.encode(cpu, router, layer.expert_gate, layer.expert_up, layer.expert_down, k, True)
        combine, seen = moe.combine, {"base": 0}

        def last_combine(backend, weights, outputs):
            out = combine(backend, weights, outputs)
            seen["alive"] = tracemalloc.get_traced_memory()[0] - seen["base"]
            return out

        alive = {}
        rng = np.random.default_rng(0)
        for tokens in (1024, 2048):
            h = rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)
            d_out = rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)
            args = (cpu, h, router, layer.expert_gate, layer.expert_up, layer.expert_down, encoded, d_out, None)
            moe.composed_block_backward(*args)  # the weights' cached host integers, once
            moe.combine = last_combine
            tracemalloc.start()
            try:
                seen["base"] = tracemalloc.get_traced_memory()[0]
                moe.composed_block_backward(*args)
            finally:
                tracemalloc.stop()
                moe.combine = combine
            alive[tokens] = seen["alive"]
        measured = (alive[2048] - alive[1024]) / 1024
        assert measured == pytest.approx(memory.moe_block_activations(config), rel=0.05), (k, measured)


class _Recording:
    """A rank's expert-parallel group that keeps every collective's result (for _Replay)."""

    def __init__(self, group, log: list):
        self.group, self.log, self.rank, self.size = group, log, group.rank, group.size

    def all_to_all(self, array):
        self.log.append(np.array(self.group.all_to_all(array)))
        return self.log[-1]

    def all_gather(self, array):
        self.log.append(np.array(self.group.all_gather(array)))
        return self.log[-1]


class _Replay:
    """That rank alone: each collective returns a fresh copy of the recorded result, in order."""

    def __init__(self, log: list, rank: int, size: int):
        self.log, self.rank, self.size, self.calls = log, rank, size, 0

    def _next(self, _array):
        self.calls += 1
        return self.log[self.calls - 1].copy()

    all_to_all = all_gather = _next


def test_ep_block_activations_bound_what_a_rank_holds():
    """The expert-parallel block's bytes a token against what rank 0 holds at its share's last combine
    (model/expert_parallel.py moe_block_backward on the cpu backend, tracemalloc): rank 0 replayed alone
    with its recorded collectives (threads would mix the ranks' allocations), 2048 minus 1024 tokens. The
    model errs high, by at most 25% (it counts even routing; rank 0's experts got fewer rows here)."""
    import tracemalloc

    from rlportable.model import expert_parallel
    from rlportable.model.synthetic import random_weights
    from rlportable.ops import moe
    from rlportable.runtime import get_backend
    from rlportable.runtime.collectives import SingleGroup, run_threads

    cpu = get_backend("cpu")
    for k, experts, inner, ep in ((2, 4, 128, 2), (2, 4, 128, 4), (3, 8, 48, 2), (3, 8, 48, 4)):
        config = _moe_config(num_experts_per_tok=k, num_experts=experts, moe_intermediate_size=inner)
        layer = random_weights(config, seed=0).layers[1]
        router = (layer.router * 50).astype(np.float32)  # spread logits: tokens pick different experts

        def arguments(rank, h, d_out):
            mine = expert_parallel.ExpertParallel(rank, ep).experts(config.num_experts)
            held = [[w if e in mine else None for e, w in enumerate(ws)]
                    for ws in (layer.expert_gate, layer.expert_up, layer.expert_down)]
            return (h, router, *held, moe.encode(cpu, router, *held, k, True), d_out, None)

        alive = {}
        rng = np.random.default_rng(0)
        for tokens in (1024, 2048):
            h = rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)
            d_out = rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)
            logs = [[] for _ in range(ep)]
            run_threads(cpu, ep, lambda group: expert_parallel.moe_block_backward(
                cpu, _Recording(group, logs[group.rank]), SingleGroup(), *arguments(group.rank, h, d_out)))
            args = arguments(0, h, d_out)
            expert_parallel.moe_block_backward(cpu, _Replay(logs[0], 0, ep), SingleGroup(), *args)  # caches, once
            last, seen = moe.input_grad_sum, {}

            def measured_sum(*sum_args):
                out = last(*sum_args)
                seen["alive"] = tracemalloc.get_traced_memory()[0] - seen["base"]
                return out

            moe.input_grad_sum = measured_sum
            tracemalloc.start()
            try:
                seen["base"] = tracemalloc.get_traced_memory()[0]
                expert_parallel.moe_block_backward(cpu, _Replay(logs[0], 0, ep), SingleGroup(), *args)
            finally:
                tracemalloc.stop()
                moe.input_grad_sum = last
            alive[tokens] = seen["alive"]
        measured = (alive[2048] - alive[1024]) / 1024
        model = memory.moe_block_activations(config, 1, ep)
        assert measured <= model <= 1.25 * measured, (k, experts, ep, measured, model)
        assert model < memory.moe_block_activations(config)


def test_qwen3_30b_a3b_counts_and_layouts():
    from rlportable.model.weights import expected_tensors

    config = memory.shape_config("qwen3-30b-a3b")
    params = sum(int(np.prod(shape)) for shape in expected_tensors(config).values())
    one = memory.components(config, memory.Layout(1, 1), memory.Workload())
    assert one["weights"] == 4 * params and round(params / 1e9, 1) == 30.5
    rows = {(r["tp"], r["dp"]): r for r in memory.table("qwen3-30b-a3b", [memory.Layout(t, d) for t, d in
                                                                          ((1, 1), (4, 1), (4, 2), (1, 8))],
                                                       memory.Workload())}
    assert not rows[1, 1]["fits_141gb"] and not rows[1, 8]["fits_141gb"] and not rows[4, 1]["fits_141gb"]
    assert rows[4, 2]["fits_141gb"] and not rows[4, 2]["fits_80gb"]
    assert memory.table("qwen3-30b-a3b", [memory.Layout(1, 1)], memory.Workload(), layers=2)[0]["peak_gib"] < 80
    with pytest.raises(InputError, match="num_key_value_heads \\(4\\) divisible by the TP size \\(8\\)"):
        memory.components(config, memory.Layout(8, 1), memory.Workload())
    # expert parallelism cuts the experts where TP cannot go past 4: 80 GB cards from 16 GPUs on
    ep = {(r["tp"], r["ep"], r["dp"]): r for r in memory.table("qwen3-30b-a3b", memory.parse_layouts(
        "4x2x1,4x2x2,4x4x1,2x8x1"), memory.Workload())}
    assert ep[4, 2, 1]["fits_141gb"] and not ep[4, 2, 1]["fits_80gb"] and ep[4, 2, 1]["gpus"] == 8
    assert ep[4, 2, 1]["peak_gib"] < rows[4, 2]["peak_gib"]  # 8 GPUs either way: EP 2 beats DP 2
    assert ep[4, 4, 1]["fits_80gb"] and ep[2, 8, 1]["fits_80gb"] and not ep[4, 2, 2]["fits_80gb"]


def test_bench_memory_prints_the_moe_table():
    result = CliRunner().invoke(main, ["bench", "memory", "--model", "qwen3-30b-a3b,qwen3-0.6b", "--layouts", "4x2"])
    assert result.exit_code == 0, result.output
    assert "qwen3-30b-a3b" in result.output and "qwen3-0.6b" in result.output


def test_bench_memory_takes_ep_layouts_and_measures_none():
    result = CliRunner().invoke(main, ["bench", "memory", "--model", "qwen3-30b-a3b", "--layouts", "4x1x2,4x2x1"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.startswith("qwen3-30b-a3b")]
    assert [row[1:5] for row in rows] == [["4", "1", "2", "8"], ["4", "2", "1", "8"]]  # tp, ep, dp, gpus
    measured = CliRunner().invoke(main, ["bench", "memory", "--model", "qwen3-30b-a3b", "--layouts", "1x2x1",
                                         "--measure", "--device", "cpu"])
    assert measured.exit_code != 0 and "the layout with EP 2 is modelled only" in measured.output
    bad = CliRunner().invoke(main, ["bench", "memory", "--layouts", "1x2x3x4"])
    assert bad.exit_code != 0 and "'1x2x3x4' is not TPxDP or TPxEPxDP" in bad.output
