"""Qwen3-MoE under expert parallelism (ranks emulated as threads): whole experts per rank, the router whole
on every rank, each expert row sent by all-to-all to the rank that combines its token and back; log-probs,
logits, every sparse layer's expert choices, the engine's recorded routing and every gradient bitwise EP 1's
(raw bits, no tolerance); SFT and GRPO at EP 2 saving EP 1's weights."""

from __future__ import annotations

import numpy as np
import pytest

import moe_parallel
from moe_parallel import CASES, CPU, forward, gradients, packed, raw
from test_moe_device import moe_config, scaled_weights
from rlportable.engine.sequence import SamplingParams
from rlportable.errors import InputError
from rlportable.model.expert_parallel import ExpertParallel, expert_of, is_expert
from rlportable.model.forward import Model
from rlportable.model.parallel import TensorParallel, shard_tensor
from rlportable.runtime.collectives import ThreadGroup, run_threads


@pytest.mark.parametrize("overrides", CASES)
@pytest.mark.parametrize("size", [2, 4])
def test_logprobs_logits_and_routing_at_ep_equal_ep1(size, overrides):
    moe_parallel.check_forward_is_one_devices("ep", size, overrides)


def test_each_rank_runs_only_its_experts_on_the_rows_routed_to_them(monkeypatch):
    """The layer really exchanges: a rank's expert products see only its own experts and exactly the rows
    routed to them (compared with the recorded routing), and with the all-to-all made the identity (each
    rank keeping what it would send to itself) the outputs are no longer EP 1's."""
    from rlportable.model import parallel

    config = moe_config(num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=1)
    weights = scaled_weights(config, seed=4)
    tokens, cu = packed(config.vocab_size)
    want_lp, _, (want_routing,) = forward(Model(CPU, config, weights), tokens, cu)
    seen: dict = {}
    original = parallel.expert_rows

    def recording(backend, tp_group, h, weight, groups, bits_a=parallel.gemm.DEFAULT_BITS_A):
        held = [e for e in range(weight.num_experts) if weight.gate_up[e] is not None]
        for expert, chosen in groups:
            seen.setdefault(tuple(held), []).append((expert, chosen.copy()))
        return original(backend, tp_group, h, weight, groups, bits_a)

    monkeypatch.setattr(parallel, "expert_rows", recording)
    results = run_threads(CPU, 2, lambda group: forward(Model(CPU, config, weights, ep_group=group), tokens, cu))
    assert np.array_equal(raw(results[0][0]), raw(want_lp))
    assert sorted(seen) == [tuple(range(0, 4)), tuple(range(4, 8))]  # each rank holds 4 whole experts
    k = config.num_experts_per_tok
    for held, calls in seen.items():
        for expert, chosen in calls:
            assert expert in held
            assert np.array_equal(chosen, np.flatnonzero(want_routing.reshape(-1) == expert))  # its pairs only
    assert {e for calls in seen.values() for e, _ in calls} == set(np.unique(want_routing).tolist())
    assert all(chosen.size < tokens.size * k for calls in seen.values() for _, chosen in calls)

    monkeypatch.setattr(parallel, "expert_rows", original)
    monkeypatch.setattr(ThreadGroup, "all_to_all", lambda self, array: array)  # no exchange
    broken = run_threads(CPU, 2, lambda group: forward(Model(CPU, config, weights, ep_group=group), tokens, cu))
    assert not np.array_equal(raw(broken[0][0]), raw(want_lp))


def test_what_ep_cannot_cut_is_one_line():
    config = moe_config(num_experts=6)  # 6 experts over 4 ranks
    weights = scaled_weights(config, seed=1)
    with pytest.raises(InputError, match="^expert parallelism: num_experts=6 is not divisible by the EP size 4$"):
        Model(CPU, config, weights, ep_group=ThreadGroup.create(CPU, 4)[0])
    from rlportable.model.synthetic import random_weights
    from rlportable.model.config import ModelConfig

    dense = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                   "intermediate_size": 40, "num_hidden_layers": 1, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "head_dim": 8})
    with pytest.raises(InputError, match="^expert parallelism: EP 2 needs a mixture-of-experts model; this qwen3 "
                                         "model has no experts"):
        Model(CPU, dense, random_weights(dense, 1), ep_group=ThreadGroup.create(CPU, 2)[0])


