"""Models with recurrent layers (Qwen3-Next, Qwen3.5) served: each sequence's state slot is taken and given back
with its blocks through aborts, preemption and a failed unit, a hand-off copies exactly one slot, and what
the state rules out (speculation, prefix caching) is refused or said."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
from dataclasses import replace

import pytest

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.speculative import SpeculativeConfig
from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.worker import faults
from tests.hf_models import reference_model, transformers_greedy
from tests.models import SLOS_SET, engine_config, hf_checkpoint
from tests.test_coordinator import burst, collect_events, four_units
from tests.test_engine_modes import abort_after, assert_pools_free, prompts, run_engine, wait_idle

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@functools.cache
def expected_tokens(arch: str, prompt: tuple[int, ...]) -> list[int]:
    return transformers_greedy(reference_model(hf_checkpoint(arch)), prompt, GREEDY.max_tokens)


def assert_state_slots_free(engine: Engine) -> None:
    for actor in engine.actors:
        slots = actor.blocks.state_slots
        assert slots is not None and actor.blocks.num_free_state_slots == slots.count, actor.name


@pytest.mark.parametrize("mode", ("colocated", "disaggregated", "adaptive"))
def test_random_aborts_at_every_stage_leave_every_block_and_state_slot_free(mode):
    engine = four_units(mode, "qwen3.5")
    rng = random.Random(7)

    async def scenario():
        streams = [engine.submit(Request(f"a{i}", p, SamplingParams(max_tokens=20, ignore_eos=True)))
                   for i, p in enumerate(prompts([rng.randint(1, 150) for _ in range(24)], seed=21))]
        engine.abort("a0")
        results = await asyncio.gather(*(abort_after(engine, s, rng.randint(0, 8)) for s in streams))
        await wait_idle(engine)
        return results

    results = asyncio.run(run_engine(engine, scenario()))
    assert sum(reason is FinishReason.ABORT for _, reason in results) >= 10
    assert all(len(tokens) == 20 for tokens, reason in results if reason is FinishReason.LENGTH)
    assert_pools_free(engine)
    assert_state_slots_free(engine)
    engine.close()


def test_a_hand_off_copies_exactly_one_state_slot_per_sequence():
    engine = four_units("disaggregated", "qwen3-next")
    decode = {actor.index: actor for actor in engine.actors if actor.name == "decode"}
    copied: dict[str, list[int]] = {}
    for actor in (a for a in engine.actors if a.name == "prefill"):
        submit = actor.unit.submit

        def recording(work, submit=submit):
            for copy in work.copies:
                copied.setdefault(copy.key, []).extend((copy.peer, block) for block in copy.dst_blocks)
            return submit(work)
        actor.unit.submit = recording
    batch = prompts([5, 70, 33, 140, 9, 64], seed=11)
    outputs = asyncio.run(run_engine(engine, burst(engine, [Request(f"r{i}", p, GREEDY)
                                                            for i, p in enumerate(batch)])))
    assert outputs == [expected_tokens("qwen3-next", p) for p in batch]
    for request_id, blocks in copied.items():
        slots = {decode[peer].blocks.state_slots for peer, _ in blocks}
        [state] = slots
        in_states = sorted(block for _, block in blocks if block >= state.first_block)
        assert len(in_states) == state.blocks_per_slot, request_id
        slot = (in_states[0] - state.first_block) // state.blocks_per_slot
        assert in_states == list(state.blocks(slot)), request_id
    assert len(copied) == len(batch)
    assert_state_slots_free(engine)
    engine.close()


def test_a_failed_worker_process_frees_its_slots_and_serves_again(monkeypatch):
    monkeypatch.setenv(faults.ENV, "decode1:exit@4")
    engine = four_units("disaggregated", "qwen3.5", workers="process", **SLOS_SET)
    monkeypatch.delenv(faults.ENV)
    batch = prompts([12, 40, 7, 25, 60, 18, 33, 9], seed=17)

    async def scenario():
        first = await asyncio.gather(*(collect_events(engine.submit(Request(f"f{i}", p, GREEDY)))
                                       for i, p in enumerate(batch)))
        await asyncio.gather(*engine.supervisor.units_down.values())
        again = await burst(engine, [Request(f"g{i}", p, GREEDY) for i, p in enumerate(batch)])
        return first, again

    first, again = asyncio.run(run_engine(engine, scenario()))
    assert any(events[-1].finish_reason is FinishReason.ERROR for events in first)
    assert again == [expected_tokens("qwen3.5", p) for p in batch]
    assert_pools_free(engine)
    assert_state_slots_free(engine)
    engine.close()


def test_a_small_pool_gives_fewer_state_slots_than_sequences_and_every_request_waits_for_one(caplog):
    config = ModelConfig.from_dir(hf_checkpoint("qwen3.5"))
    memory = 7 * config.state_bytes()
    batch = prompts([30, 50, 20, 44, 61, 9, 27, 35], seed=23)
    with caplog.at_level(logging.INFO, logger="pdserve"):
        engine = Engine(engine_config(hf_checkpoint("qwen3.5"), mode="colocated", kv_cache_memory=memory))
    [actor] = engine.actors
    assert 1 <= actor.blocks.state_slots.count < len(batch)
    assert "recurrent state slots fit in half the KV pool" in caplog.text
    outputs = asyncio.run(run_engine(engine, burst(engine, [Request(f"r{i}", p, GREEDY)
                                                            for i, p in enumerate(batch)])))
    assert outputs == [expected_tokens("qwen3.5", p) for p in batch]
    assert_state_slots_free(engine)
    engine.close()


def test_prefix_caching_and_tiers_are_off_and_said_once_and_speculation_is_refused(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve"):
        config = engine_config(hf_checkpoint("qwen3.5"), mode="colocated")
        engine = Engine(replace(config, cache=replace(config.cache, kv_offload_memory=2**20)))
    assert not engine.config.cache.enable_prefix_caching and engine.config.cache.kv_offload_memory is None
    assert caplog.text.count("prefix caching is off for hf-qwen3.5, and with it the KV tiers") == 1
    engine.close()
    with pytest.raises(ValueError, match="recurrent layers keep one state per sequence"):
        Engine(engine_config(hf_checkpoint("qwen3.5"), mode="colocated",
                             speculative=SpeculativeConfig(num_speculative_tokens=2)))



def test_a_qwen35_moe_config_without_a_dense_mlp_size_parses(tmp_path):
    """Qwen3.5-MoE's config.json (as transformers' class writes it) has no intermediate_size: every MLP is experts."""
    raw = json.loads((hf_checkpoint("qwen3.5-moe") / "config.json").read_text())
    raw.pop("intermediate_size", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_dir(tmp_path)
    assert config.experts is not None and all(kind.experts for kind in config.layer_kinds)
