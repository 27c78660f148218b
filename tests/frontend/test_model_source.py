"""Models by Hugging Face id from the local cache: found without the network, or (offline)
refused with a message that says where conveyor looked and how to put the model there. Downloads:
test_model_download.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conveyor.frontend import LLM
from conveyor.frontend.engine_args import EngineArgs
from conveyor.frontend.model_source import hub_cache_dir, looks_like_repo_id, resolve_model
from conveyor.protocol import SamplingParams
from conveyor.protocol.config import ConfigError

MAIN = "a" * 40
TAGGED = "b" * 40


@pytest.fixture
def cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding acme/tiny at two commits: main, and the tag v2."""
    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny"
    for commit in (MAIN, TAGGED):
        shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(TAGGED)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and were anything to try the network: refused
    return repo


def test_an_id_resolves_to_its_cached_snapshot(cache):
    assert resolve_model("acme/tiny") == str(cache / "snapshots" / MAIN)
    assert resolve_model("acme/tiny", "v2") == str(cache / "snapshots" / TAGGED)
    assert resolve_model("acme/tiny", TAGGED) == str(cache / "snapshots" / TAGGED)
    config = EngineArgs(model="acme/tiny", kv_cache_memory=16 << 20).create_engine_config()
    assert config.model.model == str(cache / "snapshots" / MAIN)


def test_a_missing_id_says_where_it_looked_and_what_to_do(cache):
    with pytest.raises(ConfigError) as error:
        resolve_model("acme/absent")
    message = str(error.value)
    assert str(cache.parent / "models--acme--absent") in message
    assert "hf download acme/absent" in message and "nothing is downloaded" in message
    with pytest.raises(ConfigError, match="revision v9"):
        resolve_model("acme/tiny", "v9")


def test_an_incomplete_snapshot_is_not_served(cache):
    (cache / "snapshots" / MAIN / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"incomplete \(\*\.safetensors\) in the Hugging Face"):
        resolve_model("acme/tiny")


def test_paths_are_never_taken_for_ids(tmp_path, cache):
    with pytest.raises(ConfigError, match="model directory not found"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="needs a Hugging Face id"):
        resolve_model(str(cache / "snapshots" / MAIN), "v2")
    assert looks_like_repo_id("Qwen/Qwen3-0.6B") and looks_like_repo_id("gpt2")
    assert not any(map(looks_like_repo_id, ["./a/b", "/a/b", "a/b/c", "~/m", "a/..", "a//b"]))


def test_the_cache_follows_hf_home_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"


@pytest.mark.slow
def test_llm_serves_a_model_by_id_as_from_its_directory(cache, tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = []
    for model in ("acme/tiny", str(tiny_model_dir)):
        with LLM(model, engine="inprocess", kv_cache_memory=16 << 20) as llm:
            outputs.append(llm.generate(["def main():"], params, use_tqdm=False)[0])
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
