"""The engine front: submit requests, stream their tokens as text, abort them, report stats."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pdserve.engine.actors.base import Actor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.coordinator.coordinator import Coordinator, NoUnitUp
from pdserve.engine.coordinator.planner import Planner
from pdserve.engine.coordinator.profile import UnitProfile, full_prefill_shape, one_row_shape, profile_unit
from pdserve.engine.coordinator.slo import MeasuredUnits, Slos, derive_slos
from pdserve.engine.core.messages import (
    ActorStats,
    EngineStats,
    FinishReason,
    Request,
    StepOutput,
    TokenEvent,
    TokenLogprob,
)
from pdserve.engine.units.drafts import check_draft_model, with_draft_models
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.units.processes import load_process_units
from pdserve.engine.supervisor import Supervisor
from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.stop_strings import StopStringMatcher
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.units.layout import core_share, load_units, make_plan, unit_names, wire_actor, wire_actors
from pdserve.engine.worker.memory import keep_freed_memory_in_process

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """Too many unfinished requests; retry later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down, restarting its actors after a failure, dead, or not started."""


@dataclass(slots=True, eq=False)
class _Stream:
    request: Request
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None           # None: no stop strings
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class RequestStream:
    """Async iterator of TokenEvent for one request; the last event has `finish_reason` set.

    Leaving the iteration early (break, cancellation, `aclose()`) aborts the request.
    """

    def __init__(self, engine: "Engine", stream: _Stream) -> None:
        self._engine = engine
        self._stream = stream
        self._finished = False
        self.request_id = stream.request.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> TokenEvent:
        if self._finished:
            raise StopAsyncIteration
        try:
            event = await self._stream.queue.get()
        except BaseException:
            await self.aclose()
            raise
        self._finished = event.finished
        return event

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.abort(self.request_id)


class Engine:
    """Loads the model into the configured topology and runs its actors on the current event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)                # unseeded sampling draws from the global generator
        model = resolve_model(config.model)
        self.model_dir, self.model_name = model.path, model.name
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.eos_token_ids = self.tokenizer.eos_token_ids | frozenset(self.model_config.eos_token_ids)
        check_draft_model(config, self.model_config)
        self.plan = make_plan(config, self.model_config)
        if any(device.type == "cpu" for device in self.plan.devices):
            keep_freed_memory_in_process()
        load = _unit_loader(config)
        self.units = on_single_threaded_loader(load, config, self.model_config, self.plan, self.eos_token_ids)
        self.units = on_single_threaded_loader(with_draft_models, self.units, config, self.model_config, self.plan)
        self.supervisor = Supervisor(self, config.on_worker_failure, config.step_timeout)
        self._slos: Slos | None = None
        self.coordinator = self._wire()
        pool_tokens = min(unit.num_blocks * unit.block_size for unit in self.units.all())
        self.max_model_len = min(self.plan.max_model_len, pool_tokens)
        self._streams: dict[str, _Stream] = {}
        self._running = False

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def actors(self) -> list[Actor]:
        """Every actor: the prefill units' in unit order, then the decode (or colocated) units'."""
        return self.coordinator.actors

    @property
    def slos(self) -> Slos | None:
        """The TTFT and ITL SLOs in effect (set, or derived at the first `start()`); None before it."""
        return self._slos

    def _planner(self) -> Planner | None:
        if self.mode != "adaptive" or self._slos is None:
            return None
        return Planner(self._slos, self.config.scheduler.max_prefill_tokens)

    def _wire(self) -> Coordinator:
        prefill, decode = wire_actors(self.config, self.plan, self.units, self._on_step)
        coordinator = Coordinator(self.mode, prefill, decode, self._planner())
        for role, actors in (("prefill", prefill), ("colocated" if self.mode == "colocated" else "decode", decode)):
            for index, (actor, name) in enumerate(zip(actors, unit_names(role, len(actors)))):
                actor.index, actor.unit_name = index, name
                actor.on_failure = self.supervisor.actor_failed
        return coordinator

    async def start(self) -> None:
        if self._slos is None:
            measured = await self._measure()
            self._slos = derive_slos(self.config.scheduler, self.plan.max_model_len, measured)
            logger.info("%s", self._slos.describe())
            if measured is not None:
                self.coordinator.learn_costs(measured)
            self.coordinator.planner = self._planner()
        for actor in self.coordinator.serving:          # a retired unit's stand-in never starts
            self._start_actor(actor)
        self.supervisor.start()
        self._running = True

    def _start_actor(self, actor: Actor) -> None:
        """Start `actor`, its speculator bounded by the engine's ITL SLO (a derived one exists only now)."""
        if actor.speculator is not None:
            actor.speculator.serve(self._slos and self._slos.itl)
        actor.start()

    async def _measure(self) -> MeasuredUnits | None:
        return await measure_units(self.config, self.plan, self.units, self.model_config.vocab_size)

    async def stop(self) -> None:
        """Abort every unfinished request and stop the actors, holding no KV block (the model stays loaded)."""
        self._running = False
        await self.supervisor.stop()
        for request_id in list(self._streams):
            self.abort(request_id)
        for actor in self.actors:
            await actor.stop()
        delivered = True
        while delivered:                      # NOTE: a message handled by one actor can send another
            delivered = any([actor.drain() for actor in self.actors])
        for actor in self.actors:
            actor.settle()

    def close(self) -> None:
        self.units.close()

    @property
    def dead(self) -> str | None:
        """Why the engine cannot serve any more (the supervisor gave up on it); None while it can."""
        return self.supervisor.dead

    async def wait_dead(self) -> str:
        await self.supervisor.died.wait()
        return self.supervisor.dead

    def healthy(self, stall_seconds: float | None = None) -> bool:
        """Running, and every actor alive and not stuck in one step for over `stall_seconds`
        (default: --step-timeout, or never when that is 0)."""
        stall = stall_seconds or self.supervisor.step_timeout or float("inf")
        return (self._running and not self.supervisor.recovering and self.dead is None
                and all(actor.stepping(stall) for actor in self.actors if self.coordinator.up(actor)))

    # failures (engine.supervisor decides when)
    def fail_unfinished(self, error: str) -> None:
        """End every unfinished request with an error event; nothing new is accepted until restarted."""
        self._running = False
        streams, self._streams = self._streams, {}
        self.coordinator.forget_all()
        for stream in streams.values():
            stream.queue.put_nowait(self._final_event(stream, FinishReason.ERROR, error))
        if streams:
            logger.error("%d unfinished requests ended with an error: %s", len(streams), error)

    async def abandon_actors(self) -> None:
        for actor in self.actors:
            await actor.abandon()

    def can_recover_stuck(self, actor: Actor | None = None) -> bool:
        """A unit stuck in a step (`actor`'s; None: any unit) can be killed and spawned again only when it is
        a process or a Ray actor."""
        units = self.units.all() if actor is None else (actor.unit,)
        return all(unit.kind in ("process", "ray") for unit in units)

    async def restart_actors(self, recover_stuck: bool) -> None:
        """Fresh actors over the same units (a worker process that died or hangs is spawned again); the
        retired units stay retired."""
        old = self.coordinator
        for actor in old.serving:
            await actor.unit.recover(force=recover_stuck)
        self.coordinator = self._wire()
        for actor in self.coordinator.actors:
            if actor.unit_name in old.retired:
                self.coordinator.retire(actor, actor, old.down[actor.unit_name])
        for actor in self.coordinator.serving:
            self._start_actor(actor)
        self._running = True

    # one unit's failure (engine.supervisor decides when): only its requests end
    def can_fail_alone(self, actor: Actor) -> bool:
        """The units not retired, `actor`'s aside, serve every phase the mode needs: its failure stays local."""
        return self.coordinator.serves_without(actor)

    def can_serve(self) -> bool:
        """The units not retired serve every phase the mode needs."""
        return self.coordinator.serves_without()

    def fail_unit(self, actor: Actor, error: str) -> None:
        """End the requests `actor`'s unit holds with an error event (their other units free them)."""
        failed = [self._streams.pop(rid) for rid in self.coordinator.fail_unit(actor, error)
                  if rid in self._streams]
        for stream in failed:
            stream.queue.put_nowait(self._final_event(stream, FinishReason.ERROR, error))
        if failed:
            logger.error("%d requests on unit %s ended with an error: %s", len(failed), actor.unit_name, error)

    async def restart_unit(self, actor: Actor, recover_stuck: bool) -> None:
        """A fresh actor over `actor`'s unit (a worker process that died or hangs is spawned again)."""
        await self.coordinator.quiesce(actor)
        await actor.unit.recover(force=recover_stuck)
        fresh = self._fresh_actor(actor)
        fresh.on_failure = self.supervisor.actor_failed
        self.coordinator.unit_up(actor, fresh)
        self._start_actor(fresh)

    async def retire_unit(self, actor: Actor, why: str, stuck: bool) -> None:
        """`actor`'s unit serves no more, until the server restarts (its requests have ended): a fresh actor
        that never starts stands in for it, so its pool reads free and routing skips it for good.
        `stuck`: its thread is inside a step, abandoned (nothing is waited for on it)."""
        await self.coordinator.quiesce(actor, stuck)
        stand_in = self._fresh_actor(actor)
        self.coordinator.retire(actor, stand_in, why)
        if stuck and actor.unit.kind == "thread":
            logger.error("unit %s retired: its compute thread is stuck in a step and is abandoned; its %s stay "
                         "taken until the server restarts", actor.unit_name, _compute_of(actor.unit))
        logger.error("unit %s retired, the other units serve on: %s", actor.unit_name, why)

    def _fresh_actor(self, actor: Actor) -> Actor:
        """A new actor (nothing queued, not started) over `actor`'s unit, in its role."""
        role = "prefill" if actor in self.coordinator.prefill else "decode"
        return wire_actor(self.config, self.plan, self.units, self._on_step, role, actor.index)

    def units_up(self) -> list[dict]:
        """Every unit: its name, role, whether it serves now, its state and, when down, why (for /health)."""
        return [{"unit": name, "role": role, "up": state == "up", "state": state} | ({"error": why} if why else {})
                for name, role, state, why in self.coordinator.units()]

    def submit(self, request: Request) -> RequestStream:
        """Queue `request`; returns its event stream.

        Raises ValueError for a prompt that cannot run (empty, unknown token ids, too long for
        the context window), EngineOverloaded when the queue is full, EngineStopped when not running.
        """
        if not self._running:
            if self.dead is not None:
                raise EngineStopped(f"the engine is dead: {self.dead}")
            if self.supervisor.recovering:
                raise EngineStopped("the engine is restarting its actors after a failure; retry shortly")
            raise EngineStopped("the engine is not running")
        self._validate(request)
        if len(self._streams) >= self.config.scheduler.max_queue:
            raise EngineOverloaded(f"{len(self._streams)} requests in flight; the limit is "
                                   f"{self.config.scheduler.max_queue}")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream = _Stream(request, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                         request.params.skip_special_tokens),
                         StopStringMatcher(request.params.stop) if request.params.stop else None,
                         num_prompt_tokens=len(request.prompt_token_ids))
        if request.arrival_time == 0.0:
            request = _with_arrival_time(request)
        try:
            self.coordinator.submit(request)
        except NoUnitUp as e:
            raise EngineStopped(str(e)) from None
        self._streams[request.request_id] = stream
        return RequestStream(self, stream)

    def _validate(self, request: Request) -> None:
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not t < vocab for t, _ in request.params.logit_bias):
            raise ValueError(f"logit_bias must name token ids in [0, {vocab})")
        if prompt_len + request.params.max_tokens > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the "
                             f"prompt has {prompt_len} and max_tokens is {request.params.max_tokens}")

    def abort(self, request_id: str) -> None:
        """End the request's stream with finish reason `abort` and free its KV blocks on every actor."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.queue.put_nowait(self._final_event(stream, FinishReason.ABORT))
        self._abort_in_actors(request_id)

    def _on_step(self, output: StepOutput) -> None:
        """One actor step's tokens: detokenize each and put its event on its request's stream."""
        streams = self._streams
        logprobs = output.logprobs or (None,) * len(output)
        if output.cached_tokens is not None:
            self._note_cached(output)
        for request_id, token_id, reason, logprob in zip(output.request_ids, output.token_ids,
                                                         output.finish_reasons, logprobs):
            stream = streams.get(request_id)
            if stream is None:                     # aborted or stopped while in flight between actors
                if reason is None:
                    self._abort_in_actors(request_id)
            elif reason is None and stream.stops is None:     # the common case, kept short: mid-stream
                stream.num_output_tokens += 1
                stream.queue.put_nowait(TokenEvent(request_id, (token_id,), stream.detokenizer.push(token_id),
                                                   (logprob,) if logprob else (), None, None,
                                                   stream.num_prompt_tokens, stream.num_output_tokens,
                                                   stream.num_cached_tokens))
            elif reason is FinishReason.ERROR:
                del streams[request_id]
                self.coordinator.finished(request_id)
                stream.queue.put_nowait(self._final_event(stream, FinishReason.ERROR, output.error))
            else:
                self._deliver(stream, token_id, logprob, reason)

    def _note_cached(self, output: StepOutput) -> None:
        """A request's first token carries how much of its prompt came from the prefix cache."""
        for request_id, cached in zip(output.request_ids, output.cached_tokens):
            stream = self._streams.get(request_id)
            if stream is not None and stream.num_output_tokens == 0:
                stream.num_cached_tokens = cached

    def _deliver(self, stream: _Stream, token_id: int, logprob: TokenLogprob | None,
                 actor_reason: FinishReason | None) -> None:
        stream.num_output_tokens += 1
        text = "" if actor_reason is FinishReason.STOP else stream.detokenizer.push(token_id)
        stopped, reason = False, actor_reason
        if stream.stops is not None:
            text, stopped = stream.stops.feed(text)
        if stopped:
            reason = FinishReason.STOP
        elif reason is not None:
            text, reason = self._final_text(stream, text, reason)
        request_id = stream.request.request_id
        stream.queue.put_nowait(TokenEvent(request_id, (token_id,), text, (logprob,) if logprob else (), reason,
                                           None, stream.num_prompt_tokens, stream.num_output_tokens,
                                           stream.num_cached_tokens))
        if reason is not None:
            del self._streams[request_id]
            if actor_reason is None:               # a stop string: the actors still hold the sequence
                self._abort_in_actors(request_id)
            else:
                self.coordinator.finished(request_id)

    @staticmethod
    def _final_text(stream: _Stream, text: str, reason: FinishReason) -> tuple[str, FinishReason]:
        """The text held back by the detokenizer and the stop strings, at the end of a stream."""
        tail = stream.detokenizer.flush()
        if stream.stops is None:
            return text + tail, reason
        tail, stopped = stream.stops.feed(tail)
        return text + (tail if stopped else tail + stream.stops.flush()), FinishReason.STOP if stopped else reason

    def _abort_in_actors(self, request_id: str) -> None:
        self.coordinator.abort(request_id)

    @staticmethod
    def _final_event(stream: _Stream, reason: FinishReason, error: str | None = None) -> TokenEvent:
        return TokenEvent(stream.request.request_id, finish_reason=reason, error=error,
                          num_prompt_tokens=stream.num_prompt_tokens, num_cached_tokens=stream.num_cached_tokens,
                          num_output_tokens=stream.num_output_tokens)

    def stats(self) -> EngineStats:
        prefill = [self._actor_stats(actor) for actor in self.coordinator.prefill]
        decode = [self._actor_stats(actor) for actor in self.coordinator.decode]
        actors = (*prefill, *decode)
        if self.mode == "colocated":
            running, waiting = sum(a.running for a in decode), sum(a.waiting for a in decode)
        elif self.mode == "adaptive":               # decode: (decoding and landing, queued for local prefill)
            running, waiting = sum(a.running for a in decode), sum(a.waiting for a in (*decode, *prefill))
        else:
            running, waiting = sum(a.running + a.waiting for a in decode), sum(a.waiting for a in prefill)
        return EngineStats(actors, running=running, waiting=waiting, num_unfinished=len(self._streams),
                           restarts=self.supervisor.restarts, dead=self.dead is not None)

    def _actor_stats(self, actor: Actor) -> ActorStats:
        stats = actor.stats()
        return dataclasses.replace(stats, retired=True) if actor.unit_name in self.coordinator.retired else stats

    def take_mask_times(self) -> list[float]:
        """Host seconds each step spent on its token masks (grammars, logit_bias), since the last call."""
        drained = [seconds for actor in self.actors for seconds in actor.mask_seconds]
        for actor in self.actors:
            actor.mask_seconds.clear()
        return drained

    def take_kv_transfer_times(self) -> list[float]:
        """Durations (seconds) of KV copies finished since the last call."""
        drained = []
        for actor in self.coordinator.prefill:
            drained += actor.transfer_seconds
            actor.transfer_seconds.clear()
        return drained


