"""The engine front: submit requests, stream their tokens as text, abort them, report stats.

Start-up, in order: the served model (`served.py`), the mode (`engine.modes`, chosen once), the layout
(`engine.units.layout`: one UnitSpec per unit), the units (threads, worker processes, Ray actors or simulated
ones, built from the specs), then the mode's actors over them and the coordinator between them."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.actors.base import Actor
from pdserve.engine.actors.tiering import keep_prefixes
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.coordinator.coordinator import Coordinator, NoUnitUp
from pdserve.engine.coordinator.profile import measure_units
from pdserve.engine.coordinator.profile_store import ProfileStore, profile_key
from pdserve.engine.coordinator.slo import Slos, derive_slos
from pdserve.engine.core.context_window import check_context
from pdserve.engine.core.messages import ActorStats, EngineStats, FinishReason, Request
from pdserve.engine.modes import choose_mode
from pdserve.engine.modes.base import Wiring
from pdserve.engine.recovery import Recovery
from pdserve.engine.recurrent import serving_config
from pdserve.engine.served import ServedModel
from pdserve.engine.streams import RequestStream, Streams
from pdserve.engine.supervisor import Supervisor
from pdserve.engine.units.drafts import check_draft_model, with_draft_models
from pdserve.engine.units.layout import machine_cores, machine_devices, machine_dtype, make_layout
from pdserve.engine.units.spec import Layout
from pdserve.engine.units.units import Units
from pdserve.engine.worker.openmp import on_single_threaded_loader

logger = logging.getLogger(__name__)

UnitLoader = Callable[[EngineConfig, ModelConfig, Layout, frozenset[int]], Units]


class EngineOverloaded(RuntimeError):
    """Too many unfinished requests; retry later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down, restarting its actors after a failure, dead, or not started."""


@dataclass(frozen=True, slots=True)
class Machine:
    """What the units run on: the devices of each role, the serving dtype and the CPU cores."""

    prefill: tuple[torch.device, ...]
    decode: tuple[torch.device, ...]
    dtype: torch.dtype
    cores: tuple[int, ...]

    @classmethod
    def here(cls, config: EngineConfig) -> Machine:
        """This machine, as the options and its devices decide (each choice logged)."""
        prefill, decode = machine_devices(config)
        return cls(prefill, decode, machine_dtype(config, (*prefill, *decode)), machine_cores())


class Engine(Recovery):
    """The served model over its units, in its mode, on the current event loop. A simulator hands in its own
    model, machine, unit loader and clock; nothing else differs."""

    def __init__(self, config: EngineConfig, served: ServedModel | None = None, machine: Machine | None = None,
                 load: UnitLoader | None = None, clock: Callable[[], float] = time.monotonic,
                 keep_profile: bool = True) -> None:
        """`keep_profile`: keep the start-up profile on disk for the next start (not a simulator's: free steps)."""
        self.clock, self.keep_profile = clock, keep_profile
        torch.manual_seed(config.seed)                # unseeded sampling draws from the global generator
        self.served = served or ServedModel.load(config.model)
        self.config = config = serving_config(config, self.served.config)
        check_draft_model(config, self.served.config)
        machine = machine or Machine.here(config)
        self.mode = choose_mode(config.mode, machine.prefill[0], machine.decode[0])
        self.layout = make_layout(config, self.served.config, self.mode, machine.prefill, machine.decode,
                                  machine.dtype, machine.cores)
        load = load or unit_loader(config)
        eos = self.served.eos_token_ids
        self.units = on_single_threaded_loader(load, config, self.served.config, self.layout, eos)
        self.units = on_single_threaded_loader(with_draft_models, self.units, config, self.served.config, self.layout)
        self.supervisor = Supervisor(self, config.on_worker_failure, config.step_timeout)
        self.streams = Streams(self.served.tokenizer, self._abort_in_actors, self._left_table)
        self._slos: Slos | None = None
        self.coordinator = self._wire()
        self.max_model_len = min(self.layout.max_model_len, self.units.sequence_tokens())
        self._running = False

    # what it serves
    @property
    def model_name(self) -> str:
        return self.served.name

    @property
    def model_dir(self):
        return self.served.model_dir

    @property
    def model_config(self) -> ModelConfig:
        return self.served.config

    @property
    def tokenizer(self):
        return self.served.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.served.eos_token_ids

    @property
    def actors(self) -> list[Actor]:
        """Every actor: the prefill units' in unit order, then those that decode."""
        return self.coordinator.actors

    @property
    def slos(self) -> Slos | None:
        """The TTFT and ITL SLOs in effect (set, or derived at the first `start()`); None before it."""
        return self._slos

    def _wire(self) -> Coordinator:
        wiring = Wiring(self.config, self.layout, self.streams.on_step)
        actors = [self.mode.actor(spec, unit, self.units.drafter(spec), wiring)
                  for spec, unit in zip(self.units.specs, self.units.computes)]
        for actor, spec in zip(actors, self.units.specs):
            actor.index, actor.unit_name = spec.index, spec.name
            actor.on_failure = self.supervisor.actor_failed
            self._attach_tiers(actor)
        prefill = [a for a, spec in zip(actors, self.units.specs) if not spec.decodes]
        decoding = [a for a, spec in zip(actors, self.units.specs) if spec.decodes]
        coordinator = Coordinator(prefill, decoding, self.mode.entry_role, self.mode.needs_prefill_units, self.clock)
        self.mode.wire(coordinator, wiring)
        return coordinator

    def _fresh_actor(self, actor: Actor) -> Actor:
        """A new actor (nothing queued, not started) over `actor`'s unit, in its role."""
        spec, unit = next((s, u) for s, u in zip(self.units.specs, self.units.computes) if s.name == actor.unit_name)
        return self._attach_tiers(self.mode.actor(spec, unit, self.units.drafter(spec),
                                                  Wiring(self.config, self.layout, self.streams.on_step)))

    def _attach_tiers(self, actor: Actor) -> Actor:
        """`actor` saves to and loads from the engine's KV tiers, where it has any (one store for every unit)."""
        if self.units.tiers is not None:
            actor.attach_tiers(self.units.tiers.index)
        return actor

    # lifecycle
    async def start(self) -> None:
        if self._slos is None:
            measured = await measure_units(self.config.scheduler, self.layout, self.units,
                                           self.served.config.vocab_size, self.mode.decode_units_prefill,
                                           self._profile_store() if self.keep_profile else None)
            self._slos = derive_slos(self.config.scheduler, self.layout.max_model_len, measured)
            logger.info("%s", self._slos.describe())
            self.mode.serve(self.coordinator, self._slos, measured)
        for actor in self.coordinator.serving:          # a retired unit's stand-in never starts
            self._start_actor(actor)
        self.supervisor.start()
        self._running = True

    def _profile_store(self) -> ProfileStore:
        key = profile_key(self.served.model_dir, self.layout, self.config.quantization, self.config.cpu_kernels,
                          self.config.scheduler)
        return ProfileStore(key | {"units run as": sorted({type(u).__name__ for u in self.units.computes}),
                                   "mode": self.mode.name})

    def _start_actor(self, actor: Actor) -> None:
        """Start `actor`, its speculator bounded by the engine's ITL SLO (a derived one exists only now)."""
        if actor.speculator is not None:
            actor.speculator.serve(self._slos and self._slos.itl)
        actor.start()

    async def stop(self) -> None:
        """Abort every unfinished request and stop the actors, holding no KV block (the model stays loaded)."""
        self._running = False
        await self.supervisor.stop()
        for request_id in list(self.streams.open):
            self.abort(request_id)
        await keep_prefixes(self.actors)
        for actor in self.actors:
            await actor.stop()
        delivered = True
        while delivered:                      # NOTE: a message handled by one actor can send another
            delivered = any([actor.drain() for actor in self.actors])
        for actor in self.actors:
            actor.clear()

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

    # requests
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
        if len(self.streams) >= self.config.scheduler.max_queue:
            raise EngineOverloaded(f"{len(self.streams)} requests in flight; the limit is "
                                   f"{self.config.scheduler.max_queue}")
        if request.request_id in self.streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        if request.arrival_time == 0.0:
            request = dataclasses.replace(request, arrival_time=self.clock())
        try:
            self.coordinator.submit(request)
        except NoUnitUp as e:
            raise EngineStopped(str(e)) from None
        return self.streams.add(request, self.abort)

    def _validate(self, request: Request) -> None:
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        vocab = self.served.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not t < vocab for t, _ in request.params.logit_bias):
            raise ValueError(f"logit_bias must name token ids in [0, {vocab})")
        check_context(prompt_len, request.params.max_tokens, self.max_model_len)

    def abort(self, request_id: str) -> None:
        """End the request's stream with finish reason `abort` and free its KV blocks on every actor."""
        if self.streams.end(request_id, FinishReason.ABORT):
            self._abort_in_actors(request_id)

    def _abort_in_actors(self, request_id: str) -> None:
        self.coordinator.abort(request_id)

    def _left_table(self, request_id: str) -> None:
        self.coordinator.finished(request_id)

    # what it reports
    def stats(self) -> EngineStats:
        prefill = [self._actor_stats(actor) for actor in self.coordinator.prefill]
        decoding = [self._actor_stats(actor) for actor in self.coordinator.decode]
        running, waiting = self.mode.counts(prefill, decoding)
        return EngineStats((*prefill, *decoding), running=running, waiting=waiting, num_unfinished=len(self.streams),
                           restarts=self.supervisor.restarts, dead=self.dead is not None,
                           tiers=self.units.tiers.index.stats() if self.units.tiers is not None else ())

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


def unit_loader(config: EngineConfig) -> UnitLoader:
    """Where the units run: threads of this process, worker processes, or Ray actors (ray is an extra)."""
    if config.distributed_executor_backend == "ray":
        from pdserve.engine.ray.units import load_ray_units       # NOTE: imported only when asked for
        return load_ray_units
    if config.workers == "process":
        from pdserve.engine.units.processes import load_process_units
        return load_process_units
    from pdserve.engine.units.threads import load_thread_units
    return load_thread_units
