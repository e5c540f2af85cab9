"""`rlportable bench attention`: the exact attention family against torch's bf16 attention.

Ours: attention_packed (the training forward and packed prefill: K/V encoding included),
attention_packed_backward (given the forward's o and row statistics, as the trainer calls it) and the decode path
(attention_paged, one query per sequence over a paged cache of `length` keys). Peer: torch
scaled_dot_product_attention in bf16 (causal, GQA; FlashAttention-2 kernels on Hopper), forward and
backward, in the same process on the same GPU, over the same shapes. Causal FLOPs count the two
products of the forward (4 T^2 D / 2 a head) and the five of the backward (2.5x), as FlashAttention
reports them. Decode reports the bytes of the encoded cache it must read per step against a device
copy's bandwidth measured in the same run.
"""

from __future__ import annotations

import statistics

import numpy as np

from rlportable.errors import RlpError

LENGTHS = (1024, 4096, 16384)
#: (q heads, kv heads): Qwen3-0.6B's and Qwen3-8B's attention layouts, head_dim 128
LAYOUTS = ((16, 8), (32, 8))
HEAD_DIM = 128
TOKENS = 16384  # tokens per call: sequences = TOKENS // length
DECODE_SEQUENCES = 64
TARGET_RATIO = 4.0  # forward + backward against sdpa bf16, at T = 4096
TARGET_DECODE_BOUND = 0.5


def _median_seconds(events, step, sync, repeats: int) -> float:
    """Median seconds of `step` between two device events, after one warm-up call (compiles).
    events() gives (start, stop, elapsed milliseconds of the pair)."""
    step()
    sync()
    samples = []
    for _ in range(repeats):
        start, stop, elapsed = events()
        start.record()
        step()
        stop.record()
        stop.synchronize()
        samples.append(elapsed(start, stop) / 1e3)
    return statistics.median(samples)


def _flops(sequences: int, length: int, hq: int, dim: int) -> float:
    """Causal forward FLOPs: two products of length^2 / 2 pairs per head."""
    return 4.0 * sequences * hq * dim * length * length / 2


def run(backend, lengths=LENGTHS, layouts=LAYOUTS, tokens: int = TOKENS, repeats: int = 3,
        decode_sequences: int = DECODE_SEQUENCES, progress=None) -> dict:
    if backend.name != "cuda":
        raise RlpError(f"bench attention runs on the cuda backend (peer: torch sdpa on CUDA); got {backend.label}")
    try:
        import torch
        import torch.nn.functional as functional
    except ImportError as error:
        raise RlpError(f"bench attention needs torch for the peer: {error}") from None
    from rlportable.bench.decode import copy_bandwidth
    from rlportable.ops import attention

    cupy = backend.cupy
    def cupy_events():
        return cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.get_elapsed_time

    def torch_events():
        return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                lambda start, stop: start.elapsed_time(stop))
    bandwidth = copy_bandwidth(backend)["bytes_per_s"]  # bench decode's bound: the best of ten copies
    rows = []
    for length in lengths:
        for hq, hkv in layouts:
            sequences = max(1, tokens // length)
            total = sequences * length
            if progress:
                progress(f"T = {length} x {sequences} sequences, {hq}/{hkv} heads")
            rng = np.random.default_rng(length + hq)
            host = {name: rng.standard_normal((total, heads, HEAD_DIM)).astype(np.float32)
                    for name, heads in (("q", hq), ("k", hkv), ("v", hkv), ("do", hq))}
            q, k, v, do = (backend.asarray(host[name]) for name in ("q", "k", "v", "do"))
            cu = np.arange(0, total + 1, length, dtype=np.int64)
            # as the trainer calls them: the forward keeps o and its row statistics for the backward
            o, stats = attention.attention_packed(backend, q, k, v, cu, keep_stats=True)
            ours_fwd = _median_seconds(
                cupy_events, lambda: attention.attention_packed(backend, q, k, v, cu, keep_stats=True),
                backend.synchronize, repeats)
            ours_bwd = _median_seconds(
                cupy_events, lambda: attention.attention_packed_backward(backend, q, k, v, do, cu, o=o, row_stats=stats),
                backend.synchronize, repeats)
            del q, k, v, do, o, stats
            cupy.get_default_memory_pool().free_all_blocks()

            def peer_tensor(name, heads):
                return torch.from_numpy(host[name]).cuda().to(torch.bfloat16).view(
                    sequences, length, heads, HEAD_DIM).transpose(1, 2).contiguous()

            tq, tk, tv, tdo = (peer_tensor(n, h) for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("do", hq)))
            for tensor in (tq, tk, tv):
                tensor.requires_grad_(True)
            out = functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
            peer_fwd = _median_seconds(
                torch_events, lambda: functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                             enable_gqa=True),
                torch.cuda.synchronize, repeats)
            peer_bwd = _median_seconds(
                torch_events, lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True),
                torch.cuda.synchronize, repeats)
            del tq, tk, tv, tdo, out
            torch.cuda.empty_cache()

            flops = _flops(sequences, length, hq, HEAD_DIM)
            row = {"length": length, "sequences": sequences, "hq": hq, "hkv": hkv, "head_dim": HEAD_DIM,
                   "ours_forward_s": ours_fwd, "ours_backward_s": ours_bwd,
                   "sdpa_forward_s": peer_fwd, "sdpa_backward_s": peer_bwd,
                   "forward_ratio": ours_fwd / peer_fwd, "backward_ratio": ours_bwd / peer_bwd,
                   "train_ratio": (ours_fwd + ours_bwd) / (peer_fwd + peer_bwd),
                   "ours_forward_tflops": flops / ours_fwd / 1e12, "ours_backward_tflops": 2.5 * flops / ours_bwd / 1e12,
                   "sdpa_forward_tflops": flops / peer_fwd / 1e12, "sdpa_backward_tflops": 2.5 * flops / peer_bwd / 1e12}
            row.update(_decode(backend, attention, cupy_events, length, hq, hkv, decode_sequences, repeats,
                               bandwidth, rng))
            rows.append(row)
            if progress:
                progress(f"  forward {row['forward_ratio']:.2f}x, backward {row['backward_ratio']:.2f}x, "
                         f"decode bound {row['decode_bound_fraction']:.2f}")
    return {"device": backend.info(), "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth,
            "rows": rows,
            "targets": {"train_ratio_at_most_at_4096": TARGET_RATIO,
                        "decode_bound_fraction_at_least": TARGET_DECODE_BOUND}}


