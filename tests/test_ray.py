"""`--distributed-executor-backend ray` on a two-node Ray cluster on this machine, every address 127.0.0.1:
prefill units on one node and decode units on the other give transformers' greedy tokens and prompt logprobs
through the HTTP API (and, with KV over gloo, the tokens through the engine); an abort while blocks are copied frees them on both nodes; a
decode unit steps on while a copy into its pool is held; a decode actor killed mid-stream ends its streams
with an error naming the unit and its node, Ray starts it again, and the engine serves again. Prefill and
decode units on one node share the decode pool (no KV through the object store) until a unit restarts."""
from __future__ import annotations

import dataclasses

import argparse
import asyncio
import contextlib
import logging
import os
import signal

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"     # NOTE: read once, when ray is imported: nodes take 127.0.0.1
os.environ["GLOO_SOCKET_IFNAME"] = "lo"                   # NOTE: the nodes inherit it: gloo's sockets on loopback

import openai  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from pdserve.engine.args import add_engine_args, engine_config_from_args  # noqa: E402
from pdserve.engine.core.messages import FinishReason, Request  # noqa: E402
from pdserve.engine.core.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.ray import actor as ray_actor  # noqa: E402
from pdserve.engine.ray import compute as ray_compute  # noqa: E402
from pdserve.engine.ray.compute import RayCompute  # noqa: E402
from pdserve.engine.ray import transport as ray_transport  # noqa: E402
from pdserve.engine.ray import units as ray_units  # noqa: E402
from pdserve.engine.ray.shared import open_peer_pool, pool_address, with_peer  # noqa: E402
from pdserve.engine.ray.units import actor_options  # noqa: E402
from pdserve.engine.worker.processes.shared_pool import PoolSpec, SharedPool  # noqa: E402
from pdserve.kernels.kv_layout import KVLayout  # noqa: E402
from pdserve.server.app import create_app  # noqa: E402
from pdserve.server.config import ServerConfig  # noqa: E402
from pdserve.server.systemd import render_unit  # noqa: E402
from tests.hf_models import reference_model, transformers_greedy  # noqa: E402
from tests.models import demo_checkpoint, engine_config, hf_checkpoint  # noqa: E402
from tests.test_engine_modes import assert_pools_free, collect, prompts, transformers_model  # noqa: F401, E402
from tests.test_supervisor import until  # noqa: E402
from tests.tolerance import assert_float32_close, reference_logprobs  # noqa: E402

