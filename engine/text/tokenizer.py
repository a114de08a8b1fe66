"""Tokenizer of a Hugging Face model directory: `tokenizers` for the text, jinja2 for chat."""
from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "      # transformers' marker for continue_final_message


class Tokenizer:
    """Encode, decode and chat-template rendering for one model directory."""

    def __init__(self, backend: HFTokenizer, config: dict, eos_token_ids: frozenset[int],
                 chat_template: str | None, model_dir: Path) -> None:
        self._backend = backend
        self._config = config
        self._template_tokens = {name: content for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                                 if (content := _token_content(config.get(name))) is not None}
        self._chat_template = chat_template
        self._model_dir = model_dir
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token: str | None = _token_content(config.get("bos_token"))
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.bos_token_id: int | None = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids: frozenset[int] = eos_token_ids
        self.add_bos: bool = self.bos_token_id is not None and self._adds_bos()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json (special_tokens_map.json), chat_template.jinja,
        generation_config.json and config.json from `model_dir` (all but tokenizer.json optional).

        Raises FileNotFoundError when tokenizer.json is missing and ValueError when a file is malformed;
        both name the file.
        """
        model_dir = Path(model_dir)
        backend = _load_backend(model_dir / "tokenizer.json")
        config = {**_read_json(model_dir / "special_tokens_map.json"), **_read_json(model_dir / "tokenizer_config.json")}
        eos_ids = _eos_ids(_read_json(model_dir / "generation_config.json"), _read_json(model_dir / "config.json"))
        if not eos_ids and (eos := _token_content(config.get("eos_token"))) is not None:
            eos_ids = {backend.token_to_id(eos)} - {None}
        return cls(backend, config, frozenset(eos_ids), _chat_template(model_dir, config), model_dir)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, a BOS first when the model wants one."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_special_tokens and self.add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            **extra: Any) -> str:
        """Render `messages` (OpenAI-style dicts) with the chat template; `extra` are the template's own
        variables (e.g. Qwen3's enable_thinking). With `continue_final_message` the text ends inside the last
        message, for the model to continue it (as transformers cuts it).

        Raises ValueError when the model directory has no chat template or the last message's text is not in
        the rendering, and jinja2.TemplateError when the template rejects the conversation.
        """
        if continue_final_message:
            messages = _tag_final_message(messages)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, **self._template_tokens, **extra)
        return _cut_at_tag(text, messages[-1]["content"]) if continue_final_message else text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **extra: Any) -> list[int]:
        """Render then encode a conversation; a BOS is added only if the template did not write one."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **extra)
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def with_chat_template(self, source: str) -> "Tokenizer":
        """This tokenizer with `source` as its chat template (jinja2.TemplateSyntaxError when it does not parse)."""
        compile_chat_template(source)
        other = copy.copy(self)
        other._chat_template = source
        other.__dict__.pop("_template", None)          # NOTE: cached_property's value for the old template
        return other

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for `token_id` (byte-level pieces as stored, e.g. 'Ġthe'), None when unknown."""
        return self._backend.id_to_token(token_id)

    @property
    def chat_template(self) -> str | None:
        """The template's source (None when the model directory has none)."""
        return self._chat_template

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` underneath (for its streaming decoder)."""
        return self._backend

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise ValueError(f"model directory {self._model_dir} has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        return compile_chat_template(self._chat_template)

    def _adds_bos(self) -> bool:
        # NOTE: the post-processor decides, as in transformers 5; add_bos_token only when there is none
        if self._backend.post_processor is None:
            return self._config.get("add_bos_token") is True
        return self._backend.encode("a", add_special_tokens=True).ids[:1] == [self.bos_token_id]


def compile_chat_template(source: str) -> jinja2.Template:
    """`source` in the sandbox chat templates render in; jinja2.TemplateSyntaxError when it does not parse."""
    return _jinja_env().from_string(source)


def _tag_final_message(messages: list[dict]) -> list[dict]:
    """`messages` with a tag after the last one's text, where transformers' continue_final_message cuts."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    return [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]


def _cut_at_tag(text: str, tagged: str) -> str:
    final = tagged[:-len(CONTINUE_TAG)]
    tag = text.rfind(CONTINUE_TAG.strip())
    if final.strip() not in text or tag < 0:
        raise ValueError("continue_final_message: the chat template does not render the last message's text as is")
    return text[:tag] if text.startswith(CONTINUE_TAG, tag) else text[:tag].rstrip()   # NOTE: a template may trim


def _load_backend(path: Path) -> HFTokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as err:  # NOTE: the Rust side raises a bare Exception
        raise ValueError(f"cannot load tokenizer file {path}: {err}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"malformed JSON in {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"malformed {path}: expected a JSON object")
    return data


def _eos_ids(*configs: dict) -> set[int]:
    ids: set[int] = set()
    for config in configs:
        value = config.get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids


def _chat_template(model_dir: Path, config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


def _token_content(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env
