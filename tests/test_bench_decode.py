"""bench decode: the byte accounting of the bandwidth bound, and the engine measurement on cpu."""

import pytest
from click.testing import CliRunner

from conftest import clean_exit
from rlportable.bench import decode
from rlportable.cli import main
from rlportable.errors import InputError
from rlportable.model.tiny import tiny_config, tiny_weights
from rlportable.runtime import get_backend


def test_step_bytes_of_the_tiny_model_by_hand():
    # tiny: hidden 64, intermediate 176, 4 query heads and 2 KV heads of 16, vocab 512, 2 layers,
    # QK-norm, tied embeddings. Stored encodings: 2 int8 digits per element, K padded to 64,
    # one int32 exponent per output row (weights) and per (token, KV head) row of K or V.
    config = tiny_config()
    q = 64 * (2 * 64 + 4)            # [64, 64]
    k = v = 32 * (2 * 64 + 4)        # [32, 64]
    o = 64 * (2 * 64 + 4)            # [64, 64]
    gate = up = 176 * (2 * 64 + 4)   # [176, 64]
    down = 64 * (2 * 192 + 4)        # [64, 176]: K = 176 padded to 192
    assert q + k + v + o + gate + up + down == 96640
    norms = (2 * 64 + 2 * 16) * 4    # attn and mlp norms, q and k norms, float32
    final_norm = 64 * 4
    lm_head = 512 * (2 * 64 + 4)     # read whole, once per step
    embedding_rows = 2 * 64 * 4      # two sequences: two float32 rows gathered
    kv_row = 2 * 64 + 4              # head_dim 16 stored padded to 64, + exponent
    kv = (5 + 7) * 2 * 2 * 2 * kv_row  # tokens x layers x KV heads x (K, V) x row
    parts = decode.step_bytes(config, [5, 7], "ours")
    assert parts == {"projections": 2 * 96640, "norms_and_biases": 2 * norms + final_norm,
                     "embedding_rows": embedding_rows, "lm_head": lm_head, "kv_cache": kv,
                     "total": 2 * 96640 + 2 * norms + final_norm + embedding_rows + lm_head + kv}
    assert parts["total"] == 275584

    bf16 = decode.step_bytes(config, [5, 7], "bf16")
    assert bf16["projections"] == 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 176 * 64) * 2
    assert bf16["lm_head"] == 512 * 64 * 2
    assert bf16["kv_cache"] == 12 * 2 * 2 * 2 * 16 * 2


def test_step_bytes_of_the_qwen3_06b_shape():
    from rlportable.model.synthetic import qwen3_06b_config

    config = qwen3_06b_config()
    parts = decode.step_bytes(config, [640] * 256, "ours")
    # 2 bytes per weight element as bf16 has, plus exponents; no padding at these sizes
    elements = 28 * (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 3072 * 1024)
    rows = 28 * (2048 + 2 * 1024 + 1024 + 2 * 3072 + 1024)
    assert parts["projections"] == 2 * elements + 4 * rows
    assert parts["lm_head"] == 151936 * (2 * 1024 + 4)
    assert parts["kv_cache"] == 256 * 640 * 28 * 8 * 2 * (2 * 128 + 4)
    with pytest.raises(InputError):
        decode.step_bytes(config, [0], "ours")


def test_pure_decode_steps_and_their_lengths():
    # 2 sequences: a prefill step gives 1 token to one, then a mixed step, then pure decodes
    assert decode.pure_decode_indices([1, 2, 4, 6], 2) == [2, 3]
    assert decode.decode_kv_lengths(4, 2, 2) == [5, 5]  # feeds output 1 at position 4: 5 positions


