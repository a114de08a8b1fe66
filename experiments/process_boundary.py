"""What the process boundary of `--workers process` costs per step: encode + send + receive + decode.

    python experiments/process_boundary.py --num-seqs 1,32,128

For N decode rows (and, separately, N new rows of a 64-token prompt each, the heaviest message), a
step message goes to an echo worker process over the same pipe and wire format the engine uses,
which decodes it, builds an outcome of N tokens, and sends it back. Reported per step in
microseconds: the encode/decode work alone, the full round trip through the pipe, and a thread
round trip (`run_in_executor` on the event loop: what `--workers thread` pays) as the baseline,
all in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import orjson

from pdserve.bench.documents import machine_description
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import new_event_loop
from pdserve.engine.worker.processes import wire
from pdserve.engine.worker.step import NewRow, StepInput, StepResult, StepWork
from pdserve.engine.worker.step_runner import StepOutcome


def decode_work(n: int) -> StepWork:
    return StepWork(StepInput(decode_rows=tuple(range(n)), decode_positions=tuple(range(100, 100 + n))))


def prefill_work(n: int) -> StepWork:
    rows = tuple(NewRow(i, tuple(range(64)), 64, tuple(range(i * 4, i * 4 + 4)), SamplingParams()) for i in range(n))
    return StepWork(StepInput(new_rows=rows))


def outcome_for(work: StepWork) -> StepOutcome:
    n = len(work.step.decode_rows) + len(work.step.new_rows)
    return StepOutcome(StepResult(tuple(range(n))), (), 0.0, 1)


def echo(conn) -> None:
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        conn.send_bytes(wire.encode_outcome(outcome_for(wire.decode_work(data))))


def codec_us(work: StepWork, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        wire.decode_work(wire.encode_work(work))
        wire.decode_outcome(wire.encode_outcome(outcome_for(work)))
    return (time.perf_counter() - started) / repeats * 1e6


async def pipe_us(conn, work: StepWork, repeats: int) -> float:
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: replies.put_nowait(wire.decode_outcome(conn.recv_bytes())))
    try:
        started = time.perf_counter()
        for _ in range(repeats):
            conn.send_bytes(wire.encode_work(work))
            await replies.get()
        return (time.perf_counter() - started) / repeats * 1e6
    finally:
        loop.remove_reader(conn.fileno())


async def thread_us(work: StepWork, repeats: int) -> float:
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    for _ in range(repeats):
        await loop.run_in_executor(None, outcome_for, work)
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", default="1,32,128")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=True)
    worker = context.Process(target=echo, args=(child,), daemon=True)
    worker.start()
    loop = new_event_loop()
    rows = []
    try:
        for n in (int(x) for x in args.num_seqs.split(",")):
            for kind, work in (("decode rows", decode_work(n)), ("new 64-token rows", prefill_work(n))):
                repeats = max(args.repeats // (8 if kind != "decode rows" else 1), 50)
                loop.run_until_complete(pipe_us(parent, work, 50))                 # warm both sides
                rows.append({"num_seqs": n, "kind": kind, "bytes": len(wire.encode_work(work)),
                             "codec_us": codec_us(work, repeats),
                             "pipe_round_trip_us": loop.run_until_complete(pipe_us(parent, work, repeats)),
                             "thread_round_trip_us": loop.run_until_complete(thread_us(work, repeats))})
    finally:
        parent.send_bytes(b"")
        worker.join(5)
        loop.close()
    print(machine_description())
    print("| rows | message | bytes | encode+decode (both ways) us | pipe round trip us | thread round trip us |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['num_seqs']} | {r['kind']} | {r['bytes']} | {r['codec_us']:.1f} | {r['pipe_round_trip_us']:.1f} "
              f"| {r['thread_round_trip_us']:.1f} |")
    if args.result_json:
        with open(args.result_json, "wb") as f:
            f.write(orjson.dumps({"machine": machine_description(), "rows": rows}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
