"""What both generation endpoints share: the serving state, the pipeline's entry points with its
errors as 400s, usage, streaming responses and the disconnect watch.

Runs in an HTTP frontend process, on its event loop. Prompts go through the same
``InputProcessor`` and ``OutputProcessor`` as ``LLM.generate``; only HTTP's own rules live here.
The loop itself only moves bytes: work that grows with the input (decoding a large body,
tokenizing, the chat template, decoding a long output's text) runs on ``ServingState.cpu_pool``
(``run_cpu``), so one huge request cannot stall the other streams of its frontend, its /health,
or its heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.frontend.engine_client.engine_group import EngineGroupClient
from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.frontend.input_processor import Choice, InputProcessor, PromptError
from conveyor.frontend.output_processor import ChoiceDelta, ChoiceState
from conveyor.frontend.server.choice_stream import stream_choices
from conveyor.frontend.server.errors import (
    RETRY_AFTER_OVERLOADED_S,
    ApiError,
    bad_request,
    error_body,
)
from conveyor.frontend.server.lora_modules import LoRARegistry
from conveyor.frontend.server.metrics import FrontendMetrics
from conveyor.frontend.server.request_log import RequestLogger
from conveyor.frontend.server.response_models import SSE_DONE, UsageInfo, encode_json, sse_event
from conveyor.frontend.server.stream_shape import StreamShape
from conveyor.protocol import FAILED_FINISH_REASONS, EngineConfig, SamplingParams
from conveyor.protocol.lora import LoRARequest
from conveyor.protocol.messages import STRUCTURED_OUTPUT_FAILURE

T = TypeVar("T")

logger = logging.getLogger(__name__)

# One HTTP request may not fan out into more engine requests than this (prompts x n): a small
# body must not be able to queue unbounded work.
MAX_CHOICES_PER_REQUEST = 256
# Threads for tokenizing and templating: HF's fast tokenizers release the GIL, so two threads use
# two cores; more would only queue behind the same cores.
NUM_CPU_THREADS = min(4, os.cpu_count() or 1)
# Input up to this size (characters of prompt text, or prompt token ids) is prepared on the event
# loop itself: tokenizing runs at about 1 us per character, so this holds the loop for half a
# millisecond at most, and handing a small request to a thread costs more than that in throughput
# (``python -m benchmarks tokenize``: 32-token prompts, 1.2x the requests per second on the loop).
LOOP_PREPARE_LIMIT = 512


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready; its work was aborted."""


@dataclass
class ServingState:
    """Everything a handler needs, made once when the frontend starts."""

    client: EngineGroupClient
    tokenizer: Any
    model_name: str
    # None: --disable-metrics (nothing recorded, /metrics answers 404).
    metrics: FrontendMetrics | None
    max_request_body_bytes: int
    # None unless --enable-log-requests.
    request_log: RequestLogger | None = None
    # Every name requests may give the model (--served-model-name a b); empty: model_name.
    model_names: tuple[str, ...] = ()
    # The LoRA adapters a request's model may name (--enable-lora); None: none.
    loras: LoRARegistry | None = None
    # Generation requests whose body has arrived and whose response has not ended yet: the
    # per-frontend queue cap and the drain count them.
    num_in_flight: int = 0
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    inputs: InputProcessor = field(init=False)
    cpu_pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.model_names = self.model_names or (self.model_name,)
        self.inputs = InputProcessor(
            self.client.config,
            self.tokenizer,
            strict_context=True,
            max_choices=MAX_CHOICES_PER_REQUEST,
        )
        self.cpu_pool = ThreadPoolExecutor(NUM_CPU_THREADS, thread_name_prefix="frontend-cpu")

    async def run_cpu(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)`` on the CPU pool, off the event loop."""
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, call)

    async def run_cpu_unless_small(
        self, size: int, function: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``function(*args, **kwargs)`` on the event loop if its input's ``size`` is within
        ``LOOP_PREPARE_LIMIT``, else on the CPU pool (``run_cpu``)."""
        if size <= LOOP_PREPARE_LIMIT:
            return function(*args, **kwargs)
        return await self.run_cpu(function, *args, **kwargs)

    def close(self) -> None:
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def config(self) -> EngineConfig:
        return self.client.config


def check_model(state: ServingState, model: str | None) -> None:
    # An omitted model means the one this server serves (as vLLM allows).
    if model is not None and model not in state.model_names and lora_of(state, model) is None:
        raise ApiError(404, f"the model {model!r} does not exist", "model")


