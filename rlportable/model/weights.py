"""Model weights: read and write Hugging Face safetensors checkpoints, all arrays float32.

The tensors are read and written by the safetensors library (its NumPy API: BF16 as
ml_dtypes.bfloat16, each file mapped lazily, tensor by tensor); BF16 and F16 widen to
float32 exactly. Before any tensor is read, every file's header is checked here (the
8-byte length, the JSON naming each tensor's dtype, shape and byte range): the header fits
in the file, every byte range fits in the data and matches its dtype and shape, every
tensor the config needs is there with its exact shape and nothing else is. That check is
ours rather than the library's so that each problem is one line naming the file and the
tensor (ModelError); a partial model is never returned.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from rlportable.model.config import ModelConfig, ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Bytes per element of every safetensors dtype (for the byte-range check).
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
READABLE_DTYPES = ("BF16", "F16", "F32")
SAVE_DTYPES = {"bf16": "BF16", "bfloat16": "BF16", "fp32": "F32", "float32": "F32"}
_TORCH_NAME = {"BF16": "bfloat16", "F32": "float32"}


@dataclass(eq=False)
class LayerWeights:
    """One decoder layer. Matrices are [out, in] as in torch.nn.Linear (y = x @ W.T).

    A sparse (Qwen3-MoE) layer has router and the expert_* lists, one matrix per expert, and no
    dense gate, up and down (None)."""

    attn_norm: np.ndarray              # [H]             input_layernorm
    q: np.ndarray                      # [Hq*D, H]
    k: np.ndarray                      # [Hkv*D, H]
    v: np.ndarray                      # [Hkv*D, H]
    o: np.ndarray                      # [H, Hq*D]
    mlp_norm: np.ndarray               # [H]             post_attention_layernorm
    gate: np.ndarray                   # [I, H]
    up: np.ndarray                     # [I, H]
    down: np.ndarray                   # [H, I]
    q_bias: np.ndarray | None = None   # [Hq*D]   Qwen2
    k_bias: np.ndarray | None = None   # [Hkv*D]  Qwen2
    v_bias: np.ndarray | None = None   # [Hkv*D]  Qwen2
    q_norm: np.ndarray | None = None   # [D]      Qwen3
    k_norm: np.ndarray | None = None   # [D]      Qwen3
    router: np.ndarray | None = None   # [E, H]   Qwen3-MoE sparse layers: mlp.gate
    expert_gate: list | None = None    # E x [Im, H]  mlp.experts.e.gate_proj
    expert_up: list | None = None      # E x [Im, H]  mlp.experts.e.up_proj
    expert_down: list | None = None    # E x [H, Im]  mlp.experts.e.down_proj


@dataclass(eq=False)
class ModelWeights:
    """All weights, float32 C-contiguous; lm_head IS embed (same object) when tied."""

    embed: np.ndarray                  # [V, H]
    layers: list[LayerWeights]
    final_norm: np.ndarray             # [H]
    lm_head: np.ndarray                # [V, H]

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed

    def named_tensors(self, config: ModelConfig) -> dict[str, np.ndarray]:
        """Hugging Face tensor names to arrays, in checkpoint order (no lm_head when tied)."""
        out = {"model.embed_tokens.weight": self.embed}
        for index, layer in enumerate(self.layers):
            out.update(layer_named(config, index, layer))
        out["model.norm.weight"] = self.final_norm
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head
        return out


def layer_named(config: ModelConfig, index: int, layer: LayerWeights) -> dict:
    """Layer `index`'s tensors by Hugging Face name. An expert held as None (another rank's, under expert
    parallelism: model/expert_parallel.py) has no name here."""
    named = ((name, _get(layer, attr)) for name, attr in _layer_names(config, index))
    return {name: array for name, array in named if array is not None or ".experts." not in name}


def _get(layer: LayerWeights, attr: str):
    """The array an attribute path names: "q", or "expert_gate.3" for one expert's matrix."""
    name, _, expert = attr.partition(".")
    value = getattr(layer, name)
    return value[int(expert)] if expert else value


