"""How a hand-off's KV blocks go from a prefill unit's Ray actor into a decode unit's pool.

`object-store` (the default): the prefill actor's `read_blocks` puts the bytes in its node's object
store and the decode actor's `write_blocks` pulls them (the reference handed to it inside a list, so no
call of the decode actor waits for it; see `pdserve.engine.ray.actor`).

`gloo` (`--ray-kv-transport gloo`): Ray Direct Transport. The prefill actor's `read_blocks_gloo`
returns the blocks as a tensor kept in the actor, and Ray sends it over one `torch_gloo` collective group
made over every unit's actor once all have started (set GLOO_SOCKET_IFNAME to the interface the nodes
reach each other on). The write is submitted only once the read has answered (a reference argument still
being produced would hold the decode actor's later calls, its steps included). Ray kills both actors of
an RDT transfer that fails, and a group takes no fresh actor in (each actor's torch.distributed world is
fixed when the group is made): after any unit's restart, and where the group cannot be made, the engine
copies through the object store, with a warning.

A prefill unit whose actor maps a same-node decode unit's pool (`pdserve.engine.ray.shared`) copies into
it inside its step; the transport takes only its other copies, and after any restart all of them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)
OBJECT_STORE, GLOO = "object-store", "gloo"
NAMES = (OBJECT_STORE, GLOO)


@dataclass(frozen=True, slots=True)
class Sending:
    """One copy under way: `read` answers once the source has read the blocks (lease it on the source);
    `write()` gives the reference to the bytes the destination stored, to be called once `read` answered."""

    read: ray.ObjectRef
    write: Callable[[], ray.ObjectRef]


class KVTransport:
    """The transport every unit of one engine copies with (mutable: it falls back to the object store)."""

    def __init__(self, name: str = OBJECT_STORE) -> None:
        if name not in NAMES:
            raise ValueError(f"--ray-kv-transport must be one of {', '.join(NAMES)}, got {name!r}")
        self.configured = self.name = name
        self.group = None
        self.sharing: list = []          # the RayCompute units whose actors copy into same-node peers' pools

    def connect(self, actors: list) -> None:
        """Make the gloo group over `actors` (every unit's, started); the object store where it cannot be made."""
        if self.name != GLOO or len(actors) < 2:
            return
        from ray.experimental.collective import create_collective_group

        try:
            self.group = create_collective_group(actors, backend="torch_gloo")
        except Exception as e:                  # NOTE: whatever the cause, the object store still works
            self.fall_back(f"the gloo collective group could not be made: {type(e).__name__}: {e}")
            return
        logger.info("KV between Ray units: Ray Direct Transport over gloo (%d actors)", len(actors))

    def share(self, unit) -> None:
        """`unit`'s actor copies into a same-node peer's pool itself, until `fall_back`."""
        if unit not in self.sharing:
            self.sharing.append(unit)

    def fall_back(self, why: str) -> None:
        """Every copy goes through the object store from now on (a restarted actor joins no gloo group and
        has a pool of its own): each sharing unit's actor unmaps its peers' pools."""
        if self.name != OBJECT_STORE or self.sharing:
            logger.warning("KV between Ray units goes through the object store from now on: %s", why)
        self.name = OBJECT_STORE
        for unit in self.sharing:
            unit.detach()
        self.sharing = []

    def send(self, src_actor, dst_actor, src: list[int], dst: list[int]) -> Sending:
        """Start copying blocks `src` of `src_actor`'s pool into blocks `dst` of `dst_actor`'s."""
        if self.name == GLOO:
            tensor = src_actor.read_blocks_gloo.remote(src)
            read = src_actor.fence.remote()       # NOTE: answers after the read, in call order, without its bytes
            return Sending(read, lambda: dst_actor.write_blocks_gloo.remote(dst, tensor))
        data, read = src_actor.read_blocks.remote(src)
        written = dst_actor.write_blocks.remote(dst, [data])    # NOTE: in a list: no call of dst waits for it
        return Sending(read, lambda: written)
