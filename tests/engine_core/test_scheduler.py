"""The scheduler's shared machinery: queues, the diff, chunking, preemption, aborts, outputs.

Every step runs through the fake executor, which mirrors requests from the diffs alone and
asserts they are consistent, so these tests check the wire diff as well.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conveyor.engine_core import Request, RequestStatus, Scheduler
from conveyor.engine_core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    make_request_queue,
)
from conveyor.protocol import ModelRunnerOutput, SamplingParams
from conveyor.protocol.config import POLICIES
from tests.commands import CHECKOUT, LAB
from tests.fake_executor import FakeExecutor, fake_next_token, make_scheduler, run_step

VOCAB = 50


def make_request(
    req_id: int,
    prompt_len: int = 6,
    max_tokens: int = 5,
    priority: int = 0,
    client_index: int = 0,
    first_token: int = 1,
    **params: object,
) -> Request:
    return Request(
        req_id,
        [(first_token + req_id * 7 + i) % VOCAB for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),  # type: ignore[arg-type]
        max_model_len=512,
        client_index=client_index,
        arrival_time=float(req_id),
        priority=priority,
    )


def expected_tokens(request: Request) -> list[int]:
    """What the fake model produces for this request when nothing gets in its way."""
    history = list(request.prompt_token_ids)
    for _ in range(request.max_tokens):
        history.append(fake_next_token(history, VOCAB))
    return history[len(request.prompt_token_ids) :]


def run_to_end(scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 500) -> dict:
    """Step until nothing is left; every request's tokens and finish reason by request_id."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not (scheduler.has_unfinished_requests() or scheduler.has_pending_outputs()):
            return {"tokens": tokens, "reasons": reasons}
        _, outputs = run_step(scheduler, executor)
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                assert out.request_id not in reasons, "output after the final one"
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
    raise AssertionError("requests did not finish")


# ---------------------------------------------------------------- queues


def test_fcfs_queue_keeps_arrival_order_and_puts_preempted_in_front():
    queue = make_request_queue("fcfs")
    assert isinstance(queue, FCFSRequestQueue)
    requests = [make_request(i) for i in range(4)]
    for request in requests:
        queue.add(request)
    assert queue.pop() is requests[0]
    queue.add_preempted(requests[0])
    queue.remove_requests([requests[2]])
    assert [r.req_id for r in queue] == [0, 1, 3]
    assert queue.peek() is requests[0] and len(queue) == 3


def test_priority_queue_orders_by_priority_then_arrival():
    queue = make_request_queue("priority")
    assert isinstance(queue, PriorityRequestQueue)
    requests = [make_request(0, priority=5), make_request(1, priority=0), make_request(2)]
    for request in requests:
        queue.add(request)
    assert [r.req_id for r in queue] == [1, 2, 0]
    assert queue.pop() is requests[1]
    # A preempted request goes back by its key, not to the front.
    queue.add_preempted(requests[1])
    queue.add_preempted(make_request(3, priority=9))
    queue.remove_requests([requests[2]])
    assert [queue.pop().req_id for _ in range(len(queue))] == [1, 0, 3]
    with pytest.raises(ValueError):
        make_request_queue("random")


# ---------------------------------------------------------------- the diff


def test_new_then_cached_diff_with_optimistic_advance():
    scheduler, executor = make_scheduler()
    request = make_request(0, prompt_len=6, max_tokens=8)
    scheduler.add_request(request)
    first = scheduler.schedule()
    (new,) = first.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.num_computed_tokens) == (
        0,
        request.prompt_token_ids,
        0,
    )
    assert new.num_scheduled_tokens == 6 and len(new.block_ids) == 2
    assert first.scheduled_cached_reqs.req_ids == []
    # Advanced when scheduled, not when the step returns.
    assert request.num_computed_tokens == 6 and request.status is RequestStatus.RUNNING
    executor.initialize_cache(executor.num_blocks)
    scheduler.update_from_output(first, executor.execute_model(first))
    sent_block_ids = list(new.block_ids)
    for _ in range(6):
        output, _ = run_step(scheduler, executor)
        cached = output.scheduled_cached_reqs
        assert output.scheduled_new_reqs == [] and cached.req_ids == [0]
        assert cached.num_scheduled_tokens == [1] and cached.resumed_token_ids == {}
        assert cached.num_computed_tokens == [request.num_computed_tokens - 1]
        sent_block_ids += cached.new_block_ids[0]
        # The workers' table, rebuilt from the diffs, is the KV manager's.
        assert sent_block_ids == scheduler.kv_cache_manager.get_block_ids(0)
    assert len(sent_block_ids) == 3  # 6 + 6 tokens in blocks of 4: some steps added one
    run_step(scheduler, executor)
    assert request.output_token_ids == expected_tokens(request)
    assert request.is_finished
    scheduler.check_all_free()