def _layer_names(config: ModelConfig, index: int) -> list[tuple[str, str]]:
    prefix = f"model.layers.{index}."
    names = [("input_layernorm.weight", "attn_norm"),
             ("self_attn.q_proj.weight", "q")]
    if config.qkv_bias:
        names.append(("self_attn.q_proj.bias", "q_bias"))
    names.append(("self_attn.k_proj.weight", "k"))
    if config.qkv_bias:
        names.append(("self_attn.k_proj.bias", "k_bias"))
    names.append(("self_attn.v_proj.weight", "v"))
    if config.qkv_bias:
        names.append(("self_attn.v_proj.bias", "v_bias"))
    names.append(("self_attn.o_proj.weight", "o"))
    if config.qk_norm:
        names += [("self_attn.q_norm.weight", "q_norm"), ("self_attn.k_norm.weight", "k_norm")]
    names.append(("post_attention_layernorm.weight", "mlp_norm"))
    if config.sparse_layer(index):  # Hugging Face's names, expert by expert
        names.append(("mlp.gate.weight", "router"))
        for expert in range(config.num_experts):
            names += [(f"mlp.experts.{expert}.{proj}_proj.weight", f"expert_{proj}.{expert}")
                      for proj in ("gate", "up", "down")]
    else:
        names += [("mlp.gate_proj.weight", "gate"),
                  ("mlp.up_proj.weight", "up"),
                  ("mlp.down_proj.weight", "down")]
    return [(prefix + name, attr) for name, attr in names]


