"""Tool calling: `tools` / `tool_choice` parsing, the grammar that forces `required` and named choices, the
conversation as the chat template wants it, and reading the model's own tool-call format back
(`hermes`: Hermes / Qwen2.5 `<tool_call>{...}</tool_call>`; `llama3_json`: Llama 3.1 JSON)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from pdserve.server.errors import bad_request
from pdserve.server.structured import OutputFormat

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class Tools:
    """The tools a chat request offers and how the model may use them."""

    tools: tuple[dict, ...]          # the request's tool objects, validated
    choice: str                      # none | auto | required | function (then `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str                   # JSON text
    id: str = ""

    def body(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; APIError(400) naming the field."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_request(f"{legacy} is deprecated and not supported; use tools and tool_choice", legacy)
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty array of tool objects", "tools")
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    if choice is None or choice in ("none", "auto", "required"):
        return Tools(checked, choice or "auto", None, parallel)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
    return Tools(checked, "function", name, parallel)


def _tool(tool: Any, index: int) -> dict:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise bad_request(f"{param}.function.name must be 1 to 64 letters, digits, _ or -", f"{param}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{param}.function.description must be a string", f"{param}.function.description")
    return {"type": "function", "function": {"name": name, "parameters": parameters,
                                             **({"description": description} if description else {})}}


def forced_format(tools: Tools) -> OutputFormat:
    """The grammar of a `required` or named choice: a JSON array of {"name", "arguments"} calls."""
    offered = [t["function"] for t in tools.tools if tools.choice == "required" or t["function"]["name"] == tools.name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in offered]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not tools.parallel:
        schema["maxItems"] = 1
    return OutputFormat("json", orjson.dumps(schema).decode(), "tools")          # NOTE: the name comes first


def choose_parser(chat_template: str | None, override: str | None) -> str:
    """The tool-call format of a model: `override`, else Llama 3.1's JSON when its template speaks it, else Hermes."""
    if override:
        return override
    template = chat_template or ""
    return "llama3_json" if PYTHON_TAG in template or "ipython" in template else "hermes"


def template_messages(messages: tuple[dict, ...], tools: Tools | None, chat_template: str | None,
                      parser: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. A template that knows tools gets them as they are (tool call
    arguments as objects, as HF templates expect); one that does not gets them written in the parser's
    format: a system message that lists the tools, calls and results as text."""
    template = chat_template or ""
    if "tool" in template and "tools" in template:
        return [_for_template(m) for m in messages], [t for t in tools.tools] if tools else None
    rendered = [_as_text(m, parser) for m in messages]
    if tools is not None and tools.choice != "none":
        rendered = _with_tools_prompt(rendered, tools, parser)
    return rendered, None


def _for_template(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _loads_or_text(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _as_text(message: dict, parser: str) -> dict:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if not message.get("tool_calls"):
        return {k: v for k, v in message.items() if k in ("role", "content", "name")}
    calls = [{"name": c["function"]["name"], "arguments": _loads_or_text(c["function"]["arguments"])}
             for c in message["tool_calls"]]
    if parser == "hermes":
        text = "".join(f"{HERMES_START}\n{json.dumps(c)}\n{HERMES_END}" for c in calls)
    else:
        text = "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    return {"role": "assistant", "content": (message["content"] or "") + text}


def _with_tools_prompt(messages: list[dict], tools: Tools, parser: str) -> list[dict]:
    listing = "\n".join(json.dumps(t) for t in tools.tools)
    if parser == "hermes":
        how = ("For each function call, return a json object with function name and arguments within "
               f"{HERMES_START}{HERMES_END} XML tags:\n{HERMES_START}\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n' + HERMES_END)
    else:
        how = ('To call a function, respond with JSON of the form {"name": function name, "parameters": '
               "dictionary of argument name and its value}.")
    prompt = ("You may call one or more functions to assist with the user query.\n\nYou are provided with "
              f"function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n{how}")
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_calls(text: str) -> list[ToolCall] | None:
    """The calls of a forced choice's output (the grammar's JSON array); None when it is cut short."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False), new_call_id()) for c in calls]


def parse_auto(text: str, parser: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a model's own output; text that holds no call of an offered tool stays content."""
    if parser == "hermes":
        start = text.find(HERMES_START)
        if start < 0:
            return text, []
        calls = [c for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[start:], re.S)
                 if (c := read_call(body, names, "arguments")) is not None]
        return (text[:start].strip(), calls) if calls else (text, [])
    body = text.strip().removeprefix(PYTHON_TAG)
    calls = [read_call(part, names, "parameters") for part in _json_objects(body)]
    return ("", calls) if calls and all(c is not None for c in calls) else (text, [])


def read_call(body: str, names: frozenset[str], arguments_key: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get(arguments_key, data.get("arguments", data.get("parameters", {})))
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def _json_objects(text: str) -> list[str]:
    """`{...}; {...}` (Llama 3.1 separates parallel calls with semicolons) as separate JSON texts."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(text):
        while at < len(text) and text[at] in " \n\t;":
            at += 1
        if at == len(text):
            break
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[at:end])
        at = end
    return parts
