"""The built-in Qwen3-MoE (`--model tiny-moe`, rlportable/model/tiny.py tiny_moe_model): tiny-sft upcycled,
made at load from the shipped weights and a seed; its shape, its determinism, its experts in use, and the
commands that take it."""

import json

import numpy as np
from click.testing import CliRunner

from rlportable.cli import main
from rlportable.model import backward
from rlportable.model.forward import Model
from rlportable.model.load import load_model, save_model
from rlportable.model.tiny import TINY_MOE_ACTIVE, TINY_MOE_EXPERTS
from rlportable.runtime import get_backend
from rlportable.train import prepare

CPU = get_backend("cpu")


def _bits(weights, config) -> dict:
    return {name: np.asarray(a, np.float32).view(np.uint32) for name, a in weights.named_tensors(config).items()}


def test_tiny_moe_is_tiny_sft_with_one_sparse_layer():
    config, weights, tokenizer = load_model("tiny-moe")
    dense_config, dense, _ = load_model("tiny-sft")
    assert config.architecture == "Qwen3MoeForCausalLM" and config.is_moe
    assert [config.sparse_layer(i) for i in range(config.num_hidden_layers)] == [False, True]
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (TINY_MOE_EXPERTS,
                                                                                        TINY_MOE_ACTIVE, True)
    assert not config.load_balancing
    ours, theirs = _bits(weights, config), _bits(dense, dense_config)
    shared = set(ours) & set(theirs)
    assert {name for name in theirs if name not in shared} == {
        f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert all(np.array_equal(ours[name], theirs[name]) for name in shared)
    experts = [ours[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(TINY_MOE_EXPERTS)]
    assert all(not np.array_equal(experts[0], other) for other in experts[1:])
    assert tokenizer.encode("3+4=") == load_model("tiny-sft")[2].encode("3+4=")


def test_tiny_moe_pinned_digest():
    # The golden MoE trajectory depends on these bits (tiny-sft's and NumPy's default_rng normal stream): a
    # change here is a change of the tiny-moe model, to be made on purpose with the golden digests rewritten
    from test_tiny_model import digest

    config, weights, _ = load_model("tiny-moe")
    assert digest(config, weights) == "4ce646e0e0c0ab84a93b938cf3a07d45886b7af14dbb58c32fe8eed8cd7b8d5e"


def test_tiny_moe_is_deterministic_and_routes_over_its_experts():
    config, a, tokenizer = load_model("tiny-moe")
    _, b, _ = load_model("tiny-moe")
    first, second = _bits(a, config), _bits(b, config)
    assert all(np.array_equal(first[name], second[name]) for name in first)
    tokens = np.array(tokenizer.encode("What is 3+4? 7. What is 8+1? 9. 5+2=7 6+0=6"), np.int32)
    fwd = backward.forward(Model(CPU, config, a, trainable=True), tokens, np.array([0, tokens.size]),
                           keep_attention=False)
    (routing,) = fwd.routing
    assert np.unique(routing).size == TINY_MOE_EXPERTS  # every expert gets tokens


def test_tiny_moe_saves_and_loads_to_the_bit(tmp_path):
    config, weights, tokenizer = load_model("tiny-moe")
    save_model(tmp_path, config, weights, tokenizer, dtype="fp32")
    loaded_config, loaded, _ = load_model(str(tmp_path))
    assert loaded_config.is_moe and loaded_config.num_experts == TINY_MOE_EXPERTS
    want, got = _bits(weights, config), _bits(loaded, loaded_config)
    assert want.keys() == got.keys() and all(np.array_equal(want[n], got[n]) for n in want)


def test_the_commands_take_tiny_moe(tmp_path):
    assert "tiny-moe" in prepare.BUILT_IN_MODELS  # the embedded run's settings, as tiny-sft's
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "--model", "tiny-moe", "--device", "cpu", "--prompt", "3+4=",
                                  "--max-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["grpo", "--model", "tiny-moe", "--device", "cpu", "--steps", "1",
                                  "--prompts-per-step", "2", "-G", "4", "--out", str(tmp_path / "grpo"),
                                  "--log-jsonl", str(tmp_path / "grpo.jsonl")])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "grpo.jsonl").read_text().splitlines()[-1])
    assert record["routing_mismatches"] == 0 and record["routing_compared"] > 0
    result = runner.invoke(main, ["sft", "--model", "tiny-moe", "--device", "cpu", "--steps", "1",
                                  "--batch-size", "2", "--out", str(tmp_path / "sft")])
    assert result.exit_code == 0, result.output
