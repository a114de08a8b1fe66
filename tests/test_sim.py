"""engine/sim and `pdserve simulate` / `pdserve plan`: the virtual clock, the roofline against figures worked
by hand, the engine's own coordinator and actors over simulated units (prefix-cache hits and routing as the
real logic gives them), determinism per seed, and plan's ranking and command line."""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from dataclasses import replace

import pytest
import torch

from pdserve.bench import loadtest, plan, simulate
from pdserve.bench.sim_replay import WordIds, send
from pdserve.bench.workloads import SampleRequest
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.sim.clock import SimulationStalled, run_virtual
from pdserve.engine.sim.cost import FittedCost, Roofline, StepShape, fit, step_shape
from pdserve.engine.sim.target import Target, simulated_engine
from pdserve.engine.sim.units import CoreSet, SimCompute, UnitModel
from pdserve.engine.sim.hardware import HARDWARE
from pdserve.engine.sim.shapes import NAMED_SHAPES
from pdserve.engine.worker.step import ChunkInput, StepInput, StepWork
from pdserve.server.cli import COMMANDS
from tests.models import hf_checkpoint

LLAMA_8B, H200 = NAMED_SHAPES["llama-8b"], HARDWARE["h200"]


def test_the_virtual_clock_jumps_to_the_next_timer_and_reports_a_stall():
    async def sleeper():
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(3600.0), asyncio.sleep(7200.0))
        return loop.time()

    assert run_virtual(sleeper()) == pytest.approx(7200.0)

    async def forever():
        await asyncio.Event().wait()

    with pytest.raises(SimulationStalled):
        run_virtual(forever())


