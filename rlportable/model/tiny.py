"""The tiny built-in model (`--model tiny`): a 2-layer Qwen3 with its own tokenizer, no download.

Weights: seeded (numpy default_rng), normal(0, 0.02) matrices rounded to the
bfloat16 grid (as a real bf16 checkpoint; a bf16 save round-trips every bit),
ones for the norms, embeddings tied.

Tokenizer: byte-level BPE with Qwen2's pre-tokenizer (digits one by one), its
merges learnt at run time from a built-in corpus by the small trainer below,
not by the `tokenizers` trainer: the vocabulary is a function of this file
alone (ties between equally frequent pairs go to the smaller pair), so it is
the same on every machine and every `tokenizers` version.
"""

from __future__ import annotations

import functools
from collections import Counter

import ml_dtypes
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from rlportable.model.config import ModelConfig
from rlportable.model.tokenizer import Tokenizer
from rlportable.model.weights import ModelWeights, from_named, expected_tensors

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2's split: letters with one leading non-letter, single digits, punctuation runs, newlines, spaces.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = """
the answer is question what how many which when where who why because so then than that this these
those there their they them we you your our us he she it its his her him a an and or not no yes of
to in on at by for with from into over under after before between about above below up down out off
again once more most less least some any each every all both few other such only own same very can
will just should would could may might must do does did done doing have has had having be been being
am are was were is one two three four five six seven eight nine ten eleven twelve twenty thirty
hundred thousand number numbers sum total add adding added plus minus times divided multiply
subtract difference product equal equals result value values count first second third last next
step steps think thinking reason solve solution problem problems example examples check correct
wrong true false final compute calculate left right give given gives make made find found take
took use used using need needs want wants know known say said see seen look good great small big
large little long short new old high low same different number apple apples orange oranges book
books cat cats dog dogs day days year years time hour hours minute minutes people person man woman
child children money price cost costs buy bought sell sold pay paid half double each per rate
speed distance water tree trees house houses car cars box boxes bag bags ball balls red blue green
user assistant system message reply please thank thanks hello world yes sure okay let us start
""".split()


def _corpus() -> str:
    parts = [" ".join(_WORDS), " ".join(reversed(_WORDS)), " ".join(word.capitalize() for word in _WORDS)]
    for a in range(0, 100, 7):
        for b in range(3, 100, 11):
            parts.append(f"{a}+{b}={a + b} {a}*{b}={a * b} {max(a, b)}-{min(a, b)}={abs(a - b)}")
    parts += [
        "What is the sum of the numbers? The answer is the total of all the values.",
        "Let us think step by step, then give the final answer.",
        "If a box has 12 apples and you add 7 more, how many apples are there? There are 19 apples.",
        "The cat sat on the mat. The dog ran after the ball in the house.",
        "Question: how many hours are in two days? Answer: there are 48 hours in two days.",
        "Please check the result again; the correct answer should be an integer.",
    ]
    return "\n".join(parts) + "\n"


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _train_merges(words: Counter, num_tokens: int) -> list[tuple[str, str]]:
    """Plain BPE: merge the most frequent adjacent pair (ties: the smaller pair) until the
    merges have made num_tokens new tokens (or no pair is left)."""
    symbols = {word: tuple(word) for word in words}
    merges: list[tuple[str, str]] = []
    made: set[str] = set()
    while len(made) < num_tokens:
        pairs: Counter = Counter()
        for word, count in words.items():
            parts = symbols[word]
            for pair in zip(parts, parts[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda item: (-item[1], item[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        made.add(joined)
        for word, parts in symbols.items():
            if len(parts) < 2:
                continue
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == best[0] and parts[i + 1] == best[1]:
                    out.append(joined)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            symbols[word] = tuple(out)
    return merges


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """The tiny tokenizer, serialized (tokenizer.json contents); built once per process."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _BYTE_OF[ch])
    pre = _pre_tokenizer()
    words: Counter = Counter()
    for line in _corpus().splitlines(keepends=True):
        words.update(piece for piece, _ in pre.pre_tokenize_str(line))
    merges = _train_merges(words, VOCAB_SIZE - len(byte_chars) - len(SPECIAL_TOKENS))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return backend.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable character table, which ByteLevel uses.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF = {ch: byte for byte, ch in _bytes_to_unicode().items()}


