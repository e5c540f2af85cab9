"""`rlportable conform --peer hf`: the end-to-end comparison run on HF transformers, beside rlportable's.

The peer's "engine" is transformers' own incremental decoding (generate with its KV cache: each token's
logits from the step that sampled it, `output_logits`); its "trainer" is its full forward over the
generated sequence. Both are turned into the log-prob of every sampled token the same way
(log_softmax(logits.float() / T) in float32, T = 1), then compared as rlportable's are: bit for bit,
and with the metrics of end_to_end.logprob_metrics. In fp32 and in bf16 (Qwen3ForCausalLM, sdpa).

rlportable runs the same workload (the same model and token-id prompts, n=1, the same lengths): its
engine against its trainer's forward. Model: the tiny one converted to an HF Qwen3 directory on cpu
(rlportable.model.load.save_model), the seeded Qwen3-0.6B-shaped one on a device (2 layers with --quick).
"""

from __future__ import annotations

import tempfile

import numpy as np

from rlportable.conform.end_to_end import (METRIC_COLUMNS, QWEN3_06B, TINY, EngineRun, load, logprob_metrics,
                                           metric_cells, trainer_logprobs)
from rlportable.engine.sequence import SamplingParams
from rlportable.errors import RlpError

# (sequences, prompt length, new tokens) per tier
WORKLOADS = {"cpu-quick": (4, 16, 16), "cpu": (8, 16, 48), "device-quick": (8, 32, 32), "device": (32, 64, 256)}
TEMPERATURE = 1.0


def _side(name: str, precision: str, engine: list[np.ndarray], trainer: list[np.ndarray]) -> dict:
    e, t = np.concatenate(engine), np.concatenate(trainer)
    return {"side": name, "precision": precision, "compared": int(e.size),
            "mismatches": int(np.count_nonzero(e.view(np.uint32) != t.view(np.uint32))),
            "metrics": logprob_metrics(engine, trainer)}


def rlportable_side(loaded, prompts: np.ndarray, new_tokens: int, seed: int) -> dict:
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=new_tokens, seed=seed, ignore_eos=True)
    run = EngineRun({"max_num_seqs": len(prompts), "max_model_len": prompts.shape[1] + new_tokens,
                     **({"sampler": "device"} if loaded.spec == QWEN3_06B else {})},
                    [row.tolist() for row in prompts], [params] * len(prompts), "peer")
    completions, _ = run.generate(loaded)
    budget = 16384 if not loaded.model.backend.runs_reference else 2048
    trainer = trainer_logprobs(loaded, completions, "in-order", budget, np.random.default_rng(seed))
    return _side("rlportable", "contract", [c.logprobs for c in completions], [lp for lp, _ in trainer])


def hf_side(directory: str, precision: str, prompts: np.ndarray, new_tokens: int, device: str, seed: int) -> dict:
    """HF generate (KV cache) against HF's full forward on the generated sequences, one precision."""
    import torch
    import transformers

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                              attn_implementation="sdpa").to(device).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)  # equal-length prompts: no padding
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE, top_k=0,
                             top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        sequences = out.sequences
        sampled = sequences[:, prompts.shape[1]:]
        engine, trainer = [], []
        for row in range(sequences.shape[0]):  # one sequence at a time: [N, V] float32 logits at most
            incremental = torch.stack([step[row].float() for step in out.logits])
            full = model(input_ids=sequences[row:row + 1]).logits[0, prompts.shape[1] - 1:-1].float()
            engine.append(_picked(incremental, sampled[row]))
            trainer.append(_picked(full, sampled[row]))
    del model, out
    return _side("HF transformers", precision, engine, trainer)


def _picked(logits, tokens) -> np.ndarray:
    import torch

    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return logp.cpu().numpy().astype(np.float32)


def run(backend, quick: bool = False, seed: int = 0, progress=None) -> dict:
    try:
        import torch
        import transformers
    except ImportError as error:
        raise RlpError(f"conform --peer hf needs torch and transformers: {error}") from None
    on_device = not backend.runs_reference
    if on_device and not torch.cuda.is_available():
        raise RlpError(f"conform --peer hf: torch sees no GPU for the peer on {backend.label}")
    device = "cuda" if on_device else "cpu"
    spec = QWEN3_06B if on_device else TINY
    tier = ("device" if on_device else "cpu") + ("-quick" if quick else "")
    sequences, prompt_len, new_tokens = WORKLOADS[tier]
    loaded = load(backend, spec, quick)
    config = loaded.model.config
    prompts = np.random.default_rng([seed, 6]).integers(0, config.vocab_size, (sequences, prompt_len))
    if progress:
        progress(f"peer: rlportable, {sequences} x {new_tokens} tokens")
    rows = [rlportable_side(loaded, prompts, new_tokens, seed)]
    from rlportable.model.load import save_model
    from rlportable.model.tiny import tiny_tokenizer

    with tempfile.TemporaryDirectory() as directory:
        tokenizer = loaded.tokenizer if spec == TINY else tiny_tokenizer()  # any tokenizer within the vocabulary
        save_model(directory, config, loaded.weights, tokenizer, dtype="bf16")  # the weights are on the bf16 grid
        for precision in ("fp32", "bf16"):
            if progress:
                progress(f"peer: HF transformers {precision}")
            rows.append(hf_side(directory, precision, prompts, new_tokens, device, seed))
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"peer": "hf", "model": loaded.describe, "device": device, "temperature": TEMPERATURE,
            "sequences": sequences, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}


def peer_table(result: dict) -> tuple[list[list], list[str]]:
    rows = [[row["side"], row["precision"], row["compared"], row["mismatches"], *metric_cells(row["metrics"])]
            for row in result["rows"]]
    return rows, ["engine vs trainer", "precision", "compared", "mismatches", *(t for _, t in METRIC_COLUMNS)]
