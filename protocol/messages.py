"""Wire messages between the frontend, the engine core and the workers.

Shared by every process. Structs only: no behaviour, no tensors, no pickle. Messages on the hot
path are ``array_like`` (no field names on the wire), ``omit_defaults`` and ``gc=False`` (they hold
no reference cycles, so the cyclic collector need not track them).

Request ids: frontends name requests with strings (``request_id``). The engine core gives each
request an integer ``req_id`` on arrival, unique for the life of the engine; everything between the
engine core and the workers uses that integer, which keeps a 256-request decode step at a few
hundred bytes of ids instead of several KB of strings.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from conveyor.protocol.lora import LoRALoad, LoRARequest
from conveyor.protocol.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error", "rejected"]
# A request that ended without running to a stop: it failed ("error") or the engine would not
# queue it ("rejected": the waiting queue was at max_waiting_requests; retrying later may work).
FAILED_FINISH_REASONS: tuple[str, ...] = ("error", "rejected")
# How the reason of an "error" finish begins when a request's grammar failed in the worker (the
# frontend answers it as the client's constraint, not as an engine fault).
STRUCTURED_OUTPUT_FAILURE = "structured output: "


# ---------------------------------------------------------------- frontend -> engine core


class EngineCoreRequest(msgspec.Struct, tag=1, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Tokens that end generation unless ignore_eos; from the model's generation config.
    eos_token_ids: list[int] = []
    # vLLM's cache_salt: this request's prompt shares prefix-cache blocks only with requests of
    # the same salt (a tenant's own prefix is then no timing signal for anyone else).
    cache_salt: str | None = None
    # The LoRA adapter to run the request under (None: the base model); its KV is its own.
    lora_request: LoRARequest | None = None


class Abort(msgspec.Struct, tag=2, array_like=True, gc=False):
    request_ids: list[str]


EngineCoreInput = Union[EngineCoreRequest, Abort]


# ---------------------------------------------------------------- engine core -> frontend


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities for a run of tokens (generated, or a prompt's), one row per token.

    Row i holds the sampled token first, then the top-k alternatives in descending order.
    ``ranks[i]`` is the sampled token's rank in the full distribution (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class RequestTimings(msgspec.Struct, array_like=True, gc=False):
    """Where a finished request spent its time inside the engine, in seconds of the engine's
    clock (differences only, so the frontend's clock never has to agree with it).

    ``queued``: arrival in the engine to its first scheduling; ``prefill``: first scheduling to
    its first sampled token; ``decode``: first to last sampled token (0 with one token).
    """

    queued: float
    prefill: float
    decode: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request, or the reason for "error" and "rejected".
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    # With the request's first token, when it asked for prompt logprobs: one row per prompt
    # token after the first (that token first, then the top alternatives).
    prompt_logprobs: Logprobs | None = None
    # Only on the final output of a request that was scheduled at least once.
    timings: RequestTimings | None = None


# Upper bounds of the tokens-per-step histogram (``SchedulerStats.iteration_tokens``); a step
# over the last bound counts in one more (+Inf) bucket.
ITERATION_TOKENS_BUCKETS: tuple[int, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine's state after a step, as only the engine core knows it.

    Gauges describe this moment; every other field is cumulative since the engine started, so
    a lost or late message loses nothing, and a frontend that sees the stats late only lags.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The latest scheduled step's tokens (0 when the stats follow no step).
    step_num_prefill_tokens: int = 0
    step_num_decode_tokens: int = 0
    # Steps scheduled, and their tokens: prompt work (prefill chunks, recomputation after a
    # preemption) and decodes, counted when scheduled.
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Steps per tokens-per-step bucket: ``ITERATION_TOKENS_BUCKETS`` then +Inf (not cumulative).
    iteration_tokens: list[int] = []
    # Under a TBT SLO (``SchedulerConfig.tbt_slo_ms``; all 0 without one): steps whose time the
    # step-cost model predicted and the engine measured, the sum of |measured - predicted| and
    # of their measured times (seconds; the ratio is the model's relative error), and steps
    # with decodes that took longer than the SLO.
    num_steps_timed: int = 0
    step_time_abs_error_s: float = 0.0
    step_time_s: float = 0.0
    num_steps_over_tbt_slo: int = 0
    # Speculative decoding (vLLM's spec_decode counters): requests' steps that carried drafts,
    # their draft tokens, the accepted ones, and accepted ones per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # With LoRA adapters: the names of those with running and with waiting requests (vLLM's
    # lora_requests_info).
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None


# ---------------------------------------------------------------- engine core -> workers


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen: sent once, in full."""

    req_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # The engine's id of the request's LoRA adapter (0: the base model); its slot comes in a
    # ``LoRALoad`` of this step or an earlier one.
    lora_id: int = 0


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Requests the workers already mirror, as parallel lists (one entry per request).

    ``new_block_ids[i]`` are appended to the request's block table, unless the request is in
    ``resumed_token_ids``: it was preempted and is starting over, so its block table is replaced
    by ``new_block_ids[i]`` and its token history by the ids given there (prompt + outputs).
    """

    req_ids: list[int] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []
    num_scheduled_tokens: list[int] = []
    resumed_token_ids: dict[int, list[int]] = {}


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    total_num_scheduled_tokens: int = 0
    # Requests that ended (finished or aborted) since the previous step: drop their mirrors.
    finished_req_ids: list[int] = []
    # Requests preempted since the previous step: keep the mirror, drop them from the batch.
    preempted_req_ids: list[int] = []
    # Structured requests not yet scheduled, and their grammars: the workers build each matcher
    # off the step and report it in ``grammars_ready``; until then the request waits.
    grammar_req_ids: list[int] = []
    grammars: list[str] = []
    # With no tokens to run: how long a worker may wait for a grammar build to end before it
    # answers (how the engine polls while only grammars are pending; 0: no poll).
    grammar_wait_s: float = 0.0
    # Speculative decoding (vLLM V1's shape): req_id -> the draft tokens scheduled after the
    # request's last known token, counted in its num_scheduled_tokens (1 + len(drafts)).
    scheduled_spec_decode_tokens: dict[int, list[int]] = {}
    # LoRA slots to fill before this step runs: the adapters its requests need that no slot
    # holds yet (scheduled once, when the scheduler first admits a request of the adapter).
    lora_loads: list[LoRALoad] = []


def reaches_workers(scheduler_output: SchedulerOutput) -> bool:
    """Whether a step has anything for the workers (tokens, grammars to build, a poll)."""
    return (
        scheduler_output.total_num_scheduled_tokens > 0
        or bool(scheduler_output.grammar_req_ids)
        or scheduler_output.grammar_wait_s > 0
    )


# ---------------------------------------------------------------- worker rank 0 -> engine core


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The tokens of each request whose prompt was complete this step, in ``req_ids`` order.

    One token each, unless ``num_sampled_tokens`` says otherwise (speculative decoding: the
    accepted drafts and the token after them); ``sampled_token_ids`` and the logprobs rows are
    then the requests' tokens one after the other.
    """

    step_id: int
    req_ids: list[int] = []
    sampled_token_ids: list[int] = []
    logprobs: Logprobs | None = None
    # Per request, how many of ``sampled_token_ids`` are its (empty: one each).
    num_sampled_tokens: list[int] = []
    # Per request (aligned with ``req_ids``; empty: none), the drafts the worker proposes for
    # its next step, made from its tokens as they are after this step.
    spec_token_ids: list[list[int]] = []
    # Requests the worker could not go on with (a grammar matcher in error), and why: they end
    # with an "error" finish; the token sampled for them this step is dropped.
    failed_req_ids: list[int] = []
    failure_reasons: list[str] = []
    # Requests whose grammar was built since the previous step (in any step's output).
    grammars_ready: list[int] = []
    # Prompt logprobs of requests that sampled their first token this step (their prompt is
    # complete), one ``Logprobs`` each, rows in prompt order from its second token.
    prompt_logprobs_req_ids: list[int] = []
    prompt_logprobs: list[Logprobs] = []


# ---------------------------------------------------------------- session control (ZMQ clients)


class Hello(msgspec.Struct, tag=3, array_like=True, gc=False):
    """A client attaches: first frame on a new DEALER socket; answered by ``Ready``."""

    client_name: str = ""


class Heartbeat(msgspec.Struct, tag=4, array_like=True, gc=False):
    """Sent by a client every few seconds; a client silent for too long is dropped and its
    requests aborted. The engine answers ``EngineHeartbeat`` (a client on another host cannot
    see the engine's pid: silence is how it learns the engine is gone), or ``EngineDead`` with
    ``client_dropped`` if it has dropped the client already."""


class Goodbye(msgspec.Struct, tag=5, array_like=True, gc=False):
    """A client detaches cleanly: its requests are aborted at once."""


class CheckAllFree(msgspec.Struct, tag=6, array_like=True, gc=False):
    """Debug query: is the engine empty (no request anywhere, every KV block free, ref count 0)?

    Answered by ``AllFreeReport``; an engine started without debug queries says so instead.
    """

    query_id: int


class AddRequests(msgspec.Struct, tag=7, array_like=True, gc=False):
    """Several requests at once, added in order before the engine schedules again.

    An offline batch sent as single requests reaches an idle engine one by one: its first step
    would see only the first few, which is unfair to policies that admit a batch only once
    (static batching). One message makes the batch arrive as a batch.
    """

    requests: list[EngineCoreRequest]


EngineCoreClientMessage = Union[
    EngineCoreRequest, Abort, Hello, Heartbeat, Goodbye, CheckAllFree, AddRequests
]


class Ready(msgspec.Struct, tag=10, array_like=True, gc=False):
    """The engine accepted a client: what it serves and how (num_blocks filled in)."""

    client_index: int
    config_msgpack: bytes  # an encoded protocol.config.EngineConfig
    engine_pid: int
    # Which engine this is among several (data parallelism); the ``engine`` metrics label.
    engine_index: int = 0
    # How long the engine waits for a silent client before dropping it (0: not said): the
    # client heartbeats often enough that a few late ones cannot get it dropped.
    heartbeat_timeout_s: float = 0.0


class EngineDead(msgspec.Struct, tag=11, array_like=True, gc=False):
    """The engine is exiting (a fatal error, or ``shutdown``); every open request has failed.

    With ``client_dropped`` only the receiving client's session is over (the engine dropped it
    for missing heartbeats and aborted its requests) while the engine serves on: that client
    must attach again (a new Hello) to be served.
    """

    reason: str
    client_dropped: bool = False
    # The engine was shut down on purpose (a signal, its owner stopping it), not by a fault.
    shutdown: bool = False


class EngineOutputsFrame(msgspec.Struct, tag=12, array_like=True, gc=False):
    outputs: EngineCoreOutputs


class AllFreeReport(msgspec.Struct, tag=13, array_like=True, gc=False):
    """The answer to ``CheckAllFree``: ``problem`` is empty when everything is free."""

    query_id: int
    problem: str = ""


class EngineHeartbeat(msgspec.Struct, tag=14, array_like=True, gc=False):
    """The engine's answer to a client's ``Heartbeat``: it is still there."""


EngineCoreServerMessage = Union[
    EngineOutputsFrame, Ready, EngineDead, AllFreeReport, EngineHeartbeat
]
