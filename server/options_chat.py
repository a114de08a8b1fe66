"""`pdserve serve` options for chat: the template, sampling defaults, reasoning and tool-call parsers (vLLM's
names and meanings)."""
from __future__ import annotations

import argparse
import codecs
from pathlib import Path
from typing import Any

import jinja2
import orjson

from pdserve.engine.text.tokenizer import compile_chat_template
from pdserve.server.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from pdserve.server.sampling_defaults import GENERATION_CONFIG_KEYS, check_defaults

# vLLM's tool-call and reasoning parsers pdserve does not have (each refused naming those it has)
VLLM_TOOL_CALL_PARSERS = ("mistral", "pythonic", "granite", "granite-20b-fc", "internlm", "jamba", "qwen3_coder",
                          "qwen3_xml", "deepseek_v3", "deepseek_v31", "kimi_k2", "openai", "llama4_json",
                          "llama4_pythonic", "hunyuan_a13b", "glm45", "minimax", "phi4_mini_json", "xlam",
                          "seed_oss", "step3")
VLLM_REASONING_PARSERS = ("granite", "glm45", "gpt_oss", "hunyuan_a13b", "mistral", "step3", "ernie45",
                          "seed_oss", "minimax_m2", "deepseek_v3", "olmo3")


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("chat")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template that replaces the model's: a file, or the template itself")
    g.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="sampling defaults for fields a request leaves out: auto (the model's "
                        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens), vllm (none: vLLM's own defaults), or a folder holding that file")
    g.add_argument("--override-generation-config", type=_json_object, default={}, metavar="JSON",
                   help="defaults over --generation-config's, e.g. '{\"temperature\": 0.5}'")
    g.add_argument("--reasoning-parser", type=_reasoning_parser, default=None,
                   metavar="{" + ",".join(REASONING_PARSERS) + "}",
                   help="return a reasoning model's <think> text as reasoning_content, apart from content")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice auto is always on")
    g.add_argument("--tool-call-parser", type=_tool_call_parser, default=None,
                   metavar="{" + ",".join(TOOL_CALL_PARSERS) + "}",
                   help="how to read tool calls from the model's output with tool_choice auto (default: from "
                        "the chat template: llama3_json for Llama 3.1 style templates, else hermes)")


def chat_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig fields; raises ValueError naming the option."""
    check_defaults(args.override_generation_config, "--override-generation-config")
    if args.generation_config not in ("auto", "vllm") and not Path(args.generation_config).is_dir():
        raise ValueError(f"--generation-config {args.generation_config}: expected auto, vllm or a folder holding "
                         "generation_config.json")
    template = _checked(load_chat_template(args.chat_template), args.chat_template)
    return dict(chat_template=template, generation_config=args.generation_config,
                override_generation_config=args.override_generation_config,
                reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)


def load_chat_template(value: str | None) -> str | None:
    """The template a --chat-template value names: a file's text, else the value itself (escapes such as \\n
    decoded, as vLLM does) when it looks like Jinja. Raises ValueError otherwise."""
    if value is None:
        return None
    try:
        if Path(value).is_file():
            return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {value}: cannot read it: {e}") from None
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")
    return codecs.decode(value, "unicode_escape")


def _checked(template: str | None, value: str | None) -> str | None:
    """`template` once it parses; ValueError naming the line that does not."""
    if template is not None:
        try:
            compile_chat_template(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template {value[:80]}: line {e.lineno}: {e.message}") from None
    return template


def _json_object(text: str) -> dict:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict) or not set(value) <= set(GENERATION_CONFIG_KEYS):
        raise argparse.ArgumentTypeError(f"expected a JSON object of {', '.join(GENERATION_CONFIG_KEYS)}")
    return value


def _tool_call_parser(text: str) -> str:
    return _choice(text, TOOL_CALL_PARSERS, VLLM_TOOL_CALL_PARSERS, "pdserve reads Hermes-style <tool_call> JSON "
                   "(Qwen2.5, Qwen3, Hermes) and Llama 3.1's JSON calls")


def _reasoning_parser(text: str) -> str:
    return _choice(text, REASONING_PARSERS, VLLM_REASONING_PARSERS, "pdserve reads <think>...</think> reasoning "
                   "(Qwen3, QwQ, DeepSeek-R1 and their distills)")


def _choice(text: str, ours: tuple[str, ...], theirs: tuple[str, ...], what: str) -> str:
    if text in ours:
        return text
    if text in theirs:
        raise argparse.ArgumentTypeError(f"{text} is one of vLLM's parsers that pdserve lacks: {what}; use "
                                         f"{' or '.join(ours)}")
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(ours)})")