def tiny_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer.from_str(tiny_tokenizer_json())
    stops = (backend.token_to_id("<|im_end|>"),)
    return Tokenizer(backend, bos_token=None, eos_token=EOS_TOKEN, chat_template=CHAT_TEMPLATE,
                     extra_stop_ids=stops, source="tiny tokenizer")


def tiny_config() -> ModelConfig:
    backend = tokenizers.Tokenizer.from_str(tiny_tokenizer_json())
    eos = (backend.token_to_id(EOS_TOKEN), backend.token_to_id("<|im_end|>"))
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=True,
        hidden_act="silu",
        torch_dtype="bfloat16",
        bos_token_id=None,
        eos_token_ids=eos,
    )


def tiny_weights(config: ModelConfig, seed: int = 0) -> ModelWeights:
    """Seeded weights for `config`: normal(0, 0.02) on the bf16 grid for matrices, ones for norms."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in expected_tensors(config).items():
        if len(shape) == 1:
            arrays[name] = np.ones(shape, dtype=np.float32)
        else:
            values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
            arrays[name] = np.ascontiguousarray(values.astype(ml_dtypes.bfloat16).astype(np.float32))
    return from_named(config, arrays)


def tiny_model(seed: int = 0) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    config = tiny_config()
    return config, tiny_weights(config, seed), tiny_tokenizer()


# The built-in Qwen3-MoE (`--model tiny-moe`): tiny-sft upcycled, so that GRPO on the built-in task has
# rewards with spread from its first step (a random-weight MoE model almost never answers, and all-zero
# rewards train nothing); docs/moe.md, "The built-in tiny-moe model".
TINY_MOE_EXPERTS = 4
TINY_MOE_ACTIVE = 2
TINY_MOE_EXPERT_NOISE = 0.01  # about a third of tiny-sft's MLP weights' spread: the experts differ, still answer


def tiny_moe_config(dense: ModelConfig) -> ModelConfig:
    """tiny-sft's shape as a Qwen3-MoE: layer 0 dense, layer 1 sparse (decoder_sparse_step 2) over
    TINY_MOE_EXPERTS experts of the dense MLP's width, TINY_MOE_ACTIVE active, renormalised; the
    load-balancing loss off (output_router_logits false, Qwen's checkpoints' setting)."""
    import dataclasses

    return dataclasses.replace(dense, architecture="Qwen3MoeForCausalLM", num_experts=TINY_MOE_EXPERTS,
                               num_experts_per_tok=TINY_MOE_ACTIVE, moe_intermediate_size=dense.intermediate_size,
                               norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=(),
                               router_aux_loss_coef=0.001, output_router_logits=False, raw={})


def upcycled_weights(dense_config: ModelConfig, dense: ModelWeights, config: ModelConfig,
                     seed: int = 0) -> ModelWeights:
    """`config`'s weights from a dense model of the same shape: every tensor the two share is the dense
    one; a sparse layer's router is normal(0, 0.02) on the bf16 grid (the tiny recipe) and each expert is
    the layer's dense MLP plus normal(0, TINY_MOE_EXPERT_NOISE), drawn from default_rng(seed) in
    checkpoint order."""
    rng = np.random.default_rng(seed)
    source = dense.named_tensors(dense_config)
    arrays = {}
    for name, shape in expected_tensors(config).items():
        if name in source:
            arrays[name] = np.array(source[name], dtype=np.float32, copy=True)
        elif name.endswith(".mlp.gate.weight"):
            values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
            arrays[name] = np.ascontiguousarray(values.astype(ml_dtypes.bfloat16).astype(np.float32))
        else:  # model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
            layer, _, rest = name.partition(".mlp.experts.")
            base = source[f"{layer}.mlp.{rest.split('.')[1]}.weight"]
            arrays[name] = (base + rng.normal(0.0, TINY_MOE_EXPERT_NOISE, size=shape)).astype(np.float32)
    return from_named(config, arrays)


def tiny_moe_model(seed: int = 0) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    """The built-in Qwen3-MoE: tiny-sft (the shipped SFT result) upcycled by tiny_moe_config and
    upcycled_weights; its tokenizer is tiny-sft's."""
    from rlportable.model.load import TINY_SFT, load_model

    dense_config, dense, tokenizer = load_model(TINY_SFT)
    config = tiny_moe_config(dense_config)
    return config, upcycled_weights(dense_config, dense, config, seed), tokenizer
