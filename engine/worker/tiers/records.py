"""A tier record's header: what a block's bytes are, whose they are, and the checksum they must match.

Every block written to a tier carries one: its prefix-cache hash, the validity key (a digest of everything
that makes KV bytes valid for this server: `validity_key`), its length, the CRC-32 of its bytes and when it
was written; a CRC-32 of the header itself closes it. A load reads nothing that does not match all of them.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

from pdserve.engine.model.cache import pdserve_version

FORMAT = 1                       # the record layout; any change makes older records unreadable, never misread
MAGIC = b"PDKV"
_FIELDS = struct.Struct("<4sHH32s32sQIQ")     # magic, format, flags, key, hash, bytes, CRC-32, written (ns)
_CLOSE = struct.Struct("<I")                   # CRC-32 of the fields
HEADER_BYTES = 128
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


class Record(NamedTuple):
    digest: bytes
    nbytes: int
    crc: int
    written_ns: int


def checksum(data) -> int:
    """CRC-32 of a buffer (bytes, memoryview, a contiguous uint8 array)."""
    return zlib.crc32(data)


def pack_header(key: bytes, record: Record) -> bytes:
    fields = _FIELDS.pack(MAGIC, FORMAT, 0, key, record.digest, record.nbytes, record.crc, record.written_ns)
    return (fields + _CLOSE.pack(zlib.crc32(fields))).ljust(HEADER_BYTES, b"\0")


def unpack_header(raw: bytes, key: bytes) -> Record | None:
    """The record `raw` describes, or None unless it is whole, of this format and under `key`."""
    if len(raw) < _FIELDS.size + _CLOSE.size:
        return None
    fields = raw[:_FIELDS.size]
    (closing,) = _CLOSE.unpack_from(raw, _FIELDS.size)
    if zlib.crc32(fields) != closing:
        return None
    magic, version, _, record_key, digest, nbytes, crc, written = _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT or record_key != key:
        return None
    return Record(digest, nbytes, crc, written)


def is_blank(raw: bytes) -> bool:
    """A header never written (or invalidated before a write): not a record, and not a bad one."""
    return not any(raw[:_FIELDS.size])


def validity_key(parts: dict) -> bytes:
    """The key of `parts` (everything that makes a block's bytes valid), with the record format and pdserve's
    version added: a record under another key is ignored, never read."""
    whole = parts | {"format": FORMAT, "pdserve": pdserve_version()}
    return hashlib.sha256(json.dumps(whole, sort_keys=True, default=str).encode()).digest()


def model_files(model_dir: Path | None) -> list:
    """The model's files: config.json's bytes, and each weight file's name, size and modification time."""
    if model_dir is None:
        return []
    config = model_dir / "config.json"
    parts = [hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else ""]
    for path in sorted(model_dir.iterdir()):
        if path.suffix in WEIGHT_SUFFIXES:
            stat = path.stat()
            parts.append([path.name, stat.st_size, stat.st_mtime_ns])
    return parts
