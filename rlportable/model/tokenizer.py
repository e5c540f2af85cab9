"""Tokenizer: a Hugging Face tokenizer.json (through the `tokenizers` library) plus its chat template.

tokenizer_config.json, when present, gives the bos/eos tokens and the chat
template (a `chat_template.jinja` file next to it wins, as in transformers).
Rendering a chat template needs jinja2, which rlportable does not depend on:
apply_chat_template says so when it is missing; everything else works
without it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import tokenizers

from rlportable.model.config import ModelConfig, ModelError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"


class Tokenizer:
    """encode/decode, the special token ids and the raw chat template of one model.

    vocab_size is the largest token id + 1 (added tokens included); the model's
    embedding may be larger (padded), never smaller. stop_token_ids is eos plus
    any other end ids the model's config.json / generation_config.json name.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, chat_template: str | None = None,
                 extra_stop_ids: tuple[int, ...] = (), source: str = "tokenizer",
                 settings: dict | None = None):
        self.backend = backend
        self.settings = dict(settings or {})  # tokenizer_config.json as read, written back by save()
        self.source = source
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self.bos_token_id = self._token_id(bos_token, "bos_token")
        self.eos_token_id = self._token_id(eos_token, "eos_token")
        stops = ([self.eos_token_id] if self.eos_token_id is not None else []) + list(extra_stop_ids)
        self.stop_token_ids = tuple(dict.fromkeys(stops))

    def _token_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ModelError(f"{self.source}: {what} {token!r} is not in the vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. No BOS or other post-processor tokens unless asked: a chat
        template already writes them as text."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any):
        """Render the chat template as transformers does (jinja2 sandbox, trim_blocks, lstrip_blocks)."""
        if self.chat_template is None:
            raise ModelError(f"{self.source}: the model has no chat template")
        try:
            import jinja2  # noqa: F401
        except ImportError:
            raise ModelError("applying a chat template needs jinja2, which is not installed "
                             "(pip install jinja2)") from None
        template = _compile(self.chat_template)
        import jinja2.exceptions

        try:
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.exceptions.TemplateError as error:
            raise ModelError(f"{self.source}: chat template failed: {' '.join(str(error).split())}") from None
        return self.encode(text) if tokenize else text

    def to_str(self) -> str:
        return self.backend.to_str()

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (atomically) so load_tokenizer reads it back."""
        from rlportable.model.weights import atomic_write

        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        atomic_write(os.path.join(directory, TOKENIZER_FILE), [self.backend.to_str().encode("utf-8")])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        config.update(self.settings)
        config.update(bos_token=self.bos_token, eos_token=self.eos_token)
        config.pop("chat_template", None)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        atomic_write(os.path.join(directory, TOKENIZER_CONFIG_FILE), [text.encode("utf-8")])


_TEMPLATES: dict[str, Any] = {}


def _compile(source: str):
    template = _TEMPLATES.get(source)
    if template is None:
        import jinja2
        from datetime import datetime
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(source)
        except jinja2.exceptions.TemplateError as error:
            raise ModelError(f"chat template does not compile: {' '.join(str(error).split())}") from None
        _TEMPLATES[source] = template
    return template


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{path}: not a readable JSON file: {' '.join(str(error).split())}") from None


def load_tokenizer(directory: str | os.PathLike, config: ModelConfig | None = None) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory; checks it fits config.vocab_size."""
    directory = os.fspath(directory)
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ModelError(f"{directory}: no {TOKENIZER_FILE}")
    try:
        backend = tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the Rust library raises plain Exception
        raise ModelError(f"{path}: not a readable tokenizer: {' '.join(str(error).split())}") from None

    settings: dict = {}
    config_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if os.path.isfile(config_path):
        settings = _read_json(config_path)
        if not isinstance(settings, dict):
            raise ModelError(f"{config_path}: the top level is not a JSON object")
    template = settings.get("chat_template")
    if isinstance(template, list):  # the older list of named templates
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    template_path = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as handle:
            template = handle.read()
    if template is not None and not isinstance(template, str):
        raise ModelError(f"{config_path}: chat_template is not a string")

    extra_stops: list[int] = list(config.eos_token_ids) if config is not None else []
    generation_path = os.path.join(directory, GENERATION_CONFIG_FILE)
    if os.path.isfile(generation_path):
        generation = _read_json(generation_path)
        eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        extra_stops += [value for value in eos if isinstance(value, int) and not isinstance(value, bool)]

    tokenizer = Tokenizer(backend, bos_token=_token_text(settings.get("bos_token")),
                          eos_token=_token_text(settings.get("eos_token")), chat_template=template,
                          extra_stop_ids=tuple(extra_stops), source=path, settings=settings)
    if config is not None:
        check_vocab(tokenizer, config)
    return tokenizer


def check_vocab(tokenizer: Tokenizer, config: ModelConfig) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelError(f"{tokenizer.source}: the tokenizer has {tokenizer.vocab_size} token ids but the model's "
                         f"vocab_size is {config.vocab_size}")
    for token_id in tokenizer.stop_token_ids:
        if token_id >= config.vocab_size:
            raise ModelError(f"{tokenizer.source}: stop token id {token_id} is outside the model's "
                             f"vocab_size {config.vocab_size}")
