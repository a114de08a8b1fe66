"""Defaults chosen from the machine it runs on: the devices and the dtype, each with its reason.

One home for these decisions; `pdserve.engine.units.layout.make_plan` asks here whenever an option is not given.

- Devices: CUDA when a GPU is visible (two or more: prefill on cuda:0, decode on cuda:1; one: both on
  cuda:0), else the CPU.
- CUDA dtype: bfloat16 on compute capability 8.0 or newer, else float16.
- CPU dtype: bfloat16 (or float16) only where the cores have units for it (the amx_* / avx512_*
  flags) *and* a start-up probe, one small matmul per candidate, finds it at least `MIN_SPEEDUP`
  faster than float32; float32 everywhere else. `probe` times any set of callables, so another
  candidate (a weight format, say) joins by adding one.
"""
from __future__ import annotations

import functools
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

MIN_SPEEDUP = 1.1                  # a narrower dtype must beat float32 by this much to be chosen
SCREEN_SHAPE = (8, 128, 128)       # tokens, in, out: 0.26 MFLOP, cheap even where a dtype is emulated
PROBE_SHAPE = (128, 256, 512)      # 34 MFLOP: quick where the CPU computes the dtype, long enough to time
PROBE_BUDGET_S = 0.05              # all candidates together; see probe()
PROBE_MAX_TURNS = 20
CLEARLY_SLOWER = 10.0              # after three turns, a candidate this much slower than the best drops out
HALF_UNITS = {"bfloat16": (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512_BF16")),
              "float16": (("amx_fp16", "AMX-FP16"), ("avx512_fp16", "AVX512_FP16"))}


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str                     # the model name /proc/cpuinfo reports
    isa: str                       # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    flags: frozenset[str]          # /proc/cpuinfo flags

    def units(self, dtype: str) -> str | None:
        """The name of the units that compute `dtype` natively (e.g. 'AMX'), or None."""
        return next((name for flag, name in HALF_UNITS.get(dtype, ()) if flag in self.flags), None)

    def describe(self) -> str:
        """'AVX2', 'AVX512 with AVX512_BF16', ...: what the dtype choice depends on."""
        extra = [u for u in dict.fromkeys(self.units(d) for d in HALF_UNITS) if u]
        return self.isa + (f" with {', '.join(extra)}" if extra else "")


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    capability: tuple[int, int]

    def describe(self) -> str:
        return f"cuda:{self.index} ({self.name}) is sm_{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True, slots=True)
class Choice:
    """A value picked for an option the user did not set, and why."""

    option: str                    # dtype | devices
    value: str
    reason: str

    def __str__(self) -> str:
        return f"{self.option} {self.value}: {self.reason}"


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    prefill: str
    decode: str
    reason: str

    def __str__(self) -> str:
        return f"devices prefill {self.prefill}, decode {self.decode}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    seconds: tuple[tuple[str, float], ...]    # (candidate, best time of one call), in probe order

    @classmethod
    def of(cls, seconds: Mapping[str, float]) -> "ProbeResult":
        return cls(tuple(seconds.items()))

    def time(self, name: str) -> float:
        return dict(self.seconds)[name]

    def speedup(self, name: str, over: str = "float32") -> float:
        """How many times faster `name` ran than `over` (below 1: slower)."""
        return self.time(over) / self.time(name)


def detect_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    fields = _cpuinfo_fields(cpuinfo)
    return CpuInfo(model=fields.get("model name") or platform.processor() or platform.machine(),
                   isa=torch.backends.cpu.get_cpu_capability(),
                   flags=frozenset(fields.get("flags", "").split()))


def visible_gpus() -> tuple[GpuInfo, ...]:
    if not torch.cuda.is_available():
        return ()
    return tuple(GpuInfo(i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
                 for i in range(torch.cuda.device_count()))


def choose_devices(gpus: Sequence[GpuInfo]) -> DeviceChoice:
    if len(gpus) >= 2:
        return DeviceChoice("cuda:0", "cuda:1", f"{len(gpus)} GPUs visible, one per phase")
    if gpus:
        return DeviceChoice("cuda:0", "cuda:0", "one GPU visible, both phases share it")
    return DeviceChoice("cpu", "cpu", "no GPU visible")


def choose_cuda_dtype(gpus: Sequence[GpuInfo]) -> Choice:
    """bfloat16 when every GPU in use is sm_80 or newer, else float16."""
    oldest = min(gpus, key=lambda g: g.capability)
    if oldest.capability >= (8, 0):
        return Choice("dtype", "bfloat16", f"{oldest.describe()}, bf16 is native from sm_80")
    return Choice("dtype", "float16", f"{oldest.describe()}, no bf16 before sm_80")


def choose_cpu_dtype(cpu: CpuInfo, measure: Callable[[Sequence[str]], ProbeResult] | None = None) -> Choice:
    """float32 unless a dtype with units on this CPU wins the probe by MIN_SPEEDUP (`measure` is injectable)."""
    candidates = ["float32", "bfloat16"] + (["float16"] if cpu.units("float16") else [])
    result = (measure or probe_matmul)(tuple(candidates))
    native = [d for d in candidates[1:] if cpu.units(d) and result.speedup(d) >= MIN_SPEEDUP]
    if native:
        best = max(native, key=result.speedup)
        return Choice("dtype", best, f"CPU has {cpu.describe()}; {_probe_phrase(best, result)}")
    if cpu.units("bfloat16"):
        return Choice("dtype", "float32", f"CPU has {cpu.describe()}; {_probe_phrase('bfloat16', result)}, "
                                          f"under the {MIN_SPEEDUP}x needed")
    return Choice("dtype", "float32", f"CPU has {cpu.isa}, no bf16 units; {_probe_phrase('bfloat16', result)}")


def choose_dtype(devices: Sequence[torch.device]) -> Choice:
    """The default dtype for a plan on `devices`: CUDA's rule when any is a GPU, else the CPU's."""
    indices = {d.index or 0 for d in devices if d.type == "cuda"}
    if not indices:
        return choose_cpu_dtype(detect_cpu())
    gpus = [g for g in visible_gpus() if g.index in indices]
    if len(gpus) < len(indices):
        raise ValueError(f"a device among {', '.join(map(str, devices))} is not one of the "
                         f"{len(visible_gpus())} visible GPUs")
    return choose_cuda_dtype(gpus)


def probe(candidates: Mapping[str, Callable[[], object]], clock: Callable[[], float] = time.perf_counter,
          budget_s: float = PROBE_BUDGET_S, max_turns: int = PROBE_MAX_TURNS) -> ProbeResult:
    """Best time of one call of each candidate, called in turns (so noise hits all alike) until
    `budget_s` is spent or `max_turns` are done; after three turns (the first pays warm-up costs) a candidate
    clearly slower than the best drops out (after two, one interrupted call beside the warm-up dropped bfloat16
    at a start). The budget spans several of the scheduler's time slices, so that one preemption on a shared
    core cannot slow every call of a candidate; `max_turns` ends a probe of short calls sooner."""
    best = dict.fromkeys(candidates, float("inf"))
    live, started = list(candidates), clock()
    for turn in range(max_turns):
        for name in live:
            best[name] = min(best[name], _time_call(candidates[name], clock))
        if turn >= 2:                                        # NOTE: turn 0 includes warm-up costs
            live = [n for n in live if best[n] <= CLEARLY_SLOWER * min(best.values())]
        if turn >= 2 and clock() - started > budget_s:
            break
    return ProbeResult.of(best)


def _time_call(call: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    call()
    return clock() - start


@functools.cache
def probe_matmul(dtypes: tuple[str, ...]) -> ProbeResult:
    """`probe` of one linear layer per dtype, on one thread of a short-lived thread, once per process.

    A tiny layer first screens out emulated dtypes (orders of magnitude slower) at little cost; the rest
    are timed on `PROBE_SHAPE`. A screened-out dtype keeps its tiny-layer ratio to float32.
    """
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        return pool.submit(_probe_matmul, dtypes).result()


def _probe_matmul(dtypes: tuple[str, ...]) -> ProbeResult:
    screen = probe(_matmuls(dtypes, SCREEN_SHAPE), max_turns=3)
    kept = [d for d in dtypes if d == "float32" or screen.speedup(d) * CLEARLY_SLOWER >= 1.0]
    full = probe(_matmuls(kept, PROBE_SHAPE))
    scale = full.time("float32") / screen.time("float32")
    return ProbeResult.of({d: full.time(d) if d in kept else screen.time(d) * scale for d in dtypes})


def _matmuls(dtypes: Sequence[str], shape: tuple[int, int, int]) -> dict[str, Callable[[], torch.Tensor]]:
    tokens, fan_in, fan_out = shape
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, fan_in, generator=generator), torch.randn(fan_out, fan_in, generator=generator)
    pairs = {name: (x.to(getattr(torch, name)), w.to(getattr(torch, name))) for name in dtypes}
    return {name: functools.partial(torch.nn.functional.linear, *pair) for name, pair in pairs.items()}


def _probe_phrase(dtype: str, result: ProbeResult) -> str:
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    speedup = result.speedup(dtype)
    if speedup >= 1.0:
        return f"{short} probe {speedup:.1f}x faster"
    slower = 1.0 / speedup
    return f"{short} probe {slower:.0f}x slower" if slower >= 10 else f"{short} probe {slower:.1f}x slower"


def _cpuinfo_fields(path: Path) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
