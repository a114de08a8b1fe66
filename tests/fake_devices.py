"""CPU tensors that say they are on cuda:N, for `tests.fake_cuda`.

A tensor made with `device="cuda:1"` (or moved there) is a CPU tensor whose storage is tagged with
device 1; `.device`, `.is_cuda` and `.get_device()` report the tag, and the results of ops on tagged
tensors are tagged the same. Every `copy_` is handed to the fake runtime, which records its stream.
Pinned host tensors are remembered, and every op that would make the host wait for a real GPU
(`host_sync_of`: reading a device value, a data-dependent shape, a copy from or into pageable host
memory, a blocking copy) is reported to the runtime's step window (`FakeCuda.host_sync`).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map


def storage_key(tensor: torch.Tensor):
    """What identifies a tensor's memory: its storage address, or the tensor itself when it has none."""
    ptr = tensor.untyped_storage().data_ptr()
    return ptr if ptr else ("id", id(tensor))


class FakeDevices(TorchFunctionMode):
    """CPU tensors that say they are on cuda:N (see the module docstring)."""

    def __init__(self, cuda) -> None:          # cuda: tests.fake_cuda.FakeCuda
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:
            return func(*args, **kwargs)
        if func in (torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.get_device):
            return self._device_query(func, args[0])
        if func is torch.Tensor.is_pinned:
            return storage_key(args[0]) in self.cuda.pinned
        if func is torch.Tensor.pin_memory:
            return self._pin(args[0].clone())
        pinned = kwargs.pop("pin_memory", False)
        if self.cuda.window is not None:
            sync = host_sync_of(func, args, kwargs, self.cuda)
            if sync is not None:
                self.cuda.host_sync(sync)
        target, args, kwargs = self._target(func, args, kwargs)
        if func is torch.Tensor.copy_:
            self.cuda.record_copy(args[0], args[1])
        out = func(*args, **kwargs)
        if func is not torch.Tensor.copy_:
            for tensor in (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
                self._tag(tensor, target)
        return self._pin(out) if pinned else out

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        self.cuda.pinned.add(storage_key(tensor))
        return tensor

    def _device_query(self, func, tensor):
        device = self.cuda.device_of(tensor)
        if func is torch.Tensor.is_cuda.__get__:
            return device.type == "cuda"
        if func is torch.Tensor.get_device:
            return -1 if device.index is None else device.index
        return device

    def _target(self, func, args, kwargs):
        """(fake device index of the result or None, args and kwargs with CUDA devices made 'cpu')."""
        requested = []

        def strip(value):
            if isinstance(value, (torch.device, str)) and is_cuda_device(value):
                requested.append(self.cuda.index(value))
                return "cpu"
            return value

        args, kwargs = tree_map(strip, args), tree_map(strip, kwargs)
        if requested:
            return requested[0], args, kwargs
        if func in (torch.Tensor.cpu, torch.Tensor.numpy) or any(map(_is_cpu, (kwargs.get("device"), *args[1:2]))):
            return None, args, kwargs
        tagged = [self.cuda.tags.get(storage_key(t)) for t in tree_flatten(args)[0]
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        return next((index for index in tagged if index is not None), None), args, kwargs

    def _tag(self, tensor: torch.Tensor, index: int | None) -> None:
        if tensor.device.type != "cpu":
            return
        if index is None:
            self.cuda.tags.pop(storage_key(tensor), None)
        else:
            self.cuda.tags[storage_key(tensor)] = index


def is_cuda_device(value) -> bool:
    return _device_type(value) == "cuda"


def _is_cpu(value) -> bool:
    return _device_type(value) == "cpu"


def _device_type(value) -> str | None:
    if not isinstance(value, (torch.device, str)):
        return None
    try:
        return torch.device(value).type
    except (RuntimeError, TypeError):
        return None


_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}
_DATA_DEPENDENT = {torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
                   torch.unique, torch.Tensor.unique, torch.argwhere}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put,
             torch.index_put}


def host_sync_of(func, args, kwargs, cuda) -> str | None:
    """What makes the host wait for the GPU in `func(*args, **kwargs)` on a real device, or None."""
    name = getattr(func, "__name__", str(func))
    on_cuda = lambda t: isinstance(t, torch.Tensor) and cuda.device_of(t).type == "cuda"  # noqa: E731
    if func in _READS and args and on_cuda(args[0]):
        return f"{name}() of a device tensor"
    if func in _DATA_DEPENDENT and args and on_cuda(args[0]):
        return f"{name}() (a data-dependent shape)"
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs \
            and any(map(on_cuda, args)):
        return "repeat_interleave without output_size"
    if func in _INDEXING and args and on_cuda(args[0]):
        return _indexing_sync(name, args[1] if len(args) > 1 else kwargs.get("indices"), cuda, on_cuda)
    if func is torch.Tensor.copy_:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return _copy_sync(args[0], args[1], non_blocking, cuda, on_cuda)
    if func in (torch.tensor, torch.as_tensor) and _wants_cuda(args, kwargs):
        return f"torch.{name}(host data, device=cuda): a copy from pageable memory"
    if func in (torch.Tensor.to, torch.Tensor.cuda) and args:
        moved = _wants_cuda(args[1:], kwargs) or func is torch.Tensor.cuda
        if moved and not on_cuda(args[0]):
            ok = storage_key(args[0]) in cuda.pinned and kwargs.get("non_blocking", False)
            return None if ok else ".to(cuda) from pageable memory or blocking"
        if on_cuda(args[0]) and any(map(_is_cpu, (*args[1:2], kwargs.get("device")))):
            return ".to(cpu) of a device tensor"
    return None


def _indexing_sync(name, index, cuda, on_cuda) -> str | None:
    for part in tree_flatten(index)[0] if isinstance(index, (tuple, list)) else [index]:
        if isinstance(part, torch.Tensor) and part.dtype == torch.bool and part.dim() > 0:
            return f"{name} with a boolean mask (a data-dependent shape)"
        if isinstance(part, torch.Tensor) and not on_cuda(part) and part.dim() > 0:
            return f"{name} with a host index tensor (a pageable copy)"
    if isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(p, list) for p in index)):
        return f"{name} with a Python list index (a pageable copy)"
    return None


def _copy_sync(target, source, non_blocking, cuda, on_cuda) -> str | None:
    if on_cuda(source) and not on_cuda(target):
        pinned = storage_key(target) in cuda.pinned
        return None if pinned and non_blocking else "copy_ device -> host, blocking or into pageable memory"
    if on_cuda(target) and not on_cuda(source):
        pinned = storage_key(source) in cuda.pinned
        return None if pinned and non_blocking else "copy_ host -> device, blocking or from pageable memory"
    return None


def _wants_cuda(args, kwargs) -> bool:
    return any(is_cuda_device(v) for v in (*args, kwargs.get("device")))
