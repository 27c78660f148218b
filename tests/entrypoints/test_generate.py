"""conveyor generate: the model's sampling defaults (generation_config.json) under the flags."""

from __future__ import annotations

import json
import shutil

import pytest

from conveyor.entrypoints import generate
from conveyor.protocol import SamplingParams


def test_flags_left_out_take_the_models_defaults_then_the_apis():
    defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.3, "max_tokens": 100}
    params = generate.sampling_params(generate.parse_args(["hi"]), defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 1.0)
    assert (params.repetition_penalty, params.max_tokens) == (1.3, 100)
    given = generate.parse_args(["hi", "--temperature", "0", "--top-k", "5", "--max-tokens", "7"])
    params = generate.sampling_params(given, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 5, 7)
    assert params.repetition_penalty == 1.3  # no flag for it: the model's stays
    plain = generate.sampling_params(generate.parse_args(["hi"]), {})
    assert plain == SamplingParams(max_tokens=generate.DEFAULT_MAX_TOKENS)


@pytest.mark.slow
def test_generate_applies_the_models_generation_config(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=5)
    (model / "generation_config.json").write_text(json.dumps(config))
    argv = ["def main():", "--model", str(model), "--ignore-eos", "--kv-cache-memory", "16M"]
    assert generate.main(argv) == 0
    err = capsys.readouterr().err
    assert "[5 tokens, finish_reason=length, temperature=0.0" in err
    assert "the model's defaults: max_tokens=5, temperature=0.0" in err