# ---- training: the sparse layers' backward over whole experts per rank
@pytest.mark.parametrize("aux_scale", [0.0, 0.25])
@pytest.mark.parametrize("overrides", CASES)
@pytest.mark.parametrize("size", [2, 4])
def test_gradients_at_ep_are_the_ep1_gradients(size, overrides, aux_scale):
    """Every rank's gradients are EP 1's on raw bits: the replicated tensors' whole (the same on every rank),
    its own experts' whole, and no other expert's; the load-balancing loss's value too."""
    config = moe_config(**overrides)
    weights = scaled_weights(config, seed=3 + size)
    tokens, cu = packed(config.vocab_size)
    want, want_aux = gradients(Model(CPU, config, weights, trainable=True), tokens, cu, aux_scale)
    assert any(np.any(g) for name, g in want.items() if is_expert(name))
    results = run_threads(CPU, size, lambda group: gradients(
        Model(CPU, config, weights, trainable=True, ep_group=group), tokens, cu, aux_scale))
    for rank, (got, aux) in enumerate(results):
        assert aux == want_aux and (aux is None) == (aux_scale == 0.0)
        mine = ExpertParallel(rank, size).experts(config.num_experts)
        assert set(got) == {n for n in want if not is_expert(n) or expert_of(n) in mine}
        for name, grad in got.items():
            assert np.array_equal(raw(grad), raw(want[name])), (rank, name)


@pytest.mark.parametrize("engine", [dict(max_num_seqs=3, block_size=4),
                                    dict(max_num_seqs=64, block_size=2, max_num_batched_tokens=5,
                                         enable_prefix_caching=True)])
def test_the_engine_at_ep2_records_ep1s_tokens_and_routing_and_the_trainers(engine):
    """The engine at EP 2: sampled tokens, log-prob bits and recorded expert choices equal EP 1's (decode
    steps of 1 to 3 tokens, fewer than the ranks' shares: some shares empty), and the trainer forward's
    recomputed choices at those rows."""
    config = moe_config(num_experts_per_tok=2, norm_topk_prob=False)
    weights = scaled_weights(config, seed=9)
    prompts = [[5, 9, 2], [7, 7, 1, 30, 4], [5, 9, 2, 11]]
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, ignore_eos=True)
    moe_parallel.check_engine_at_2_is_one_devices("ep", config, weights, prompts, params, **engine)


@pytest.mark.parametrize("aux_scale", [0.0, 0.25])
def test_tp2_by_ep2_forward_and_gradients_are_one_devices(aux_scale):
    """EP composed with TP (runtime/world.py model_groups: 4 ranks, TP 2 inside EP 2): each rank holds half
    the experts, each of those cut over its TP pair; log-probs and routing EP 1's, every gradient the rank's
    TP slice of EP 1's for its experts and the replicated tensors."""
    from rlportable.runtime.world import model_groups

    config = moe_config(num_key_value_heads=2)
    weights = scaled_weights(config, seed=12)
    tokens, cu = packed(config.vocab_size)
    want_lp, _, want_routing = forward(Model(CPU, config, weights), tokens, cu)
    want, want_aux = gradients(Model(CPU, config, weights, trainable=True), tokens, cu, aux_scale)

    def work(world):
        tp_group, ep_group, dp_group = model_groups(world, 2, 2)
        assert dp_group.size == 1
        lp = forward(Model(CPU, config, weights, tp_group=tp_group, ep_group=ep_group), tokens, cu)
        model = Model(CPU, config, weights, trainable=True, tp_group=tp_group, ep_group=ep_group)
        return tp_group.rank, ep_group.rank, lp, gradients(model, tokens, cu, aux_scale)

    for tp_rank, ep_rank, (lp, _, routing), (got, aux) in run_threads(CPU, 4, work):
        assert np.array_equal(raw(lp), raw(want_lp)) and aux == want_aux
        assert all(np.array_equal(g, w) for g, w in zip(routing, want_routing))
        mine = ExpertParallel(ep_rank, 2).experts(config.num_experts)
        assert set(got) == {n for n in want if not is_expert(n) or expert_of(n) in mine}
        for name, grad in got.items():
            whole = shard_tensor(config, TensorParallel(tp_rank, 2), name, want[name])
            assert np.array_equal(raw(grad), raw(whole)), (tp_rank, ep_rank, name)


@pytest.fixture(scope="module", params=["plain", "aux"])
def hf_folder(tmp_path_factory, request):
    return moe_parallel.hf_folder(tmp_path_factory, request, "tiny-moe-ep")


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_training_at_ep2_saves_ep1s_weights_on_raw_bits(tmp_path, hf_folder, kind):
    """Two SFT or GRPO steps at EP 2 (threads): the same losses, grad norms (and load-balancing losses) as
    EP 1, 0 log-prob and 0 routing mismatches, and every saved weight (every expert gathered to rank 0) EP
    1's bits; the routers and the experts of both ranks moved."""
    (want, got), (single, sharded), config, moved = moe_parallel.check_training_at_2_is_one_devices(
        "ep", kind, tmp_path, hf_folder)
    assert all(g.get("grad_norm") == w.get("grad_norm") for w, g in zip(want, got))
    assert list(single) == list(sharded)
    for rank in range(2):  # each rank's experts trained
        mine = ExpertParallel(rank, 2).experts(config.num_experts)
        assert any(is_expert(n) and expert_of(n) in mine and "down_proj" in n for n in moved)


