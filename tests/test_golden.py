"""Golden digests (rlportable/conform/golden.py, golden_digest.py, golden_stream.py, and each family's
cases): the committed files are what --write-golden writes, a corrupted or changed digest fails with a
message naming it, one flipped output bit changes it."""

import dataclasses
import importlib
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from rlportable.cli import main
from rlportable.conform import golden, golden_digest, golden_stream
from rlportable.conform.tally import Settings
from rlportable.errors import RlpError
from rlportable.resources import resource_dir
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
COMMITTED = resource_dir("conformance") / "golden"
CHEAP_GROUPS = [g for g in golden.groups() if not any(c.expensive for c in golden.CASES if c.group == g)]


@pytest.fixture
def golden_copy(tmp_path):
    """A copy of the committed digests, for the checks to read instead of the originals."""
    folder = tmp_path / "golden"
    shutil.copytree(COMMITTED, folder)
    return folder


def _case(check_name: str) -> golden.Case:
    return next(c for c in golden.CASES if c.check_name == check_name)


def test_every_group_is_committed_and_every_case_named_once():
    names = [c.check_name for c in golden.CASES]
    assert len(names) == len(set(names))
    assert sorted(p.stem for p in COMMITTED.glob("*.json")) == sorted(golden.groups())
    # every family with kernels has golden cases: one the golden module missed would fail here, not
    # silently go unchecked (a reference_only family has no kernels to reproduce them with yet)
    from rlportable.contract.spec import kernel_families

    for family in [*kernel_families(), "tiny", "qwen3-0.6b-shape"]:
        assert family in golden.groups(), family
    assert {"golden.tiny.train.gradients", "golden.tiny.train.updated_weights", "golden.tiny.engine.generate",
            "golden.qwen3-0.6b-shape.engine.generate", "golden.norm.rmsnorm_backward",
            "golden.attention.packed_backward"} <= set(names)


def test_write_golden_reproduces_the_committed_files_byte_for_byte(tmp_path):
    # every group but the Qwen3-0.6B-shaped model's (about a minute on cpu): `rlportable conform
    # --device cpu` in .ci/run checks that one against its committed digests
    written = golden.write_golden(CPU, tmp_path, only_groups=CHEAP_GROUPS)
    assert sorted(p.name for p in written) == sorted(f"{g}.json" for g in CHEAP_GROUPS)
    for path in written:
        assert path.read_bytes() == (COMMITTED / path.name).read_bytes(), path.name


def test_committed_digests_pass_on_cpu():
    for case in golden.CASES:
        if case.group in ("norm", "tiny"):
            compared, mismatches, message = golden.verify(CPU, case)
            assert compared > 0 and mismatches == 0 and message is None, message


def test_a_corrupted_digest_fails_with_a_message_naming_it(golden_copy):
    path = golden_copy / "norm.json"
    document = json.loads(path.read_text())
    item = next(d for d in document["digests"] if d["name"] == "rmsnorm")
    item["sha256"] = ("0" if item["sha256"][0] != "0" else "1") + item["sha256"][1:]
    path.write_text(json.dumps(document))
    settings = Settings(golden_dir=golden_copy)
    tally = dict(golden.GOLDEN_CHECKS)["golden.norm.rmsnorm"](CPU, None, False, settings)
    assert tally.mismatches > 0 and tally.compared > 0
    message = tally.message
    assert "golden.norm.rmsnorm" in message and "differs" in message and "norm.json" in message
    # the other digests of the file still pass
    other = dict(golden.GOLDEN_CHECKS)["golden.norm.rmsnorm_heads"](CPU, None, False, settings)
    assert other.mismatches == 0 and other.message is None

    result = CliRunner().invoke(main, ["conform", "--device", "cpu", "--only", "golden.norm.rmsnorm",
                                       "--golden-dir", str(golden_copy)])
    assert result.exit_code == 1
    assert "golden digest golden.norm.rmsnorm differs" in result.output
    assert "golden.norm.rmsnorm_backward" in result.output  # ran, and passed
    assert "golden digest golden.norm.rmsnorm_backward" not in result.output


def test_a_changed_recipe_or_a_missing_digest_is_named(golden_copy):
    path = golden_copy / "residual.json"
    document = json.loads(path.read_text())
    document["digests"][0]["recipe"]["seed"] += 1
    document["digests"] = document["digests"][:2]  # transpose removed
    path.write_text(json.dumps(document))
    for name, words in (("golden.residual.add", "another recipe"), ("golden.residual.transpose", "has no digest")):
        compared, mismatches, message = golden.verify(CPU, _case(name), golden_copy)
        assert mismatches > 0 and name in message and words in message and "--write-golden" in message


@pytest.mark.parametrize("check_name, output, element", [
    ("golden.norm.rmsnorm", 0, 0),                  # the first element of the first output
    ("golden.attention.write_kv", 4, -1),           # int8 digits, the last element
    ("golden.tiny.engine.generate", 1, 2),          # a sampled token
    ("golden.adamw.steps", -1, 17),                 # the last output
])
def test_one_flipped_bit_changes_the_digest_and_names_the_output(check_name, output, element):
    case = _case(check_name)
    outputs = case.outputs(CPU)
    name, array = outputs[output]
    assert array.size > 0
    for bit in (0, array.dtype.itemsize * 8 - 1):
        flipped = array.copy()
        raw = flipped.reshape(-1).view(f"u{array.dtype.itemsize}")
        raw[element] ^= raw.dtype.type(1 << bit)
        changed = outputs[:output % len(outputs)] + [(name, flipped)] + outputs[output % len(outputs) + 1:]
        assert golden_digest.digest(changed) != golden_digest.digest(outputs)
        bad_case = dataclasses.replace(case, compute=lambda backend, s, r, changed=changed: changed)
        compared, mismatches, message = golden.verify(CPU, bad_case)
        assert mismatches == flipped.size and f"first differing output: {name} " in message
    assert golden.verify(CPU, case)[1:] == (0, None)


