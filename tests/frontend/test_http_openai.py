"""The OpenAI-compatible HTTP server, through the official ``openai`` client, against real processes.

One ``conveyor serve --frontends 2`` per module (engine core, one worker, two frontends sharing a
port) plus one frontend attached by hand with ``conveyor frontend``. Greedy outputs are compared
with ``frontend.LLM`` on the same prompts. The last test kills the engine core (which stops the
whole server), so it must stay last; tests/frontend/test_http_faults.py kills a frontend.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from conveyor.entrypoints.serve import DEMO_MAX_TOKENS
from conveyor.frontend import LLM
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import SamplingParams
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    frontend_pid_of,
    frontend_pids,
    get,
    metric,
    parse_metrics,
    post_json,
    read_events,
    read_to_end,
    send_completion,
    start_attached_frontend,
    start_served_http,
    stream_text,
    wait_for,
)
from tests.process_tree import descendants, kill_all, wait_until_gone

# One server per module: with --dist loadgroup, xdist keeps a module on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-openai")]

TEXT_PROMPTS = ["def main():", "import os\nimport sys\n", "class Foo(object):"]
TOKEN_PROMPT = [5, 6, 7, 8, 9, 10]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
MAX_TOKENS = 12
SEEDED = dict(n=3, temperature=1.0, seed=7, max_tokens=10)
# Sampled, with n, a stop string and logprobs: everything the two APIs' pipeline does.
PIPELINE = dict(n=2, temperature=0.9, seed=11, max_tokens=16)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("http") / "serve.log"
    extra = ["--frontends", "2", "--demo-prompt", TEXT_PROMPTS[0]]
    served = start_served_http(tiny_model_dir, log, extra)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, object]:
    """What ``frontend.LLM`` (in-process engine) produces for the prompts the tests send."""
    tokenizer = load_tokenizer(tiny_model_dir)
    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = list(tokenizer(chat_text, add_special_tokens=False).input_ids)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(str(tiny_model_dir), engine="inprocess", kv_cache_memory=16 << 20) as llm:
        outputs = llm.generate([*TEXT_PROMPTS, TOKEN_PROMPT, chat_ids], greedy, use_tqdm=False)
        seeded = llm.generate([TEXT_PROMPTS[0]], SamplingParams(**SEEDED), use_tqdm=False)
        demo_params = SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS)
        demo = llm.generate([TEXT_PROMPTS[0]], demo_params, use_tqdm=False)
        # A stop string that one choice certainly meets: two characters from its middle.
        unstopped = llm.generate(
            TEXT_PROMPTS[:1], SamplingParams(**PIPELINE, top_k=50), use_tqdm=False
        )
        text = unstopped[0].outputs[0].text
        stop = next(text[i : i + 2] for i in range(4, len(text)) if "\ufffd" not in text[i : i + 2])
        pipeline_params = SamplingParams(**PIPELINE, top_k=50, logprobs=1, stop=[stop])
        pipeline = llm.generate(TEXT_PROMPTS, pipeline_params, use_tqdm=False)
    return {
        "greedy": outputs,
        "seeded": seeded[0],
        "demo": demo[0],
        "pipeline": pipeline,
        "pipeline_stop": stop,
        "tokenizer": tokenizer,
    }


@pytest.fixture(scope="module")
def client(served: ServedHttp) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0)


def _by_index(choices: list) -> list:
    return sorted(choices, key=lambda c: c.index)


def test_the_demo_prompt_prints_the_greedy_completion(served, reference):
    # The README's quick start relies on these lines.
    lines = [served.stdout.get(timeout=30.0)]
    while not lines[-1].startswith("try: curl "):
        lines.append(served.stdout.get(timeout=5.0))
    demo = reference["demo"].outputs[0]
    # The prompt and its completion as one text, so that code reads as code; a blank line after.
    expected = f"completion ({demo.finish_reason}):\n{TEXT_PROMPTS[0]}{demo.text}\n\n"
    assert "".join(lines[:-1]) == expected


def test_completions_equal_llm_whole_and_streamed(client, reference):
    greedy = reference["greedy"]
    response = client.completions.create(
        model=MODEL_NAME, prompt=TEXT_PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.object == "text_completion" and response.model == MODEL_NAME
    assert [c.text for c in _by_index(response.choices)] == [o.outputs[0].text for o in greedy[:3]]
    assert [c.finish_reason for c in _by_index(response.choices)] == ["length"] * 3
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in greedy[:3])
    assert response.usage.completion_tokens == 3 * MAX_TOKENS
    assert response.usage.total_tokens == response.usage.prompt_tokens + 3 * MAX_TOKENS

    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=TOKEN_PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert by_ids.choices[0].text == greedy[3].outputs[0].text

    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=TEXT_PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [o.outputs[0].text for o in greedy[:3]]
    assert finish == ["length"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * MAX_TOKENS


def test_chat_equals_llm_on_the_templated_prompt(client, reference):
    expected = reference["greedy"][4]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    message = response.choices[0].message
    assert response.object == "chat.completion" and message.role == "assistant"
    assert message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)

    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        logprobs=True,
        top_logprobs=2,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == MAX_TOKENS
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        # Greedy takes the most likely token, so its logprob is the best of the top-k.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_seeded_samples_are_reproducible_and_match_llm(client, reference):
    kwargs = dict(model=MODEL_NAME, prompt=TEXT_PROMPTS[0], **SEEDED)
    first = [c.text for c in _by_index(client.completions.create(**kwargs).choices)]
    again = [c.text for c in _by_index(client.completions.create(**kwargs).choices)]
    assert first == again
    assert first == [o.text for o in reference["seeded"].outputs]
    assert len(set(first)) > 1, "n samples with seed + i should differ"


def test_completions_and_llm_generate_give_identical_tokens_and_text(client, reference):
    """One request pipeline: the same prompts and sampling through ``/v1/completions`` and
    ``LLM.generate`` give the same tokens (each sampled token's text and logprob), text, finish
    and stop reasons, choice by choice."""
    tokenizer = reference["tokenizer"]
    expected = [c for out in reference["pipeline"] for c in out.outputs]
    prompts = TEXT_PROMPTS
    for stream in (False, True):
        chunks = client.completions.create(
            model=MODEL_NAME,
            prompt=prompts,
            logprobs=1,
            stream=stream,
            extra_body={"top_k": 50},
            stop=[reference["pipeline_stop"]],
            **PIPELINE,
        )
        choices = _merge_stream(chunks) if stream else _whole_choices(chunks)
        assert len(choices) == len(expected) == len(prompts) * PIPELINE["n"]
        for choice, want in zip(choices, expected):
            assert choice["text"] == want.text, (stream, choice["index"])
            assert choice["finish_reason"] == want.finish_reason
            assert choice["stop_reason"] == want.stop_reason
            tokens = [tokenizer.decode([t]) for t in want.token_ids]
            assert choice["tokens"] == tokens, (stream, choice["index"])
            values = [row[t] for row, t in zip(want.logprobs, want.token_ids)]
            # The server's engine may meet these requests in other step arrangements than
            # LLM.generate's, and a linear's row count picks its kernel (and so its rounding):
            # the tokens are equal, the logprobs within the parity tests' 1e-4.
            assert choice["token_logprobs"] == pytest.approx(values, abs=1e-4)
    assert {c.finish_reason for c in expected} >= {"stop"}, "no choice met a stop string"
    assert len({tuple(c.token_ids) for c in expected}) > len(TEXT_PROMPTS), "samples differ"


def _whole_choices(response) -> list[dict]:
    return [
        {
            "index": c.index,
            "text": c.text,
            "tokens": c.logprobs.tokens,
            "token_logprobs": c.logprobs.token_logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.to_dict().get("stop_reason"),
        }
        for c in _by_index(response.choices)
    ]


def _merge_stream(chunks) -> list[dict]:
    """A streamed completion folded back into whole choices (text, tokens, reasons)."""
    merged: dict[int, dict] = {}
    for chunk in chunks:
        for part in chunk.choices:
            choice = merged.setdefault(part.index, {"index": part.index, "text": "",
                                                    "tokens": [], "token_logprobs": [],
                                                    "finish_reason": None, "stop_reason": None})  # fmt: skip
            choice["text"] += part.text
            if part.logprobs is not None:
                choice["tokens"] += part.logprobs.tokens
                choice["token_logprobs"] += part.logprobs.token_logprobs
            if part.finish_reason is not None:
                choice["finish_reason"] = part.finish_reason
                choice["stop_reason"] = part.to_dict().get("stop_reason")
    return [merged[i] for i in sorted(merged)]


def test_completion_logprobs_in_openai_format(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt=TEXT_PROMPTS[1], max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert logprobs.text_offset[0] == 0
    assert all(a <= b for a, b in zip(logprobs.text_offset, logprobs.text_offset[1:]))
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0.0 and 1 <= len(top) <= 4 and top[token] == value
        assert value == pytest.approx(max(top.values()), abs=1e-5)


def test_stop_strings_end_and_truncate_the_text(client, reference):
    full = reference["greedy"][0].outputs[0].text
    # Two plain characters from the middle: the model's byte tokens may also print U+FFFD.
    windows = [full[i : i + 2] for i in range(3, len(full) - 2)]
    stop = next(w for w in windows if "\ufffd" not in w and w.strip())
    cut = full.find(stop)
    assert stop and cut + len(stop) < len(full), f"the reference text is too short: {full!r}"
    kwargs = dict(model=MODEL_NAME, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)

    choice = client.completions.create(stop=[stop, "never-seen-stop"], **kwargs).choices[0]
    assert (choice.text, choice.finish_reason) == (full[:cut], "stop")
    assert choice.to_dict()["stop_reason"] == stop

    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"

    kept = client.completions.create(
        stop=stop, extra_body={"include_stop_str_in_output": True}, **kwargs
    )
    assert kept.choices[0].text == full[: cut + len(stop)]


def test_a_stop_token_ends_the_text_before_it_but_counts_as_a_token(client, reference):
    greedy = reference["greedy"][0].outputs[0]
    tokenizer = reference["tokenizer"]
    # The first output token whose text is plain and non-empty: it would show if kept.
    cut = next(
        i
        for i, t in enumerate(greedy.token_ids[1:], 1)
        if tokenizer.decode([t]).strip() and "\ufffd" not in tokenizer.decode([t])
    )
    stop_id = greedy.token_ids[cut]
    cut = greedy.token_ids.index(stop_id)  # it may come earlier: the first one stops
    expected = tokenizer.decode(greedy.token_ids[:cut], skip_special_tokens=True)
    kwargs = dict(model=MODEL_NAME, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    body = {"stop_token_ids": [stop_id]}

    whole = client.completions.create(extra_body=body, **kwargs)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    assert whole.choices[0].to_dict()["stop_reason"] == stop_id
    assert whole.usage.completion_tokens == cut + 1
    streamed = list(client.completions.create(extra_body=body, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == expected
    kept = client.completions.create(
        extra_body={**body, "include_stop_str_in_output": True}, **kwargs
    )
    assert kept.choices[0].text == tokenizer.decode(
        greedy.token_ids[: cut + 1], skip_special_tokens=True
    )


def test_nulls_the_client_sends_mean_the_defaults(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=2, n=None, stream=None, logprobs=None
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    completion = client.completions.create(
        model=MODEL_NAME, prompt=TEXT_PROMPTS[0], max_tokens=2, n=None, echo=None, stream=None
    )
    assert len(completion.choices) == 1
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=2, stream_options={"include_usage": True}
        )


SUCCESS = "conveyor:request_success_total"


def test_two_frontends_serve_parallel_requests(served, reference):
    prompts = [*TEXT_PROMPTS, TOKEN_PROMPT] * 6
    expected = [o.outputs[0].text for o in reference["greedy"][:4]] * 6
    body = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    pids = frontend_pids(served.process.pid)
    samples = parse_metrics(get(served.base_url, "/metrics")[1])
    before = metric(samples, SUCCESS, finished_reason="length")

    def complete(prompt: str | list[int]) -> tuple[int, str]:
        # A fresh connection each: the kernel spreads connections over the two frontends.
        with send_completion(served.base_url, {**body, "prompt": prompt}) as sock:
            pid = frontend_pid_of(sock, pids)
            text, reason = stream_text(read_to_end(sock))
        assert reason == "length"
        return pid, text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(complete, prompts))
    assert [text for _, text in results] == expected
    assert {pid for pid, _ in results} == set(pids), "both frontends served requests"
    # A scrape of either frontend counts both frontends' requests.
    for _ in range(6):
        samples = parse_metrics(get(served.base_url, "/metrics")[1])
        assert metric(samples, SUCCESS, finished_reason="length") == before + len(prompts)


@pytest.fixture(scope="module")
def attached(served: ServedHttp, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A third frontend, started by hand on its own port against the running engine."""
    log = tmp_path_factory.mktemp("attached") / "conveyor.frontend.log"
    process, base_url = start_attached_frontend(served.engine_address, log)
    try:
        yield base_url
        assert process.poll() is None, "the attached frontend died"
        # Whether or not the engine is gone (the last test stops it), SIGTERM drains, exits 0.
        process.send_signal(signal.SIGTERM)
        assert process.wait(15.0) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5.0)


