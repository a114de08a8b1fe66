"""The native CPU kernels: the C++ sources in kernels/csrc, built once per machine into one shared library.

The build uses the system C++ compiler ($CXX, else g++ or c++) with -O3 -march=native -fopenmp, so
it targets the CPU it runs on (AVX2, AVX-512, ...); it is cached under $PDSERVE_CACHE/native/, keyed
by the sources, the compiler and the CPU's flags, and takes a few seconds the first time. The library
links the OpenMP runtime torch already loaded (same soname), so its threads are torch's threads.
Where there is no compiler, or the build fails, `library()` returns None after one log line and the
plain-torch references serve the CPU. `set_enabled(False)` (the engine's `--cpu-kernels torch`) or
PDSERVE_KERNELS=torch turns the native path off.
"""
from __future__ import annotations

import ctypes
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

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")

_lock = threading.Lock()
_state: dict[str, object] = {"enabled": True}


def set_enabled(enabled: bool) -> None:
    """Use (True, the default) or bypass (False) the native kernels for CPU tensors in this process."""
    _state["enabled"] = enabled


def enabled() -> bool:
    """True when the native kernels are switched on and the library built (PDSERVE_KERNELS: kernels.use_native)."""
    return bool(_state["enabled"]) and library() is not None


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first call, then cached on disk); None where they cannot be built."""
    if "library" not in _state:
        with _lock:
            if "library" not in _state:
                _state["library"] = _load()
    return _state["library"]  # type: ignore[return-value]


def _load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("native CPU kernels unavailable (no C++ compiler found); using the torch references")
        return None
    target = _cache_dir() / f"pdkernels-{_build_key(compiler)}.so"
    if not target.exists():
        error = _build(compiler, target)
        if error:
            logger.warning("native CPU kernels unavailable (%s); using the torch references", error)
            return None
    return ctypes.CDLL(str(target))


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.[ch]*")):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join((compiler, *FLAGS, _compiler_version(compiler), _cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _build(compiler: str, target: Path) -> str | None:
    """Compile into `target` (atomically); an error message, or None on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    command = [compiler, *FLAGS, *map(str, _sources()), "-o", scratch]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(scratch)
        return f"{compiler} failed to run: {exc}"
    if result.returncode != 0:
        os.unlink(scratch)
        last_line = (result.stderr.strip().splitlines() or [""])[-1]
        return f"{compiler} exited {result.returncode}: {last_line}".rstrip(": ")
    os.replace(scratch, target)
    for stale in target.parent.glob("pdkernels-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)     # NOTE: a process that mapped it keeps its copy
    logger.info("built the native CPU kernels: %s", target)
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve") / "native"


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


POINTER, INT64, INT, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SUFFIXES = {"torch.float32": "f32", "torch.bfloat16": "bf16"}


def bind(name: str, *argtypes) -> ctypes._CFuncPtr:
    """The library's function `name`, declared with `argtypes` (returns void); the library must exist."""
    function = getattr(library(), name)
    function.argtypes, function.restype = argtypes, None
    return function


def int64_array(*values: int) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)