def test_engine_measurement_on_cpu():
    config = tiny_config()
    result = decode.measure(get_backend("cpu"), config, tiny_weights(config), sequences=2, prompt_len=4,
                            new_tokens=3, peer="none")
    ours = result["ours"]
    assert ours["complete"] and ours["all_lengths_equal_new_tokens"]
    assert ours["output_tokens"] == 6 and ours["preemptions"] == 0
    # step 1 prefills both prompts (one token each); steps 2 and 3 are pure decodes attending to 5 and 6
    assert ours["step_log"]["outputs"] == [2, 4, 6]
    assert ours["decode_steps"] == 2 and ours["decode_step_indices"] == [2, 3]
    expected = (decode.step_bytes(config, [5, 5])["total"] + decode.step_bytes(config, [6, 6])["total"]) / 2
    assert ours["decode_bytes_per_step_mean"] == expected
    assert ours["bound_step_s_mean"] == pytest.approx(expected / result["copy_bandwidth"]["bytes_per_s"])
    assert 0 < ours["bound_fraction"] and ours["tokens_per_s"] > 0
    assert ours["decode_execute_s_median"] is not None and ours["decode_host_sampler_s_median"] is not None
    assert ours["engine"]["sampler"] == "host"  # auto on cpu
    assert result["hf_bf16"] is None and result["ratios"] == {}


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_pure_decode_steps_after_a_staggered_chunked_prefill(cuda_graphs):
    """A token budget below the prompts' total admits sequences over several steps, so they hold
    different output counts; the engine's own plans still tell the pure decode steps (the bug: none
    were found at 256 sequences, and no ms per decode step was reported)."""
    config = tiny_config()
    prompts = decode.random_prompts(config, 4, 6)
    ours = decode.measure_engine(get_backend("cpu"), config, tiny_weights(config), prompts, 9,
                                 max_num_batched_tokens=8, cuda_graphs=cuda_graphs)
    outputs = ours["step_log"]["outputs"]
    assert ours["complete"] and decode.pure_decode_indices(outputs, 4) == []  # counts alone find none
    assert ours["decode_steps"] >= 3 and ours["decode_step_s_median"] > 0
    assert ours["decode_execute_s_median"] > 0 and ours["decode_runner_wait_s_median"] is not None
    assert ours["engine"]["cuda_graphs"] is cuda_graphs and ours["engine"]["graphs"] == 0  # cpu: no graphs
    pure = ours["step_log"]["pure_decode"]
    assert all(outputs[i] - outputs[i - 1] == 4 for i in pure)


def test_decode_steps_are_timed_with_asynchronous_scheduling():
    """With async scheduling a step is launched before the one before it is recorded: its timings and its
    plan still go to its own index of the step log."""
    config = tiny_config()
    prompts = decode.random_prompts(config, 4, 6)
    ours = decode.measure_engine(get_backend("cpu"), config, tiny_weights(config), prompts, 9, sampler="device",
                                 cuda_graphs=True, async_scheduling=True)
    assert ours["complete"] and ours["engine"]["async_scheduling"] and ours["steps_ahead"] == 7
    assert ours["step_log"]["pure_decode"] == list(range(1, 9)) and ours["decode_steps"] == 8
    assert ours["decode_execute_s_median"] > 0 and ours["decode_runner_wait_s_median"] is not None


def test_engine_time_limit_stops_and_reports():
    config = tiny_config()
    prompts = decode.random_prompts(config, 2, 4)
    ours = decode.measure_engine(get_backend("cpu"), config, tiny_weights(config), prompts, 5, time_limit=0.0)
    assert not ours["complete"] and ours["steps"] == 1 and ours["output_tokens"] == 2


def test_hf_peer_on_cpu_runs_the_same_batch():
    pytest.importorskip("transformers")
    config = tiny_config()
    prompts = decode.random_prompts(config, 2, 4)
    hf = decode.measure_hf(config, prompts, 3, device="cpu")
    assert hf["complete"] and hf["generated_shape"] == [2, 7] and hf["step_log"]["outputs"] == [2, 4, 6]
    ours = {"complete": True, "tokens_per_s": 2 * hf["tokens_per_s"], "sequences": 2,
            "step_log": {"times_s": [0.0, 0.5, 1.0], "outputs": [2, 4, 6]}, "peak_bytes": None}
    ratios = decode.compare(ours, hf)
    assert ratios["throughput_ratio"] == pytest.approx(2.0)
    assert ratios["decode_steps_compared"] == 2
    times = hf["step_log"]["times_s"]
    assert ratios["decode_step_ratio"] == pytest.approx((times[2] - times[0]) / 1.0)
    # the peer is HF's second full-length call; the first (its warm-up) is reported beside it
    assert hf["warm"] and hf["first_call"]["complete"] and hf["first_call"]["tokens_per_s"] > 0


def test_hf_static_peer_on_cpu_generates_the_batch_with_a_static_cache():
    """--peer hf-static: the static KV cache (uncompiled on cpu; torch.compile only on cuda), the same
    batch and step log as the default peer, and the setup recorded."""
    pytest.importorskip("transformers")
    config = tiny_config()
    prompts = decode.random_prompts(config, 2, 4)
    hf = decode.measure_hf(config, prompts, 3, device="cpu", static=True)
    assert hf["complete"] and hf["generated_shape"] == [2, 7] and hf["step_log"]["outputs"] == [2, 4, 6]
    assert hf["setup"] == {"kv_cache": "static", "torch_compile": False}
    assert decode.measure_hf(config, prompts, 1, device="cpu")["setup"]["kv_cache"] == "dynamic"


def test_hf_peer_under_a_time_limit_or_one_token_reports_without_decode_steps():
    pytest.importorskip("transformers")
    config = tiny_config()
    prompts = decode.random_prompts(config, 2, 4)
    stopped = decode.measure_hf(config, prompts, 3, device="cpu", time_limit=0.0)
    assert not stopped["complete"] and not stopped["warm"] and stopped["first_call"]["decode_step_s_median"] is None
    assert decode.measure_hf(config, prompts, 1, device="cpu")["complete"]


