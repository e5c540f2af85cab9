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

The backward (route_backward, combine_backward, moe_block_backward) holds the experts fixed (the
top-k choice is piecewise constant: no gradient through it): the softmax's gradient from the forward's
own p_e and D with one exact sum, the combine's with exact sums over the hidden axis, the experts'
through the gemm and SwiGLU backward rules of the dense layers, and d h as one exact sum of the 2k + 1
rows that reach it, rounded once. The load-balancing loss (transformers' aux loss, below) adds its router
logit gradient to route_backward's by one float32 addition; it is route_backward again, every expert chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract import activation, exact, fixedpoint as fp, residual
from rlportable.contract.exact import GEMM_K_CHUNK, WEIGHT_GRAD_BITS
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
    out = exact_sum_f32(np.ascontiguousarray(terms.transpose(0, 2, 1)).reshape(t * h, k))  # a row per element
    return out.reshape(t, h)


def expert_groups(experts: np.ndarray, order: np.ndarray | None = None, group_rows: int | None = None):
    """The (token, slot) pairs of experts [T, k] as flat indices t * k + j, grouped by expert: (expert,
    pairs) per product. order: a permutation of the pairs applied before grouping; group_rows: cut each
    group into products of at most that many rows (the tests vary both; no bit changes)."""
    t, k = experts.shape
    pairs = np.arange(t * k) if order is None else np.asarray(order)
    flat = experts.reshape(-1)[pairs]
    for expert in np.unique(flat):
        chosen = pairs[flat == expert]
        step = group_rows or max(chosen.size, 1)
        for start in range(0, chosen.size, step):
            yield expert, chosen[start:start + step]


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
    for expert, part in expert_groups(experts, order, group_rows):
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


# ---- the backward (contracts/moe.toml route_backward, combine_backward, block_backward)
# The top-k choice is piecewise constant in the logits: no gradient flows through which experts were
# chosen, only through the softmax weights of the chosen ones and through the experts' products.


@np.errstate(all="ignore")  # non-finite terms are defined below, not warnings
def _exact_row_sums(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total int64 [R], e int64 [R], special float32 [R], finite bool [R]) of float64 rows [R, n]: each
    finite row's terms on a 38-bit grid below its largest, total their exact int64 sum (the value
    total 2^(e - 36)); a row with a non-finite term has special: the canonical NaN (a NaN term, or both
    infinities) or that infinity."""
    finite = np.isfinite(rows).all(axis=1)
    q, e = quantize_f64_rows(np.where(finite[:, None], rows, 0.0), COMBINE_BITS)
    special = np.zeros(rows.shape[0], dtype=np.float32)
    if not finite.all():
        bad = rows[~finite]
        has_pos, has_neg = (bad == np.inf).any(axis=1), (bad == -np.inf).any(axis=1)
        value = np.where(has_pos, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
        value[np.isnan(bad).any(axis=1) | (has_pos & has_neg)] = fp.CANONICAL_NAN
        special[~finite] = value
    return q.sum(axis=1), e, special, finite


def exact_sum_f32(rows: np.ndarray) -> np.ndarray:
    """float32 [R]: each float64 row's terms summed exactly on the combine's grid, rounded once
    (fixedpoint.round_scaled); exact zero is +0; non-finite terms as combine's."""
    total, e, special, finite = _exact_row_sums(np.asarray(rows, dtype=np.float64))
    out = fp.round_scaled(total, e - (COMBINE_BITS - 2))
    out[~finite] = special[~finite]
    return out


def _exact_sum_f64(rows: np.ndarray) -> np.ndarray:
    """float64 [R]: the same exact grid sum, converted exactly (|sum| < k 2^37 < 2^53 for k < 2^16)."""
    total, e, special, finite = _exact_row_sums(np.asarray(rows, dtype=np.float64))
    out = total.astype(np.float64) * fp.pow2_f64(e - (COMBINE_BITS - 2))
    out[~finite] = special[~finite]
    return out


