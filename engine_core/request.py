"""A request as the engine core sees it: its tokens, its progress and why it stopped.

Runs in the engine-core process. ``Request`` owns its tokens and counters; the KV cache manager
owns its blocks (by ``req_id``) and never writes here.
"""

from __future__ import annotations

import enum

from conveyor.protocol import FinishReason, RequestTimings, SamplingParams
from conveyor.protocol.lora import LoRARequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Two counters and a token list: there is no prefill or decode phase.

    ``num_tokens`` is prompt + outputs so far; ``num_computed_tokens`` is how many of them are in
    the KV cache (advanced optimistically when a step is scheduled). The scheduler hands out
    ``num_tokens - num_computed_tokens`` tokens, or fewer when the budget is short.
    """

    __slots__ = (
        "req_id",
        "request_id",
        "client_index",
        "prompt_token_ids",
        "all_token_ids",
        "sampling_params",
        "cache_salt",
        "lora",
        "lora_id",
        "eos_token_ids",
        "arrival_time",
        "priority",
        "max_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "stop_reason",
        "queued_time",
        "first_scheduled_time",
        "first_token_time",
    )

    def __init__(
        self,
        req_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_model_len: int,
        request_id: str = "",
        client_index: int = 0,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRARequest | None = None,
        lora_id: int = 0,
    ) -> None:
        self.req_id = req_id
        self.cache_salt = cache_salt
        # The LoRA adapter it runs under, and the engine's id of it (0: the base model).
        self.lora = lora
        self.lora_id = lora_id
        self.request_id = request_id or str(req_id)
        self.client_index = client_index
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority
        # Generation also ends when the context is full, whichever comes first.
        room = max_model_len - len(prompt_token_ids)
        asked = sampling_params.max_tokens
        self.max_tokens = room if asked is None else min(asked, room)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at admission; -1 until admitted.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # The engine's clock (time.monotonic) when the scheduler queued the request, first
        # scheduled it and saw its first token; -1 until then.
        self.queued_time = -1.0
        self.first_scheduled_time = -1.0
        self.first_token_time = -1.0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def timings(self, now: float) -> RequestTimings | None:
        """Where the request spent its time, ending ``now``; None if it was never scheduled."""
        if self.first_scheduled_time < 0:
            return None
        first_token = self.first_token_time if self.first_token_time >= 0 else now
        return RequestTimings(
            queued=max(self.first_scheduled_time - self.queued_time, 0.0),
            prefill=first_token - self.first_scheduled_time,
            decode=now - first_token,
        )

    def append_output_token_id(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Decide, after a token was appended, whether the request is done; set status if so.

        A stop token wins over the length cap when both happen on the same token, so a model
        that ends exactly at max_tokens reports "stop" as it would unconstrained.
        """
        num_output = self.num_output_tokens
        params = self.sampling_params
        if num_output >= params.min_tokens:
            last = self.all_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_output >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request(req_id={self.req_id}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
