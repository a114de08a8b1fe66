"""pdserve's inference engine: model, paged KV cache, schedulers, prefill and decode actors."""

from engine.llm import LLM, GenerationOutput
from engine.core.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
