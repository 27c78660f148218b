"""What both generation endpoints share: the serving state, prompt checks, fan-out, usage,
streaming responses and the disconnect watch.

Runs in an HTTP frontend process, on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from frontend.async_engine_client import AsyncEngineClient
from frontend.choice_tracker import ChoiceDelta, ChoiceTracker
from frontend.http_errors import RETRY_AFTER_OVERLOADED_S, ApiError, bad_request
from frontend.http_metrics import ServerMetrics
from frontend.openai_responses import UsageInfo
from frontend.validation import context_limit, find_kv_cache_problem, find_prompt_problem
from protocol import EngineConfig, EngineCoreRequest, SamplingParams

T = TypeVar("T")

# One HTTP request may not fan out into more engine requests than this (prompts x n): a small
# body must not be able to queue unbounded work.
MAX_CHOICES_PER_REQUEST = 256


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready; its work was aborted."""


@dataclass
class ServingState:
    """Everything a handler needs, made once when the frontend starts."""

    client: AsyncEngineClient
    tokenizer: Any
    model_name: str
    metrics: ServerMetrics
    max_request_body_bytes: int
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def config(self) -> EngineConfig:
        return self.client.config


def check_model(state: ServingState, model: str | None) -> None:
    # An omitted model means the one this server serves (as vLLM allows).
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist", "model")


def tokenize(state: ServingState, text: str) -> list[int]:
    return list(state.tokenizer(text).input_ids)


def check_prompt(
    state: ServingState, token_ids: list[int], max_tokens: int | None, index: int | None = None
) -> None:
    """400 unless the prompt is valid, prompt + max_tokens fits the context (vLLM's rule) and
    the engine's whole KV cache (else the engine could only fail it, a 500)."""
    config = state.config
    max_model_len = context_limit(config)
    where = "" if index is None else f"prompt {index}: "
    problem = find_prompt_problem(token_ids, config.model.vocab_size, max_model_len)
    if problem is not None:
        raise bad_request(where + problem, "prompt")
    if max_tokens is not None and len(token_ids) + max_tokens > max_model_len:
        raise bad_request(
            f"{where}this model's maximum context length is {max_model_len} tokens, but "
            f"{len(token_ids) + max_tokens} were requested ({len(token_ids)} in the prompt, "
            f"{max_tokens} for the completion); shorten the prompt or lower max_tokens",
            "max_tokens",
        )
    problem = find_kv_cache_problem(len(token_ids), max_tokens, config.cache)
    if problem is not None:
        raise bad_request(where + problem, "max_tokens")


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """n samples -> n single-sample engine requests; seeded ones get seed + i so they differ
    (the same rule as ``LLM.generate``, so a seed gives the same choices through both)."""
    if params.n == 1:
        return [params]
    return [
        msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


def make_choices(
    state: ServingState,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    priority: int,
    arrival_time: float,
) -> tuple[list[EngineCoreRequest], list[ChoiceTracker]]:
    """One engine request and tracker per choice; choice index = prompt index * n + sample."""
    if len(prompts) * params.n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(
            f"{len(prompts)} prompts x n={params.n} exceeds {MAX_CHOICES_PER_REQUEST} choices "
            "per request",
            "n",
        )
    try:
        samples = fan_out(params)
    except ValueError as exc:  # seed + i past the 64-bit range
        raise bad_request(f"with n={params.n}: {exc}", "seed") from None
    base_id = uuid.uuid4().hex
    eos = list(state.config.model.eos_token_ids)
    now = time.time()
    requests, trackers = [], []
    for prompt_index, token_ids in enumerate(prompts):
        for sample, sample_params in enumerate(samples):
            index = prompt_index * params.n + sample
            request_id = f"{base_id}-{index}"
            requests.append(
                EngineCoreRequest(request_id, token_ids, sample_params, now, priority, eos)
            )
            trackers.append(
                ChoiceTracker(
                    index, request_id, state.tokenizer, token_ids, sample_params, arrival_time
                )
            )
    return requests, trackers


def usage(prompts: Sequence[list[int]], trackers: Sequence[ChoiceTracker]) -> UsageInfo:
    # A prompt counts once however many samples it has, as in OpenAI's API.
    num_prompt = sum(len(p) for p in prompts)
    num_completion = sum(len(t.token_ids) for t in trackers)
    return UsageInfo(num_prompt, num_completion, num_prompt + num_completion)


def raise_on_error(trackers: Sequence[ChoiceTracker]) -> None:
    """A choice the engine failed or refused fails the whole response (500 or 429)."""
    for tracker in trackers:
        if tracker.finish_reason == "rejected":
            raise overloaded(str(tracker.stop_reason))
    for tracker in trackers:
        if tracker.finish_reason == "error":
            raise ApiError(500, f"the engine failed the request: {tracker.stop_reason}")


def overloaded(reason: str) -> ApiError:
    return ApiError(429, reason, retry_after_s=RETRY_AFTER_OVERLOADED_S)


async def start_stream(
    receive: Receive, deltas: AsyncIterator[ChoiceDelta]
) -> AsyncIterator[ChoiceDelta]:
    """Wait for the engine's first answer, then hand the whole stream back.

    No header goes out before it: a request the engine refuses (its queue is full) or cannot
    serve (it died) gets a 429 or 503 instead of a 200 stream that ends in an error event. The
    client waits no longer for it: the first token comes in the same moment as the headers.
    """
    try:
        first = await run_unless_disconnected(receive, anext(deltas, None))
        if first is not None and first.finish_reason == "rejected":
            raise overloaded(str(first.stop_reason))
    except BaseException:
        await deltas.aclose()  # type: ignore[attr-defined]
        raise
    return _prepended(first, deltas)


async def _prepended(
    first: ChoiceDelta | None, rest: AsyncIterator[ChoiceDelta]
) -> AsyncIterator[ChoiceDelta]:
    async with contextlib.aclosing(rest):  # type: ignore[type-var]
        if first is not None:
            yield first
        async for delta in rest:
            yield delta


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends.

    Starlette cancels the sending task when the client disconnects, which may leave the generator
    suspended at a ``yield``; closing it here runs its cleanup (the engine aborts) at once.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so aborting its engine requests) if the client leaves."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.cancelled() or not work_task.done():
        # Give the cancelled work its chance to clean up before answering.
        await asyncio.gather(work_task, return_exceptions=True)
        raise ClientDisconnected()
    return work_task.result()
