"""`RayCompute`: a unit whose runner steps in a Ray actor (`pdserve.engine.ray.actor.UnitActor`), possibly on
another node. The serve process keeps the unit's scheduler and block manager; each step is one wire frame
out and one back over Ray actor calls.

A prefill unit's hand-off blocks go straight from its actor to the decode unit's actor: this side only
chains the calls (`read_blocks` on the prefill actor after its step, `write_blocks` on the decode actor,
which stores them on a thread its steps do not use; `pdserve.engine.ray.transport`), so the bytes move
node to node (through Ray's object store, or over gloo) and never through this process, and the decode
unit's steps are never queued behind a copy. A step's outcome is given once its copies have landed, as a
worker process does, so the decode unit admits a sequence only once its KV is in its pool. A decode unit on
this unit's node whose pool its actor maps (`shared_peers`; `pdserve.engine.ray.shared`) gets its copies
inside the step's frame instead: the actor writes them into that pool before it answers.

A Ray error on any call (the actor or its node died) loses the unit: the step fails with an error naming
the unit and node, and `recover` asks Ray for a fresh actor. A step that has not answered within LEASE_S
renews the unit's lease with a ping (answered by a thread of the actor that steps do not hold); no answer
to the ping within LEASE_S (a node gone silent, before Ray's health checks notice) loses the unit too, so
nothing waits on a lost peer longer than twice the lease: not a step, not the decode blocks reserved for it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import ray
import torch

from pdserve.engine.transfer.base import TransferHandle
from pdserve.engine.worker.processes import wire
from pdserve.engine.worker.processes.process import WorkerDied, WorkerStepError
from pdserve.engine.worker.processes.worker_process import WorkerSpec
from pdserve.engine.worker.step import BlockCopy, StepWork
from pdserve.engine.worker.step_runner import StepOutcome
from pdserve.engine.ray.actor import remote_unit_actor
from pdserve.engine.ray.shared import PoolAddress
from pdserve.engine.ray.transport import GLOO, OBJECT_STORE, KVTransport, Sending

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0
LEASE_S = 10.0                 # a unit must answer within this, or answer a ping within it
SPAWN_ATTEMPTS = 10            # a fresh actor placed on a node Ray has not yet seen die fails at once: again
SPAWN_RETRY_S = 3.0


class UnitLost(WorkerDied):
    """A unit's Ray actor (or its node) is gone; the message names the unit and the node."""


