"""Accuracy of the attention backward's coefficient rule (contracts/attention.toml, coef_bits), on the CPU.

    PYTHONPATH=. python3 scripts/measure_attention_backward_bits.py [bits ...] > result.json

The contract's weighted sums (dq, dk, dv) quantize their coefficients by block: aligned blocks of
BLOCK = 64 sequence positions (dq_t: keys j in [64b, 64b + 64); dk_j, dv_j: queries t in [64b, 64b + 64)
of one q head), each block's coefficients to COEF_BITS = 15 bits below the largest of that block, each
block's exact integer partial scaled into float64 and the partials added in float64 in ascending (query
block, head) order, one rounding to float32. Measured:
  * models: for each COEF_BITS of the block rule (default 15 16 14 12; reference.COEF_BITS set to it),
    the gradients of the three random-weight model tests (test_model_backward: Qwen3, Qwen2, Llama
    shapes, two packed sequences of 17 and 23 tokens) against float64 torch autograd: the worst relative
    L2 error over the weight tensors, beside bf16 autograd's worst (the contract's rule: at most 1/10 of it);
  * attention alone, T = 256 ... 16384: one sequence of T tokens (2 q heads, 1 kv head, head_dim 128),
    q scaled so the softmax is peaky as in trained models (score spread ~ 4), against float64 autograd of
    the same (encoded) inputs, beside torch's bf16 attention backward on the same inputs: the block rule
    at 15 bits (the contract), 16 and 12, and for comparison the flat rule at 32 bits (one exponent per
    whole sum, the exact sum rounded once), all by a chunked function whose memory is linear in T
    (attention_backward_chunked); where the reference's own backward runs (T <= 4096), its bits at each
    COEF_BITS of the block rule (the contract's first) are compared with the chunked function's
    (chunked_equals_reference).
Prints JSON.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from rlportable.contract import attention as reference  # noqa: E402
from rlportable.contract import fixedpoint as fp  # noqa: E402
from rlportable.model import backward  # noqa: E402
from rlportable.model.forward import Model  # noqa: E402
from rlportable.runtime import get_backend  # noqa: E402
from test_model_backward import _rel_error, gradient_case, torch_gradients  # noqa: E402
from test_model_forward import hf_model_and_ours  # noqa: E402

CONTRACT_BITS = reference.COEF_BITS  # read before any measurement changes it
BITS = [int(b) for b in sys.argv[1:]] or [CONTRACT_BITS, 16, 14, 12]
CPU = get_backend("cpu")
BLOCK = reference.BLOCK  # sequence positions per coefficient block (one E per output row, block and head)
BLOCK_BITS = [CONTRACT_BITS, 16, 12]  # 15: two int8 digits
FLAT_BITS = 32  # the flat rule's bits (one E per whole sum) for the comparison
LENGTHS = (256, 1024, 4096, 16384)
WHOLE_MAX = 4096  # longer sequences: no reference backward (its [T, T] arrays), autograd head by head /
#                   in query chunks (memory), see attention_grads


def model_errors(bits_list):
    """{arch: {"bf16": worst, bits: worst, "ratio_to_bf16": {bits: ratio}}} over the weight tensors of the
    model test."""
    out = {}
    for arch in ("qwen3", "qwen2", "llama"):
        with tempfile.TemporaryDirectory() as tmp:
            hf, (rl_config, weights, _) = hf_model_and_ours(arch, Path(tmp))
            tokens, cu, rows, g = gradient_case(hf.config.vocab_size)
            exact, bf16 = torch_gradients(hf, tokens, cu, rows, g)
            row = {"bf16": max(_rel_error(bf16[n], r) for n, r in exact.items())}
            for bits in bits_list:
                reference.COEF_BITS = bits  # read at call time by the cpu backend's backward
                model = Model(CPU, rl_config, weights, trainable=True)
                fwd = backward.forward(model, tokens, cu, rows=rows)
                grads = backward.backward(model, fwd, g).named_tensors(rl_config)
                row[str(bits)] = max(_rel_error(grads[n], r) for n, r in exact.items())
            reference.COEF_BITS = CONTRACT_BITS
            row["ratio_to_bf16"] = {str(bits): row[str(bits)] / row["bf16"] for bits in bits_list}
            out[arch] = row
    return out


def attention_f64(q, k, v, do, dtype):
    """torch autograd of causal GQA attention (one sequence) in dtype; returns dq, dk, dv float64."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    tq, tk, tv = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    kk, vv = (x.repeat_interleave(group, dim=1) for x in (tk, tv))
    scores = torch.einsum("thd,jhd->htj", tq, kk).float() if dtype == torch.bfloat16 else \
        torch.einsum("thd,jhd->htj", tq, kk)
    scores = scores / np.sqrt(d)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(dtype)
    out = torch.einsum("htj,jhd->thd", probs, vv)
    out.backward(torch.tensor(do, dtype=dtype))
    return [x.grad.double().numpy() for x in (tq, tk, tv)]