LOOPBACK = "127.0.0.1"
NODE = dict(num_cpus=2, object_store_memory=100 * 2**20)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
DOOMED = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)   # NOTE: streams a fault must cut: long
#                         enough (context 2048) not to end before the kill reaches their unit, however fast decode is


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on loopback: the head advertises pdserve_prefill, the other pdserve_decode."""
    assert not ray_constants.ENABLE_RAY_CLUSTER, "ray was imported before this module: it would use this host's IP"
    nodes = Cluster(initialize_head=True, head_node_args=NODE | dict(include_dashboard=False,
                                                                     resources={"pdserve_prefill": 1}))
    decode_node = nodes.add_node(**NODE, resources={"pdserve_decode": 1})
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {LOOPBACK}
        yield nodes, decode_node.node_id
    finally:
        ray.shutdown()
        nodes.shutdown()


ENGINE_CONFIG = engine_config(demo_checkpoint(), mode="disaggregated", distributed_executor_backend="ray",
                              prefill_threads=1, decode_threads=1, max_prefill_tokens=32)


@pytest.fixture(scope="module")
def engine(cluster):
    built = Engine(ENGINE_CONFIG)
    yield built
    built.close()


def test_units_ask_for_their_role_nodes_and_their_threads_or_a_gpu():
    cluster = {"CPU": 4.0, "pdserve_decode": 1.0}
    assert actor_options("decode", "cpu", 3, cluster)["resources"] == {"pdserve_decode": 0.001}
    assert actor_options("decode", "cpu", 3, cluster)["num_cpus"] == 3
    assert "resources" not in actor_options("prefill", "cpu", 1, cluster)        # no prefill nodes: anywhere
    assert actor_options("prefill", "cuda", 8, cluster)["num_gpus"] == 1


def test_the_options_are_checked_together():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--distributed-executor-backend", "ray",
                                                        "--ray-address", "10.0.0.1:6379"]))
    assert (config.distributed_executor_backend, config.ray_address) == ("ray", "10.0.0.1:6379")
    with pytest.raises(ValueError, match="--ray-address needs --distributed-executor-backend ray"):
        engine_config_from_args(parser.parse_args(["--ray-address", "10.0.0.1:6379"]))
    with pytest.raises(ValueError, match="drop --workers"):
        engine_config_from_args(parser.parse_args(["--distributed-executor-backend", "ray", "--workers", "process"]))


def test_prefill_and_decode_on_their_nodes_give_transformers_greedy_tokens_over_http(
        cluster, engine, transformers_model):  # noqa: F811
    _, decode_node = cluster
    prefill_unit, decode_unit = engine.units.prefills[0], engine.units.decoding[0]
    assert isinstance(prefill_unit, RayCompute) and isinstance(decode_unit, RayCompute)
    assert decode_unit.where["node_id"] == decode_node != prefill_unit.where["node_id"]
    assert {prefill_unit.where["ip"], decode_unit.where["ip"]} == {LOOPBACK}
    batch = prompts([5, 90, 37, 140], seed=3)

    async def scenario():
        server = TestServer(create_app(ServerConfig(engine=engine.config), engine), host=LOOPBACK)
        await server.start_server()
        try:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
            replies = await asyncio.gather(*(client.completions.create(
                model=engine.model_name, prompt=list(p), max_tokens=12, temperature=0, logprobs=0, echo=True)
                for p in batch))
            return [r.choices[0].logprobs for r in replies]
        finally:
            await server.close()

    for prompt, logprobs in zip(batch, asyncio.run(scenario())):
        expected = transformers_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                               min_new_tokens=12)[0, len(prompt):].tolist()
        assert logprobs.tokens[len(prompt):] == [engine.tokenizer.decode([t]) for t in expected]
        ours32, ours64, scale = reference_logprobs(transformers_model, list(prompt[:1]), list(prompt[1:]))
        assert_float32_close(torch.tensor(logprobs.token_logprobs[1:len(prompt)]), ours32, ours64, scale)
    assert_pools_free(engine)


def test_kv_over_gloo_gives_transformers_greedy_tokens(cluster, transformers_model):  # noqa: F811
    gloo = Engine(dataclasses.replace(ENGINE_CONFIG, ray_kv_transport=ray_transport.GLOO))
    batch = prompts([5, 90, 37], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def scenario():
        await gloo.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(
                collect(gloo.submit(Request(f"g{i}", p, params))) for i, p in enumerate(batch))), 120)
        finally:
            await gloo.stop()

    try:
        assert gloo.units.prefills[0].transport.name == ray_transport.GLOO
        results = asyncio.run(scenario())
        for prompt, (tokens, _) in zip(batch, results):
            expected = transformers_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                                   min_new_tokens=8)[0, len(prompt):].tolist()
            assert tokens == expected
        assert gloo.units.prefills[0].transport.name == ray_transport.GLOO      # no copy fell back
        assert_pools_free(gloo)
    finally:
        gloo.close()


def test_a_hybrid_models_state_slots_cross_nodes_with_its_blocks(cluster):
    """Qwen3.5's Gated DeltaNet states travel to the decode node in their slots, as one more run of blocks."""
    hybrid = Engine(dataclasses.replace(ENGINE_CONFIG, model=str(hf_checkpoint("qwen3.5"))))
    batch = prompts([5, 90, 37], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def scenario():
        await hybrid.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(
                collect(hybrid.submit(Request(f"h{i}", p, params))) for i, p in enumerate(batch))), 120)
        finally:
            await hybrid.stop()

    try:
        results = asyncio.run(scenario())
        reference = reference_model(hf_checkpoint("qwen3.5"))
        assert [tokens for tokens, _ in results] == [transformers_greedy(reference, p, 8) for p in batch]
        assert_pools_free(hybrid)
        assert all(a.blocks.num_free_state_slots == a.blocks.state_slots.count for a in hybrid.actors)
    finally:
        hybrid.close()


