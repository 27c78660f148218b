"""Per-client outputs of one step: sampled tokens, and the endings the model did not decide.

Runs in the engine-core process. Each frontend (``client_index``) gets one ``EngineCoreOutputs``
per step with an entry for each of its requests that sampled a token, and one final entry for
each request that was aborted or failed since the previous step.
"""

from __future__ import annotations

import time

from conveyor.engine_core.request import Request, RequestStatus
from conveyor.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    Logprobs,
    ModelRunnerOutput,
    SchedulerStats,
)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class OutputCollector:
    """Outputs gathered for each client until ``take`` hands them out."""

    def __init__(self) -> None:
        self._by_client: dict[int, list[EngineCoreOutput]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_client)

    def add_final(self, request: Request) -> None:
        """The one output of a request that ended without a sampled token (abort, error)."""
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            timings=request.timings(time.monotonic()),
        )
        self._by_client.setdefault(request.client_index, []).append(output)

    def add_sampled(
        self, requests: dict[int, Request], runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Append each sampled token to its request and record it; returns those now finished.

        A token for a request that has ended (aborted after the step was scheduled, or finished
        by the step before: async scheduling runs one step past a stop token) is dropped. A
        request preempted after the step was scheduled keeps its token. Runs for every running
        request every step, hence the local names.
        """
        if runner_output.num_sampled_tokens:
            return self._add_token_runs(requests, runner_output)
        finished: list[Request] = []
        by_client = self._by_client
        logprobs = runner_output.logprobs
        sampled = runner_output.sampled_token_ids
        prompt_logprobs = dict(
            zip(runner_output.prompt_logprobs_req_ids, runner_output.prompt_logprobs)
        )
        now = time.monotonic()
        for i, req_id in enumerate(runner_output.req_ids):
            request = requests.get(req_id)
            if request is None or (
                request.status is not _RUNNING and request.status is not _PREEMPTED
            ):
                continue
            token = sampled[i]
            if request.max_tokens == 0:
                # A prompt scored, nothing generated: the token sampled after it is dropped.
                output = EngineCoreOutput(request.request_id, [], "length")
                output.num_cached_tokens = request.num_cached_tokens
                output.prompt_logprobs = prompt_logprobs.get(req_id)
                output.timings = request.timings(now)
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                finished.append(request)
                by_client.setdefault(request.client_index, []).append(output)
                continue
            request.all_token_ids.append(token)
            if request.first_token_time < 0:
                request.first_token_time = now
            output = EngineCoreOutput(request.request_id, [token])
            output.num_cached_tokens = request.num_cached_tokens
            if request.check_stop():
                finished.append(request)
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
                output.timings = request.timings(now)
            if logprobs is not None and request.sampling_params.logprobs is not None:
                output.logprobs = _logprobs_row(logprobs, i)
            if prompt_logprobs:
                output.prompt_logprobs = prompt_logprobs.get(req_id)
            client_outputs = by_client.get(request.client_index)
            if client_outputs is None:
                by_client[request.client_index] = [output]
            else:
                client_outputs.append(output)
        return finished

    def _add_token_runs(
        self, requests: dict[int, Request], runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """``add_sampled`` for a step where requests got several tokens (speculative decoding):
        each token is folded in and checked in turn, so a stop token or ``max_tokens`` inside
        an accepted run ends the request there and the tokens after it are never output."""
        finished: list[Request] = []
        logprobs = runner_output.logprobs
        sampled = runner_output.sampled_token_ids
        prompt_logprobs = dict(
            zip(runner_output.prompt_logprobs_req_ids, runner_output.prompt_logprobs)
        )
        now = time.monotonic()
        end = 0
        for req_id, count in zip(runner_output.req_ids, runner_output.num_sampled_tokens):
            start, end = end, end + count
            request = requests.get(req_id)
            if request is None or (
                request.status is not _RUNNING and request.status is not _PREEMPTED
            ):
                continue
            output = EngineCoreOutput(request.request_id, [])
            output.num_cached_tokens = request.num_cached_tokens
            if request.max_tokens == 0:
                output.finish_reason = "length"
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            else:
                for token in sampled[start:end]:
                    request.all_token_ids.append(token)
                    output.new_token_ids.append(token)
                    if request.check_stop():
                        output.finish_reason = request.status.finish_reason
                        output.stop_reason = request.stop_reason
                        break
                if request.first_token_time < 0:
                    request.first_token_time = now
            if request.is_finished:
                finished.append(request)
                output.timings = request.timings(now)
            if logprobs is not None and request.sampling_params.logprobs is not None:
                rows = range(start, start + len(output.new_token_ids))
                output.logprobs = Logprobs(
                    token_ids=[logprobs.token_ids[row] for row in rows],
                    logprobs=[logprobs.logprobs[row] for row in rows],
                    ranks=[logprobs.ranks[row] for row in rows],
                )
            if prompt_logprobs:
                output.prompt_logprobs = prompt_logprobs.get(req_id)
            self._by_client.setdefault(request.client_index, []).append(output)
        return finished

    def take(self, stats: SchedulerStats, timestamp: float) -> dict[int, EngineCoreOutputs]:
        """Everything gathered, one message per client, and start empty again."""
        by_client, self._by_client = self._by_client, {}
        return {
            client_index: EngineCoreOutputs(outputs, timestamp, stats)
            for client_index, outputs in by_client.items()
        }


def _logprobs_row(logprobs: Logprobs, row: int) -> Logprobs:
    # The runner sends one row per sampled token, in req_ids order.
    return Logprobs(
        token_ids=[logprobs.token_ids[row]],
        logprobs=[logprobs.logprobs[row]],
        ranks=[logprobs.ranks[row]],
    )
