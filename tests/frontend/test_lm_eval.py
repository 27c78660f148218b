"""Scoring through the completions API: lm-evaluation-harness's ``local-completions`` model runs
a multiple-choice task from a local data file against ``conveyor serve``, and every
loglikelihood it reports equals transformers' on the same random-weight model (float32, within
1e-4); the same for ``echo`` with ``logprobs`` and for vLLM's ``prompt_logprobs`` field sent by
hand.

One server (the tiny model, prompts cut into 16-token chunks, prefix caching on: the choices of
a question share their context, so plain requests would hit it). lm-eval asks for each
(context, continuation) pair with ``echo: true, logprobs: 1, max_tokens: 1`` and token ids for a
prompt, and sums the echoed ``token_logprobs`` over the continuation's tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.frontend.http_helpers import MODEL_NAME, ServedHttp, post_json, start_served_http

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lm-eval")]

TOLERANCE = 1e-4
QUESTIONS = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "label": 0},
    {"context": "import os\nimport", "choices": [" sys", " json", " re"], "label": 1},
    {"context": "for i in range(10):\n   ", "choices": [" print(i)", " pass", " break"], "label": 0},
    {"context": "class Point:\n    def __init__(self, x, y):\n        self.x =", "choices": [
        " x", " y", " 0"], "label": 0},
]  # fmt: skip
TASK = """task: conveyor_scoring
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("lm-eval") / "serve.log"
    served = start_served_http(tiny_model_dir, log, ["--max-num-batched-tokens", "16"])
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), -1)


def test_lm_eval_loglikelihoods_equal_transformers(served, hf_model, tiny_model_dir, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "conveyor_scoring.yaml").write_text(TASK.format(data=data))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    lm = LocalCompletionsAPI(
        model=MODEL_NAME,
        base_url=f"{served.base_url}/v1/completions",
        tokenizer=str(tiny_model_dir),
        tokenizer_backend="huggingface",
        num_concurrent=2,
        max_retries=1,
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["conveyor_scoring"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    samples = results["samples"]["conveyor_scoring"]
    assert len(samples) == len(QUESTIONS)
    num_scored = 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            expected = _log_softmax(hf_model, context_ids + continuation_ids)
            start = len(context_ids)
            want = sum(
                expected[start + i - 1, token].item() for i, token in enumerate(continuation_ids)
            )
            loglikelihood, _ = response[0]
            assert abs(loglikelihood - want) < TOLERANCE * len(continuation_ids), (
                context,
                continuation,
                loglikelihood,
                want,
            )
            num_scored += 1
    assert num_scored == sum(len(q["choices"]) for q in QUESTIONS)


def test_echo_with_logprobs_and_prompt_logprobs_equal_transformers(served, hf_model):
    """Echo + logprobs (the completions format, the prompt's tokens first: no value for the very
    first) and vLLM's ``prompt_logprobs`` (None first, then the token and its top rivals by id,
    with rank and text), on a prompt of four chunks."""
    prompt = [(37 * i + 11) % 400 + 3 for i in range(60)]
    expected = _log_softmax(hf_model, prompt)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    status, _, echoed = post_json(
        served.base_url, "/v1/completions", {**body, "echo": True, "logprobs": 2}
    )
    assert status == 200, echoed
    logprobs = echoed["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    values = logprobs["token_logprobs"][1 : len(prompt)]
    assert len(logprobs["token_logprobs"]) == len(prompt) + 1  # and the generated token
    for i, value in enumerate(values):
        assert abs(value - expected[i, prompt[i + 1]].item()) < TOLERANCE, i
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    text = echoed["choices"][0]["text"]
    assert text.startswith("".join(logprobs["tokens"][: len(prompt)]))

    # Only the prompt, scored: max_tokens 0 (as some lm-eval versions send it).
    status, _, only = post_json(
        served.base_url,
        "/v1/completions",
        {**body, "echo": True, "logprobs": 2, "max_tokens": 0},
    )
    assert status == 200, only
    assert only["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:-1]
    assert (
        only["choices"][0]["finish_reason"] == "length" and only["usage"]["completion_tokens"] == 0
    )

    status, _, scored = post_json(
        served.base_url, "/v1/completions", {**body, "prompt_logprobs": 3}
    )
    assert status == 200, scored
    entries = scored["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        own = entry[str(prompt[i + 1])]
        assert abs(own["logprob"] - expected[i, prompt[i + 1]].item()) < TOLERANCE, i
        assert own["rank"] == int((expected[i] > expected[i, prompt[i + 1]]).sum()) + 1
        top = expected[i].topk(3)
        assert {str(t) for t in top.indices.tolist()} <= set(entry) or (
            top.values[1:] - top.values[:-1]
        ).abs().min() < 1e-5
