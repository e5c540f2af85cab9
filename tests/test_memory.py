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
    assert bad.exit_code != 0 and "TPxDP" in bad.output
