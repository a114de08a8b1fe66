"""pdserve's cache folder, and building a folder in it exactly once.

Generated checkpoints (the demo models, converted GGUF files) live in $PDSERVE_CACHE
(default ~/.cache/pdserve). Each is built in a temporary folder beside its final place and
renamed into place, so a reader never sees a half-written folder and an interrupted build
leaves nothing behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pdserve import env


def cache_root() -> Path:
    """$PDSERVE_CACHE, or ~/.cache/pdserve."""
    return env.cache_dir()


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
