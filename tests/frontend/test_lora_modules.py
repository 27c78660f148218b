"""--lora-modules: vLLM's two forms of naming an adapter on the command line."""

from __future__ import annotations

import argparse

import pytest

from conveyor.frontend.server.lora_modules import LoRAModule, parse_lora_module


def test_lora_modules_take_both_of_vllms_forms():
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    text = '{"name": "sql", "path": "/a/sql", "base_model_name": "qwen"}'
    assert parse_lora_module(text) == LoRAModule("sql", "/a/sql", "qwen")
    for bad in ("sql", "=/a", '{"name": "x"}', '{"name": "x", "path": "/a", "rank": 2}', "{x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