def test_long_prompt_is_chunked_by_the_budget_and_samples_only_when_complete():
    scheduler, executor = make_scheduler(max_num_batched_tokens=8)
    request = make_request(0, prompt_len=20, max_tokens=2)
    scheduler.add_request(request)
    chunks, sampled = [], []
    for _ in range(3):
        output, outputs = run_step(scheduler, executor)
        chunks.append(output.total_num_scheduled_tokens)
        sampled.append(sum(len(o.new_token_ids) for o in outputs[0].outputs) if outputs else 0)
    assert chunks == [8, 8, 4] and sampled == [0, 0, 1]


def test_long_prefill_threshold_caps_each_chunk():
    scheduler, executor = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    scheduler.add_request(make_request(0, prompt_len=12, max_tokens=1))
    chunks = [run_step(scheduler, executor)[0].total_num_scheduled_tokens for _ in range(3)]
    assert chunks == [5, 5, 2]
    assert not scheduler.has_unfinished_requests()


def test_width_cap_keeps_the_rest_waiting():
    scheduler, executor = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(i, max_tokens=3))
    output, _ = run_step(scheduler, executor)
    assert [n.req_id for n in output.scheduled_new_reqs] == [0, 1]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1
    result = run_to_end(scheduler, executor)
    assert set(result["reasons"].values()) == {"length"}
    scheduler.check_all_free()


# ---------------------------------------------------------------- preemption


def _three_running(queue_order: str) -> tuple[Scheduler, FakeExecutor, list[Request]]:
    """A (prio 0), B (prio 5), C (prio 1) running in that admission order, one block each, pool full."""
    scheduler, executor = make_scheduler(
        num_blocks=4, enable_prefix_caching=False, queue_order=queue_order
    )
    a, b, c = (
        make_request(0, 3, 8, priority=0),
        make_request(1, 3, 8, priority=5),
        make_request(2, 3, 8, priority=1),
    )
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler, executor)
    scheduler.add_request(c)
    run_step(scheduler, executor)
    assert scheduler.running == [a, b, c] and scheduler.kv_cache_manager.num_free_blocks == 0
    return scheduler, executor, [a, b, c]


def test_fcfs_preempts_the_newest_and_puts_it_back_in_front():
    scheduler, executor, (a, b, c) = _three_running("fcfs")
    output, _ = run_step(scheduler, executor)
    # A needs a block: C (newest) goes. Then B needs one and is the newest: it goes itself.
    assert output.preempted_req_ids == [2, 1]
    assert output.scheduled_cached_reqs.req_ids == [0]
    assert [r.req_id for r in scheduler.waiting] == [1, 2]
    for victim in (b, c):
        assert victim.status is RequestStatus.PREEMPTED
        assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
        assert scheduler.kv_cache_manager.get_block_ids(victim.req_id) == []
    assert scheduler.make_stats().num_preemptions == 2


def test_priority_preempts_the_lowest_priority_first():
    scheduler, executor, _ = _three_running("priority")
    output, _ = run_step(scheduler, executor)
    # A needs a block: B (priority 5) goes although C is newer; C still fits its block.
    assert output.preempted_req_ids == [1]
    assert output.scheduled_cached_reqs.req_ids == [0, 2]
    assert [r.req_id for r in scheduler.waiting] == [1]


def test_preempted_requests_resume_with_full_history_and_the_same_tokens():
    scheduler, executor, requests = _three_running("fcfs")
    result = run_to_end(scheduler, executor)
    resumed = [o.scheduled_cached_reqs.resumed_token_ids for o in executor.scheduler_outputs]
    assert any(1 in r for r in resumed) and any(2 in r for r in resumed)
    for request in requests:
        assert request.output_token_ids == expected_tokens(request)
        assert (
            request.output_token_ids[-len(result["tokens"][request.request_id]) :]
            == (result["tokens"][request.request_id])
        )
    scheduler.check_all_free()