def _unit_loader(config: EngineConfig):
    """Where the units run: threads of this process, worker processes, or Ray actors (ray is an extra)."""
    if config.distributed_executor_backend == "ray":
        from pdserve.engine.ray.units import load_ray_units       # NOTE: imported only when asked for
        return load_ray_units
    return load_process_units if config.workers == "process" else load_units


async def measure_units(config: EngineConfig, plan, units, vocab_size: int) -> MeasuredUnits | None:
    """Profile the first decode unit and the first prefill unit (`pdserve.engine.coordinator.profile`);
    None with `startup_profile` off (both SLOs are then set): each on its own threads and, where cores are lent,
    on both units' threads too; an adaptive decode unit prefills in both (without its own threads' prefill
    steps, its fit priced a 2,048-token chunk on one core at 78 ms, not 870, and it declined lent cores).
    The units' cost models (routing, the planner) start from it (`Coordinator.learn_costs`) and learn from
    serving steps on.
    (The simulator, pdserve.engine.sim, profiles its simulated units with it too.)"""
    sched = config.scheduler
    if not sched.startup_profile:
        return None
    share = core_share(plan)
    colocated = not units.prefills
    prefills_too = colocated or plan.mode == "adaptive"   # NOTE: an adaptive decode unit prefills on its own cores
    decode = UnitProfile(units.decode, StepCostModel(), True, prefills_too,  # while the prefill unit works
                         share and (share.decode_own,) or (None,))
    prefill = decode if colocated else UnitProfile(units.prefill, StepCostModel(), False, True,
                                                   share and (share.prefill_own,) or (None,))
    profiles = [decode] if colocated else [decode, prefill]
    if share is not None:            # lent cores: each unit as it steps on both units' threads
        profiles += [dataclasses.replace(decode, prefills=True, thread_counts=(share.total,)),
                     dataclasses.replace(prefill, thread_counts=(share.total,))]
    for profile in profiles:
        await profile_unit(profile, sched, plan.max_model_len, vocab_size)
    return MeasuredUnits(decode.cost, share and share.decode_own, prefill.cost, share and share.prefill_own,
                         decode.own_timing(one_row_shape(sched, plan.max_model_len)),
                         prefill.own_timing(full_prefill_shape(sched, plan.max_model_len)))


def _compute_of(unit) -> str:
    """What a thread unit steps on, for a log line: its CPU cores, else its device."""
    cores = unit.cpu_cores
    return f"CPU cores {','.join(map(str, cores))}" if cores else f"device {unit.device}"


def on_single_threaded_loader(fn, *args):
    """Run `fn(*args)` on a short-lived thread limited to one intra-op thread.

    NOTE: a thread that runs multi-threaded CPU ops keeps an OpenMP team alive; with one left behind by
    loading, every CPU actor step ran about 25% slower (measured with commit 823867d).
    """
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,)) as loader:
        return loader.submit(fn, *args).result()


def _with_arrival_time(request: Request) -> Request:
    return dataclasses.replace(request, arrival_time=time.monotonic())
