"""A chat request's prompt: its messages and tools through the chat template, with the request's options."""
from __future__ import annotations

import jinja2

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.server.chat_options import ChatOptions
from pdserve.server.errors import APIError, bad_request
from pdserve.server.protocol import ParsedRequest
from pdserve.server.tool_calls import template_messages

# what the template (the model's code) raises on the request's values: messages and chat_template_kwargs
TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, ArithmeticError, LookupError)


def render_chat(tokenizer: Tokenizer, parsed: ParsedRequest, parser: str, options: ChatOptions) -> str:
    """The prompt text; APIError(400) when the template rejects the conversation or its options."""
    messages, tools = template_messages(parsed.messages, parsed.tools, tokenizer.chat_template, parser)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, **options.render_kwargs())
    except TEMPLATE_ERRORS as e:
        raise _template_error(e) from None


def chat_prompt_ids(tokenizer: Tokenizer, parsed: ParsedRequest, parser: str, options: ChatOptions) -> tuple[int, ...]:
    """The prompt's token ids as the engine gets them (a BOS the model wants and the template did not write)."""
    messages, tools = template_messages(parsed.messages, parsed.tools, tokenizer.chat_template, parser)
    try:
        return tuple(tokenizer.encode_chat(messages, tools=tools, **options.render_kwargs()))
    except TEMPLATE_ERRORS as e:
        raise _template_error(e) from None


def _template_error(error: Exception) -> APIError:
    detail = str(error) if isinstance(error, (jinja2.TemplateError, ValueError)) else type(error).__name__
    return bad_request(f"cannot apply the chat template to these messages and options: {detail}", "messages")