def test_a_victim_scheduled_earlier_in_the_step_is_taken_back_out():
    scheduler, executor = make_scheduler(
        num_blocks=3, enable_prefix_caching=False, queue_order="priority"
    )
    low, high = make_request(0, 2, 6, priority=5), make_request(1, 4, 6, priority=0)
    scheduler.add_request(low)
    run_step(scheduler, executor)
    scheduler.add_request(high)
    run_step(scheduler, executor)
    # low is scheduled first (it fits its block), then high needs a block and low must go.
    output, _ = run_step(scheduler, executor)
    assert output.preempted_req_ids == [0]
    assert output.scheduled_cached_reqs.req_ids == [1]
    assert output.total_num_scheduled_tokens == 1
    assert low.num_computed_tokens == 0 and low.status is RequestStatus.PREEMPTED
    result = run_to_end(scheduler, executor)
    assert result["tokens"]["0"][-1] == expected_tokens(low)[-1]
    scheduler.check_all_free()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_larger_than_the_pool_fails_and_the_rest_go_on(policy: str):
    scheduler, executor = make_scheduler(num_blocks=4, enable_prefix_caching=False, policy=policy)
    big = make_request(0, prompt_len=8, max_tokens=10)  # 17 tokens: 5 blocks; the pool has 3
    scheduler.add_request(big)
    scheduler.add_request(make_request(1, prompt_len=2, max_tokens=2))
    result = run_to_end(scheduler, executor)
    assert result["reasons"] == {"0": "error", "1": "length"}
    assert big.stop_reason == "needs more KV cache blocks than the whole pool holds"
    scheduler.check_all_free()


def test_a_whole_prompt_policy_fails_a_prompt_over_the_budget():
    scheduler, executor = make_scheduler(policy="orca", max_num_batched_tokens=8)
    scheduler.add_request(make_request(0, prompt_len=10))
    scheduler.add_request(make_request(1, prompt_len=4, max_tokens=1))
    result = run_to_end(scheduler, executor)
    assert result["reasons"] == {"0": "error", "1": "length"}
    scheduler.check_all_free()


# ---------------------------------------------------------------- aborts and outputs


