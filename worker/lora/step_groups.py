"""The step's tokens grouped by LoRA slot, shared by every adapted layer of a worker.

Runs in worker processes. The model runner sets a step's tokens' slots once
(``LoRAManager.begin_step``); every adapted layer (``slots.LoRASlots``) reads the grouping: the
CPU's grouped kernel and the torch loop read the runs, the CUDA Triton kernels each token's
slot on the device. That per-token slot index is also what a CUDA graph reads, so it lives in
a buffer that never moves.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.worker.device_buffers import StagingBuffer, StepUploads


class StepGroups:
    """The step's LoRA tokens sorted by slot: contiguous runs ``(slot, start, end)``.

    ``perm`` maps a run's rows back to the flat stream (None when the LoRA tokens already lie in
    slot order in one contiguous range, then ``offset`` places the runs and no gather is needed).
    ``segment_array`` holds the runs as int64 ``[runs, 3]`` for the grouped kernel;
    ``token_slots`` every token's slot (-1: the base model) as int32 on the step's device, for
    the Triton kernels (worker/lora/triton_lora.py); None in a step without adapters, and on
    CPU without a slot buffer.

    With ``max_num_tokens`` (the runner's largest step) the slots live in ``slot_buffer``, a
    persistent int32 buffer whose device address never changes: a CUDA graph's input. Each
    step fills it with one asynchronous host-to-device copy (no sync), the step's slots then -1
    over every row an earlier step wrote, so a graph's padding rows (and a shorter step after a
    longer one) read -1 and get nothing added; ``token_slots`` is then its first rows.
    ``capturing`` is set while the runner captures graphs: every adapted layer then launches
    its kernels on all its rows (``LoRASlots.add_to``).
    """

    def __init__(self, max_num_tokens: int = 0, device: torch.device | str = "cpu") -> None:
        self.segments: list[tuple[int, int, int]] = []
        self.segment_array = np.zeros((0, 3), dtype=np.int64)
        self.perm: torch.Tensor | None = None
        self.offset = 0
        self.num_tokens = 0
        self.token_slots: torch.Tensor | None = None
        self.capturing = False
        device = torch.device(device)
        self.slot_buffer: StagingBuffer | None = None
        if max_num_tokens > 0:
            self.slot_buffer = StagingBuffer(max_num_tokens, torch.int32, device)
            self.slot_buffer.host_np[:] = -1
            self.slot_buffer.device_tensor.fill_(-1)
        self._uploads = StepUploads(device)
        # Rows of the slot buffer from 0 on that may still hold an earlier step's slots.
        self._num_written = 0

    def set_tokens(self, token_slots: np.ndarray, device: torch.device) -> None:
        """``token_slots[t]``: the slot of token t of the flat stream, -1 for the base model."""
        self.num_tokens = len(token_slots)
        lora_tokens = np.flatnonzero(token_slots >= 0)
        self.perm, self.offset = None, 0
        if len(lora_tokens) == 0:
            self.clear()
            return
        order = lora_tokens[np.argsort(token_slots[lora_tokens], kind="stable")]
        slots = token_slots[order]
        cuts = (np.flatnonzero(np.diff(slots)) + 1).tolist()
        starts, ends = [0, *cuts], [*cuts, len(order)]
        segments = [(int(slots[s]), s, e) for s, e in zip(starts, ends)]
        if order[-1] - order[0] == len(order) - 1 and np.all(np.diff(order) == 1):
            self.offset = int(order[0])
        else:
            self.perm = torch.from_numpy(order.astype(np.int64)).to(device)
        self.segments = segments
        self.segment_array = np.array(segments, dtype=np.int64).reshape(-1, 3)
        if self.slot_buffer is not None:
            self.token_slots = self._fill_slot_buffer(token_slots)
        elif torch.device(device).type == "cuda":
            slots32 = np.ascontiguousarray(token_slots, dtype=np.int32)
            self.token_slots = torch.from_numpy(slots32).to(device, non_blocking=True)

    def clear(self) -> None:
        """A step of the base model alone (no slot buffer row reads other than -1)."""
        self.segments = []
        self.segment_array = np.zeros((0, 3), dtype=np.int64)
        self.perm = None
        self.token_slots = None
        if self.slot_buffer is not None:
            self._fill_slot_buffer(np.zeros(0, dtype=np.int32))

    def _fill_slot_buffer(self, token_slots: np.ndarray) -> torch.Tensor:
        """The step's slots in the buffer's first rows and -1 over the rest an earlier step
        wrote, in one copy; the device rows of the step."""
        buffer = self.slot_buffer
        assert buffer is not None
        count = len(token_slots)
        if count > len(buffer.host_np):
            raise RuntimeError(
                f"a step of {count} tokens over the LoRA slot buffer's {len(buffer.host_np)}"
            )
        reach = max(count, self._num_written)
        if reach:
            values = np.full(reach, -1, dtype=np.int32)
            values[:count] = token_slots
            # The host half is rewritten: the previous step's copy out of it must have run
            # (in a steady decode loop it has: that step waited for its sampled tokens).
            self._uploads.wait()
            buffer.stage(values)
            self._uploads.uploaded()
        self._num_written = count
        return buffer.device_tensor[:count]