def encoded(x, bits):
    """The row-encoded values the contract computes with (so the float64 peer sees the same inputs)."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    e = np.floor(np.log2(np.abs(rows).max(axis=1)))
    unit = 2.0 ** (bits - 2 - e)[:, None]
    return (np.rint(rows * unit) / unit).reshape(x.shape).astype(np.float32)


def attention_f64_long(q, k, v, do, dtype, rows=1024):
    """attention_f64 for sequences too long for its whole [H, T, T] arrays. float64: query rows in chunks
    and one head at a time (a row's output depends on its own row only; dk, dv add the chunks' float64
    gradients). bf16: one head at a time (dk, dv add the heads' bf16 gradients in float32 and round to
    bf16 once, as torch's sum over the repeated kv head does)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if dtype == torch.bfloat16:
        per_head = [attention_f64(q[:, h:h + 1], k[:, h // group:h // group + 1], v[:, h // group:h // group + 1],
                                  do[:, h:h + 1], dtype) for h in range(hq)]
        dq = np.concatenate([x[0] for x in per_head], axis=1)
        kv = [np.concatenate([sum(per_head[h][i].astype(np.float32) for h in range(g * group, (g + 1) * group))
                              for g in range(hkv)], axis=1) for i in (1, 2)]
        return [dq] + [torch.tensor(x).bfloat16().double().numpy() for x in kv]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for h in range(hq):
        g = h // group
        for start in range(0, t, rows):
            end = min(start + rows, t)
            tq = torch.tensor(q[start:end, h], dtype=dtype, requires_grad=True)
            tk, tv = (torch.tensor(x[:end, g], dtype=dtype, requires_grad=True) for x in (k, v))
            scores = (tq @ tk.T) / np.sqrt(d)
            mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            (probs @ tv).backward(torch.tensor(do[start:end, h], dtype=dtype))
            dq[start:end, h] = tq.grad.numpy()
            dk[:end, g] += tk.grad.numpy()
            dv[:end, g] += tv.grad.numpy()
    return [dq, dk, dv]


def attention_grads(q, k, v, do, dtype):
    return (attention_f64 if q.shape[0] <= WHOLE_MAX else attention_f64_long)(q, k, v, do, dtype)


# ---- the contract's block rule and the flat rule, by query chunks
#
# P and dS are the reference's own float64 values (reference._head_gradient_terms on a chunk of query
# rows against their keys: a row's P and dS depend on its own row and keys only), so the rules differ
# only in how the coefficients are quantized and summed, and the block rule at COEF_BITS = bits gives
# the reference's bits.

DIGIT_BITS = 11  # a flat coefficient (up to 33 bits) as 3 digits, each digit's product exact in float64


def quantize_last_axis(u, bits):
    """reference.quantize_block at COEF_BITS = bits: one E per entry of u's leading axes, over its last
    axis (U = RNE(u 2^(bits-2-E)) as float64 integers, E int64), E from the largest exponent field, 0 if
    all 0."""
    fields = reference.exponent_fields(u).max(axis=-1, initial=0)
    e = np.where(fields > 0, fields - 1023, 0)
    return np.rint(u * fp.pow2_f64(bits - 2 - e)[..., None]), e


def digit_sums(big_u, rows):
    """The exact sum big_u @ rows (big_u [..., N, n] float64 integers, |U| <= 2^32; rows [..., n, D]
    integers, |r| <= 2^22) as 3 int64 arrays [..., N, D] of digit sums, U = d0 + d1 2^11 + d2 2^22 (d0, d1
    in [0, 2^11)): each digit's float64 product is exact while 2^11 2^22 n < 2^53."""
    assert 2.0**DIGIT_BITS * 2.0**22 * big_u.shape[-1] < 2.0**53
    rest = big_u.astype(np.int64)
    out = []
    for i in range(3):
        digit = rest & (2**DIGIT_BITS - 1) if i < 2 else rest
        rest = rest >> DIGIT_BITS
        out.append((digit.astype(np.float64) @ rows).astype(np.int64))
    return out


def round_digit_sums(sums, scale_exponent):
    """RNE_f32((s0 + s1 2^11 + s2 2^22) 2^scale_exponent) with one rounding: the exact sum as H 2^32 + l
    (0 <= l < 2^32; H 2^32 and l exact in float64), rounded to odd at 53 bits (an exact TwoSum, then one
    step toward the error where the nearest is even), scaled exactly, converted to float32 once (round to
    odd at 53 bits, then to nearest at 24, is the one rounding)."""
    high, low = np.zeros_like(sums[0]), np.zeros_like(sums[0])
    for i, s in enumerate(sums):
        shift = DIGIT_BITS * i  # s 2^shift = (s >> (32 - shift)) 2^32 + (s's low 32 - shift bits) 2^shift
        low = low + ((s & ((1 << (32 - shift)) - 1)) << shift)
        high = high + (s >> (32 - shift))
    high, low = high + (low >> 32), low & ((1 << 32) - 1)
    a, b = high.astype(np.float64) * 2.0**32, low.astype(np.float64)
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    raw = s.view(np.int64).copy()
    step = (err != 0) & ((raw & 1) == 0)
    away = (err > 0) == (s > 0)  # the exact sum is larger in magnitude than s
    raw = np.where(step, raw + np.where(away, 1, -1), raw)
    return (raw.view(np.float64) * fp.pow2_f64(scale_exponent)).astype(np.float32)


def _chunks(enc, g, group, length, rows_per_chunk, scale):
    """(rows, P, dS [G, R, end]) of kv head g's q heads, query rows in aligned chunks, against keys 0..end-1."""
    heads = range(g * group, (g + 1) * group)
    for start in range(0, length, rows_per_chunk):
        end = min(start + rows_per_chunk, length)
        rows = slice(start, end)
        sub = {name: (x[rows] if name in ("qq", "eq", "qdo", "edo", "o") else x[:end]) for name, x in enc.items()}
        allowed = np.arange(end)[None, :] <= np.arange(start, end)[:, None]
        terms = [reference._head_gradient_terms(sub, h, g, allowed, scale) for h in heads]
        assert not any(poisoned.any() for _, _, poisoned in terms)  # finite inputs only
        yield rows, np.stack([p for p, _, _ in terms]), np.stack([d for _, d, _ in terms])


def attention_backward_chunked(q, k, v, do, block_bits, flat_bits, rows_per_chunk=256):
    """dq, dk, dv of one causal sequence (q, do [T, Hq, D]; k, v [T, Hkv, D] float32, T a multiple of BLOCK)
    by the block rule at each of block_bits (the reference's attention_backward at COEF_BITS = bits) and by
    the flat rule at each of flat_bits (one E per output row over its whole sum, the exact sum rounded
    once). Returns {("block" or "flat", bits): (dq, dk, dv)}.

    Memory stays linear in T (chunks of query rows). A chunk holds whole query blocks and the chunks come
    in ascending order, so dk and dv add their blocks in the reference's (query block, head) order. Flat dk
    and dv need each column's largest coefficient over all queries first: a second pass recomputes P and
    dS for them."""
    length, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    assert length % BLOCK == 0 and rows_per_chunk % BLOCK == 0
    enc = {"o": reference.attention_packed_batched(q, k, v, np.array([0, length]))}
    for name, x, bits in (("q", q, reference.Q_BITS), ("k", k, reference.K_BITS), ("v", v, reference.V_BITS),
                          ("do", do, reference.DO_BITS)):
        enc["q" + name], enc["e" + name] = reference.encode_heads(x, bits)
    scale = 1.0 / np.sqrt(np.float64(dim))
    q_row, k_row = reference.Q_BITS - 2, reference.K_BITS - 2  # do's rows have q's 23 bits
    for bits in block_bits:  # every block's integer partial (BLOCK terms) must be exact in float64
        assert BLOCK * 2.0 ** (bits - 1) * 2.0 ** (q_row + 1) < 2.0**53, bits
    assert all(bits <= 3 * DIGIT_BITS for bits in flat_bits)  # 3 digits (digit_sums)
    out = {var: tuple(np.empty(x.shape, np.float32) for x in (q, k, v))
           for var in [("block", b) for b in block_bits] + [("flat", b) for b in flat_bits]}
    for g in range(hkv):
        heads = slice(g * group, (g + 1) * group)
        row_q, row_do = np.moveaxis(enc["qq"][:, heads], 1, 0), np.moveaxis(enc["qdo"][:, heads], 1, 0)  # [G, T, D]
        scale_q, scale_do = (fp.pow2_f64(np.moveaxis(enc[e][:, heads], 1, 0))[..., None] for e in ("eq", "edo"))
        scale_k = fp.pow2_f64(enc["ek"][:, g])
        wide = {bits: (np.zeros((length, dim)), np.zeros((length, dim))) for bits in block_bits}  # float64 sums
        fields = [np.zeros(length, np.int64), np.zeros(length, np.int64)]  # flat dk, dv: largest exponent fields
        for rows, big_p, d_s in _chunks(enc, g, group, length, rows_per_chunk, scale):
            end, count = rows.stop, (rows.stop - rows.start) // BLOCK
            u_dq = d_s * scale_k[:end]  # [G, R, end]
            u_kv = (d_s * scale_q[:, rows], big_p * scale_do[:, rows])
            for i, u in enumerate(u_kv):
                fields[i][:end] = np.maximum(fields[i][:end], reference.exponent_fields(u).max(axis=(0, 1)))
            for bits in flat_bits:  # flat dq: dq_t's whole sum is in this chunk
                big_u, e = quantize_last_axis(u_dq, bits)
                dq = round_digit_sums(digit_sums(big_u, enc["qk"][:end, g]), (e - (bits - 2) - k_row)[..., None])
                out["flat", bits][0][rows, heads] = np.moveaxis(dq, 0, 1)
            for bits in block_bits:
                # dq: blocks of BLOCK keys; partials [key blocks, G R, D], added in ascending order to a
                # float64 sum that starts at +0 (as block_weighted_sum)
                big_u, e = quantize_last_axis(u_dq.reshape(group * (end - rows.start), end // BLOCK, BLOCK), bits)
                exact = np.moveaxis(big_u, 1, 0) @ enc["qk"][:end, g].reshape(end // BLOCK, BLOCK, dim)
                partial = exact * fp.pow2_f64(e.T - (bits - 2) - k_row)[..., None]
                total = np.zeros(partial.shape[1:])
                for part in partial:
                    total += part
                out["block", bits][0][rows, heads] = np.moveaxis(total.reshape(group, end - rows.start, dim), 0, 1)
                # dk, dv: the chunk's query blocks of each q head, [count, G, keys, BLOCK] with one E per
                # (block, head, key), added in ascending (query block, head) order
                for acc, u, r in zip(wide[bits], u_kv, (row_q, row_do)):
                    blocks = np.swapaxes(u.reshape(group, count, BLOCK, end), 0, 1)  # [count, G, BLOCK, end]
                    big_u, e = quantize_last_axis(np.swapaxes(blocks, -1, -2), bits)  # [count, G, end, BLOCK]
                    rows_b = np.swapaxes(r[:, rows].reshape(group, count, BLOCK, dim), 0, 1)  # [count, G, BLOCK, D]
                    partial = (big_u @ rows_b) * fp.pow2_f64(e - (bits - 2) - q_row)[..., None]  # exact integers
                    for b in range(count):
                        for h in range(group):
                            acc[:end] += partial[b, h]
        for bits, acc in wide.items():
            for i in (1, 2):
                out["block", bits][i][:, g] = acc[i - 1]
        if not flat_bits:
            continue
        e_kv = [np.where(f > 0, f - 1023, 0) for f in fields]
        sums = {bits: [[np.zeros((length, dim), np.int64) for _ in range(3)] for _ in range(2)] for bits in flat_bits}
        for rows, big_p, d_s in _chunks(enc, g, group, length, rows_per_chunk, scale):  # second pass: flat dk, dv
            end = rows.stop
            u_kv = (d_s * scale_q[:, rows], big_p * scale_do[:, rows])
            for bits in flat_bits:
                for acc, u, r, e in zip(sums[bits], u_kv, (row_q, row_do), e_kv):
                    big_u = np.rint(u * fp.pow2_f64(bits - 2 - e[:end]))
                    for a, s in zip(acc, digit_sums(big_u.reshape(-1, end).T, r[:, rows].reshape(-1, dim))):
                        a[:end] += s  # exact int64: below 2^11 2^22 (G T)
        for bits in flat_bits:
            for i, (acc, e) in enumerate(zip(sums[bits], e_kv)):
                out["flat", bits][i + 1][:, g] = round_digit_sums(acc, (e - (bits - 2) - q_row)[:, None])
    return out


def attention_inputs(length):
    """(raw q, k, v, do float32; the same encoded as the contract encodes them): one sequence, 2 q heads,
    1 kv head, head_dim 128, q scaled so that the scores spread ~ 4 (a peaky softmax, as in trained models)."""
    rng = np.random.default_rng(length)
    hq, hkv, d = 2, 1, 128
    q = (rng.standard_normal((length, hq, d)) * 2.0).astype(np.float32)  # scores with spread ~ 4
    k, v = (rng.standard_normal((length, hkv, d)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((length, hq, d)).astype(np.float32)
    return (q, k, v, do), (encoded(q, 23), encoded(k, 15), encoded(v, 15), encoded(do, 23))


def same_bits(a, b):
    return all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))


def attention_errors(length, exact, bf16):
    """Errors of the block rule at BLOCK_BITS and of the flat rule at FLAT_BITS, their ratios to bf16's, and
    (T <= WHOLE_MAX) whether the chunked block rule's bits equal the reference's at the same COEF_BITS."""
    q, k, v, do = attention_inputs(length)[0]
    bf16_errors = [_rel_error(a, b) for a, b in zip(bf16, exact)]
    started = time.time()
    grads = attention_backward_chunked(q, k, v, do, BLOCK_BITS, [FLAT_BITS])
    row = {"length": length, "bf16": bf16_errors, "chunked_seconds": round(time.time() - started, 1)}
    for rule, bits_list in (("block", BLOCK_BITS), ("flat", [FLAT_BITS])):
        errors = {str(bits): [_rel_error(a, b) for a, b in zip(grads[rule, bits], exact)] for bits in bits_list}
        row[rule] = errors
        row[rule + "_ratio_to_bf16"] = {bits: [x / y for x, y in zip(e, bf16_errors)] for bits, e in errors.items()}
    if length <= WHOLE_MAX:
        started = time.time()
        row["chunked_equals_reference"] = {}
        for bits in BLOCK_BITS:  # the contract's bits, and the others through the reference's own COEF_BITS
            reference.COEF_BITS = bits
            ours = reference.attention_packed_backward_batched(q, k, v, do, np.array([0, length]), None)
            row["chunked_equals_reference"][str(bits)] = same_bits(grads["block", bits], ours)
        reference.COEF_BITS = CONTRACT_BITS
        row["reference_seconds"] = round(time.time() - started, 1)
    return row


def main():
    started = time.time()
    result = {
        "what": "worst relative L2 error against float64 autograd (dq, dk, dv for attention)",
        "contract": {"rule": "block", "block": BLOCK, "coef_bits": CONTRACT_BITS},
        "models": {"bits": BITS, "what": ("block rule at COEF_BITS = bits (reference.COEF_BITS); ratio_to_bf16: "
                                          "the contract's rule is at most 0.1 at its own bits"),
                   **model_errors(BITS)},
        "attention": {
            "block_bits": BLOCK_BITS, "flat_bits": FLAT_BITS,
            "what": ("relative L2 error (dq, dk, dv) against float64 autograd of the encoded inputs; block: the "
                     "contract's rule at COEF_BITS = bits (one E per output row and aligned block of 64 positions: "
                     "keys for dq, queries of one q head for dk, dv; exact integer block partials added in "
                     "float64 in ascending (query block, head) order, one rounding to float32); flat: one E per "
                     "output row over its whole sum, the exact sum rounded once (at 32 bits, for comparison). "
                     "Both by the script's chunked function on the reference's own float64 P and dS "
                     "(rlportable.contract.attention._head_gradient_terms on chunks of query rows); "
                     "chunked_equals_reference: the block rule's bits equal the reference's "
                     "attention_packed_backward_batched at COEF_BITS = bits (T <= 4096). Beyond T = 4096 "
                     "the float64 autograd runs in query chunks per head and bf16 autograd per head (memory)"),
            "rows": []}}
    for length in LENGTHS:
        raw, enc = attention_inputs(length)
        exact, bf16 = attention_grads(*enc, torch.float64), attention_grads(*raw, torch.bfloat16)
        result["attention"]["rows"].append(attention_errors(length, exact, bf16))
    result["seconds"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
