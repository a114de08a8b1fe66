"""A test-only fault hook for the supervisor's tests: `PDSERVE_FAULT="<unit>:<kind>@<step>"`.

The compute unit named `<unit>` (prefill, decode, colocated; with several units of a role, one of
them: prefill0, decode1, colocated1, ...) misbehaves at its `<step>`-th step
(counting from 1 after warm-up): `raise` raises InjectedFault, `hang` never returns, `exit` ends
the process at once (a worker process dies as if killed). Unset, it costs one None check per step.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve import env

ENV = env.FAULT                      # the variable, as messages and tests name it
KINDS = ("raise", "hang", "exit")
RELEASE = threading.Event()          # a hung step of this process returns once this is set (tests clean up)


class InjectedFault(RuntimeError):
    pass


@dataclass(slots=True)
class Fault:
    unit: str
    kind: str
    step: int
    steps_seen: int = 0

    @classmethod
    def from_env(cls, unit: str, environ: Mapping[str, str] | None = None) -> Fault | None:
        spec = env.fault_spec(environ)
        if not spec:
            return None
        try:
            target, rest = spec.split(":", 1)
            kind, step = rest.split("@", 1)
            fault = cls(target, kind, int(step))
        except ValueError:
            raise ValueError(f"{ENV} must look like 'decode:raise@3', got {spec!r}") from None
        if kind not in KINDS:
            raise ValueError(f"{ENV} kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return fault if target == unit else None

    def on_step(self) -> None:
        self.steps_seen += 1
        if self.steps_seen != self.step:
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected fault in {self.unit} step {self.step}")
        if self.kind == "hang":
            RELEASE.wait()
            return
        os._exit(17)
