"""An actor's mailbox: the messages not yet handled, and the prompt tokens they carry (routing counts a prompt
as queued from the moment it is sent: a burst is routed before the actor's loop has handled any of it)."""
from __future__ import annotations

from collections import deque

from pdserve.engine.core.messages import Preempted, Request


class Mailbox:
    def __init__(self) -> None:
        self._messages: deque = deque()
        self._inbound: dict[str, int] = {}      # prompts not yet handled: request id -> tokens to compute

    def __len__(self) -> int:
        return len(self._messages)

    def put(self, message) -> None:
        prompt = _prompt_of(message)
        if prompt is not None:
            self._inbound[prompt[0]] = prompt[1]
        self._messages.append(message)

    def take(self):
        """The oldest message (the mailbox must not be empty)."""
        message = self._messages.popleft()
        if self._inbound and (prompt := _prompt_of(message)) is not None:
            self._inbound.pop(prompt[0], None)
        return message

    @property
    def prompt_tokens(self) -> int:
        """Tokens to compute of the prompts waiting here."""
        return sum(self._inbound.values())


def _prompt_of(message) -> tuple[str, int] | None:
    """(request id, tokens to compute) of a prompt sent to an actor; None for any other message."""
    if isinstance(message, Preempted):
        return message.request.request_id, len(message.request.prompt_token_ids) + len(message.output_token_ids)
    if isinstance(message, Request):
        return message.request_id, len(message.prompt_token_ids)
    return None
