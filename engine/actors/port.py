"""What an actor asks of the coordinator (`engine.coordinator`): the hand-off protocol. No actor holds another."""
from __future__ import annotations

from typing import Protocol

from pdserve.engine.core.messages import Reservation
from pdserve.engine.core.sequence import Sequence


class Port(Protocol):
    def reserve(self, seq: Sequence) -> Reservation | None:
        """Decode blocks for `seq` on a decode unit the coordinator picks, or None (back-pressure)."""

    def post(self, message) -> None:
        """A KVHandoff, Release or Preempted, for the coordinator to deliver."""

    def blocks_freed(self, actor) -> None:
        """`actor` (an Actor) freed blocks: a prefill unit held back for room may go on."""


class NoPort:
    """An actor not wired to a coordinator: it reserves nothing and delivers nothing."""

    def reserve(self, seq: Sequence) -> Reservation | None:
        return None

    def post(self, message) -> None:
        pass

    def blocks_freed(self, actor) -> None:
        pass