def test_a_transport_named_wrong_is_refused_and_gloo_falls_back_for_good():
    with pytest.raises(ValueError, match="--ray-kv-transport must be one of object-store, gloo"):
        ray_transport.KVTransport("nccl")
    transport = ray_transport.KVTransport(ray_transport.GLOO)
    transport.fall_back("a unit restarted")
    assert (transport.name, transport.configured) == (ray_transport.OBJECT_STORE, ray_transport.GLOO)


def test_a_fall_back_detaches_every_unit_that_shares_a_pool_once_and_for_good(caplog):
    class Sharing:
        detached = 0

        def detach(self) -> None:
            self.detached += 1

    transport, unit = ray_transport.KVTransport(), Sharing()
    transport.share(unit)
    transport.share(unit)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.ray.transport"):
        transport.fall_back("the decode unit's Ray actor is started again")
        transport.fall_back("the prefill unit's Ray actor is started again")
    assert unit.detached == 1 and transport.sharing == []
    assert caplog.text.count("object store from now on: the decode unit's Ray actor is started again") == 1
    assert "prefill unit" not in caplog.text


def test_a_pool_address_opens_the_segment_itself_through_proc_and_nothing_else():
    spec = PoolSpec(KVLayout(2, 16, 2, 8), 3, torch.float32)
    segment = SharedPool.create(spec, "test")
    try:
        address = pool_address(segment, "node-a")
        mine, mapped = segment.tensor(), open_peer_pool(address)
        values = torch.randn(2, 2, 16, 2, 8)
        mapped[1] = values
        assert torch.equal(mine[1], values) and address.path == f"/proc/{os.getpid()}/fd/{segment.fd.fd}"
        with pytest.raises(ValueError, match="is not the segment the decode unit reported"):
            open_peer_pool(dataclasses.replace(address, identity=(0, 0)))
        with pytest.raises(OSError):
            open_peer_pool(dataclasses.replace(address, fd=segment.fd.fd + 1000))
    finally:
        segment.close()


def test_a_peer_goes_at_its_index_and_the_others_stay_unattached():
    assert with_peer((), 2, "decode2") == (None, None, "decode2")
    assert with_peer(("decode0", None, "decode2"), 1, "decode1") == ("decode0", "decode1", "decode2")


def test_an_abort_while_blocks_are_copied_frees_them_on_both_nodes(engine):
    long_prompt = prompts([1000], seed=5)[0]                     # 32 chunks of 32, each copied to the decode node

    async def scenario():
        await engine.start()
        try:
            stream = engine.submit(Request("cut", long_prompt, LONG))
            prefill = engine.coordinator.prefill[0]
            await until(lambda: "cut" in prefill.outgoing and prefill.outgoing["cut"].transfers, 60)
            assert not prefill.outgoing["cut"].seq.done               # mid-prefill: its copies are in flight
            assert engine.coordinator.decode[0].blocks.num_used > 0   # the decode node's reservation
            await stream.aclose()
            await until(lambda: all(a.blocks.num_used == 0 for a in engine.actors), 60)
            after, _ = await collect(engine.submit(Request("after", prompts([10], seed=2)[0], LONG)))
            assert len(after) == LONG.max_tokens
        finally:
            await engine.stop()

    asyncio.run(scenario())
    assert_pools_free(engine)


GATE = "pdserve-test-gate"


def gate_actor():
    """A Ray actor that holds every caller of `passed` while closed and counts those it holds (defined in a
    function, so Ray ships the class by value to the nodes, as `unit_actor_with_held_reads`)."""
    class Gate:
        def __init__(self) -> None:
            self.opened, self.held = asyncio.Event(), 0
            self.opened.set()

        async def close(self) -> None:
            self.opened.clear()

        async def open(self) -> None:
            self.opened.set()

        async def passed(self) -> None:
            self.held += 1
            await self.opened.wait()
            self.held -= 1

        async def holding(self) -> int:
            return self.held
    return ray.remote(num_cpus=0)(Gate).options(name=GATE).remote()


def unit_actor_with_held_reads() -> type:
    """`UnitActor` whose `read_blocks` (a hand-off's copy) waits at the gate first: a copy as slow as the
    test wants."""
    class HeldReads(ray_actor.UnitActor):
        @ray.method(num_returns=2)
        def read_blocks(self, blocks):
            ray.get(ray.get_actor(GATE).passed.remote())
            return super().read_blocks(blocks)
    return HeldReads


