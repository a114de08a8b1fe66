"""Per-app state shared by handlers, middlewares and the lifecycle, under typed keys."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from llguidance import LLTokenizer

from pdserve.engine.core.messages import EngineStats
from pdserve.engine.engine import Engine
from pdserve.engine.text.grammar import grammar_tokenizer
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.server.config import ServerConfig
from pdserve.server.errors import APIError
from pdserve.server.metrics import Metrics
from pdserve.server.reasoning import ReasoningParser
from pdserve.server.sampling_defaults import SamplingDefaults
from pdserve.server.structured import GrammarCompiler


class Abortable(Protocol):
    def abort(self) -> None: ...


@dataclass(slots=True, eq=False)
class AccessRecord:
    """What the access log reports about one HTTP request; handlers fill in what they know."""

    request_id: str = "-"
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    finish_reasons: str = "-"                  # one per choice, comma-separated


class ServerState:
    """The engine, metrics and the set of running generations (for draining) of one app."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine
        self.model_names: tuple[str, ...] = ()
        self.draining = False
        self.generations: set[Abortable] = set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.metrics = Metrics(self._stats, self._transfer_times, self._mask_times, config.metrics_names)
        self.grammars = GrammarCompiler(self._grammar_tokenizer, self.metrics.grammar_compile.observe)
        self.tool_call_parser: str | None = config.tool_call_parser
        self.reasoning = ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None
        self.tokenizer: Tokenizer | None = None          # the engine's, with --chat-template (set at start-up)
        self.sampling_defaults = SamplingDefaults()      # --generation-config's (read at start-up)

    def running_engine(self) -> Engine:
        """The engine, or APIError(503) while loading or draining."""
        if self.engine is not None and self.engine.dead is not None:
            raise APIError(503, f"the engine is dead and the server is exiting: {self.engine.dead}")
        if self.engine is None or self.draining:
            reason = "the server is shutting down" if self.draining else "the model is still loading"
            raise APIError(503, reason, retry_after=self.config.retry_after)
        return self.engine

    def check_model(self, name: str | None) -> str:
        """The served model name for a requested `model` (None: the default); APIError(404) if unknown."""
        if name is None or name in self.model_names:
            return self.model_names[0]
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def add(self, generation: Abortable) -> None:
        self.generations.add(generation)
        self.idle.clear()

    def discard(self, generation: Abortable) -> None:
        self.generations.discard(generation)
        if not self.generations:
            self.idle.set()

    async def drain(self, timeout: float, abort_grace: float = 10.0) -> bool:
        """Refuse new requests, wait up to `timeout` for running ones, then abort the rest.

        Returns True when every generation finished on its own.
        """
        self.draining = True
        if await self._wait_idle(timeout):
            return True
        for generation in list(self.generations):
            generation.abort()
        await self._wait_idle(abort_grace)
        return False

    async def _wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def _mask_times(self) -> list[float]:
        return self.engine.take_mask_times() if self.engine is not None else []

    def _grammar_tokenizer(self) -> LLTokenizer:
        engine = self.running_engine()
        vocab = engine.model_config.vocab_size
        return grammar_tokenizer(engine.model_dir, vocab, tuple(sorted(t for t in engine.eos_token_ids if t < vocab)))

    def _transfer_times(self) -> list[float]:
        return self.engine.take_kv_transfer_times() if self.engine is not None else []


STATE = web.AppKey("pdserve_state", ServerState)
ACCESS = web.RequestKey("pdserve_access", AccessRecord)
