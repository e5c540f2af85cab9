"""SFT and GRPO runs on the cpu backend: mismatch 0 every step, learning, atomic resume bitwise."""

import json
import os

import numpy as np
import pytest

from rlportable.errors import InputError
from rlportable.runtime import get_backend
from rlportable.train import checkpoint, prepare
from rlportable.train.grpo import GRPOConfig, LogprobMismatchError
from rlportable.train.sft import SFTConfig

CPU = get_backend("cpu")
TASK = "arithmetic:digits=1,ops=+"


def _options(tmp_path, name="run", resume=False, **kw):
    return prepare.RunOptions(model=kw.get("model", "tiny"), out=str(tmp_path / name), resume=resume, save_every=1,
                             log_jsonl=str(tmp_path / f"{name}.jsonl"), plot=kw.get("plot"), task=TASK, data=None)


def _grpo_config(**kw):
    base = dict(steps=3, prompts_per_step=3, num_generations=4, max_completion_length=4, learning_rate=3e-3,
                seed=5)
    base.update(kw)
    return GRPOConfig(**base)


def _final_weights(folder) -> dict:
    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(folder))
    return {k: v.view(np.uint32) for k, v in ckpt.weights.named_tensors(ckpt.config).items()}


def test_grpo_logs_zero_mismatch_and_ratio_one_every_step(tmp_path):
    config = _grpo_config(beta=0.04, num_iterations=2, mini_batches=2, loss_type="grpo")
    records = prepare.run_grpo(CPU, _options(tmp_path), config, [], lambda r: None)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["logp_mismatches"] == 0 and r["max_abs_dlogp"] == 0.0
        assert r["logp_compared"] == round(r["completion_length"] * 12) > 0  # every completion token
        assert r["ratio_min"] == 1.0 and r["ratio_max"] == 1.0
    logged = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]


def test_grpo_schedule_spans_every_optimizer_step(tmp_path):
    """Each GRPO step takes num_iterations x mini_batches optimizer steps; the learning-rate schedule
    spans all of them (as TRL's max_steps), so it reaches its end at the last step, not before."""
    config = _grpo_config(steps=2, num_iterations=2, mini_batches=2, warmup_steps=0)
    records = prepare.run_grpo(CPU, _options(tmp_path), config, [], lambda r: None)
    schedule = config.schedule(2 * 2 * 2)
    assert [r["lr"] for r in records] == [schedule.lr(4), schedule.lr(8)]
    assert records[0]["lr"] > 0.0


def test_grpo_resume_after_a_crash_continues_bitwise(tmp_path):
    config = _grpo_config()
    prepare.run_grpo(CPU, _options(tmp_path, "straight"), config, [], lambda r: None)

    def crash_after_two(record):
        if record["step"] == 2:
            raise KeyboardInterrupt  # before step 2's checkpoint is written

    with pytest.raises(KeyboardInterrupt):
        prepare.run_grpo(CPU, _options(tmp_path, "crashed"), config, [], crash_after_two)
    # the crash hit before step 2's checkpoint: the latest is step 1, and resume redoes step 2
    assert checkpoint.list_checkpoints(tmp_path / "crashed") == [1]
    records = prepare.run_grpo(CPU, _options(tmp_path, "crashed", resume=True), config, [], lambda r: None)
    assert [r["step"] for r in records] == [1, 2, 3]
    straight, resumed = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "crashed")
    for name in straight:
        assert np.array_equal(straight[name], resumed[name]), name
    with pytest.raises(InputError, match="different settings"):
        prepare.run_grpo(CPU, _options(tmp_path, "crashed", resume=True), _grpo_config(learning_rate=1e-3), [],
                        lambda r: None)
    # another --steps changes the schedule of every step: refused, naming both values and the way on
    with pytest.raises(InputError, match=r"--steps 5, but the run was started with --steps 3.*--model"):
        prepare.run_grpo(CPU, _options(tmp_path, "crashed", resume=True), _grpo_config(steps=5), [],
                        lambda r: None)


def test_a_broken_rollout_logprob_stops_the_run(tmp_path, monkeypatch):
    from rlportable.train import grpo

    original = grpo.GRPOTrainer._rollout

    def perturbed(self, records, step):
        samples, texts = original(self, records, step)
        samples[0].logp = samples[0].logp.copy()
        samples[0].logp[0] = np.nextafter(samples[0].logp[0], np.float32(0))  # one ulp
        return samples, texts

    monkeypatch.setattr(grpo.GRPOTrainer, "_rollout", perturbed)
    with pytest.raises(LogprobMismatchError, match="1 of"):
        prepare.run_grpo(CPU, _options(tmp_path), _grpo_config(steps=1), [], lambda r: None)


