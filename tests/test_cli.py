import json

from click.testing import CliRunner

from rlportable.cli import main
from rlportable.runtime import probe


def test_conform_cpu_quick_passes_and_writes_json(tmp_path):
    out = tmp_path / "conform.json"
    result = CliRunner().invoke(main, ["conform", "--device", "cpu", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert set(payload) == {"device", "backend", "checks", "compared", "mismatches", "passed", "provenance"}
    assert set(payload["provenance"]) == {"commit", "date"}
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


def test_logp_prints_per_token_logprobs_as_json(tmp_path):
    data = tmp_path / "texts.jsonl"
    data.write_text('{"text": "12+34=46"}\n{"prompt": "7*6=", "completion": "42"}\n')
    result = CliRunner().invoke(main, ["logp", "--model", "tiny", "--device", "cpu", "--jsonl", str(data), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert len(payload["results"]) == 2
    first = payload["results"][0]
    assert first["logprobs"][0] is None and len(first["logprobs"]) == len(first["tokens"]) >= 2
    assert all(lp <= 0 for lp in first["logprobs"][1:])


def test_logp_bad_input_is_one_line():
    result = CliRunner().invoke(main, ["logp", "--model", "tiny", "--device", "cpu"])
    assert result.exit_code == 1 and "exactly one of --text or --jsonl" in result.output
    result = CliRunner().invoke(main, ["logp", "--model", "/no/such/dir", "--device", "cpu", "--text", "hi there"])
    assert result.exit_code == 1 and "/no/such/dir" in result.output and "Traceback" not in result.output


def test_generate_json_gives_tokens_text_and_logprobs():
    result = CliRunner().invoke(main, ["generate", "--device", "cpu", "--prompt", "12+34=", "-n", "2",
                                       "--max-tokens", "5", "--ignore-eos", "--seed", "1", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    samples = payload["results"][0]["samples"]
    assert len(samples) == 2 and all(len(s["token_ids"]) == 5 == len(s["logprobs"]) for s in samples)
