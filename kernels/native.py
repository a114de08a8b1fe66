"""Build a C kernel once for the running CPU and load it with ctypes.

The shared library is compiled with the system C compiler (`$CC`, default `cc`) for this CPU
(`-march=native`, OpenMP when the compiler has it) into `$PDSERVE_CACHE/kernels`, keyed by the
source, the compiler and the CPU's flags, written under a temporary name and renamed, so a second
start loads it at once and a machine with other instructions builds its own. Without a working
compiler the loader returns None (logged once) and callers keep their torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120
_LOCK = threading.Lock()


def cache_dir() -> Path:
    # NOTE: engine.model.cache.cache_root's rule; kernels/ sits below engine/ and cannot import it
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve") / "kernels"


def cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {flags}"


def compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else ""


def load_native(source: Path) -> ctypes.CDLL | None:
    """The compiled library of `source` (built on first use); None where it cannot be built."""
    with _LOCK:
        return _load(source, os.environ.get("CC", "cc"), str(cache_dir()))


@functools.cache
def _load(source: Path, compiler: str, cache: str) -> ctypes.CDLL | None:
    version = compiler_version(compiler) if shutil.which(compiler) else ""
    if not version:
        logger.warning("native kernel %s: no working C compiler (%s); using the torch path", source.name, compiler)
        return None
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, version.encode(), cpu_flags().encode()])).hexdigest()[:16]
    target = Path(cache) / f"{source.stem}-{key}.so"
    if not target.is_file() and not _compile(source, compiler, target):
        return None
    return ctypes.CDLL(str(target))


def _compile(source: Path, compiler: str, target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = ""
    for extra in (("-fopenmp",), ()):                  # NOTE: OpenMP where the compiler has it
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        command = [compiler, *BASE_FLAGS, *extra, str(source), "-o", tmp]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
                                    check=False)
        except subprocess.TimeoutExpired:
            result = None
        if result is not None and result.returncode == 0:
            os.replace(tmp, target)
            logger.info("native kernel %s built for this CPU: %s", source.name, target)
            return True
        os.unlink(tmp)
        errors = result.stderr.strip().splitlines()[-1:] if result is not None else ["timed out"]
    logger.warning("native kernel %s: build failed (%s); using the torch path", source.name, " ".join(errors))
    return False