def test_sft_learns_and_its_checkpoint_loads_as_a_model(tmp_path):
    from rlportable.model.load import load_model

    config = SFTConfig(steps=8, batch_size=16, learning_rate=3e-3)
    plot = tmp_path / "loss.png"
    records = prepare.run_sft(CPU, _options(tmp_path, "sft", plot=str(plot)), config, lambda r: None)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] * 0.8, losses
    model_config, weights, _ = load_model(checkpoint.latest_checkpoint(tmp_path / "sft"))
    assert model_config.vocab_size == weights.embed.shape[0]


@pytest.mark.parametrize("replicas", [2, 3])
def test_data_parallel_grpo_is_bitwise_the_single_device_run(tmp_path, replicas):
    """Replicas as threads (the same code as NCCL ranks): rollout dealt out by request, micro-batches
    round-robin, gradients added in micro-batch order: the same metrics and final weights bits."""
    from rlportable.runtime.collectives import run_threads

    # small micro-batches, two mini-batches, two passes, a KL term: every path of the loop, uneven rounds
    config = _grpo_config(steps=2, micro_batch_tokens=12, mini_batches=2, num_iterations=2, beta=0.04)
    single = prepare.run_grpo(CPU, _options(tmp_path, "single", model="tiny-sft"), config, [], lambda r: None)
    assert any(r["reward_std"] > 0 for r in single)  # non-zero advantages: the gradients are not all zero
    replicated = run_threads(CPU, replicas, lambda dp_group: prepare.run_grpo(
        CPU, _options(tmp_path, "replicated", model="tiny-sft"), config, [], lambda r: None, dp_group))
    timing = ("rollout_s", "train_s", "step_s", "rollout_tokens_per_s", "tokens_per_s")
    for records in replicated:
        for a, b in zip(records, single):
            assert {k: v for k, v in a.items() if k not in timing and not k.startswith("time/")} == \
                {k: v for k, v in b.items() if k not in timing and not k.startswith("time/")}
    straight, parallel = _final_weights(tmp_path / "single"), _final_weights(tmp_path / "replicated")
    for name in straight:
        assert np.array_equal(straight[name], parallel[name]), name


def test_data_parallel_sft_is_bitwise_the_single_device_run(tmp_path):
    from rlportable.runtime.collectives import run_threads

    config = SFTConfig(steps=2, batch_size=8, learning_rate=3e-3, micro_batch_tokens=20, seed=2)
    single = prepare.run_sft(CPU, _options(tmp_path, "single"), config, lambda r: None)
    replicated = run_threads(CPU, 2, lambda dp_group: prepare.run_sft(CPU, _options(tmp_path, "replicated"), config,
                                                                     lambda r: None, dp_group))
    for records in replicated:
        assert [r["loss"] for r in records] == [r["loss"] for r in single]
        assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in single]
    straight, parallel = _final_weights(tmp_path / "single"), _final_weights(tmp_path / "replicated")
    for name in straight:
        assert np.array_equal(straight[name], parallel[name]), name


def test_sharded_optimiser_holds_one_piece_per_rank():
    """ZeRO stages 1-2: each rank's moments and gradient cover its piece of every tensor, and the
    pieces of all ranks tile each flattened tensor exactly once."""
    from rlportable.model.forward import Model
    from rlportable.model.load import load_model
    from rlportable.runtime.collectives import run_threads
    from rlportable.train.optimizer import Optimizer, Schedule, shard_range

    config, weights, _ = load_model("tiny")
    hyper = SFTConfig().hyper()
    pieces = run_threads(CPU, 3, lambda dp_group: Optimizer(Model(CPU, config, weights, trainable=True), hyper,
                                                            Schedule(), dp_group))
    for name, size in pieces[0].sizes.items():
        assert [opt.ranges[name] for opt in pieces] == [shard_range(size, 3, r) for r in range(3)]
        assert sum(opt.m[name].size for opt in pieces) == size
        assert max(opt.m[name].size for opt in pieces) == -(-size // 3)
    assert shard_range(2, 3, 2) == (2, 2)  # more ranks than elements: an empty piece
    with pytest.raises(InputError, match="Replicas.train_rounds"):  # adding only its own pieces would be wrong
        pieces[0].accumulate_named({})


def test_sharded_checkpoint_resumes_bitwise_at_another_replica_count(tmp_path):
    """A run checkpointed by 3 sharded replicas (one optimiser file each) resumes at 2 and at 1
    replicas, and each ends with the bits of an unbroken single-device run: weights, moments, metrics."""
    from rlportable.runtime.collectives import run_threads

    config = SFTConfig(steps=3, batch_size=8, learning_rate=3e-3, micro_batch_tokens=20, seed=2)
    single = prepare.run_sft(CPU, _options(tmp_path, "single"), config, lambda r: None)

    def stop_after_two(record):
        if record["step"] == 2:
            raise KeyboardInterrupt  # before step 2's checkpoint: the latest is step 1's, in 3 shards

    for replicas in (2, 1):
        name = f"from3to{replicas}"
        with pytest.raises(KeyboardInterrupt):
            run_threads(CPU, 3, lambda dp_group: prepare.run_sft(CPU, _options(tmp_path, name), config,
                                                                lambda r: None if dp_group.rank else stop_after_two(r),
                                                                dp_group))
        step1 = checkpoint.latest_checkpoint(tmp_path / name)
        assert step1.endswith("step-000001")
        assert sorted(f for f in os.listdir(step1) if f.startswith("optimizer")) == [
            f"optimizer-0000{r}-of-00003.safetensors" for r in range(3)]
        resumed = run_threads(CPU, replicas, lambda dp_group: prepare.run_sft(
            CPU, _options(tmp_path, name, resume=True), config, lambda r: None, dp_group))[0]
        assert [r["loss"] for r in resumed] == [r["loss"] for r in single]  # the log holds steps 1-2 too
        assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in single]
        straight, parted = _final_weights(tmp_path / "single"), _final_weights(tmp_path / name)
        for key in straight:
            assert np.array_equal(straight[key], parted[key]), key
        a = checkpoint.load_checkpoint(tmp_path / "single").optimizer_state
        b = checkpoint.load_checkpoint(tmp_path / name).optimizer_state
        for key in a.keys():
            assert np.array_equal(a[key].reshape(-1).view(np.uint32), b[key].reshape(-1).view(np.uint32)), key


