"""Everything an actor does on CUDA happens on the actor's own device, whichever thread builds it.

Actors are built on a loader thread whose current CUDA device is cuda:0. On CPU, `tests.fake_cuda`
stands in for two GPUs: these tests build runners, capture decode graphs, warm up, profile memory and
serve requests for cuda:1 (and cuda:0) there, and check every Triton launch (Triton launches on the
current device's current stream), every capture, stream and event against the device of the tensors.
"""
from __future__ import annotations

import threading

import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.worker import cuda_graph
from pdserve.engine.worker.cuda_graph import DecodeGraphs, batch_buckets
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.startup.warmup import warm_up, warmup_shapes
from tests.fake_cuda import fake_cuda
from tests.models import demo_checkpoint, engine_config

CUDA1 = torch.device("cuda:1")


def misplaced(launches, device: torch.device) -> list:
    """Launches not made with `device` current, on a stream of `device`, over tensors of `device` only."""
    return [launch for launch in launches
            if launch.current_device != device.index or launch.stream.device != device
            or launch.tensor_devices != {str(device)}]


def runner_on(device: torch.device, graph_max_batch: int = 0) -> ModelRunner:
    config = ModelConfig.from_dir(demo_checkpoint())
    model = load_model(config, torch.float32, device, 256)
    return ModelRunner(model, 64, 16, frozenset(), graph_max_batch, max_blocks_per_seq=16)


def test_decode_graphs_for_cuda1_are_captured_on_cuda1_from_a_cuda0_thread(monkeypatch):
    with fake_cuda(monkeypatch) as cuda:
        assert torch.cuda.current_device() == 0
        runner_on(CUDA1, graph_max_batch=6)
        assert torch.cuda.current_device() == 0, "building a runner must not change the current device"
        assert len(cuda.graphs) == len(batch_buckets(6))
        for graph in cuda.graphs:
            assert graph.capture_device == 1 and graph.capture_stream.device == CUDA1
            assert not graph.capture_stream.default
        captured = [launch for launch in cuda.launches if launch.capturing]
        assert captured and not misplaced(cuda.launches, CUDA1)
        assert {launch.kernel for launch in captured} >= {"_decode_split_kernel", "_store_kv_kernel"}


def test_the_check_catches_a_capture_without_its_own_stream(monkeypatch):
    """The check has teeth: the capture before this fix (no stream, no device) is caught."""
    def capture_on_the_default_capture_stream(self, bucket):
        batch = self.buffers.forward_batch(bucket, bucket, bucket, self.width, is_decode=True)
        side = torch.cuda.Stream(self.kv_pool.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.compute_logits(self.model(batch, self.kv_pool))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = self.model.compute_logits(self.model(batch, self.kv_pool))
        return graph, logits

    with fake_cuda(monkeypatch) as cuda:
        monkeypatch.setattr(DecodeGraphs, "_capture", capture_on_the_default_capture_stream)
        monkeypatch.setattr(cuda_graph, "on_device", lambda device: torch.cuda.device(0))
        runner_on(CUDA1, graph_max_batch=2)
        assert all(graph.capture_device == 0 for graph in cuda.graphs)
        assert misplaced([launch for launch in cuda.launches if launch.capturing], CUDA1)


def test_a_runner_steps_on_its_device_on_the_actor_thread_and_replays_there(monkeypatch):
    from pdserve.engine.worker.compute import ThreadCompute
    from tests.test_cuda_graph import decode_step

    with fake_cuda(monkeypatch) as cuda:
        runner = runner_on(CUDA1, graph_max_batch=4)
        cuda.launches.clear()
        actor = type("Probe", (), {"device": CUDA1, "cpu_cores": ()})()
        result = []

        def actor_thread():
            ThreadCompute._init_thread(actor)
            result.append(runner.execute(decode_step(runner, [5, 40, 3])))
            result.append(runner.execute(decode_step(runner, list(range(1, 30, 3)))))   # eager: > 4 sequences

        thread = threading.Thread(target=actor_thread)
        thread.start()
        thread.join()
        assert len(result) == 2 and len(result[0].token_ids) == 3
        replays = [r for graph in cuda.graphs for r in graph.replays]
        assert replays == [(1, replays[0][1])] and replays[0][1].device == CUDA1 and not replays[0][1].default
        assert cuda.launches and not misplaced(cuda.launches, CUDA1)
        assert all(event.device == CUDA1 for event in cuda.events if event.device is not None)


def test_warm_up_from_the_loader_thread_runs_on_the_runner_device(monkeypatch):
    with fake_cuda(monkeypatch) as cuda:
        runner = runner_on(CUDA1, graph_max_batch=4)
        cuda.launches.clear()
        steps = warm_up(runner, warmup_shapes("colocated", 4, 48, 256))
        assert steps == len(warmup_shapes("colocated", 4, 48, 256))
        kernels = {launch.kernel for launch in cuda.launches}
        assert {"_prefill_kernel", "_store_kv_kernel", "_rms_norm_kernel"} <= kernels
        assert not misplaced(cuda.launches, CUDA1) and torch.cuda.current_device() == 0


@pytest.mark.parametrize("mode, devices", [("disaggregated", ("cuda:0", "cuda:1")),
                                           ("disaggregated", ("cuda:1", "cuda:1")),
                                           ("colocated", ("cuda:1", "cuda:1"))])
def test_an_engine_on_fake_gpus_keeps_every_launch_on_its_actor_device(monkeypatch, mode, devices):
    with fake_cuda(monkeypatch) as cuda:
        llm = LLM(config=engine_config(demo_checkpoint(), mode=mode, prefill_device=devices[0],
                                       decode_device=devices[1], max_num_seqs=4, max_prefill_tokens=32))
        warmed = {(launch.kernel, launch.current_device) for launch in cuda.launches}
        assert {("_prefill_kernel", torch.device(devices[0]).index),            # before any request
                ("_decode_split_kernel", torch.device(devices[1]).index)} <= warmed
        try:
            outputs = llm.generate([[5, 6, 7], list(range(3, 60))],
                                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        finally:
            llm.close()
        assert [len(o.token_ids) for o in outputs] == [4, 4]
        by_device = {}
        for launch in cuda.launches:
            by_device.setdefault(launch.current_device, []).append(launch)
        assert set(by_device) == {torch.device(d).index for d in devices}
        for index, launches in by_device.items():
            assert not misplaced(launches, torch.device("cuda", index))
        assert all(g.capture_stream.device == torch.device(devices[1]) for g in cuda.graphs)
        assert all(s.device.type == "cuda" for s in cuda.streams)
