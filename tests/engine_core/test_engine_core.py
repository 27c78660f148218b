"""EngineCore with the fake executor: validation as outputs, clients, aborts, idle steps."""

from __future__ import annotations

import pytest

from conveyor.engine_core import EngineCore
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
)
from tests.fake_executor import FakeExecutor, fake_next_token

VOCAB = 50
MAX_MODEL_LEN = 64


def make_engine(num_blocks: int = 40, **scheduler: object) -> tuple[EngineCore, FakeExecutor]:
    config = EngineConfig(
        model=ModelConfig(
            model="fake", architecture="Fake", vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN
        ),
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32,
            max_model_len=MAX_MODEL_LEN,
            **scheduler,  # type: ignore[arg-type]
        ),
    )
    executor = FakeExecutor(num_blocks, VOCAB, block_size=4)
    return EngineCore(config, executor), executor


def make_request(request_id: str, prompt: list[int] | None = None, **params: object):
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3, 4, 5] if prompt is None else prompt,
        sampling_params=SamplingParams(**{"max_tokens": 4, "ignore_eos": True, **params}),  # type: ignore[arg-type]
        arrival_time=0.0,
    )


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(fake_next_token(history, VOCAB))
    return history[len(prompt) :]


def run_to_end(engine: EngineCore) -> dict[tuple[int, str], tuple[list[int], str]]:
    """(client, request_id) -> (tokens, finish_reason), stepping until nothing is left."""
    results: dict[tuple[int, str], tuple[list[int], str | None]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            engine.check_all_free()
            return results  # type: ignore[return-value]
        for client_index, outputs in engine.step().items():
            for out in outputs.outputs:
                tokens, reason = results.get((client_index, out.request_id), ([], None))
                assert reason is None, f"{out.request_id} got output after finishing"
                results[(client_index, out.request_id)] = (
                    tokens + out.new_token_ids,
                    out.finish_reason,
                )
    raise AssertionError("engine did not finish")


def test_init_sizes_the_cache_from_the_executor():
    engine, executor = make_engine(num_blocks=23)
    assert executor.initialized_num_blocks == 23
    assert engine.scheduler.kv_cache_manager.block_pool.num_blocks == 23
    engine.shutdown()
    assert executor.num_shutdowns == 1


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "empty"),
        ([1, -1], "token ids"),
        ([1, VOCAB], "token ids"),
        ([1] * MAX_MODEL_LEN, "max_model_len"),
    ],
)
def test_bad_requests_come_back_as_errors_and_the_engine_keeps_serving(prompt, message):
    engine, _ = make_engine()
    rejected = engine.add_request(make_request("bad", prompt))
    assert isinstance(rejected, EngineCoreOutputs)
    (out,) = rejected.outputs
    assert out.request_id == "bad" and out.finish_reason == "error" and out.new_token_ids == []
    assert isinstance(out.stop_reason, str) and message in out.stop_reason
    assert engine.add_request(make_request("good")) is None
    assert run_to_end(engine) == {(0, "good"): (expected_tokens([1, 2, 3, 4, 5], 4), "length")}


def test_duplicate_in_flight_request_id_is_rejected_per_client():
    engine, _ = make_engine()
    assert engine.add_request(make_request("a")) is None
    rejected = engine.add_request(make_request("a"))
    assert rejected is not None and rejected.outputs[0].finish_reason == "error"
    assert engine.add_request(make_request("a"), client_index=1) is None
    results = run_to_end(engine)
    assert set(results) == {(0, "a"), (1, "a")}
    # Finished, the name is free again.
    assert engine.add_request(make_request("a")) is None


def test_two_clients_get_their_own_outputs():
    engine, _ = make_engine()
    engine.add_request(make_request("x", [3, 4, 5]), client_index=0)
    engine.add_request(make_request("y", [6, 7], max_tokens=2), client_index=1)
    outputs = engine.step()
    assert [o.request_id for o in outputs[0].outputs] == ["x"]
    assert [o.request_id for o in outputs[1].outputs] == ["y"]
    results = run_to_end(engine)
    assert results[(0, "x")][1] == "length" and results[(1, "y")][1] == "length"


def test_eos_from_the_request_stops_it():
    engine, _ = make_engine()
    prompt = [1, 2, 3]
    first = expected_tokens(prompt, 1)[0]
    request = make_request("e", prompt, ignore_eos=False, max_tokens=10)
    engine.add_request(
        EngineCoreRequest(
            request.request_id,
            prompt,
            request.sampling_params,
            arrival_time=0.0,
            eos_token_ids=[first],
        )
    )
    assert run_to_end(engine) == {(0, "e"): ([first], "stop")}