def _layout_run(kind, tmp_path, name, config, tp, dp, resume=False, on_step=None, **options):
    from rlportable.runtime.collectives import run_threads
    from rlportable.runtime.world import layout_groups

    run = prepare.run_sft if kind == "sft" else prepare.run_grpo

    def rank(world):
        tensor, data = layout_groups(world, tp)
        hook = on_step if (on_step and world.rank == 0) else (lambda r: None)
        args = (CPU, _options(tmp_path, name, resume=resume, **options), config)
        return run(*args, hook, data, tensor) if kind == "sft" else run(*args, [], hook, data, tensor)

    return run_threads(CPU, tp * dp, rank)[0]


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_tensor_and_data_parallel_runs_resume_across_layouts_bitwise(tmp_path, kind):
    """A run at TP 2 x DP 2 (threads) has the single-device metrics; interrupted after step 1 at one
    layout, it resumes at another (TP 2 -> TP 1 x DP 2, TP 1 x DP 2 -> TP 2, TP 2 -> TP 2 x DP 2) and
    ends with the single-device weights and moments, bitwise."""
    if kind == "sft":
        config = SFTConfig(steps=3, batch_size=8, learning_rate=3e-3, micro_batch_tokens=20, seed=2)
        single = prepare.run_sft(CPU, _options(tmp_path, "single"), config, lambda r: None)
        extra = {}
    else:
        config = _grpo_config(steps=3, micro_batch_tokens=12, mini_batches=2, beta=0.04)
        single = prepare.run_grpo(CPU, _options(tmp_path, "single", model="tiny-sft"), config, [], lambda r: None)
        extra = {"model": "tiny-sft"}
    timing = ("rollout_s", "train_s", "step_s", "rollout_tokens_per_s", "tokens_per_s")

    def same_metrics(records):
        clean = [{k: v for k, v in r.items() if k not in timing and not k.startswith("time/")} for r in records]
        want = [{k: v for k, v in r.items() if k not in timing and not k.startswith("time/")} for r in single]
        assert clean == want

    same_metrics(_layout_run(kind, tmp_path, "tp2dp2", config, 2, 2, **extra))

    def stop_after_one(record):
        if record["step"] == 2:
            raise KeyboardInterrupt  # before step 2's checkpoint: the latest is step 1's

    for name, first, then in (("tp2_to_dp2", (2, 1), (1, 2)), ("dp2_to_tp2", (1, 2), (2, 1)),
                              ("tp2_to_tp2dp2", (2, 1), (2, 2))):  # the last reads only its own shard's files
        with pytest.raises(KeyboardInterrupt):
            _layout_run(kind, tmp_path, name, config, *first, on_step=stop_after_one, **extra)
        step1 = checkpoint.latest_checkpoint(tmp_path / name)
        assert step1.endswith("step-000001")
        tp, dp = first  # every rank wrote its optimiser shard
        assert sorted(f for f in os.listdir(step1) if f.startswith("optimizer")) == sorted(
            checkpoint.optimizer_files(dp, tp))
        same_metrics(_layout_run(kind, tmp_path, name, config, *then, resume=True, **extra))
    for name in ("tp2dp2", "tp2_to_dp2", "dp2_to_tp2", "tp2_to_tp2dp2"):
        straight, parted = _final_weights(tmp_path / "single"), _final_weights(tmp_path / name)
        for key in straight:
            assert np.array_equal(straight[key], parted[key]), (name, key)
        a = checkpoint.load_checkpoint(tmp_path / "single").optimizer_state
        b = checkpoint.load_checkpoint(tmp_path / name).optimizer_state
        for key in a.keys():
            assert np.array_equal(a[key].reshape(-1).view(np.uint32), b[key].reshape(-1).view(np.uint32)), key


