"""`rlportable bench gemm`: the exact GEMM (activation encoding included) against cuBLAS bf16 via torch.

Qwen3-0.6B projection shapes (K x N) at several M. Both sides are timed by CUDA
graph replay in the same process on the same device; the ratio is ours / torch.
"""

from __future__ import annotations

import numpy as np

from rlportable.bench.timing import time_cupy_graph, time_cupy_loop, time_torch_graph
from rlportable.errors import RlpError
from rlportable.ops import gemm as gemm_op

QWEN3_06B_SHAPES = [(1024, 2048), (1024, 1024), (2048, 1024), (1024, 4096), (1024, 6144), (3072, 1024),
                    (1024, 151936)]
M_VALUES = [1, 16, 64, 256, 4096, 16384]
TARGETS = {"small_m": (256, 1.5), "large_m": (4096, 3.5)}  # the training-speed targets (exact / bf16 cuBLAS, at most)


def peer_torch():
    try:
        import torch
    except ImportError:
        raise RlpError("bench gemm needs torch (with CUDA) for the cuBLAS bf16 peer") from None
    if not torch.cuda.is_available():
        raise RlpError("bench gemm: torch cannot see a CUDA device for the peer")
    return torch


def bench_case(backend, torch, m: int, k: int, n: int, methods: list[str], rng) -> dict:
    cupy = backend.cupy
    x_host = rng.standard_normal((m, k)).astype(np.float32)
    w_host = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    x = backend.asarray(x_host)
    weight = gemm_op.encode_weight(backend, backend.asarray(w_host))
    row = {"M": m, "K": k, "N": n}
    replays, repeats = (3, 3) if m * n * k > 10**11 else (20, 5)
    for method in methods:
        out = {}
        name, _, tile = method.partition(":")

        def ours():
            out["y"] = gemm_op.gemm(backend, x, weight, method=name, tile=tile or None)

        # CuPy refuses cuBLAS calls inside a graph capture: the blas path is timed by a
        # launch loop queued behind a spin kernel, the fused path by graph replay.
        resolved = gemm_op.resolve_method(backend, m, gemm_op.DEFAULT_BITS_A, weight, name)
        timer = time_cupy_loop if resolved == "blas" else time_cupy_graph
        row[f"{method}_method"] = resolved
        row[f"{method}_s"] = timer(cupy, ours, replays, repeats)
    xt = torch.from_numpy(x_host).to("cuda", torch.bfloat16)
    wt = torch.from_numpy(w_host).to("cuda", torch.bfloat16)
    yt = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    row["torch_bf16_s"] = time_torch_graph(torch, lambda: torch.matmul(xt, wt.t(), out=yt), replays, repeats)
    # the reported ratio is the default path's ("auto": what the model uses)
    row["exact_s"] = row["auto_s"]
    row["ratio"] = row["exact_s"] / row["torch_bf16_s"]
    del xt, wt, yt, x, weight
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    return row


def run(backend, m_values=None, shapes=None, methods=("auto", "blas"), seed=0, progress=None) -> dict:
    """methods: "auto", "blas", or "fused:<tile>" for one tile of ops/gemm_fused.FUSED_TILES."""
    if backend.name != "cuda":
        raise RlpError(f"bench gemm runs on the cuda backend (peer: torch cuBLAS); got {backend.label}")
    torch = peer_torch()
    rng = np.random.default_rng(seed)
    rows = []
    for k, n in shapes or QWEN3_06B_SHAPES:
        for m in m_values or M_VALUES:
            if progress:
                progress(f"M={m} K={k} N={n}")
            rows.append(bench_case(backend, torch, m, k, n, list(methods), rng))
    return {"device": backend.info(), "torch": torch.__version__, "rows": rows, "targets": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    small = [r["ratio"] for r in rows if r["M"] <= TARGETS["small_m"][0]]
    large = [r["ratio"] for r in rows if r["M"] >= TARGETS["large_m"][0]]
    return {
        "max_ratio_m_le_256": max(small) if small else None,
        "target_m_le_256": TARGETS["small_m"][1],
        "max_ratio_m_ge_4096": max(large) if large else None,
        "target_m_ge_4096": TARGETS["large_m"][1],
    }
