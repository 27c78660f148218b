"""gpt-oss loading: MXFP4 and dequantized checkpoints give the same model; a lone MXFP4 half and
a missing expert tensor are refused naming the checkpoint's tensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.fixtures.model_maker import ensure_model
from conveyor.worker.layers.mxfp4 import dequantize_mxfp4
from conveyor.worker.loader import ModelLoadError, load_model

CPU = torch.device("cpu")


def _rewrite(source, target, change) -> None:
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config))


def _dequantized(tensors, config) -> None:
    """transformers' unpacked layout: [experts, in, out], no quantization_config."""
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        blocks, scales = tensors.pop(name), tensors.pop(f"{base}_scales")
        tensors[base] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    del config["quantization_config"]


def test_a_dequantized_checkpoint_loads_to_the_same_weights(tmp_path):
    source = ensure_model("tiny", "gpt_oss")
    _rewrite(source, tmp_path / "dequantized", _dequantized)
    packed = load_model(str(source), torch.float32, CPU)
    unpacked = load_model(str(tmp_path / "dequantized"), torch.float32, CPU)
    for (name, ours), (_, theirs) in zip(
        packed.named_parameters(), unpacked.named_parameters(), strict=True
    ):
        assert torch.equal(ours, theirs), name
    experts = packed.model.layers[0].mlp.experts
    # De-interleaved: the first half of each expert's rows are gate rows (the checkpoint's even
    # rows), the second half up rows (odd rows).
    blocks = load_file(str(source / "model.safetensors"))
    full = dequantize_mxfp4(
        blocks["model.layers.0.mlp.experts.gate_up_proj_blocks"],
        blocks["model.layers.0.mlp.experts.gate_up_proj_scales"],
    )
    size = experts.intermediate_size
    assert torch.equal(experts.gate_up_proj[:, :size], full[:, 0::2])
    assert torch.equal(experts.gate_up_proj[:, size:], full[:, 1::2])


def test_missing_or_unpaired_expert_tensors_are_refused(tmp_path):
    source = ensure_model("tiny", "gpt_oss")

    def drop_scales(tensors, config) -> None:
        del tensors["model.layers.1.mlp.experts.down_proj_scales"]

    _rewrite(source, tmp_path / "unpaired", drop_scales)
    with pytest.raises((ModelLoadError, ValueError), match="down_proj_blocks"):
        load_model(str(tmp_path / "unpaired"), torch.float32, CPU)

    def drop_both(tensors, config) -> None:
        del tensors["model.layers.1.mlp.experts.down_proj_scales"]
        del tensors["model.layers.1.mlp.experts.down_proj_blocks"]

    _rewrite(source, tmp_path / "missing", drop_both)
    with pytest.raises(ModelLoadError, match="down_proj_blocks"):
        load_model(str(tmp_path / "missing"), torch.float32, CPU)


def test_greedy_output_depends_on_the_whole_context(hf_model):
    from tests.worker import test_model_maker

    test_model_maker.test_greedy_output_depends_on_the_whole_context(
        ensure_model("tiny", "gpt_oss"), hf_model
    )
