"""pdserve's inference engine: model, paged KV cache, schedulers, prefill and decode actors."""

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM, GenerationOutput

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