def test_abort_frees_reports_once_and_is_idempotent():
    scheduler, executor = make_scheduler()
    scheduler.add_request(make_request(0, max_tokens=20))
    scheduler.add_request(make_request(1, max_tokens=20))
    run_step(scheduler, executor)
    scheduler.abort_requests([0, 0, 99])
    scheduler.abort_requests([0])
    output, outputs = run_step(scheduler, executor)
    aborted = [o for o in outputs[0].outputs if o.request_id == "0"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert aborted[0].new_token_ids == []
    assert output.finished_req_ids == [0] and output.scheduled_cached_reqs.req_ids == [1]
    assert scheduler.kv_cache_manager.get_block_ids(0) == []
    scheduler.abort_requests([0])
    _, outputs = run_step(scheduler, executor)
    assert [o.request_id for o in outputs[0].outputs] == ["1"]


def test_a_request_the_worker_fails_ends_in_an_error_with_its_reason_and_frees_its_blocks():
    """A worker that cannot go on with a request (its grammar failed) reports it with the step's
    tokens: the request ends "error" with the reason, its token of that step is dropped, the
    others carry on, and the next diff tells the workers to drop it."""
    scheduler, executor = make_scheduler()
    for req_id in (0, 1):
        scheduler.add_request(make_request(req_id, max_tokens=20))
    run_step(scheduler, executor)
    scheduler_output = scheduler.schedule()
    runner_output = executor.execute_model(scheduler_output)
    runner_output.failed_req_ids = [0, 99]
    runner_output.failure_reasons = ["structured output: no way on", "unknown request"]
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    by_id = {o.request_id: o for o in outputs[0].outputs}
    assert by_id["0"].finish_reason == "error" and by_id["0"].new_token_ids == []
    assert by_id["0"].stop_reason == "structured output: no way on"
    assert by_id["1"].finish_reason is None and len(by_id["1"].new_token_ids) == 1
    assert scheduler.kv_cache_manager.get_block_ids(0) == []
    output, _ = run_step(scheduler, executor)
    assert output.finished_req_ids == [0] and output.scheduled_cached_reqs.req_ids == [1]


def test_a_structured_request_waits_for_its_grammar_without_holding_anyone_up():
    """The grammar goes to the workers once, with the next step; the request is left out of the
    steps until a worker says its matcher is built, while the others run; with nothing else to
    do the engine polls the workers (a step of no tokens they may hold briefly); one aborted
    while it waits leaves no trace."""
    scheduler, executor = make_scheduler()
    executor.initialize_cache(executor.num_blocks)
    scheduler.add_request(make_request(0, max_tokens=20))
    scheduler.add_request(make_request(1, grammar="a grammar"))
    scheduler.add_request(make_request(2, grammar="another"))
    first = scheduler.schedule()
    assert (first.grammar_req_ids, first.grammars) == ([1, 2], ["a grammar", "another"])
    assert [new.req_id for new in first.scheduled_new_reqs] == [0]
    assert scheduler.make_stats().num_waiting == 2
    runner_output = executor.execute_model(first)
    runner_output.grammars_ready = []  # still building
    scheduler.update_from_output(first, runner_output)
    second = scheduler.schedule()
    assert second.grammar_req_ids == [] and second.grammar_wait_s == 0  # request 0 runs
    runner_output = executor.execute_model(second)
    runner_output.grammars_ready = [1, 7]  # 7: not ours (a finished request, say)
    scheduler.update_from_output(second, runner_output)
    scheduler.abort_requests([2])
    third = scheduler.schedule()
    assert [new.req_id for new in third.scheduled_new_reqs] == [1]
    assert third.grammar_req_ids == [] and third.finished_req_ids == []
    scheduler.update_from_output(third, executor.execute_model(third))
    scheduler.abort_requests([0, 1])
    idle = scheduler.schedule()
    assert idle.total_num_scheduled_tokens == 0 and idle.grammar_wait_s == 0
    scheduler.update_from_output(idle, ModelRunnerOutput(step_id=idle.step_id))
    scheduler.check_all_free()

    scheduler.add_request(make_request(3, grammar="a grammar"))
    sent = scheduler.schedule()
    assert sent.grammar_req_ids == [3] and sent.total_num_scheduled_tokens == 0
    scheduler.update_from_output(sent, ModelRunnerOutput(step_id=sent.step_id))
    poll = scheduler.schedule()
    assert poll.total_num_scheduled_tokens == 0 and poll.grammar_wait_s > 0
    scheduler.update_from_output(poll, ModelRunnerOutput(step_id=poll.step_id, grammars_ready=[3]))
    assert [new.req_id for new in scheduler.schedule().scheduled_new_reqs] == [3]


def test_tokens_for_a_request_aborted_during_the_step_are_ignored():
    scheduler, executor = make_scheduler()
    scheduler.add_request(make_request(0))
    executor.initialize_cache(executor.num_blocks)
    scheduler_output = scheduler.schedule()
    runner_output = executor.execute_model(scheduler_output)
    scheduler.abort_requests([0])
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    (only,) = outputs[0].outputs
    assert only.finish_reason == "abort" and only.new_token_ids == []
    scheduler.check_all_free()


def test_waiting_requests_can_be_aborted():
    scheduler, executor = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request(0))
    scheduler.add_request(make_request(1))
    run_step(scheduler, executor)
    scheduler.abort_requests([1])
    output, outputs = run_step(scheduler, executor)
    assert output.finished_req_ids == []  # the workers never saw it
    assert ("1", "abort") in [(o.request_id, o.finish_reason) for o in outputs[0].outputs]
    run_to_end(scheduler, executor)
    scheduler.check_all_free()


def test_finished_ids_wait_for_a_step_that_reaches_the_workers():
    scheduler, executor = make_scheduler()
    scheduler.add_request(make_request(0, max_tokens=1))
    run_step(scheduler, executor)
    empty, outputs = run_step(scheduler, executor)
    assert empty.total_num_scheduled_tokens == 0 and empty.finished_req_ids == [] and outputs == {}
    scheduler.add_request(make_request(1, max_tokens=1))
    output, _ = run_step(scheduler, executor)
    assert output.finished_req_ids == [0]


