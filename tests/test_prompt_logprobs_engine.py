"""Prompt logprobs in the engine: only the chunks that ask pass through the LM head, a sequence prefilled again
after preemption does not send them twice, worker processes return what thread workers do, and the parameter
is checked like every other."""
from __future__ import annotations

import asyncio
import functools

import pytest
import torch
import transformers

from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.llm import LLM
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.prompt_logprobs import SLICE_POSITIONS
from pdserve.engine.worker.startup.memory_profile import Demand, measure_reserve
from pdserve.engine.worker.startup.sizing import largest_steps
from pdserve.engine.worker.step import ChunkInput, NewRow, StepInput
from tests.fake_cuda import fake_cuda
from tests.models import SLOS_SET, demo_checkpoint, engine_config, hf_checkpoint
from tests.test_engine_modes import assert_pools_free, prompts, run_engine
from tests.test_step_sync import CUDA1, launch_and_read, new_row, runner_on
from tests.tolerance import assert_float32_close, reference_logprobs

ARCH = "llama3"
SCORED = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)


@functools.cache
def reference():
    return transformers.AutoModelForCausalLM.from_pretrained(hf_checkpoint(ARCH), dtype=torch.float32).eval()


def assert_prompt_logprobs_match(prompt: list[int], logprobs: list[float]) -> None:
    """`logprobs` of prompt tokens 1 .. are transformers' log_softmax of the logits before each, within the
    suite's float32 tolerance."""
    assert len(logprobs) == len(prompt) - 1
    if not logprobs:
        return
    ours32, ours64, scale = reference_logprobs(reference(), prompt[:1], prompt[1:])
    assert_float32_close(torch.tensor(logprobs, dtype=torch.float32), ours32, ours64, scale)


def test_only_the_chunks_that_ask_pass_through_the_lm_head():
    config = ModelConfig.from_dir(hf_checkpoint(ARCH))
    runner = ModelRunner(load_model(config, torch.float32, torch.device("cpu"), 256), 32, 16, frozenset())
    rows_seen: list[int] = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: rows_seen.append(hidden.shape[0]) or compute_logits(hidden)
    asking, plain, single = prompts([40, 30, 1], seed=2)
    plain_params = SamplingParams(max_tokens=1, temperature=0.0)
    step = StepInput(new_rows=(NewRow(0, asking, 40, (0, 1, 2), SCORED), NewRow(1, plain, 30, (3, 4), plain_params),
                               NewRow(2, single, 1, (5,), SCORED)),
                     chunks=(ChunkInput(0, 0, 24, False, 2), ChunkInput(1, 0, 30, True),
                             ChunkInput(2, 0, 1, True, 2)))
    first = runner.execute(step)
    second = runner.execute(StepInput(chunks=(ChunkInput(0, 24, 16, True, 2),)))
    assert rows_seen == [2, 24, 1, 15]          # sampled rows; then 24 positions of row 0; then 1; then 15
    assert [index for index, _ in first.prompt_logprobs] == [0, 2] and first.prompt_logprobs[1][1].token_ids == ()
    scores = [part for _, part in first.prompt_logprobs[:1] + second.prompt_logprobs]
    assert scores[0].token_ids + scores[1].token_ids == asking[1:]
    assert_prompt_logprobs_match(list(asking), list(scores[0].logprobs + scores[1].logprobs))
    for part in scores:
        for logprob, rank, top in zip(part.logprobs, part.ranks, part.top):
            assert len(top) == 2 and top[0][1] >= top[1][1] and rank >= 1
            assert (rank == 1) == (logprob == top[0][1])


def test_scoring_a_prompt_on_cuda_never_waits_for_the_gpu(monkeypatch):
    with fake_cuda(monkeypatch) as cuda:
        runner = runner_on(CUDA1)
        row = new_row(0, SCORED, 20)
        cuda.syncs.clear()
        result = launch_and_read(cuda, runner, StepInput(new_rows=(row,), chunks=(ChunkInput(0, 0, 20, True, 2),)))
        assert cuda.syncs == []
    [(index, scores)] = result.prompt_logprobs
    assert index == 0 and scores.token_ids == row.token_ids[1:] and len(scores.top[0]) == 2


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_sequence_prefilled_again_after_preemption_sends_them_once(mode):
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    requests = [Request(f"p{i}", p, params) for i, p in enumerate(prompts([40] * 8, seed=4))]
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_model_len=256, kv_cache_memory="1MiB",
                                  max_prefill_tokens=32, **SLOS_SET))

    async def events_of(request: Request) -> list:
        return [event async for event in engine.submit(request)]

    async def all_requests():
        return await asyncio.gather(*(events_of(r) for r in requests))

    streams = asyncio.run(run_engine(engine, all_requests()))
    decode = engine.actors[-1]
    assert (decode.scheduler if mode == "disaggregated" else decode.decode).num_preemptions > 0
    for request, events in zip(requests, streams):
        scored = [i for i, event in enumerate(events) if event.prompt_logprobs is not None]
        assert scored == [0] and events[0].token_ids
        assert events[0].prompt_logprobs.token_ids == request.prompt_token_ids[1:]
        assert sum(len(e.token_ids) for e in events) == 100
    assert_pools_free(engine)
    engine.close()


def test_worker_processes_return_the_thread_workers_prompt_logprobs():
    batch = [list(p) for p in prompts([45, 7, 1], seed=6)]
    outputs = {}
    for workers in ("thread", "process"):
        llm = LLM(config=engine_config(hf_checkpoint(ARCH), mode="disaggregated", max_prefill_tokens=16,
                                       workers=workers, **SLOS_SET))
        outputs[workers] = llm.generate(batch, SCORED)
        llm.close()
    assert [o.prompt_logprobs for o in outputs["process"]] == [o.prompt_logprobs for o in outputs["thread"]]
    for prompt, output in zip(batch, outputs["process"]):
        assert output.prompt_logprobs.token_ids == tuple(prompt[1:])
        assert_prompt_logprobs_match(prompt, list(output.prompt_logprobs.logprobs))


def test_the_memory_profile_runs_a_full_slice_of_prompt_logprobs(monkeypatch):
    model = load_model(ModelConfig.from_dir(demo_checkpoint()), torch.float32, torch.device("cpu"), 256)
    rows_seen: list[int] = []
    compute_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: rows_seen.append(hidden.shape[0])
                        or compute_logits(hidden))
    steps, rows = largest_steps("prefill", SchedulerConfig(max_num_seqs=2, max_prefill_tokens=32), 256)
    measure_reserve(Demand(model, 1.0, 10**9, steps, rows), 16, 16, NoMemory())
    assert SLICE_POSITIONS in rows_seen


class NoMemory:
    """Readings of a device with nothing measured (the profile's steps run all the same)."""

    def allocated(self) -> int:
        return 0

    peak_allocated = allocated

    def reset_peak(self) -> None:
        pass

    release_cached = reset_peak


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "1"])
def test_prompt_logprobs_out_of_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
