"""AdamW with fp32 master weights, exact global-norm clipping and a warmup + cosine schedule:
the NumPy reference of contracts/adamw.toml (kernels: backends/portable/adamw.hip).

Everything here is IEEE-754 binary32/binary64 add, subtract, multiply, divide, sqrt and
conversions with round-to-nearest-even, exact integer arithmetic, and the contract's own
float64 cos (float64_math.sincos64). No libm, no fma.

1. Global gradient norm (clip_factor), exact
   * e = ilogb of the largest |g| over ALL gradient elements of ALL tensors (an exact
     integer max of the float32 magnitude bits; -149 if every element is 0 or there are none).
   * q = RNE(g * 2^(B-2-e)) with B = NORM_BITS = 23 (the fixed-point encoding of
     contracts/fixedpoint.toml with the global exponent), clamped to +-(2^22 - 1).
     Elements below 2^(e-22) in magnitude round into the grid.
   * S = sum q^2 over every element: exact. q^2 < 2^44, so a chunk of NORM_CHUNK = 2^18
     elements sums below 2^62 in int64; the chunks' sums (one per chunk of each tensor, the
     kernel's output) are added in Python ints (unbounded, exact, any order).
   * norm = sqrt(float64(S) * 2^(2(e-21))): float64(S) is one RNE conversion of the Python int,
     the power of two is exact (2(e-21) in [-340, 212], S >= 1 keeps the product normal), sqrt is
     IEEE. |norm - ||g||_2| <= sqrt(N) * 2^(e-22) (N elements), i.e. a relative error of at most
     sqrt(N) * 2^-22 of the true norm.
   * Non-finite gradients: any NaN -> norm = NaN; otherwise any +-inf -> norm = +inf.
   * clip factor, torch.nn.utils.clip_grad_norm_'s formula in float64:
       coef = max_norm / (norm + 1e-6);  c = coef if not (coef > 1.0) else 1.0
     (torch.clamp(coef, max=1.0): NaN stays NaN, so a NaN norm makes every update NaN;
     an infinite norm gives c = 0).

2. Update (adamw_update), per element, in float64, one rounding per stored value.
   Host scalars (float64, computed once per step by `hyper_scalars`, passed to the kernels as
   they are, so both vendors use the host's bits):
       bc1 = 1 - beta1^t, bc2 = 1 - beta2^t      (powers by `power`: exponentiation by squaring)
       step_size = lr / bc1;  sqrt_bc2 = sqrt(bc2);  decay = 1 - lr * wd
       one_minus_beta1 = 1 - beta1;  one_minus_beta2 = 1 - beta2
   With p, m, v, g float32 (widened exactly) and c the clip factor (float64):
       g'  = g * c
       m'  = RNE_f32(beta1 * m + one_minus_beta1 * g')
       v'  = RNE_f32(beta2 * v + one_minus_beta2 * (g' * g'))
       p1  = p * decay                                      (torch: param.mul_(1 - lr*wd) first)
       d   = sqrt(float64(v')) / sqrt_bc2 + eps             (torch: exp_avg_sq.sqrt()/bc2_sqrt + eps)
       p'  = RNE_f32(p1 - step_size * (float64(m') / d))    (torch: param.addcdiv_(m, d, -step_size))
   This is torch.optim.AdamW's (foreach=False, amsgrad=False, maximize=False) order of
   operations, evaluated in float64 with the intermediate p1 and d not rounded to float32, and
   with m' and v' read back as the float32 values that are stored (as torch reads its state).
   torch's m update is lerp(m, g, 1 - beta1); the contract writes it as the equal-in-exact-
   arithmetic beta1*m + (1-beta1)*g'. A NaN result is stored as the canonical NaN 0x7FC00000.

3. Schedule (lr_at): float64, step t = 1, 2, ... (the t of the update that uses it):
       t <= warmup:  lr = peak * (t / warmup)
       otherwise:    progress = min(1, (t - warmup) / max(1, total - warmup))
                     lr = min_lr + (peak - min_lr) * (0.5 * (1 + cos(PI * progress)))
   with cos = float64_math.sincos64 and PI the float64 nearest pi.

4. Gradient accumulation is the caller's: the gradients given here are the sum (or mean) of the
   micro-batch gradients, and that sum must itself be exact (fixed-point, order-free) for the
   update to be bitwise reproducible; the trainer is responsible for it, not this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.contract.float64_math import sincos64

NORM_BITS = 23
NORM_CHUNK = 1 << 18  # q^2 < 2^44, 2^18 of them < 2^62
NORM_EPS = 1e-6
PI = float.fromhex("0x1.921fb54442d18p+1")
CANONICAL_NAN = fp.CANONICAL_NAN


def power(base: float, t: int) -> float:
    """base^t in float64 by exponentiation by squaring, low bit first:
    result = 1; while t: (if t & 1: result *= base); base *= base; t >>= 1."""
    result, base, t = 1.0, float(base), int(t)
    if t < 0:
        raise ValueError("power: negative exponent")
    while t:
        if t & 1:
            result = result * base
        base = base * base
        t >>= 1
    return result


def lr_at(step: int, peak: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    """The warmup + cosine schedule (module docstring, section 3)."""
    t, warmup, total = int(step), int(warmup), int(total)
    peak, min_lr = float(peak), float(min_lr)
    if t <= warmup:
        return peak * (float(t) / float(warmup)) if warmup > 0 else peak
    progress = min(1.0, float(t - warmup) / float(max(1, total - warmup)))
    _, cos = sincos64(np.array([PI * progress]))
    return min_lr + (peak - min_lr) * (0.5 * (1.0 + float(cos[0])))


@dataclass(frozen=True)
class Hyper:
    """AdamW hyper-parameters (the lr of a step comes from the schedule or is given directly)."""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_norm: float | None = 1.0  # None: no clipping (c = 1)


def hyper_scalars(hyper: Hyper, step: int, lr: float | None = None) -> dict:
    """The float64 scalars of one step, computed on the host (module docstring, section 2)."""
    if int(step) < 1:
        raise ValueError("AdamW steps count from 1")
    lr = float(hyper.lr if lr is None else lr)
    beta1, beta2 = float(hyper.beta1), float(hyper.beta2)
    bc1 = 1.0 - power(beta1, step)
    bc2 = 1.0 - power(beta2, step)
    return {
        "beta1": beta1, "one_minus_beta1": 1.0 - beta1,
        "beta2": beta2, "one_minus_beta2": 1.0 - beta2,
        "decay": 1.0 - lr * float(hyper.weight_decay),
        "step_size": lr / bc1,
        "sqrt_bc2": math.sqrt(bc2),  # IEEE sqrt
        "eps": float(hyper.eps),
    }


# ---- 1. the exact global norm

def max_magnitude_bits(grads) -> int:
    """Largest float32 magnitude bits over every element (0 when there are none)."""
    largest = 0
    for g in grads:
        g = np.asarray(g, dtype=np.float32).reshape(-1)
        if g.size:
            largest = max(largest, int((g.view(np.uint32) & np.uint32(0x7FFFFFFF)).max()))
    return largest


def exponent_of(largest_bits: int) -> int:
    """ilogb of the largest magnitude (fixedpoint.row_exponents for one value)."""
    return int(fp.row_exponents(np.array([[np.uint32(largest_bits).view(np.float32)]]))[0])


def chunk_sums(g: np.ndarray, e: int) -> np.ndarray:
    """int64 sum of q^2 over each NORM_CHUNK-element chunk of one flat tensor (the kernel's output)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    chunks = -(-g.size // NORM_CHUNK)
    scaled = g.astype(np.float64) * float(fp.pow2_f64(np.int64(NORM_BITS - 2 - e)))
    limit = float(2 ** (NORM_BITS - 1) - 1)
    q = np.clip(np.rint(scaled), -limit, limit).astype(np.int64)
    out = np.zeros(chunks, dtype=np.int64)
    for c in range(chunks):
        part = q[c * NORM_CHUNK:(c + 1) * NORM_CHUNK]
        out[c] = int(np.dot(part, part))  # < 2^62: exact in int64
    return out


def norm_from_parts(largest_bits: int, total: int) -> float:
    """norm = sqrt(float64(S) * 2^(2(e-21))), with the non-finite cases of section 1."""
    if largest_bits > 0x7F800000:
        return math.nan
    if largest_bits == 0x7F800000:
        return math.inf
    e = exponent_of(largest_bits)
    return math.sqrt(float(int(total)) * float(fp.pow2_f64(np.int64(2 * (e - (NORM_BITS - 2))))))


def clip_from_norm(norm: float, max_norm: float | None) -> float:
    if max_norm is None:
        return 1.0
    coef = float(max_norm) / (norm + NORM_EPS)
    return 1.0 if coef > 1.0 else coef  # NaN stays NaN (torch.clamp)


def global_norm(grads) -> float:
    largest = max_magnitude_bits(grads)
    if largest >= 0x7F800000:
        return norm_from_parts(largest, 0)
    e = exponent_of(largest)
    total = sum(int(s) for g in grads for s in chunk_sums(g, e))
    return norm_from_parts(largest, total)


def clip_factor(grads, max_norm: float | None) -> float:
    """c = min(1, max_norm / (norm + 1e-6)) as torch's clip_grad_norm_, in float64."""
    return clip_from_norm(global_norm(grads), max_norm)


# ---- 2. the update

def _f32(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32)
    y[np.isnan(y)] = CANONICAL_NAN
    return y


def adamw_update(p, g, m, v, c: float, s: dict):
    """One AdamW update of flat float32 arrays; returns new (p, m, v) float32 arrays."""
    p64, g64 = np.asarray(p, np.float32).astype(np.float64), np.asarray(g, np.float32).astype(np.float64)
    m64, v64 = np.asarray(m, np.float32).astype(np.float64), np.asarray(v, np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        gc = g64 * float(c)
        m_new = _f32(s["beta1"] * m64 + s["one_minus_beta1"] * gc)
        v_new = _f32(s["beta2"] * v64 + s["one_minus_beta2"] * (gc * gc))
        p1 = p64 * s["decay"]
        d = np.sqrt(v_new.astype(np.float64)) / s["sqrt_bc2"] + s["eps"]
        p_new = _f32(p1 - s["step_size"] * (m_new.astype(np.float64) / d))
    return p_new, m_new, v_new


def adamw_step(params, grads, m, v, step: int, hyper: Hyper, lr: float | None = None):
    """The whole step: exact clip factor over all grads, then the update of every tensor.
    Returns (new_params, new_m, new_v) lists (float32, the input shapes); inputs are untouched."""
    c = clip_factor(grads, hyper.max_norm)
    s = hyper_scalars(hyper, step, lr)
    out_p, out_m, out_v = [], [], []
    for pi, gi, mi, vi in zip(params, grads, m, v):
        shape = np.shape(pi)
        a, b, d = adamw_update(np.ravel(pi), np.ravel(gi), np.ravel(mi), np.ravel(vi), c, s)
        out_p.append(a.reshape(shape)); out_m.append(b.reshape(shape)); out_v.append(d.reshape(shape))
    return out_p, out_m, out_v