def test_outputs_are_grouped_by_client_with_stats_and_logprob_rows():
    scheduler, executor = make_scheduler()
    scheduler.add_request(make_request(0, client_index=0, logprobs=2))
    scheduler.add_request(make_request(1, client_index=1))
    _, outputs = run_step(scheduler, executor)
    assert set(outputs) == {0, 1}
    (mine,), (theirs,) = outputs[0].outputs, outputs[1].outputs
    assert mine.logprobs is not None and theirs.logprobs is None
    assert mine.logprobs.token_ids == [mine.new_token_ids]
    stats = outputs[1].scheduler_stats
    assert stats is not None and stats.num_running == 2 and stats.step_num_prefill_tokens == 12
    _, outputs = run_step(scheduler, executor)
    assert outputs[0].scheduler_stats.step_num_decode_tokens == 2


def test_check_all_free_complains_while_requests_are_left():
    scheduler, executor = make_scheduler()
    scheduler.add_request(make_request(0))
    with pytest.raises(AssertionError):
        scheduler.check_all_free()
    run_step(scheduler, executor)
    scheduler.abort_requests([0])
    scheduler.check_all_free()


def test_runner_output_for_an_unknown_request_is_ignored():
    scheduler, _ = make_scheduler()
    outputs = scheduler.update_from_output(
        scheduler.schedule(), ModelRunnerOutput(step_id=1, req_ids=[42], sampled_token_ids=[3])
    )
    assert outputs == {}


def test_bench_scheduler_script_reports_the_sweep_as_json():
    args = ["--running", "64", "--waiting", "20", "--steps", "10", "--json"]
    command = [*LAB, "scheduler", *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=CHECKOUT)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"machine", "config", "headline", "rows"}
    assert [(r["running"], r["waiting"]) for r in report["rows"]] == [
        (64, 20),
        (256, 20),
        (1024, 20),
        (64, 200),
        (64, 20),
    ]
    assert report["rows"][-1]["num_blocks"] > 9 * report["rows"][0]["num_blocks"]
    assert all(r["step_us"] > 0 for r in report["rows"])


def test_stats_count_steps_tokens_and_tokens_per_step_cumulatively():
    scheduler, executor = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request(0, prompt_len=10, max_tokens=3))
    scheduler.add_request(make_request(1, prompt_len=2, max_tokens=3))
    run_to_end(scheduler, executor)
    stats = scheduler.make_stats()
    # Prompts of 10 and 2 tokens under a budget of 8 (8, then 2 + 2), then two decode steps.
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (12, 2 + 2)
    assert stats.num_steps == 4 and sum(stats.iteration_tokens) == 4
    # Steps of 8, 4, 2 and 2 tokens: buckets (1], (1, 8], (8, 16] ...
    assert stats.iteration_tokens[:3] == [0, 4, 0]
    scheduler.schedule()  # a step with nothing to do is not counted
    assert scheduler.make_stats().num_steps == 4


def test_a_finished_request_reports_where_it_spent_its_time():
    scheduler, executor = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request(0, prompt_len=8, max_tokens=3))
    scheduler.add_request(make_request(1, prompt_len=2, max_tokens=2))
    finals = {}
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler, executor)
        for out in outputs[0].outputs if 0 in outputs else []:
            if out.finish_reason is not None:
                finals[out.request_id] = out.timings
            else:
                assert out.timings is None, "timings come with the final output only"
    first, second = finals["0"], finals["1"]
    # Request 1 waited while request 0's prompt took the whole budget of the first step.
    assert first.queued >= 0 and second.queued > 0
    assert first.prefill > 0 and first.decode > 0 and second.decode > 0


def test_an_aborted_request_has_timings_only_once_it_ran():
    scheduler, executor = make_scheduler(max_num_batched_tokens=4, max_num_seqs=1)
    scheduler.add_request(make_request(0, prompt_len=2, max_tokens=50))
    scheduler.add_request(make_request(1, prompt_len=2, max_tokens=50))
    run_step(scheduler, executor)
    run_step(scheduler, executor)
    scheduler.abort_requests([0, 1])
    _, outputs = run_step(scheduler, executor)
    timings = {out.request_id: out.timings for out in outputs[0].outputs}
    assert timings["0"] is not None and timings["0"].decode > 0
    assert timings["1"] is None, "never scheduled: no engine times to report"


def test_num_preempted_waiting_counts_requests_sent_back():
    scheduler, executor = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    for req_id in range(2):
        scheduler.add_request(make_request(req_id, prompt_len=7, max_tokens=20))
    seen = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler, executor)
        seen = max(seen, scheduler.num_preempted_waiting)
    assert seen >= 1 and scheduler.make_stats().num_preemptions >= 1