def _engine_metrics(base_url: str) -> dict[str, float]:
    samples = parse_metrics(get(base_url, "/metrics")[1])
    return {
        "running": metric(samples, "conveyor:num_requests_running"),
        "kv": metric(samples, "conveyor:kv_cache_usage_perc"),
        "aborted": metric(samples, "conveyor:request_success_total", finished_reason="abort"),
        "seconds_per_token": metric(samples, "conveyor:inter_token_latency_seconds_sum")
        / metric(samples, "conveyor:inter_token_latency_seconds_count"),
    }


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
def test_a_disconnect_aborts_the_request_and_frees_its_blocks(attached, reference, stream):
    prompt = TEXT_PROMPTS[2]
    greedy = {"prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS}
    response = post_json(attached, "/v1/completions", greedy)[2]
    assert response["choices"][0]["text"] == reference["greedy"][2].outputs[0].text
    before = _engine_metrics(attached)
    long_request = {"prompt": prompt, "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    sock = send_completion(attached, long_request)
    try:
        if stream:
            read_events(sock, 3)
        busy = wait_for(lambda: (m := _engine_metrics(attached))["running"] > 0 and m, 10.0)
        assert busy and busy["kv"] > 0, busy
    finally:
        sock.close()
    closed_at = time.monotonic()
    # The engine's gauges (running, KV) and the frontend's abort count move on their own: the
    # abort goes to the engine as the choice's stream closes, the count a moment later, when the
    # handler's cleanup runs (a loaded run saw the gauges at idle first). Wait for both.
    aborted = before["aborted"] + 1
    idle = wait_for(
        lambda: (m := _engine_metrics(attached))["running"] == 0 and m["aborted"] == aborted and m,
        10.0,
    )
    assert idle and idle["kv"] == 0.0, (idle, _engine_metrics(attached), aborted)
    # Idle because it was aborted, not because it ran to the end: that takes far longer.
    assert time.monotonic() - closed_at < 0.25 * 4000 * idle["seconds_per_token"]


def test_a_dead_engine_fails_open_streams_and_stops_the_supervisor(served, attached):
    """Row 6 through HTTP: SIGKILL the engine core with a stream open."""
    children = descendants(served.process.pid)
    assert len(frontend_pids(served.process.pid)) == 2
    # A stream on the attached frontend, which outlives the supervisor and so can be watched.
    long_request = {"prompt": TEXT_PROMPTS[0], "max_tokens": 4000, "ignore_eos": True}
    sock = send_completion(attached, {**long_request, "stream": True})
    try:
        received = read_events(sock, 1)
        os.kill(served.engine_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while b"data: [DONE]" not in received:
            data = sock.recv(65536)
            assert data, f"the stream closed without [DONE]: {received[-300:]!r}"
            received += data
        assert time.monotonic() - killed_at < 10.0
        assert served.process.wait(15.0) == 1
    finally:
        sock.close()
        kill_all(children)
    assert wait_until_gone(children, 10.0) == [], "the supervisor left children behind"
    death = rf"engine_core \(pid {served.engine_pid}\) exited with code -9; stopping everything"
    assert re.search(death, served.log.read_text())
    # The stream ended with an error event, then [DONE].
    error_event = received[received.rindex(b'data: {"error"') : received.rindex(b"data: [DONE]")]
    assert b'"code":503' in error_event and b"engine" in error_event
    # The frontend outlives the engine: it says so, and refuses new work with 503.
    assert wait_for(lambda: get(attached, "/health")[0] == 503, 10.0)
    status, headers, body = post_json(attached, "/v1/completions", {"prompt": "x"})
    assert status == 503 and int(headers["retry-after"]) > 0
    assert body["error"]["code"] == 503 and "engine" in body["error"]["message"]
    # The attached fixture then checks that a SIGTERMed frontend still drains and exits 0.
