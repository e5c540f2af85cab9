"""RoPE: the contract's frequency and angle tables, and their application (reference).

Executable form of contracts/rope.toml. Tables are computed once on the host
with the contract's own float64 functions (contract/float64_math.py), so every
host makes the same float32 tables; kernels only read them.

  inv_freq[j] = RNE_f32(theta^(-2j/D)), j < D/2, after Llama-3 frequency scaling
                when the config asks for it (computed in float64, rounded once);
  angle       = float64(pos) * float64(inv_freq[j])        (exact: 24 x 24 bits)
  cos[pos, j] = RNE_f32(cos64(angle)), sin likewise;
  y[i]        = RNE_f32(x[i] * cos[j] - x[i+D/2] * sin[j])   for i = j < D/2
  y[i+D/2]    = RNE_f32(x[i+D/2] * cos[j] + x[i] * sin[j])
              with the products exact in float64 and the sum rounded in float64,
              then once more to float32 (the "rotate half" layout of HF models).
  A NaN result (a NaN input, or inf * 0 and inf - inf) is the canonical NaN 0x7FC00000.
  apply_backward is the transpose rotation dx = R^T dy, rounded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract.fixedpoint import CANONICAL_NAN
from rlportable.contract.float64_math import exp64, log64, sincos64

TWO_PI = float.fromhex("0x1.921fb54442d18p+2")
MAX_POSITIONS = 2**20


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3Scaling | None = None) -> np.ndarray:
    """float32 [head_dim // 2]."""
    j = np.arange(head_dim // 2, dtype=np.float64)
    inv_freq = exp64(-(2.0 * j / head_dim) * log64(np.array(theta, dtype=np.float64)))
    if scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: Llama3Scaling) -> np.ndarray:
    """Llama 3.1 frequency scaling, the rule of HF's _compute_llama3_parameters, in float64."""
    old = float(s.original_max_position_embeddings)
    low_freq_wavelen = old / s.low_freq_factor
    high_freq_wavelen = old / s.high_freq_factor
    wavelen = TWO_PI / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1.0 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 [len(positions), D/2]; positions are integers in [0, 2^20).

    2^20 keeps every angle (inv_freq <= 1) inside sincos64's exact range reduction."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= MAX_POSITIONS):
        raise ValueError(f"RoPE positions must lie in [0, {MAX_POSITIONS})")
    angle = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    sin, cos = sincos64(angle)
    return cos.astype(np.float32), sin.astype(np.float32)


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x float32 [T, heads, D]; cos/sin float32 [T, D/2] (one row per token's position)."""
    half = x.shape[-1] // 2
    first = x[..., :half].astype(np.float64)
    second = x[..., half:].astype(np.float64)
    c = cos.astype(np.float64)[:, None, :]
    s = sin.astype(np.float64)[:, None, :]
    out = np.empty(x.shape, dtype=np.float32)
    out[..., :half] = (first * c - second * s).astype(np.float32)
    out[..., half:] = (second * c + first * s).astype(np.float32)
    out[np.isnan(out)] = CANONICAL_NAN
    return out


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def apply_backward(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """dx = R^T dy, the gradient of apply for the upstream dy [T, heads, D] (cos/sin [T, D/2] rows):
      dx[i]       = RNE_f32(dy[i] * cos[j] + dy[i+D/2] * sin[j])   for i = j < D/2
      dx[i+D/2]   = RNE_f32(dy[i+D/2] * cos[j] - dy[i] * sin[j])
    products exact in float64, the sum rounded in float64, then once to float32 (bitwise equal to
    apply(dy, cos, -sin): a - (-b) is a + b in IEEE arithmetic). NaN -> the canonical NaN."""
    half = dy.shape[-1] // 2
    first = dy[..., :half].astype(np.float64)
    second = dy[..., half:].astype(np.float64)
    c = cos.astype(np.float64)[:, None, :]
    s = sin.astype(np.float64)[:, None, :]
    out = np.empty(dy.shape, dtype=np.float32)
    out[..., :half] = (first * c + second * s).astype(np.float32)
    out[..., half:] = (second * c - first * s).astype(np.float32)
    out[np.isnan(out)] = CANONICAL_NAN
    return out
