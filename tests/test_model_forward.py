"""The model forward on the cpu backend: packing invariance (bitwise) and accuracy against HF transformers."""

import numpy as np
import pytest

from rlportable.model.forward import Model
from rlportable.model.load import load_model
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


@pytest.fixture(scope="module")
def tiny():
    config, weights, tokenizer = load_model("tiny")
    return Model(CPU, config, weights), tokenizer


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def test_tiny_logprobs_are_finite_log_probabilities(tiny):
    model, tokenizer = tiny
    ids = np.array(tokenizer.encode("12+34=46"), dtype=np.int32)
    (lp,) = model.logprobs(ids, np.array([0, ids.size]))
    assert lp.shape == (ids.size - 1,) and np.all(np.isfinite(lp)) and np.all(lp <= 0)


def test_a_sequence_has_the_same_bits_alone_and_packed_at_any_offset(tiny):
    model, _ = tiny
    rng = np.random.default_rng(0)
    target = rng.integers(0, model.config.vocab_size, 23).astype(np.int32)
    (alone,) = model.logprobs(target, np.array([0, target.size]))
    for before in (1, 5, 40):
        other = rng.integers(0, model.config.vocab_size, before).astype(np.int32)
        after = rng.integers(0, model.config.vocab_size, 7).astype(np.int32)
        tokens = np.concatenate([other, target, after])
        cu = np.array([0, before, before + target.size, tokens.size])
        packed = model.logprobs(tokens, cu)
        assert np.array_equal(bits(packed[1]), bits(alone))


def test_temperature_and_entropy(tiny):
    model, _ = tiny
    tokens = np.arange(1, 12, dtype=np.int32)
    (lp1,), (ent,) = model.logprobs(tokens, np.array([0, 11]), 1.0, with_entropy=True)
    (lp2,) = model.logprobs(tokens, np.array([0, 11]), 0.5)
    assert np.all(ent >= 0) and not np.array_equal(bits(lp1), bits(lp2))


def test_the_stacked_projections_get_their_encoding_from_add_rmsnorm(tiny, monkeypatch):
    """Every stacked gemm but the first layer's q/k/v (whose h comes from rmsnorm) reads the encoding that
    norm.add_rmsnorm returned with its h: fixedpoint's encoding of that h, to the bit. The final norm's
    output is not encoded (the LM head encodes only the rows it needs)."""
    from rlportable.ops import fixedpoint, gemm, norm

    model, _ = tiny
    seen, requested = [], []
    columns, add_rmsnorm = gemm.gemm_columns, norm.add_rmsnorm

    def recording_columns(backend, x, stacked, encoded=None, tile=None):
        seen.append((np.array(x), encoded))
        return columns(backend, x, stacked, encoded=encoded, tile=tile)

    def recording_add_rmsnorm(*args, encode_bits=None, **kwargs):
        requested.append(encode_bits)
        return add_rmsnorm(*args, encode_bits=encode_bits, **kwargs)

    monkeypatch.setattr(gemm, "gemm_columns", recording_columns)
    monkeypatch.setattr(norm, "add_rmsnorm", recording_add_rmsnorm)
    tokens = np.arange(1, 12, dtype=np.int32)
    model.logprobs(tokens, np.array([0, 5, 11]))
    layers = len(model.layers)
    assert len(seen) == 2 * layers and seen[0][1] is None
    for h, encoded in seen[1:]:
        want = fixedpoint.encode_rows_reference(h, gemm.DEFAULT_BITS_A)
        assert (encoded.bits, encoded.k, encoded.descending) == (want.bits, want.k, want.descending)
        assert np.array_equal(encoded.digits, want.digits) and np.array_equal(encoded.exponents, want.exponents)
    # per layer: the in-layer norm and the closing one, encoded except the final norm's
    assert requested == [gemm.DEFAULT_BITS_A] * (2 * layers - 1) + [None]


def test_bad_packing_is_an_input_error(tiny):
    from rlportable.errors import InputError

    model, _ = tiny
    with pytest.raises(InputError, match="cu_seqlens"):
        model.logprobs(np.arange(5, dtype=np.int32), np.array([0, 3]))
    with pytest.raises(InputError, match="token ids"):
        model.logprobs(np.array([0, 10**7], dtype=np.int32), np.array([0, 2]))


# ---- accuracy against HF transformers (a float64 forward on the CPU)
# The criterion is the contract's promise: the log-probs' largest error against a float64 forward is
# at most 1/10 of a bf16 forward's. rlportable rounds weights to 15 bits and activations to 23 bits
# relative to each row's largest element, and keys/values to 15 bits (per-element errors near
# 2^-15); bf16 rounds every operand to 8 bits (2^-9). No absolute bound: on a real pretrained 135M
# checkpoint the largest error reached 4.2e-3 (mean 3.2e-4) while staying 1/80 of bf16's.
ERROR_RATIO_TO_BF16 = 10


def _hf_models():
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.15, rms_norm_eps=1e-6)
    return {
        "qwen3": transformers.Qwen3Config(head_dim=16, rope_theta=1e6, tie_word_embeddings=True, **common),
        "qwen2": transformers.Qwen2Config(rope_theta=1e6, tie_word_embeddings=False, **common),
        "llama": transformers.LlamaConfig(
            rope_theta=5e5, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common),
    }


def hf_model_and_ours(arch: str, folder):
    """A seeded random HF model of `arch`, saved to folder, and load_model's view of that folder."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = _hf_models()[arch]
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.save_pretrained(folder, safe_serialization=True)
    write_test_tokenizer(folder, config.vocab_size)
    return hf, load_model(str(folder))


def write_test_tokenizer(folder, vocab_size):
    """A word-level tokenizer.json of vocab_size entries: the HF directory needs one to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<unk>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def _hf_logprobs(model, tokens, dtype):
    import torch

    with torch.no_grad():
        logits = model.to(dtype)(torch.tensor(tokens[None].astype(np.int64))).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(tokens[1:, None].astype(np.int64)))
    return lp[:, 0].numpy()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_logprobs_match_hf_transformers(arch, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    hf, (rl_config, weights, _) = hf_model_and_ours(arch, tmp_path)
    config = hf.config
    model = Model(CPU, rl_config, weights)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 96).astype(np.int32)
    (ours,) = model.logprobs(tokens, np.array([0, tokens.size]))
    reference = _hf_logprobs(hf, tokens, torch.float64)
    bf16 = _hf_logprobs(hf, tokens, torch.bfloat16)
    ours_error = np.abs(ours.astype(np.float64) - reference).max()
    bf16_error = np.abs(bf16 - reference).max()
    assert ours_error * ERROR_RATIO_TO_BF16 <= bf16_error, (arch, ours_error, bf16_error)
