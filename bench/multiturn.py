"""The multi-turn chat workload: seeded conversations that share one system prompt, each turn
sending the whole history with the previous turns' real answers, conversations arriving under
Poisson (gamma) arrivals and interleaving on the server.

A turn is sent only once the previous turn's stream has ended (its answer is part of the next
request), so a conversation has at most one request in flight; `--max-concurrency` caps the
conversations in flight. A failed turn ends its conversation: the turns it never sent are
recorded as failures that say why.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from pdserve.bench.metrics import BenchResult, RequestRecord
from pdserve.bench.server_metrics import prefix_cache_delta, scrape_prefix_cache, spec_decode_delta
from pdserve.bench.sse_client import EndpointConfig, send_request_with_text
from pdserve.bench.workloads import (
    SampleRequest,
    TrafficSpec,
    WorkloadSpec,
    arrival_offsets,
    warmup_spec,
    word_prompt,
)

MULTITURN = "multiturn"


@dataclass(frozen=True, slots=True)
class Conversation:
    """One seeded conversation: the shared system prompt and a user message per turn."""

    index: int
    system_prompt: str
    user_messages: tuple[str, ...]

    def messages(self, answers: Sequence[str]) -> tuple[dict[str, str], ...]:
        """The history sent for turn len(answers) + 1: system, each earlier (user, assistant) pair, the new user."""
        history = [{"role": "system", "content": self.system_prompt}]
        for user, answer in zip(self.user_messages, answers):
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return (*history, {"role": "user", "content": self.user_messages[len(answers)]})


def build_conversations(spec: WorkloadSpec) -> list[Conversation]:
    """`spec.num_conversations` conversations of `spec.num_turns` turns; the same seed gives the same ones.

    Raises ValueError on non-positive counts or lengths.
    """
    if min(spec.num_conversations, spec.num_turns, spec.system_prompt_len, spec.user_message_len,
           spec.output_len) < 1:
        raise ValueError("multiturn: conversations, turns, system prompt, user message and output lengths "
                         "must be at least 1")
    if spec.think_time < 0 or spec.document_len < 0:
        raise ValueError("multiturn: think_time and document_len must be non-negative")
    rng = random.Random(spec.seed)
    system = word_prompt(rng, spec.system_prompt_len, spec.tokens_per_word)
    return [Conversation(index, system, _messages(spec, rng)) for index in range(spec.num_conversations)]


def _messages(spec: WorkloadSpec, rng: random.Random) -> tuple[str, ...]:
    """One conversation's user messages; the first pastes its document, if the workload has one."""
    messages = [word_prompt(rng, spec.user_message_len, spec.tokens_per_word) for _ in range(spec.num_turns)]
    if spec.document_len:
        messages[0] = word_prompt(rng, spec.document_len, spec.tokens_per_word) + "\n\n" + messages[0]
    return tuple(messages)


def turn_request(spec: WorkloadSpec, conversation: Conversation, answers: Sequence[str]) -> SampleRequest:
    """The request of turn len(answers) + 1, with the whole history."""
    turn = len(answers) + 1
    return SampleRequest(conversation.user_messages[turn - 1], history_len(spec, turn), spec.output_len, "chat",
                         conversation.messages(answers), conversation.index, turn)


def history_len(spec: WorkloadSpec, turn: int) -> int:
    """About how many tokens turn `turn` sends (the server's usage.prompt_tokens has the real count)."""
    return spec.system_prompt_len + spec.document_len + turn * spec.user_message_len + (turn - 1) * spec.output_len


SendTurn = Callable[[SampleRequest, int], Awaitable[tuple[RequestRecord, str]]]


async def converse(spec: WorkloadSpec, conversation: Conversation, send: SendTurn,
                   on_turn: Callable[[], None] = lambda: None) -> list[RequestRecord]:
    """Every turn of `conversation`, one after the other, each with the answers so far."""
    answers: list[str] = []
    records: list[RequestRecord] = []
    for turn in range(1, spec.num_turns + 1):
        sample = turn_request(spec, conversation, answers)
        record, answer = await send(sample, conversation.index * spec.num_turns + turn - 1)
        records.append(record)
        on_turn()
        if not record.success:
            return records + _not_sent(spec, conversation.index, turn)
        answers.append(answer)
        if turn < spec.num_turns and spec.think_time:
            await asyncio.sleep(spec.think_time)          # the user reading and typing, not synchronisation
    return records


def _not_sent(spec: WorkloadSpec, conversation: int, failed: int) -> list[RequestRecord]:
    error = f"not sent: turn {failed} of its conversation failed"
    return [RequestRecord(conversation * spec.num_turns + turn - 1, "chat", history_len(spec, turn), spec.output_len,
                          0.0, success=False, error=error, conversation=conversation, turn=turn)
            for turn in range(failed + 1, spec.num_turns + 1)]


def warmup_requests(spec: WorkloadSpec, count: int) -> list[SampleRequest]:
    """First turns of `count` conversations of another seed (another system prompt: nothing measured is cached)."""
    return [turn_request(spec, c, []) for c in build_conversations(warmup_spec(spec))[:count]]


async def benchmark_conversations(endpoint: EndpointConfig, spec: WorkloadSpec, traffic: TrafficSpec,
                                  warmups: Sequence[SampleRequest] = (), progress: bool = True) -> BenchResult:
    """Run every conversation of `spec` on `traffic`'s arrival schedule of conversations, after `warmups`
    (one at a time, unrecorded); stops starting conversations after `traffic.duration` seconds."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for index, sample in enumerate(warmups):
            record, _ = await send_request_with_text(session, endpoint, sample, index, time.perf_counter())
            if not record.success:
                print(f"warm-up request {index} failed: {record.error}", file=sys.stderr)
        before = await scrape_prefix_cache(session, endpoint)
        with tqdm(total=spec.num_conversations * spec.num_turns, disable=not progress, unit="turn") as bar:
            origin = time.perf_counter()
            tasks = await _start_all(spec, traffic, _sender(session, endpoint, origin), origin, bar)
            records = [record for result in await asyncio.gather(*tasks) for record in result]
            duration = time.perf_counter() - origin
        after = await scrape_prefix_cache(session, endpoint)
    return BenchResult(tuple(sorted(records, key=lambda r: r.index)), duration, prefix_cache_delta(before, after),
                       origin, spec_decode_delta(before, after))


def _sender(session: aiohttp.ClientSession, endpoint: EndpointConfig, origin: float) -> SendTurn:
    async def send(sample: SampleRequest, index: int) -> tuple[RequestRecord, str]:
        return await send_request_with_text(session, endpoint, sample, index, origin)
    return send


async def _start_all(spec: WorkloadSpec, traffic: TrafficSpec, send: SendTurn, origin: float,
                     bar: tqdm) -> list[asyncio.Task]:
    semaphore = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    offsets = arrival_offsets(traffic.request_rate, traffic.burstiness, traffic.seed)
    tasks = []
    for conversation, offset in zip(build_conversations(spec), offsets):
        if traffic.duration is not None and max(offset, time.perf_counter() - origin) >= traffic.duration:
            break
        await asyncio.sleep(max(0.0, origin + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(_limited(semaphore, converse(spec, conversation, send,
                                                                       lambda: bar.update(1)))))
    return tasks


async def _limited(semaphore: asyncio.Semaphore | None, coroutine: Awaitable[list[RequestRecord]]):
    async with semaphore or contextlib.nullcontext():
        return await coroutine
