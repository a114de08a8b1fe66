"""The unit layout as data: start-up turns the options into a Layout, one UnitSpec per unit; a builder
(`engine.units.threads`, `engine.units.processes`, `engine.ray.units`, `engine.sim.units`) then makes a
compute unit of each spec."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One unit: what it runs as, where, on which cores, and its part of its device's KV budget."""

    role: str                       # prefill | decode | colocated
    index: int                      # its place among the units of its role
    name: str                       # prefill, decode1, colocated0, ...: logs, metrics, PDSERVE_FAULT
    device: torch.device
    cores: tuple[int, ...]          # the CPU cores its steps run on (() off the CPU)
    thread_counts: tuple[int, ...]  # the CPU thread counts its steps may take (several where cores are lent)
    warmup_role: str                # what it is warmed up and profiled for (an adaptive decode unit prefills too)
    pool_share: float               # its share of its device's KV budget (`engine.units.pools`)
    pool_cap: int                   # the most KV blocks it can use
    graph_batch: int = 0            # CUDA graphs for decode batches up to this size (0: none)

    @property
    def decodes(self) -> bool:
        """Whether it runs decode steps (decode and colocated units)."""
        return self.role != "prefill"


@dataclass(frozen=True, slots=True)
class CoreShare:
    """The CPU threads of two units that lend each other their cores (one prefill and one decode unit)."""

    prefill_own: int
    decode_own: int

    @property
    def total(self) -> int:
        return self.prefill_own + self.decode_own


@dataclass(frozen=True, slots=True)
class StepBuffers:
    """The sizes a runner's step buffers start at (they grow when a step needs more)."""

    blocks_per_seq: int             # a block table row: the longest sequence's blocks
    tokens: int                     # a step's tokens: a full prefill step and a full decode batch
    seqs: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Decisions made once at start-up: the units, the serving dtype, the context window, core lending."""

    units: tuple[UnitSpec, ...]     # prefill units first, then the units that decode, each by index
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    buffers: StepBuffers
    lending: CoreShare | None = None
    window_seqs: int = 0            # a split_window model keeps its sliding layers' K and V in window slots for
    #                                 this many sequences per unit (0: every block holds every layer)

    def of(self, role: str) -> tuple[UnitSpec, ...]:
        return tuple(spec for spec in self.units if spec.role == role)

    @property
    def prefill(self) -> tuple[UnitSpec, ...]:
        return self.of("prefill")

    @property
    def decoding(self) -> tuple[UnitSpec, ...]:
        """The units that decode: decode units, or colocated ones."""
        return tuple(spec for spec in self.units if spec.decodes)

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(dict.fromkeys(spec.device for spec in self.units))

    def own_threads(self, spec: UnitSpec) -> int:
        """The CPU threads `spec`'s steps take while its partner works: its cores, or where cores are lent its
        role's own share of them."""
        if self.lending is not None:
            return self.lending.prefill_own if spec.role == "prefill" else self.lending.decode_own
        return max(len(spec.cores), 1)

    @property
    def cores(self) -> tuple[int, ...]:
        """Every CPU core a unit steps on."""
        return tuple(sorted({core for spec in self.units for core in spec.cores}))


def unit_names(role: str, count: int) -> list[str]:
    """`prefill` for a role's only unit, else `prefill0`, `prefill1`, ... (logs, metrics, PDSERVE_FAULT)."""
    return [role] if count == 1 else [f"{role}{i}" for i in range(count)]


def parse_devices(spec: str) -> tuple[torch.device, ...]:
    """A --prefill-device / --decode-device value: one device per unit, comma-separated (`cpu,cpu`, `cuda:0,cuda:1`)."""
    names = [name.strip() for name in spec.split(",")]
    if not all(names):
        raise ValueError(f"a device list names one device per unit, comma-separated; got {spec!r}")
    return tuple(torch.device(name) for name in names)


def deal_cores(cores: tuple[int, ...], devices: tuple[torch.device, ...]) -> tuple[tuple[int, ...], ...]:
    """Split `cores` between the CPU units of `devices` (contiguous, as even as possible; fewer cores than
    units: they share, round robin); a GPU unit gets none."""
    cpu = [i for i, device in enumerate(devices) if device.type == "cpu"]
    dealt: list[tuple[int, ...]] = [()] * len(devices)
    if len(cores) < len(cpu):
        for n, i in enumerate(cpu):
            dealt[i] = (cores[n % len(cores)],) if cores else ()
        return tuple(dealt)
    start = 0
    for n, i in enumerate(cpu):
        size = len(cores) // len(cpu) + (n < len(cores) % len(cpu))
        dealt[i], start = cores[start:start + size], start + size
    return tuple(dealt)
