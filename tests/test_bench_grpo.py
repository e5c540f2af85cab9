"""bench grpo on cpu at tiny sizes: the GRPOConfig additions it needs (token-id prompts, ignore_eos,
the engine's sampler), the reward, our side's measurement, TRL's side (skipped without trl), the CLI.
No timing assertions: only that every step is timed and every completion has the full length."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import clean_exit
from rlportable.bench import grpo as bench
from rlportable.model.synthetic import IdsOnlyTokenizer
from rlportable.cli import main
from rlportable.errors import InputError
from rlportable.model.forward import Model
from rlportable.model.tiny import tiny_config, tiny_weights
from rlportable.runtime import get_backend
from rlportable.train.grpo import GRPOConfig, GRPOTrainer, prompt_length
from rlportable.train.rewards import RewardSet

CPU = get_backend("cpu")
TINY = dict(prompts_per_step=2, num_generations=3, prompt_len=4, completion_len=5, steps=1, warmup=1)


def _trainer(dataset, tokenizer=None, **config):
    model_config = tiny_config()
    model = Model(CPU, model_config, tiny_weights(model_config), trainable=True)
    settings = dict(steps=2, prompts_per_step=2, num_generations=3, max_completion_length=5, seed=3)
    return GRPOTrainer(model, tokenizer or IdsOnlyTokenizer(), dataset, RewardSet([(bench.hash_reward, 1.0)]),
                       GRPOConfig(**{**settings, **config}))


def test_grpo_trainer_takes_token_id_prompts():
    prompts = bench.random_prompts(tiny_config(), 2, 4)
    trainer = _trainer([{"prompt": row.tolist()} for row in prompts], ignore_eos=True)
    assert trainer.engine.max_model_len == 4 + 5  # the longest prompt, counted in ids (no encode)
    samples, _ = trainer._rollout([{"prompt": row.tolist()} for row in prompts], 0)
    assert [s.prompt_ids for s in samples] == [row.tolist() for row in prompts for _ in range(3)]
    assert all(len(s.completion_ids) == 5 and len(s.logp) == 5 for s in samples)


def test_prompt_length_of_texts_and_ids():
    from rlportable.model.load import load_model

    _, _, tokenizer = load_model("tiny")
    assert prompt_length(tokenizer, "12+34=") == len(tokenizer.encode("12+34="))
    assert prompt_length(IdsOnlyTokenizer(), [5, 6, 7]) == 3


def test_ignore_eos_and_sampler_reach_the_engine(monkeypatch):
    """ignore_eos goes into every rollout's SamplingParams; sampler picks the engine's sampler."""
    trainer = _trainer([{"prompt": [1, 2, 3]}], ignore_eos=True, sampler="device")
    assert trainer.engine.runner.sampler == "device"
    seen = []
    generate = trainer.engine.generate
    monkeypatch.setattr(trainer.engine, "generate", lambda prompts, params, **kw: seen.append(params) or
                        generate(prompts, params, **kw))
    trainer._rollout([{"prompt": [1, 2, 3]}], 0)
    assert seen[0].ignore_eos is True and seen[0].max_tokens == 5
    assert GRPOConfig().ignore_eos is False and GRPOConfig().sampler == "host"
    with pytest.raises(InputError):
        _trainer([{"prompt": [1, 2]}], sampler="gpu")


def test_ignore_eos_runs_every_completion_to_the_end():
    """With the tiny model's own tokenizer (which has an eos) every completion is max_completion_length."""
    from rlportable.model.load import load_model

    _, _, tokenizer = load_model("tiny")
    trainer = _trainer([{"prompt": "1+2="}], tokenizer, ignore_eos=True, max_completion_length=12,
                       num_generations=8, prompts_per_step=1)
    samples, _ = trainer._rollout([{"prompt": "1+2="}], 0)
    assert [len(s.completion_ids) for s in samples] == [12] * 8


def test_hash_reward_is_a_function_of_the_ids():
    ids = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    rewards = bench.hash_reward(completion_ids=ids, prompts=None, completions=None, trainer_state=None)
    assert rewards[0] == rewards[2] != rewards[1]
    assert all(0.0 <= r < 1.0 for r in rewards)
    spread = bench.hash_reward(completion_ids=[[i] for i in range(64)])
    assert np.std(spread) > 0.2  # uniform on [0, 1): std 0.29, so the advantages are far from zero