def test_cli_bench_decode_needs_cuda():
    result = CliRunner().invoke(main, ["bench", "decode", "--device", "cpu", "--sequences", "2"])
    assert result.exit_code != 0
    assert "cuda" in result.output and clean_exit(result)


def test_cli_bench_decode_prints_and_writes_json(tmp_path, monkeypatch):
    """The command's table and JSON, on a cpu result (the command itself refuses cpu)."""
    import json

    config = tiny_config()

    def fake_run(backend, sequences, prompt_len, new_tokens, layers, peer, time_limit, sampler, progress=None,
                 cuda_graphs=True, async_scheduling=None, runs=1):
        assert (sequences, prompt_len, new_tokens, layers, peer, sampler, runs) == (2, 4, 3, 1, "hf", "auto", 2)
        assert cuda_graphs is False and async_scheduling is False  # --no-cuda-graphs --no-async-scheduling
        return decode.measure(get_backend("cpu"), config, tiny_weights(config), sequences, prompt_len, new_tokens,
                              peer, time_limit, sampler, progress, runs=runs)

    monkeypatch.setattr(decode, "run", fake_run)
    out = tmp_path / "decode.json"
    result = CliRunner().invoke(main, ["bench", "decode", "--device", "cpu", "--sequences", "2", "--prompt-len", "4",
                                       "--new-tokens", "3", "--layers", "1", "--json", str(out),
                                       "--no-cuda-graphs", "--no-async-scheduling", "--runs", "2"])
    assert result.exit_code == 0, result.output
    assert "rlportable engine" in result.output and "HF transformers bf16 sdpa" in result.output
    assert "throughput ratio" in result.output and "bound fraction" in result.output
    assert "runs (ours / HF tokens/s, throughput ratio)" in result.output
    payload = json.loads(out.read_text())
    assert payload["ours"]["complete"] and payload["hf_bf16"]["complete"] and len(payload["runs"]) == 2
    assert payload["copy_bandwidth"]["bytes_per_s"] > 0 and payload["device"]["backend"] == "cpu"


def test_a_failing_peer_keeps_our_numbers(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(decode, "measure_hf", broken)
    config = tiny_config()
    result = decode.measure(get_backend("cpu"), config, tiny_weights(config), 2, 4, 2, peer="hf")
    assert result["ours"]["complete"] and result["hf_bf16"] is None
    assert result["peer_error"] == "RuntimeError: CUDA out of memory" and result["ratios"] == {}


def test_runs_alternate_and_report_each_sides_median_run(monkeypatch):
    """--runs N: ours and the peer in turn N times; each side's median run (a real one) makes the ratios."""
    order = []

    def side(name, rates):
        def fake(*args, **kwargs):
            rate = rates[len([o for o in order if o[0] == name])]
            order.append((name, rate))
            first = {"complete": True, "tokens_per_s": rate / 4}  # the peer's cold first call
            return {"complete": True, "tokens_per_s": rate, "sequences": 2, "peak_bytes": None,
                    "step_log": {"times_s": [0.0, 1.0 / rate], "outputs": [2, 4]}, "first_call": first}
        return fake

    monkeypatch.setattr(decode, "measure_engine", side("ours", [30.0, 10.0, 20.0]))
    monkeypatch.setattr(decode, "measure_hf", side("hf", [2.0, 4.0, 3.0]))
    config = tiny_config()
    result = decode.measure(get_backend("cpu"), config, tiny_weights(config), 2, 4, 2, peer="hf", runs=3)
    assert [name for name, _ in order] == ["ours", "hf"] * 3
    assert result["ours"]["tokens_per_s"] == 20.0 and result["hf_bf16"]["tokens_per_s"] == 3.0
    assert result["ratios"]["throughput_ratio"] == pytest.approx(20.0 / 3.0)
    # HF's first call in the process is run 1's (2.0 / 4), whichever run is the median
    assert result["hf_first_call"]["tokens_per_s"] == 0.5
    assert result["ratios"]["throughput_ratio_first_call"] == pytest.approx(20.0 / 0.5)
    assert [r["ratios"]["throughput_ratio"] for r in result["runs"]] == pytest.approx([15.0, 2.5, 20.0 / 3.0])
    assert decode.median_run([{"tokens_per_s": v} for v in (4.0, 1.0, 3.0, 2.0)])["tokens_per_s"] == 2.0
    with pytest.raises(InputError, match="runs must be a positive integer"):
        decode.measure(get_backend("cpu"), config, tiny_weights(config), 2, 4, 2, peer="none", runs=0)