def test_step_with_nothing_to_do_returns_nothing_and_runs_nothing():
    engine, executor = make_engine()
    assert not engine.has_unfinished_requests()
    assert engine.step() == {}
    assert executor.scheduler_outputs == []
    engine.check_all_free()


def test_abort_reaches_the_client_without_a_model_step_and_frees_the_name():
    engine, executor = make_engine()
    engine.add_request(make_request("a", max_tokens=20))
    engine.step()
    num_executed = len(executor.scheduler_outputs)
    engine.abort_requests(["a", "a", "unknown"])
    engine.abort_requests(["a"])
    assert engine.has_unfinished_requests()  # the abort output is still to go out
    # The name may be reused at once, before the abort output went out.
    assert engine.add_request(make_request("a", max_tokens=1), client_index=0) is None
    outputs = engine.step()
    reasons = [(o.request_id, o.finish_reason) for o in outputs[0].outputs]
    # The old "a" ends as aborted; the new one runs its single token in the same step.
    assert reasons == [("a", "abort"), ("a", "length")]
    assert executor.scheduler_outputs[-1].finished_req_ids == [0]
    assert len(executor.scheduler_outputs) == num_executed + 1
    assert not engine.has_unfinished_requests()
    engine.check_all_free()


def test_only_an_abort_pending_still_gets_delivered():
    engine, executor = make_engine()
    engine.add_request(make_request("a", max_tokens=20))
    engine.step()
    engine.abort_requests(["a"])
    num_executed = len(executor.scheduler_outputs)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs[0].outputs] == [("a", "abort")]
    assert len(executor.scheduler_outputs) == num_executed  # nothing to run
    assert not engine.has_unfinished_requests()
    engine.check_all_free()


def test_a_pool_smaller_than_the_context_caps_max_model_len_so_no_request_overruns_it(caplog):
    # 9 usable blocks of 4 tokens: 36 tokens, under MAX_MODEL_LEN (64).
    engine, _ = make_engine(num_blocks=10)
    assert engine.config.scheduler.max_model_len == 36
    assert "max_model_len is lowered to 36" in caplog.text
    # "Until the context is full" now ends at the pool's size with "length", not an error.
    engine.add_request(make_request("until-full", max_tokens=None))
    tokens, reason = run_to_end(engine)[(0, "until-full")]
    assert (len(tokens), reason) == (36 - 5, "length")
    assert tokens == expected_tokens([1, 2, 3, 4, 5], 36 - 5)
    assert engine.add_request(make_request("too-long", prompt=[1] * 36)) is not None


def test_a_pool_that_holds_the_context_leaves_max_model_len_alone():
    engine, _ = make_engine(num_blocks=17)  # 16 usable blocks: exactly 64 tokens
    assert engine.config.scheduler.max_model_len == MAX_MODEL_LEN


def test_a_full_waiting_queue_rejects_new_requests_until_it_drains():
    engine, _ = make_engine(max_num_seqs=1, max_waiting_requests=2)
    # Nothing is scheduled between adds, so two wait and the third finds the queue full.
    assert engine.add_request(make_request("a")) is None
    assert engine.add_request(make_request("b")) is None
    for name in ("c", "d"):
        rejected = engine.add_request(make_request(name))
        assert rejected is not None
        (output,) = rejected.outputs
        assert (output.request_id, output.new_token_ids) == (name, [])
        assert output.finish_reason == "rejected"
        assert "queue is full (2 requests waiting)" in str(output.stop_reason)
    expected = expected_tokens([1, 2, 3, 4, 5], 4)
    (first,) = engine.step()[0].outputs  # "a" runs (one at a time), "b" waits: room for one
    assert (first.request_id, first.new_token_ids) == ("a", expected[:1])
    assert engine.add_request(make_request("e")) is None
    assert engine.add_request(make_request("f")) is not None
    results = run_to_end(engine)
    assert results.pop((0, "a")) == (expected[1:], "length")
    assert results == {(0, name): (expected, "length") for name in ("b", "e")}
    # Nothing of a refused request is left behind: its name is free again.
    assert engine.add_request(make_request("c")) is None
    assert run_to_end(engine) == {(0, "c"): (expected, "length")}
