"""Accuracy of the attention backward's coefficient bits (contracts/attention.toml, coef_bits), on the CPU.

    PYTHONPATH=. python3 scripts/measure_attention_backward_bits.py [bits ...] > result.json

For each candidate number of coefficient bits (default 32 16 15 14 12), with the reference's
COEF_BITS set to it:
  * models: the gradients of the three random-weight model tests (test_model_backward: Qwen3, Qwen2,
    Llama shapes, two packed sequences of 17 and 23 tokens) against float64 torch autograd: the worst
    relative L2 error over the weight tensors, beside bf16 autograd's worst (the contract's rule: at
    most 1/10 of it);
  * attention alone at long sequences: one sequence of T tokens (2 q heads, 1 kv head, head_dim 128),
    q scaled so the softmax is peaky as in trained models (score spread ~ 4), against float64 autograd
    of the same (encoded) inputs, beside torch's bf16 attention backward on the same inputs;
  * block-scaled coefficients ("attention_block_scaled", T = 256 ... 16384): the same attention
    inputs, the weighted sums of dq, dk, dv cut into aligned blocks of BLOCK = 64 sequence positions
    (dq_t: keys j in [64b, 64b + 64); dk_j, dv_j: queries t in [64b, 64b + 64), all q heads of the kv
    group), coefficients quantized to B bits below the largest of their own block (B in BLOCK_BITS),
    each block's exact integer partial scaled into float64 and the partials added in float64 in
    ascending block order, one rounding to float32 (attention_backward_blocked); beside the flat rule
    (one largest per whole sum, the contract's) at the same B, computed by the same chunked function
    (bit-identical to the reference at COEF_BITS = B where the reference runs: T <= 4096).
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
from test_model_backward import _rel_error, _torch_grads  # noqa: E402
from test_model_forward import hf_model_and_ours  # noqa: E402

BITS = [int(b) for b in sys.argv[1:]] or [32, 16, 15, 14, 12]
CPU = get_backend("cpu")
BLOCK = 64  # sequence positions per coefficient block (one E per output row and block)
BLOCK_BITS = [15, 16, 12]  # 15: two int8 digits
LENGTHS = (256, 1024, 4096)  # the reference's own (whole-sequence) backward runs at these
LONG_LENGTHS = LENGTHS + (16384,)  # the chunked functions below also run at these
WHOLE_MAX = 4096  # longer sequences: autograd head by head / in query chunks (memory), see attention_grads


def model_errors(bits_list):
    """{arch: {"bf16": worst, bits: worst}} over the weight tensors of the model test."""
    out = {}
    for arch in ("qwen3", "qwen2", "llama"):
        with tempfile.TemporaryDirectory() as tmp:
            hf, (rl_config, weights, _) = hf_model_and_ours(arch, Path(tmp))
            rng = np.random.default_rng(3)
            tokens = rng.integers(0, hf.config.vocab_size, 40).astype(np.int32)
            cu = np.array([0, 17, 40])
            rows = np.array([3, 4, 5, 10, 15, 20, 30, 31, 38])
            g = rng.normal(size=rows.size).astype(np.float32)
            exact = _torch_grads(hf, tokens, cu, rows, g, torch.float64)
            bf16 = _torch_grads(hf, tokens, cu, rows, g, torch.bfloat16)
            row = {"bf16": max(_rel_error(bf16[n], r) for n, r in exact.items())}
            for bits in bits_list:
                reference.COEF_BITS = bits
                model = Model(CPU, rl_config, weights, trainable=True)
                fwd = backward.forward(model, tokens, cu, rows=rows)
                grads = backward.backward(model, fwd, g).named_tensors(rl_config)
                row[str(bits)] = max(_rel_error(grads[n], r) for n, r in exact.items())
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


# ---- the block-scaled coefficient rule, beside the flat one
#
# P and dS are the reference's own float64 values (reference._head_gradient_terms on a chunk of query
# rows against their keys: a row's P and dS depend on its own row and keys only), so the two rules differ
# from the reference's flat rule only in how the coefficients are quantized and summed.

def quantize_last_axis(u, bits):
    """quantize_coefficients' rule with one E per entry of u's leading axes, over its last axis:
    (U = RNE(u 2^(bits-2-E)) as float64 integers, E int64), E from the largest exponent field, 0 if all 0."""
    fields = reference.exponent_fields(u).max(axis=-1, initial=0)
    e = np.where(fields > 0, fields - 1023, 0)
    return np.rint(u * fp.pow2_f64(bits - 2 - e)[..., None]), e


def _blocks(x, count):
    """[G, R, ...] -> [R / BLOCK, G * BLOCK, ...]: the G heads' rows of each aligned query block together."""
    g = x.shape[0]
    x = x.reshape((g, count, BLOCK) + x.shape[2:])
    return np.moveaxis(x, 1, 0).reshape((count, g * BLOCK) + x.shape[3:])


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


