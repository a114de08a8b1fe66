"""Does Ray Direct Transport over gloo move KV blocks between two actors on two Ray nodes of this machine?

    python experiments/ray_transport_probe.py [--case NAME ...] [--blocks 16] [--timeout 30]

Starts a two-node Ray cluster on 127.0.0.1 (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, `GLOO_SOCKET_IFNAME=lo`),
one actor on each node joined in a `torch_gloo` collective group, and runs each case: a producer method
`@ray.method(tensor_transport="gloo")` returns a tensor and the consumer actor takes its reference as an
argument. The cases go from the toy of Ray's documentation to the pattern of a prefill to decode hand-off
(blocks indexed out of a pool, stored into the other actor's pool, the actors built as pdserve's with
concurrency groups). A case that does not answer within --timeout has both actors' Python stacks dumped
(faulthandler, SIGUSR1) to stdout, the Ray version with them, and the next case gets fresh actors.
No pdserve import: the file can be sent upstream as it is.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # NOTE: before ray is imported: loopback nodes
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

POOL = (64, 4, 2, 16, 2, 64)         # [blocks, layers, 2, block_size, kv_heads, head_dim]: a small KV pool


class Pool:
    """One side of a hand-off: a KV pool, a producer of blocks and a consumer that stores them."""

    def __init__(self, dtype: str, stacks: str) -> None:
        self.pool = torch.zeros(POOL, dtype=getattr(torch, dtype))
        self.stacks = open(stacks, "w")
        faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True)

    def where(self) -> dict:
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def fill(self, value: float) -> None:
        self.pool.fill_(value)

    @ray.method(tensor_transport="gloo")
    def toy(self) -> torch.Tensor:
        return torch.ones(4, 4)

    @ray.method(tensor_transport="gloo")
    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        return self.pool[blocks]

    @ray.method(tensor_transport="gloo")
    def read_blocks_contiguous(self, blocks: list[int]) -> torch.Tensor:
        return self.pool[blocks].contiguous().clone()

    @ray.method(tensor_transport="gloo")
    def read_blocks_bytes(self, blocks: list[int]) -> torch.Tensor:
        return self.pool[blocks].view(torch.uint8).clone()

    def step(self, seconds: float) -> int:
        """A model step's stand-in: compute on this actor's default thread for `seconds`."""
        a, n, deadline = torch.randn(256, 256), 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            a = torch.tanh(a @ a)
            n += 1
        return n

    def fence(self) -> None:
        """Answers once the calls sent before it (this group runs one at a time, in order) have run."""

    def total(self, tensor: torch.Tensor) -> float:
        return float(tensor.double().sum())

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> int:
        self.pool[blocks] = data.view(self.pool.dtype).reshape((len(blocks),) + POOL[1:])
        return data.numel() * data.element_size()

    def checksum(self, blocks: list[int]) -> float:
        return float(self.pool[blocks].double().sum())


def case_toy(src, dst, blocks: list[int]) -> object:
    return dst.total.remote(src.toy.remote())


def case_blocks(src, dst, blocks: list[int]) -> object:
    return dst.write_blocks.remote(blocks, src.read_blocks.remote(blocks))


def case_blocks_contiguous(src, dst, blocks: list[int]) -> object:
    return dst.write_blocks.remote(blocks, src.read_blocks_contiguous.remote(blocks))


def case_blocks_bytes(src, dst, blocks: list[int]) -> object:
    return dst.write_blocks.remote(blocks, src.read_blocks_bytes.remote(blocks))


def case_kv_group(src, dst, blocks: list[int]) -> object:
    """As pdserve calls it: the consumer in its own concurrency group."""
    return dst.write_blocks.options(concurrency_group="kv").remote(blocks, src.read_blocks.remote(blocks))


def case_repeated(src, dst, blocks: list[int]) -> object:
    """Several hand-offs in a row, each waited for: the steady state of a serving engine."""
    for i in range(5):
        ray.get(dst.write_blocks.remote(blocks, src.read_blocks.remote(blocks)), timeout=ARGS.timeout)
    return dst.write_blocks.remote(blocks, src.read_blocks.remote(blocks))


def case_chained_while_stepping(src, dst, blocks: list[int]) -> object:
    """pdserve's hand-off as first written: the producer steps, its read follows; the consumer's write takes
    the read's reference at once (its metadata not known yet) while the consumer steps before and after."""
    src.step.remote(0.5)
    read = src.read_blocks.remote(blocks)
    steps = [dst.step.remote(0.2) for _ in range(2)]
    written = dst.write_blocks.options(concurrency_group="kv").remote(blocks, read)
    steps += [dst.step.remote(0.2) for _ in range(3)]
    return written


def case_after_read_while_stepping(src, dst, blocks: list[int]) -> object:
    """As pdserve does it now: the write is submitted only once the read has answered (a fence behind it)."""
    src.step.remote(0.5)
    read = src.read_blocks.remote(blocks)
    steps = [dst.step.remote(0.2) for _ in range(2)]
    ray.get(src.fence.remote(), timeout=ARGS.timeout)
    written = dst.write_blocks.options(concurrency_group="kv").remote(blocks, read)
    steps += [dst.step.remote(0.2) for _ in range(3)]
    return written


