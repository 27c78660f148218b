"""Every wire message round-trips through its codec; typed decoders reject junk and wrong shapes."""

from __future__ import annotations

import msgspec
import pytest

from conveyor.protocol import (
    Abort,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
)
from conveyor.protocol.codec import (
    ENGINE_INPUT,
    ENGINE_OUTPUT,
    RUNNER_OUTPUT,
    SCHEDULER_OUTPUT,
    WireCodec,
)

SAMPLING = SamplingParams(
    temperature=0.7, top_p=0.9, top_k=40, seed=1234, max_tokens=64, stop=["\n\n"], logprobs=2
)
LOGPROBS = Logprobs(
    token_ids=[[5, 6, 7], [8, 9, 10]],
    logprobs=[[-0.1, -2.5, -3.0], [-0.5, -1.0, -4.0]],
    ranks=[1, 2],
)


def roundtrip(codec: WireCodec, message: object) -> object:
    decoded = codec.decode(codec.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message
    return decoded


def test_engine_core_request_roundtrip_keeps_sampling_params():
    request = EngineCoreRequest(
        request_id="cmpl-1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SAMPLING,
        arrival_time=1712.5,
        priority=-1,
        eos_token_ids=[2, 151645],
    )
    decoded = roundtrip(ENGINE_INPUT, request)
    assert decoded.sampling_params.stop == ["\n\n"]
    assert decoded.sampling_params.max_tokens == 64


def test_abort_roundtrip_through_the_same_input_codec():
    # EngineCoreInput is a tagged union: the tag picks the type.
    roundtrip(ENGINE_INPUT, Abort(request_ids=["a", "b"]))


def test_engine_core_outputs_roundtrip():
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(request_id="a", new_token_ids=[5, 8], logprobs=LOGPROBS),
            EngineCoreOutput(
                request_id="b", new_token_ids=[2], finish_reason="stop", stop_reason=2
            ),
            EngineCoreOutput(
                request_id="c", new_token_ids=[], finish_reason="error", stop_reason="worker died"
            ),
            EngineCoreOutput(request_id="d", new_token_ids=[9], num_cached_tokens=32),
        ],
        timestamp=99.25,
        scheduler_stats=SchedulerStats(
            num_running=3,
            num_waiting=1,
            kv_cache_usage=0.5,
            num_preemptions=2,
            prefix_cache_queries=100,
            prefix_cache_hits=48,
            step_num_prefill_tokens=17,
            step_num_decode_tokens=3,
        ),
    )
    decoded = roundtrip(ENGINE_OUTPUT, outputs)
    assert decoded.outputs[1].stop_reason == 2
    assert decoded.outputs[2].stop_reason == "worker died"


def test_scheduler_output_roundtrip_with_new_cached_resumed_finished_and_preempted():
    output = SchedulerOutput(
        step_id=41,
        scheduled_new_reqs=[
            NewRequestData(
                req_id=7,
                prompt_token_ids=list(range(40)),
                sampling_params=SAMPLING,
                block_ids=[3, 4, 5],
                num_computed_tokens=16,
                num_scheduled_tokens=24,
            )
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[1, 2, 3],
            new_block_ids=[[], [9], [10, 11]],
            num_computed_tokens=[100, 57, 0],
            num_scheduled_tokens=[1, 1, 20],
            # Request 3 was preempted and starts over: prompt + outputs so far.
            resumed_token_ids={3: list(range(20))},
        ),
        total_num_scheduled_tokens=46,
        finished_req_ids=[4, 5],
        preempted_req_ids=[6],
    )
    decoded = roundtrip(SCHEDULER_OUTPUT, output)
    assert decoded.scheduled_cached_reqs.resumed_token_ids == {3: list(range(20))}
    assert decoded.scheduled_new_reqs[0].sampling_params == SAMPLING


def test_empty_scheduler_output_roundtrip():
    roundtrip(SCHEDULER_OUTPUT, SchedulerOutput(step_id=0))


