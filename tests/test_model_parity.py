"""The model against transformers on the same checkpoint: logits and greedy generations."""
from __future__ import annotations

import functools

import pytest
import torch

from pdserve.engine.actors.runner_rows import RunnerRows
from pdserve.engine.config import ModelConfig
from pdserve.engine.core.batch import Batch, ScheduledChunk
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.llm import LLM
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from tests.hf_models import ARCHS, HYBRID_ARCHS, LONGROPE_ORIGINAL, MOE_ARCHS, transformers_greedy
from tests.hf_models import reference_model as hf_reference
from tests.models import demo_checkpoint, engine_config, hf_checkpoint
from tests.tolerance import assert_float32_close, reference_logits, reference_logprobs

CHECKPOINTS = {
    **{arch: functools.partial(hf_checkpoint, arch) for arch in ARCHS + MOE_ARCHS + HYBRID_ARCHS},
    "demo-llama": lambda: demo_checkpoint("llama"),
    "demo-qwen2": lambda: demo_checkpoint("qwen2"),
    "phi3-longrope": functools.partial(hf_checkpoint, "phi3-longrope"),    # long prompts only
}
PROMPT_LENGTHS = (3, 17, 40, 129)
LONG_PROMPT_LENGTHS = (LONGROPE_ORIGINAL + 1, 129)   # past LongRoPE's original context: its long factors
NEW_TOKENS = 32


def random_prompts(vocab: int, seed: int = 0, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def lengths_for(name: str) -> tuple[int, ...]:
    return LONG_PROMPT_LENGTHS if name == "phi3-longrope" else PROMPT_LENGTHS


@functools.cache
def reference_model(name: str):
    return hf_reference(CHECKPOINTS[name]())


def prompt_logits(name: str, prompts: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Every position's logits from our model, all prompts packed into each step, `chunk` tokens at a time."""
    config = ModelConfig.from_dir(CHECKPOINTS[name]())
    windows = len(prompts) if config.mixed_kv_shapes else 0      # Gemma 4's sliding layers: window slots only
    runner = ModelRunner(load_model(config, torch.float32, torch.device("cpu"), 512), 128, 16, frozenset(),
                         state_slots=len(prompts), window_seqs=windows)
    blocks = BlockManager(runner.num_blocks, 16, state_slots=runner.state_slots, window_slots=runner.window_slots)
    seqs = [Sequence(Request(str(i), tuple(p))) for i, p in enumerate(prompts)]
    for seq in seqs:
        seq.block_table = blocks.grow(seq.request_id, seq.num_tokens)
        seq.state_slot = blocks.state_slot(seq.request_id)
    rows: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
    planner = RunnerRows()
    while chunks := [ScheduledChunk(s, s.num_computed_tokens, min(chunk, s.num_tokens - s.num_computed_tokens),
                                    sample=False) for s in seqs if s.num_computed_tokens < s.num_tokens]:
        step = planner.step_input(Batch(chunks=tuple(chunks)), blocks.take_window_assignments())
        runner.apply(step)
        batch = runner.prepare(step)
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(batch, runner.kv_pool))
        for c, part in zip(chunks, logits.split([c.num_tokens for c in chunks])):
            rows[c.seq.request_id].append(part)
            c.seq.num_computed_tokens = c.stop
    return [torch.cat(rows[s.request_id]) for s in seqs]


@pytest.mark.parametrize("chunk", [512, 16])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_prompt_logits_match_transformers(name, chunk):
    reference = reference_model(name)
    prompts = random_prompts(reference.config.vocab_size, lengths=lengths_for(name))
    for prompt, ours in zip(prompts, prompt_logits(name, prompts, chunk)):
        expected32, expected64 = reference_logits(reference, prompt)
        assert expected64.std() > 0.1
        assert_float32_close(ours, expected32, expected64)


@pytest.mark.parametrize("max_prefill_tokens", [2048, 16])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_generation_matches_transformers(name, max_prefill_tokens):
    reference = reference_model(name)
    prompts = random_prompts(reference.config.vocab_size, seed=1, lengths=lengths_for(name))
    llm = LLM(config=engine_config(CHECKPOINTS[name](), max_prefill_tokens=max_prefill_tokens))
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                       ignore_eos=True, logprobs=0))
    finally:
        llm.close()
    for prompt, output in zip(prompts, outputs):
        expected = transformers_greedy(reference, prompt, NEW_TOKENS)
        assert list(output.token_ids) == expected
        ours = torch.tensor([lp.logprob for lp in output.logprobs])
        assert_float32_close(ours, *reference_logprobs(reference, prompt, expected))
