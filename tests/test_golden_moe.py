"""The whole-run golden digest of GRPO on the built-in Qwen3-MoE (golden.training.grpo_moe.trajectory): it is
registered and committed, `conform --quick` keeps and passes it, its run is a real check (rewards with
spread, routing compared on every completion token, router and experts trained), and a changed trajectory
changes the digest; expert-parallel layouts reproduce it (tests/test_golden.py: TP x DP layouts); .ci/run's
`conform --device hip-cpu --quick` reproduces it with the HIP sources."""

import json

import numpy as np
import pytest

from rlportable.conform import golden, run
from rlportable.model import tiny
from rlportable.resources import resource_dir
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
CHECK = "golden.training.grpo_moe.trajectory"


def _case() -> golden.Case:
    return next(c for c in golden.CASES if c.check_name == CHECK)


@pytest.fixture(scope="module")
def outputs() -> dict:
    return dict(_case().outputs(CPU))


def test_the_case_is_registered_committed_and_kept_by_quick():
    case = _case()
    assert case.group == "training" and case.recipe["model"] == "tiny-moe"
    assert CHECK not in golden.QUICK_SKIPPED
    committed = json.loads((resource_dir("conformance") / "golden" / "training.json").read_text())
    entry = next(item for item in committed["digests"] if item["name"] == case.name)
    assert entry["recipe"] == case.recipe
    names = [line.split(" ")[0] for line in entry["outputs"]]
    for step in (1, 2):
        assert {f"step{step}.routing_mismatches", f"step{step}.routing_compared"} <= set(names)
    for kind in ("weights", "optimizer.m", "optimizer.v"):  # the router and every expert, and both moments
        assert f"{kind}.model.layers.1.mlp.gate.weight" in names
        assert all(f"{kind}.model.layers.1.mlp.experts.{e}.down_proj.weight" in names
                   for e in range(tiny.TINY_MOE_EXPERTS))


def test_quick_conform_runs_it_and_it_passes():
    (result,) = run(CPU, quick=True, only=CHECK)
    assert result.name == CHECK and result.compared > 600_000 and result.mismatches == 0, result.message


def test_the_run_is_a_real_check(outputs):
    """All-zero rewards would train nothing; the digest must cover routing that was compared, and a router
    and experts that moved."""
    for step in (1, 2):
        assert outputs[f"step{step}.reward_std"][0] > 0
        assert outputs[f"step{step}.routing_compared"][0] == outputs[f"step{step}.logp_compared"][0] > 0
        assert outputs[f"step{step}.routing_mismatches"][0] == outputs[f"step{step}.logp_mismatches"][0] == 0
        assert outputs[f"step{step}.lr"][0] > 0  # every update applies (min_lr)
    assert outputs["step1.ratio_min"][0] < 1 < outputs["step1.ratio_max"][0]  # the second mini-batch
    config, weights, _ = tiny.tiny_moe_model()
    start = weights.named_tensors(config)
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight"):
        assert not np.array_equal(outputs[f"weights.{name}"], start[name].view(np.uint32))


@pytest.mark.parametrize("bit, first", [(0, "weights.model.layers.1.mlp.gate.weight"), (22, "step1.loss")])
def test_a_changed_router_bit_fails_the_digest(monkeypatch, bit, first):
    """One router weight's bit flipped: its lowest bit is below the weights' 15-bit encoding, so only the
    trained router differs; a high bit changes the routing and the whole run from the first step's loss."""
    built = tiny.upcycled_weights

    def flipped(*args, **kwargs):
        weights = built(*args, **kwargs)
        weights.layers[1].router.view(np.uint32)[2, 5] ^= np.uint32(1 << bit)
        return weights

    monkeypatch.setattr(tiny, "upcycled_weights", flipped)
    compared, mismatches, message = golden.verify(CPU, _case())
    assert mismatches > 0 and CHECK in message and f"first differing output: {first} " in message


@pytest.mark.parametrize("tp, ep, dp", [(1, 4, 1), (2, 2, 1), (1, 2, 2)])
def test_the_trajectory_reproduces_under_expert_parallelism(tp, ep, dp):
    """The digest with the experts over ep ranks (one expert each at EP 4), inside TP, beside DP (threads):
    every rank's gathered weights and moments give the committed single-device digest."""
    from rlportable.conform import golden_digest, golden_stream
    from rlportable.runtime.collectives import run_threads
    from rlportable.runtime.world import model_groups

    case = _case()
    committed = json.loads((resource_dir("conformance") / "golden" / "training.json").read_text())
    want = next(item["sha256"] for item in committed["digests"] if item["name"] == case.name)

    def rank(world):
        tp_group, ep_group, dp_group = model_groups(world, tp, ep)
        return case.compute(CPU, golden_stream.Stream(case.recipe["seed"]), case.recipe, dp_group, tp_group,
                            ep_group)

    ranks = tp * ep * dp
    assert [golden_digest.digest(outputs) for outputs in run_threads(CPU, ranks, rank)] == [want] * ranks
