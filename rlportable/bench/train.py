"""`rlportable bench train`: the training phase alone against HF transformers bf16 + torch AdamW.

One optimiser step over `sequences` packed sequences of `length` tokens (Qwen3-0.6B shape, random
weights, every next-token row scored, as a GRPO step's completions are): forward, backward and
AdamW, in micro-batches of at most 16,384 tokens (the trainer's default; a longer sequence goes
alone). Ours: the trainer's own calls (train.trainer.pack, model.backward, train.optimizer). Peer:
HF transformers Qwen3ForCausalLM in bf16 with sdpa attention (FlashAttention-2 kernels), the
log-probs from float32 log_softmax, gradients accumulated over the same micro-batches (as many whole
sequences as fit the same token budget), then torch.optim.AdamW; gradient checkpointing only where a
micro-batch does not fit without it (the JSON says where). Same process, same GPU, same tokens.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from rlportable.errors import RlpError

#: (sequences, tokens each): short GRPO completions, 1k, 4k and 16k
SHAPES = ((64, 320), (64, 1088), (64, 4160), (8, 16448))
MICRO_BATCH_TOKENS = 16384
TARGETS = {"64x4160": 2.0, "8x16448": 2.5}  # ratio to the peer at most


def _ours(backend, config, weights, sequences: int, length: int, progress) -> dict:
    from rlportable.bench.forward import PeakTracker
    from rlportable.model import backward
    from rlportable.model.forward import Model
    from rlportable.train.optimizer import Hyper, Optimizer, Schedule
    from rlportable.train.trainer import Sample, pack

    cupy = backend.cupy
    rng = np.random.default_rng(sequences * length)
    ids = rng.integers(0, config.vocab_size, (sequences, length))
    samples = [Sample(list(map(int, row[:1])), list(map(int, row[1:]))) for row in ids]
    batches = pack(samples, MICRO_BATCH_TOKENS)
    model = Model(backend, config, weights, trainable=True)
    optimizer = Optimizer(model, Hyper(lr=1e-6), Schedule(total_steps=10))

    def step(micro_batches):
        for batch in micro_batches:
            fwd = backward.forward(model, batch.tokens, batch.cu_seqlens, rows=batch.rows)
            grads = backward.backward(model, fwd, np.full(batch.rows.size, -1.0 / batch.rows.size, np.float32))
            optimizer.accumulate(grads)
            del fwd
        optimizer.step()

    step(pack(samples[:1], MICRO_BATCH_TOKENS))  # warm-up on one sequence: compiles the kernels
    backend.synchronize()
    if progress:
        progress(f"ours: {sequences} x {length} in {len(batches)} micro-batches")
    with PeakTracker(cupy) as tracker:
        start = time.perf_counter()
        step(batches)
        backend.synchronize()
        seconds = time.perf_counter() - start
    del model, optimizer
    gc.collect()  # anything of ours in a reference cycle goes now, not while the peer runs
    cupy.get_default_memory_pool().free_all_blocks()
    return {"ours_s": seconds, "ours_micro_batches": len(batches), "ours_peak_bytes": tracker.peak}


def _peer(torch, transformers, hf_config, sequences: int, length: int, progress) -> dict:
    rng = np.random.default_rng(sequences * length)
    ids = torch.tensor(rng.integers(0, hf_config.vocab_size, (sequences, length)), device="cuda")
    per_batch = max(1, MICRO_BATCH_TOKENS // length)
    result = {"hf_micro_batch_sequences": per_batch}
    for checkpointing in (False, True):
        torch.cuda.empty_cache()
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                              torch_dtype=torch.bfloat16).cuda()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99))
        rows = sequences * (length - 1)

        def step():
            for first in range(0, sequences, per_batch):
                batch = ids[first:first + per_batch]
                logits = model(batch).logits[:, :-1].float()
                logp = torch.log_softmax(logits, dim=-1).gather(-1, batch[:, 1:, None])
                (-logp.sum() / rows).backward()
                del logits, logp
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        try:
            step()  # warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if progress:
                progress(f"HF bf16: {sequences} x {length}, checkpointing {'on' if checkpointing else 'off'}")
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            result.update({"hf_s": time.perf_counter() - start, "hf_gradient_checkpointing": checkpointing,
                           "hf_peak_bytes": int(torch.cuda.max_memory_allocated())})
            return result
        except torch.cuda.OutOfMemoryError:
            if checkpointing:
                raise RlpError(f"bench train: the HF peer does not fit {per_batch} x {length} tokens "
                               "even with gradient checkpointing") from None
        finally:
            del model, optimizer
            torch.cuda.empty_cache()
    raise AssertionError("unreachable")


def run(backend, shapes=SHAPES, layers: int | None = None, progress=None) -> dict:
    if backend.name != "cuda":
        raise RlpError(f"bench train runs on the cuda backend (peer: HF transformers on CUDA); got {backend.label}")
    try:
        import torch
        import transformers
    except ImportError as error:
        raise RlpError(f"bench train needs torch and transformers for the peer: {error}") from None
    from rlportable.model.synthetic import QWEN3_06B, qwen3_06b_config, random_weights

    config = qwen3_06b_config(layers)
    weights = random_weights(config)
    hf_config = transformers.Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": config.num_hidden_layers})
    rows = []
    for sequences, length in shapes:
        row = {"sequences": sequences, "length": length}
        row.update(_ours(backend, config, weights, sequences, length, progress))
        row.update(_peer(torch, transformers, hf_config, sequences, length, progress))
        row["ratio"] = row["ours_s"] / row["hf_s"]
        rows.append(row)
        if progress:
            progress(f"  {sequences} x {length}: ours {row['ours_s']:.2f} s, HF {row['hf_s']:.2f} s, "
                     f"ratio {row['ratio']:.2f}")
    return {"device": backend.info(), "torch": torch.__version__, "transformers": transformers.__version__,
            "model": "Qwen3-0.6B shape, random weights", "layers": config.num_hidden_layers,
            "micro_batch_tokens": MICRO_BATCH_TOKENS, "rows": rows, "targets": {"ratio_at_most": TARGETS}}
