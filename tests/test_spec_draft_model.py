"""Speculative decoding with a draft model (vLLM's `draft_model` method): its proposals are the draft
checkpoint's greedy continuation (checked against transformers) after any pattern of accepted and rejected
drafts, greedy outputs stay those of plain decoding, a draft equal to the target has every draft accepted,
and aborts, preemption and finished requests leave neither pool nor the draft's KV holding anything."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import threading
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.spec_policy import DraftGate
from pdserve.engine.core.speculative import SpeculativeConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.demo import DemoSize, make_weights, model_config
from pdserve.engine.units.drafts import check_draft_model
from pdserve.engine.worker.draft_model import DraftModelProposer, load_draft_model
from pdserve.server.cli import add_serve_arguments, server_config_from_args
from tests.models import _ROOT, demo_checkpoint, engine_config
from tests.test_engine_modes import abort_after, assert_pools_free, prompts, run_engine, staggered, wait_idle
from tests.test_spec_decode import GREEDY, drafts_unpriced  # noqa: F401  (the fixture pins the gate open)

REAL_BUDGET = DraftGate.budget          # NOTE: drafts_unpriced replaces it in every test of this module
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def first_layers_draft(target: Path, layers: int = 1) -> Path:
    """The target's first `layers` layers with its embeddings, norm and head: a draft that often agrees."""
    out = _ROOT / f"draft-{target.name}-{layers}"
    if out.is_dir():
        return out
    out.mkdir()
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    kept = {name: t for name, t in load_file(target / "model.safetensors").items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copy(target / name, out / name)
    return out


def random_draft(hidden: int, vocab: int) -> Path:
    """A random one-layer model, narrower than the target, with `vocab` tokens."""
    out = _ROOT / f"draft-random-{hidden}-{vocab}"
    if out.is_dir():
        return out
    out.mkdir()
    config = model_config(DemoSize(hidden, 1, 2, 1, 2 * hidden, vocab, 4096, torch.float32), "llama")
    save_file(make_weights(config, torch.float32, seed=3), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(demo_checkpoint() / name, out / name)
    return out


def spec(draft: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.from_json({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})


def echo_prompts(lengths, seed=0):
    return [p * 2 for p in prompts(lengths, seed=seed)]


def drafter(engine: Engine) -> DraftModelProposer:
    return engine.actors[-1].speculator.draft_model


def assert_draft_kv_free(engine: Engine) -> None:
    for actor in engine.actors:
        if actor.speculator is not None:
            proposer = actor.speculator.draft_model
            assert proposer.blocks.num_used == 0 and not proposer.rows
            proposer.blocks.check_consistency()


def generate(mode: str, requests, speculative=None, **overrides):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=32, speculative=speculative,
                                  **overrides))
    outputs = asyncio.run(run_engine(engine, staggered(engine, requests)))
    assert_pools_free(engine)
    if speculative is not None:
        assert_draft_kv_free(engine)
    return outputs, engine


def plain_and_drafted(mode: str, requests, speculative, **overrides):
    plain, engine = generate(mode, requests, **overrides)
    engine.close()
    drafted, engine = generate(mode, requests, speculative, **overrides)
    counters = engine.actors[-1].speculator.counters
    engine.close()
    return plain, drafted, counters


# configuration
def test_config_needs_a_model_for_draft_model_only():
    config = SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/m", 3)
    for bad in ('{"method": "draft_model"}', '{"method": "ngram", "model": "/m"}',
                '{"method": "suffix", "model": "/m"}', '{"method": "draft_model", "model": "/m", "prompt_lookup_max": 2}',
                '{"method": "draft_model", "model": "/m", "suffix_decoding_max_tree_depth": 8}'):
        with pytest.raises(ValueError, match="speculative-config"):
            SpeculativeConfig.from_json(bad)


def test_pdserve_serve_passes_the_draft_model_through():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "draft_model", "model": "/d", '
                                                      '"num_speculative_tokens": 2}'])
    assert server_config_from_args(args).engine.speculative == SpeculativeConfig("draft_model", 2, model="/d")


