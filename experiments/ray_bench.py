"""`--distributed-executor-backend ray` against `--workers process`: step round trip, KV bytes/s between
two nodes, and one serving run of each with the same units.

    python experiments/ray_bench.py [--model demo:tiny] [--ray-address HOST:PORT] [--threads 1]
                                      [--requests 16] [--prompt-tokens 256] [--max-tokens 64] [--out DIR]
                                      [--kv-transport object-store|gloo] [--compiled-graph] [--one-node]

Without --ray-address it starts a two-node Ray cluster on this machine, every address 127.0.0.1 (the
head advertises `pdserve_prefill`, the other node `pdserve_decode`); with it, it joins that cluster as
the driver (its nodes must advertise the two resources). With --one-node the cluster has one node that
advertises both, so the Ray units share the decode pool as worker processes do (`pdserve.engine.ray.shared`)
and the comparison is of the boundary alone. For each backend, the same 1P1D disaggregated
engine (--threads threads per unit) serves --requests seeded random prompts at once; every step's round
trip is timed at the unit (submit to outcome) minus the compute the worker measured, so the overhead of
the boundary is what is left (a Ray prefill step's includes its KV copies to the other node, which a
worker process makes inside its step; the decode column is the bare round trip in both). Then the prefill
actor's pool blocks are sent to the decode actor (the path a hand-off takes, through --kv-transport) in
runs of 16 blocks, and bytes/s reported. --compiled-graph first times a bare frame's round trip to an
actor on each node, as an actor call and through a Ray Compiled Graph. Writes DIR/ray_bench.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # NOTE: before ray is imported: loopback nodes
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")                # --kv-transport gloo between loopback nodes

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import orjson  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from pdserve.bench.documents import machine_description  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.core.messages import Request  # noqa: E402
from pdserve.engine.core.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.ray import transport as ray_transport  # noqa: E402

NODE = dict(num_cpus=4, object_store_memory=200 * 2**20)
RUN_BLOCKS = 16


def start_cluster(threads: int, one_node: bool):
    from ray.cluster_utils import Cluster

    node = NODE | dict(num_cpus=max(NODE["num_cpus"], 2 * threads + 1))
    head = {"pdserve_prefill": 1} | ({"pdserve_decode": 1} if one_node else {})
    cluster = Cluster(initialize_head=True, head_node_args=node | dict(include_dashboard=False, resources=head))
    if not one_node:
        cluster.add_node(**node, resources={"pdserve_decode": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def engine_config(args, backend: str) -> EngineConfig:
    ray_backend = backend == "ray"
    return EngineConfig(model=args.model, dtype=args.dtype, mode="disaggregated",
                        prefill_threads=args.threads, decode_threads=args.threads,
                        workers="thread" if ray_backend else "process",
                        distributed_executor_backend="ray" if ray_backend else None,
                        ray_kv_transport=args.kv_transport,
                        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
                        scheduler=SchedulerConfig(max_model_len=args.prompt_tokens + args.max_tokens + 16,
                                                  max_num_seqs=max(args.requests, 1)))


def time_steps(engine: Engine) -> dict[str, list[float]]:
    """Each unit's per-step overhead in seconds (submit to outcome, less the worker's own compute)."""
    overheads: dict[str, list[float]] = {"prefill": [], "decode": []}
    for role, unit in (("prefill", engine.units.prefills[0]), ("decode", engine.units.decoding[0])):
        submit = unit.submit

        def timed(work, submit=submit, out=overheads[role]):
            started = time.perf_counter()
            future = submit(work)
            future.add_done_callback(lambda f: f.cancelled() or f.exception() or
                                     out.append(time.perf_counter() - started - f.result().seconds))
            return future

        unit.submit = timed
    return overheads


async def serve(engine: Engine, args) -> dict:
    generator = torch.Generator().manual_seed(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    await engine.start()
    try:
        async def one(i: int) -> tuple[float, list[float]]:
            prompt = tuple(torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist())
            started, stamps = time.perf_counter(), []
            async for event in engine.submit(Request(f"b{i}", prompt, params)):
                stamps.extend([time.perf_counter()] * len(event.token_ids))
            return stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:])]

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - started
    finally:
        await engine.stop()
    ttfts, itls = [r[0] for r in results], [x for r in results for x in r[1]]
    return {"wall_s": wall, "output_tok_s": args.requests * args.max_tokens / wall,
            "ttft_ms_median": 1e3 * statistics.median(ttfts), "itl_ms_median": 1e3 * statistics.median(itls),
            "itl_ms_p99": 1e3 * quantile(itls, 0.99)}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def kv_bytes_per_second(engine: Engine, iters: int) -> dict:
    """Runs of RUN_BLOCKS blocks from the prefill actor's pool into the decode actor's, as a hand-off goes."""
    prefill, decode = engine.units.prefills[0], engine.units.decoding[0]
    n = min(prefill.num_blocks, decode.num_blocks, RUN_BLOCKS)
    src, dst = list(range(n)), list(range(n))
    transport = prefill.transport

    def copy() -> int:
        sending = transport.send(prefill.actor, decode.actor, src, dst)
        ray.get(sending.read)
        return ray.get(sending.write())

    copy()      # warm
    seconds, nbytes = [], 0
    for _ in range(iters):
        started = time.perf_counter()
        nbytes = copy()
        seconds.append(time.perf_counter() - started)
    same_node = prefill.where["node_id"] == decode.where["node_id"]
    return {"transport": transport.name, "blocks_per_run": n, "bytes_per_run": nbytes,
            "run_ms_median": 1e3 * statistics.median(seconds),
            "bytes_per_s": nbytes / statistics.median(seconds), "same_node": same_node}


class Echo:
    """The bare boundary: a frame in, the same frame out (a step message's round trip without the step)."""

    def echo(self, frame: bytes) -> bytes:
        return frame


def echo_round_trips(frame_bytes: int, iters: int, role: str) -> dict:
    """Driver to an actor on `role`'s node and back, with a frame of `frame_bytes`: as a Ray actor call
    (what the units use) and through a Ray Compiled Graph (a channel the actor reads in a loop)."""
    from ray.dag import InputNode

    actor = ray.remote(num_cpus=0, resources={f"pdserve_{role}": 0.001})(Echo).remote()
    frame = bytes(frame_bytes)
    ray.get(actor.echo.remote(frame))
    calls = timed(lambda: ray.get(actor.echo.remote(frame)), iters)
    try:
        with InputNode() as step:
            graph = actor.echo.bind(step)
        compiled = graph.experimental_compile()
    except Exception as e:                          # NOTE: reported, not fatal: the rest still measures
        ray.kill(actor)
        return {"frame_bytes": frame_bytes, "actor_call_us_median": calls, "compiled_graph": f"{type(e).__name__}: {e}"}
    try:
        ray.get(compiled.execute(frame))
        graphs = timed(lambda: ray.get(compiled.execute(frame)), iters)
    finally:
        compiled.teardown()
        ray.kill(actor)
    return {"frame_bytes": frame_bytes, "actor_call_us_median": calls, "compiled_graph_us_median": graphs}


def timed(call, iters: int) -> float:
    seconds = []
    for _ in range(iters):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return 1e6 * statistics.median(seconds)


def summary(overheads: dict[str, list[float]]) -> dict:
    return {role: {"steps": len(v), "overhead_us_median": 1e6 * statistics.median(v) if v else None,
                   "overhead_us_p90": 1e6 * quantile(v, 0.9) if v else None} for role, v in overheads.items()}


def run(args) -> dict:
    cluster = None if args.ray_address else start_cluster(args.threads, args.one_node)
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    try:
        results = {}
        if args.compiled_graph:
            results["echo"] = {role: echo_round_trips(args.frame_bytes, args.kv_iters, role)
                               for role in ("decode", "prefill")}
        for backend in ("process", "ray"):
            engine = Engine(engine_config(args, backend))
            overheads = time_steps(engine)
            results[backend] = {"serving": asyncio.run(serve(engine, args)), "step_round_trip": summary(overheads)}
            if backend == "ray":
                results["ray"]["kv"] = kv_bytes_per_second(engine, args.kv_iters)
                results["ray"]["shared_pool"] = bool(engine.units.prefills[0].shared_peers)
            engine.close()
        return results
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo:tiny")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--ray-address", default=None, help="join this cluster instead of starting one on 127.0.0.1")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each unit")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--kv-iters", type=int, default=50)
    parser.add_argument("--kv-transport", choices=ray_transport.NAMES, default=ray_transport.OBJECT_STORE,
                        help="how the Ray units move KV blocks (--ray-kv-transport)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled-graph", action="store_true",
                        help="also time a bare frame's round trip to each node: actor call vs Compiled Graph")
    parser.add_argument("--frame-bytes", type=int, default=2048, help="the frame --compiled-graph sends")
    parser.add_argument("--one-node", action="store_true",
                        help="one Ray node for both units (they share the decode pool), not two")
    parser.add_argument("--out", type=Path, default=Path("experiments/out"))
    args = parser.parse_args()
    results = run(args)
    process, ray_ = results["process"], results["ray"]
    print(machine_description())
    print("| backend | output tok/s | TTFT ms (median) | ITL ms (median / p99) | prefill step overhead us "
          "(ray: with its KV copies) | decode step overhead us |")
    print("|---|---:|---:|---:|---:|---:|")
    where = "one node, " + ("shared pool" if ray_["shared_pool"] else "object store") if args.one_node else "two nodes"
    for name, r in (("process (one node)", process), (f"ray ({where})", ray_)):
        s, t = r["serving"], r["step_round_trip"]
        print(f"| {name} | {s['output_tok_s']:.1f} | {s['ttft_ms_median']:.1f} | {s['itl_ms_median']:.2f} / "
              f"{s['itl_ms_p99']:.2f} | {t['prefill']['overhead_us_median']:.0f} | "
              f"{t['decode']['overhead_us_median']:.0f} |")
    kv = ray_["kv"]
    print(f"KV between the actors through the transport ({kv['transport']}): {kv['bytes_per_s'] / 1e6:.1f} MB/s "
          f"({kv['blocks_per_run']} blocks, "
          f"{kv['bytes_per_run']} bytes per run, {kv['run_ms_median']:.2f} ms; same node: {kv['same_node']})")
    for role, echo in results.get("echo", {}).items():
        graph = echo.get("compiled_graph_us_median")
        where = "the other node" if role == "decode" else "the driver's node"
        print(f"bare round trip to {where} ({role}), {echo['frame_bytes']} B frame: actor call "
              f"{echo['actor_call_us_median']:.0f} us, compiled graph "
              + (f"{graph:.0f} us" if graph is not None else f"failed: {echo['compiled_graph']}"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_bench.json").write_bytes(orjson.dumps({"machine": machine_description(), "args": {
        k: str(v) for k, v in vars(args).items()}, "results": results}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
