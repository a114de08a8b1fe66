"""The one check of a request against the context window, for the engine and the API alike."""
from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """A prompt, or a prompt and its max_tokens, past the context window; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_param: str = "prompt",
                  max_tokens_param: str = "max_tokens") -> None:
    """Raise ContextLengthExceeded unless the prompt leaves room for a token, and for `max_tokens` if given."""
    if prompt_len >= max_model_len:
        raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens. However, "
                                    f"your {prompt_param} resulted in {prompt_len} tokens.", prompt_param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens. However, you "
                                    f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                                    f"{prompt_param}, {max_tokens} in the completion).", max_tokens_param)