def test_the_gate_prices_each_draft_token_at_one_draft_forward():
    """A step of 2 rows: 10 ms plain, 1 ms per verified draft token, and 3 ms per draft forward."""
    gate = DraftGate(4, None)
    for rows, drafts in ((1, 0), (2, 0), (2, 4), (3, 2), (1, 3), (2, 1)):
        gate.observe_step(rows, drafts, 0.008 + 0.001 * rows + 0.001 * drafts, threads=1, drafts=drafts)
    verify = REAL_BUDGET(gate, 2, 0).per_draft
    assert verify == pytest.approx(0.001, rel=0.01)        # the fit's ridge shifts it a little
    gate.draft_forward = 0.003
    assert REAL_BUDGET(gate, 2, 0).per_draft == pytest.approx(verify + 0.003)
    gate.draft_forward = 0.005                          # 2 rows x 6 ms per draft token >= 10 ms: no draft pays
    assert REAL_BUDGET(gate, 2, 0) is None


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(monkeypatch):
    monkeypatch.setattr("pdserve.engine.engine.on_single_threaded_loader", lambda *a: pytest.fail("loaded first"))
    with pytest.raises(ValueError, match=r"vocabulary of 512 tokens.* 1024"):
        Engine(engine_config(demo_checkpoint(), mode="colocated", speculative=spec(random_draft(64, 512))))


def test_the_ray_backend_is_refused_with_a_draft_model():
    config = engine_config(demo_checkpoint(), distributed_executor_backend="ray", speculative=spec(demo_checkpoint()))
    with pytest.raises(ValueError, match="Ray backend"):
        check_draft_model(config, ModelConfig.from_dir(demo_checkpoint()))


# proposals
def transformers_greedy(model, context: list[int], k: int) -> list[int]:
    ids = torch.tensor([context])
    out = []
    with torch.no_grad():
        for _ in range(k):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_proposals_are_the_drafts_greedy_continuation_after_accepts_and_rejections():
    draft = first_layers_draft(demo_checkpoint())
    target = ModelConfig.from_dir(demo_checkpoint())
    proposer = DraftModelProposer(load_draft_model(str(draft), target, torch.float32, torch.device("cpu"), 512),
                                  num_blocks=64, block_size=16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    rng = random.Random(0)
    contexts = {f"r{i}": list(p) for i, p in enumerate(prompts([7, 30, 18], seed=8))}
    for _ in range(8):
        ks = {r: rng.randint(1, 5) for r in contexts}
        rows = [(r, torch.tensor(c).numpy(), ks[r]) for r, c in contexts.items() if rng.random() < 0.7]
        for (r, _, k), drafts in zip(rows, proposer.propose(rows)):
            assert list(drafts) == transformers_greedy(reference, contexts[r], k)
            kept = rng.randint(0, k)                    # what a verification might keep, then another token
            bonus = rng.choice([t for t in range(3, 1024) if kept == k or t != drafts[kept]])
            contexts[r] += list(drafts[:kept]) + [bonus]
        for r in set(contexts) - {r for r, _, _ in rows}:     # steps without drafts: plain tokens
            contexts[r] += [rng.randrange(3, 1024) for _ in range(rng.randint(1, 3))]
    for r in contexts:
        proposer.release(r)
    assert proposer.blocks.num_used == 0 and not proposer.rows


def test_a_row_without_free_draft_blocks_drafts_nothing_and_holds_nothing():
    target = ModelConfig.from_dir(demo_checkpoint())
    proposer = DraftModelProposer(load_draft_model(str(demo_checkpoint()), target, torch.float32,
                                                   torch.device("cpu"), 512), num_blocks=3, block_size=16)
    short, long = (torch.tensor(p).numpy() for p in prompts([20, 50], seed=9))
    assert proposer.propose([("long", long, 4), ("short", short, 4)])[0] == ()     # 53 positions: 4 blocks
    assert len(proposer.propose([("short", short, 4)])[0]) == 4
    assert not proposer.blocks.holds("long") and "long" not in proposer.rows
    proposer.release("short")
    assert proposer.blocks.num_used == 0


# the engine: the same greedy tokens, every pool free
@pytest.mark.parametrize("mode", ("colocated", "disaggregated", "adaptive"))
def test_greedy_tokens_identical_with_a_smaller_draft(mode):
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(echo_prompts([20, 40, 9, 33], seed=1))]
    plain, drafted, counters = plain_and_drafted(mode, requests, spec(first_layers_draft(demo_checkpoint())))
    assert drafted == plain
    assert counters.num_drafts > 0 and counters.num_draft_tokens > counters.num_accepted_tokens


