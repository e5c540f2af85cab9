"""End-to-end conformance (conform/end_to_end.py, e2e_bisect.py, peer_hf.py) on the cpu backend: the sweep
passes bitwise, the metrics are the ones verl and slime define, an injected one-bit fault is localized to
its op and layer with a reproducer, and the HF peer prints its numbers beside ours."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from rlportable.cli import main
from rlportable.conform import CHECKS, end_to_end
from rlportable.conform.end_to_end import E2E_CHECKS, SWEEPS, logprob_metrics
from rlportable.conform.tally import Settings, check_rng
from rlportable.runtime import get_backend

CHECK = dict(E2E_CHECKS)


def run_check(name: str, quick: bool = True, repro_dir=None):
    rng = check_rng(0, name)  # as rlportable.conform.run seeds a check
    settings = Settings(repro_dir=repro_dir) if repro_dir is not None else Settings()
    return CHECK[name](get_backend("cpu"), rng, quick, settings)


@pytest.fixture
def repro_dir(tmp_path):
    return tmp_path / "repro"


def test_every_configuration_is_registered_once():
    names = [name for name, _ in CHECKS if name.startswith("e2e.")]
    assert names == [f"e2e.{sweep.name}" for sweep in SWEEPS]
    for name in names:  # `--only <name>` selects exactly that check
        assert [other for other in names if name in other] == [name]
    assert {"e2e.batch-1", "e2e.batch-7", "e2e.batch-64", "e2e.batch-256", "e2e.block-1-token",
            "e2e.cuda-graphs-off", "e2e.temperature-1.3", "e2e.tp-2"} <= set(names)


def test_metrics_are_zero_for_equal_bits_and_follow_verl_and_slime():
    engine = [np.array([-1.0, -2.0], np.float32), np.array([-0.5], np.float32)]
    zero = logprob_metrics(engine, [a.copy() for a in engine])
    assert zero["tokens"] == 3 and all(zero[k] == 0.0 for k in zero if k != "tokens")
    trainer = [np.array([-1.5, -2.0], np.float32), np.array([-0.25], np.float32)]
    m = logprob_metrics(engine, trainer)
    d = [np.array([-0.5, 0.0]), np.array([0.25])]  # trainer - engine
    flat = np.concatenate(d)
    assert m["mean_abs_dlogp"] == pytest.approx((0.25 + 0.25) / 2)  # slime: per-sample mean, then mean
    assert m["max_abs_dlogp"] == 0.5
    assert m["k3_kl"] == pytest.approx(np.mean(np.exp(flat) - flat - 1))
    assert m["log_ppl_diff"] == pytest.approx(((-1.5 - -1.75) + (-0.5 - -0.25)) / 2)
    assert m["chi2_token"] == pytest.approx(np.mean(np.exp(flat) ** 2) - 1)
    assert m["chi2_seq"] == pytest.approx(np.mean([np.exp(2 * x.sum()) for x in d]) - 1)
    inf = logprob_metrics([np.array([-np.inf], np.float32)], [np.array([-np.inf], np.float32)])
    assert inf["max_abs_dlogp"] == 0.0  # equal bits, even infinite, differ by nothing


@pytest.mark.parametrize("name", ["e2e.batch-7", "e2e.packing", "e2e.block-1-token", "e2e.prefix-sharing-on",
                                  "e2e.cuda-graphs-on", "e2e.async-scheduling-on"])
def test_engine_logprobs_equal_the_trainer_bitwise(name):
    tally = run_check(name)
    part = tally.details["models"]["tiny"]
    assert tally.mismatches == 0 and tally.compared == part["compared"] > 50
    assert part["metrics"]["max_abs_dlogp"] == 0.0 and part["metrics"]["tokens"] == part["compared"]
    assert "first_divergence" not in part
    if name == "e2e.async-scheduling-on":
        assert all(run["steps_ahead"] > 0 for run in part["runs"])


def test_packing_compares_every_completion_in_every_packing():
    part = run_check("e2e.packing").details["models"]["tiny"]
    assert part["packings"] == list(end_to_end.PACKINGS)
    assert part["compared"] == len(end_to_end.PACKINGS) * part["completion_tokens"]


def test_preemption_happens_and_position_in_batch_is_compared_engine_to_engine():
    preempted = run_check("e2e.preemption").details["models"]["tiny"]
    assert preempted["runs"][0]["preemptions"] > 0 and "note" not in preempted
    position = run_check("e2e.batch-position").details["models"]["tiny"]
    assert [run["label"] for run in position["runs"]] == ["alone", "among"]
    assert position["engine_vs_engine"]["compared"] > 2 and position["engine_vs_engine"]["mismatches"] == 0


def test_batch_256_runs_256_sequences_together():
    part = run_check("e2e.batch-256").details["models"]["tiny"]
    assert part["sequences"] == 256 and part["runs"][0]["engine"]["max_num_seqs"] == 256
    assert part["mismatches"] == 0


def test_tensor_parallel_emulated_matches_and_unsplittable_shapes_are_not_applicable():
    for name in ("e2e.tp-2", "e2e.tp-4"):
        tally = run_check(name)
        part = tally.details["models"]["tiny"]
        assert tally.compared > 100 and tally.mismatches == 0
        assert part["forward_at_tp_vs_engine"]["compared"] > 50 and part["forward_at_tp_vs_engine"]["mismatches"] == 0
    tally = run_check("e2e.tp-8")  # tiny has 4 query heads
    assert tally.compared == 0 and tally.details["models"]["tiny"]["status"] == "not applicable"
    assert "num_attention_heads=4 is not divisible by the TP size 8" in tally.details["models"]["tiny"]["reason"]


def flip_in_layer(monkeypatch, module, function: str, layer: int, layers: int, bit: int, index):
    """Flip one bit of one element of `function`'s output at its calls for `layer` (calls cycle
    through the layers, one per layer and step)."""
    original = getattr(module, function)
    calls = itertools.count()

    def faulty(*args, **kwargs):
        out = original(*args, **kwargs)
        if next(calls) % layers == layer:
            out = np.array(out)
            out.view(np.uint32)[index] ^= np.uint32(1 << bit)
        return out

    monkeypatch.setattr(module, function, faulty)


def test_an_injected_bit_flip_is_localized_to_its_op_and_layer(monkeypatch, repro_dir):
    from rlportable.ops import attention

    # the engine's paged attention only (the trainer runs attention_packed): layer 1 of the tiny model's 2
    flip_in_layer(monkeypatch, attention, "attention_paged", layer=1, layers=2, bit=22, index=(0, 0, 3))
    tally = run_check("e2e.batch-7", repro_dir=repro_dir)
    assert tally.mismatches > 0
    part = tally.details["models"]["tiny"]
    where = part["first_divergence"]
    assert (where["op"], where["layer"]) == ("attention", 1)
    assert where["element_index"] == [0, 3] and where["inputs_agree"] is True and where["reproduced"] is True
    assert int(where["engine_bits"], 16) ^ int(where["trainer_bits"], 16) == 1 << 22
    npz_path, json_path = map(Path, part["reproducer"])
    assert npz_path.parent == repro_dir and npz_path.name == "e2e.batch-7.tiny.attention.layer1.npz"
    arrays = np.load(npz_path)
    for side in ("engine", "trainer"):
        for name in ("q", "k", "v", "output"):
            assert f"{side}_{name}" in arrays
    assert np.array_equal(arrays["engine_q"].view(np.uint32), arrays["trainer_q"].view(np.uint32))
    assert not np.array_equal(arrays["engine_output"].view(np.uint32), arrays["trainer_output"].view(np.uint32))
    meta = json.loads(json_path.read_text())
    assert meta["first_divergence"]["op"] == "attention" and meta["engine"]["max_num_seqs"] == 7
    assert "--only e2e.batch-7" in meta["command"] and f"--repro-dir {repro_dir}" in meta["command"]
    assert meta["prompt_token_ids"] and meta["model"]["name"] == "tiny"


def test_a_fault_in_the_recorded_logprob_is_localized_to_the_lm_head(monkeypatch, repro_dir):
    from rlportable.contract import sampling

    flip_in_layer(monkeypatch, sampling, "sampled_logprobs", layer=0, layers=1, bit=0, index=0)
    part = run_check("e2e.temperature-1.0", repro_dir=repro_dir).details["models"]["tiny"]
    where = part["first_divergence"]
    assert (where["op"], where["layer"]) == ("lm_head_logprob", None) and where["inputs_agree"] is True
    assert part["mismatches"] > 0 and part["metrics"]["max_abs_dlogp"] > 0
    arrays = np.load(part["reproducer"][0])
    assert "weight_lm_head" in arrays and "engine_final" in arrays and "trainer_output" in arrays


def test_cli_prints_the_table_and_writes_details(tmp_path):
    out = tmp_path / "e2e.json"
    result = CliRunner().invoke(main, ["conform", "--device", "cpu", "--quick", "--only", "e2e.t",
                                       "--json", str(out), "--repro-dir", str(tmp_path / "repro")])
    assert result.exit_code == 0, result.output
    assert "end to end: engine log-probs against the trainer's forward" in result.output
    assert "not applicable" in result.output and "n/a" in result.output
    payload = json.loads(out.read_text())
    checks = {c["name"]: c for c in payload["checks"]}
    assert set(checks) == {"e2e.temperature-0.7", "e2e.temperature-1.0", "e2e.temperature-1.3", "e2e.tp-2",
                           "e2e.tp-4", "e2e.tp-8"}
    assert checks["e2e.temperature-0.7"]["details"]["models"]["tiny"]["metrics"]["k3_kl"] == 0.0
    assert not (tmp_path / "repro").exists()  # nothing failed, nothing written


def test_peer_hf_on_cpu_prints_beside_ours(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "peer.json"
    result = CliRunner().invoke(main, ["conform", "--device", "cpu", "--quick", "--only", "e2e.tp-2", "--peer",
                                       "hf", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "HF transformers" in result.output and "incremental decoding against the full forward" in result.output
    peer = json.loads(out.read_text())["peer"]
    rows = {(row["side"], row["precision"]): row for row in peer["rows"]}
    assert set(rows) == {("rlportable", "contract"), ("HF transformers", "fp32"), ("HF transformers", "bf16")}
    assert rows[("rlportable", "contract")]["mismatches"] == 0
    for row in rows.values():
        assert row["compared"] == peer["sequences"] * peer["new_tokens"]
        assert set(row["metrics"]) >= {"mean_abs_dlogp", "max_abs_dlogp", "k3_kl", "log_ppl_diff", "chi2_token"}