def test_settings_and_trl_arguments():
    settings = bench.Settings()
    assert (settings.samples, settings.prompt_len, settings.completion_len, settings.total_steps) == (64, 64, 256, 4)
    args = bench.trl_args(settings, "/tmp/x", "cuda")
    assert args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] == 64  # one step per rollout
    assert (args["num_iterations"], args["beta"], args["loss_type"], args["num_generations"]) == (1, 0.0, "dapo", 8)
    assert args["max_completion_length"] == 256 and args["temperature"] == 1.0 and args["top_k"] == 0
    assert args["bf16"] and not args["use_cpu"] and not args["use_vllm"] and args["max_steps"] == 4
    with pytest.raises(InputError):
        bench.trl_args(bench.Settings(prompts_per_step=3, num_generations=4), "/tmp/x", "cuda", micro_batch=8)
    with pytest.raises(InputError):
        bench.Settings(steps=0)


def test_our_side_on_cpu():
    config = tiny_config()
    result = bench.measure(CPU, config, tiny_weights(config), bench.Settings(**TINY), peer="none")
    assert result["ours_error"] is None, result["ours_error"]
    ours = result["ours"]
    assert len(ours["steps"]) == 2 and ours["completion_lengths"] == [5, 5]
    assert all(s["samples"] == 6 and s["logp_mismatches"] == 0 for s in ours["steps"])
    assert all(s["total_s"] >= s["rollout_s"] > 0 for s in ours["steps"])
    assert ours["total_s_median"] == ours["steps"][1]["total_s"]  # the warm-up step is not counted
    assert ours["steps"][0]["reward_std"] > 0  # non-zero advantages
    # every phase of the step is reported, and together they account for its time
    phases = ours["steps"][1]["phases_s"]
    assert {"rollout", "rewards", "kv_cache", "old_logp", "forward", "loss", "backward", "optimizer",
            "other"} <= set(phases)
    assert all(value >= 0 for value in phases.values()) and phases["backward"] > 0
    assert sum(phases.values()) == pytest.approx(ours["steps"][1]["total_s"], rel=0.05)
    assert set(ours["phases_s_median"]) == set(phases)
    assert ours["config"]["ignore_eos"] and ours["engine"]["sampler"] == "host"  # auto on cpu
    assert result["trl"] is None and result["ratios"] == {} and result["peer_error"] is None


def test_trl_side_on_cpu():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    config = tiny_config()
    settings = bench.Settings(**TINY)
    trl = bench.measure_trl(config, bench.bench_prompts(config, settings), settings, device="cpu")
    assert len(trl["steps"]) == 2 and trl["completion_lengths"] == [5, 5]  # the eos can never be sampled
    assert trl["trl"]["eos_token_id"] == [config.vocab_size]
    assert trl["trl"]["per_device_train_batch_size"] * trl["trl"]["gradient_accumulation_steps"] == 6
    assert all(s["samples"] == 6 and s["total_s"] >= s["rollout_s"] > 0 for s in trl["steps"])
    assert all(s["reward_std"] > 0 for s in trl["steps"])
    ratios = bench.compare({"rollout_s_median": 1.0, "train_s_median": 2.0, "total_s_median": 3.0}, trl)
    assert ratios["total_ratio"] == pytest.approx(3.0 / trl["total_s_median"])


def test_id_tokenizer_round_trips_token_ids():
    pytest.importorskip("transformers")
    tokenizer = bench.id_tokenizer(512)
    assert tokenizer(text=[bench.prompt_text([5, 511, 0])])["input_ids"] == [[5, 511, 0]]
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 512


def _fake_side(settings, seconds=(1.0, 2.0)):
    """A measured side as summarize() makes it, without running a trainer."""
    steps = [{"rollout_s": seconds[0], "train_s": seconds[1], "total_s": sum(seconds), "logp_mismatches": 0,
              "completion_min": settings.completion_len, "completion_max": settings.completion_len}
             for _ in range(settings.total_steps)]
    return bench.summarize(steps, settings.warmup)


