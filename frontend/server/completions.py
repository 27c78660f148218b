"""POST /v1/completions: prompts in, n choices per prompt out, whole or streamed.

Runs in an HTTP frontend process, on its event loop. Everything a client can get wrong is
checked before the first engine request is sent, so a 400 never leaves work behind.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive

from frontend.input_processor import Choice
from frontend.output_processor import ChoiceDelta
from frontend.server.choice_stream import stream_choices
from frontend.server.errors import ApiError, error_body
from frontend.server.logprobs import completion_logprobs
from frontend.server.request_models import (
    CompletionRequest,
    check_completion_request,
    prompt_list,
    to_sampling_params,
)
from frontend.server.response_models import (
    SSE_DONE,
    CompletionChoice,
    CompletionResponse,
    encode_json,
    sse_event,
)
from frontend.server.serving import (
    ServingState,
    SSEResponse,
    as_bad_request,
    check_model,
    check_prompts,
    make_choices,
    raise_on_error,
    run_unless_disconnected,
    start_stream,
    usage,
)
from protocol import FAILED_FINISH_REASONS


async def create_completion(
    state: ServingState, body: CompletionRequest, receive: Receive
) -> Response:
    arrival_time = time.monotonic()
    check_model(state, body.model)
    check_completion_request(body)
    with as_bad_request():
        prompts = [
            p if isinstance(p, list) else state.inputs.tokenize(p) for p in prompt_list(body.prompt)
        ]
    check_prompts(state, prompts, body.max_tokens)
    params = to_sampling_params(body, body.max_tokens, body.logprobs, state.config.model.vocab_size)
    response_id, choices = make_choices(
        state, prompts, params, body.priority, arrival_time, bool(body.stream)
    )
    run = _CompletionRun(state, body, prompts, f"cmpl-{response_id}", choices)
    if body.stream:
        return SSEResponse(run.events(await start_stream(receive, run.deltas())))
    response = await run_unless_disconnected(receive, run.collect())
    return Response(encode_json(response), media_type="application/json")


class _CompletionRun:
    """One completion request in flight: its choices and response id."""

    def __init__(
        self,
        state: ServingState,
        body: CompletionRequest,
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
        self._text_offsets = [0] * len(choices)

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        return stream_choices(self.state.client, self.choices, self.state.metrics)

    async def collect(self) -> CompletionResponse:
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for _ in deltas:
                pass
        raise_on_error(self.states)
        choices = []
        for choice in self.states:
            choices.append(self._choice(choice.index, choice.text, choice.logprobs))
            choices[-1].finish_reason = choice.finish_reason
            choices[-1].stop_reason = choice.stop_reason
        return CompletionResponse(
            self.response_id,
            self.created,
            self.state.model_name,
            choices,
            usage(self.prompts, self.states),
        )

    async def events(self, source: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(source) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    # A failed choice sends nothing itself: the error event below reports it.
                    ended = delta.finish_reason not in (None, *FAILED_FINISH_REASONS)
                    if delta.text or delta.logprobs or ended:
                        yield sse_event(self._chunk(delta))
            raise_on_error(self.states)
        except ApiError as exc:
            yield sse_event(error_body(exc.status, exc.message))
        except Exception as exc:  # EngineDeadError above all: the stream ends with an error event
            yield sse_event(error_body(503, f"the engine failed: {exc}"))
        else:
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield sse_event(
                    CompletionResponse(
                        self.response_id,
                        self.created,
                        self.state.model_name,
                        [],
                        usage(self.prompts, self.states),
                    )
                )
        yield SSE_DONE

    def _chunk(self, delta: ChoiceDelta) -> CompletionResponse:
        choice = self._choice(delta.index, delta.text, delta.logprobs)
        if delta.finish_reason is not None and delta.finish_reason not in FAILED_FINISH_REASONS:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        return CompletionResponse(self.response_id, self.created, self.state.model_name, [choice])

    def _choice(self, index: int, text: str, rows: list) -> CompletionChoice:
        choice = CompletionChoice(index, text)
        if self.body.logprobs is not None:
            choice.logprobs, self._text_offsets[index] = completion_logprobs(
                self.state.tokenizer, rows, self.body.logprobs, self._text_offsets[index]
            )
        return choice
