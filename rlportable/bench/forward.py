"""`rlportable bench forward`: log-prob throughput and peak memory of a Qwen3-0.6B-shaped model.

Ours: the contract forward (packed sequences, fused LM-head + log-prob). Peer:
HF transformers Qwen3ForCausalLM in bf16 with sdpa attention, then
log_softmax + gather, in the same process on the same GPU, same tokens.
Weights are random (no download): throughput does not depend on their values.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from rlportable.errors import RlpError

from rlportable.model.synthetic import QWEN3_06B, qwen3_06b_config, random_weights


class PeakTracker:
    """Peak bytes handed out by CuPy's memory pool while active."""

    def __init__(self, cupy):
        self.cupy, self.pool, self.peak = cupy, cupy.get_default_memory_pool(), 0

    def __enter__(self):
        def allocate(size):
            memory = self.pool.malloc(size)
            self.peak = max(self.peak, self.pool.used_bytes())
            return memory

        self.pool.free_all_blocks()
        self.peak = self.pool.used_bytes()
        self.cupy.cuda.set_allocator(allocate)
        return self

    def __exit__(self, *exc):
        self.cupy.cuda.set_allocator(self.pool.malloc)


def _time(step, sync, repeats: int) -> float:
    step()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run(backend, sequences: int = 16, length: int = 1024, layers: int | None = None, repeats: int = 3,
        progress=None) -> dict:
    if backend.name != "cuda":
        raise RlpError(f"bench forward runs on the cuda backend (peer: HF transformers on CUDA); got {backend.label}")
    try:
        import torch
        import transformers
    except ImportError as error:
        raise RlpError(f"bench forward needs torch and transformers for the peer: {error}") from None
    from rlportable.model.forward import Model

    cupy = backend.cupy
    config = qwen3_06b_config(layers)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, sequences * length).astype(np.int32)
    cu = np.arange(0, sequences * length + 1, length)
    if progress:
        progress("ours: building the model")
    weights = random_weights(config)
    with PeakTracker(cupy) as tracker:
        model = Model(backend, config, weights)
        if progress:
            progress("ours: timing")
        ours_s = _time(lambda: model.logprobs(tokens, cu), backend.synchronize, repeats)
    ours_peak = tracker.peak
    del model
    cupy.get_default_memory_pool().free_all_blocks()

    if progress:
        progress("HF transformers bf16 sdpa: timing")
    hf_config = transformers.Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": config.num_hidden_layers})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                       torch_dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(tokens.reshape(sequences, length).astype(np.int64), device="cuda")

    def peer():
        with torch.no_grad():
            logits = hf(ids).logits
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])
        return lp

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    hf_s = _time(peer, torch.cuda.synchronize, repeats)
    hf_peak = torch.cuda.max_memory_allocated() - base + sum(p.numel() * p.element_size() for p in hf.parameters())
    scored = sequences * (length - 1)
    return {
        "device": backend.info(), "torch": torch.__version__, "transformers": transformers.__version__,
        "model": "Qwen3-0.6B shape, random weights", "layers": config.num_hidden_layers,
        "sequences": sequences, "length": length,
        "ours_s": ours_s, "ours_tokens_per_s": scored / ours_s, "ours_peak_bytes": ours_peak,
        "hf_bf16_s": hf_s, "hf_tokens_per_s": scored / hf_s, "hf_peak_bytes": hf_peak,
        "throughput_ratio": hf_s / ours_s, "memory_ratio": ours_peak / hf_peak,
        "targets": {"throughput_ratio_at_least": 0.25, "memory_ratio_at_most": 1.0},
    }
