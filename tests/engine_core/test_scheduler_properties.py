"""Properties of every policy over random streams of arrivals, aborts and model outputs.

Hypothesis draws a workload (prompts sharing prefixes, output lengths, priorities, arrival steps,
aborts) and a configuration (budget, width, a tiny or a roomy KV pool); the scheduler runs it to
the end through the fake executor, which checks every diff and every KV slot it reads. Then:
no step broke the budget or the width cap, admissions kept the queue's order, nothing is left
anywhere, and every request that was not aborted produced exactly the tokens it produces alone,
however often it was chunked, preempted and resumed. The same holds with async scheduling (one step
always in flight while the next is scheduled), which must also never emit a token after a
request's final output.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.engine_core import Request
from conveyor.engine_core.request_queue import priority_key
from conveyor.protocol import SamplingParams, SchedulerOutput
from conveyor.protocol.config import POLICIES
from tests.fake_executor import OverlappedSteps, fake_next_token, make_scheduler, run_step

VOCAB = 50
EOS = 0
BLOCK_SIZE = 4
MAX_MODEL_LEN = 40
# The longest request: 24 prompt + 12 output tokens fit 9 blocks, so a 10-block pool (9 usable)
# holds any single request and every workload must finish, however tight.
MAX_PROMPT, MAX_OUTPUT = 24, 12
PREFIX = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3, 3]


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int
    stops_on_eos: bool


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 5),
    prompt=st.builds(
        lambda k, tail: tuple(PREFIX[:k]) + tuple(tail),
        st.integers(0, len(PREFIX)),
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=MAX_PROMPT - len(PREFIX)),
    ),
    max_tokens=st.integers(1, MAX_OUTPUT),
    priority=st.integers(0, 3),
    stops_on_eos=st.booleans(),
)


@st.composite
def workloads(draw: st.DrawFn, policy: str) -> dict:
    whole_prompts = policy != "stall-free"
    return {
        "arrivals": sorted(draw(st.lists(arrivals, min_size=2, max_size=10)), key=lambda a: a.step),
        "aborts": draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=3)),
        "options": {
            "policy": policy,
            "queue_order": draw(st.sampled_from(["fcfs", "priority"])),
            "max_num_seqs": draw(st.integers(1, 6)),
            # Whole-prompt policies need a budget that holds the longest prompt.
            "max_num_batched_tokens": draw(
                st.integers(MAX_MODEL_LEN, 64) if whole_prompts else st.integers(2, 48)
            ),
            "long_prefill_token_threshold": 0 if whole_prompts else draw(st.integers(0, 16)),
            "num_blocks": draw(st.sampled_from([10, 10, 12, 200])),
            "enable_prefix_caching": draw(st.booleans()),
        },
    }


def make_request(req_id: int, arrival: Arrival) -> Request:
    return Request(
        req_id,
        list(arrival.prompt),
        SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=not arrival.stops_on_eos),
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=(EOS,),
        arrival_time=float(arrival.step),
        priority=arrival.priority,
    )


def tokens_alone(request: Request) -> list[int]:
    """The request's tokens with nothing else around: the fake model run step by step."""
    alone = Request(
        request.req_id,
        list(request.prompt_token_ids),
        request.sampling_params,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=tuple(request.eos_token_ids),
    )
    while not alone.is_finished:
        alone.append_output_token_id(fake_next_token(alone.all_token_ids, VOCAB))
        alone.check_stop()
    return alone.output_token_ids


class Run:
    """Drives one workload and checks each step as it goes."""

    def __init__(self, workload: dict) -> None:
        options = dict(workload["options"])
        self.scheduler, self.executor = make_scheduler(
            block_size=BLOCK_SIZE, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, **options
        )
        self.config = self.scheduler.config
        self.overlapped = (
            OverlappedSteps(self.scheduler, self.executor) if self.config.async_scheduling else None
        )
        self.requests = [make_request(i, a) for i, a in enumerate(workload["arrivals"])]
        self.arrivals = workload["arrivals"]
        self.aborts = workload["aborts"]
        self.tokens: dict[int, list[int]] = {r.req_id: [] for r in self.requests}
        self.reasons: dict[int, str] = {}
        self.first_admissions: list[int] = []

    def run(self) -> None:
        for step in range(2000):
            for request, arrival in zip(self.requests, self.arrivals):
                if arrival.step == step:
                    self.scheduler.add_request(request)
            self.scheduler.abort_requests(
                self.requests[i].req_id
                for s, i in self.aborts
                if s == step and i < len(self.requests)
            )
            if step > self.arrivals[-1].step and not (
                self.scheduler.has_unfinished_requests()
                or self.scheduler.has_pending_outputs()
                or (self.overlapped is not None and self.overlapped.in_flight)
            ):
                return
            if self.overlapped is not None:
                outputs = self.overlapped.step(self.check_step)
            else:
                output, outputs = run_step(self.scheduler, self.executor)
                self.check_step(output)
            for client_outputs in outputs.values():
                for out in client_outputs.outputs:
                    req_id = int(out.request_id)
                    assert req_id not in self.reasons, "an output after the final one"
                    self.tokens[req_id] += out.new_token_ids
                    if out.finish_reason is not None:
                        self.reasons[req_id] = out.finish_reason
        raise AssertionError("livelock: requests still unfinished after 2000 steps")

    def check_step(self, output: SchedulerOutput) -> None:
        config, scheduler = self.config, self.scheduler
        assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
        num_scheduled = len(output.scheduled_new_reqs) + len(output.scheduled_cached_reqs.req_ids)
        assert num_scheduled <= config.max_num_seqs
        assert len(scheduler.running) <= config.max_num_seqs
        new_ids = [n.req_id for n in output.scheduled_new_reqs]
        self.first_admissions += new_ids
        if config.queue_order == "priority":
            admitted = new_ids + list(output.scheduled_cached_reqs.resumed_token_ids)
            still_waiting = [priority_key(r) for r in scheduler.waiting]
            for req_id in admitted:
                # Head-of-line in key order: nobody admitted while a better key waits.
                assert all(priority_key(self.requests[req_id]) < k for k in still_waiting)

    def check_end(self) -> None:
        self.scheduler.check_all_free()
        aborted = {self.requests[i].req_id for _, i in self.aborts if i < len(self.requests)}
        assert set(self.reasons) == {r.req_id for r in self.requests}
        if self.config.queue_order == "fcfs":
            assert self.first_admissions == sorted(self.first_admissions)
        for request in self.requests:
            expected = tokens_alone(request)
            produced, reason = self.tokens[request.req_id], self.reasons[request.req_id]
            if reason == "abort":
                assert request.req_id in aborted
                assert produced == expected[: len(produced)]
            else:
                assert reason in ("stop", "length"), (request, reason)
                assert produced == expected, (
                    f"req {request.req_id} after {request.num_preemptions} preemptions"
                )


