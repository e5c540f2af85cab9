"""The model's backward (rlportable.model.backward) against torch autograd, and its determinism."""

import numpy as np
import pytest

from rlportable.model import backward
from rlportable.model.forward import Model
from rlportable.model.load import load_model
from rlportable.runtime import get_backend
from test_model_forward import hf_model_and_ours

CPU = get_backend("cpu")

# Tolerance (relative L2 error per weight tensor against float64 autograd): the forward rounds
# weights to 15 bits and activations to 23 bits (per-element relative error ~3e-5), and the
# backward's products round gradients to 23 bits and activations to 15 bits relative to each
# row's (channel's) largest element, so small elements of a row carry relative errors up to
# ~2^-15 x (row max / element). Summed over a tensor this stays near 1e-4; a bf16 autograd
# (8-bit operands) is at ~1e-2. 2e-3 leaves room for the rows with a large dynamic range while
# failing any real error in a backward formula (those give O(1) relative errors).
GRAD_TOLERANCE = 2e-3


def _torch_grads(hf, tokens: np.ndarray, cu: np.ndarray, rows: np.ndarray, g: np.ndarray, dtype) -> dict:
    import torch

    model = hf.to(dtype)
    model.zero_grad()
    total = 0
    for start, stop in zip(cu[:-1], cu[1:]):
        ids = torch.tensor(tokens[start:stop][None].astype(np.int64))
        logits = model(ids).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        picked = (rows >= start) & (rows < stop - 1)
        weights = torch.tensor(g[picked].astype(np.float64))
        total = total + (logp[torch.tensor(rows[picked] - start)] * weights).sum()
    total.backward()
    return {name: p.grad.double().numpy() for name, p in model.named_parameters() if p.grad is not None}


def torch_gradients(hf, tokens: np.ndarray, cu: np.ndarray, rows: np.ndarray, g: np.ndarray) -> tuple[dict, dict]:
    """(float64 autograd's gradients, bf16 autograd's) of the same case: the reference and the yardstick
    of every gradient accuracy check."""
    import torch

    return (_torch_grads(hf, tokens, cu, rows, g, torch.float64),
            _torch_grads(hf, tokens, cu, rows, g, torch.bfloat16))


def _rel_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - reference) / max(np.linalg.norm(reference), 1e-30))


def gradient_case(vocab_size: int):
    """(tokens, cu, rows, g): two packed sequences of 17 and 23 tokens, some rows of each (as completions
    are) and their upstream gradients; the case of the gradient tests and of scripts/measure_*.py."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, vocab_size, 40).astype(np.int32)
    rows = np.array([3, 4, 5, 10, 15, 20, 30, 31, 38])
    return tokens, np.array([0, 17, 40]), rows, rng.normal(size=rows.size).astype(np.float32)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_gradients_match_torch_autograd(arch, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    hf, (rl_config, weights, _) = hf_model_and_ours(arch, tmp_path)
    config = hf.config
    model = Model(CPU, rl_config, weights, trainable=True)
    tokens, cu, rows, g = gradient_case(config.vocab_size)
    fwd = backward.forward(model, tokens, cu, rows=rows)
    grads = backward.backward(model, fwd, g).named_tensors(rl_config)
    reference, bf16 = torch_gradients(hf, tokens, cu, rows, g)
    assert set(grads) == set(reference), set(grads) ^ set(reference)
    worst = worst_bf16 = 0.0
    for name, ref in reference.items():
        ours = grads[name]
        assert ours.shape == ref.shape, name
        error = _rel_error(ours, ref)
        assert error < GRAD_TOLERANCE, (arch, name, error, _rel_error(bf16[name], ref))
        worst, worst_bf16 = max(worst, error), max(worst_bf16, _rel_error(bf16[name], ref))
    assert worst * 10 < worst_bf16, (arch, worst, worst_bf16)  # measured: ~6e-4 against ~4e-2


def test_backward_is_deterministic_and_checks_its_input(monkeypatch):
    """Two runs give the same gradient bits, one keeping the forward's attention outputs (the
    attention forward runs once per layer), one recomputing them (twice per layer)."""
    from rlportable.errors import InputError
    from rlportable.ops import attention

    config, weights, _ = load_model("tiny")
    model = Model(CPU, config, weights, trainable=True)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 30).astype(np.int32)
    cu = np.array([0, 12, 30])
    calls = []
    packed = attention.attention_packed
    monkeypatch.setattr(attention, "attention_packed", lambda *a, **k: calls.append(1) or packed(*a, **k))
    runs = []
    for keep in (True, False):
        calls.clear()
        fwd = backward.forward(model, tokens, cu, keep_attention=keep)
        g = np.linspace(-1, 1, fwd.rows.size).astype(np.float32)
        runs.append({k: v.view(np.uint32).copy() for k, v in backward.backward(model, fwd, g)
                     .named_tensors(config).items()})
        assert len(calls) == config.num_hidden_layers * (1 if keep else 2)
    for name in runs[0]:
        assert np.array_equal(runs[0][name], runs[1][name]), name
    with pytest.raises(InputError, match="grad_logp"):
        backward.backward(model, fwd, np.zeros(3, np.float32))
    with pytest.raises(InputError, match="trainable"):
        backward.backward(Model(CPU, config, weights), fwd, g)
    with pytest.raises(InputError, match="own sequence"):
        backward.forward(model, tokens, cu, rows=np.array([11]))  # row 11 ends sequence 0


def test_training_logprobs_equal_the_model_logprobs_bitwise():
    config, weights, _ = load_model("tiny")
    model = Model(CPU, config, weights, trainable=True)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 25).astype(np.int32)
    cu = np.array([0, 9, 25])
    fwd = backward.forward(model, tokens, cu, temperature=0.7)
    expected = np.concatenate(model.logprobs(tokens, cu, temperature=0.7))
    assert np.array_equal(fwd.logp.view(np.uint32), expected.view(np.uint32))
