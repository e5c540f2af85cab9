import json

from click.testing import CliRunner

from rlportable.cli import main
from rlportable.runtime import probe


def test_conform_cpu_quick_passes_and_writes_json(tmp_path):
    out = tmp_path / "conform.json"
    result = CliRunner().invoke(main, ["conform", "--device", "cpu", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert set(payload) == {"device", "backend", "checks", "compared", "mismatches", "passed"}
    assert payload["passed"] and payload["mismatches"] == 0 and payload["compared"] > 1_000_000
    assert {c["name"] for c in payload["checks"]} >= {"gemm", "rowsum", "fixedpoint.encode_rows", "gemm.invariance"}


def test_unavailable_device_exits_2_with_a_clear_message():
    for device in ("cuda", "hip"):
        if probe(device)[0]:
            continue
        result = CliRunner().invoke(main, ["conform", "--device", device, "--quick"])
        assert result.exit_code == 2
        assert f"device '{device}' is unavailable" in result.output


def test_info_lists_every_backend():
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    for name in ("cuda", "hip", "cpu"):
        assert name in result.output


def test_auto_says_which_device_it_took():
    result = CliRunner().invoke(main, ["conform", "--device", "auto", "--quick", "--only", "rowsum"])
    assert "device auto -> " in result.output