def lora_of(state: ServingState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's ``model`` names, or None (the base model)."""
    return state.loras.get(model) if state.loras is not None else None


@contextlib.contextmanager
def as_bad_request() -> Iterator[None]:
    """The pipeline's ``PromptError`` as a 400 naming the field."""
    try:
        yield
    except PromptError as exc:
        raise bad_request(str(exc), exc.param) from None


def check_sizes(
    state: ServingState, prompts: Sequence[str | Sequence[int]], n: int, truncating: bool = False
) -> None:
    """The checks that cost no more than a ``len`` (choices, prompt lengths): on the loop,
    before anything is tokenized, so an oversized request is refused at once."""
    with as_bad_request():
        state.inputs.check_sizes(prompts, n, truncating)


def check_prompts(
    state: ServingState, prompts: Sequence[list[int]], max_tokens: int | None
) -> None:
    """400 unless every prompt can run; prompts are numbered in the message when there are
    several."""
    with as_bad_request():
        for i, token_ids in enumerate(prompts):
            state.inputs.check_prompt(token_ids, max_tokens, i if len(prompts) > 1 else None)


def make_choices(
    state: ServingState,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    priority: int,
    arrival_time: float,
    stream: bool,
    structured_param: str = "structured_outputs",
    cache_salt: str | None = None,
    model: str | None = None,
) -> tuple[str, list[Choice]]:
    """A fresh id for the response and one engine request per choice (index = prompt index * n
    + sample); a structured-output constraint is checked here, its errors reported against
    ``structured_param``."""
    base_id = uuid.uuid4().hex
    with as_bad_request():
        choices = state.inputs.make_choices(
            prompts,
            params,
            base_id,
            arrival_time,
            priority=priority,
            stream=stream,
            structured_param=structured_param,
            cache_salt=cache_salt,
            lora_request=lora_of(state, model),
        )
    return base_id, choices


def prepare_size(size: int, params: SamplingParams) -> int:
    """The size that decides where a request is prepared (``run_cpu_unless_small``): a
    structured-output constraint is compiled and checked then, which is never small."""
    return size if params.structured_outputs is None else LOOP_PREPARE_LIMIT + size + 1


def usage(prompts: Sequence[list[int]], choices: Sequence[ChoiceState]) -> UsageInfo:
    # A prompt counts once however many samples it has, as in OpenAI's API.
    num_prompt = sum(len(p) for p in prompts)
    num_completion = sum(len(c.token_ids) for c in choices)
    return UsageInfo(num_prompt, num_completion, num_prompt + num_completion)


def raise_on_error(choices: Sequence[ChoiceState]) -> None:
    """A choice the engine failed or refused fails the whole response (500 or 429)."""
    for choice in choices:
        if choice.finish_reason == "rejected":
            raise overloaded(str(choice.stop_reason))
    for choice in choices:
        if choice.finish_reason == "error":
            reason = str(choice.stop_reason)
            if reason.startswith(STRUCTURED_OUTPUT_FAILURE):
                # The constraint, not the engine: it cannot be met past some token.
                raise ApiError(400, f"the constraint could not be followed: {reason}")
            raise ApiError(500, f"the engine failed the request: {reason}")


def overloaded(reason: str) -> ApiError:
    return ApiError(429, reason, retry_after_s=RETRY_AFTER_OVERLOADED_S)


class GenerationRun(ABC):
    """One generation request in flight: its choices, its response id, and what both endpoints
    do with them (run them to the end, or frame their deltas as server-sent events). Subclasses
    say how a whole response, a delta and the closing usage chunk look."""

    def __init__(
        self,
        state: ServingState,
        body: Any,
        prompts: list[list[int]],
        response_id: str,
        choices: list[Choice],
    ) -> None:
        self.state = state
        self.body = body
        self.prompts = prompts
        self.response_id = response_id
        self.choices = choices
        self.states = [choice.state for choice in choices]
        self.created = int(time.time())
        options = body.stream_options
        continuous_usage = (
            options is not None and options.include_usage and options.continuous_usage_stats
        )
        self.shape = StreamShape(self.states, body.stream_interval, continuous_usage)
        self.return_token_ids = bool(body.return_token_ids)

    @abstractmethod
    def response(self) -> msgspec.Struct:
        """The whole response, once every choice has ended."""

    @abstractmethod
    def delta_event(self, delta: ChoiceDelta) -> bytes:
        """One delta as a server-sent event."""

    @abstractmethod
    def usage_event(self) -> bytes:
        """The last chunk of a stream that asked for ``stream_options.include_usage``."""

    def usage(self) -> UsageInfo:
        return usage(self.prompts, self.states)

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        state = self.state
        return stream_choices(
            state.client,
            self.choices,
            state.run_cpu,
            state.metrics,
            state.request_log,
            self.response_id,
            n=len(self.choices) // len(self.prompts),
        )

    async def collect(self) -> msgspec.Struct:
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for _ in deltas:
                pass
        raise_on_error(self.states)
        return self.response()

    async def events(self, source: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(source) as deltas:  # type: ignore[type-var]
                async for taken in deltas:
                    delta = self.shape.take(taken)
                    if delta is None:
                        continue  # held back by stream_interval
                    # A failed choice sends nothing itself: the error event below reports it.
                    ended = delta.finish_reason not in (None, *FAILED_FINISH_REASONS)
                    with_ids = self.return_token_ids and delta.token_ids
                    if delta.text or delta.logprobs or ended or with_ids:
                        yield self.delta_event(delta)
            raise_on_error(self.states)
        except ApiError as exc:
            yield sse_event(error_body(exc.status, exc.message))
        except EngineDeadError as exc:
            yield sse_event(error_body(503, f"the engine failed: {exc}"))
        except Exception as exc:
            # Ours, not the engine's: said as the whole response's 500 says it, and logged.
            logger.exception("unexpected error streaming %s", self.response_id)
            yield sse_event(error_body(500, f"internal error: {type(exc).__name__}"))
        else:
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield self.usage_event()
        yield SSE_DONE

    async def respond(self, receive: Receive) -> Response:
        """A stream (headers with the engine's first output) or a whole JSON response."""
        if self.body.stream:
            return SSEResponse(self.events(await start_stream(receive, self.deltas())))
        response = await run_unless_disconnected(receive, self.collect())
        return Response(encode_json(response), media_type="application/json")


def ended_normally(delta: ChoiceDelta) -> bool:
    """The delta ends its choice with a reason a client is shown (a failure is an error event)."""
    return delta.finish_reason is not None and delta.finish_reason not in FAILED_FINISH_REASONS


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
