"""LoRA adapters over HTTP: --lora-modules, a request's model, vLLM's run-time routes.

One ``conveyor serve`` per module, with one slot (``--max-loras 1``) for more adapters than
that, and run-time updating on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``). Every adapter's
tokens are checked against transformers + PEFT on the same tiny model; bad adapters are refused
with their reason and nothing else is harmed.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from benchmarks.fixtures.lora_maker import make_adapter, peft_greedy
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    post_json,
    post_raw,
    start_served_http,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-lora")]

NUM_TOKENS = 10
PROMPTS = [np.random.default_rng(3).integers(3, 2000, n).tolist() for n in (7, 21, 40)]


class Adapters:
    def __init__(self, model_dir: Path, folder: Path) -> None:
        self.model_dir = model_dir
        self.a8 = make_adapter(model_dir, folder / "a8", 8, ["q_proj", "v_proj", "o_proj"], 11)
        self.b16 = make_adapter(
            model_dir, folder / "b16", 16, ["gate_proj", "up_proj", "down_proj"], 12, None, True
        )
        self.c8 = make_adapter(model_dir, folder / "c8", 8, ["k_proj", "down_proj"], 13)
        self.r32 = make_adapter(model_dir, folder / "r32", 32, ["q_proj"], 14)
        self.wrong_shape = folder / "wrong_shape"
        shutil.copytree(self.a8, self.wrong_shape)
        weights = self.wrong_shape / "adapter_model.safetensors"
        tensors = {
            k: v[:, :-1].contiguous() if "lora_A" in k else v for k, v in load_file(weights).items()
        }
        save_file(tensors, weights)
        self._tokens: dict[tuple[str | None, int], list[int]] = {}

    def tokens(self, adapter: str | None, index: int) -> list[int]:
        if (adapter, index) not in self._tokens:
            path = getattr(self, adapter) if adapter else None
            [tokens] = peft_greedy(self.model_dir, path, [PROMPTS[index]], NUM_TOKENS)
            self._tokens[(adapter, index)] = tokens
        return self._tokens[(adapter, index)]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    return Adapters(tiny_model_dir, tmp_path_factory.mktemp("http-lora"))


@pytest.fixture(scope="module")
def served(adapters: Adapters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("http-lora-log") / "serve.log"
    b16 = json.dumps({"name": "b16", "path": str(adapters.b16), "base_model_name": "tiny-base"})
    extra = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--dtype", "float32"]
    extra += ["--lora-modules", f"a8={adapters.a8}", b16]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    served = start_served_http(adapters.model_dir, log, extra, env=env)
    try:
        yield served
    finally:
        served.stop()


def _complete(served: ServedHttp, model: str, index: int) -> tuple[int, dict]:
    body = {
        "model": model,
        "prompt": PROMPTS[index],
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, _, answer = post_json(served.base_url, "/v1/completions", body)
    return status, answer


def _tokens(served: ServedHttp, model: str, index: int) -> list[int]:
    status, answer = _complete(served, model, index)
    assert status == 200, answer
    return answer["choices"][0]["token_ids"]


def _post_text(served: ServedHttp, path: str, body: dict) -> tuple[int, str]:
    status, _, raw = post_raw(served.base_url, path, json.dumps(body).encode())
    return status, raw.decode()


def test_models_lists_the_adapters_with_their_parent(served):
    status, text = get(served.base_url, "/v1/models")
    assert status == 200
    parents = {card["id"]: card.get("parent") for card in json.loads(text)["data"]}
    # b16's parent is the base_model_name its JSON form gave.
    assert parents == {MODEL_NAME: None, "a8": MODEL_NAME, "b16": "tiny-base"}
    status, text = get(served.base_url, "/v1/models/a8")
    assert status == 200 and json.loads(text)["parent"] == MODEL_NAME


def test_more_adapters_than_slots_at_once_match_peft(served, adapters):
    # One slot, two adapters and the base model at once: they wait their turn and swap.
    plan = [("a8", 0), ("b16", 1), (MODEL_NAME, 2), ("b16", 0), ("a8", 2)]
    results: dict[int, list[int]] = {}

    def run(i: int, model: str, index: int) -> None:
        results[i] = _tokens(served, model, index)

    threads = [threading.Thread(target=run, args=(i, *p)) for i, p in enumerate(plan)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for i, (model, index) in enumerate(plan):
        adapter = None if model == MODEL_NAME else model
        assert results[i] == adapters.tokens(adapter, index), (model, index)


def test_an_unknown_model_is_a_404_naming_it(served):
    status, answer = _complete(served, "no-such-adapter", 0)
    assert status == 404 and "no-such-adapter" in answer["error"]["message"]


def test_load_and_unload_at_run_time_while_another_adapter_runs(served, adapters):
    streamed: list[list[int]] = []
    thread = threading.Thread(target=lambda: streamed.append(_tokens(served, "a8", 1)))
    thread.start()
    status, text = _post_text(
        served, "/v1/load_lora_adapter", {"lora_name": "c8", "lora_path": str(adapters.c8)}
    )
    assert status == 200 and "c8" in text
    assert _tokens(served, "c8", 1) == adapters.tokens("c8", 1)
    thread.join(60)
    assert streamed == [adapters.tokens("a8", 1)]
    status, text = _post_text(served, "/v1/unload_lora_adapter", {"lora_name": "c8"})
    assert status == 200
    assert _complete(served, "c8", 0)[0] == 404
    status, _ = _post_text(served, "/v1/unload_lora_adapter", {"lora_name": "c8"})
    assert status == 404


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("r32", "over --max-lora-rank 16"),
        ("missing", "no adapter_config.json"),
        ("wrong_shape", "has shape"),
        ("a8", "already loaded"),
    ],
)
def test_a_bad_adapter_is_a_400_with_its_reason(served, adapters, case, message):
    path = adapters.model_dir / "nowhere" if case == "missing" else getattr(adapters, case)
    name = "a8" if case == "a8" else f"bad-{case}"
    status, text = _post_text(
        served, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
    )
    assert status == 400 and message in text, text
    # Nothing else harmed: the adapter is not listed, the others still serve.
    assert name == "a8" or name not in get(served.base_url, "/v1/models")[1]
    assert _tokens(served, "a8", 0) == adapters.tokens("a8", 0)


def test_metrics_say_which_adapters_run(served):
    # While a long a8 request runs, a lora_requests_info series names it running; once it is
    # done, the newest series names nothing.
    body = {"model": "a8", "prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True}
    thread = threading.Thread(target=post_json, args=(served.base_url, "/v1/completions", body))
    thread.start()
    seen_running = False
    while thread.is_alive() and not seen_running:
        seen_running = any('running_lora_adapters="a8"' in line for line in _lora_series(served))
        time.sleep(0.1)
    thread.join(60)
    assert seen_running
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        series = _lora_series(served)
        newest = max(series, key=lambda line: float(line.rsplit(" ", 1)[1]))
        if 'running_lora_adapters=""' in newest:
            break
        time.sleep(0.2)
    assert 'running_lora_adapters=""' in newest and 'waiting_lora_adapters=""' in newest
    assert all('max_lora="1"' in line for line in series)


def _lora_series(served: ServedHttp) -> list[str]:
    status, text = get(served.base_url, "/metrics")
    assert status == 200
    return [line for line in text.splitlines() if line.startswith("conveyor:lora_requests_info{")]


def test_load_inplace_serves_the_folders_new_weights(served, adapters, tmp_path):
    folder = tmp_path / "swap"
    shutil.copytree(adapters.a8, folder)
    body = {"lora_name": "swap", "lora_path": str(folder)}
    assert _post_text(served, "/v1/load_lora_adapter", body)[0] == 200
    assert _tokens(served, "swap", 0) == adapters.tokens("a8", 0)
    shutil.rmtree(folder)
    shutil.copytree(adapters.c8, folder)
    status, text = _post_text(served, "/v1/load_lora_adapter", {**body, "load_inplace": True})
    assert status == 200, text
    # A new adapter to the engine: c8's weights and KV, nothing of a8's reused.
    assert _tokens(served, "swap", 0) == adapters.tokens("c8", 0)
    assert _post_text(served, "/v1/unload_lora_adapter", {"lora_name": "swap"})[0] == 200