@np.errstate(all="ignore")
def route_backward(logits: np.ndarray, experts: np.ndarray, weights: np.ndarray, d_weights: np.ndarray,
                   norm_topk_prob: bool) -> np.ndarray:
    """float32 [T, E]: d/dz of sum_j d_weights[t, j] * weights[t, j] through route's softmax, the
    experts held fixed (the top-k choice has no gradient). With the forward's p_e and D:
      q_e   = float64(p_e) / (odd(D) 2^-36)   for every e (softmax over all E), or, with norm_topk_prob,
              for the chosen e only (q_e = 0 elsewhere: the renormalised weights do not see them)
      c     = sum_j float64(g_j) float64(w_j)  exact products on the combine's grid, one exact float64
      gsel_e = g_j where e = experts[t, j], else 0
      dz_e  = RNE_f32(q_e * (gsel_e - c))      IEEE float64 subtraction and product, one conversion
    An unchosen expert under norm_topk_prob gets +0. A row with g all zero gives +0 everywhere (even an
    undefined row); otherwise a non-finite g or an undefined row (route's NaN weights) gives the
    canonical NaN everywhere."""
    z = np.asarray(logits, dtype=np.float32)
    t, e = z.shape
    experts = np.asarray(experts).astype(np.int64)
    w = np.asarray(weights, dtype=np.float32).astype(np.float64)
    g = np.asarray(d_weights, dtype=np.float32).astype(np.float64)
    bad = undefined_rows(z)
    m = z.max(axis=1, keepdims=True, initial=-np.inf)
    p = exp_f32((z - np.where(bad[:, None], np.float32(0), m)).astype(np.float32)).astype(np.float64)
    terms = np.rint(p * 2.0 ** (SUM_BITS - 2)).astype(np.int64)
    rows = np.arange(t)[:, None]
    sums = terms[rows, experts].sum(axis=1) if norm_topk_prob else terms.sum(axis=1)
    sums = np.where(bad, 2 ** (SUM_BITS - 2), sums)
    denominator = fp.round_to_odd_f64(sums) * fp.pow2_f64(np.full(t, -(SUM_BITS - 2)))
    if norm_topk_prob:
        q = np.zeros((t, e))
        q[rows, experts] = p[rows, experts] / denominator[:, None]
    else:
        q = p / denominator[:, None]
    c = _exact_sum_f64(g * w) if t else np.zeros(0)
    selected = np.zeros((t, e))
    selected[rows, experts] = g
    out = (q * (selected - c[:, None])).astype(np.float32)
    if norm_topk_prob:
        chosen = np.zeros((t, e), dtype=bool)
        chosen[rows, experts] = True
        out[~chosen] = 0.0
    out[bad | ~np.isfinite(g).all(axis=1) | np.isnan(out).any(axis=1)] = fp.CANONICAL_NAN
    out[(g == 0).all(axis=1)] = 0.0
    return out


@np.errstate(all="ignore")
def combine_backward(d_out: np.ndarray, weights: np.ndarray, outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d_weights float32 [T, k], d_outputs float32 [T, k, H]) of out = combine(weights, outputs):
      d_weights[t, j]     = sum_h float64(d_out[t, h]) float64(y_j[h])   exact products, combine's grid,
                                                                          one rounding
      d_outputs[t, j, h]  = RNE_f32(float64(w_j) float64(d_out[t, h]))  one rounding
    A slot with w_j = 0 is removed from the forward whatever y_j, so both its gradients are +0."""
    g = np.asarray(d_out, dtype=np.float32)
    w = np.asarray(weights, dtype=np.float32)
    y = np.asarray(outputs, dtype=np.float32)
    t, k = w.shape
    h = g.shape[1] if g.ndim == 2 else 0
    if g.shape != (t, h) or y.shape != (t, k, h):
        raise ValueError(f"moe combine_backward: d_out {g.shape}, weights {w.shape} and outputs {y.shape} "
                         "must be [T, H], [T, k], [T, k, H]")
    products = g.astype(np.float64)[:, None, :] * y.astype(np.float64)
    d_weights = exact_sum_f32(products.reshape(t * k, h)).reshape(t, k) if h else np.zeros((t, k), np.float32)
    d_outputs = (w.astype(np.float64)[:, :, None] * g.astype(np.float64)[:, None, :]).astype(np.float32)
    d_outputs[np.isnan(d_outputs)] = fp.CANONICAL_NAN
    removed = w == 0
    d_weights[removed] = 0.0
    d_outputs[removed] = 0.0
    return d_weights, d_outputs


def input_grad(dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dX = dY W for y = x W^T (W [N, K]): the gemm of dY's rows (23 bits) with W^T's rows (15 bits),
    N cut into GEMM_K_CHUNK columns whose float32 products are added in order (model/backward.py's)."""
    dy = np.asarray(dy, dtype=np.float32)
    w_t = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)
    n = dy.shape[1]
    total = None
    for start in range(0, max(n, 1), GEMM_K_CHUNK):
        part = exact.gemm(dy[:, start:start + GEMM_K_CHUNK], w_t[:, start:start + GEMM_K_CHUNK], BITS_A, BITS_W)
        total = part if total is None else residual.add(total, part)
    return total