def test_digest_covers_names_shapes_and_dtypes():
    x = np.arange(6, dtype=np.float32)
    base = golden_digest.digest([("a", x)])
    assert base != golden_digest.digest([("b", x)])
    assert base != golden_digest.digest([("a", x.reshape(2, 3))])
    assert base != golden_digest.digest([("a", x.view(np.int32))])
    assert base == golden_digest.digest([("a", x.astype(">f4"))])  # byte order: always little-endian
    assert golden_digest.canonical(np.array([1, 2], np.int64), "int32").dtype == np.int32
    with pytest.raises(RlpError):
        golden_digest.canonical(np.array([2**40]), "int32")


def test_canonical_inputs_are_fixed_and_exact():
    # SplitMix64's published first outputs for seed 0
    assert [int(v) for v in golden_stream.splitmix64(0, 0, 3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                                   0x06C45D188009454F]
    stream = golden_stream.Stream(7)
    assert np.array_equal(np.concatenate([stream.u64(3), stream.u64(2)]), golden_stream.splitmix64(7, 0, 5))
    tiny = golden_stream.Stream(1).floats((64, 9), "tiny").astype(np.float64)
    assert np.array_equal(np.ldexp(tiny, 149), np.round(np.ldexp(tiny, 149)))  # multiples of 2^-149: exact
    huge = golden_stream.Stream(1).floats((64, 9), "huge")
    assert np.isfinite(huge).all() and np.abs(huge).max() > 1e37
    nonfinite = golden_stream.Stream(1).floats((6, 5), "nonfinite")
    assert (~np.isfinite(nonfinite)).sum(axis=1).tolist() == [1, 0, 1, 0, 1, 0]


def test_every_recorded_function_names_its_cases_code():
    """Each digest names the module and function that compute it (some are made by a factory there)."""
    for path in COMMITTED.glob("*.json"):
        for item in json.loads(path.read_text())["digests"]:
            module, _, name = item["function"].rpartition(".")
            case = next(c for c in golden.CASES if (c.group, c.name) == (path.stem, item["name"]))
            assert importlib.import_module(module) is not None
            assert (module, name) == (case.compute.__module__, case.compute.__name__)


def test_write_golden_refuses_any_device_but_cpu(tmp_path):
    class FakeDevice:
        name, label = "cuda", "cuda (fake)"

    with pytest.raises(RlpError, match="--device cpu"):
        golden.write_golden(FakeDevice(), tmp_path)
    assert not list(tmp_path.iterdir())


def test_quick_skips_only_the_expensive_end_to_end_digests():
    from rlportable.conform import run

    assert golden.QUICK_SKIPPED == {"golden.qwen3-0.6b-shape.model.logprobs",
                                    "golden.qwen3-0.6b-shape.engine.generate"}
    assert run(CPU, quick=True, only="golden.qwen3") == []
    assert [r.name for r in run(CPU, quick=True, only="golden.rowsum")] == ["golden.rowsum.rowsum"]


def test_recorded_outputs_are_copies_not_arrays_updated_later():
    """On cpu to_numpy returns the array itself: recording it without a copy let AdamW's later steps
    rewrite the step-1 outputs (the digest then disagreed with every device)."""
    from rlportable.conform import golden as golden_module

    case = next(c for c in golden_module.CASES if (c.group, c.name) == ("adamw", "steps"))
    outputs = dict(case.outputs(get_backend("cpu")))
    assert not np.array_equal(outputs["0.uniform.1.p0"], outputs["0.uniform.3.p0"])


@pytest.mark.parametrize("check_name", ["golden.training.sft.trajectory", "golden.training.grpo.trajectory",
                                        "golden.training.grpo_moe.trajectory"])
@pytest.mark.parametrize("tp,dp", [(1, 2), (1, 3), (2, 1), (2, 2)])
def test_training_trajectories_reproduce_at_any_layout(check_name, tp, dp):
    """The whole-run digests (weights, AdamW moments, metrics) with the model cut over tp tensor-parallel
    ranks and the optimiser sharded over dp replicas (threads): the committed single-device digest,
    to the bit, on every rank."""
    from rlportable.runtime.collectives import run_threads
    from rlportable.runtime.world import layout_groups

    case = _case(check_name)
    expected = json.loads((COMMITTED / f"{case.group}.json").read_text())
    want = next(item["sha256"] for item in expected["digests"] if item["name"] == case.name)

    def rank(world_group):
        tp_group, dp_group = layout_groups(world_group, tp)
        return case.compute(CPU, golden_stream.Stream(case.recipe["seed"]), case.recipe, dp_group, tp_group)

    for rank_outputs in run_threads(CPU, tp * dp, rank):
        assert golden_digest.digest(rank_outputs) == want
