"""The generated test models: deterministic, loadable by transformers, and context-sensitive."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import benchmarks.__main__
from benchmarks.fixtures.model_maker import (
    cached_model_name,
    ensure_model,
    model_config,
    write_model_dir,
)
from benchmarks.fixtures.tokenizer_maker import CHAT_TEMPLATE

TEXT = "def greet(name):\n    return f'Hello, {name}!'  # naïve café, 東京, emoji 🚂 \t tabs"


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path):
    a = write_model_dir(tmp_path / "a", "tiny", "qwen2", seed=7)
    b = write_model_dir(tmp_path / "b", "tiny", "qwen2", seed=7)
    c = write_model_dir(tmp_path / "c", "tiny", "qwen2", seed=8)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tokenizer_round_trips_text_and_every_id_decodes(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab_size = model_config("tiny")["vocab_size"]
    assert len(tokenizer) == vocab_size
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    assert max(ids) < vocab_size and len(ids) < len(TEXT.encode())  # it learned merges
    assert all(isinstance(t, str) for t in tokenizer.convert_ids_to_tokens(range(vocab_size)))
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_transformers_encodes_as_tokenizer_json_does_for_every_family(tiny_model_dirs):
    # transformers may build its own pipeline for a model type (it does for qwen2); ours must be
    # the same one, or the frontend and a tokenizers-only client would disagree on ids.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text = TEXT + "<|im_start|>user\nI'll count 12345<|im_end|>\n"
    for arch, model_dir in tiny_model_dirs.items():
        raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text).ids, arch


def test_chat_template_is_chatml(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2  # specials are single tokens


def test_transformers_loads_every_tensor(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    for arch, model_dir in tiny_model_dirs.items():
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], arch
        assert type(model).__name__ == model_config("tiny", arch)["architectures"][0]
        with safe_open(model_dir / "model.safetensors", framework="pt") as f:
            has_head = "lm_head.weight" in f.keys()  # noqa: SIM118
        assert has_head == (arch == "llama")


def test_bench_config_is_exactly_as_specified():
    config = model_config("bench")
    expected = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 8192,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "max_position_embeddings": 4096,
    }
    assert {key: config[key] for key in expected} == expected
    with pytest.raises(ValueError, match="Qwen3 only"):
        model_config("bench", "llama")


def _greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_output_depends_on_the_whole_context(tiny_model_dir_each: Path, hf_model):
    """Guards against weights so small the model just repeats its last token."""
    model = hf_model(tiny_model_dir_each)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    different_next, distinct_counts = 0, []
    for _ in range(4):
        prompt = rng.integers(3, vocab, 16).tolist()
        other = rng.integers(3, vocab, 15).tolist() + prompt[-1:]  # same last token
        continuation = _greedy(model, prompt, 32)
        distinct_counts.append(len(set(continuation)))
        different_next += continuation[:4] != _greedy(model, other, 4)
    assert different_next == 4
    assert min(distinct_counts) > 1 and sum(distinct_counts) / 4 >= 8, distinct_counts


def test_ensure_model_is_made_once_under_concurrent_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: ensure_model("tiny", "llama"), range(3)))
    assert len(set(paths)) == 1
    assert paths[0] == tmp_path / cached_model_name("tiny", "llama")
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temporary leftovers
    assert (paths[0] / "model.safetensors").is_file()
    assert ensure_model("tiny", "llama") == paths[0]


def test_conveyor_make_model(tmp_path: Path, capsys):
    def main(argv: list[str]) -> int:
        return benchmarks.__main__.main(["make-model", *argv])

    assert main([str(tmp_path / "m"), "--size", "tiny", "--arch", "qwen2", "--seed", "3"]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (
        write_model_dir(tmp_path / "again", "tiny", "qwen2", seed=3) / "model.safetensors"
    ).read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "b"), "--size", "bench", "--arch", "llama"])
    assert exit_info.value.code == 2 and "Qwen3 only" in capsys.readouterr().err


def test_the_qwen3_0_6b_size_has_qwen3_0_6bs_shapes():
    """What gpu-check measures; its weights (1.2 GB) are generated on the GPU machine only."""
    config = model_config("qwen3-0.6b")
    shapes = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "head_dim", "vocab_size")}
    assert shapes == dict(hidden_size=1024, num_hidden_layers=28, head_dim=128, vocab_size=151936)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (16, 8)
    assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == 40960
    assert config["tie_word_embeddings"]
    with pytest.raises(ValueError, match="Qwen3 only"):
        model_config("qwen3-0.6b", "llama")
