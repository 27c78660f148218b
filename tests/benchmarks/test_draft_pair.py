"""``python -m benchmarks make-draft-pair``: the grown target computes the default model's logits
when its extra layers add nothing, and every extra layer is a real one (it costs weight reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.fixtures.draft_pair import main, make_draft_pair_target
from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR

IDS = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 7, 8, 9, 50, 60, 70]])


def _logits(model_dir: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(IDS).logits


def test_a_target_whose_extra_layers_add_nothing_is_the_default_model(tmp_path: Path):
    target = make_draft_pair_target(
        tmp_path / "t", extra_layers=2, intermediate_size=640, output_scale=0.0
    )
    config = json.loads((target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["intermediate_size"]) == (6, 640)
    expected = _logits(DEFAULT_MODEL_DIR)
    # Only the padded matmuls' summation order differs.
    torch.testing.assert_close(_logits(target), expected, rtol=0, atol=1e-4)
    # With a scale the extra layers move the logits: the draft is then right only mostly.
    nudged = make_draft_pair_target(
        tmp_path / "n", extra_layers=2, intermediate_size=640, output_scale=0.3
    )
    assert (_logits(nudged) - expected).abs().max() > 1e-2


def test_the_command_refuses_a_narrower_mlp_and_an_existing_directory(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--intermediate-size", "64"])
    assert "can only widen" in capsys.readouterr().err
    (tmp_path / "y").mkdir()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "y"), "--extra-layers", "1", "--intermediate-size", "640"])
