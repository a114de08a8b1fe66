"""CPU tensors that say they are on cuda:N, for `tests.fake_cuda`.

A tensor made with `device="cuda:1"` (or moved there) is a CPU tensor whose storage is tagged with
device 1; `.device`, `.is_cuda` and `.get_device()` report the tag, and the results of ops on tagged
tensors are tagged the same. Every `copy_` is handed to the fake runtime, which records its stream.
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
        if func is torch.Tensor.pin_memory:
            return args[0].clone()
        kwargs.pop("pin_memory", None)
        target, args, kwargs = self._target(func, args, kwargs)
        if func is torch.Tensor.copy_:
            self.cuda.record_copy(args[0], args[1])
        out = func(*args, **kwargs)
        if func is not torch.Tensor.copy_:
            for tensor in (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
                self._tag(tensor, target)
        return out

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