def weight_grad(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dW = dY^T X [N, K] over M rows: dY^T's rows at 23 bits, X^T's at 15, the row axis cut into
    GEMM_K_CHUNK chunks (in the rows' order) whose float32 products are added in order."""
    dy = np.asarray(dy, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32)
    m = dy.shape[0]
    if m == 0:
        return np.zeros((dy.shape[1], x.shape[1]), dtype=np.float32)
    total = None
    for start in range(0, m, GEMM_K_CHUNK):
        part = exact.gemm(np.ascontiguousarray(dy[start:start + GEMM_K_CHUNK].T),
                          np.ascontiguousarray(x[start:start + GEMM_K_CHUNK].T), BITS_A, WEIGHT_GRAD_BITS)
        total = part if total is None else residual.add(total, part)
    return total


@dataclass
class BlockGradients:
    """The block's gradients: d_h [T, H], d_router [E, H], per expert d_gate, d_up [I, H] and d_down [H, I]
    (zeros for an expert no token chose), and the intermediate d_logits [T, E] and d_weights [T, k]."""

    d_h: np.ndarray
    d_router: np.ndarray
    d_gate: list
    d_up: list
    d_down: list
    d_logits: np.ndarray
    d_weights: np.ndarray
    experts: np.ndarray
    logits: np.ndarray | None = None  # the recomputed router logits z [T, E] (the load-balancing loss's value)


def moe_block_backward(h: np.ndarray, router: np.ndarray, gate: list, up: list, down: list, top_k: int,
                       norm_topk_prob: bool, d_out: np.ndarray, order: np.ndarray | None = None,
                       group_rows: int | None = None, aux: np.ndarray | None = None) -> BlockGradients:
    """The block's backward for the upstream d_out [T, H], from the forward recomputed (the same bits):
      d_weights, d_y = combine_backward(d_out, weights, y)
      d_logits       = route_backward(z, experts, weights, d_weights)
                       with aux (the load-balancing loss's coefficients, float32 [E]): one float32 addition
                       of load_balancing_backward(z, aux) to it (residual.add), before anything reads d_logits
      d_router       = weight_grad(d_logits, h)                   every token, in token order
      per pair (t, j), e = experts[t, j]:  a = swiglu(g, u) with g, u the forward's gemms of h_t,
        d_a = input_grad(d_y[t, j], D_e);  d_g, d_u = swiglu_backward(g, u, d_a)
      per expert e, its pairs in ascending token order:
        d_down_e = weight_grad(d_y, a);  d_gate_e = weight_grad(d_g, h);  d_up_e = weight_grad(d_u, h)
      d_h[t] = one exact sum (combine's grid, one rounding) of the 2k + 1 float32 rows
               input_grad(d_logits, W_r)[t], input_grad(d_g, G_e)[t] and input_grad(d_u, U_e)[t] per slot
    Every per-row product is row-independent and d_h is an integer sum, so a token's d_h and d_logits do
    not depend on the batch, the token order, or how the pairs are grouped and cut into products
    (order, group_rows: as expert_outputs'). The weight gradients are sums over tokens: exact within a
    GEMM_K_CHUNK chunk of an expert's tokens, so any token order gives their bits while an expert has at
    most GEMM_K_CHUNK tokens (beyond, the chunks follow token order, as the dense layers' do)."""
    h = np.asarray(h, dtype=np.float32)
    d_out = np.asarray(d_out, dtype=np.float32)
    t, hidden = h.shape
    z = router_logits(h, router)
    experts, weights = route(z, top_k, norm_topk_prob)
    y = expert_outputs(h, experts, gate, up, down, order=order, group_rows=group_rows)
    d_weights, d_y = combine_backward(d_out, weights, y)
    d_logits = route_backward(z, experts, weights, d_weights, norm_topk_prob)
    if aux is not None:
        d_logits = residual.add(d_logits, load_balancing_backward(z, aux))
    d_router = weight_grad(d_logits, h)
    k = top_k
    inner = np.asarray(gate[0]).shape[0]
    act = np.zeros((t, k, inner), np.float32)
    d_g = np.zeros((t, k, inner), np.float32)
    d_u = np.zeros((t, k, inner), np.float32)
    dx = np.zeros((t, 2 * k + 1, hidden), np.float32)
    dx[:, 2 * k] = input_grad(d_logits, router) if t else 0.0
    for expert, part in expert_groups(experts, order, group_rows):
        rows, slots = part // k, part % k
        x = h[rows]
        g = exact.gemm(x, gate[expert], BITS_A, BITS_W)
        u = exact.gemm(x, up[expert], BITS_A, BITS_W)
        act[rows, slots] = activation.swiglu(g, u)
        d_a = input_grad(d_y[rows, slots], down[expert])
        d_g[rows, slots], d_u[rows, slots] = activation.swiglu_backward(g, u, d_a)
        dx[rows, 2 * slots] = input_grad(d_g[rows, slots], gate[expert])
        dx[rows, 2 * slots + 1] = input_grad(d_u[rows, slots], up[expert])
    d_gate, d_up, d_down = [], [], []
    every = experts.reshape(-1)
    for expert in range(len(gate)):
        mine = np.flatnonzero(every == expert)  # ascending pair index: ascending token order
        rows, slots = mine // k, mine % k
        d_down.append(weight_grad(d_y[rows, slots], act[rows, slots]))
        d_gate.append(weight_grad(d_g[rows, slots], h[rows]))
        d_up.append(weight_grad(d_u[rows, slots], h[rows]))
    terms = np.ascontiguousarray(dx.transpose(0, 2, 1)).reshape(t * hidden, 2 * k + 1)
    d_h = exact_sum_f32(terms).reshape(t, hidden) if t else np.zeros((0, hidden), np.float32)
    return BlockGradients(d_h, d_router, d_gate, d_up, d_down, d_logits, d_weights, experts, z)


# ---- the load-balancing loss (transformers' load_balancing_loss_func, Switch Transformer's)
# Over one forward's N = T x (sparse layers) router rows: aux = E sum_e f_e P_e, f_e = c_e / N with c_e the
# (row, slot) selections of expert e, P_e = sum_rows p_{row,e} / N with p the softmax over all E. The counts
# are constants (no gradient through the choice), so d aux / d p_{row,e} = E c_e / N^2, one value per expert
# for every row: a softmax backward with a constant upstream per expert, which is route_backward with all
# E experts chosen (norm_topk_prob off). No new rule: the existing op's exact sums give every backend's bits.


def load_balancing_coefficients(experts: list, num_experts: int, scale: float) -> np.ndarray:
    """float32 [E]: g_e = RNE_f32(scale E c_e / N^2) in float64, d (scale aux) / d p_{row,e} for every row.
    experts: each sparse layer's choices int32 [T, k] of one forward (N = T x layers); scale: the loss's
    weight of aux (router_aux_loss_coef over the step's micro-batches)."""
    counts = np.zeros(num_experts, dtype=np.int64)
    rows = 0
    for layer in experts:
        layer = np.asarray(layer)
        counts += np.bincount(layer.reshape(-1).astype(np.int64), minlength=num_experts)
        rows += layer.shape[0]
    if rows == 0:
        return np.zeros(num_experts, dtype=np.float32)
    return (float(scale) * num_experts * counts.astype(np.float64) / (float(rows) * float(rows))).astype(np.float32)


def load_balancing_backward(logits: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """float32 [T, E]: d/dz of sum_e coefficients[e] softmax(z)_e per row, as route_backward with every expert
    chosen: (experts, w) = route(z, E, false), g_j = coefficients[experts[j]], so dz_e = RNE_f32(q_e (g_e - c))
    with c = sum_e g_e w_e one exact sum (the slots' order cannot change a bit)."""
    z = np.asarray(logits, dtype=np.float32)
    experts, weights = route(z, z.shape[1], False)
    d_weights = np.asarray(coefficients, dtype=np.float32)[experts]
    return route_backward(z, experts, weights, d_weights, False)


@np.errstate(all="ignore")
def router_probability_sums(logits: np.ndarray) -> np.ndarray:
    """float64 [E]: sum over rows of the float64 softmax of each row of z [T, E] (for the loss's value only)."""
    z = np.asarray(logits, dtype=np.float64)
    if z.shape[0] == 0:
        return np.zeros(z.shape[1])
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)).sum(axis=0)


def load_balancing_loss(experts: list, probability_sums: np.ndarray) -> float:
    """aux = E sum_e (c_e / N) (P_e / N) in float64, from each sparse layer's choices and the sum over layers
    of router_probability_sums."""
    sums = np.asarray(probability_sums, dtype=np.float64)
    counts = np.zeros(sums.size)
    rows = 0
    for layer in experts:
        layer = np.asarray(layer)
        counts += np.bincount(layer.reshape(-1).astype(np.int64), minlength=sums.size)
        rows += layer.shape[0]
    return float(sums.size * np.sum(counts / rows * (sums / rows))) if rows else 0.0
