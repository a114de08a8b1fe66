"""The one build path of the native CPU kernels: C / C++ sources compiled for the running CPU, loaded with ctypes.

`load_native(name, sources)` compiles the sources into one shared library with the system compiler
(C++: `$CXX`, else g++ or c++; C: `$CC`, else cc) for this CPU (`-O3 -march=native`, OpenMP when the
compiler has it) into `$PDSERVE_CACHE/kernels/<name>-<key>.so`, keyed by the sources and the headers
beside them, the compiler and its flags and the CPU's flags; written under a temporary name and
renamed, so a second start loads it at once and a machine with other instructions builds its own.
Without a working compiler, or when the build fails, it returns None after one log line and callers
keep their torch path. OpenMP is the runtime torch loaded (same soname), so its threads are torch's.

Two libraries are built this way: `quant_linear.c` (kernels/quant_linear.py) and the C++ sources in
kernels/csrc (`cpu_kernels()`: attention, linear, RMSNorm, rotary + KV store, SiLU-and-mul), which
serve CPU tensors unless `set_cpu_kernels(False)` (the engine's `--cpu-kernels torch`).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve import env

logger = logging.getLogger(__name__)

OPTIMIZE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fno-math-errno")
BASE_FLAGS = (*OPTIMIZE_FLAGS, "-shared")
CXX_FLAGS = ("-std=c++17",)
COMPILE_TIMEOUT_S = 300
# NOTE: the slowest to compile first (a tile per block type, rows and batch), so a 2-core build does the rest beside it
CPU_KERNEL_SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp"),
                                  key=lambda path: (path.name != "gguf_linear.cpp", path.name)))
_LOCK = threading.Lock()
_cpu_state: dict[str, object] = {"enabled": True}


def cache_dir() -> Path:
    return env.cache_dir() / "kernels"


def load_native(name: str, sources: tuple[Path, ...]) -> ctypes.CDLL | None:
    """The library `name` compiled from `sources` (built on first use); None where it cannot be built."""
    with _LOCK:
        return _load(name, tuple(sources), _compiler(sources), str(cache_dir()))


def cpu_kernels() -> ctypes.CDLL | None:
    """The C++ kernels of kernels/csrc, built or loaded once per process; None where they cannot build."""
    if "library" not in _cpu_state:
        _cpu_state["library"] = load_native("cpu_kernels", CPU_KERNEL_SOURCES)
    return _cpu_state["library"]  # type: ignore[return-value]


def set_cpu_kernels(enabled: bool) -> None:
    """Serve CPU tensors with the C++ kernels (True, the default) or the torch references (False)."""
    _cpu_state["enabled"] = enabled


def cpu_kernels_enabled() -> bool:
    """True when the C++ kernels are switched on and built (PDSERVE_KERNELS: kernels.use_native)."""
    return bool(_cpu_state["enabled"]) and cpu_kernels() is not None


def _compiler(sources: tuple[Path, ...]) -> str:
    if any(path.suffix == ".cpp" for path in sources):
        return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
    return os.environ.get("CC", "cc")


@functools.cache
def _load(name: str, sources: tuple[Path, ...], compiler: str, cache: str) -> ctypes.CDLL | None:
    version = compiler_version(compiler) if shutil.which(compiler) else ""
    if not version:
        logger.warning("native kernels %s: no working compiler (%s); using the torch path", name, compiler)
        return None
    target = Path(cache) / f"{name}-{_build_key(sources, compiler, version)}.so"
    if not target.is_file():
        error = _compile(sources, compiler, target)
        if error:
            logger.warning("native kernels %s: build failed (%s); using the torch path", name, error)
            return None
        logger.info("native kernels %s built for this CPU: %s", name, target)
    return ctypes.CDLL(str(target))


def _build_key(sources: tuple[Path, ...], compiler: str, version: str) -> str:
    digest = hashlib.sha256()
    headers = {h for path in sources for h in path.parent.glob("*.h")}
    for path in sorted({*sources, *headers}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join((compiler, version, *BASE_FLAGS, *CXX_FLAGS, cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _compile(sources: tuple[Path, ...], compiler: str, target: Path) -> str:
    """Compile into `target` (atomically), with OpenMP where the compiler has it; '' or the error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    language = CXX_FLAGS if any(path.suffix == ".cpp" for path in sources) else ()
    error = ""
    for openmp in (("-fopenmp",), ()):
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as folder:
            library = Path(folder) / "library.so"
            error = _build(sources, compiler, (*language, *openmp), library)
            if not error:
                os.replace(library, target)
                _remove_stale(target)
                return ""
    return error


def _build(sources: tuple[Path, ...], compiler: str, flags: tuple[str, ...], library: Path) -> str:
    """Each source compiled on its own, as many at once as this process has cores, then linked into `library`
    (a first start waits for the build); '' or the first error."""
    objects = [library.with_name(f"{index}.o") for index in range(len(sources))]
    commands = [[compiler, *OPTIMIZE_FLAGS, *flags, "-c", str(source), "-o", str(obj)]
                for source, obj in zip(sources, objects)]
    with ThreadPoolExecutor(max(1, min(len(commands), len(os.sched_getaffinity(0))))) as pool:
        errors = [error for error in pool.map(_run_compiler, commands) if error]
    if errors:
        return errors[0]
    return _run_compiler([compiler, "-shared", *flags, *map(str, objects), "-o", str(library)])


def _run_compiler(command: list[str]) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{command[0]}: {exc}"
    if result.returncode == 0:
        return ""
    return f"{command[0]} exited {result.returncode}: {(result.stderr.strip().splitlines() or [''])[-1]}"


def _remove_stale(target: Path) -> None:
    """Other builds of the same library (older sources, another compiler); a process that mapped one keeps it."""
    name = target.name.rsplit("-", 1)[0]
    for stale in target.parent.glob(f"{name}-*.so"):
        if stale != target and stale.name.rsplit("-", 1)[0] == name:
            stale.unlink(missing_ok=True)


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


POINTER, INT64, INT, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SUFFIXES = {"torch.float32": "f32", "torch.bfloat16": "bf16"}


def bind(name: str, *argtypes) -> ctypes._CFuncPtr:
    """The C++ kernels' function `name`, declared with `argtypes` (returns void); cpu_kernels() must exist."""
    function = getattr(cpu_kernels(), name)
    function.argtypes, function.restype = argtypes, None
    return function


def int64_array(*values: int) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)