_LAYER_SHAPES = {
    "attn_norm": lambda c: (c.hidden_size,),
    "q": lambda c: (c.q_size, c.hidden_size),
    "k": lambda c: (c.kv_size, c.hidden_size),
    "v": lambda c: (c.kv_size, c.hidden_size),
    "o": lambda c: (c.hidden_size, c.q_size),
    "q_bias": lambda c: (c.q_size,),
    "k_bias": lambda c: (c.kv_size,),
    "v_bias": lambda c: (c.kv_size,),
    "q_norm": lambda c: (c.head_dim,),
    "k_norm": lambda c: (c.head_dim,),
    "mlp_norm": lambda c: (c.hidden_size,),
    "gate": lambda c: (c.intermediate_size, c.hidden_size),
    "up": lambda c: (c.intermediate_size, c.hidden_size),
    "down": lambda c: (c.hidden_size, c.intermediate_size),
    "router": lambda c: (c.num_experts, c.hidden_size),
    "expert_gate": lambda c: (c.moe_intermediate_size, c.hidden_size),
    "expert_up": lambda c: (c.moe_intermediate_size, c.hidden_size),
    "expert_down": lambda c: (c.hidden_size, c.moe_intermediate_size),
}


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, with its shape, in checkpoint order."""
    out = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for index in range(config.num_hidden_layers):
        for name, attr in _layer_names(config, index):
            out[name] = _LAYER_SHAPES[attr.partition(".")[0]](config)
    out["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return out


def _ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES)


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a safetensors header; offsets are absolute positions in the file."""

    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def read_header(path: str) -> dict[str, TensorEntry]:
    """Parse and check a safetensors file's header; no tensor data is read."""

    def fail(problem: str) -> ModelError:
        return ModelError(f"{path}: {problem}")

    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise fail(f"truncated: {size} bytes, too short for the 8-byte header length")
            header_len = int.from_bytes(prefix, "little")
            if header_len > size - 8:
                raise fail(f"truncated or corrupt: header length {header_len} runs past the end of the "
                           f"file ({size} bytes)")
            if header_len > MAX_HEADER_BYTES:
                raise fail(f"corrupt: header length {header_len} is over the {MAX_HEADER_BYTES}-byte limit")
            raw = handle.read(header_len)
    except FileNotFoundError:
        raise fail("no such file") from None
    except OSError as error:
        raise fail(f"cannot be read: {error.strerror or error}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise fail(f"corrupt header, not valid JSON: {' '.join(str(error).split())}") from None
    if not isinstance(header, dict):
        raise fail("corrupt header: not a JSON object")
    data_start = 8 + header_len
    data_size = size - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise fail(f"tensor {name}: corrupt header entry {info!r}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise fail(f"tensor {name}: corrupt header entry, dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise fail(f"tensor {name}: corrupt header entry, shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise fail(f"tensor {name}: corrupt header entry, data_offsets {offsets!r}")
        begin, end = offsets
        if end > data_size:
            raise fail(f"tensor {name}: truncated: data_offsets [{begin}, {end}] run past the end of the "
                       f"data ({data_size} bytes)")
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise fail(f"tensor {name}: corrupt: data_offsets [{begin}, {end}] hold {end - begin} bytes but "
                       f"{dtype} {shape} needs {math.prod(shape) * itemsize}")
        entries[name] = TensorEntry(path, name, dtype, tuple(shape), data_start + begin, data_start + end)
    return entries


def _finite(array: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """The array, or ModelError naming the first NaN or inf (one would poison every output it reaches)."""
    if np.isfinite(array).all():
        return array
    bad = ~np.isfinite(array)
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ModelError(f"{entry.path}: tensor {entry.name}: {array[index]} at index {list(index)} "
                     f"({int(bad.sum())} non-finite values); weights must be finite")


def _read_tensors(entries: list[TensorEntry]) -> dict[str, np.ndarray]:
    """The entries' tensors as float32, through the library (headers already checked by read_header)."""
    out: dict[str, np.ndarray] = {}
    by_file: dict[str, list[TensorEntry]] = {}
    for entry in entries:
        by_file.setdefault(entry.path, []).append(entry)
    for path, group in by_file.items():
        try:
            with safetensors.safe_open(path, framework="numpy") as handle:
                for entry in group:
                    array = np.ascontiguousarray(handle.get_tensor(entry.name), dtype=np.float32)
                    out[entry.name] = _finite(array, entry)
        except OSError as error:
            raise ModelError(f"{path}: cannot be read: {error.strerror or error}") from None
        except safetensors.SafetensorError as error:  # a file changed since its header was checked
            raise ModelError(f"{path}: cannot be read: {' '.join(str(error).split())}") from None
    return out


def _locate(directory: str) -> tuple[str, dict[str, TensorEntry]]:
    """(the file to name for missing tensors, every tensor entry in the checkpoint)."""
    single = os.path.join(directory, SINGLE_FILE)
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(single):
        return single, read_header(single)
    if not os.path.isfile(index_path):
        raise ModelError(f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}")
    try:
        with open(index_path, encoding="utf-8") as handle:
            index = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{index_path}: not a readable JSON file: {' '.join(str(error).split())}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelError(f"{index_path}: no 'weight_map' object of tensor name -> shard file")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise ModelError(f"{index_path}: shard name {shard!r} is not a file name in the directory")
        if not os.path.isfile(os.path.join(directory, shard)):
            first = next(name for name, file in weight_map.items() if file == shard)
            raise ModelError(f"{index_path}: shard {shard} (holding {first}) is missing")
    entries: dict[str, TensorEntry] = {}
    for shard in shards:
        shard_path = os.path.join(directory, shard)
        for name, entry in read_header(shard_path).items():
            if _ignored(name):
                continue
            if weight_map.get(name) != shard:
                where = "not listed" if name not in weight_map else f"listed in {weight_map[name]}"
                raise ModelError(f"{shard_path}: tensor {name} is {where} in {INDEX_FILE}")
            entries[name] = entry
    for name, shard in weight_map.items():
        if name not in entries and not _ignored(name):
            raise ModelError(f"{os.path.join(directory, shard)}: tensor {name} listed in {INDEX_FILE} "
                             "is not in this file")
    return index_path, entries


def load_weights(directory: str | os.PathLike, config: ModelConfig) -> ModelWeights:
    """Read model.safetensors (or the shards of model.safetensors.index.json) for `config`."""
    directory = os.fspath(directory)
    main_file, entries = _locate(directory)
    expected = expected_tensors(config)
    problems: list[str] = []
    for name, shape in expected.items():
        entry = entries.get(name)
        if entry is None:
            problems.append(f"{main_file}: missing tensor {name} (shape {list(shape)})")
        elif entry.shape != shape:
            problems.append(f"{entry.path}: tensor {name} has shape {list(entry.shape)}, expected {list(shape)} "
                            f"for this {config.architecture} config")
        elif entry.dtype not in READABLE_DTYPES:
            problems.append(f"{entry.path}: tensor {name} has dtype {entry.dtype}; supported: "
                            f"{', '.join(READABLE_DTYPES)}")
    tied_head = None
    for name, entry in entries.items():
        if name in expected or _ignored(name):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            # Some tied checkpoints store the head anyway; it must equal the embedding.
            shape = (config.vocab_size, config.hidden_size)
            if entry.shape != shape or entry.dtype not in READABLE_DTYPES:
                problems.append(f"{entry.path}: tensor {name} ({entry.dtype} {list(entry.shape)}) does not "
                                f"match the tied embedding ({list(shape)})")
            tied_head = entry
            continue
        problems.append(f"{entry.path}: unexpected tensor {name} (not part of a {config.architecture} "
                        "with this config)")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ModelError(problems[0] + more)

    wanted = [entries[name] for name in expected] + ([tied_head] if tied_head else [])
    arrays = _read_tensors(wanted)
    if tied_head is not None:
        head = arrays.pop("lm_head.weight")
        if not np.array_equal(head.view(np.uint32), arrays["model.embed_tokens.weight"].view(np.uint32)):
            raise ModelError(f"{tied_head.path}: tensor lm_head.weight differs from model.embed_tokens.weight "
                             "but tie_word_embeddings is true")
    return from_named(config, arrays)


def from_named(config: ModelConfig, arrays: dict[str, np.ndarray]) -> ModelWeights:
    """ModelWeights from Hugging Face tensor names (named_tensors' inverse)."""
    layers = []
    for index in range(config.num_hidden_layers):
        fields: dict = {"gate": None, "up": None, "down": None}
        for name, attr in _layer_names(config, index):
            field_name, _, expert = attr.partition(".")
            if expert:  # the names come expert by expert, so each list fills in order
                fields.setdefault(field_name, []).append(arrays[name])
            else:
                fields[field_name] = arrays[name]
        layers.append(LayerWeights(**fields))
    embed = arrays["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else arrays["lm_head.weight"]
    return ModelWeights(embed=embed, layers=layers, final_norm=arrays["model.norm.weight"], lm_head=lm_head)


def check_weights(weights: ModelWeights, config: ModelConfig) -> None:
    """Raise ModelError unless `weights` has exactly the arrays `config` needs (float32, shapes, tying)."""
    if len(weights.layers) != config.num_hidden_layers:
        raise ModelError(f"weights have {len(weights.layers)} layers, config has {config.num_hidden_layers}")
    if config.tie_word_embeddings != weights.tied:
        raise ModelError(f"config tie_word_embeddings={config.tie_word_embeddings} but lm_head "
                         f"{'is' if weights.tied else 'is not'} the embedding array")
    expected = expected_tensors(config)
    for name, array in weights.named_tensors(config).items():
        if not isinstance(array, np.ndarray) or array.dtype != np.float32:
            raise ModelError(f"weight {name} is not a float32 NumPy array")
        if array.shape != expected[name]:
            raise ModelError(f"weight {name} has shape {list(array.shape)}, expected {list(expected[name])}")
    for index, layer in enumerate(weights.layers):
        for attr, wanted in (("q_bias", config.qkv_bias), ("k_bias", config.qkv_bias),
                             ("v_bias", config.qkv_bias), ("q_norm", config.qk_norm), ("k_norm", config.qk_norm)):
            if not wanted and getattr(layer, attr) is not None:
                raise ModelError(f"layer {index} has {attr} but the {config.architecture} config has none")


# ----------------------------------------------------------------------------- writing


def atomic_write(path: str, chunks) -> None:
    """Write the byte chunks to `path` atomically (a temporary file beside it, synced, then renamed)."""
    def write(name: str) -> None:
        with open(name, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)

    _atomic(path, write)


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: the process's umask, read once at import (reading it means setting it, which threads must not race)
UMASK = _current_umask()


def _atomic(path: str, write) -> None:
    """write(temporary name) beside `path`, sync it, rename it to `path`; no trace left on failure. The
    file gets the permissions an ordinary open would give it (0666 less the umask), not the temporary
    file's 0600, so that another user's job on a shared filesystem can read what is saved."""
    directory = os.path.dirname(path) or "."
    handle = tempfile.NamedTemporaryFile("wb", dir=directory, prefix=".tmp-" + os.path.basename(path) + "-",
                                         delete=False)
    handle.close()
    try:
        write(handle.name)
        os.chmod(handle.name, 0o666 & ~UMASK)  # after the write: a writer may replace the file it was given
        with open(handle.name, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(handle.name, path)
    except BaseException:
        try:
            os.unlink(handle.name)
        except OSError:
            pass
        raise


_NUMPY_DTYPE = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}


def write_safetensors(path: str, tensors: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    """Write float32 arrays as one safetensors file (BF16 rounds to nearest even), atomically, through
    the library."""
    arrays = {name: np.ascontiguousarray(np.asarray(array, dtype=np.float32).astype(_NUMPY_DTYPE[dtype]))
              for name, array in tensors.items()}
    _atomic(path, lambda name: safetensors.numpy.save_file(arrays, name, metadata={"format": "pt"}))


def save_safetensors(weights: ModelWeights, config: ModelConfig, directory: str | os.PathLike,
                     dtype: str = "bf16") -> None:
    """Write config.json + model.safetensors (bf16 or fp32) into `directory`, each file atomically.

    The result loads with transformers' from_pretrained and with load_weights.
    bf16 rounds each float32 to nearest even (bitwise round trip only for
    weights already on the bf16 grid); fp32 round-trips every bit.
    """
    directory = os.fspath(directory)
    st_dtype = SAVE_DTYPES.get(dtype)
    if st_dtype is None:
        raise ModelError(f"cannot save weights as {dtype!r}; choose one of {', '.join(SAVE_DTYPES)}")
    check_weights(weights, config)
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, SINGLE_FILE), weights.named_tensors(config), st_dtype)
    text = json.dumps(config.to_hf_dict(torch_dtype=_TORCH_NAME[st_dtype]), indent=2) + "\n"
    atomic_write(os.path.join(directory, "config.json"), [text.encode("utf-8")])