def run_workload(workload: dict) -> Run:
    run = Run(workload)
    run.run()
    run.check_end()
    return run


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_policy_keeps_its_promises(policy: str, async_scheduling: bool, data: st.DataObject):
    workload = data.draw(workloads(policy))
    workload["options"]["async_scheduling"] = async_scheduling
    run = run_workload(workload)
    stats = run.scheduler.make_stats()
    # Shown by --hypothesis-show-statistics: how often the draws reach the interesting paths.
    event("preempted" if stats.num_preemptions else "no preemption")
    event("aborted" if "abort" in run.reasons.values() else "no abort")
    event("prefix hit" if stats.prefix_cache_hits else "no prefix hit")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["stall-free", "prefill-first"])
def test_a_tiny_pool_forces_preemption_and_tokens_still_match(policy: str, async_scheduling: bool):
    # Eight requests that each need up to 9 blocks of a 9-block pool: preemption is certain.
    workload = {
        "arrivals": [
            Arrival(0, tuple(PREFIX[: i + 1]) + (i + 10,) * 12, 12, 0, False) for i in range(8)
        ],
        "aborts": [],
        "options": {
            "policy": policy,
            "queue_order": "fcfs",
            "max_num_seqs": 8,
            "max_num_batched_tokens": 64,
            "num_blocks": 10,
            "enable_prefix_caching": True,
            "async_scheduling": async_scheduling,
        },
    }
    run = run_workload(workload)
    assert run.scheduler.make_stats().num_preemptions > 0
    assert any(r.num_preemptions > 0 and r.status.finish_reason != "abort" for r in run.requests)


def test_a_request_preempted_in_an_empty_step_then_finished_is_only_sent_as_finished():
    # Found by the property test: with async scheduling, req 2 was preempted in a step that had
    # no tokens (so its preemption waited for the next step) and then finished by the token in
    # flight; the next step told the workers it was both finished and preempted.
    workload = {
        "arrivals": [
            Arrival(0, (1,), 1, 0, False),
            Arrival(0, (7,) + (1,) * 12, 6, 0, False),
            Arrival(0, tuple(PREFIX[:10]) + (32, 46), 6, 0, True),
            Arrival(1, (1,), 1, 0, False),
        ],
        "aborts": [],
        "options": {
            "policy": "stall-free",
            "queue_order": "fcfs",
            "max_num_seqs": 2,
            "max_num_batched_tokens": 2,
            "long_prefill_token_threshold": 1,
            "num_blocks": 10,
            "enable_prefix_caching": False,
            "async_scheduling": True,
        },
    }
    run = run_workload(workload)
    assert run.requests[2].num_preemptions >= 1, "the workload no longer reaches the case"
    sent = run.executor.scheduler_outputs
    for output in sent:
        assert not set(output.finished_req_ids) & set(output.preempted_req_ids), output.step_id


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["stall-free", "prefill-first"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), sliding_window=st.sampled_from([1, 3, 6, 9]))
def test_a_sliding_window_frees_blocks_behind_it_and_keeps_every_promise(
    policy: str, async_scheduling: bool, sliding_window: int, data: st.DataObject
):
    # The fake executor checks each read inside the window only, so a block freed too early
    # (and reused by another request) fails there, as does a wrong table after a freed block.
    workload = data.draw(workloads(policy))
    workload["options"].update(async_scheduling=async_scheduling, sliding_window=sliding_window)
    run = run_workload(workload)
    event("freed behind the window" if run.scheduler.kv_cache_manager.num_window_freed_blocks
          else "nothing freed")  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_window_lets_a_pool_too_small_for_one_whole_request_serve_it(async_scheduling: bool):
    # 36 tokens need 9 blocks, the pool has 5 usable: only freeing behind the 6-token window
    # (at most 3 blocks of 4 in view, plus the chunk's) lets these run, one after the other,
    # without preemption.
    workload = {
        "arrivals": [Arrival(0, tuple(PREFIX) + (i + 10,) * 12, 12, 0, False) for i in range(2)],
        "aborts": [],
        "options": {
            "policy": "stall-free",
            "queue_order": "fcfs",
            "max_num_seqs": 1,
            "max_num_batched_tokens": 4,
            "num_blocks": 6,
            "enable_prefix_caching": True,
            "async_scheduling": async_scheduling,
            "sliding_window": 6,
        },
    }
    run = run_workload(workload)
    manager = run.scheduler.kv_cache_manager
    assert manager.num_window_freed_blocks >= 2 * 5
    assert run.scheduler.make_stats().num_preemptions == 0