def decode_inputs(backend, attention, length: int, hq: int, hkv: int, sequences: int, rng) -> dict:
    """A decode step's inputs: `sequences` queries, each at position length - 1 over a paged cache
    (blocks of 16) of `length` random keys, and the bytes of the cache rows the step must read."""
    block = 16
    blocks = -(-length // block)
    cache = attention.KVCache.allocate(backend, sequences * blocks * block, hkv, HEAD_DIM, block_size=block)
    keys = sequences * length
    slots = (np.arange(sequences)[:, None] * blocks * block + np.arange(length)[None, :]).reshape(-1)
    chunk = 1 << 16  # keys written per call: bounded host memory
    for first in range(0, keys, chunk):
        count = min(chunk, keys - first)
        k = backend.asarray(rng.standard_normal((count, hkv, HEAD_DIM)).astype(np.float32))
        v = backend.asarray(rng.standard_normal((count, hkv, HEAD_DIM)).astype(np.float32))
        attention.write_kv(backend, cache, k, v, slots[first:first + count].astype(np.int32))
    tables = backend.asarray((np.arange(sequences)[:, None] * blocks + np.arange(blocks)[None, :]).astype(np.int32))
    row_bytes = 2 * (2 * cache.head_dim_padded + 4)  # K and V: two int8 digits a channel, an int32 exponent
    return {"q": backend.asarray(rng.standard_normal((sequences, hq, HEAD_DIM)).astype(np.float32)),
            "q_seq": backend.asarray(np.arange(sequences, dtype=np.int32)),
            "q_pos": backend.asarray(np.full(sequences, length - 1, dtype=np.int32)),
            "cache": cache, "tables": tables, "bytes": keys * hkv * row_bytes}


def _decode(backend, attention, events, length: int, hq: int, hkv: int, sequences: int, repeats: int,
            bandwidth: float, rng) -> dict:
    """One decode step's attention (decode_inputs) against the copy bandwidth."""
    x = decode_inputs(backend, attention, length, hq, hkv, sequences, rng)

    def step():
        return attention.attention_paged(backend, x["q"], x["q_seq"], x["q_pos"], x["cache"], x["tables"])
    seconds = _median_seconds(events, step, backend.synchronize, repeats)
    return {"decode_sequences": sequences, "decode_s": seconds, "decode_bytes": x["bytes"],
            "decode_bound_fraction": x["bytes"] / seconds / bandwidth,
            "decode_kernels_s": _kernel_seconds(backend, events, step)}


def _kernel_seconds(backend, events, step) -> dict:
    """Seconds of each kernel one call of `step` launches, between events around each launch (the
    split passes' shares of a decode step)."""
    launch, marks = backend.launch, []

    def timed_launch(family, kernel, *args, **kwargs):
        start, stop, elapsed = events()
        start.record()
        launch(family, kernel, *args, **kwargs)
        stop.record()
        marks.append((kernel, start, stop, elapsed))

    backend.launch = timed_launch
    try:
        step()
    finally:
        backend.launch = launch
    backend.synchronize()
    times = {}
    for kernel, start, stop, elapsed in marks:
        times[kernel] = times.get(kernel, 0.0) + elapsed(start, stop) / 1e3
    return times
