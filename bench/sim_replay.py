"""Replaying a `pdserve bench` workload through the simulated engine on its virtual clock: the same seeded
samples and arrival times, one RequestRecord per request, as the load test would record them."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.bench.loadtest import Options
from pdserve.bench.metrics import BenchResult, RequestRecord
from pdserve.bench.multiturn import MULTITURN, build_conversations, converse, warmup_requests
from pdserve.bench.server_metrics import HITS, QUERIES, prefix_cache_delta
from pdserve.bench.workloads import SampleRequest, arrival_offsets, build_workload, warmup_spec
from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine

ANSWER = "\x00answer"      # the word an answer is made of: it tokenizes to the token the simulated units emit


@dataclass(frozen=True, slots=True)
class ChatOverhead:
    """Tokens a chat template adds: per message by role (the first message's include a BOS or other
    preamble), and the generation prompt at the end."""

    per_role: tuple[tuple[str, int], ...] = ()
    generation_prompt: int = 0

    def of(self, role: str) -> int:
        return dict(self.per_role).get(role, 0)


ROLES = ("system", "user", "assistant")


def chat_overhead(model_dir) -> ChatOverhead:
    """What `model_dir`'s chat template adds (pdserve.engine.text.tokenizer renders it as the server does),
    from renders of a system, user and assistant message in turn; none without a tokenizer or a template."""
    from pdserve.engine.text.tokenizer import Tokenizer

    messages = [{"role": role, "content": f"alpha {role} beta"} for role in ROLES]
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
        rendered = [0] + [len(tokenizer.encode_chat(messages[:n], add_generation_prompt=False)) for n in (1, 2, 3)]
        prompted = len(tokenizer.encode_chat(messages[:2], add_generation_prompt=True))
    except (OSError, ValueError, LookupError):
        return ChatOverhead()
    content = [len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages]
    per_role = tuple((role, max(rendered[i + 1] - rendered[i] - content[i], 0)) for i, role in enumerate(ROLES))
    return ChatOverhead(per_role, max(prompted - rendered[2], 0))


class WordIds:
    """Prompt text to token ids without a tokenizer: each word hashes to `tokens_per_word` ids (on average),
    the same word always to the same ids, so repeated history hits the prefix cache as it would."""

    def __init__(self, vocab_size: int, answer_token: int, tokens_per_word: float = 1.0,
                 avoid: frozenset[int] = frozenset(), chat: ChatOverhead | None = None) -> None:
        self.vocab_size, self.answer_token, self.avoid = vocab_size, answer_token, avoid
        self.whole, self.fraction = int(tokens_per_word), tokens_per_word - int(tokens_per_word)
        self.chat = chat or ChatOverhead()

    def word(self, word: str) -> list[int]:
        if word == ANSWER:
            return [self.answer_token]
        code = zlib.crc32(word.encode())
        count = self.whole + ((code % 1000) < self.fraction * 1000)
        ids = [zlib.crc32(f"{word}#{i}".encode()) % self.vocab_size for i in range(max(count, 1))]
        return [i if i not in self.avoid else (i + 1) % self.vocab_size for i in ids]

    def text(self, text: str) -> list[int]:
        return [i for word in text.split() for i in self.word(word)]

    def sample(self, sample: SampleRequest) -> tuple[int, ...]:
        """A completion's prompt, or a chat: each message's template tokens (by role) and content, then the
        generation prompt (the assistant's template tokens, so the next turn's history extends it)."""
        if not sample.messages:
            return tuple(self.text(sample.prompt))
        ids = [i for m in sample.messages for i in (*self._role(m["role"], self.chat.of(m["role"])),
                                                     *self.text(m["content"]))]
        return tuple(ids + self._role("assistant", self.chat.generation_prompt))

    def _role(self, role: str, count: int) -> list[int]:
        return self.text(" ".join(f"\x00{role}{i}" for i in range(count)))[:count] if count else []


async def send(engine: Engine, ids: WordIds, sample: SampleRequest, index: int, origin: float,
               prefix: str = "req") -> tuple[RequestRecord, str]:
    """One request through the engine, recorded as `pdserve bench` records a stream; and its answer text."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    prompt = ids.sample(sample)
    params = SamplingParams(max_tokens=sample.output_len, min_tokens=sample.output_len, ignore_eos=True,
                            temperature=0.0)
    base = dict(index=index, kind=sample.kind, prompt_len=sample.prompt_len, max_tokens=sample.output_len,
                send_time=sent - origin, conversation=sample.conversation, turn=sample.turn)
    try:
        stream = engine.submit(Request(f"{prefix}-{index}", prompt, params))
    except ValueError as error:
        return RequestRecord(**base, success=False, error=f"HTTP 400: {error}"), ""
    times, cached, reason, error = [], 0, None, None
    async for event in stream:
        if event.token_ids:
            times.append(loop.time())
        cached = cached or event.num_cached_tokens
        reason, error = event.finish_reason, event.error
    if reason is FinishReason.ERROR:
        return RequestRecord(**base, success=False, error=f"engine error: {error}"), ""
    record = RequestRecord(**base, success=True, prompt_tokens=len(prompt), output_tokens=len(times),
                           ttft=times[0] - sent, latency=times[-1] - sent,
                           itl=tuple(b - a for a, b in itertools.pairwise(times)), finish_reason=reason.value,
                           usage_reported=True, cached_tokens=cached)
    return record, " ".join([ANSWER] * len(times))


