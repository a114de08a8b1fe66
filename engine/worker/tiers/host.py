"""The host tier's bytes: `num_slots` blocks and their record headers in one buffer of host memory (pinned
where CUDA copies read or fill it; a memfd segment where worker processes share it)."""
from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.worker.tiers.records import HEADER_BYTES, Record, checksum, pack_header, unpack_header

ALIGN = 4096


def host_tier_bytes(num_slots: int, block_bytes: int) -> int:
    """The buffer a host tier of `num_slots` blocks takes."""
    return _blocks_offset(num_slots) + num_slots * block_bytes


def host_tier_slots(budget: int, block_bytes: int) -> int:
    """The blocks a host tier of `budget` bytes holds."""
    slots = budget // (block_bytes + HEADER_BYTES)
    while slots and host_tier_bytes(slots, block_bytes) > budget:
        slots -= 1
    return slots


def _blocks_offset(num_slots: int) -> int:
    return -(-num_slots * HEADER_BYTES // ALIGN) * ALIGN


class HostTier:
    """`buffer` (flat uint8, `host_tier_bytes` long) as slots; records under `key` only."""

    name = "host"

    def __init__(self, buffer: torch.Tensor, num_slots: int, block_bytes: int, key: bytes) -> None:
        if buffer.numel() != host_tier_bytes(num_slots, block_bytes) or buffer.dtype != torch.uint8:
            raise ValueError(f"a host tier of {num_slots} blocks needs {host_tier_bytes(num_slots, block_bytes)} "
                             f"bytes, got {buffer.numel()} of {buffer.dtype}")
        self.buffer, self.num_slots, self.block_bytes, self.key = buffer, num_slots, block_bytes, key
        array = buffer.numpy()
        offset = _blocks_offset(num_slots)
        self.headers = array[:num_slots * HEADER_BYTES].reshape(num_slots, HEADER_BYTES)
        self.blocks = array[offset:].reshape(num_slots, block_bytes)
        self.block_tensors = buffer[offset:].view(num_slots, block_bytes)    # the same bytes, for device copies

    @classmethod
    def allocate(cls, num_slots: int, block_bytes: int, key: bytes, pin: bool = False) -> HostTier:
        """A tier in this process's memory: its headers blank, its blocks' pages taken only as they are written
        (unless pinned)."""
        buffer = torch.empty(host_tier_bytes(num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        buffer[:_blocks_offset(num_slots)].zero_()
        return cls(buffer, num_slots, block_bytes, key)

    def write(self, slot: int, digest: bytes, data: np.ndarray, crc: int, written_ns: int) -> None:
        """The block `data` into `slot`: its header is blank until its bytes are whole."""
        self.headers[slot] = 0
        self.blocks[slot] = data
        self.headers[slot] = np.frombuffer(pack_header(self.key, Record(digest, self.block_bytes, crc, written_ns)),
                                           dtype=np.uint8)

    def read_into(self, slot: int, digest: bytes, out: np.ndarray) -> bool:
        """Copy `slot`'s block into `out`; True only when its record is `digest`'s and the bytes match its CRC."""
        record = self.record(slot, digest)
        if record is None:
            return False
        out[:] = self.blocks[slot]
        return checksum(out) == record.crc

    def record(self, slot: int, digest: bytes) -> Record | None:
        """`slot`'s header if it is a whole record of `digest`'s block, else None."""
        record = unpack_header(self.headers[slot].tobytes(), self.key)
        return record if record is not None and record.digest == digest and record.nbytes == self.block_bytes \
            else None

    def forget(self, slot: int) -> None:
        self.headers[slot] = 0

    def close(self) -> None:
        """Nothing to release: the buffer goes with its last reference."""