class RayCompute:
    kind = "ray"

    def __init__(self, spec: WorkerSpec, threads: int, options: dict, peers: tuple[RayCompute, ...] = (),
                 transport: KVTransport | None = None, shares_pool: bool = False) -> None:
        """`options`: Ray actor options (resources); `peers`: the decode units a prefill unit hands off to;
        `transport`: how blocks move between the units (shared by all of them); `shares_pool`: the actor's
        pool is a segment an actor on its node can map (`pdserve.engine.ray.shared`)."""
        self.spec, self.threads, self.options, self.peers = spec, threads, options, peers
        self.shares_pool = shares_pool
        self.transport = transport or KVTransport(OBJECT_STORE)
        self.device = torch.device(spec.device)
        self.num_blocks, self.block_size = spec.pool.num_blocks, spec.pool.layout.block_size
        self.state_slots = spec.state_slots()
        self.kv_window = spec.model_config.kv_window
        self.window_slots = spec.window_slots()
        if self.state_slots is not None:
            self.num_blocks = self.state_slots.first_block
        if self.window_slots is not None:
            self.num_blocks = self.window_slots.first_block
        self.eos_token_ids = spec.eos_token_ids
        self.lost: str | None = None           # why the actor is gone; None while it serves
        self.where: dict = {}
        self.spawn()

    # lifecycle
    def spawn(self) -> None:
        """Ask Ray for the actor; returns at once (`wait_ready` waits for its runner)."""
        gloo = self.transport.configured == GLOO
        self.actor = remote_unit_actor(gloo).options(**self.options).remote(self.spec, self.threads, self.shares_pool)
        self._ready = self.actor.where.remote()
        self.lost = None
        self.shared_peers: frozenset[int] = frozenset()     # peers whose pools the actor maps (`attach`)

    def wait_ready(self) -> None:
        """Block until the actor has built its runner; RuntimeError naming the unit if it could not."""
        try:
            self.where = ray.get(self._ready, timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.kill()
            raise RuntimeError(f"the {self.spec.name} unit's Ray actor did not start within {START_TIMEOUT_S:g} s "
                               f"(no node with {self.options.get('resources') or 'free CPUs/GPUs'}?)") from None
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"the {self.spec.name} unit's Ray actor could not start: {first_line(e)}") from None
        logger.info("%s unit ready on node %s (%s), pid %d", self.spec.name, self.where["ip"],
                    self.where["node_id"][:12], self.where["pid"])

    @property
    def node(self) -> str:
        return f"node {self.where.get('ip', '?')} ({self.where.get('node_id', '?')[:12]})"

    # steps
    def submit(self, work: StepWork) -> asyncio.Future:
        return asyncio.get_running_loop().create_task(self._step(work))

    async def _step(self, work: StepWork) -> StepOutcome:
        if self.lost is not None:
            raise UnitLost(self.lost)
        actor = self.actor
        direct = tuple(copy for copy in work.copies if self._writes_directly(copy))
        chained = [copy for copy in work.copies if not self._writes_directly(copy)]
        step = actor.step.remote(wire.encode_work(replace(work, copies=direct, threads=None)))   # NOTE: no lending
        sends = [(copy, self.peers[copy.peer], self._send(actor, self.peers[copy.peer].actor, copy))
                 for copy in chained]
        started = time.perf_counter()
        reply = await self._answer(actor, step)
        kind, doc = wire.decode_message(reply)
        if kind == wire.ERROR:
            raise WorkerStepError(f"in the {self.spec.name} unit on {self.node}: {doc['error']}")
        outcome = wire.decode_outcome(reply)
        landed = dict(outcome.copies)                           # the direct copies, landed in the step
        for copy, peer, (peer_actor, sending) in sends:
            nbytes = await self._copied(actor, peer, peer_actor, sending)
            landed[copy.key] = TransferHandle.finished(nbytes, time.perf_counter() - started)
        return replace(outcome, copies=tuple((copy.key, landed[copy.key]) for copy in work.copies))

    def _writes_directly(self, copy: BlockCopy) -> bool:
        """Whether this unit's actor writes `copy` into its peer's pool itself (a same-node pool it maps, of a
        peer not known to be lost)."""
        return copy.peer in self.shared_peers and self.peers[copy.peer].lost is None

    def _send(self, actor, peer_actor, copy: BlockCopy) -> tuple:
        """Chain the copy: this unit's blocks (read after its step, in call order) into the peer's pool."""
        return peer_actor, self.transport.send(actor, peer_actor, list(copy.src_blocks), list(copy.dst_blocks))

    async def _answer(self, actor, ref):
        """`ref`'s value; a Ray error, or no answer to a ping within the lease, loses this unit."""
        try:
            return await _leased(actor, ref)
        except (ray.exceptions.RayError, LeaseExpired) as e:
            raise UnitLost(self.lose(actor, e)) from None

    async def _copied(self, actor, peer: RayCompute, peer_actor, sending: Sending) -> int:
        """Bytes a copy into `peer` wrote, once this unit has read them (leased on this unit) and the peer has
        stored them (leased on the peer). A lost peer: 0, and the copy counts as landed; the hand-off goes on
        to the peer, whose next step fails with its own error (naming it and its node) while this unit serves."""
        await self._answer(actor, sending.read)
        try:
            return await _leased(peer_actor, sending.write())
        except LeaseExpired as e:
            peer.lose(peer_actor, e)
        except ray.exceptions.RayError as e:
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
            if getattr(cause, "actor_id", None) != peer_actor._actor_id.hex():     # NOTE: this actor died under it
                raise UnitLost(self.lose(actor, cause)) from None
            peer.lose(peer_actor, cause)
        return 0

    def lose(self, actor, error: BaseException) -> str:
        """Mark this unit lost by `error` on `actor` (ignored when Ray has given it a fresh actor since)."""
        if actor is self.actor and self.lost is None:
            self.lost = f"the {self.spec.name} unit's Ray actor on {self.node} is lost: {first_line(error)}"
            logger.error("%s", self.lost)
        return self.lost or f"the {self.spec.name} unit's earlier Ray actor is lost: {first_line(error)}"

    def attach(self, index: int, address: PoolAddress) -> None:
        """The actor maps peer `index`'s pool at `address` and copies into it in its steps from now on, until
        any unit restarts. Raises Ray's error (the actor's OSError or ValueError inside) where it cannot."""
        ray.get(self.actor.attach_peer.remote(index, address), timeout=START_TIMEOUT_S)
        self.shared_peers |= {index}
        self.transport.share(self)

    def detach(self) -> None:
        """Every copy goes through the transport from now on; the actor unmaps its peers' pools (after the
        steps sent before, in call order)."""
        if self.shared_peers and self.lost is None:
            self.actor.detach_peers.remote()
        self.shared_peers = frozenset()

    async def wait(self, handle: TransferHandle) -> None:
        """Copies have landed before a step's outcome is given; nothing to wait for."""

    async def recover(self, force: bool) -> None:
        """A lost actor, or (`force`) one stuck in a step, is killed and Ray starts a fresh one (on another node
        where its node is gone: until Ray marks that node dead, a fresh actor placed there dies, and is asked again)."""
        if self.lost is None and not force:
            return
        self.transport.fall_back(f"the {self.spec.name} unit's Ray actor is started again")
        for attempt in range(SPAWN_ATTEMPTS):
            self.kill()
            self.spawn()
            try:
                await asyncio.to_thread(self.wait_ready)
                return
            except RuntimeError:
                if attempt == SPAWN_ATTEMPTS - 1:
                    raise
                logger.warning("the %s unit's fresh Ray actor died while starting; asking again in %g s",
                               self.spec.name, SPAWN_RETRY_S)
                await asyncio.sleep(SPAWN_RETRY_S)

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except ray.exceptions.RayError:
            pass

    def close(self) -> None:
        self.kill()


class LeaseExpired(TimeoutError):
    pass


async def _leased(actor, ref):
    """`ref`'s value, waited for as long as `actor` answers a ping within LEASE_S whenever LEASE_S passes without
    the value. Raises Ray's error for `ref`, or LeaseExpired."""
    answer = asyncio.wrap_future(ref.future())
    try:
        while True:
            done, _ = await asyncio.wait({answer}, timeout=LEASE_S)
            if done:
                return answer.result()
            try:
                await asyncio.wait_for(asyncio.wrap_future(actor.ping.remote().future()), LEASE_S)
            except asyncio.TimeoutError:
                raise LeaseExpired(f"no answer to a ping within the {LEASE_S:g} s lease") from None
    finally:
        answer.cancel()


def first_line(error: BaseException) -> str:
    """`error`'s type and the first line of its message (log lines, error events)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
