"""Which LoRA adapter sits in which worker slot, and which adapters may run.

Runs in the engine-core process. The workers hold ``max_loras`` slots; an adapter is given one
when the scheduler admits the first request of it that no slot holds, and the step's
``lora_loads`` tell the workers to fill it. Adapters with running requests are pinned; an idle
one stays in its slot (a later request of it needs no load) until its slot is wanted, least
recently used first. Requests of at most ``max_loras`` adapters run at once: a waiting request
whose adapter would be one more is not admitted, and (admission being head-of-line) nobody
overtakes it, so it runs as soon as one adapter's requests have drained: no starvation.
"""

from __future__ import annotations

from collections import OrderedDict

from conveyor.engine_core.request import Request
from conveyor.protocol.lora import LoRALoad


class LoRASlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # lora_id -> slot
        self._free_slots = list(range(max_loras - 1, -1, -1))
        self._num_running: dict[int, int] = {}  # lora_id -> its running requests
        self._idle: OrderedDict[int, None] = OrderedDict()  # in a slot, no running request
        self._holders: dict[int, int] = {}  # req_id -> lora_id, for running requests
        self._loads: list[LoRALoad] = []

    def can_admit(self, request: Request) -> bool:
        lora_id = request.lora_id
        return (
            not lora_id or lora_id in self._num_running or len(self._num_running) < self.max_loras
        )

    def acquire(self, request: Request) -> None:
        """An admitted request runs its adapter: pin it, in a slot (loading it if need be)."""
        lora_id = request.lora_id
        if not lora_id or request.req_id in self._holders:
            return
        self._holders[request.req_id] = lora_id
        if lora_id in self._num_running:
            self._num_running[lora_id] += 1
            return
        self._num_running[lora_id] = 1
        if lora_id in self._slot_of:
            del self._idle[lora_id]
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:  # can_admit left room: some slot holds an idle adapter
            evicted, _ = self._idle.popitem(last=False)
            slot = self._slot_of.pop(evicted)
        self._slot_of[lora_id] = slot
        assert request.lora is not None
        self._loads.append(LoRALoad(slot, lora_id, request.lora.lora_path))

    def release(self, request: Request) -> None:
        """The request stopped running (finished, aborted, preempted)."""
        lora_id = self._holders.pop(request.req_id, 0)
        if not lora_id:
            return
        self._num_running[lora_id] -= 1
        if not self._num_running[lora_id]:
            del self._num_running[lora_id]
            self._idle[lora_id] = None

    def take_loads(self) -> list[LoRALoad]:
        loads, self._loads = self._loads, []
        return loads

    @property
    def running_lora_ids(self) -> list[int]:
        return list(self._num_running)