def test_roofline_of_llama_8b_on_h200_matches_the_figures_worked_by_hand():
    # per layer 2*4096*4096 (q, o) + 2*4096*1024 (k, v) + 3*4096*14336 (MLP) = 218,103,808; 32 layers and a
    # 128256 x 4096 head: 7,504,658,432 weights. KV: 2 * 32 layers * 8 heads * 128 = 65,536 values per token.
    assert (LLAMA_8B.layer_params, LLAMA_8B.weight_params, LLAMA_8B.kv_elements_per_token()) == \
        (218_103_808, 7_504_658_432, 65_536)
    roofline = Roofline(LLAMA_8B, H200, dtype_bytes=2, overhead=1e-3)
    decode = StepShape(decode_rows=1, decode_context=1000, sampled=1)      # memory-bound
    assert roofline.bytes(decode) == 15_009_316_864 + 131_072 * 1000
    assert roofline.flops(decode) == 13_958_643_712 + 1_050_673_152 + 524_288_000
    assert roofline.seconds(decode) == pytest.approx(15_140_388_864 / 4.8e12 + 1e-3)
    chunk = step_shape(StepInput(chunks=(ChunkInput(0, 0, 2048, sample=True),)))   # compute-bound
    assert (chunk.prefill_tokens, chunk.prefill_pairs, chunk.sampled) == (2048, 2048 * 2049 // 2, 1)
    assert roofline.seconds(chunk) == pytest.approx(29_688_401_494_016 / 989e12 + 1e-3)
    assert roofline.transfer_seconds(131_072 * 1024) == pytest.approx(131_072 * 1024 / 450e9)


@pytest.mark.parametrize("name, active, total", [("mixtral-8x7b", 12.9e9, 46.7e9), ("qwen3-30b-a3b", 3.3e9, 30.5e9)])
def test_an_expert_layer_is_priced_by_the_experts_its_tokens_read(name, active, total):
    """The shapes' parameters as their model cards count them (active / total, embeddings included): a one-row
    decode step reads the active weights, a 256-row one every expert; the pool is sized after all of them."""
    shape = NAMED_SHAPES[name]
    embedding = shape.vocab_size * shape.hidden_size
    assert shape.weight_params + embedding == pytest.approx(active, rel=0.02)     # cards round to one decimal
    assert shape.stored_params + embedding == pytest.approx(total, rel=0.01)
    roofline, kv = Roofline(shape, H200, dtype_bytes=2, overhead=0.0), shape.kv_elements_per_token() * 2
    assert roofline.bytes(StepShape(decode_rows=1, decode_context=1, sampled=1)) == shape.weight_params * 2 + kv
    many = StepShape(decode_rows=256, decode_context=256, sampled=256)
    assert roofline.bytes(many) == pytest.approx(shape.stored_params * 2 + 256 * kv, rel=1e-3)
    assert roofline.flops(many) == pytest.approx(256 * 2 * shape.weight_params, rel=0.01)


def test_a_recurrent_layer_costs_the_same_at_any_context_and_reads_and_writes_each_rows_state():
    """Qwen3-Next's shape (three Gated DeltaNet layers to one attention layer): a longer context reads more KV of
    the attention layer only; each row of a step reads and writes its state once."""
    shape = ModelConfig.from_dir(hf_checkpoint("qwen3-next"))
    assert (shape.num_recurrent_layers, shape.num_kv_layers) == (3, 1)
    roofline = Roofline(shape, H200, dtype_bytes=2, overhead=0.0)
    kv = 2 * shape.num_kv_heads * shape.head_dim * 2
    one = StepShape(decode_rows=1, decode_context=1000, sampled=1)
    assert roofline.bytes(replace(one, decode_context=2000)) - roofline.bytes(one) == 1000 * kv
    assert roofline.flops(replace(one, decode_context=2000)) - roofline.flops(one) == \
        4 * 1000 * shape.num_heads * shape.head_dim
    two = StepShape(decode_rows=2, decode_context=2000, sampled=2)
    read_twice = roofline.bytes(two) - roofline.bytes(replace(one, decode_context=2000))
    assert read_twice == pytest.approx(shape.params_read(2) * 2 - shape.params_read(1) * 2 + 2 * shape.state_bytes())


def test_a_fit_recovers_linear_step_costs_and_never_goes_negative():
    truth = (2e-3, 5e-5, 1e-8, 3e-4, 2e-7, 8e-3)
    shapes = [StepShape(prefill_tokens=n, prompt_chunks=int(n > 0), prefill_pairs=n * (n + 1) // 2 + n * c,
                        decode_rows=r, decode_context=r * c)
              for n in (0, 16, 256) for r in (0, 4, 16) for c in (32, 512)]
    samples = [(s, sum(w * x for w, x in zip(truth, (1, s.prefill_tokens, s.prefill_pairs, s.decode_rows,
                                                        s.decode_context, s.prompt_chunks)))) for s in shapes]
    assert fit(samples) == pytest.approx(truth, rel=1e-6)
    cost = FittedCost({1: fit(samples), 4: (1.0, 0, 0, 0, 0, 0)}, copy_bandwidth=1e9)
    assert cost.seconds(StepShape(), threads=3) == pytest.approx(1.0)          # nearest measured count
    assert replace(cost, overhead=0.5).seconds(StepShape(), threads=4) == pytest.approx(1.5)
    assert FittedCost.from_json(json.loads(json.dumps(cost.to_json()))) == cost
    noisy = [(s, t - 0.01 * s.decode_rows) for s, t in samples]             # would need a negative coefficient
    assert min(fit(noisy)) >= 0.0


def test_a_fit_prices_a_one_row_decode_step_beside_long_prefill_chunks_within_a_tenth():
    """Steps that are not one line in their counts (kernels chosen by row count): weighed by their own time, the
    short decode steps a chat's inter-token latency is made of are not left to absorb the long chunks' error."""
    def seconds(s: StepShape) -> float:
        if s.prefill_tokens:
            return 0.03 + 1e-3 * s.prefill_tokens + 1e-6 * s.prefill_pairs
        per_row = 3e-4 if s.decode_rows <= 16 else 1.2e-3
        return (0.007 if s.decode_rows <= 16 else 0.004) + per_row * s.decode_rows + 2e-6 * s.decode_context

    shapes = [StepShape(prefill_tokens=n, prompt_chunks=1, prefill_pairs=n * (n + 1) // 2) for n in (16, 64, 256, 1024)]
    shapes += [StepShape(decode_rows=r, decode_context=r * c, sampled=r) for r in (1, 4, 16, 32) for c in (32, 1024)]
    cost = FittedCost({2: fit([(s, seconds(s)) for s in shapes])}, copy_bandwidth=1e9)
    one_row = StepShape(decode_rows=1, decode_context=300, sampled=1)
    assert cost.seconds(one_row, threads=2) == pytest.approx(seconds(one_row), rel=0.1)
    assert all(cost.seconds(s, threads=2) == pytest.approx(seconds(s), rel=0.01) for s in shapes[:4])


class _SecondsPerThreads:
    """A cost model whose step takes 1 s on one thread and 0.6 s on two, whatever the step."""

    def seconds(self, shape: StepShape, threads: int | None = None) -> float:
        return 1.0 if threads == 1 else 0.6

    def transfer_seconds(self, nbytes: int) -> float:
        return 0.0


def test_units_that_lend_each_other_cores_step_side_by_side_and_a_lent_step_waits_for_both_cores():
    """Adaptive mode's prefill and decode units share one core set: a one-thread step of each runs at once (as the
    served units' threads do), a two-thread step takes both cores, and a unit runs its own steps one at a time."""
    cores = CoreSet([0.0, 0.0])
    model = dict(device=torch.device("cpu"), num_blocks=8, block_size=16, eos_token_ids=frozenset(), token_id=1,
                 cost=_SecondsPerThreads(), cores=cores, links=(), block_bytes=1)
    prefill, decode = SimCompute(UnitModel(**model)), SimCompute(UnitModel(**model))
    step = StepInput(decode_rows=(0,), decode_positions=(3,))

    async def main():
        loop = asyncio.get_running_loop()
        first = [prefill.submit(StepWork(step, threads=1)), decode.submit(StepWork(step, threads=1))]
        own = decode.submit(StepWork(step, threads=1))          # the decode unit's next step: after its first
        lent = prefill.submit(StepWork(step, threads=2))        # both cores: after every step above
        ends = []
        for future in (*first, own, lent):
            await future
            ends.append(loop.time())
        return ends

    assert run_virtual(main()) == pytest.approx([1.0, 1.0, 2.0, 2.6])


def _config(mode: str, prefill="cuda:0", decode="cuda:1", **scheduler) -> EngineConfig:
    return EngineConfig(mode=mode, prefill_device=prefill, decode_device=decode,
                        cache=CacheConfig(block_size=16, kv_cache_memory="0.9"), scheduler=SchedulerConfig(**scheduler))


def _target() -> Target:
    return Target(LLAMA_8B, Roofline(LLAMA_8B, H200), H200)


def _chat_turns(config: EngineConfig, turns: int = 3, output_len: int = 5):
    """One conversation of `turns` turns through a simulated engine: the engine, and (prompt ids, record) per turn."""
    history, sent = [{"role": "system", "content": " ".join(f"w{i}" for i in range(100))}], []

    async def main():
        engine = simulated_engine(config, _target())
        ids = WordIds(engine.model_config.vocab_size, engine.units.decoding[0].model.token_id)
        await engine.start()
        for turn in range(1, turns + 1):
            history.append({"role": "user", "content": f"question {turn} about this"})
            sample = SampleRequest("", 0, output_len, "chat", tuple(history), 0, turn)
            record, answer = await send(engine, ids, sample, turn, 0.0)
            sent.append((ids.sample(sample), record))
            history.append({"role": "assistant", "content": answer})
        await engine.stop()
        return engine, sent

    return run_virtual(main())


def test_the_real_coordinator_and_actors_serve_a_chat_with_prefix_cache_hits_where_the_blocks_are():
    engine, sent = _chat_turns(_config("disaggregated"))
    assert type(engine).__module__ == "pdserve.engine.engine"
    assert type(engine.coordinator).__module__ == "pdserve.engine.coordinator.coordinator"
    assert {type(a).__name__ for a in engine.coordinator.actors} == {"PrefillActor", "DecodeActor"}
    for (prompt, record), (previous, _) in zip(sent[1:], sent):
        assert record.success and record.output_tokens == 5 and len(record.itl) == 4
        assert prompt[:len(previous)] == previous        # the history, then the answer the units emitted
        # the prefill unit cached the previous prompt's full blocks (it never computes the answer's KV)
        assert record.cached_tokens == len(previous) // 16 * 16
    assert sent[0][1].cached_tokens == 0
    prefill, decode = engine.stats().actors
    assert (prefill.routed_prefill, decode.kv_blocks_used, prefill.kv_blocks_used) == (3, 0, 0)


def test_colocated_units_keep_a_conversation_where_its_prefix_is_cached():
    engine, sent = _chat_turns(_config("colocated", prefill="cuda:0,cuda:1", decode=None), turns=4)
    # a colocated unit computes the answer's KV too: all but the last token of prompt + output is cached
    for (prompt, record), (previous, _) in zip(sent[1:], sent):
        assert record.cached_tokens == (len(previous) + 5 - 1) // 16 * 16
    assert sorted(s.routed_prefill for s in engine.stats().actors) == [0, 4]       # every turn to the unit holding it


def _simulate_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    return parser.parse_args(["--hardware", "h200", "--model-shape", "llama-8b", "--dataset-name", "mixed",
                              "--long-input-len", "3000", "--long-fraction", "0.3", "--output-len", "16",
                              "--num-prompts", "30", "--request-rate", "20", "--num-warmups", "2",
                              "--slo", "ttft_ms=300", "itl_ms=30", *extra])


def test_a_simulation_is_the_same_json_for_a_seed_and_another_for_another(tmp_path, capsys):
    outputs = []
    for run, seed in enumerate((0, 0, 1)):
        out = tmp_path / f"{run}.json"
        assert simulate.run(_simulate_args("--mode", "adaptive", "--seed", str(seed), "--result-json", str(out))) == 0
        document = json.loads(out.read_text())
        outputs.append({k: document[k] for k in ("summary", "requests", "workload", "traffic")})
    assert outputs[0] == outputs[1] and outputs[0] != outputs[2]
    assert outputs[0]["summary"]["completed"] == 30 and outputs[0]["summary"]["request_goodput"] is not None
    assert "Request goodput (req/s):" in capsys.readouterr().out


def test_bad_simulation_options_are_errors_naming_them(capsys):
    assert simulate.run(_simulate_args("--step-overhead-ms", "-1")) == 2
    assert "--step-overhead-ms" in capsys.readouterr().err
    assert simulate.run(_simulate_args("--mode", "colocated", "--prefill-device", "cpu")) == 2
    assert "cuda devices" in capsys.readouterr().err


def test_plan_ranks_by_goodput_and_recommends_a_command_serve_accepts(capsys):
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    args = parser.parse_args(["--hardware", "l40s", "--devices", "2", "--model-shape", "llama-8b",
                              "--dataset-name", "mixed", "--long-input-len", "3000", "--long-fraction", "0.3",
                              "--output-len", "16", "--num-prompts", "30", "--request-rate", "8",
                              "--max-num-seqs", "64", "--slo", "ttft_ms=1000", "itl_ms=40"])
    assert plan.run(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| config")]
    names = [row.split("|")[1].strip() for row in rows]
    assert sorted(names) == ["1P1D", "adaptive 1P1D", "colocated x2"]
    goodputs = [float(row.split("|")[2]) for row in rows]
    assert all(a >= 0.985 * b for a, b in zip(goodputs, goodputs[1:]))      # ties within 1% go by headroom
    assert goodputs[0] > goodputs[-1]              # a 30% long-document load: splitting matters on PCIe L40S
    command = shlex.split(out.split("recommended: ")[1].strip())
    assert command[:2] == ["pdserve", "serve"] and "--max-num-seqs" in command
    serve = argparse.ArgumentParser()
    COMMANDS["serve"].add_arguments(serve)
    chosen = serve.parse_args(command[2:])
    best = next(c for c in plan.candidates(2) if c.name == names[0])
    assert (chosen.mode, chosen.prefill_device, chosen.max_num_seqs) == (best.mode, best.prefill_device, 64)
    assert (chosen.ttft_slo_ms, chosen.itl_slo_ms) == (1000.0, 40.0)      # the engine plans toward plan's SLO


def test_plan_lists_every_split():
    assert [c.name for c in plan.candidates(3)] == ["colocated x3", "1P2D", "adaptive 1P2D", "2P1D", "adaptive 2P1D"]
    assert plan.candidates(3)[3].flags() == ["--mode", "disaggregated", "--prefill-device", "cuda:0,cuda:1",
                                             "--decode-device", "cuda:2"]


async def test_the_result_json_has_the_keys_of_a_real_bench_run(tiny_model_dir, tmp_path):
    from aiohttp.test_utils import TestServer

    from pdserve.engine.engine import Engine
    from pdserve.server.app import create_app
    from pdserve.server.config import ServerConfig

    workload = ["--dataset-name", "mixed", "--short-input-len", "8", "--long-input-len", "40", "--output-len", "4",
                "--num-prompts", "4", "--request-rate", "50", "--slo", "ttft_ms=60000", "itl_ms=60000"]
    config = EngineConfig(model=str(tiny_model_dir), mode="colocated", cache=CacheConfig(kv_cache_memory="32MiB"),
                          scheduler=SchedulerConfig(max_model_len=128))
    engine = Engine(config)
    server = TestServer(create_app(ServerConfig(engine=config), engine))
    await server.start_server()
    try:
        parser = argparse.ArgumentParser()
        loadtest.add_arguments(parser)
        bench_args = parser.parse_args(["--base-url", str(server.make_url("")).rstrip("/"), "--disable-tqdm",
                                        "--result-json", str(tmp_path / "bench.json"), *workload])
        assert await loadtest._run(bench_args, loadtest.options_from_args(bench_args)) == 0
    finally:
        await server.close()
        engine.close()
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    sim_args = parser.parse_args(["--hardware", "h100", "--model-shape", "llama-13b", "--mode", "colocated",
                                  "--prefill-device", "cuda:0", "--result-json", str(tmp_path / "sim.json"),
                                  *workload])
    await asyncio.to_thread(simulate.run, sim_args)
    measured, predicted = (json.loads((tmp_path / name).read_text()) for name in ("bench.json", "sim.json"))
    assert predicted.keys() == measured.keys()
    assert predicted["summary"].keys() == measured["summary"].keys()
    assert [r.keys() for r in predicted["requests"]] == [r.keys() for r in measured["requests"]]
    assert [r["kind"] for r in predicted["requests"]] == [r["kind"] for r in measured["requests"]]
    assert predicted["workload"] == measured["workload"] and predicted["traffic"] == measured["traffic"]
    table = simulate.compare_table(predicted["summary"], measured["summary"])
    assert "| request_throughput |" in table and "x |" in table


def _own_options(add_arguments) -> set[str]:
    """The options a command adds beyond the engine's and `pdserve bench`'s workload, traffic and metrics."""
    from pdserve.bench.workloads import add_traffic_arguments, add_workload_arguments
    from pdserve.engine.args import add_engine_args

    def names(*adders) -> set[str]:
        parser = argparse.ArgumentParser()
        for add in adders:
            add(parser)
        return {name for action in parser._actions for name in action.option_strings} - {"-h", "--help"}

    inherited = names(add_engine_args, add_workload_arguments, add_traffic_arguments, loadtest.add_metric_arguments)
    return names(add_arguments) - inherited


def test_the_readme_table_has_one_row_per_simulate_and_plan_option():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("| simulate / plan option |")[1].split("\n\n")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = [name for row in rows for name in re.findall(r"`(--[a-z0-9-]+)`", row.split("|")[1])]
    assert sorted(named) == sorted(set(named)) == sorted(_own_options(simulate.add_arguments)
                                                         | _own_options(plan.add_arguments))


def test_measured_hardware_profiles_the_real_units_and_reuses_the_profile(tiny_model_dir, tmp_path, capsys):
    profile, bench = tmp_path / "profile.json", tmp_path / "bench.json"
    argv = ["--hardware", "measured", "--model", str(tiny_model_dir), "--mode", "colocated", "--max-num-seqs", "4",
            "--max-prefill-tokens", "64", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--dataset-name", "mixed", "--short-input-len", "8", "--long-input-len", "40", "--output-len", "4",
            "--num-prompts", "6", "--profile-json", str(profile)]
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    assert simulate.run(parser.parse_args(argv + ["--result-json", str(bench)])) == 0
    units = json.loads(profile.read_text())["units"]
    assert [u["role"] for u in units] == ["colocated"] and units[0]["num_blocks"] > 0
    assert all(c >= 0 for fits in units[0]["cost"]["coefficients"].values() for c in fits)
    assert units[0]["step_overhead"] > 0                   # a step's result reaches the loop after its compute
    for extra, overhead in (([], units[0]["step_overhead"]), (["--step-overhead-ms", "2"], 0.002)):
        args = parser.parse_args(argv + extra)                 # each step pays the measured hand-off, or the one given
        assert simulate.target_from_args(args, simulate.engine_config_from_args(args)).cost[0].overhead == overhead
    first = json.loads(bench.read_text())["requests"]
    assert simulate.run(parser.parse_args(argv + ["--compare", str(bench)])) == 0      # read back, not measured
    assert "| request_throughput |" in capsys.readouterr().out
    assert simulate.run(parser.parse_args(argv + ["--result-json", str(bench)])) == 0
    assert json.loads(bench.read_text())["requests"] == first
    assert simulate.run(parser.parse_args(argv + ["--compare", str(profile)])) == 2
    assert "not a pdserve bench --result-json" in capsys.readouterr().err
    other = [a if a != "colocated" else "disaggregated" for a in argv]
    assert simulate.run(parser.parse_args(other)) == 2
    assert "--profile-json" in capsys.readouterr().err


def test_equal_goodput_ranks_by_the_headroom_under_the_slo():
    slo = {"ttft": 1000.0, "itl": 50.0}
    roomy = {"p99_ttft_ms": 200.0, "p99_itl_ms": 5.0}
    tight = {"p99_ttft_ms": 100.0, "p99_itl_ms": 40.0}
    assert plan.headroom(roomy, slo) == pytest.approx(0.2) and plan.headroom(tight, slo) == pytest.approx(0.8)


def test_plan_says_why_no_placement_fits(capsys):
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    # Llama-2-13B keeps 819,200 bytes of KV per token: one 4096-token sequence needs 3.1 GiB of a 1 GiB pool
    args = parser.parse_args(["--hardware", "l40s", "--devices", "2", "--model-shape", "llama-13b",
                              "--kv-cache-memory", "1GiB", "--num-prompts", "2"])
    assert plan.run(args) == 2
    assert "no placement can run" in capsys.readouterr().err
    for bad in (["--attainment", "1.5"], ["--attainment", "0.9", "--request-rate", "inf"]):
        assert plan.run(parser.parse_args(["--model-shape", "llama-8b", *bad])) == 2
        assert "--attainment" in capsys.readouterr().err


def test_chat_requests_carry_the_templates_tokens_and_keep_the_history_a_prefix(tiny_model_dir):
    from pdserve.bench.sim_replay import ChatOverhead, chat_overhead
    from pdserve.engine.text.tokenizer import Tokenizer

    overhead = chat_overhead(tiny_model_dir)
    messages = [{"role": "system", "content": "one two three"}, {"role": "user", "content": "four five"}]
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    real = tokenizer.encode_chat(messages)
    ids = WordIds(1000, 7, chat=overhead)
    sample = SampleRequest("", 0, 4, "chat", tuple(messages))
    words = sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)
    added = overhead.of("system") + overhead.of("user") + overhead.generation_prompt
    assert len(ids.sample(sample)) == 5 + added and added == len(real) - words and overhead.of("user") > 0
    answered = SampleRequest("", 0, 4, "chat", (*messages, {"role": "assistant", "content": "\x00answer " * 3},
                                                 {"role": "user", "content": "six"}))
    first = ids.sample(sample)
    assert ids.sample(answered)[:len(first)] == first          # the previous prompt is a prefix: cacheable
    assert WordIds(1000, 7).sample(sample) == WordIds(1000, 7, chat=ChatOverhead()).sample(sample)


def test_the_pdserve_command_runs_simulate_and_plan(capsys):
    from pdserve.server.cli import main

    small = ["--model-shape", "llama-8b", "--random-input-len", "64", "--random-output-len", "4", "--num-prompts", "3"]
    assert main(["simulate", "--hardware", "a100", "--mode", "colocated", "--prefill-device", "cuda:0", *small]) == 0
    assert main(["plan", "--hardware", "h100", "--devices", "1", *small]) == 0
    out = capsys.readouterr().out
    assert "llama-8b on a100, colocated (simulated)" in out and "| colocated x1 |" in out
    recommended = out.split("recommended: ")[1].strip()
    assert recommended.startswith("pdserve serve --model PATH/TO/llama-8b")
    assert recommended.endswith("--mode colocated --prefill-device cuda:0")


def test_the_rate_search_brackets_then_bisects_to_the_highest_rate_that_holds():
    calls = []

    def below(limit):
        def attained(rate):
            calls.append(rate)
            return rate <= limit
        return attained

    assert plan.max_rate(below(7.3), 1.0) == pytest.approx(7.3, rel=1 / 2 ** plan.RATE_STEPS)
    assert plan.max_rate(below(7.3), 1.0) <= 7.3
    assert plan.max_rate(below(0.3), 4.0) == pytest.approx(0.3, rel=1 / 2 ** plan.RATE_STEPS)
    assert plan.max_rate(below(1e9), 1.0) == 2.0 ** plan.BRACKET_STEPS            # the bracket's top
    assert plan.max_rate(below(0.0), 1.0) == 0.0


def test_a_higher_rate_is_searched_over_the_same_arrival_time_not_the_same_count():
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    for workload, count in ((["--dataset-name", "random", "--num-prompts", "40"], "num_prompts"),
                            (["--dataset-name", "multiturn", "--num-conversations", "8"], "num_conversations")):
        options = loadtest.options_from_args(parser.parse_args([*workload, "--request-rate", "4"]))
        quadruple = plan.sustained(options, 16.0)
        assert quadruple.traffic.request_rate == 16.0
        if count == "num_prompts":
            assert quadruple.traffic.num_prompts == 160
        else:
            assert quadruple.workload.num_conversations == 32
        assert plan.sustained(options, 4.0) == options
