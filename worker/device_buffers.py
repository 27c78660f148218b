"""Moving a step's small tensors between host and device without stalling the host.

Runs in worker processes. A plain ``tensor.to("cuda")`` from ordinary (pageable) memory, or
``torch.tensor(values, device="cuda")``, blocks the host until the device has caught up with
everything queued before it; a step made a dozen of them, so the host could never run ahead of the
GPU. Here every upload is a ``non_blocking`` copy out of page-locked memory, queued on the stream
ahead of the kernels that read it, and the one download a step needs (its sampled tokens) waits on
an event recorded after its copy, not on the whole device.

On CPU none of this applies: the host tensor is the device tensor and nothing is copied.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: itself on CPU, else an asynchronous copy of a pinned copy.

    The pinned block comes from torch's caching host allocator, which keeps it until the copy
    has run, so the caller may drop or reuse ``tensor`` at once.
    """
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def array_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(np.ascontiguousarray(array)), device)


class StagingBuffer:
    """A fixed-size 1-D host buffer and its device twin, reused every step.

    ``stage(values)`` writes values into the host buffer and returns the device slice holding
    them, copied asynchronously. The device buffer's address never changes, which is what a CUDA
    graph that reads it needs. On CPU the two are one tensor. The host buffer is rewritten by the
    next ``stage``: the runner waits for the previous step's copies first (``StepUploads``).
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.device_tensor = (
            self.host if not pinned else torch.zeros(size, dtype=dtype, device=device)
        )

    def stage(self, values: np.ndarray) -> torch.Tensor:
        count = len(values)
        if count > len(self.host_np):  # never in a step the scheduler sized; kept correct anyway
            return array_to_device(values.astype(self.host_np.dtype), self.device)
        self.host_np[:count] = values
        if self.device.type == "cpu":
            return self.host[:count]
        target = self.device_tensor[:count]
        target.copy_(self.host[:count], non_blocking=True)
        return target


class StepUploads:
    """Orders the reuse of staging buffers after the copies that read them (CUDA only).

    ``uploaded()`` records an event after a step's copies are queued; ``wait()`` before the next
    step writes its host buffers returns once those copies have run. In a steady decode loop the
    step before already waited for its sampled tokens, queued after those copies, so this returns
    at once; it matters after a step that sampled nothing (a prompt chunk).
    """

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def uploaded(self) -> None:
        if self._event is not None:
            self._event.record()
            self._pending = True

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False


class HostCopier:
    """Copies a step's results to the host asynchronously, then waits on one event (CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def to_host(self, result):  # a dataclass whose fields are tensors or None
        """The same dataclass with every tensor field on the host."""
        if self._event is None:
            return result
        copies = {}
        for field in dataclasses.fields(result):
            value = getattr(result, field.name)
            if isinstance(value, torch.Tensor):
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                copies[field.name] = host.copy_(value, non_blocking=True)
        self._event.record()
        # The one wait of a step: for this stream's work up to the copies, not the whole device.
        self._event.synchronize()
        return dataclasses.replace(result, **copies)
