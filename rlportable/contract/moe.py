"""Mixture-of-experts block (Qwen3-MoE's sparse MLP): reference of contracts/moe.toml.

For a token's hidden row h [H] (the post-attention RMSNorm output), E experts, k of them active:
  z    = gemm(h, W_router)                                 [E], the exact gemm contract (23 x 15 bits)
  m    = max_e z_e                                         exact
  p_e  = exp_f32(z_e - m)                                  float32 subtraction, contract exp
  S    = sum_e RNE(p_e * 2^36)                             exact int64 (as logprob's S)
  top  = the k experts of largest z, equal z: lower index first (an exact comparison of floats)
  Sk   = sum_{e in top} RNE(p_e * 2^36)                    exact int64 (norm_topk_prob only)
  w_e  = RNE_f32(float64(p_e) / (odd(D) * 2^-36))          D = Sk if norm_topk_prob else S
  y_j  = gemm(swiglu(gemm(h, G_e), gemm(h, U_e)), D_e)     expert e = top[j], three exact gemms
  out  = RNE_f32(sum_j w_j y_j)                            per output element: the exact float64
                                                           products w_j y_j on a 38-bit fixed-point
                                                           grid below their largest, summed in int64,
                                                           rounded once
Every step depends on the token's own row only, and each gemm row is exact, so the bits do not
depend on the batch, the token order or how tokens are grouped by expert. The top-k order is the
order of the logits, which is the order of the exact softmax: selecting on the float32
probabilities would add ties the logits do not have.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import activation, exact, fixedpoint as fp
from rlportable.contract.elementwise import exp_f32
from rlportable.contract.logprob import quantize_f64_rows

SUM_BITS = 38  # probability sums: logprob's grid, so S here is logprob's S of the router logits
COMBINE_BITS = 38  # each output element's terms: rowsum's grid, 2^-36 of the largest term
MAX_EXPERTS = 2**16  # S < 2^53: odd(S) is exact, as in logprob (E terms of at most 2^36)
BITS_A, BITS_W = fp.ACTIVATION_BITS, 15  # the gemm contract's default operand bits (ops/gemm.py)


def check_top_k(num_experts: int, top_k: int) -> None:
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"moe: the number of experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe: top_k must be in [1, {num_experts}], got {top_k}")


def router_logits(h: np.ndarray, router: np.ndarray) -> np.ndarray:
    """float32 [T, E]: the router's logits, the gemm contract at the default bits."""
    return exact.gemm(h, router, BITS_A, BITS_W)


def top_k_experts(logits: np.ndarray, top_k: int) -> np.ndarray:
    """int32 [T, k]: the experts of the k largest logits, largest first; equal logits (+0 and -0
    included) in ascending expert index. A stable sort of -z keeps equal keys in index order."""
    z = np.asarray(logits, dtype=np.float32)
    check_top_k(z.shape[1], top_k)
    with np.errstate(invalid="ignore"):
        order = np.argsort(-z, axis=1, kind="stable")
    return np.ascontiguousarray(order[:, :top_k]).astype(np.int32)


