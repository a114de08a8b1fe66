"""The prompt of a request, checked: chat `messages` (roles, text parts, tool calls and results) or a completion's
`prompt` (text, texts, token ids or lists of them). Bad values raise APIError(400) naming the field."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.server.errors import bad_request

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
Prompt = str | tuple[int, ...]


def messages_of(messages: Any) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of message objects", "messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(message: Any, index: int) -> dict:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise bad_request(f"{param}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{param}.role")
    content = _content(message.get("content"), f"{param}.content", role)
    name = message.get("name")
    extra = {"name": name} if isinstance(name, str) else {}
    if role == "assistant" and message.get("tool_calls") is not None:
        extra["tool_calls"] = _tool_calls(message["tool_calls"], f"{param}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{param}.tool_call_id must be a string", f"{param}.tool_call_id")
        extra["tool_call_id"] = call_id
    return {"role": role, "content": content, **extra}


def _tool_calls(calls: Any, param: str) -> list[dict]:
    error = bad_request(f"{param} must be an array of {{'id', 'type': 'function', 'function': {{'name', "
                        "'arguments': JSON text}}}}", param)
    if not isinstance(calls, list):
        raise error
    checked = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str) and isinstance(call.get("id", ""), str)):
            raise error
        checked.append({"id": call.get("id", ""), "type": "function",
                        "function": {"name": function["name"], "arguments": function["arguments"]}})
    return checked


def _content(content: Any, param: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of text parts", param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{param} parts must be {{'type': 'text', 'text': str}} (only text is supported)",
                              param)
        texts.append(part["text"])
    return "".join(texts)


def prompts_of(prompt: Any) -> tuple[Prompt, ...]:
    error = bad_request("prompt must be a string, an array of strings, an array of token ids "
                        "or an array of token id arrays", "prompt")
    if isinstance(prompt, str):
        return (prompt,)
    if not isinstance(prompt, list) or not prompt:
        raise error
    if all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if _is_token_list(prompt):
        return (tuple(prompt),)
    if all(isinstance(p, list) and p and _is_token_list(p) for p in prompt):
        return tuple(tuple(p) for p in prompt)
    raise error


def _is_token_list(values: Sequence) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)
