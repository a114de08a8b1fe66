"""pdserve's cache folder, building a folder in it exactly once, and answers kept in it across starts.

Generated checkpoints (the demo models, converted GGUF files) live in $PDSERVE_CACHE
(default ~/.cache/pdserve). Each is built in a temporary folder beside its final place and
renamed into place, so a reader never sees a half-written folder and an interrupted build
leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from pdserve import env

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """$PDSERVE_CACHE, or ~/.cache/pdserve."""
    return env.cache_dir()


def pdserve_version() -> str:
    """The installed pdserve's version ("unknown" where it is run from a checkout without installing it)."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, calling `build(tmp_dir)` to fill it first if it does not exist yet.

    Concurrent callers are safe: the first rename wins and the others' work is discarded.
    Any exception from `build` propagates, with its temporary folder removed.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # NOTE: losing the rename race is fine; any other failure is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class KeptAnswer:
    """A JSON document kept in `root/folder/` under a key of everything it depends on: `load()` gives the one
    written under the same key and format (None otherwise), `save(doc)` writes it atomically (a folder that cannot
    be written is logged, and the next start measures again)."""

    def __init__(self, folder: str, key: dict, format: int, root: Path) -> None:
        self.key, self.format = key, format
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        self.path = root / folder / f"{digest}.json"

    def load(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("format") == self.format and data.get("key") == self.key else None

    def save(self, doc: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": self.format, "key": self.key, **doc}))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("%s not kept (%s): the next start measures again", self.path.parent.name, e)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
