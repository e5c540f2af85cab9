"""Accuracy of the exact gemm with fewer int8 digit products (a candidate contract revision), on the CPU.

    PYTHONPATH=. python3 scripts/measure_gemm_digit_products.py [--quick] > result.json

The gemm contract (contracts/gemm.toml) multiplies a 23-bit activation row (three balanced int8 digits
a2 a1 a0, digit 0 least significant) by a 15-bit weight row (w1 w0): S = sum_(i,j) 256^(i+j) a_i . w_j over
six digit products, rounded once. A variant that leaves products out is still an exact integer sum
rounded once (vendor-free); only its accuracy changes. Variants (the same in every gemm of the forward
and of the backward, whatever the operands' digit counts: the first operand is the "a" side, the second
the "w" side, as rlportable.contract.exact.gemm_from_encoded takes them):
  6  today's contract (no product left out)
  5  a0.w0 left out (weight 256^0): the tensor-core floor of an exact gemm from 3x to 2.5x a bf16 gemm
  4  a0.w0 and a0.w1 left out (the activation's lowest digit entirely: about 16-bit activations)
The swap: rlportable.contract.exact.gemm_from_encoded, which every cpu gemm reaches (ops/gemm.py's
reference path, exact.gemm by its module global), is replaced for the duration of a measurement by a
function that subtracts the left-out products (exact: float64 products of int8 digits) from the contract's
exact sums and rounds with the contract's own round_sums; restored after, and the restore checked bitwise
(the contract's outputs after every swap equal those before). Nothing in rlportable/ is edited.

Measured:
  1. gemm alone (the conform row kinds, rlportable.conform.inputs.random_rows; finite kinds: normal,
     massive (one channel x 25000), tiny (subnormal), huge (1e37)) as tests/test_gemm.py's
     test_default_bits_beat_a_bf16_gemm: X [64, K] of the kind, W [128, K] normal x 0.02, K = 1024 and
     3072: relative L2 error (Frobenius) against float64 of the raw inputs, beside a bf16 gemm with
     float32 accumulation (ml_dtypes), and against float64 of the encoded inputs (the digit products and
     the one rounding alone); and the digit identity checked (the six products sum to the contract's
     integer sums);
  2. log-probs of the random-weight test models (tests/test_model_forward.py: Qwen3, Qwen2, Llama
     shapes, 2 layers, hidden 64) at 96 (the test's) and 256 tokens, and of a random-weight
     Qwen3-0.6B-shaped model (hidden 1024, 16 / 8 heads of 128, intermediate 3072, vocabulary 151,936,
     2 of its 28 layers, HF's initializer) at 96 and 512 tokens: mean and max |log-prob error| against HF
     transformers in float64, beside HF in bf16 (the rule for a contract change: max error at most 1/20
     of bf16's); --quick: the three test models at 96 tokens;
  3. gradients of the three test models as tests/test_model_backward.py (two packed sequences of 17 and
     23 tokens) and of the Qwen3-0.6B-shaped model (60 and 68 tokens, every third row; not with --quick):
     relative L2 error of every weight gradient against float64 autograd, beside bf16 autograd's; worst
     tensor and median tensor (rule: worst at most 1/10 of bf16's worst).
Prints JSON.
"""

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from rlportable.contract import exact  # noqa: E402
from rlportable.contract import fixedpoint as fp  # noqa: E402
from rlportable.conform.inputs import random_rows  # noqa: E402
from rlportable.provenance import host, provenance  # noqa: E402

CONTRACT_GEMM_FROM_ENCODED = exact.gemm_from_encoded  # read before any swap
#: (a digit, w digit) pairs left out, digit 0 least significant
VARIANTS = {"6": (), "5": ((0, 0),), "4": ((0, 0), (0, 1))}
KINDS = ("normal", "massive", "tiny", "huge")
GEMM_KS = (1024, 3072)
ARCHS = ("qwen3", "qwen2", "llama")