def undefined_rows(logits: np.ndarray) -> np.ndarray:
    """bool [T]: rows with a NaN logit or a non-finite maximum (+inf, or every logit -inf)."""
    z = np.asarray(logits, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.isnan(z).any(axis=1) | ~np.isfinite(z.max(axis=1, initial=-np.inf))


@np.errstate(all="ignore")  # inf - inf in undefined rows is overwritten; not a warning
def route(logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """(experts int32 [T, k], weights float32 [T, k]) of router logits [T, E].

    An undefined row (undefined_rows) takes experts 0..k-1 with the canonical NaN as every weight,
    so its block output is the canonical NaN."""
    z = np.asarray(logits, dtype=np.float32)
    t, e = z.shape
    experts = top_k_experts(z, top_k)
    bad = undefined_rows(z)
    m = z.max(axis=1, keepdims=True, initial=-np.inf)
    p = exp_f32((z - np.where(bad[:, None], np.float32(0), m)).astype(np.float32)).astype(np.float64)
    terms = np.rint(p * 2.0 ** (SUM_BITS - 2)).astype(np.int64)
    rows = np.arange(t)[:, None]
    chosen = experts.astype(np.int64)
    sums = terms[rows, chosen].sum(axis=1) if norm_topk_prob else terms.sum(axis=1)
    # the maximum's p is exactly 1 and always among the chosen, so the sum is at least 2^36
    sums = np.where(bad, 2 ** (SUM_BITS - 2), sums)
    denominator = fp.round_to_odd_f64(sums) * fp.pow2_f64(np.full(t, -(SUM_BITS - 2)))
    weights = (p[rows, chosen] / denominator[:, None]).astype(np.float32)
    experts[bad] = np.arange(top_k, dtype=np.int32)
    weights[bad] = fp.CANONICAL_NAN
    return experts, weights


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def combine(weights: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """float32 [T, H] = sum_j weights[t, j] * outputs[t, j, :], one exact sum per element.

    P_j = float64(w_j) * float64(y_j) is exact (24 x 24 bits); a term with w_j = 0 is exactly 0
    whatever y_j (an expert whose probability underflowed contributes nothing, as the entropy's p = 0
    terms). Per output element: any NaN term, or both +inf and -inf, gives the canonical NaN; else an
    infinite term gives that infinity; else e = ilogb(max_j |P_j|), q_j = RNE(P_j * 2^(36 - e)),
    out = RNE_f32(sum_j q_j * 2^(e - 36)), exact zero +0."""
    w = np.asarray(weights, dtype=np.float32)
    y = np.asarray(outputs, dtype=np.float32)
    t, k = w.shape
    if y.shape[:2] != (t, k) or y.ndim != 3:
        raise ValueError(f"moe combine: outputs {y.shape} must be [T, k, H] for weights {w.shape}")
    h = y.shape[2]
    terms = w.astype(np.float64)[:, :, None] * y.astype(np.float64)
    terms = np.where((w == 0)[:, :, None], 0.0, terms)
    rows = np.ascontiguousarray(terms.transpose(0, 2, 1)).reshape(t * h, k)  # one row per output element
    finite = np.isfinite(rows).all(axis=1)
    q, e = quantize_f64_rows(np.where(finite[:, None], rows, 0.0), COMBINE_BITS)
    out = fp.round_scaled(q.sum(axis=1), e - (COMBINE_BITS - 2))
    if not finite.all():
        bad = rows[~finite]
        has_pos, has_neg = (bad == np.inf).any(axis=1), (bad == -np.inf).any(axis=1)
        value = np.where(has_pos, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
        value[np.isnan(bad).any(axis=1) | (has_pos & has_neg)] = fp.CANONICAL_NAN
        out[~finite] = value
    return out.reshape(t, h)


def expert_outputs(h: np.ndarray, experts: np.ndarray, gate: list, up: list, down: list,
                   order: np.ndarray | None = None, group_rows: int | None = None) -> np.ndarray:
    """float32 [T, k, H]: y[t, j] = expert experts[t, j]'s SwiGLU MLP of h[t] (three exact gemms).

    The (token, slot) pairs are grouped by expert, each group's rows run as one product. order: a
    permutation of the T * k pairs applied before grouping; group_rows: cut each group into products
    of at most that many rows. Neither changes a bit (every gemm row is exact); the tests vary both."""
    h = np.asarray(h, dtype=np.float32)
    experts = np.asarray(experts)
    t, k = experts.shape
    out = np.zeros((t, k, h.shape[1]), dtype=np.float32)
    pairs = np.arange(t * k) if order is None else np.asarray(order)
    flat = experts.reshape(-1)[pairs]
    for expert in np.unique(flat):
        chosen = pairs[flat == expert]
        step = group_rows or max(chosen.size, 1)
        for start in range(0, chosen.size, step):
            part = chosen[start:start + step]
            x = h[part // k]
            g = exact.gemm(x, gate[expert], BITS_A, BITS_W)
            u = exact.gemm(x, up[expert], BITS_A, BITS_W)
            out[part // k, part % k] = exact.gemm(activation.swiglu(g, u), down[expert], BITS_A, BITS_W)
    return out


def moe_block(h: np.ndarray, router: np.ndarray, gate: list, up: list, down: list, top_k: int,
              norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out float32 [T, H], experts int32 [T, k], weights float32 [T, k]): the whole block.

    router [E, H]; gate[e], up[e] [I, H] and down[e] [H, I] per expert (lists or stacked arrays)."""
    experts, weights = route(router_logits(h, router), top_k, norm_topk_prob)
    return combine(weights, expert_outputs(h, experts, gate, up, down)), experts, weights