@pytest.fixture
def gate(cluster):
    handle = gate_actor()
    yield handle
    ray.kill(handle)


def test_decode_steps_go_on_while_a_hand_off_into_their_pool_is_held(gate, monkeypatch):
    monkeypatch.setattr(ray_actor, "UnitActor", unit_actor_with_held_reads())
    held = Engine(ENGINE_CONFIG)
    running_prompt, landing_prompt = prompts([6, 40], seed=1)      # 40 tokens: 2 chunks, each copied

    async def scenario():
        await held.start()
        try:
            reference, _ = await collect(held.submit(Request("reference", landing_prompt, LONG)))
            running = held.submit(Request("running", running_prompt, LONG))
            await asyncio.wait_for(running.__anext__(), 60)                 # decoding on the decode node
            await asyncio.wait_for(gate.close.remote(), 60)
            landing = asyncio.ensure_future(collect(held.submit(Request("landing", landing_prompt, LONG))))
            await until(lambda: ray.get(gate.holding.remote()) > 0, 60)     # its first copy is held
            for _ in range(5):                                              # the decode unit steps meanwhile
                event = await asyncio.wait_for(running.__anext__(), 60)
                assert event.finish_reason is None
            assert held.coordinator.decode[0].scheduler.find("landing") is None and not landing.done()
            await asyncio.wait_for(gate.open.remote(), 60)
            tokens, _ = await asyncio.wait_for(landing, 120)
            await running.aclose()
            return reference, tokens
        finally:
            await held.stop()

    try:
        reference, tokens = asyncio.run(scenario())
        assert tokens == reference and len(tokens) == LONG.max_tokens
        assert_pools_free(held)
    finally:
        held.close()


def test_a_killed_decode_actor_errors_its_streams_then_ray_starts_it_again(cluster, engine):
    _, decode_node = cluster
    victim = engine.units.decoding[0]
    first_pid = victim.where["pid"]
    reference = prompts([10], seed=2)[0]

    async def scenario():
        await engine.start()
        try:
            before, _ = await collect(engine.submit(Request("before", reference, LONG)))
            streams = [engine.submit(Request(f"doomed{i}", p, DOOMED)) for i, p in enumerate(prompts([6, 40], seed=1))]
            firsts = await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), 60)
            assert all(event.finish_reason is None for event in firsts)        # decoding on the decode node
            os.kill(first_pid, signal.SIGKILL)
            events = await asyncio.wait_for(asyncio.gather(*(collect_events(s) for s in streams)), 60)
            ends = [([t for e in evs for t in e.token_ids], evs[-1].finish_reason) for evs in events]
            await until(lambda: engine.healthy(), 120)
            after, reason = await asyncio.wait_for(collect(engine.submit(Request("after", reference, LONG))), 120)
            return ends, [evs[-1] for evs in events], before, after, reason
        finally:
            await engine.stop()

    ends, errors, before, after, reason = asyncio.run(scenario())
    assert [r for _, r in ends] == [FinishReason.ERROR] * 2
    assert all(e.error.startswith("the decode actor failed: UnitLost: the decode unit's Ray actor on node 127.0.0.1")
               for e in errors)
    assert all(len(tokens) < DOOMED.max_tokens for tokens, _ in ends)
    assert engine.units.decoding[0].lost is None                              # the fresh actor serves
    assert victim.where["pid"] != first_pid and victim.where["node_id"] == decode_node
    assert reason is FinishReason.LENGTH and after == before
    assert engine.supervisor.restarts == 1
    assert_pools_free(engine)


def test_an_idle_decode_actor_killed_fails_the_next_hand_off_with_its_name_and_node(engine):
    victim, prefill = engine.units.decoding[0], engine.units.prefills[0]
    prefill_pid = prefill.where["pid"]

    async def scenario():
        await engine.start()
        try:
            os.kill(victim.where["pid"], signal.SIGKILL)                  # no step of its own notices
            stream = engine.submit(Request("doomed", prompts([70], seed=4)[0], DOOMED))
            events = await asyncio.wait_for(collect_events(stream), 60)
            await until(lambda: engine.healthy(), 120)
            after, _ = await asyncio.wait_for(collect(engine.submit(Request("after", prompts([9])[0], LONG))), 120)
            return events[-1], after
        finally:
            await engine.stop()

    last, after = asyncio.run(scenario())
    assert last.finish_reason is FinishReason.ERROR
    assert last.error.startswith("the decode actor failed: UnitLost: the decode unit's Ray actor on node 127.0.0.1")
    assert "is lost" in last.error
    assert len(after) == LONG.max_tokens
    assert prefill.where["pid"] == prefill_pid and prefill.lost is None       # the sender was not restarted
    assert_pools_free(engine)