def case_chained_busy_producer(src, dst, blocks: list[int]) -> object:
    """The consumer idle; only the producer busy when the write is submitted."""
    src.step.remote(0.5)
    return dst.write_blocks.remote(blocks, src.read_blocks.remote(blocks))


def case_chained_busy_consumer(src, dst, blocks: list[int]) -> object:
    """The producer idle; the consumer steps in its default group when the write (same group) is submitted."""
    read = src.read_blocks.remote(blocks)
    dst.step.remote(0.5)
    return dst.write_blocks.remote(blocks, read)


CASES = {"chained_while_stepping": case_chained_while_stepping,
         "after_read_while_stepping": case_after_read_while_stepping,
         "chained_busy_producer": case_chained_busy_producer, "chained_busy_consumer": case_chained_busy_consumer,
         "toy": case_toy, "blocks": case_blocks, "blocks_contiguous": case_blocks_contiguous,
         "blocks_bytes": case_blocks_bytes, "kv_group": case_kv_group, "repeated": case_repeated}
NEEDS_GROUPS = {"kv_group", "chained_while_stepping", "after_read_while_stepping"}   # the consumer's "kv" group
ARGS = argparse.Namespace(timeout=30.0)


def actors(dtype: str, groups: bool, stacks: Path) -> tuple:
    """A producer on the head (pdserve_prefill) and a consumer on the other node (pdserve_decode), joined in a
    gloo collective group."""
    from ray.experimental.collective import create_collective_group

    options = dict(num_cpus=1, max_restarts=0)
    if groups:
        options["concurrency_groups"] = {"kv": 4, "lease": 1}
    cls = ray.remote(**options)(Pool)
    src = cls.options(resources={"pdserve_prefill": 0.001}).remote(dtype, str(stacks / "src.txt"))
    dst = cls.options(resources={"pdserve_decode": 0.001}).remote(dtype, str(stacks / "dst.txt"))
    where = ray.get([src.where.remote(), dst.where.remote()], timeout=120)
    group = create_collective_group([src, dst], backend="torch_gloo")
    return src, dst, where, group


def run_case(name: str, dtype: str, groups: bool, blocks: list[int], stacks: Path) -> dict:
    src, dst, where, group = actors(dtype, groups, stacks)
    try:
        ray.get([src.fill.remote(1.0), dst.fill.remote(0.0)])
        started = time.perf_counter()
        ref = CASES[name](src, dst, blocks)
        try:
            answer = ray.get(ref, timeout=ARGS.timeout)
        except ray.exceptions.GetTimeoutError:
            return {"case": name, "dtype": dtype, "groups": groups, "result": "hung", "where": where,
                    "stacks": dump_stacks(where, stacks)}
        except ray.exceptions.RayError as e:
            return {"case": name, "dtype": dtype, "groups": groups, "result": f"error: {type(e).__name__}: "
                    f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}", "where": where}
        seconds = time.perf_counter() - started
        landed = ray.get(dst.checksum.remote(blocks)) if name != "toy" else answer
        expected = 16.0 if name == "toy" else float(len(blocks) * torch.Size(POOL[1:]).numel())
        return {"case": name, "dtype": dtype, "groups": groups, "where": where, "seconds": seconds,
                "result": "ok" if landed == expected else f"wrong data: {landed} != {expected}"}
    finally:
        for actor in (src, dst):
            ray.kill(actor, no_restart=True)
        del group


def dump_stacks(where: list[dict], stacks: Path) -> dict:
    for w in where:
        os.kill(w["pid"], signal.SIGUSR1)         # NOTE: both actors' processes are on this machine
    time.sleep(1.0)
    return {side: (stacks / f"{side}.txt").read_text() for side in ("src", "dst")}


def start_cluster():
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=4, object_store_memory=200 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=node | dict(include_dashboard=False,
                                                                       resources={"pdserve_prefill": 1}))
    cluster.add_node(**node, resources={"pdserve_decode": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}, "a node is not on loopback"
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    parser.add_argument("--dtype", action="append", help="pool dtypes (default: float32, bfloat16)")
    parser.add_argument("--no-groups", action="store_true", help="only actors without concurrency groups")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    ARGS.timeout = args.timeout
    print(f"ray {ray.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}, "
          f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
    cluster = start_cluster()
    blocks = list(range(1, 2 * args.blocks, 2))[:args.blocks]       # scattered, as a sequence's blocks are
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.case or list(CASES):
                for dtype in args.dtype or ["float32", "bfloat16"]:
                    for groups in ([False] if args.no_groups else [False, True]):
                        if name in NEEDS_GROUPS and not groups:
                            continue
                        report(run_case(name, dtype, groups, blocks, Path(tmp)))
    finally:
        ray.shutdown()
        cluster.shutdown()


def report(r: dict) -> None:
    print(f"{r['case']:18} {r['dtype']:9} concurrency groups: {str(r['groups']):5} -> {r['result']}"
          + (f" ({1e3 * r['seconds']:.1f} ms)" if "seconds" in r else ""), flush=True)
    for side, text in r.get("stacks", {}).items():
        print(f"--- {side} actor (pid {r['where'][0 if side == 'src' else 1]['pid']}) stacks ---\n{text}")


if __name__ == "__main__":
    main()