def test_runs_interrupted_at_ep2_or_ep1_resume_at_the_other_bitwise(tmp_path, hf_folder):
    """Two SFT steps, stopped after the first and resumed at another layout (EP 2 -> 2, 2 -> 1, 1 -> 2, TP 2 x
    EP 2 -> TP 2 and -> EP 2): the optimiser state of a checkpoint written at EP 2 is read from each expert's
    rank's files, and every run ends with the unbroken one-device run's weights, bit for bit."""
    import shutil

    from test_moe_train import _options, _weights
    from rlportable.runtime.world import model_groups
    from rlportable.train import prepare
    from rlportable.train.sft import SFTConfig

    folder, _ = hf_folder
    config = SFTConfig(steps=2, batch_size=4, learning_rate=3e-3, seed=1)

    def sft(name, layout, resume=False):
        tp, ep = layout

        def rank(world):
            tp_group, ep_group, dp_group = model_groups(world, tp, ep)
            return prepare.run_sft(CPU, _options(tmp_path, folder, name, resume), config, lambda r: None, dp_group,
                                   tp_group, ep_group)
        return run_threads(CPU, tp * ep, rank)

    sft("unbroken", (1, 1))
    want = _weights(tmp_path / "unbroken")
    # (TP, EP): the same TP reads each rank's own shard files, another TP whole tensors
    for first, then in (((1, 2), (1, 2)), ((1, 2), (1, 1)), ((1, 1), (1, 2)), ((2, 2), (2, 1)), ((2, 2), (1, 2))):
        name = f"{first}-then-{then}"
        sft(name, first)
        shutil.rmtree(tmp_path / name / "step-000002")
        (tmp_path / name / "latest").write_text("step-000001\n")  # as if stopped after step 1
        sft(name, then, resume=True)
        got = _weights(tmp_path / name)
        assert list(got) == list(want) and all(np.array_equal(got[n], want[n]) for n in want), name


def test_ep2_on_hip_cpu_is_the_cpu_ep1_bits():
    """The HIP sources (HIP-CPU) at EP 2: log-probs, routing and every gradient the cpu reference's at EP 1
    on raw bits (the device path: row gathers, moe_combine and its backward kernels on each rank's share)."""
    from conftest import hip_cpu_backend

    device = hip_cpu_backend()
    config = moe_config(num_experts_per_tok=2, norm_topk_prob=True)
    weights = scaled_weights(config, seed=21)
    tokens, cu = packed(config.vocab_size)
    want_lp, _, want_routing = forward(Model(CPU, config, weights), tokens, cu)
    want, _ = gradients(Model(CPU, config, weights, trainable=True), tokens, cu, 0.25)

    def work(group):
        return (forward(Model(device, config, weights, ep_group=group), tokens, cu),
                gradients(Model(device, config, weights, trainable=True, ep_group=group), tokens, cu, 0.25)[0])

    for (lp, _, routing), got in run_threads(device, 2, work):
        assert np.array_equal(raw(lp), raw(want_lp))
        assert all(np.array_equal(g, w) for g, w in zip(routing, want_routing))
        for name, grad in got.items():
            assert np.array_equal(raw(grad), raw(want[name])), name


