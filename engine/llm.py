"""Offline, synchronous generation: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace
from typing import Sequence

from pdserve.engine.config import EngineConfig, SpeculativeConfig
from pdserve.engine.core.messages import FinishReason, PromptLogprobs, Request, TokenLogprob
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None   # with SamplingParams.prompt_logprobs: prompt tokens 1 ..


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LLM:
    """Loads the model once; each `generate` call runs the actors on a fresh event loop."""

    def __init__(self, model: str | None = None, config: EngineConfig | None = None,
                 speculative_config: dict | str | None = None, **overrides) -> None:
        """`speculative_config`: vLLM's dict (or JSON), e.g. {"method": "ngram", "num_speculative_tokens": 4}."""
        config = config or EngineConfig()
        if speculative_config is not None:
            overrides["speculative"] = SpeculativeConfig.from_json(speculative_config)
        self.engine = Engine(replace(config, model=model or config.model, **overrides))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Generate for every prompt (text, or token ids); outputs come back in prompt order."""
        params_list = self._params_per_prompt(prompts, params)
        loop = new_event_loop()
        try:
            return loop.run_until_complete(self._generate(list(prompts), params_list))
        finally:
            loop.close()

    def _params_per_prompt(self, prompts, params) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return list(params)

    async def _generate(self, prompts: list, params: list[SamplingParams]) -> list[GenerationOutput]:
        await self.engine.start()
        try:
            return await asyncio.gather(*(self._one(p, sp) for p, sp in zip(prompts, params)))
        finally:
            await self.engine.stop()

    async def _one(self, prompt: str | Sequence[int], params: SamplingParams) -> GenerationOutput:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request = Request(f"llm-{next(self._ids)}", tuple(ids), params)
        text, tokens, logprobs, reason, error, scored = [], [], [], FinishReason.ABORT, None, None
        async for event in self.engine.submit(request):
            text.append(event.text)
            tokens += event.token_ids
            logprobs += event.logprobs
            reason, error = event.finish_reason or reason, event.error
            if event.prompt_logprobs is not None:
                scored = event.prompt_logprobs
        return GenerationOutput(prompt if isinstance(prompt, str) else None, tuple(ids), "".join(text),
                                tuple(tokens), reason.value, tuple(logprobs), error, scored)

    def close(self) -> None:
        self.engine.close()
