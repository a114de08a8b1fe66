"""The chat template options of a request (vLLM's fields), for /v1/chat/completions and /tokenize."""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.server.errors import bad_request

MAX_TEMPLATE_KWARGS = 32
TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# variables the server itself gives the template: a request sets them through its own fields
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                     "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception",
                                     "strftime_now"})


@dataclass(frozen=True, slots=True)
class ChatOptions:
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)   # the template's own switches
    add_generation_prompt: bool = True
    continue_final_message: bool = False      # end the prompt inside the last (assistant) message
    include_reasoning: bool = True            # with --reasoning-parser: send reasoning_content

    def render_kwargs(self) -> dict[str, Any]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, **self.template_kwargs}


def parse_chat_options(body: dict) -> ChatOptions:
    """The options of `body`; APIError(400) naming the field for a bad one."""
    if body.get("chat_template") is not None:
        raise bad_request("a chat_template per request is not accepted: start the server with --chat-template",
                          "chat_template")
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final_message = _bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise bad_request("continue_final_message cannot be combined with add_generation_prompt true (set it "
                          "to false)", "continue_final_message")
    return ChatOptions(_template_kwargs(body.get("chat_template_kwargs")), add_generation_prompt,
                       continue_final_message, _bool(body, "include_reasoning", True))


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {type(value).__name__}", name)
    return value


def _template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}",
                          "chat_template_kwargs")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad_request(f"chat_template_kwargs may hold at most {MAX_TEMPLATE_KWARGS} names, got {len(kwargs)}",
                          "chat_template_kwargs")
    for name in kwargs:
        if not TEMPLATE_KWARG_NAME.fullmatch(name):
            raise bad_request(f"chat_template_kwargs names must be identifiers of at most 64 characters, got "
                              f"{name[:80]!r}", "chat_template_kwargs")
        if name in RESERVED_TEMPLATE_NAMES:
            raise bad_request(f"chat_template_kwargs may not set {name!r}: the server sets it (from the request's "
                              "own fields)", f"chat_template_kwargs.{name}")
    return kwargs
