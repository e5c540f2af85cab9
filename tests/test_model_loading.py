import json

import numpy as np
import pytest

from rlportable.model import ModelConfig, ModelError, RopeScaling, load_model, load_weights, save_model, tiny_model
from rlportable.model.tokenizer import load_tokenizer
from rlportable.model.weights import expected_tensors, read_header, write_safetensors

ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def bits(array):
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


def assert_one_line_error(excinfo, *parts):
    message = str(excinfo.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, (part, message)


# ----------------------------------------------------------------------------- Hugging Face checkpoints


def hf_checkpoint(directory, arch, dtype="bfloat16", shard=None, tie=False):
    """A random small model built and saved by transformers; returns its state dict as float32."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tie, rms_norm_eps=1e-5)
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
    else:
        config = transformers.LlamaConfig(rope_scaling=dict(ROPE_LLAMA3), **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # every tensor random (norms and biases too), so none is checked by luck
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("dtype,shard", [("bfloat16", None), ("float32", None), ("float16", None),
                                         ("bfloat16", "20KB")])
def test_hf_checkpoint_loads_bitwise(tmp_path, arch, dtype, shard):
    state = hf_checkpoint(tmp_path, arch, dtype, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert not (tmp_path / "model.safetensors").exists()
    config = ModelConfig.from_file(tmp_path / "config.json")
    weights = load_weights(tmp_path, config)
    named = weights.named_tensors(config)
    assert set(named) == {name for name in state if not name.endswith("rotary_emb.inv_freq")}
    for name, array in named.items():
        assert array.dtype == np.float32 and array.flags.c_contiguous
        assert np.array_equal(bits(array), bits(state[name])), name
    layer = weights.layers[1]
    assert (layer.q_bias is not None) == (arch == "qwen2")
    assert (layer.q_norm is not None) == (arch == "qwen3")
    assert weights.lm_head is not weights.embed


def test_hf_config_fields(tmp_path):
    hf_checkpoint(tmp_path / "q3", "qwen3")
    hf_checkpoint(tmp_path / "q2", "qwen2")
    hf_checkpoint(tmp_path / "ll", "llama")
    q3 = ModelConfig.from_file(tmp_path / "q3" / "config.json")
    q2 = ModelConfig.from_file(tmp_path / "q2" / "config.json")
    ll = ModelConfig.from_file(tmp_path / "ll" / "config.json")
    assert (q3.architecture, q3.head_dim, q3.qk_norm, q3.qkv_bias) == ("Qwen3ForCausalLM", 16, True, False)
    assert (q2.architecture, q2.head_dim, q2.qk_norm, q2.qkv_bias) == ("Qwen2ForCausalLM", 8, False, True)
    assert (ll.architecture, ll.head_dim, ll.qk_norm, ll.qkv_bias) == ("LlamaForCausalLM", 8, False, False)
    for config in (q3, q2, ll):
        assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (96, 32, 48)
        assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
        assert (config.rms_norm_eps, config.rope_theta, config.max_position_embeddings) == (1e-5, 10000.0, 128)
        assert config.tie_word_embeddings is False
        assert config.torch_dtype == "bfloat16"
    assert q3.rope_scaling is None and q2.rope_scaling is None
    assert ll.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


def test_hf_tied_checkpoint(tmp_path):
    state = hf_checkpoint(tmp_path, "qwen3", tie=True)
    config = ModelConfig.from_file(tmp_path / "config.json")
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in read_header(str(tmp_path / "model.safetensors"))
    weights = load_weights(tmp_path, config)
    assert weights.lm_head is weights.embed and weights.tied
    assert np.array_equal(bits(weights.embed), bits(state["model.embed_tokens.weight"]))


def test_tied_checkpoint_that_stores_the_head_anyway(tmp_path):
    config, weights, tokenizer = tiny_model()
    save_model(tmp_path, config, weights, tokenizer, dtype="fp32")
    tensors = weights.named_tensors(config)
    write_safetensors(str(tmp_path / "model.safetensors"), {**tensors, "lm_head.weight": weights.embed}, "F32")
    loaded = load_model(tmp_path)[1]
    assert loaded.lm_head is loaded.embed
    other = weights.embed.copy()
    other[3, 5] += 1.0
    write_safetensors(str(tmp_path / "model.safetensors"), {**tensors, "lm_head.weight": other}, "F32")
    with pytest.raises(ModelError) as excinfo:
        load_model(tmp_path)
    assert_one_line_error(excinfo, "model.safetensors", "lm_head.weight", "tie_word_embeddings")


def test_transformers_loads_what_we_save(tmp_path):
    transformers = pytest.importorskip("transformers")
    config, weights, tokenizer = tiny_model(seed=3)
    for dtype in ("bf16", "fp32"):
        save_model(tmp_path / dtype, config, weights, tokenizer, dtype=dtype)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / dtype)
        state = model.state_dict()
        named = weights.named_tensors(config)
        assert set(named) | {"lm_head.weight"} == set(state)
        for name, array in named.items():
            assert np.array_equal(bits(state[name].float().numpy()), bits(array)), name
        assert model.config.tie_word_embeddings
        assert model.config.head_dim == 16 and model.config.num_key_value_heads == 2


# ----------------------------------------------------------------------------- config.json parsing

QWEN3_0_6B = {  # transformers-4 spelling, as on the hub
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_hub_configs_parse():
    q3 = ModelConfig.from_dict(QWEN3_0_6B)
    assert (q3.head_dim, q3.q_size, q3.kv_size, q3.rope_theta, q3.tie_word_embeddings) == (128, 2048, 1024, 1e6, True)
    assert (q3.bos_token_id, q3.eos_token_ids, q3.qk_norm) == (151643, (151645,), True)
    ll = ModelConfig.from_dict(LLAMA_3_2_1B)
    assert ll.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert (ll.head_dim, ll.rope_theta, ll.eos_token_ids) == (64, 500000.0, (128001, 128008, 128009))
    q2 = ModelConfig.from_dict(QWEN2_5_0_5B)
    assert (q2.head_dim, q2.num_key_value_heads, q2.qkv_bias, q2.rms_norm_eps) == (64, 2, True, 1e-6)
    # transformers-5 spelling of the same Llama config
    v5 = {k: v for k, v in LLAMA_3_2_1B.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    v5["rope_parameters"] = {**LLAMA_3_2_1B["rope_scaling"], "rope_theta": 500000.0}
    v5["dtype"] = "bfloat16"
    assert ModelConfig.from_dict(v5) == ll
    for data in (QWEN3_0_6B, LLAMA_3_2_1B, QWEN2_5_0_5B):
        config = ModelConfig.from_dict(data)
        assert ModelConfig.from_dict(config.to_hf_dict()) == config
        assert ModelConfig.from_dict(config.to_hf_dict(torch_dtype="float32")).torch_dtype == "float32"


def test_config_defaults_follow_transformers():
    minimal = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
               "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = ModelConfig.from_dict(minimal)
    assert (config.num_key_value_heads, config.head_dim, config.max_position_embeddings) == (2, 4, 2048)
    assert (config.rope_theta, config.rope_scaling, config.rms_norm_eps) == (10000.0, None, 1e-6)
    assert ModelConfig.from_dict({**minimal, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    assert ModelConfig.from_dict({**minimal, "rope_scaling": {"type": "default"}}).rope_scaling is None
    qwen3 = ModelConfig.from_dict({**minimal, "architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 2})
    assert qwen3.head_dim == 128  # Qwen3Config's default, as in transformers


@pytest.mark.parametrize("change,words", [
    ({"architectures": ["MistralForCausalLM"]}, ["unsupported architecture", "MistralForCausalLM"]),
    ({"architectures": None, "model_type": "gpt2"}, ["model_type", "gpt2"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "gelu"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["yarn", "not supported"]),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, ["linear"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["low_freq_factor"]),
    ({"use_sliding_window": True}, ["use_sliding_window"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads"]),
    ({"vocab_size": 0}, ["vocab_size"]),
    ({"hidden_size": "64"}, ["hidden_size"]),
    ({"torch_dtype": "int8"}, ["torch_dtype"]),
    ({"rms_norm_eps": -1.0}, ["rms_norm_eps"]),
    ({"layer_types": ["full_attention", "sliding_attention"]}, ["layer_types"]),
])
def test_config_errors(tmp_path, change, words):
    data = {**QWEN3_0_6B, **change}
    if data.get("architectures") is None:
        del data["architectures"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ModelError) as excinfo:
        ModelConfig.from_file(path)
    assert_one_line_error(excinfo, str(path), *words)


def test_config_missing_field_and_bad_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in QWEN3_0_6B.items() if k != "intermediate_size"}))
    with pytest.raises(ModelError) as excinfo:
        ModelConfig.from_file(path)
    assert_one_line_error(excinfo, str(path), "intermediate_size")
    path.write_text('{"architectures": [')
    with pytest.raises(ModelError) as excinfo:
        ModelConfig.from_file(path)
    assert_one_line_error(excinfo, str(path), "JSON")


# ----------------------------------------------------------------------------- broken weight files


@pytest.fixture()
def tiny_dir(tmp_path):
    config, weights, tokenizer = tiny_model()
    save_model(tmp_path, config, weights, tokenizer, dtype="bf16")
    return tmp_path, config, weights


def write_raw(path, entries):
    """A safetensors file written by hand: entries are (name, dtype, shape, bytes)."""
    header, offset, blobs = {}, 0, []
    for name, dtype, shape, blob in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def tiny_entries(config, weights, dtype="F32"):
    out = []
    for name, array in weights.named_tensors(config).items():
        out.append((name, dtype, array.shape, array.astype("<f4").tobytes()))
    return out


def load_error(directory, config):
    with pytest.raises(ModelError) as excinfo:
        load_weights(directory, config)
    return excinfo


def test_truncated_file(tiny_dir):
    directory, config, _ = tiny_dir
    path = directory / "model.safetensors"
    data = path.read_bytes()
    last = list(read_header(str(path)))[-1]
    path.write_bytes(data[:-10])
    assert_one_line_error(load_error(directory, config), str(path), last, "truncated")
    path.write_bytes(data[:5])
    assert_one_line_error(load_error(directory, config), str(path), "truncated")
    path.write_bytes((10**9).to_bytes(8, "little") + data[8:100])
    assert_one_line_error(load_error(directory, config), str(path), "header length", "past the end")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_nonfinite_weight_names_tensor_and_index(tiny_dir, value, dtype):
    """A NaN or inf weight is refused at load, naming the file, the tensor and the first bad index."""
    directory, config, weights = tiny_dir
    entries = []
    for name, array in weights.named_tensors(config).items():
        array = array.copy()
        if name == "model.layers.1.mlp.up_proj.weight":
            array[3, 5] = value
            array[7, 0] = value
        blob = (array.astype("<f4").tobytes() if dtype == "F32"
                else (array.view(np.uint32) >> 16).astype("<u2").tobytes())
        entries.append((name, dtype, array.shape, blob))
    write_raw(directory / "model.safetensors", entries)
    assert_one_line_error(load_error(directory, config), "model.safetensors", "model.layers.1.mlp.up_proj.weight",
                          "index [3, 5]", "2 non-finite")


def test_corrupt_header(tiny_dir):
    directory, config, _ = tiny_dir
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("[")
    data[9] = ord("!")
    path.write_bytes(bytes(data))
    assert_one_line_error(load_error(directory, config), str(path), "JSON")


def test_offsets_that_do_not_match_the_shape(tiny_dir, tmp_path):
    directory, config, weights = tiny_dir
    entries = tiny_entries(config, weights)
    name, dtype, shape, blob = entries[1]
    entries[1] = (name, dtype, shape, blob[:-4])
    write_raw(directory / "model.safetensors", entries)
    assert_one_line_error(load_error(directory, config), "model.safetensors", name, "corrupt")


@pytest.mark.parametrize("problem", ["wrong_shape", "missing", "extra", "bad_dtype", "f64"])
def test_tensor_set_errors(tiny_dir, problem):
    directory, config, weights = tiny_dir
    entries = tiny_entries(config, weights)
    target = "model.layers.1.mlp.up_proj.weight"
    index = [e[0] for e in entries].index(target)
    name, dtype, shape, blob = entries[index]
    if problem == "wrong_shape":
        entries[index] = (name, dtype, (shape[1], shape[0]), blob)
        words = [target, "shape [64, 176]", "expected [176, 64]"]
    elif problem == "missing":
        del entries[index]
        words = ["missing tensor", target]
    elif problem == "extra":
        entries.append(("model.layers.2.mlp.up_proj.weight", "F32", shape, blob))
        entries.append(("model.layers.0.self_attn.rotary_emb.inv_freq", "F32", (8,), bytes(32)))
        words = ["unexpected tensor", "model.layers.2.mlp.up_proj.weight"]
    elif problem == "bad_dtype":
        entries[index] = (name, "I32", shape, blob)
        words = [target, "dtype I32"]
    else:
        entries[index] = (name, "F64", shape, blob + blob)
        words = [target, "dtype F64"]
    write_raw(directory / "model.safetensors", entries)
    assert_one_line_error(load_error(directory, config), "model.safetensors", *words)


def test_fp16_file_written_by_hand_loads(tiny_dir):
    directory, config, weights = tiny_dir
    entries = [(n, "F16", s, np.frombuffer(b, "<f4").astype("<f2").tobytes())
               for n, _, s, b in tiny_entries(config, weights)]
    write_raw(directory / "model.safetensors", entries)
    loaded = load_weights(directory, config)
    assert np.array_equal(loaded.embed, weights.embed.astype(np.float16).astype(np.float32))


def test_sharded_errors(tiny_dir):
    directory, config, weights = tiny_dir
    (directory / "model.safetensors").unlink()
    entries = tiny_entries(config, weights)
    write_raw(directory / "a.safetensors", entries[:10])
    write_raw(directory / "b.safetensors", entries[10:])
    weight_map = {e[0]: "a.safetensors" for e in entries[:10]} | {e[0]: "b.safetensors" for e in entries[10:]}
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_weights(directory, config)
    assert np.array_equal(bits(loaded.layers[1].down), bits(weights.layers[1].down))

    moved = entries[12][0]
    index.write_text(json.dumps({"weight_map": {**weight_map, moved: "a.safetensors"}}))
    assert_one_line_error(load_error(directory, config), "b.safetensors", moved, "listed in a.safetensors")

    index.write_text(json.dumps({"weight_map": {**weight_map, "model.norm.weight": "c.safetensors"}}))
    assert_one_line_error(load_error(directory, config), "model.safetensors.index.json", "c.safetensors",
                          "missing")

    index.write_text(json.dumps({"weight_map": {**weight_map, "extra.weight": "a.safetensors"}}))
    assert_one_line_error(load_error(directory, config), "a.safetensors", "extra.weight", "is not in this file")

    index.write_text(json.dumps({"weight_map": {**weight_map, "x": "../a.safetensors"}}))
    assert_one_line_error(load_error(directory, config), "model.safetensors.index.json", "../a.safetensors")

    index.write_text("{not json")
    assert_one_line_error(load_error(directory, config), "model.safetensors.index.json", "JSON")

    index.unlink()
    assert_one_line_error(load_error(directory, config), str(directory), "no model.safetensors")


def test_load_model_errors(tmp_path, tiny_dir):
    with pytest.raises(ModelError) as excinfo:
        load_model(tmp_path / "nowhere")
    assert_one_line_error(excinfo, "nowhere", "no such directory")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ModelError) as excinfo:
        load_model(tmp_path / "afile")
    assert_one_line_error(excinfo, "afile", "not a directory")
    directory = tiny_dir[0]
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ModelError) as excinfo:
        load_model(directory)
    assert_one_line_error(excinfo, str(directory), "tokenizer.json")
    (directory / "config.json").unlink()
    with pytest.raises(ModelError) as excinfo:
        load_model(directory)
    assert_one_line_error(excinfo, str(directory), "config.json")


def test_no_partial_model_on_error(tiny_dir):
    directory, config, weights = tiny_dir
    entries = tiny_entries(config, weights)
    write_raw(directory / "model.safetensors", entries[:-1])  # model.norm.weight missing
    with pytest.raises(ModelError):
        load_model(directory)


def test_expected_tensors_per_architecture():
    q2 = ModelConfig.from_dict(QWEN2_5_0_5B)
    names = expected_tensors(q2)
    assert names["model.layers.0.self_attn.q_proj.bias"] == (896,)
    assert names["model.layers.0.self_attn.k_proj.bias"] == (128,)
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_norm.weight" not in names
    assert len(names) == 1 + 24 * 12 + 1


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tiny_dir):
    directory, config, _ = tiny_dir
    tokenizer = load_tokenizer(directory, config)
    for text in ["What is 12+34? The answer is 46.", "naïve café 😀 — ünïcödé\n\n\ttabs  spaces ",
                 "<|im_start|>user\nhi<|im_end|>\n", ""]:
        ids = tokenizer.encode(text)
        assert all(0 <= i < config.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_end|>") == [tokenizer.token_to_id("<|im_end|>")]
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.bos_token_id is None
    assert tokenizer.vocab_size == 512
    assert tokenizer.stop_token_ids == (tokenizer.eos_token_id, tokenizer.token_to_id("<|im_end|>"))
    assert "<|im_start|>" in tokenizer.chat_template


def test_tokenizer_vocab_larger_than_model(tiny_dir):
    directory, config, _ = tiny_dir
    data = json.loads((directory / "config.json").read_text())
    data["vocab_size"] = 400
    (directory / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelError) as excinfo:
        load_model(directory)
    assert_one_line_error(excinfo, "tokenizer.json", "512", "400")


def test_tokenizer_config_variants(tiny_dir):
    directory, config, _ = tiny_dir
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["eos_token"] = {"content": "<|im_end|>", "special": True}
    settings["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [509, 511]}))
    tokenizer = load_tokenizer(directory, config)
    assert tokenizer.eos_token_id == 511 and tokenizer.stop_token_ids == (511, 509)
    assert tokenizer.chat_template == "{{ messages[0]['content'] }}"
    (directory / "chat_template.jinja").write_text("X{{ messages[0]['content'] }}")
    assert load_tokenizer(directory, config).chat_template == "X{{ messages[0]['content'] }}"
    settings["eos_token"] = "<|nope|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelError) as excinfo:
        load_tokenizer(directory, config)
    assert_one_line_error(excinfo, "tokenizer.json", "<|nope|>")
    (directory / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelError) as excinfo:
        load_tokenizer(directory, config)
    assert_one_line_error(excinfo, "tokenizer.json")


def test_chat_template_without_jinja2(tiny_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_jinja(name, *args, **kwargs):
        if name == "jinja2" or name.startswith("jinja2."):
            raise ImportError("no jinja2")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jinja)
    tokenizer = load_tokenizer(tiny_dir[0], tiny_dir[1])
    with pytest.raises(ModelError) as excinfo:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert_one_line_error(excinfo, "jinja2")


def test_chat_template_and_encoding_match_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    directory, config, _ = tiny_dir
    ours = load_tokenizer(directory, config)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in ["What is 12+34? The answer is 46.", "naïve café 😀\n\n  x", "<|im_start|>user\nhi<|im_end|>"]:
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    for generation in (True, False):
        assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation) == \
            ours.apply_chat_template(messages, add_generation_prompt=generation)
    assert ours.apply_chat_template(messages, tokenize=True) == ours.encode(ours.apply_chat_template(messages))
    assert theirs.eos_token_id == ours.eos_token_id