def test_the_cli_runs_ep2_and_says_what_it_cannot_cut(tmp_path, hf_folder):
    """`--ep 2` (threads on cpu): generate prints EP 1's completions, grpo logs EP 1's step with 0 log-prob
    and 0 routing mismatches and sft saves EP 1's weights; --ep 3 over 8 experts, --ep 2 on a dense model and
    --ep 0 are one line each."""
    import json

    from click.testing import CliRunner

    from conftest import clean_exit
    from test_moe_train import _weights
    from rlportable.cli import main

    folder, _ = hf_folder
    runner = CliRunner()
    generate = ["generate", "--model", str(folder), "--device", "cpu", "-n", "2", "--max-tokens", "4", "--json",
                "--prompt", "hello there"]
    one, two = (runner.invoke(main, generate + flags) for flags in ([], ["--ep", "2"]))
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert json.loads(one.stdout)["results"] == json.loads(two.stdout)["results"]
    grpo = ["grpo", "--model", str(folder), "--device", "cpu", "--steps", "1", "--prompts-per-step", "2", "-G", "2",
            "--max-completion-length", "3"]
    for name, flags in (("ep1", []), ("ep2", ["--ep", "2"])):
        result = runner.invoke(main, grpo + flags + ["--out", str(tmp_path / name),
                                                     "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        assert result.exit_code == 0, result.output
    logged, sharded = (json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[-1]) for name in ("ep1", "ep2"))
    assert sharded["routing_mismatches"] == sharded["logp_mismatches"] == 0 and sharded["routing_compared"] > 0
    assert sharded["loss"] == logged["loss"] and sharded["grad_norm"] == logged["grad_norm"]
    sft = ["sft", "--model", str(folder), "--device", "cpu", "--steps", "1", "--batch-size", "2"]
    for name, flags in (("sft1", []), ("sft2", ["--ep", "2"])):
        assert runner.invoke(main, sft + flags + ["--out", str(tmp_path / name)]).exit_code == 0
    single, sharded_weights = _weights(tmp_path / "sft1"), _weights(tmp_path / "sft2")
    assert single.keys() == sharded_weights.keys()
    assert all(np.array_equal(sharded_weights[n], single[n]) for n in single)

    bad = runner.invoke(main, sft + ["--ep", "3"])
    assert bad.exit_code != 0 and clean_exit(bad)
    assert "error: expert parallelism: num_experts=8 is not divisible by the EP size 3\n" in bad.output
    dense = runner.invoke(main, ["generate", "--model", "tiny", "--device", "cpu", "--max-tokens", "2", "--ep", "2",
                                 "--prompt", "hi"])
    assert dense.exit_code != 0 and clean_exit(dense)
    assert "error: expert parallelism: EP 2 needs a mixture-of-experts model" in dense.output
    zero = runner.invoke(main, sft + ["--ep", "0"])
    assert zero.exit_code == 2 and "--ep" in zero.output


def test_sft_at_ep2_by_dp2_saves_one_devices_weights(tmp_path, hf_folder):
    """EP composed with data parallelism (model_groups: 4 ranks, DP 2 replicas of an EP 2 model): the
    replicas exchange their own experts' gradients (the same names within a data-parallel group), and the
    saved weights are EP 1 x DP 1's bits."""
    from test_moe_train import _options, _weights
    from rlportable.runtime.world import model_groups
    from rlportable.train import prepare
    from rlportable.train.sft import SFTConfig

    folder, _ = hf_folder
    config = SFTConfig(steps=2, batch_size=4, learning_rate=3e-3, seed=1, micro_batch_tokens=24)

    def rank(world):
        tp_group, ep_group, dp_group = model_groups(world, 1, 2)
        assert (tp_group.size, ep_group.size, dp_group.size) == (1, 2, 2)
        return prepare.run_sft(CPU, _options(tmp_path, folder, "ep2dp2"), config, lambda r: None, dp_group,
                               tp_group, ep_group)

    want = prepare.run_sft(CPU, _options(tmp_path, folder, "one"), config, lambda r: None)
    got = run_threads(CPU, 4, rank)[0]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    single, sharded = _weights(tmp_path / "one"), _weights(tmp_path / "ep2dp2")
    assert list(single) == list(sharded) and all(np.array_equal(sharded[n], single[n]) for n in single)


def test_model_groups_place_tp_inside_ep_inside_dp():
    """8 ranks at TP 2 x EP 2 (x DP 2): consecutive ranks share a TP group, two TP groups make a model
    replica, whose ranks with the same TP rank form an EP group; DP joins the same place of both replicas.
    A world the model does not divide is one line."""
    from rlportable.runtime.world import model_groups

    def work(world):
        tp_group, ep_group, dp_group = model_groups(world, 2, 2)
        return [sorted(g.all_gather_object(world.rank)) for g in (tp_group, ep_group, dp_group)]

    for rank, (tp, ep, dp) in enumerate(run_threads(CPU, 8, work)):
        assert tp == [rank - rank % 2, rank - rank % 2 + 1]
        replica = rank - rank % 4
        assert ep == [replica + rank % 2, replica + rank % 2 + 2]
        assert dp == [rank % 4, rank % 4 + 4]
    with pytest.raises(InputError, match="^--tp 2 x --ep 2 must divide the 6 ranks$"):
        run_threads(CPU, 6, lambda world: model_groups(world, 2, 2))


def test_gradients_with_fewer_tokens_than_ranks():
    """3 tokens at EP 4: shares of one token, the last rank's empty (it still takes part in every exchange),
    experts without a token on some ranks; every gradient EP 1's."""
    config = moe_config(num_experts_per_tok=2, norm_topk_prob=True)
    weights = scaled_weights(config, seed=8)
    tokens, cu = packed(config.vocab_size, lengths=(3,))
    want, _ = gradients(Model(CPU, config, weights, trainable=True), tokens, cu, 0.0)
    results = run_threads(CPU, 4, lambda group: gradients(
        Model(CPU, config, weights, trainable=True, ep_group=group), tokens, cu, 0.0))
    for rank, (got, _) in enumerate(results):
        for name, grad in got.items():
            assert np.array_equal(raw(grad), raw(want[name])), (rank, name)
