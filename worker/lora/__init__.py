"""LoRA adapters in the worker: per-layer slots and the manager that fills them (worker processes)."""

from conveyor.worker.lora.manager import LoRAManager

__all__ = ["LoRAManager"]
