"""A step on CUDA never makes the host wait for the GPU: its tokens come back later, through pinned memory.

On CPU, `tests.fake_cuda` stands in for the GPU and reports, inside a step window, every op that would
make the host wait on a real device: `.item()`, `.tolist()`, `bool()` of a device tensor, a
data-dependent shape (`nonzero`, a boolean mask index), a copy from or into pageable host memory, a
blocking copy, `synchronize()` on the step's own work. A runner's `launch` runs inside the window;
its `PendingStep.result()` (the read-back point, where the actor records the step) runs outside it.
"""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.pending_step import PendingStep
from pdserve.engine.worker.step import ChunkInput, NewRow, StepInput, VerifyInput
from pdserve.engine.worker.step_runner import StepRunner
from tests.fake_cuda import fake_cuda
from tests.models import demo_checkpoint, engine_config

CUDA1 = torch.device("cuda:1")
BLOCK = 16

PARAMS = [SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.8, top_k=5),
          SamplingParams(temperature=0.7, top_p=0.9, seed=11),
          SamplingParams(temperature=1.0, min_p=0.1, top_k=400),
          SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
          SamplingParams(temperature=0.0, logprobs=3),
          SamplingParams(temperature=0.6, min_tokens=4, stop_token_ids=(9, 10), logprobs=0),
          SamplingParams(temperature=0.0, presence_penalty=1.0),
          SamplingParams(temperature=0.5, logit_bias=((7, 5.0), (8, -3.0)))]


def runner_on(device: torch.device, graph_max_batch: int = 0) -> ModelRunner:
    config = ModelConfig.from_dir(demo_checkpoint())
    model = load_model(config, torch.float32, device, 256)
    return ModelRunner(model, 64, BLOCK, frozenset({2}), graph_max_batch, max_blocks_per_seq=8)


def new_row(row: int, params: SamplingParams, length: int = 20) -> NewRow:
    prompt = tuple(3 + (7 * row + 5 * i) % 200 for i in range(length))
    first = 4 * row
    return NewRow(row, prompt, length, tuple(range(first, first + 4)), params)


def steps() -> list[StepInput]:
    """Prefill of every row, decode steps, a row leaving and another joining mid-decode, a verify step."""
    rows = [new_row(i, p) for i, p in enumerate(PARAMS)]
    n = len(rows)
    others = tuple(r for r in range(n) if r != 3)
    return [
        StepInput(new_rows=tuple(rows), chunks=tuple(ChunkInput(r.row, 0, 20, True) for r in rows)),
        StepInput(decode_rows=tuple(range(n)), decode_positions=(20,) * n),
        StepInput(decode_rows=tuple(range(n)), decode_positions=(21,) * n),
        StepInput(freed_rows=(3,), new_rows=(new_row(3, PARAMS[4], 12),), decode_rows=others,
                  decode_positions=(22,) * len(others), chunks=(ChunkInput(3, 0, 12, True),)),
        StepInput(decode_rows=tuple(range(n)), decode_positions=tuple(12 if r == 3 else 23 for r in range(n))),
    ]


def verify_step() -> StepInput:
    return StepInput(decode_rows=(1, 2), decode_positions=(24, 24),
                     verify=(VerifyInput(0, 24, (5, 6, 7)), VerifyInput(4, 24, (8, 9)),
                             VerifyInput(5, 24, (3, 4, 5, 6)), VerifyInput(6, 24, (11, 12))))


def launch_and_read(cuda, runner: ModelRunner, step: StepInput):
    with cuda.step_window():
        pending = runner.launch(step)
    return pending.result()


@pytest.mark.parametrize("graphs", [0, 16])
def test_a_step_on_cuda_never_waits_for_the_gpu(monkeypatch, graphs):
    with fake_cuda(monkeypatch) as cuda:
        runner = runner_on(CUDA1, graphs)
        cuda.syncs.clear()
        for step in steps():
            result = launch_and_read(cuda, runner, step)
            assert len(result.token_ids) == len(step.sampled_rows)
            assert all(isinstance(t, int) for t in result.token_ids)
        assert cuda.syncs == []
        assert bool(graphs) == any(graph.replays for graph in cuda.graphs)


def test_a_verify_step_on_cuda_never_waits_for_the_gpu(monkeypatch):
    with fake_cuda(monkeypatch) as cuda:
        runner = runner_on(CUDA1)
        for step in steps():
            launch_and_read(cuda, runner, step)
        cuda.syncs.clear()
        result = launch_and_read(cuda, runner, verify_step())
        assert cuda.syncs == []
        assert [len(tokens) >= 1 for tokens in result.verified] == [True] * 4
        assert result.verified_logprobs[2] is not None and result.verified_logprobs[0] is None


