"""Copies of a layer's tensors from their home to the compute device: on CUDA through a side
stream, with the event the compute stream waits on and ``record_stream`` so the allocator
keeps the memory until the compute stream is done; elsewhere a plain copy."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``, one contiguous row of the leading axis at a time when ``src`` or
    ``dst`` is strided (a slice of a preallocated buffer): a strided copy between CPU and CUDA
    would go through a pageable temporary and lose the asynchrony of pinned memory."""
    if dst.device == src.device or (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=non_blocking)
        return
    for dst_row, src_row in zip(dst, src, strict=True):
        dst_row.copy_(src_row, non_blocking=non_blocking)


class DeviceCopy:
    """One layer's tensors copied to the device, and the event that says they are there."""

    def __init__(self, tensors: dict[str, torch.Tensor], event: torch.cuda.Event | None) -> None:
        self.tensors = tensors
        self.event = event

    def wait(self) -> None:
        """Make the current stream wait for the copy and own its memory from now on."""
        if self.event is None:
            return
        stream = torch.cuda.current_stream(self.event_device)
        stream.wait_event(self.event)
        for tensor in self.tensors.values():
            tensor.record_stream(stream)  # freed memory waits for this stream's kernels
        self.event = None

    @property
    def event_device(self) -> torch.device:
        return next(iter(self.tensors.values())).device


def start_copy(tensors: dict[str, torch.Tensor], device: torch.device) -> DeviceCopy:
    """Fresh contiguous copies of ``tensors`` on ``device``; on CUDA through the side stream."""
    if device.type != "cuda":
        copies = {}
        for name, source in tensors.items():
            copies[name] = torch.empty(source.shape, dtype=source.dtype, device=device)
            copy_rows(copies[name], source)
        return DeviceCopy(copies, None)
    compute, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(compute)  # the state prefill has queued must land before it is read
    with torch.cuda.stream(side):
        copies = {}
        for name, source in tensors.items():
            copies[name] = torch.empty(source.shape, dtype=source.dtype, device=device)
            copy_rows(copies[name], source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return DeviceCopy(copies, event)