def test_a_missing_or_failing_peer_keeps_our_numbers(monkeypatch):
    def broken(*args, **kwargs):
        raise bench.RlpError("bench grpo needs trl and datasets for the peer (or --peer none): no trl")

    monkeypatch.setattr(bench, "measure_ours", lambda backend, config, weights, prompts, settings, **kw:
                        _fake_side(settings))
    monkeypatch.setattr(bench, "measure_trl", broken)
    config = tiny_config()
    result = bench.measure(CPU, config, tiny_weights(config), bench.Settings(**TINY), peer="trl")
    assert result["ours"]["completion_lengths"] == [5, 5] and result["trl"] is None
    assert result["peer_error"].startswith("RlpError: bench grpo needs trl") and result["ratios"] == {}


def test_a_failing_trainer_still_times_the_peer(monkeypatch):
    """A log-prob mismatch (or out of memory) on our side: TRL still runs, the error is recorded."""
    from rlportable.train.grpo import LogprobMismatchError

    def broken(*args, **kwargs):
        raise LogprobMismatchError("the trainer's log-probs differ from the engine's on 1 of 6 tokens")

    monkeypatch.setattr(bench, "measure_ours", broken)
    monkeypatch.setattr(bench, "measure_trl", lambda config, prompts, settings, **kw: _fake_side(settings))
    config = tiny_config()
    result = bench.measure(CPU, config, tiny_weights(config), bench.Settings(**TINY), peer="trl")
    assert result["ours"] is None and result["trl"]["completion_lengths"] == [5, 5] and result["ratios"] == {}
    assert result["ours_error"].startswith("LogprobMismatchError: the trainer's log-probs differ")


def test_ratios_of_the_medians(monkeypatch):
    monkeypatch.setattr(bench, "measure_ours", lambda backend, config, weights, prompts, settings, **kw:
                        _fake_side(settings, (1.0, 2.0)))
    monkeypatch.setattr(bench, "measure_trl", lambda config, prompts, settings, **kw:
                        _fake_side(settings, (8.0, 2.0)))
    config = tiny_config()
    result = bench.measure(CPU, config, tiny_weights(config), bench.Settings(**TINY), peer="trl")
    assert result["ratios"] == {"rollout_ratio": 0.125, "train_ratio": 1.0, "total_ratio": 0.3,
                                "step_time_ratio": 0.3}


def test_cli_bench_grpo_needs_cuda():
    result = CliRunner().invoke(main, ["bench", "grpo", "--device", "cpu", "--layers", "1"])
    assert result.exit_code != 0
    assert "cuda" in result.output and clean_exit(result)


def test_cli_bench_grpo_prints_and_writes_json(tmp_path, monkeypatch):
    """The command's table and JSON on a cpu result (the command itself refuses cpu), with stand-ins
    for both sides' measurements."""
    config = tiny_config()

    def fake_run(backend, layers, steps, peer, progress=None, prompt_len=64, completion_len=256):
        assert (layers, steps, peer, prompt_len, completion_len) == (1, 2, "trl", 64, 96)
        monkeypatch.setattr(bench, "measure_ours", lambda backend, config, weights, prompts, settings, **kw:
                            _fake_side(settings, (1.0, 2.0)))
        monkeypatch.setattr(bench, "measure_trl", lambda config, prompts, settings, **kw:
                            {**_fake_side(settings, (8.0, 2.0)), "trl": {"version": "0.0"}, "torch": "t",
                             "transformers": "x"})
        return bench.measure(backend, config, tiny_weights(config), bench.Settings(**{**TINY, "steps": steps}),
                             peer, progress=progress)

    monkeypatch.setattr(bench, "run", fake_run)
    out = tmp_path / "grpo.json"
    result = CliRunner().invoke(main, ["bench", "grpo", "--device", "cpu", "--layers", "1", "--steps", "2",
                                       "--completion-len", "96", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "rlportable GRPOTrainer" in result.output and "TRL GRPOTrainer" in result.output
    assert "TRL 0.0, transformers x, torch t" in result.output
    assert "step time ratio ours/TRL 0.300" in result.output and "mismatches 0" in result.output
    payload = json.loads(out.read_text())
    assert len(payload["ours"]["steps"]) == 3 and payload["device"]["backend"] == "cpu"
    assert payload["ratios"]["step_time_ratio"] == 0.3 and "provenance" in payload