def prefix_counters(engine: Engine) -> dict:
    """The prefix-cache counters /metrics would show now, keyed as bench.server_metrics parses them."""
    counters: dict = {}
    for stats in engine.stats().actors:
        for name, value in ((QUERIES, stats.prefix_cache_queries), (HITS, stats.prefix_cache_hits)):
            counters[(name, stats.name)] = counters.get((name, stats.name), 0.0) + float(value)
    return counters


async def replay(engine: Engine, ids: WordIds, options: Options) -> BenchResult:
    """Warm up, then run `options`' workload on its traffic, as `pdserve.bench.loadtest.run_workload` does."""
    loop = asyncio.get_running_loop()
    workload, traffic = options.workload, options.traffic
    multiturn = workload.name == MULTITURN
    warmups = warmup_requests(workload, traffic.num_warmups) if multiturn else \
        itertools.islice(build_workload(warmup_spec(workload)), traffic.num_warmups)
    for index, sample in enumerate(warmups):
        await send(engine, ids, sample, index, loop.time(), prefix="warmup")
    before = prefix_counters(engine)
    origin = loop.time()
    if multiturn:
        tasks = await _start(_conversations(engine, ids, options, origin), traffic, origin)
        records = [record for result in await asyncio.gather(*tasks) for record in result]
    else:
        tasks = await _start(_requests(engine, ids, options, origin), traffic, origin)
        records = [record for record, _ in await asyncio.gather(*tasks)]
    duration = loop.time() - origin
    return BenchResult(tuple(sorted(records, key=lambda r: r.index)), duration,
                       prefix_cache_delta(before, prefix_counters(engine)), origin, None)


def _requests(engine: Engine, ids: WordIds, options: Options, origin: float) -> Iterable:
    samples = build_workload(options.workload)
    for index, sample in zip(range(options.traffic.num_prompts), samples):
        yield lambda index=index, sample=sample: send(engine, ids, sample, index, origin)


def _conversations(engine: Engine, ids: WordIds, options: Options, origin: float) -> Iterable:
    spec = options.workload

    async def turn(sample: SampleRequest, index: int):
        return await send(engine, ids, sample, index, origin)

    for conversation in build_conversations(spec):
        yield lambda conversation=conversation: converse(spec, conversation, turn)


async def _start(starts: Iterable, traffic, origin: float) -> list[asyncio.Task]:
    """Start each coroutine at its seeded arrival offset (capped by --max-concurrency, cut at --duration)."""
    loop = asyncio.get_running_loop()
    semaphore = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    tasks = []
    for start, offset in zip(starts, arrival_offsets(traffic.request_rate, traffic.burstiness, traffic.seed)):
        if traffic.duration is not None and max(offset, loop.time() - origin) >= traffic.duration:
            break
        await asyncio.sleep(max(0.0, origin + offset - loop.time()))
        tasks.append(asyncio.create_task(_limited(semaphore, start)))
    return tasks


async def _limited(semaphore: asyncio.Semaphore | None, start):
    async with semaphore or contextlib.nullcontext():
        return await start()
