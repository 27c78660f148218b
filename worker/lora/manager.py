"""The worker's LoRA adapters: slots in every adapted layer, an LRU of adapters in host memory.

Runs in worker processes. The engine core decides which adapter sits in which slot and says so
in the step's ``lora_loads`` (scheduled when it first admits a request of an adapter no slot
holds); this class fills the slots, keeps the last ``num_cpu_loras`` adapters' tensors in host
memory so a swapped-out adapter comes back without reading its file again, and before each step
turns the scheduled rows' adapters into the token grouping every adapted layer reads.

The layers are found by name on the built model (``model.layers.N.self_attn.qkv_proj`` and
``o_proj``, ``model.layers.N.mlp.gate_up_proj`` and ``down_proj``), so every family built on
those layers is served without code of its own.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from conveyor.protocol.lora import (
    ADAPTER_WEIGHTS,
    TARGETS,
    LoRAConfig,
    LoRALoad,
    parse_tensor_name,
    read_adapter,
)
from conveyor.worker.layers.linear import LinearBase
from conveyor.worker.lora.slots import LoRASlots
from conveyor.worker.lora.step_groups import StepGroups

logger = logging.getLogger(__name__)

_ADAPTABLE = re.compile(
    r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$"
)
_NUM_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
LORA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# (layer index, our layer name) -> {part: (A, scaled B)}
AdapterWeights = dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        model_dir: str,
        model_dtype: torch.dtype,
        device: torch.device,
        max_num_tokens: int = 0,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.device = device
        dtype = model_dtype if config.lora_dtype == "auto" else LORA_DTYPES[config.lora_dtype]
        # The tokens' slots go in a buffer of the largest step (``max_num_tokens``), made now,
        # before any CUDA graph is captured on its address (the CPU's kernel reads segments,
        # but a CPU runner keeps the same buffer: its tests stand in for graphs).
        self.groups = StepGroups(max_num_tokens, device)
        self.layers: dict[tuple[int, str], LoRASlots] = {}
        for name, module in model.named_modules():
            match = _ADAPTABLE.match(name)
            if match is None or not isinstance(module, LinearBase):
                continue
            key = (int(match[1]), match[2])
            slots = LoRASlots(
                module,
                _NUM_PARTS[match[2]],
                self.groups,
                config.max_loras,
                config.max_lora_rank,
                dtype,
                device,
            )
            self.layers[key] = slots
            module.lora = slots
        if not self.layers:
            raise ValueError("this model has no layer LoRA adapters can adapt")
        # slot -> lora_id, and back; the host LRU of loaded adapters by lora_id.
        self._slot_lora: list[int] = [0] * config.max_loras
        self._lora_slot: dict[int, int] = {}
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()

    def apply_loads(self, loads: list[LoRALoad]) -> None:
        if not loads:
            return
        # A slot fill is a few hundred small copies. On several threads each waits at a barrier
        # for the others, and a busy neighbour on a shared host holds a core for whole time
        # slices: 140 ms a fill on 2 threads against 3-4 ms on one, measured on a 2-core host
        # with another process on the second core. Copies this size are memory-bound anyway.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._apply_loads(loads)
        finally:
            torch.set_num_threads(threads)

    def _apply_loads(self, loads: list[LoRALoad]) -> None:
        for load in loads:
            old = self._slot_lora[load.slot]
            if old:
                del self._lora_slot[old]
            weights = self._weights(load.lora_id, load.path)
            for key, slots in self.layers.items():
                parts = weights.get(key)
                if parts is None:
                    slots.clear(load.slot)
                else:
                    slots.load(load.slot, parts)
            self._slot_lora[load.slot] = load.lora_id
            self._lora_slot[load.lora_id] = load.slot

    def _weights(self, lora_id: int, path: str) -> AdapterWeights:
        weights = self._host.get(lora_id)
        if weights is not None:
            self._host.move_to_end(lora_id)
            return weights
        weights = read_adapter_weights(
            path, self.model_dir, self.config.max_lora_rank, set(self.layers)
        )
        self._host[lora_id] = weights
        while len(self._host) > self.config.num_cpu_loras:
            self._host.popitem(last=False)
        return weights

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While CUDA graphs are captured (and warmed up): every adapted layer launches the
        Triton kernels on all its rows, reading the slot buffer."""
        self.groups.clear()  # the captures' warm-ups read every row: the base model's -1
        self.groups.capturing = True
        try:
            yield
        finally:
            self.groups.capturing = False

    def begin_step(
        self, rows: np.ndarray, row_lora_ids: list[int], num_scheduled: np.ndarray
    ) -> tuple[np.ndarray, bool]:
        """The step's rows in slot order (the base model's first) and whether any runs an
        adapter; the tokens are grouped for every adapted layer.

        Ordering the rows (not the tokens inside each layer) makes every adapter's tokens one
        contiguous run of the flat stream: the layers then add each correction in place, with
        no gather or scatter. Attention and sampling take the rows in any order.
        """
        if not any(row_lora_ids):
            self.groups.clear()
            return rows, False
        slot_of = self._lora_slot
        try:
            row_slots = np.array([slot_of[i] if i else -1 for i in row_lora_ids], dtype=np.int64)
        except KeyError as error:
            raise RuntimeError(f"LoRA adapter {error} is in no slot") from None
        order = np.argsort(row_slots, kind="stable")
        rows, row_slots = rows[order], row_slots[order]
        self.groups.set_tokens(np.repeat(row_slots, num_scheduled[rows]), self.device)
        return rows, True


def read_adapter_weights(
    path: str, model_dir: str, max_rank: int, layers: set[tuple[int, str]]
) -> AdapterWeights:
    """A PEFT adapter's tensors, grouped by our fused layers, B scaled; checked first."""
    spec = read_adapter(path, model_dir, max_rank)
    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    weights: AdapterWeights = {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parsed = parse_tensor_name(name)
        assert parsed is not None  # read_adapter refused anything else
        layer, module, which = parsed
        pairs.setdefault((layer, module), {})[which] = tensor
    for (layer, module), pair in pairs.items():
        fused, part, _ = TARGETS[module]
        if (layer, fused) not in layers:
            raise ValueError(
                f"LoRA adapter {path!r} adapts layer {layer} {module}, which this model does "
                "not have as an adaptable layer"
            )
        b = pair["B"].float() * spec.scale
        weights.setdefault((layer, fused), {})[part] = (pair["A"], b)
    return weights
