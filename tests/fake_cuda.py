"""A fake CUDA runtime on CPU, to check which device every stream, event, graph and kernel launch uses.

`fake_cuda(monkeypatch, device_count)` replaces the `torch.cuda` calls pdserve makes with fakes that keep
CUDA's rules (a current device per thread, a current stream per thread and device, `set_stream` makes
the stream's device current, `torch.cuda.graph` without a stream captures on a side stream made on
the current device), while a TorchFunctionMode lets CPU tensors stand in for `cuda:N` tensors: a
tensor made with `device="cuda:1"` is a CPU tensor whose `.device` says cuda:1, and results of ops
on it say the same. Triton kernel launches are recorded (current device, current stream, the devices
of their tensor arguments, whether a capture is under way), not run: their outputs stay uninitialised.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import traceback
import types
from dataclasses import dataclass, field

import torch
import torch.multiprocessing.reductions  # noqa: F401  (install patches its reduce_tensor)
from torch.utils._pytree import tree_flatten

from tests.fake_devices import FakeDevices, is_cuda_device, storage_key

KERNEL_MODULES = ["pdserve.kernels.decode_attention", "pdserve.kernels.prefill_attention", "pdserve.kernels.store_kv",
                  "pdserve.kernels.rms_norm", "pdserve.kernels.rotary", "pdserve.kernels.activation",
                  "pdserve.kernels.gated_delta_triton"]


@dataclass(eq=False)
class FakeStream:
    """A stream with a vector clock: work queued on it happens after everything it waited for."""

    device: torch.device
    default: bool = False
    cuda_stream: int = field(default_factory=lambda: next(_STREAM_IDS))
    clock: dict = field(default_factory=dict)
    cuda: FakeCuda | None = None         # the runtime its synchronize() reports to

    def tick(self) -> dict:
        self.clock[self.cuda_stream] = self.clock.get(self.cuda_stream, 0) + 1
        return dict(self.clock)

    def wait_stream(self, other: FakeStream) -> None:
        _merge(self.clock, other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        assert event.clock is not None, "wait on an event never recorded"
        _merge(self.clock, event.clock)

    def synchronize(self) -> None:
        if self.cuda is not None:
            self.cuda.host_sync(f"stream.synchronize() on {self.device}")


def _merge(clock: dict, other: dict) -> None:
    for key, value in other.items():
        clock[key] = max(clock.get(key, 0), value)


_STREAM_IDS = itertools.count(1)
_IPC_EXPORTS: dict = {}          # handle key -> (exported tensor, runtime): what the fake driver can open
UNOPENABLE: set = set()          # handle keys whose open fails (a test adds them)


def open_ipc(key: int) -> torch.Tensor:
    """The fake cudaIpcOpenMemHandle: the exported tensor itself (the memory is shared)."""
    if key in UNOPENABLE or key not in _IPC_EXPORTS:
        raise RuntimeError("CUDA error: invalid resource handle (cudaIpcOpenMemHandle)")
    return _IPC_EXPORTS[key][0]


@dataclass(frozen=True)
class Launch:
    kernel: str
    current_device: int
    stream: FakeStream
    tensor_devices: frozenset
    capturing: bool


@dataclass(frozen=True)
class Copy:
    """A `copy_` queued on `stream` (the current stream of its CUDA side), with its vector clock."""

    stream: FakeStream
    clock: dict
    reads: tuple[int, int]       # [start, end) byte addresses
    writes: tuple[int, int]

    def happens_before(self, other: Copy) -> bool:
        me = self.stream.cuda_stream
        return self.clock[me] <= other.clock.get(me, 0)


def races(copies: list[Copy]) -> list[tuple[Copy, Copy]]:
    """Pairs of copies that touch the same bytes, one of them writing, with no order between them."""
    def overlap(a, b):
        return a[0] < b[1] and b[0] < a[1]

    found = []
    for i, first in enumerate(copies):
        for second in copies[i + 1:]:
            conflict = (overlap(first.writes, second.writes) or overlap(first.writes, second.reads)
                        or overlap(first.reads, second.writes))
            if conflict and not (first.happens_before(second) or second.happens_before(first)):
                found.append((first, second))
    return found


class FakeCuda:
    """State of the fake runtime; `launches`, `streams`, `events`, `graphs` record what was made and run."""

    def __init__(self, device_count: int) -> None:
        self.device_count = device_count
        self.local = threading.local()
        self.default_streams = {i: FakeStream(torch.device("cuda", i), default=True, cuda=self)
                                for i in range(device_count)}
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.graphs: list[FakeGraph] = []
        self.launches: list[Launch] = []
        self.copies: list[Copy] = []
        self.capturing: dict[int, FakeStream] = {}     # thread id -> capture stream
        self.free_memory = {i: 80 << 30 for i in range(device_count)}
        self.memory_stats = {"allocated": 1 << 30, "peak": 1 << 30, "reserved": 2 << 30}
        self.tags: dict = {}
        self.pinned: set = set()                       # storage keys of pinned host tensors
        self.syncs: list[str] = []                     # host syncs seen inside a step window
        self._windows = itertools.count(1)

    # host syncs: a step window is the stretch in which a thread must never wait for the device
    @contextlib.contextmanager
    def step_window(self):
        """Inside the block, this thread records (in `syncs`) every wait for work queued since it began."""
        previous = getattr(self.local, "window", None)
        self.local.window = next(self._windows)
        try:
            yield
        finally:
            self.local.window = previous

    @property
    def window(self) -> int | None:
        return getattr(self.local, "window", None)

    def host_sync(self, what: str) -> None:
        if self.window is not None:
            self.syncs.append(f"{what} at {_caller()}")

    # CUDA IPC: an exported tensor is "opened" by its handle; `unopenable` handles fail as a driver would
    def export_ipc(self, tensor: torch.Tensor):
        """Stands in for torch.multiprocessing.reductions.reduce_tensor of a CUDA tensor."""
        assert self.device_of(tensor).type == "cuda", "a CUDA IPC export of a host tensor"
        key = next(_STREAM_IDS)
        _IPC_EXPORTS[key] = (tensor, self)
        return open_ipc, (key,)

    # devices and streams, with CUDA's per-thread rules
    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, device) -> None:
        index = self.index(device)
        assert 0 <= index < self.device_count, f"cuda:{index} does not exist"
        self.local.device = index

    def index(self, device) -> int:
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            return device
        device = torch.device(device)
        assert device.type == "cuda", f"not a CUDA device: {device}"
        return self.current_device() if device.index is None else device.index

    def current_stream(self, device=None) -> FakeStream:
        streams = self.local.__dict__.setdefault("streams", {})
        index = self.index(device)
        return streams.get(index, self.default_streams[index])

    def set_stream(self, stream: FakeStream) -> None:
        self.local.__dict__.setdefault("streams", {})[stream.device.index] = stream
        self.local.device = stream.device.index       # NOTE: as torch._C._cuda_setStream does

    def new_stream(self, device=None, priority: int = 0) -> FakeStream:
        stream = FakeStream(torch.device("cuda", self.index(device)), cuda=self)
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def stream_context(self, stream: FakeStream | None):
        if stream is None:
            yield
            return
        source = self.current_stream()
        target_previous = self.current_stream(stream.device)
        self.set_stream(stream)
        try:
            yield
        finally:
            if source.device != stream.device:
                self.set_stream(target_previous)
            self.set_stream(source)

    @contextlib.contextmanager
    def device_context(self, device):
        previous = self.current_device()
        if device is not None and (not isinstance(device, int) or device >= 0):
            self.set_device(device)
        try:
            yield
        finally:
            self.local.device = previous

    # kernel launches
    def record_launch(self, name: str, args, kwargs) -> None:
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        capture = self.capturing.get(threading.get_ident())
        stream = self.current_stream()
        self.launches.append(Launch(name, self.current_device(), stream,
                                    frozenset(str(self.device_of(t)) for t in tensors),
                                    capture is not None and capture is stream))

    def record_copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        cuda_side = next((d for d in (self.device_of(source), self.device_of(target)) if d.type == "cuda"), None)
        if cuda_side is not None:
            stream = self.current_stream(cuda_side)
            self.copies.append(Copy(stream, stream.tick(), _span(source), _span(target)))

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        if tensor.device.type != "cpu":              # NOTE: called with the mode off: the real device
            return tensor.device
        index = self.tags.get(storage_key(tensor))
        return torch.device("cpu") if index is None else torch.device("cuda", index)


def _caller() -> str:
    """The innermost pdserve frame outside tests/ that led here."""
    for frame in reversed(traceback.extract_stack()):
        if "/tests/" not in frame.filename and ("/engine/" in frame.filename or "/kernels/" in frame.filename):
            return f"{'/'.join(frame.filename.split('/')[-2:])}:{frame.lineno}"
    return "?"


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    if not tensor.is_contiguous():          # NOTE: a strided view counts as its whole storage
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


@dataclass(eq=False)
class FakeEvent:
    cuda: FakeCuda
    enable_timing: bool = False
    blocking: bool = False
    device: torch.device | None = None
    stream: FakeStream | None = None
    clock: dict | None = None
    window: int | None = None        # the step window it was recorded in

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or self.cuda.current_stream()
        self.device = self.stream.device
        self.clock = dict(self.stream.clock)
        self.window = self.cuda.window

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        assert self.device is not None, "synchronize on an event never recorded"
        if self.window is not None and self.window == self.cuda.window:
            self.cuda.host_sync("event.synchronize() on an event of this step")

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.cuda.current_stream()).wait_event(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.device == end.device, f"elapsed_time between events on {self.device} and {end.device}"
        return 0.25


@dataclass(eq=False)
class FakeGraph:
    cuda: FakeCuda
    capture_device: int | None = None
    capture_stream: FakeStream | None = None
    replays: list = field(default_factory=list)

    def capture_begin(self, *pool, **options) -> None:
        self.capture_device = self.cuda.current_device()
        self.capture_stream = self.cuda.current_stream()
        self.cuda.capturing[threading.get_ident()] = self.capture_stream

    def capture_end(self) -> None:
        del self.cuda.capturing[threading.get_ident()]

    def replay(self) -> None:
        self.replays.append((self.cuda.current_device(), self.cuda.current_stream()))


class _Recorder:
    """Stands in for a Triton kernel object: `kernel[grid](...)` records the launch and runs nothing."""

    def __init__(self, cuda: FakeCuda, kernel) -> None:
        self.cuda, self.kernel = cuda, kernel

    def __getitem__(self, grid):
        name = getattr(self.kernel, "__name__", "kernel")
        return lambda *args, **kwargs: self.cuda.record_launch(name, args, kwargs)


def install(monkeypatch, device_count: int = 2) -> FakeCuda:
    """Patch torch.cuda (and the Triton kernels of kernels/) for the rest of the test; returns the state."""
    cuda = FakeCuda(device_count)
    fakes = {
        "is_available": lambda: True, "device_count": lambda: device_count,
        "current_device": cuda.current_device, "set_device": cuda.set_device, "device": cuda.device_context,
        "Stream": cuda.new_stream, "current_stream": cuda.current_stream, "set_stream": cuda.set_stream,
        "stream": cuda.stream_context, "Event": lambda **kw: _event(cuda, kw),
        "CUDAGraph": lambda *a, **kw: _graph(cuda), "graph_pool_handle": lambda: (0, next(_STREAM_IDS)),
        "synchronize": lambda device=None: cuda.host_sync("torch.cuda.synchronize()"), "empty_cache": lambda: None,
        "get_device_properties": lambda device=None: types.SimpleNamespace(
            multi_processor_count=132, total_memory=80 << 30, name="fake GPU", major=9, minor=0),
        "get_device_capability": lambda device=None: (9, 0),
        "can_device_access_peer": lambda device, peer: True,
        "mem_get_info": lambda device=None: (cuda.free_memory[cuda.index(device)], 80 << 30),
        "memory_allocated": lambda device=None: cuda.memory_stats["allocated"],
        "max_memory_allocated": lambda device=None: cuda.memory_stats["peak"],
        "memory_reserved": lambda device=None: cuda.memory_stats["reserved"],
        "reset_peak_memory_stats": lambda device=None: None,
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(torch, "Generator", _HostGenerator)
    monkeypatch.setattr(torch.multiprocessing.reductions, "reduce_tensor", cuda.export_ipc)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    for module in (sys.modules[name] for name in KERNEL_MODULES if name in sys.modules):
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") and attr.endswith("_kernel"):
                monkeypatch.setattr(module, attr, _Recorder(cuda, value))
    run = threading.Thread.run

    def run_with_fake_devices(thread):          # NOTE: torch function modes are per thread
        with FakeDevices(cuda):
            run(thread)

    monkeypatch.setattr(threading.Thread, "run", run_with_fake_devices)
    return cuda


@contextlib.contextmanager
def fake_cuda(monkeypatch, device_count: int = 2):
    """`install`, with the fake devices active in this thread until the block ends."""
    cuda = install(monkeypatch, device_count)
    with FakeDevices(cuda):
        yield cuda


class _HostGenerator(torch.Generator):
    """torch.Generator that makes a CPU generator where a CUDA one is asked for."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, "cpu" if is_cuda_device(device) else device)

    def __init__(self, device="cpu") -> None:
        pass


def _event(cuda: FakeCuda, options: dict) -> FakeEvent:
    event = FakeEvent(cuda, options.get("enable_timing", False), options.get("blocking", False))
    cuda.events.append(event)
    return event


def _graph(cuda: FakeCuda) -> FakeGraph:
    graph = FakeGraph(cuda)
    cuda.graphs.append(graph)
    return graph
