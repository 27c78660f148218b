"""Models by Hugging Face id that are not cached: downloaded from the Hub (a stand-in on
127.0.0.1, HF_ENDPOINT), only the files serving needs, with progress, resumed after a cut
connection, never when HF_HUB_OFFLINE is set; --revision, HF_TOKEN and --download-dir honoured."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conveyor.frontend.engine_args import EngineArgs
from conveyor.frontend.model_source import INDEX_FILE, resolve_model
from conveyor.protocol.config import ConfigError
from conveyor.runtime.processes import descendants
from tests.commands import CONVEYOR
from tests.frontend.hub_stand_in import StandInHub, model_files
from tests.process_tree import wait_until_gone

MAIN = "1" * 40
TAGGED = "2" * 40
# What a real repository holds besides what serving reads: never fetched.
EXTRAS = {
    "README.md": b"# tiny\n",
    "pytorch_model.bin": b"\0" * 4096,
    "original/model.safetensors": b"\0" * 4096,
    ".gitattributes": b"*.safetensors filter=lfs\n",
}


@pytest.fixture
def hub(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """The stand-in hub serving acme/tiny (main and the tag v2), an empty cache in
    HF_HUB_CACHE, online, progress bars forced on (stderr is no terminal here)."""
    stand_in = StandInHub()
    files = {**model_files(tiny_model_dir), **EXTRAS}
    stand_in.add_repo("acme/tiny", files, {"main": MAIN, "v2": TAGGED})
    monkeypatch.setenv("HF_ENDPOINT", stand_in.start())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("TQDM_POSITION", "-1")
    yield stand_in
    stand_in.stop()


def _snapshot(cache: Path, commit: str, repo: str = "acme--tiny") -> Path:
    return cache / f"models--{repo}" / "snapshots" / commit


def _sha256(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def _fetched(hub: StandInHub) -> set[str]:
    return {r.file for r in hub.requests if r.method == "GET" and r.file}


def test_an_uncached_id_is_downloaded_once_with_only_the_serving_files(
    hub, tmp_path, tiny_model_dir, capfd, monkeypatch
):
    path = resolve_model("acme/tiny")
    assert path == str(_snapshot(tmp_path / "hub", MAIN))
    served = model_files(tiny_model_dir)
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(served)
    assert all((Path(path) / name).read_bytes() == data for name, data in served.items())
    assert _fetched(hub) == set(served)  # no README, .bin, subfolder or .gitattributes
    err = capfd.readouterr().err
    assert "Download complete" in err and "Fetching" in err  # huggingface_hub's progress bars
    assert "downloaded acme/tiny (commit 1111111111" in err

    # Cached now: neither a second resolve nor an offline one asks the hub anything.
    hub.requests.clear()
    assert resolve_model("acme/tiny") == path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("acme/tiny") == path
    assert EngineArgs(model="acme/tiny", kv_cache_memory=16 << 20).create_engine_config()
    assert hub.requests == []


def test_a_connection_cut_midway_resumes_where_it_stopped(hub, tiny_model_dir, capfd):
    # huggingface_hub writes what arrives in 10 MiB chunks and resumes from the last whole one
    # (a smaller file starts again): weights past one chunk, cut past it.
    chunk = 10 << 20
    weights = os.urandom(chunk + (2 << 20))
    files = {**model_files(tiny_model_dir), "model.safetensors": weights}
    hub.add_repo("acme/big", files, {"main": MAIN})
    hub.cut_once["model.safetensors"] = chunk + (1 << 20)
    path = resolve_model("acme/big")
    assert (Path(path) / "model.safetensors").read_bytes() == weights
    first, resumed = hub.gets("model.safetensors")
    assert first.range is None and resumed.range == f"bytes={chunk}-"
    assert "Trying to resume download" in capfd.readouterr().err


def test_a_failed_download_keeps_what_finished_and_the_next_run_fetches_the_rest(hub):
    hub.fail.add("model.safetensors")
    with pytest.raises(ConfigError, match="downloading acme/tiny from .* failed"):
        resolve_model("acme/tiny")
    hub.fail.clear()
    hub.requests.clear()
    resolve_model("acme/tiny")
    assert _fetched(hub) == {"model.safetensors"}


def test_offline_the_cache_is_all_there_is(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as error:
        resolve_model("acme/tiny")
    message = str(error.value)
    assert "HF_HUB_OFFLINE is set" in message and "hf download acme/tiny" in message
    assert str(tmp_path / "hub" / "models--acme--tiny") in message
    assert hub.requests == []


def test_revision_token_and_download_dir_are_honoured(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_secret")
    # What LLM("acme/tiny", revision="v2", download_dir=...) and the flags do.
    args = EngineArgs("acme/tiny", revision="v2", download_dir=str(tmp_path / "models"))
    path = args.create_engine_config().model.model
    assert path == str(_snapshot(tmp_path / "models", TAGGED))
    assert (tmp_path / "models" / "models--acme--tiny" / "refs" / "v2").read_text() == TAGGED
    assert not (tmp_path / "hub").exists()
    model_requests = [r for r in hub.requests if "acme/tiny" in r.path]
    assert {r.authorization for r in model_requests} == {"Bearer hf_stand_in_secret"}
    # A commit id needs no lookup of the branch: straight to the files, from the cache now.
    hub.requests.clear()
    assert resolve_model("acme/tiny", TAGGED, download_dir=str(tmp_path / "models")) == path
    assert hub.requests == []


def test_a_sharded_checkpoint_fetches_the_shards_its_index_names(hub, tmp_path, tiny_model_dir):
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    files = {k: v for k, v in model_files(tiny_model_dir).items() if k != "model.safetensors"}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / shard)
        files[shard] = (tmp_path / shard).read_bytes()
        weight_map.update(dict.fromkeys(keys, shard))
    files[INDEX_FILE] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    files["consolidated.safetensors"] = b"\0" * 4096  # Mistral's other copy: not in the index
    hub.add_repo("acme/sharded", files, {"main": MAIN})
    path = resolve_model("acme/sharded")
    assert "consolidated.safetensors" not in _fetched(hub)
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(
        set(files) - {"consolidated.safetensors"}
    )


def test_a_tokenizer_alone_is_downloaded_without_weights(hub):
    path = resolve_model("acme/tiny", weights=False)  # --tokenizer ID
    assert (Path(path) / "tokenizer.json").is_file()
    assert "model.safetensors" not in _fetched(hub)
    hub.requests.clear()
    assert resolve_model("acme/tiny", weights=False) == path
    assert hub.requests == []


def test_what_cannot_be_downloaded_is_refused_saying_why(hub, tiny_model_dir):
    with pytest.raises(ConfigError, match="acme/absent was not found on http://127.0.0.1"):
        resolve_model("acme/absent")
    with pytest.raises(ConfigError, match="has no revision 'v9'"):
        resolve_model("acme/tiny", "v9")
    only_bin = {k: v for k, v in model_files(tiny_model_dir).items() if k != "model.safetensors"}
    hub.add_repo("acme/bin-only", {**only_bin, "pytorch_model.bin": b"\0" * 64}, {"main": MAIN})
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        resolve_model("acme/bin-only")
    assert "pytorch_model.bin" not in _fetched(hub)


def test_ctrl_c_stops_the_download_at_once_and_leaves_no_partial_file(
    hub, tmp_path, tiny_model_dir
):
    hub.stall.add("model.safetensors")  # half the weights, then nothing
    cache = tmp_path / "hub"
    code = "from conveyor.frontend.model_source import resolve_model; resolve_model('acme/tiny')"
    caller = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not hub.gets("model.safetensors") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the first half in its partial file (the small files all moved in place)
    assert [p.name[:64] for p in cache.rglob("*.incomplete")] == [_sha256(tiny_model_dir)]
    downloader = descendants(caller.pid)
    assert len(downloader) == 1
    caller.send_signal(signal.SIGINT)  # the terminal's Ctrl-C reaches the caller alone
    _, err = caller.communicate(timeout=10)
    assert "KeyboardInterrupt" in err
    assert wait_until_gone(downloader, 5.0) == []
    assert list(cache.rglob("*.incomplete")) == []


@pytest.mark.slow
def test_serve_downloads_once_before_the_engine_starts(hub, tmp_path):
    log = tmp_path / "serve.log"
    command = [*CONVEYOR, "serve", "acme/tiny", "--frontends", "0", "--kv-cache-memory", "16M"]
    with log.open("w") as stderr:
        server = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=os.environ.copy()
        )
    try:
        line = server.stdout.readline()
        assert line.startswith("ready: engine_core"), log.read_text()[-3000:]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    text = log.read_text()
    assert text.index("downloaded acme/tiny") < text.index("started engine_core")
    assert all(len(hub.gets(name)) == 1 for name in _fetched(hub))


def test_a_lora_adapter_by_id_is_downloaded_with_its_two_files_and_served(
    hub, tmp_path, tiny_model_dir, monkeypatch
):
    """vLLM takes `--lora-modules name=org/adapter`: the adapter's two files are fetched (not the
    README beside them), then the cache serves it offline; an id that is no adapter is refused
    saying so, before anything runs."""
    from benchmarks.fixtures.lora_maker import make_adapter
    from conveyor.frontend.model_source import resolve_adapter
    from conveyor.frontend.server.lora_modules import LoRARegistry
    from conveyor.protocol.lora import AdapterError

    folder = make_adapter(tiny_model_dir, tmp_path / "made", 8, ["q_proj", "v_proj"], 5)
    files = model_files(folder)  # PEFT's save writes a README.md beside the two
    assert "README.md" in files
    hub.add_repo("acme/tiny-lora", files, {"main": MAIN})
    path = resolve_adapter("acme/tiny-lora")
    assert path == str(_snapshot(tmp_path / "hub", MAIN, "acme--tiny-lora"))
    adapter_files = {"adapter_config.json", "adapter_model.safetensors"}
    assert {p.name for p in Path(path).iterdir()} == adapter_files == _fetched(hub)
    assert all((Path(path) / name).read_bytes() == files[name] for name in adapter_files)

    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory=16 << 20, enable_lora=True, max_lora_rank=8
    ).create_engine_config()
    registry = LoRARegistry(config, "tiny")
    assert registry.add("mine", "acme/tiny-lora").lora_path == path  # checked, from the cache
    assert hub.requests == []
    with pytest.raises(AdapterError, match="HF_HUB_OFFLINE is set"):
        resolve_adapter("acme/absent-lora")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        registry.add("model", "acme/tiny")  # a model, not an adapter
    with pytest.raises(AdapterError, match="not found"):
        registry.add("absent", "acme/absent-lora")
    assert set(registry.adapters) == {"mine"}
