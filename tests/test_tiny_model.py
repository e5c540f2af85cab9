import hashlib
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np

from rlportable.model import ModelConfig, load_model, load_weights, save_model, save_safetensors, tiny_model
from rlportable.model.tiny import SPECIAL_TOKENS, tiny_tokenizer_json
from rlportable.model.weights import expected_tensors


def digest(config, weights):
    h = hashlib.sha256()
    for name, array in weights.named_tensors(config).items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return h.hexdigest()


def vocab_digest():
    data = json.loads(tiny_tokenizer_json())
    model = {"vocab": data["model"]["vocab"], "merges": data["model"]["merges"]}
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()


def test_tiny_config():
    config, weights, tokenizer = tiny_model()
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm and not config.qkv_bias
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (512, 64, 176)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert (config.head_dim, config.rope_theta, config.rms_norm_eps) == (16, 10000.0, 1e-6)
    assert config.tie_word_embeddings and weights.lm_head is weights.embed
    assert tokenizer.vocab_size == config.vocab_size == 512
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [509, 510, 511]
    assert tokenizer.eos_token_id == 509 and tokenizer.id_to_token(509) == "<|endoftext|>"
    assert ModelConfig.from_dict(config.to_hf_dict()) == config


def test_tiny_weights_shapes_and_init():
    config, weights, _ = tiny_model()
    named = weights.named_tensors(config)
    assert {n: a.shape for n, a in named.items()} == expected_tensors(config)
    for name, array in named.items():
        assert array.dtype == np.float32 and array.flags.c_contiguous
        # on the bf16 grid, so a bf16 checkpoint holds it exactly
        assert np.array_equal(array.astype(ml_dtypes.bfloat16).astype(np.float32), array), name
        if array.ndim == 1:
            assert np.all(array == 1.0), name
        else:
            assert 0.015 < float(array.std()) < 0.025 and abs(float(array.mean())) < 0.005, name
    assert weights.layers[0].q_norm.shape == (16,) and weights.layers[0].q_bias is None


def test_tiny_is_deterministic():
    a_config, a, a_tok = tiny_model(seed=0)
    b_config, b, b_tok = tiny_model(seed=0)
    assert a_config == b_config and digest(a_config, a) == digest(b_config, b)
    assert a_tok.to_str() == b_tok.to_str()
    assert digest(a_config, tiny_model(seed=1)[1]) != digest(a_config, a)


def test_tiny_is_deterministic_across_processes():
    # The tokenizers library hashes with per-process random keys; our vocabulary must not depend on them.
    code = ("import test_tiny_model as t; from rlportable.model import tiny_model; "
            "c, w, _ = tiny_model(); print(t.vocab_digest(), t.digest(c, w))")
    env = dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    config, weights, _ = tiny_model()
    assert out.stdout.split() == [vocab_digest(), digest(config, weights)]


def test_tiny_pinned_digests():
    # Golden digests and recorded runs depend on these bits: a change here is a change of the tiny model
    # (this file's corpus or trainer, or NumPy's normal() stream) and must be deliberate.
    config, weights, _ = tiny_model()
    assert vocab_digest() == "56baa39c760c6ffb89d0a9e93e03df48279a3b11cb370a3d37c60a48616d9e18"
    assert digest(config, weights) == "1e4746e59f4704573dced5f16f317f71f273e46627628944377f7773df4ab941"


def test_tiny_tokenizer_basics():
    _, _, tokenizer = tiny_model()
    text = "What is 12+34? The answer is 46."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text)  # merges are in use
    digits = tokenizer.encode("1234567890")
    assert len(digits) == 10  # one token per digit
    assert tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}]) == \
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_save_load_bitwise(tmp_path):
    config, weights, tokenizer = tiny_model(seed=7)
    for dtype in ("bf16", "fp32"):
        directory = tmp_path / dtype
        save_safetensors(weights, config, directory, dtype=dtype)
        loaded_config = ModelConfig.from_file(directory / "config.json")
        assert loaded_config == ModelConfig.from_dict(config.to_hf_dict(
            torch_dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype]))
        loaded = load_weights(directory, loaded_config)
        assert digest(config, loaded) == digest(config, weights)
        assert loaded.lm_head is loaded.embed
        assert not [name for name in os.listdir(directory) if name.startswith(".tmp")]
    first = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    save_safetensors(weights, config, tmp_path / "bf16", dtype="bf16")  # overwrite in place
    assert (tmp_path / "bf16" / "model.safetensors").read_bytes() == first
    assert os.path.getsize(tmp_path / "fp32" / "model.safetensors") > 1.9 * len(first)

    save_model(tmp_path / "full", config, weights, tokenizer)
    loaded_config, loaded, loaded_tok = load_model(tmp_path / "full")
    assert loaded_config == config
    assert digest(config, loaded) == digest(config, weights)
    assert loaded_tok.to_str() == tokenizer.to_str()
    assert loaded_tok.chat_template == tokenizer.chat_template
    assert loaded_tok.stop_token_ids == tokenizer.stop_token_ids


def test_load_model_tiny():
    config, weights, tokenizer = load_model("tiny")
    reference = tiny_model()
    assert config == reference[0] and digest(config, weights) == digest(*reference[:2])