# ---- the variants


def digits_f64(q, bits):
    """Balanced int8 digits of integer rows q (any integer-valued dtype) as float64 [n, *q.shape]."""
    return fp.split_digits(np.asarray(q).astype(np.int64), bits).astype(np.float64)


def variant_sums(qa, bits_a, qw, bits_w, dropped):
    """S of the variant: the contract's exact sums less 256^(i+j) a_i . w_j for each left-out (i, j)."""
    sums = exact.exact_int_matmul(qa, qw)
    if not dropped:
        return sums
    da, dw = digits_f64(qa, bits_a), digits_f64(qw, bits_w)
    for i, j in dropped:
        if i < da.shape[0] and j < dw.shape[0]:
            # |a_i . w_j| <= 2^14 K < 2^31: exact in float64, whatever the BLAS's order
            sums = sums - (da[i] @ dw[j].T).astype(np.int64) * (256 ** (i + j))
    return sums


def variant_gemm_from_encoded(dropped):
    def gemm_from_encoded(qa, ea, bits_a, qw, ew, bits_w):
        return exact.round_sums(variant_sums(qa, bits_a, qw, bits_w, dropped), ea, bits_a, ew, bits_w)
    return gemm_from_encoded


@contextlib.contextmanager
def digit_products(name):
    """Every cpu gemm with VARIANTS[name]'s products left out, then the contract's function back."""
    exact.gemm_from_encoded = CONTRACT_GEMM_FROM_ENCODED if name == "6" else variant_gemm_from_encoded(VARIANTS[name])
    try:
        yield
    finally:
        exact.gemm_from_encoded = CONTRACT_GEMM_FROM_ENCODED


def same_bits(a, b):
    return bool(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)))


# ---- 1. gemm alone


def relative_error(y, reference):
    return float(np.linalg.norm(y.astype(np.float64) - reference) / np.linalg.norm(reference))


def gemm_rows():
    import ml_dtypes

    rows = []
    for k in GEMM_KS:
        for kind in KINDS:
            rng = np.random.default_rng([k, len(kind)])
            x = random_rows(rng, 64, k, kind)
            w = (random_rows(rng, 128, k, "normal") * np.float32(0.02)).astype(np.float32)
            reference = x.astype(np.float64) @ w.astype(np.float64).T
            qa, ea = fp.quantize_rows(x, 23)
            qw, ew = fp.quantize_rows(w, 15)
            # float64 of the encoded inputs: the error of the digit products and the one rounding alone
            encoded = (qa * np.ldexp(1.0, fp.scale_exponent(ea, 23))[:, None]) @ \
                (qw * np.ldexp(1.0, fp.scale_exponent(ew, 15))[:, None]).T
            da, dw = digits_f64(qa, 23), digits_f64(qw, 15)
            identity = sum((da[i] @ dw[j].T).astype(np.int64) * 256 ** (i + j) for i in range(3) for j in range(2))
            bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
            row = {"k": k, "kind": kind, "bf16": relative_error(bf16(x) @ bf16(w).T, reference),
                   "six_products_sum_to_contract_sums": bool(np.array_equal(identity, exact.exact_int_matmul(qa, qw)))}
            contract = exact.gemm(x, w, 23, 15)
            for name in VARIANTS:
                with digit_products(name):
                    y = exact.gemm(x, w, 23, 15)
                row[name] = relative_error(y, reference)
                row[f"{name}_against_encoded_f64"] = relative_error(y, encoded)
                if name == "6":
                    row["variant_6_equals_contract"] = same_bits(y, contract)
            row["swap_restores_contract"] = same_bits(exact.gemm(x, w, 23, 15), contract)
            row["ratio_to_bf16"] = {name: row[name] / row["bf16"] for name in VARIANTS}
            rows.append(row)
    return rows


# ---- 2. log-probs