def test_model_runner_output_roundtrip():
    output = ModelRunnerOutput(
        step_id=41, req_ids=[1, 2], sampled_token_ids=[5, 8], logprobs=LOGPROBS
    )
    roundtrip(RUNNER_OUTPUT, output)
    roundtrip(RUNNER_OUTPUT, ModelRunnerOutput(step_id=42))


@pytest.mark.parametrize("codec", [ENGINE_INPUT, ENGINE_OUTPUT, SCHEDULER_OUTPUT, RUNNER_OUTPUT])
@pytest.mark.parametrize("junk", [b"", b"\xc1", b"\x93\x01", b"not msgpack at all \xff"])
def test_decoders_reject_junk_bytes(codec: WireCodec, junk: bytes):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        codec.decode(junk)


@pytest.mark.parametrize(
    ("codec", "message"),
    [
        (SCHEDULER_OUTPUT, Abort(request_ids=["x"])),
        (ENGINE_OUTPUT, ModelRunnerOutput(step_id=1, req_ids=[1], sampled_token_ids=[2])),
        (RUNNER_OUTPUT, EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])])),
        (ENGINE_INPUT, SchedulerOutput(step_id=3)),
    ],
)
def test_decoders_reject_another_message_shape(codec: WireCodec, message: object):
    frame = msgspec.msgpack.encode(message)
    with pytest.raises(msgspec.ValidationError):
        codec.decode(frame)


def test_decoder_rejects_a_wrong_field_type():
    frame = msgspec.msgpack.encode([1, ["not", "ints"], [7]])
    with pytest.raises(msgspec.ValidationError, match="Expected `int`"):
        RUNNER_OUTPUT.decode(frame)


def test_decoder_rejects_an_unknown_union_tag():
    frame = msgspec.msgpack.encode([99, ["a"]])
    with pytest.raises(msgspec.ValidationError, match="Invalid value 99"):
        ENGINE_INPUT.decode(frame)


def test_decoder_rejects_invalid_sampling_params_inside_a_request():
    frame = msgspec.msgpack.encode([1, "r", [1, 2], {"top_p": 0.0}, 0.0])
    with pytest.raises(msgspec.ValidationError, match=r"top_p must be in \(0, 1\]"):
        ENGINE_INPUT.decode(frame)


# ---------------------------------------------------------------- the diff stays small

NUM_RUNNING = 256
BLOCK_SIZE = 16


def decode_only_output(prompt_len: int, step: int) -> SchedulerOutput:
    """One decode step of 256 running requests: only ids and counters, never the prompts.

    One request in BLOCK_SIZE starts a new block this step. Block ids come from the same range
    for both prompt lengths, so that only the prompt length differs between the two cases.
    """
    new_block_ids = [
        [10_000 + i] if (prompt_len + step + i) % BLOCK_SIZE == 0 else []
        for i in range(NUM_RUNNING)
    ]
    return SchedulerOutput(
        step_id=step,
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(range(1000, 1000 + NUM_RUNNING)),
            new_block_ids=new_block_ids,
            num_computed_tokens=[prompt_len + step] * NUM_RUNNING,
            num_scheduled_tokens=[1] * NUM_RUNNING,
        ),
        total_num_scheduled_tokens=NUM_RUNNING,
    )


def test_decode_step_wire_size_does_not_grow_with_prompt_length():
    short = len(SCHEDULER_OUTPUT.encode(decode_only_output(prompt_len=1_000, step=40)))
    long = len(SCHEDULER_OUTPUT.encode(decode_only_output(prompt_len=10_000, step=40)))
    print(
        f"decode-only SchedulerOutput, {NUM_RUNNING} requests: {short} B (1k prompts), "
        f"{long} B (10k prompts)"
    )
    assert short < 4096
    assert long == short
    # A few bytes per request: ids and counters only.
    assert short / NUM_RUNNING < 12