async def collect_events(stream) -> list:
    return [event async for event in stream]


def test_a_silent_decode_actor_loses_its_lease_and_is_started_again(cluster, monkeypatch):
    monkeypatch.setattr(ray_compute, "LEASE_S", 2.0)             # NOTE: 10 s in service
    silent = Engine(ENGINE_CONFIG)
    frozen = silent.units.decoding[0].where["pid"]

    async def scenario():
        await silent.start()
        try:
            streams = [silent.submit(Request(f"doomed{i}", p, DOOMED)) for i, p in enumerate(prompts([6, 40], seed=1))]
            await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), 60)
            os.kill(frozen, signal.SIGSTOP)                         # alive to Ray, answering nothing
            ends = await asyncio.wait_for(asyncio.gather(*(collect_events(s) for s in streams)), 60)
            await until(lambda: silent.healthy(), 120)
            after, _ = await asyncio.wait_for(collect(silent.submit(Request("after", prompts([9])[0], LONG))), 120)
            return [events[-1] for events in ends], after
        finally:
            await silent.stop()

    try:
        lasts, after = asyncio.run(scenario())
    finally:
        silent.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGKILL)
    assert [e.finish_reason for e in lasts] == [FinishReason.ERROR] * 2
    assert all("decode unit's Ray actor on node 127.0.0.1" in e.error and "within the 2 s lease" in e.error
               for e in lasts)
    assert len(after) == LONG.max_tokens and silent.units.decoding[0].where["pid"] != frozen


def test_a_lost_decode_node_errors_its_streams_and_ray_places_the_unit_on_a_new_one(cluster, engine):
    nodes, _ = cluster
    victim = engine.units.decoding[0]
    lost_node = next(n for n in nodes.worker_nodes if n.node_id == victim.where["node_id"])

    async def scenario():
        await engine.start()
        try:
            streams = [engine.submit(Request(f"doomed{i}", p, DOOMED)) for i, p in enumerate(prompts([6, 40], seed=1))]
            await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), 60)
            nodes.remove_node(lost_node, allow_graceful=False)             # its raylet and workers die
            ends = await asyncio.wait_for(asyncio.gather(*(collect_events(s) for s in streams)), 120)
            new_node = nodes.add_node(**NODE, resources={"pdserve_decode": 1})
            await until(lambda: engine.healthy(), 180)
            after, _ = await asyncio.wait_for(collect(engine.submit(Request("after", prompts([9])[0], LONG))), 120)
            return [events[-1] for events in ends], new_node.node_id, after
        finally:
            await engine.stop()

    lasts, new_node, after = asyncio.run(scenario())
    assert [e.finish_reason for e in lasts] == [FinishReason.ERROR] * 2
    assert all("decode unit's Ray actor on node 127.0.0.1" in e.error for e in lasts)
    assert victim.where["node_id"] == new_node and len(after) == LONG.max_tokens
    assert_pools_free(engine)


ONE_NODE = "pdserve_one_node"


@pytest.fixture
def one_node(cluster, monkeypatch):
    """A third node, which every unit asks for: prefill and decode on one node. Yields its node id."""
    nodes, _ = cluster
    node = nodes.add_node(**NODE, resources={ONE_NODE: 1})
    role_options = ray_units.actor_options

    def on_the_node(role: str, device_type: str, threads: int, resources: dict) -> dict:
        return role_options(role, device_type, threads, resources) | {"resources": {ONE_NODE: ray_units.ROLE_SHARE}}

    monkeypatch.setattr(ray_units, "actor_options", on_the_node)
    yield node.node_id
    nodes.remove_node(node)


@pytest.fixture
def object_store_copies(monkeypatch):
    """The number of blocks of each copy the transport chains (`read_blocks` then `write_blocks`)."""
    copied, send = [], ray_transport.KVTransport.send

    def counted(self, src_actor, dst_actor, src: list[int], dst: list[int]):
        copied.append(len(src))
        return send(self, src_actor, dst_actor, src, dst)

    monkeypatch.setattr(ray_transport.KVTransport, "send", counted)
    return copied


