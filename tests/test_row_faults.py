"""A request's own data fails that request alone: a row whose sampling parameters, grammar or drafts raise
inside a unit's step ends with an error while the other streams on the same unit finish with the tokens they
would have had (transformers' greedy tokens); no actor restarts, and every pool is free after."""
from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.speculative import Speculator, SpeculativeConfig
from pdserve.engine.core.spec_policy import DraftGate, StepBudget
from pdserve.engine.engine import Engine
from pdserve.engine.text.grammar import GrammarCache
from pdserve.engine.worker.sampling.sampling_table import SamplingTable
from tests.models import SLOS_SET, engine_config, hf_checkpoint
from tests.test_coordinator import collect_events, llama3  # noqa: F401  (fixture)
from tests.test_engine_modes import assert_pools_free, prompts, run_engine

BATCH = prompts([12, 40, 7, 25, 33, 9], seed=23)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
MARK = 4242                                           # the seed that marks the faulty request (greedy: unused)
FAULTY = {"sampling table": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, seed=MARK),
          "grammar": SamplingParams(max_tokens=16, temperature=0.0, seed=MARK, grammar='{"grammars": []}'),
          "proposer": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, seed=MARK)}


def inject(where: str, monkeypatch) -> None:
    """Make the admission of the marked request's row raise in `where` (and only there)."""
    if where == "sampling table":
        add = SamplingTable.add

        def add_or_fail(self, row, params, prompt, outputs):
            if params.seed == MARK:
                raise OverflowError("injected: this row's parameters do not fit")
            add(self, row, params, prompt, outputs)

        monkeypatch.setattr(SamplingTable, "add", add_or_fail)
    elif where == "grammar":
        def broken(self, grammar, outputs):
            raise ValueError("injected: this grammar cannot be built")

        monkeypatch.setattr(GrammarCache, "matcher", broken)
    else:
        propose = Speculator._propose

        def propose_or_fail(self, seq, k):
            if seq.params.seed == MARK:
                raise IndexError("injected: this row's lookup failed")
            return propose(self, seq, k)

        monkeypatch.setattr(Speculator, "_propose", propose_or_fail)
        monkeypatch.setattr(DraftGate, "budget", lambda self, rows, prefill_tokens:
                            None if prefill_tokens > 0 or rows <= 0 else StepBudget())


def greedy(model, prompt) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()


async def faulty_among_others(engine: Engine, where: str):
    """The others start first; the faulty one joins their unit while they stream."""
    others = [engine.submit(Request(f"r{i}", p, GREEDY)) for i, p in enumerate(BATCH)]
    first = await asyncio.gather(*(stream.__anext__() for stream in others))
    faulty = collect_events(engine.submit(Request("faulty", BATCH[0] + BATCH[2], FAULTY[where])))
    rest = await asyncio.gather(faulty, *(collect_events(stream) for stream in others))
    return rest[0], [[*head.token_ids, *(t for e in events for t in e.token_ids)]
                     for head, events in zip(first, rest[1:])]


@pytest.mark.parametrize("where", ["sampling table", "grammar", "proposer"])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "adaptive"])
def test_a_row_whose_admission_fails_ends_alone_and_the_unit_serves_on(mode, where, monkeypatch, llama3):
    inject(where, monkeypatch)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = Engine(engine_config(hf_checkpoint("llama3"), mode=mode, max_prefill_tokens=32, **SLOS_SET,
                                  speculative=spec if where == "proposer" else None))
    faulty, others = asyncio.run(run_engine(engine, faulty_among_others(engine, where)))
    assert faulty[-1].finish_reason is FinishReason.ERROR and "injected" in faulty[-1].error
    assert others == [greedy(llama3, p) for p in BATCH]
    assert engine.supervisor.restarts == 0 and engine.dead is None
    assert all(actor.alive is False and actor.failure is None for actor in engine.actors)   # stopped, never failed
    assert_pools_free(engine)
    engine.close()


def test_process_workers_report_a_rows_fault_across_the_process_boundary(llama3):
    """A seed no worker table can hold, let past validation: the worker's step reports the row; the unit lives."""
    engine = Engine(engine_config(hf_checkpoint("llama3"), mode="disaggregated", max_prefill_tokens=32, **SLOS_SET,
                                  workers="process"))
    unchecked = SamplingParams.unchecked(max_tokens=16, temperature=0.0, ignore_eos=True, seed=1 << 63)

    async def scenario():
        streams = [engine.submit(Request(f"r{i}", p, GREEDY)) for i, p in enumerate(BATCH[:3])]
        faulty = engine.submit(Request("faulty", BATCH[3], unchecked))
        return await asyncio.gather(collect_events(faulty), *(collect_events(s) for s in streams))

    faulty, *others = asyncio.run(run_engine(engine, scenario()))
    assert faulty[-1].finish_reason is FinishReason.ERROR and "OverflowError" in faulty[-1].error
    assert [[t for e in events for t in e.token_ids] for events in others] == [greedy(llama3, p) for p in BATCH[:3]]
    assert engine.supervisor.restarts == 0
    assert_pools_free(engine)
    engine.close()