def test_the_target_as_its_own_draft_has_every_draft_accepted(monkeypatch):
    threads, propose = set(), DraftModelProposer._propose

    def on_thread(self, rows):
        threads.add(threading.current_thread().name)
        return propose(self, rows)

    monkeypatch.setattr(DraftModelProposer, "_propose", on_thread)
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(echo_prompts([20, 40, 9], seed=2))]
    plain, drafted, counters = plain_and_drafted("disaggregated", requests, spec(demo_checkpoint()))
    assert drafted == plain
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens == counters.num_draft_tokens
    assert threads == {"pdserve-decode_0"}              # the decode unit's compute thread, not the loop's


def test_seeded_sampled_rows_give_the_tokens_plain_sampling_gives():
    """Greedy drafts are one-hot proposals: the verification's rule keeps plain sampling's draws exactly."""
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(echo_prompts([30, 12], seed=4))]
    plain, drafted, counters = plain_and_drafted("colocated", requests, spec(demo_checkpoint()))
    assert drafted == plain and all(len(t) == 30 for t in drafted)
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens     # sampling rejects some greedy drafts


def test_process_workers_give_the_same_greedy_tokens():
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(echo_prompts([20, 40], seed=3))]
    plain, engine = generate("disaggregated", requests)
    engine.close()
    drafted, engine = generate("disaggregated", requests, spec(demo_checkpoint()), workers="process")
    counters = engine.actors[-1].speculator.counters
    engine.close()
    assert drafted == plain
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens == counters.num_draft_tokens


@pytest.mark.parametrize("mode", ("colocated", "disaggregated"))
def test_aborts_mid_stream_free_every_pool_and_the_draft_kv(mode):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=32,
                                  speculative=spec(first_layers_draft(demo_checkpoint()))))
    rng = random.Random(0)

    async def scenario():
        streams = [engine.submit(Request(f"a{i}", p, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)))
                   for i, p in enumerate(echo_prompts([rng.randint(4, 60) for _ in range(10)], seed=5))]
        results = await asyncio.gather(*(abort_after(engine, s, rng.randint(1, 12)) for s in streams))
        await wait_idle(engine)
        held = drafter(engine).blocks.num_used         # every request has left: nothing may remain
        return results, held

    results, held = asyncio.run(run_engine(engine, scenario()))
    assert held == 0 and not drafter(engine).rows
    assert any(reason is FinishReason.ABORT for _, reason in results)
    assert engine.actors[-1].speculator.counters.num_drafts > 0
    assert_pools_free(engine)
    engine.close()


def test_preemption_frees_the_draft_kv_and_keeps_tokens():
    requests = [Request(f"p{i}", p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(echo_prompts([14] * 8, seed=6))]
    expected, engine = generate("disaggregated", requests, max_model_len=256)
    engine.close()
    got, tight = generate("disaggregated", requests, spec(demo_checkpoint()), max_model_len=256,
                          kv_cache_memory="1MiB")
    assert tight.actors[-1].scheduler.num_preemptions > 0
    tight.close()
    assert got == expected