def test_prefill_and_decode_on_one_node_share_the_decode_pool_and_give_transformers_greedy_tokens(
        one_node, object_store_copies, caplog, transformers_model):  # noqa: F811
    with caplog.at_level(logging.INFO, logger="pdserve.engine.ray.units"):
        shared = Engine(ENGINE_CONFIG)
    batch = prompts([5, 90, 37, 140], seed=3)                    # up to 5 chunks of 32, each copied
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def scenario():
        await shared.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(
                collect(shared.submit(Request(f"s{i}", p, params))) for i, p in enumerate(batch))), 120)
        finally:
            await shared.stop()

    try:
        prefill, decode = shared.units.prefills[0], shared.units.decoding[0]
        assert prefill.where["node_id"] == decode.where["node_id"] == one_node
        assert f"KV prefill -> decode: shared memory on {prefill.node}" in caplog.text
        assert ray.get(prefill.actor.attached_peers.remote()) == [0]
        results = asyncio.run(scenario())
        for prompt, (tokens, _) in zip(batch, results):
            expected = transformers_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                                   min_new_tokens=8)[0, len(prompt):].tolist()
            assert tokens == expected
        assert object_store_copies == []                         # every block went straight into the decode pool
        assert_pools_free(shared)
    finally:
        shared.close()


def test_after_a_restart_on_one_node_every_copy_goes_through_the_object_store(one_node, object_store_copies):
    restarted = Engine(ENGINE_CONFIG)
    prefill, decode = restarted.units.prefills[0], restarted.units.decoding[0]
    pids = prefill.where["pid"], decode.where["pid"]
    reference = prompts([70], seed=2)[0]                         # 3 chunks, each copied

    async def scenario():
        await restarted.start()
        try:
            before, _ = await collect(restarted.submit(Request("before", reference, LONG)))
            assert object_store_copies == [] and prefill.shared_peers == {0}
            streams = [restarted.submit(Request(f"doomed{i}", p, DOOMED))
                       for i, p in enumerate(prompts([6, 40], seed=1))]
            await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), 60)
            os.kill(pids[1], signal.SIGKILL)                      # the decode actor, mid-stream
            ends = await asyncio.wait_for(asyncio.gather(*(collect_events(s) for s in streams)), 60)
            await until(lambda: restarted.healthy(), 120)
            after_decode, _ = await asyncio.wait_for(collect(restarted.submit(Request("a", reference, LONG))), 120)
            os.kill(pids[0], signal.SIGKILL)                      # then the prefill actor, idle
            doomed = await asyncio.wait_for(collect_events(restarted.submit(Request("d", reference, LONG))), 60)
            await until(lambda: restarted.healthy(), 120)
            after_prefill, _ = await asyncio.wait_for(collect(restarted.submit(Request("b", reference, LONG))), 120)
            return [events[-1] for events in ends] + [doomed[-1]], before, after_decode, after_prefill
        finally:
            await restarted.stop()

    try:
        lasts, before, after_decode, after_prefill = asyncio.run(scenario())
        assert [e.finish_reason for e in lasts] == [FinishReason.ERROR] * 3
        assert prefill.where["pid"] != pids[0] and decode.where["pid"] != pids[1]     # both actors are fresh
        assert after_decode == before == after_prefill and len(before) == LONG.max_tokens
        assert object_store_copies                                # the pair fell back to the object store
        assert prefill.shared_peers == frozenset() and ray.get(prefill.actor.attached_peers.remote()) == []
        assert prefill.transport.sharing == [] and restarted.supervisor.restarts == 2
        assert_pools_free(restarted)
    finally:
        restarted.close()


def test_the_systemd_unit_joins_the_local_ray_node():
    unit = render_unit(["--distributed-executor-backend", "ray"], user="ray", ray=True).splitlines()
    for line in ("After=ray.service", "Wants=ray.service", "PrivateTmp=no", "ReadWritePaths=/tmp/ray",
                 "Environment=RAY_AUTH_MODE=token", "User=ray"):
        assert line in unit, line
    assert "PrivateTmp=yes" in render_unit(["--model", "demo:tiny"]).splitlines()