def qwen3_06b_shape(layers):
    import transformers

    return transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                    num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                    head_dim=128, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                                    tie_word_embeddings=True)


def hf_and_ours(arch, folder):
    """(hf, load_model's view) of a test model (tests/test_model_forward.py) or the Qwen3-0.6B shape."""
    import torch
    import transformers

    from rlportable.model.load import load_model
    from test_model_forward import hf_model_and_ours, write_test_tokenizer

    if arch in ARCHS:
        return hf_model_and_ours(arch, folder)
    torch.manual_seed(0)
    config = qwen3_06b_shape(int(arch.rsplit("-", 1)[1].rstrip("l")))
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.save_pretrained(folder, safe_serialization=True)
    write_test_tokenizer(folder, config.vocab_size)
    return hf, load_model(str(folder))


def model_logprobs(arch, lengths):
    import torch

    from rlportable.model.forward import Model
    from rlportable.runtime import get_backend
    from test_model_forward import _hf_logprobs

    cpu = get_backend("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, (rl_config, weights, _) = hf_and_ours(arch, Path(tmp))
        model = Model(cpu, rl_config, weights)
        tokens = {n: np.random.default_rng(1).integers(0, hf.config.vocab_size, n).astype(np.int32) for n in lengths}
        # _hf_logprobs casts the model in place: every float64 forward before any bf16 one
        exact_all = {n: _hf_logprobs(hf, tokens[n], torch.float64) for n in lengths}
        bf16s = {n: _hf_logprobs(hf, tokens[n], torch.bfloat16) for n in lengths}
        del hf
        for length in lengths:
            started = time.time()
            reference, toks = exact_all[length], tokens[length]
            err = np.abs(bf16s[length] - reference)
            row = {"tokens": length, "bf16": {"mean": float(err.mean()), "max": float(err.max())}}
            outs = {}
            for name in VARIANTS:
                with digit_products(name):
                    (outs[name],) = model.logprobs(toks, np.array([0, toks.size]))
                err = np.abs(outs[name].astype(np.float64) - reference)
                row[name] = {"mean": float(err.mean()), "max": float(err.max())}
            (plain,) = model.logprobs(toks, np.array([0, toks.size]))
            row["swap_restores_contract"] = same_bits(plain, outs["6"])
            row["ratio_to_bf16"] = {name: {m: row[name][m] / row["bf16"][m] for m in ("mean", "max")}
                                    for name in VARIANTS}
            row["changed_vs_contract"] = {
                name: {"logprobs_changed": int(np.count_nonzero(o.view(np.uint32) != outs["6"].view(np.uint32))),
                       "of": int(o.size), "max_abs_diff": float(np.abs(o.astype(np.float64) - outs["6"]).max())}
                for name, o in outs.items() if name != "6"}
            row["seconds"] = round(time.time() - started, 1)
            rows.append(row)
    return {"layers": rl_config.num_hidden_layers, "rows": rows}


# ---- 3. gradients


def model_gradients(arch):
    """The test's set-up (two packed sequences of 17 and 23 tokens, 9 rows) for the test models; for the
    Qwen3-0.6B shape two sequences of 60 and 68 tokens, every third row."""
    from rlportable.model import backward
    from rlportable.model.forward import Model
    from rlportable.runtime import get_backend
    from test_model_backward import _rel_error, gradient_case, torch_gradients

    cpu = get_backend("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        hf, (rl_config, weights, _) = hf_and_ours(arch, Path(tmp))
        if arch in ARCHS:
            tokens, cu, rows, g = gradient_case(hf.config.vocab_size)
        else:
            rng = np.random.default_rng(3)
            tokens = rng.integers(0, hf.config.vocab_size, 128).astype(np.int32)
            cu = np.array([0, 60, 128])
            rows = np.arange(1, 127, 3)
            rows = rows[rows != 59]  # a sequence's last token predicts nothing
            g = rng.normal(size=rows.size).astype(np.float32)
        reference, bf16_grads = torch_gradients(hf, tokens, cu, rows, g)
        bf16 = {n: _rel_error(t, reference[n]) for n, t in bf16_grads.items()}
        del hf
        out = {"tokens": int(tokens.size), "rows": int(rows.size), "tensors": len(reference), "bf16": {"worst": max(bf16.values()), "median": float(np.median(list(bf16.values())))}}
        grads_of = {}
        for name in VARIANTS:
            with digit_products(name):
                model = Model(cpu, rl_config, weights, trainable=True)
                fwd = backward.forward(model, tokens, cu, rows=rows)
                grads_of[name] = backward.backward(model, fwd, g).named_tensors(rl_config)
            errs = {n: _rel_error(grads_of[name][n], r) for n, r in reference.items()}
            out[name] = {"worst": max(errs.values()), "median": float(np.median(list(errs.values()))),
                         "median_ratio_to_bf16": float(np.median([errs[n] / bf16[n] for n in errs]))}
        model = Model(cpu, rl_config, weights, trainable=True)
        plain = backward.backward(model, backward.forward(model, tokens, cu, rows=rows), g).named_tensors(rl_config)
        out["swap_restores_contract"] = all(same_bits(plain[n], grads_of["6"][n]) for n in plain)
        out["ratio_to_bf16"] = {name: out[name]["worst"] / out["bf16"]["worst"] for name in VARIANTS}
    return out


def machine():
    import torch

    return {**host(), "torch": torch.__version__}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the three test models at 96 tokens, no Qwen3-0.6B shape")
    parser.add_argument("--large-layers", type=int, default=2, help="layers of the Qwen3-0.6B-shaped model")
    parser.add_argument("--large-tokens", type=int, default=512, help="tokens of the Qwen3-0.6B-shaped model")
    args = parser.parse_args()
    started = time.time()
    result = {
        "what": ("the exact gemm with 6 int8 digit products (the contract), 5 (a0.w0 left out) and 4 (a0.w0, a0.w1 "
                 "left out), in every gemm of the forward and backward: gemm error per conform row kind, the "
                 "models' log-prob and gradient errors against float64, each beside bf16's"),
        "quick": args.quick,
        "variants": {name: [f"a{i}.w{j}" for i, j in dropped] for name, dropped in VARIANTS.items()},
        "provenance": {**provenance(), **machine()},
    }
    result["gemm"] = {
        "what": ("relative L2 error against float64 of the raw inputs; X [64, K] of the kind (conform's random_rows), "
                 "W [128, K] normal x 0.02; bf16: bf16 operands, float32 accumulation"),
        "rows": gemm_rows()}
    print(f"gemm done {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    lengths = (96,) if args.quick else (96, 256)
    result["logprobs"] = {
        "what": ("mean and max |log-prob error| against HF float64; bf16: HF in bf16; rule for a contract change: "
                 "ratio_to_bf16.max <= 0.05"),
        **{arch: model_logprobs(arch, lengths) for arch in ARCHS}}
    print(f"test models' logprobs done {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    if not args.quick:
        large = f"qwen3-0.6b-shape-{args.large_layers}l"
        result["logprobs"][large] = model_logprobs(large, (96, args.large_tokens))
        print(f"{large} done {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    result["gradients"] = {
        "what": ("relative L2 error of every weight gradient against float64 autograd (test models: two packed "
                 "sequences of 17 and 23 tokens, tests/test_model_backward.py; the Qwen3-0.6B shape: 60 and 68 "
                 "tokens, every third row); worst and median tensor, median of the per-tensor ratios; rule: "
                 "ratio_to_bf16 (worst over worst) <= 0.1"),
        **{arch: model_gradients(arch) for arch in ARCHS}}
    if not args.quick:
        result["gradients"][large] = model_gradients(large)
    result["seconds"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
