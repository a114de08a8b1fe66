"""The disk tier's bytes: one file per validity key, `kv-<key>.tier` in the tier's folder.

Layout: a meta page (what the file holds: format, key, slots, block bytes), then every slot's record header,
then the slots' blocks, each on its own page boundary. A write blanks the slot's header, writes the block,
then the header, so a crash at any point leaves a blank header or one whose CRC the bytes fail. The server
that owns the file holds an exclusive lock on it while it runs (a second server on the same folder and model
is refused); its worker processes open it without one.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

import numpy as np

from pdserve.engine.worker.tiers.records import (
    FORMAT,
    HEADER_BYTES,
    Record,
    checksum,
    is_blank,
    pack_header,
    unpack_header,
)

logger = logging.getLogger(__name__)

PAGE = 4096
_BLANK = bytes(HEADER_BYTES)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def disk_tier_bytes(num_slots: int, block_bytes: int) -> int:
    return PAGE + _pages(num_slots * HEADER_BYTES) + num_slots * _pages(block_bytes)


def disk_tier_slots(budget: int, block_bytes: int) -> int:
    """The blocks a disk tier file of at most `budget` bytes holds."""
    slots = max((budget - PAGE) // (_pages(block_bytes) + HEADER_BYTES), 0)
    while slots and disk_tier_bytes(slots, block_bytes) > budget:
        slots -= 1
    return slots


def tier_file(folder: Path, key: bytes) -> Path:
    return Path(folder) / f"kv-{key.hex()[:24]}.tier"


class DiskTier:
    """One open tier file of `num_slots` blocks of `block_bytes` under `key`."""

    name = "disk"

    def __init__(self, path: Path, num_slots: int, block_bytes: int, key: bytes, fd: int) -> None:
        self.path, self.num_slots, self.block_bytes, self.key, self.fd = Path(path), num_slots, block_bytes, key, fd
        self._headers = PAGE
        self._blocks = PAGE + _pages(num_slots * HEADER_BYTES)
        self._stride = _pages(block_bytes)

    @classmethod
    def open(cls, path: Path, num_slots: int, block_bytes: int, key: bytes) -> DiskTier:
        """The file as another process of the owning server opens it (no lock, no check: the owner made it)."""
        return cls(path, num_slots, block_bytes, key, os.open(path, os.O_RDWR | os.O_CLOEXEC))

    @classmethod
    def own(cls, folder: Path, num_slots: int, block_bytes: int, key: bytes) -> DiskTier:
        """Open (or make) the file for `key` in `folder`, locked for this server; one made for another size or
        unreadable is started again, empty. Raises ValueError when another server holds it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = tier_file(folder, key)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"--kv-offload-disk: {path} is in use by another pdserve server; give each server "
                             "its own folder") from None
        tier = cls(path, num_slots, block_bytes, key, fd)
        if tier._meta() != tier._expected_meta():
            if os.fstat(fd).st_size:
                logger.warning("disk tier %s was written for another size or format: started again, empty", path)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(tier._expected_meta()).encode().ljust(PAGE, b" "), 0)
        if os.fstat(fd).st_size != disk_tier_bytes(num_slots, block_bytes):
            os.ftruncate(fd, disk_tier_bytes(num_slots, block_bytes))    # NOTE: a truncated file's cut reads as zeros
        return tier

    def _expected_meta(self) -> dict:
        return {"pdserve-kv-tier": FORMAT, "key": self.key.hex(), "slots": self.num_slots,
                "block_bytes": self.block_bytes}

    def _meta(self) -> dict | None:
        try:
            return json.loads(os.pread(self.fd, PAGE, 0).decode())
        except (ValueError, UnicodeDecodeError):
            return None

    def scan(self) -> tuple[list[tuple[int, bytes]], int]:
        """(slot, hash) of every whole record, oldest written first (the newest of two with one hash kept), and
        the number of headers that are neither blank nor whole (dropped: blanked)."""
        raw = os.pread(self.fd, self.num_slots * HEADER_BYTES, self._headers)
        found: dict[bytes, tuple[int, int]] = {}
        bad = 0
        for slot in range(len(raw) // HEADER_BYTES):
            header = raw[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES]
            if is_blank(header):
                continue
            record = unpack_header(header, self.key)
            if record is None or record.nbytes != self.block_bytes:
                bad += 1
                self.forget(slot)
                continue
            if record.digest not in found or found[record.digest][0] < record.written_ns:
                found[record.digest] = (record.written_ns, slot)
        return [(slot, digest) for digest, (_, slot) in sorted(found.items(), key=lambda item: item[1])], bad

    def write(self, slot: int, digest: bytes, data: np.ndarray, crc: int, written_ns: int) -> None:
        """The block `data` into `slot` (its header blank until its bytes are written); raises OSError."""
        header = self._headers + slot * HEADER_BYTES
        os.pwrite(self.fd, _BLANK, header)
        if os.pwrite(self.fd, memoryview(data), self._blocks + slot * self._stride) != self.block_bytes:
            raise OSError(f"short write to {self.path}")
        os.pwrite(self.fd, pack_header(self.key, Record(digest, self.block_bytes, crc, written_ns)), header)

    def read_into(self, slot: int, digest: bytes, out: np.ndarray) -> bool:
        """Read `slot`'s block into `out`; True only when its record is `digest`'s and the bytes match its CRC (a
        record that fails is blanked, so it is not found again)."""
        try:
            record = unpack_header(os.pread(self.fd, HEADER_BYTES, self._headers + slot * HEADER_BYTES), self.key)
            if record is None or record.digest != digest or record.nbytes != self.block_bytes:
                return False
            whole = os.preadv(self.fd, [memoryview(out)], self._blocks + slot * self._stride) == self.block_bytes
            if whole and checksum(out) == record.crc:
                return True
            self.forget(slot)
        except OSError as e:
            logger.warning("disk tier %s: reading slot %d failed: %s", self.path, slot, e)
        return False

    def forget(self, slot: int) -> None:
        try:
            os.pwrite(self.fd, _BLANK, self._headers + slot * HEADER_BYTES)
        except OSError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.fsync(self.fd)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1