@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2), (2, 2), (4, 2), (8, 1)])
def test_training_steps_are_bitwise_alike_at_every_layout(tp, dp):
    """Three AdamW steps of a Qwen3-shaped model (16 query heads, 8 KV heads) on the same micro-batches
    at TP x DP ranks (threads): the whole weights equal one device's on every rank."""
    import dataclasses

    from rlportable.bench.memory import train_random_tokens
    from rlportable.model.synthetic import qwen3_06b_config, random_weights
    from rlportable.runtime.collectives import run_threads
    from rlportable.runtime.world import layout_groups

    config = dataclasses.replace(qwen3_06b_config(2), vocab_size=1024, hidden_size=128, intermediate_size=256,
                                 head_dim=16, tie_word_embeddings=False)
    weights = random_weights(config, seed=4)
    single = train_random_tokens(CPU, config, weights, 24, 4, None)
    digests = run_threads(CPU, tp * dp, lambda world: train_random_tokens(CPU, config, weights, 24, 4,
                                                                          *reversed(layout_groups(world, tp))))
    assert digests == [single] * (tp * dp)


def test_cli_grpo_with_dp_on_cpu_prints_the_same_last_step(tmp_path):
    from click.testing import CliRunner

    from rlportable.cli import main

    args = ["grpo", "--device", "cpu", "--steps", "1", "--prompts-per-step", "2", "-G", "2",
            "--max-completion-length", "3"]
    one = CliRunner().invoke(main, args)
    assert one.exit_code == 0, one.output
    last = [line for line in one.output.splitlines() if line.startswith("step 1")][-1]
    assert "logp_mismatches 0" in last
    for layout in (["--dp", "2"], ["--tp", "2", "--dp", "2", "--emulate"]):
        other = CliRunner().invoke(main, args + layout)
        assert other.exit_code == 0, other.output
        assert last.split("| rollout")[0] == [line for line in other.output.splitlines()
                                              if line.startswith("step 1")][-1].split("| rollout")[0]
    bad = CliRunner().invoke(main, args + ["--tp", "4"])  # the tiny model's 2 KV heads
    assert bad.exit_code != 0 and "training needs num_key_value_heads (2) divisible by the TP size (4)" in bad.output


def test_mask_truncated_completions_takes_cut_completions_out_of_the_loss(tmp_path):
    """With one token allowed every completion of tiny-sft is cut (its answers need a digit and the
    end-of-sequence token), so under mask_truncated_completions nothing trains: loss 0, weights unchanged."""
    config = _grpo_config(steps=1, max_completion_length=1, mask_truncated_completions=True)
    options = _options(tmp_path, model="tiny-sft")
    records = prepare.run_grpo(CPU, options, config, [], lambda r: None)
    assert records[0]["loss"] == 0.0 and records[0]["grad_norm"] == 0.0
    unmasked = prepare.run_grpo(CPU, _options(tmp_path, "plain", model="tiny-sft"),
                               _grpo_config(steps=1, max_completion_length=1), [], lambda r: None)
    assert unmasked[0]["grad_norm"] > 0.0


def test_gspo_trains_with_the_sequence_level_ratio(tmp_path):
    """importance_sampling_level="sequence" (GSPO): 0 log-prob mismatches, and another run than the
    token-level one once the weights move (a reward with spread inside every group)."""
    (tmp_path / "reward.py").write_text("def varied(completion_ids, **columns):\n"
                                        "    return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]\n")
    rewards = [(f"{tmp_path / 'reward.py'}:varied", 1.0)]
    config = _grpo_config(steps=3, importance_sampling_level="sequence", num_iterations=2)
    records = prepare.run_grpo(CPU, _options(tmp_path, "gspo"), config, rewards, lambda r: None)
    assert all(r["logp_mismatches"] == 0 for r in records) and records[0]["grad_norm"] > 0.0
    prepare.run_grpo(CPU, _options(tmp_path, "grpo"), _grpo_config(steps=3, num_iterations=2), rewards, lambda r: None)
    gspo, grpo = _final_weights(tmp_path / "gspo"), _final_weights(tmp_path / "grpo")
    assert any(not np.array_equal(gspo[name], grpo[name]) for name in gspo)
    with pytest.raises(InputError, match="importance_sampling_level"):
        _grpo_config(importance_sampling_level="sample")
