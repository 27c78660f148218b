"""Async scheduling in EngineCore: step N+1 is scheduled before step N's tokens are known.

The fake executor mirrors requests from the diffs alone and checks every KV slot, so a run-ahead
step that fed the wrong token or the wrong block fails there; these tests pin down what the
overlap must not change (the tokens, the endings) and what it must do (keep a step in flight,
not run past ``max_tokens``, drop the one token sampled after a stop token).
"""

from __future__ import annotations

import pytest

from conveyor.engine_core import EngineCore
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    EngineCoreRequest,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
)
from tests.fake_executor import FakeExecutor, fake_next_token

VOCAB = 50
MAX_MODEL_LEN = 64


def make_engine(async_scheduling: bool, num_blocks: int = 40, **scheduler: object):
    config = EngineConfig(
        model=ModelConfig(
            model="fake", architecture="Fake", vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN
        ),
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(
            max_model_len=MAX_MODEL_LEN,
            async_scheduling=async_scheduling,
            **{"max_num_batched_tokens": 32, **scheduler},  # type: ignore[arg-type]
        ),
    )
    executor = FakeExecutor(num_blocks, VOCAB, block_size=4)
    return EngineCore(config, executor), executor


def request(request_id: str, prompt: list[int], eos: list[int] | None = None, **params: object):
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**{"max_tokens": 6, **params}),  # type: ignore[arg-type]
        arrival_time=0.0,
        eos_token_ids=eos or [],
    )


def run_to_end(engine: EngineCore, aborts: dict[int, list[str]] | None = None):
    """request_id -> (tokens, finish_reason); ``aborts`` maps a step number to ids to abort."""
    results: dict[str, tuple[list[int], str | None]] = {}
    for step in range(300):
        engine.abort_requests((aborts or {}).get(step, []))
        if not engine.has_unfinished_requests():
            engine.check_all_free()
            return results
        for outputs in engine.step().values():
            for out in outputs.outputs:
                tokens, reason = results.get(out.request_id, ([], None))
                assert reason is None, f"{out.request_id}: an output after its final one"
                results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    raise AssertionError("the engine did not finish")


def tokens_of(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(fake_next_token(history, VOCAB))
    return history[len(prompt) :]


def scheduled_tokens_per_request(executor: FakeExecutor) -> dict[int, int]:
    totals: dict[int, int] = {}
    for output in executor.scheduler_outputs:
        for new in output.scheduled_new_reqs:
            totals[new.req_id] = totals.get(new.req_id, 0) + new.num_scheduled_tokens
        cached = output.scheduled_cached_reqs
        for req_id, num in zip(cached.req_ids, cached.num_scheduled_tokens):
            totals[req_id] = totals.get(req_id, 0) + num
    return totals


def mixed_requests() -> list[EngineCoreRequest]:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13] * 20, [1, 2, 3, 14], [15, 16]]
    requests = []
    for i, prompt in enumerate(prompts):
        # Every other request stops on the token it would produce third: a stop mid-stream.
        eos = [tokens_of(prompt, 3)[2]] if i % 2 else None
        requests.append(request(f"r{i}", prompt, eos, max_tokens=4 + 3 * i))
    return requests


@pytest.mark.parametrize("policy", ["stall-free", "prefill-first", "orca", "static"])
@pytest.mark.parametrize("num_blocks", [40, 12], ids=["roomy", "tight"])
def test_async_gives_the_same_outputs_as_sync(policy: str, num_blocks: int):
    budget = 32 if policy == "stall-free" else MAX_MODEL_LEN
    results = {}
    for async_scheduling in (False, True):
        engine, _ = make_engine(
            async_scheduling, num_blocks, policy=policy, max_num_batched_tokens=budget
        )
        for r in mixed_requests():
            engine.add_request(r)
        results[async_scheduling] = run_to_end(engine, aborts={3: ["r4"]})
    assert results[True] == results[False]
    assert results[True]["r1"][1] == "stop" and results[True]["r2"][1] == "length"


def test_a_step_stays_in_flight_while_the_next_is_scheduled():
    engine, executor = make_engine(async_scheduling=True)
    engine.add_request(request("a", [1, 2, 3]))
    engine.step()
    # The prompt step and its run-ahead decode both reached the executor; one was folded in.
    assert len(executor.scheduler_outputs) == 2
    assert engine.scheduler.requests[0].num_output_tokens == 1
    assert engine.has_unfinished_requests()


def test_max_tokens_is_never_run_past():
    engine, executor = make_engine(async_scheduling=True)
    engine.add_request(request("a", [1, 2, 3], max_tokens=5, ignore_eos=True))
    assert run_to_end(engine) == {"a": (tokens_of([1, 2, 3], 5), "length")}
    # The prompt, then one token per output but the last: exactly what a synchronous run does.
    assert scheduled_tokens_per_request(executor) == {0: 3 + 4}


def test_a_stop_token_costs_one_extra_step_whose_token_is_dropped():
    prompt = [7, 8, 9]
    expected = tokens_of(prompt, 3)
    engine, executor = make_engine(async_scheduling=True)
    engine.add_request(request("a", prompt, eos=[expected[2]], max_tokens=20))
    assert run_to_end(engine) == {"a": (expected, "stop")}
    # The step after the stop token was already running when the stop became known.
    assert scheduled_tokens_per_request(executor) == {0: 3 + 3}
    # The next step that reaches the workers tells them to drop their mirror of it.
    engine.add_request(request("b", prompt, max_tokens=2))
    run_to_end(engine)
    assert 0 not in executor.mirrors


def test_an_abort_while_a_step_is_in_flight_drops_its_token():
    engine, _ = make_engine(async_scheduling=True)
    engine.add_request(request("a", [1, 2, 3], max_tokens=20, ignore_eos=True))
    engine.step()
    engine.abort_requests(["a"])
    outputs = engine.step()
    (out,) = outputs[0].outputs
    assert out.finish_reason == "abort" and out.new_token_ids == []
    assert run_to_end(engine) == {}