def test_the_window_catches_the_syncs_a_step_used_to_make(monkeypatch):
    """The check has teeth: a blocking read-back, a pageable upload and a mask index are each caught."""
    with fake_cuda(monkeypatch) as cuda:
        x = torch.arange(6, device=CUDA1)
        with cuda.step_window():
            x.tolist()
            torch.tensor([1, 2], device=CUDA1)
            torch.zeros(3).to(CUDA1, non_blocking=True)
            x[x > 2] = 0
            bool((x > 1).any())
            torch.cuda.synchronize()
        with cuda.step_window():
            pinned = torch.zeros(6, dtype=torch.int64, pin_memory=True)
            pinned.copy_(x, non_blocking=True)
            pinned.to(CUDA1, non_blocking=True)
        assert len(cuda.syncs) == 6, cuda.syncs


def test_an_engine_on_fake_gpus_steps_without_host_syncs(monkeypatch):
    """Whole engines on fake GPUs: the compute thread only launches; another thread reads the tokens back."""
    with fake_cuda(monkeypatch) as cuda:
        launch, read, readers = StepRunner.launch, PendingStep._read, set()

        def windowed(self, work):
            with cuda.step_window():
                return launch(self, work)

        def reading(self):                      # NOTE: the wait for a step's tokens (result() caches it)
            readers.add(threading.current_thread().name)
            return read(self)

        monkeypatch.setattr(StepRunner, "launch", windowed)
        monkeypatch.setattr(PendingStep, "_read", reading)
        for mode in ("colocated", "disaggregated"):
            llm = LLM(config=engine_config(demo_checkpoint(), mode=mode, prefill_device="cuda:0",
                                           decode_device="cuda:1", max_num_seqs=4, max_prefill_tokens=32))
            cuda.syncs.clear()
            readers.clear()                     # NOTE: warm-up steps are read on the loader thread
            try:
                outputs = llm.generate([[5, 6, 7], list(range(3, 60)), [9] * 30],
                                       [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                                        SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=3,
                                                       ignore_eos=True, logprobs=2),
                                        SamplingParams(max_tokens=5, temperature=0.7, repetition_penalty=1.2,
                                                       ignore_eos=True)])
            finally:
                llm.close()
            assert [len(o.token_ids) for o in outputs] == [5, 5, 5]
            assert cuda.syncs == [], (mode, cuda.syncs)
            assert readers and all(name.endswith("-readback_0") for name in readers), readers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [0, 16])
def test_a_step_on_a_real_gpu_makes_no_synchronizing_call(graphs):
    """torch's sync debug mode raises on any synchronizing CUDA call (a read of device data, a pageable copy)."""
    runner = runner_on(torch.device("cuda:0"), graphs)
    for step in [*steps(), verify_step()]:
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = runner.launch(step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        result = pending.result()
        assert len(result.token_ids) == len(step.sampled_rows) and len(result.verified) == len(step.verify)


@pytest.mark.parametrize("grammar", [True, False])
def test_launching_ahead_of_the_read_back_gives_the_tokens_of_stepping_one_at_a_time(grammar):
    """On CPU: every step launched before any earlier one is read gives what executing them one at a time
    gives: sampled and seeded rows, a grammar row (its matcher must see each token before the next mask),
    reused rows and verification (a verified row reused before its step was read keeps its own counts)."""
    from pdserve.engine.text.grammar import regex_grammar

    phrase = regex_grammar("the quick brown fox jumps over the lazy dog again and again")
    params = [*PARAMS, SamplingParams(temperature=0.9, seed=4, grammar=phrase if grammar else None)]
    grammar_row = new_row(len(PARAMS), params[-1])
    plan = steps()
    plan[0] = StepInput(new_rows=(*plan[0].new_rows, grammar_row),
                        chunks=(*plan[0].chunks, ChunkInput(grammar_row.row, 0, 20, True)))
    n = len(params)
    plan[1:3] = [StepInput(decode_rows=tuple(range(n)), decode_positions=(p,) * n) for p in (20, 21)]
    plan[3] = replace(plan[3], decode_rows=(*plan[3].decode_rows, grammar_row.row),
                      decode_positions=(22,) * (len(plan[3].decode_rows) + 1))
    plan[4] = replace(plan[4], decode_rows=(*plan[4].decode_rows, grammar_row.row),
                      decode_positions=(*plan[4].decode_positions, 23))
    plan += [verify_step(), StepInput(freed_rows=(6,), new_rows=(new_row(6, PARAMS[6], 10),),   # a verified row reused
                                      chunks=(ChunkInput(6, 0, 10, True),))]
    results = {}
    for ahead in (False, True):
        torch.manual_seed(0)
        runner = runner_on(torch.device("cpu"))
        if ahead:
            pending = [runner.launch(step) for step in plan]
            results[ahead] = [p.result() for p in pending]
        else:
            results[ahead] = [runner.execute(step) for step in plan]
        runner.settle()
        results[ahead].append(runner.sampling.arrays["num_outputs"][:n].tolist())
    assert results[True] == results[False]
    assert len(results[True][-3].verified) == 4
