"""POST /v1/completions: prompts in, n choices per prompt out, whole or streamed.

Runs in an HTTP frontend process, on its event loop. Everything a client can get wrong is
checked before the first engine request is sent, so a 400 never leaves work behind.
"""

from __future__ import annotations

import time

from starlette.responses import Response
from starlette.types import Receive

from conveyor.frontend.input_processor import Choice
from conveyor.frontend.output_processor import ChoiceDelta
from conveyor.frontend.server.logprobs import (
    completion_logprobs,
    echoed_prompt_logprobs,
    join_completion_logprobs,
    prompt_logprobs_entries,
)
from conveyor.frontend.server.request_models import (
    CompletionRequest,
    check_completion_request,
    completion_max_tokens,
    prompt_list,
    response_id_of,
    structured_param,
    to_sampling_params,
)
from conveyor.frontend.server.response_models import (
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
    sse_event,
)
from conveyor.frontend.server.serving import (
    GenerationRun,
    ServingState,
    as_bad_request,
    check_model,
    check_prompts,
    check_sizes,
    ended_normally,
    make_choices,
    prepare_size,
)
from conveyor.protocol import SamplingParams


async def create_completion(
    state: ServingState, body: CompletionRequest, receive: Receive
) -> Response:
    arrival_time = time.monotonic()
    check_model(state, body.model)
    check_completion_request(body)
    prompts = prompt_list(body.prompt)
    check_sizes(state, prompts, body.n, truncating=body.truncate_prompt_tokens is not None)
    defaults = state.inputs.sampling_defaults
    max_tokens = completion_max_tokens(body, defaults)
    vocab_size = state.config.model.vocab_size
    params = to_sampling_params(body, max_tokens, body.logprobs, vocab_size, defaults)
    size = prepare_size(sum(map(len, prompts)), params)
    prepared = await state.run_cpu_unless_small(
        size, _prepare, state, body, prompts, params, max_tokens, arrival_time
    )
    return await _CompletionRun(state, body, *prepared).respond(receive)


def _prepare(
    state: ServingState,
    body: CompletionRequest,
    prompts: list[str | list[int]],
    params: SamplingParams,
    max_tokens: int | None,
    arrival_time: float,
) -> tuple[list[list[int]], str, list[Choice], list[str]]:
    """Tokenize, truncate, check and fan out: work that grows with the input, so on the CPU pool
    unless the input is small. Also the prompts' text, when ``echo`` wants it back."""
    inputs = state.inputs
    with as_bad_request():
        token_ids = [
            p if isinstance(p, list) else inputs.tokenize(p, body.add_special_tokens)
            for p in prompts
        ]
        token_ids = [
            inputs.truncate(ids, body.truncate_prompt_tokens, body.truncation_side)
            for ids in token_ids
        ]
    check_prompts(state, token_ids, max_tokens)
    engine_id, choices = make_choices(
        state, token_ids, params, body.priority, arrival_time, bool(body.stream),
        structured_param(body), body.cache_salt, body.model,
    )  # fmt: skip
    echoed = []
    if body.echo:
        for prompt, ids in zip(prompts, token_ids):
            whole = isinstance(prompt, str) and body.truncate_prompt_tokens is None
            echoed.append(prompt if whole else state.tokenizer.decode(ids))
    return token_ids, response_id_of("cmpl", body, engine_id), choices, echoed


class _CompletionRun(GenerationRun):
    """One completion request in flight: the legacy completions format, text and logprobs."""

    def __init__(
        self,
        state: ServingState,
        body: CompletionRequest,
        prompts: list[list[int]],
        response_id: str,
        choices: list[Choice],
        echoed: list[str],
    ) -> None:
        super().__init__(state, body, prompts, response_id, choices)
        self._text_offsets = [0] * len(choices)
        # ``echo``: each choice's text starts with its prompt's (in a stream, its first chunk).
        self._echoed = echoed
        self._num_samples = len(choices) // len(prompts)
        self._echo_pending = set(range(len(choices))) if echoed else set()
        self._started: set[int] = set()  # choices whose first chunk went out
        if echoed:  # a choice's own tokens start after its echoed prompt's text
            self._text_offsets = [len(echoed[i // self._num_samples]) for i in range(len(choices))]

    def _echo(self, index: int) -> str:
        if index not in self._echo_pending:
            return ""
        self._echo_pending.discard(index)
        return self._echoed[index // self._num_samples]

    def response(self) -> CompletionResponse:
        choices = []
        for choice in self.states:
            text = self._echo(choice.index) + choice.text
            choices.append(self._choice(choice.index, text, choice.logprobs, first=True))
            choices[-1].finish_reason = choice.finish_reason
            choices[-1].stop_reason = choice.stop_reason
            if self.return_token_ids:
                choices[-1].prompt_token_ids = choice.prompt_token_ids
                choices[-1].token_ids = choice.token_ids
        return self._body(choices, self.usage())

    def delta_event(self, delta: ChoiceDelta) -> bytes:
        first = delta.index not in self._started
        text = self._echo(delta.index) + delta.text
        choice = self._choice(delta.index, text, delta.logprobs, first)
        if ended_normally(delta):
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if self.return_token_ids:
            # As vLLM: the prompt's ids with a choice's first chunk, then each chunk's own.
            if delta.index not in self._started:
                choice.prompt_token_ids = self.states[delta.index].prompt_token_ids
            choice.token_ids = delta.token_ids
        self._started.add(delta.index)
        return sse_event(self._body([choice], self.shape.usage(delta.index)))

    def usage_event(self) -> bytes:
        return sse_event(self._body([], self.usage()))

    def _body(
        self, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            self.response_id, self.created, self.state.model_name, choices, usage
        )

    def _choice(self, index: int, text: str, rows: list, first: bool) -> CompletionChoice:
        """A choice's text and logprobs; ``first``: its first appearance, which also carries
        the echoed prompt's logprobs and vLLM's ``prompt_logprobs`` when they were asked for."""
        choice = CompletionChoice(index, text)
        tokenizer, body = self.state.tokenizer, self.body
        prompt_rows = self.states[index].prompt_logprobs if first else None
        if body.logprobs is not None:
            choice.logprobs, self._text_offsets[index] = completion_logprobs(
                tokenizer,
                rows,
                body.logprobs,
                self._text_offsets[index],
                bool(body.return_tokens_as_token_ids),
            )
            if body.echo and prompt_rows is not None:
                prompt_ids = self.states[index].prompt_token_ids
                echoed, _ = echoed_prompt_logprobs(
                    tokenizer, prompt_ids, prompt_rows, body.logprobs
                )
                choice.logprobs = join_completion_logprobs(echoed, choice.logprobs)
        if body.prompt_logprobs is not None and prompt_rows is not None:
            choice.prompt_logprobs = prompt_logprobs_entries(
                tokenizer, prompt_rows, body.prompt_logprobs
            )
        return choice
