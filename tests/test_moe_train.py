"""SFT and GRPO on a tiny random-weight Qwen3-MoE (from a transformers config) on the cpu backend: the
engine's expert choices equal the trainer's every step (0 routing mismatches beside 0 log-prob
mismatches), the weights move, a resumed run continues bitwise, and the one-line refusals."""

import json

import numpy as np
import pytest

from rlportable.model.load import load_model
from rlportable.runtime import get_backend
from rlportable.train import checkpoint, prepare
from rlportable.train.grpo import GRPOConfig, RoutingMismatchError
from rlportable.train.sft import SFTConfig

CPU = get_backend("cpu")
TASK = "arithmetic:digits=1,ops=+"
REWARD = '''
def varied(completions, completion_ids, **columns):
    """A reward with spread inside every group: the count of even token ids."""
    return [float(sum(1 for t in ids if t % 2 == 0)) for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_moe_model import _hf_moe

    folder = tmp_path_factory.mktemp("tiny-moe")
    _hf_moe(folder, num_hidden_layers=2, decoder_sparse_step=1)
    return folder


def _options(tmp_path, model, name="run", resume=False):
    return prepare.RunOptions(model=str(model), out=str(tmp_path / name), resume=resume, save_every=1,
                             log_jsonl=str(tmp_path / f"{name}.jsonl"), plot=None, task=TASK, data=None)


def _weights(folder) -> dict:
    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(folder))
    return {k: np.array(v).view(np.uint32) for k, v in ckpt.weights.named_tensors(ckpt.config).items()}


def _grpo(tmp_path, moe_folder, name="run", resume=False, steps=2, on_step=lambda r: None):
    (tmp_path / "reward.py").write_text(REWARD)
    config = GRPOConfig(steps=steps, prompts_per_step=2, num_generations=3, max_completion_length=4,
                        learning_rate=3e-3, seed=5, mini_batches=2, micro_batch_tokens=40)
    return prepare.run_grpo(CPU, _options(tmp_path, moe_folder, name, resume), config,
                           [(f"{tmp_path / 'reward.py'}:varied", 1.0)], on_step)


def test_grpo_on_moe_has_zero_routing_and_logprob_mismatches(tmp_path, moe_folder):
    records = _grpo(tmp_path, moe_folder)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["logp_mismatches"] == 0 and r["routing_mismatches"] == 0
        assert r["routing_compared"] == r["logp_compared"] == round(r["completion_length"] * 6) > 0
        assert r["loss"] != 0.0  # the reward has spread: the second mini-batch trains on moved weights
    logged = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[-1])
    assert logged["routing_mismatches"] == 0
    config, weights, _ = load_model(str(moe_folder))
    start = weights.named_tensors(config)
    final = _weights(tmp_path / "run")
    # the routers and the chosen experts moved
    moved = [name for name, bits in final.items() if not np.array_equal(bits, start[name].view(np.uint32))]
    assert any(name.endswith("mlp.gate.weight") for name in moved)
    assert any(".experts." in name for name in moved)


def test_grpo_on_moe_resumes_bitwise(tmp_path, moe_folder):
    _grpo(tmp_path, moe_folder, "straight")

    def crash_after_one(record):
        if record["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _grpo(tmp_path, moe_folder, "crashed", on_step=crash_after_one)
    _grpo(tmp_path, moe_folder, "crashed", resume=True)
    straight, resumed = _weights(tmp_path / "straight"), _weights(tmp_path / "crashed")
    assert all(np.array_equal(straight[name], resumed[name]) for name in straight)


def test_a_changed_expert_choice_stops_the_run(tmp_path, moe_folder, monkeypatch):
    from rlportable.train import grpo

    original = grpo.GRPOTrainer._rollout

    def perturbed(self, records, step):
        samples, texts = original(self, records, step)
        samples[0].routing = samples[0].routing.copy()
        samples[0].routing[0, 0, 0] = (samples[0].routing[0, 0, 0] + 1) % 8  # another expert, one token
        return samples, texts

    monkeypatch.setattr(grpo.GRPOTrainer, "_rollout", perturbed)
    with pytest.raises(RoutingMismatchError, match="on 1 of"):
        _grpo(tmp_path, moe_folder, steps=1)


def test_sft_on_moe_lowers_the_loss(tmp_path, moe_folder):
    config = SFTConfig(steps=4, batch_size=4, learning_rate=3e-3, seed=1)
    records = prepare.run_sft(CPU, _options(tmp_path, moe_folder), config, lambda r: None)
    assert records[-1]["loss"] < records[0]["loss"]
    final = _weights(tmp_path / "run")
    assert any(name.endswith("mlp.gate.weight") for name in final)


def test_the_cli_trains_moe_on_cpu_and_at_tp2(tmp_path, moe_folder):
    from click.testing import CliRunner

    from rlportable.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["sft", "--model", str(moe_folder), "--device", "cpu", "--steps", "1",
                                  "--batch-size", "2", "--out", str(tmp_path / "sft")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["grpo", "--model", str(moe_folder), "--device", "cpu", "--steps", "1",
                                  "--prompts-per-step", "2", "-G", "2", "--max-completion-length", "3",
                                  "--out", str(tmp_path / "grpo"), "--log-jsonl", str(tmp_path / "grpo.jsonl")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "grpo.jsonl").read_text().splitlines()[-1])["routing_mismatches"] == 0
    result = runner.invoke(main, ["grpo", "--model", str(moe_folder), "--device", "cpu", "--steps", "1",
                                  "--prompts-per-step", "2", "-G", "2", "--max-completion-length", "3", "--tp", "2",
                                  "--emulate", "--out", str(tmp_path / "tp"), "--log-jsonl", str(tmp_path / "tp.jsonl")])
    assert result.exit_code == 0, result.output
    logged, sharded = (json.loads((tmp_path / name).read_text().splitlines()[-1]) for name in ("grpo.jsonl", "tp.jsonl"))
    assert sharded["routing_mismatches"] == sharded["logp_mismatches"] == 0
    assert sharded["loss"] == logged["loss"]  # the TP 1 run's step above