def attention_backward_blocked(q, k, v, do, variants, rows_per_chunk=256):
    """dq, dk, dv of one causal sequence (q, do [T, Hq, D]; k, v [T, Hkv, D] float32, T a multiple of BLOCK)
    for each variant (bits, block): block = BLOCK, one E per (output row, block of BLOCK positions), the
    blocks' partials added in float64 in ascending order; block = None, the flat rule (one E per output row:
    the reference's exact_weighted_sum at COEF_BITS = bits, the same bits). Returns {variant: (dq, dk, dv)}.

    Memory stays linear in T (chunks of query rows). Flat dk and dv need each column's largest coefficient
    over all queries first: a second pass recomputes P and dS for them."""
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
    for bits, block in variants:  # every integer partial (block or whole flat sum) must be exact in float64
        terms = BLOCK * group if block else length * group
        assert terms * 2.0 ** (bits - 1) * 2.0 ** (q_row + 1) < 2.0**53, (bits, block, length)
    out = {var: tuple(np.empty(x.shape, np.float32) for x in (q, k, v)) for var in variants}
    flat_bits = [bits for bits, block in variants if block is None]
    for g in range(hkv):
        heads = slice(g * group, (g + 1) * group)
        row_q, row_do = np.moveaxis(enc["qq"][:, heads], 1, 0), np.moveaxis(enc["qdo"][:, heads], 1, 0)  # [G, T, D]
        scale_q, scale_do = (fp.pow2_f64(np.moveaxis(enc[e][:, heads], 1, 0))[..., None] for e in ("eq", "edo"))
        scale_k = fp.pow2_f64(enc["ek"][:, g])
        wide = {var: (np.zeros((length, dim)), np.zeros((length, dim))) for var in variants if var[1]}
        fields = [np.zeros(length, np.int64), np.zeros(length, np.int64)]  # flat dk, dv: largest exponent fields
        for rows, big_p, d_s in _chunks(enc, g, group, length, rows_per_chunk, scale):
            end, count = rows.stop, (rows.stop - rows.start) // BLOCK
            u_dq = d_s * scale_k[:end]  # [G, R, end]
            u_kv = (d_s * scale_q[:, rows], big_p * scale_do[:, rows])
            for i, u in enumerate(u_kv):
                fields[i][:end] = np.maximum(fields[i][:end], reference.exponent_fields(u).max(axis=(0, 1)))
            for bits, block in variants:
                dq = out[bits, block][0]
                if block is None:  # the flat rule: dq_t's sum is all in this chunk
                    big_u, e = quantize_last_axis(u_dq, bits)
                    exact = big_u @ enc["qk"][:end, g]  # exact integers (< 2^53)
                    dq[rows, heads] = np.moveaxis(exact * fp.pow2_f64(e - (bits - 2) - k_row)[..., None], 0, 1)
                    continue
                # dq: blocks of BLOCK keys; partials [keys blocks, G R, D], added in ascending order (cumsum)
                big_u, e = quantize_last_axis(u_dq.reshape(group * (end - rows.start), end // BLOCK, BLOCK), bits)
                exact = np.moveaxis(big_u, 1, 0) @ enc["qk"][:end, g].reshape(end // BLOCK, BLOCK, dim)
                partial = exact * fp.pow2_f64(e.T - (bits - 2) - k_row)[..., None]
                total = np.cumsum(partial, axis=0)[-1].reshape(group, end - rows.start, dim)
                dq[rows, heads] = np.moveaxis(total, 0, 1)
                # dk, dv: the chunk's query blocks, each [keys, G BLOCK] with one E per key, in ascending order
                for acc, u, r in zip(wide[bits, block], u_kv, (row_q, row_do)):
                    big_u, e = quantize_last_axis(np.swapaxes(_blocks(u, count), 1, 2), bits)  # [count, end, G B]
                    exact = big_u @ _blocks(r[:, rows], count)  # [count, end, D], exact integers
                    partial = exact * fp.pow2_f64(e - (bits - 2) - q_row)[..., None]
                    for b in range(count):
                        acc[:end] += partial[b]
        for var, acc in wide.items():
            for i in (1, 2):
                out[var][i][:, g] = acc[i - 1]
        if not flat_bits:
            continue
        e_kv = [np.where(f > 0, f - 1023, 0) for f in fields]
        sums = {bits: (np.zeros((length, dim), np.int64), np.zeros((length, dim), np.int64)) for bits in flat_bits}
        for rows, big_p, d_s in _chunks(enc, g, group, length, rows_per_chunk, scale):  # second pass: flat dk, dv
            end = rows.stop
            u_kv = (d_s * scale_q[:, rows], big_p * scale_do[:, rows])
            for bits in flat_bits:
                for acc, u, r, e in zip(sums[bits], u_kv, (row_q, row_do), e_kv):
                    big_u = np.rint(u * fp.pow2_f64(bits - 2 - e[:end]))
                    acc[:end] += (big_u.reshape(-1, end).T @ r[:, rows].reshape(-1, dim)).astype(np.int64)
        for bits in flat_bits:
            for i, (acc, e) in enumerate(zip(sums[bits], e_kv)):
                out[bits, None][i + 1][:, g] = acc.astype(np.float64) * fp.pow2_f64(e - (bits - 2) - q_row)[:, None]
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


def attention_errors(bits_list, length, exact, bf16):
    """The reference's own (flat) backward at each COEF_BITS; returns (row, {bits: (dq, dk, dv)})."""
    q, k, v, do = attention_inputs(length)[0]
    row = {"length": length, "bf16": [_rel_error(a, b) for a, b in zip(bf16, exact)]}
    cu = np.array([0, length])
    grads = {}
    for bits in bits_list:
        reference.COEF_BITS = bits
        grads[bits] = reference.attention_packed_backward_batched(q, k, v, do, cu, None)
        row[str(bits)] = [_rel_error(a, b) for a, b in zip(grads[bits], exact)]
    reference.COEF_BITS = 32
    return row, grads


def block_errors(length, exact, bf16, reference_grads):
    """Flat and block-scaled rules at BLOCK_BITS: errors, their ratio to bf16's, and whether the flat
    rule equals the reference's bits (where the reference ran at that COEF_BITS)."""
    q, k, v, do = attention_inputs(length)[0]
    variants = [(bits, None) for bits in BLOCK_BITS] + [(bits, BLOCK) for bits in BLOCK_BITS]
    started = time.time()
    grads = attention_backward_blocked(q, k, v, do, variants)
    bf16_errors = [_rel_error(a, b) for a, b in zip(bf16, exact)]
    row = {"length": length, "bf16": bf16_errors, "seconds": round(time.time() - started, 1)}
    for name, block in (("flat", None), (f"block{BLOCK}", BLOCK)):
        errors = {str(bits): [_rel_error(a, b) for a, b in zip(grads[bits, block], exact)] for bits in BLOCK_BITS}
        row[name] = errors
        row[name + "_ratio_to_bf16"] = {bits: [x / y for x, y in zip(e, bf16_errors)] for bits, e in errors.items()}
    row["flat_equals_reference"] = {str(bits): all(np.array_equal(a, b, equal_nan=True)
                                                    for a, b in zip(grads[bits, None], reference_grads[bits]))
                                    for bits in BLOCK_BITS if bits in reference_grads}
    return row


def main():
    started = time.time()
    result = {"bits": BITS, "what": "worst relative L2 error against float64 autograd (dq, dk, dv for attention)",
              "models": model_errors(BITS), "attention": []}
    result["block_scaled"] = {
        "block": BLOCK, "bits": BLOCK_BITS,
        "what": ("relative L2 error (dq, dk, dv) against float64 autograd of the encoded inputs; flat: one E per "
                 "output row (the contract's rule), block64: one E per output row and aligned block of 64 positions "
                 "(keys for dq, queries of all q heads of the kv group for dk, dv), exact integer block partials "
                 "added in float64 in ascending block order, one rounding to float32. P and dS are the reference's "
                 "own float64 values (rlportable.contract.attention._head_gradient_terms on chunks of query rows), "
                 "so only the coefficient quantization differs; flat_equals_reference: the flat rule's bits equal "
                 "the reference's attention_packed_backward_batched at COEF_BITS = bits. Beyond T = 4096 the "
                 "float64 autograd runs in query chunks per head and bf16 autograd per head (memory)"),
        "attention": []}
    for length in LONG_LENGTHS:
        raw, enc = attention_inputs(length)
        exact, bf16 = attention_grads(*enc, torch.float64), attention_grads(*raw, torch.bfloat16)
        reference_grads = {}
        if length in LENGTHS:
            row, reference_grads = attention_errors(BITS, length, exact, bf16)
            result["attention"].append(row)
        result["block_scaled"]["attention"].append(block_errors(length, exact, bf16, reference_grads))
    result["seconds"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
