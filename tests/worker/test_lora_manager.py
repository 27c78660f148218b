"""The worker's LoRA manager: slots filled by the step's loads, and the host LRU of adapters.

On the tiny Qwen3 with one slot and room for two adapters in host memory: an adapter the LRU
still holds is loaded again without its file (deleted here to prove it), one it dropped is read
from disk again; a slot reloaded with another adapter forgets the first.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.fixtures.lora_maker import make_adapter
from conveyor.protocol.lora import AdapterError, LoRAConfig, LoRALoad
from conveyor.worker.loader import load_model
from conveyor.worker.lora import LoRAManager


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-manager")
    return [make_adapter(tiny_model_dir, folder / f"a{i}", 4, ["q_proj"], i) for i in range(3)]


def test_the_host_lru_keeps_the_last_adapters_and_slots_forget_the_replaced(
    tiny_model_dir, adapters, tmp_path
):
    model = load_model(tiny_model_dir, torch.float32, "cpu")
    config = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    manager = LoRAManager(model, config, str(tiny_model_dir), torch.float32, torch.device("cpu"))
    copies = [shutil.copytree(path, tmp_path / path.name) for path in adapters]
    qkv = manager.layers[(0, "qkv_proj")]
    for lora_id, path in enumerate(copies, start=1):
        manager.apply_loads([LoRALoad(0, lora_id, str(path))])
    assert list(manager._host) == [2, 3]
    # Adapter 1 is now in slot 0 only; 2's file is gone but the LRU holds it.
    (copies[1] / "adapter_model.safetensors").unlink()
    manager.apply_loads([LoRALoad(0, 2, str(copies[1]))])
    scale = 8 / 4  # make_adapter's alpha is 2 * rank
    saved = load_file(adapters[1] / "adapter_model.safetensors")
    b = saved["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    # Slot 0 holds adapter 2's q part: B scaled, transposed, in q's output columns.
    torch.testing.assert_close(qkv.b[0, :4, : b.shape[0]], b.t() * scale)
    assert not qkv.b[0, :4, b.shape[0] :].any()
    with pytest.raises(RuntimeError, match="in no slot"):
        manager.begin_step(np.array([0]), [3], np.array([1]))
    (copies[0] / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):  # read again
        manager.apply_loads([LoRALoad(0, 1, str(copies[0]))])
