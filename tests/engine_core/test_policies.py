"""Each policy's defining behaviour, shown on a small scenario through the fake executor."""

from __future__ import annotations

import pytest

from conveyor.engine_core import Request
from conveyor.engine_core.policies import POLICY_CLASSES, make_policy
from conveyor.protocol import SamplingParams, SchedulerOutput
from conveyor.protocol.config import POLICIES
from tests.fake_executor import make_scheduler, run_step


def make_request(req_id: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        req_id,
        [(req_id * 13 + i) % 50 for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_model_len=512,
        arrival_time=float(req_id),
    )


def new_ids(output: SchedulerOutput) -> list[int]:
    return [n.req_id for n in output.scheduled_new_reqs]


def test_every_configured_policy_has_a_class():
    assert set(POLICY_CLASSES) == set(POLICIES)
    assert make_policy("orca").name == "orca"
    with pytest.raises(ValueError):
        make_policy("lottery")


def test_stall_free_serves_every_decode_first_and_chunks_a_long_prompt():
    scheduler, executor = make_scheduler(max_num_batched_tokens=16)
    for i in range(3):
        scheduler.add_request(make_request(i, 4, 30))
    run_step(scheduler, executor)
    scheduler.add_request(make_request(3, 40, 2))
    chunks: list[int] = []
    while sum(chunks) < 40:
        output, _ = run_step(scheduler, executor)
        cached = output.scheduled_cached_reqs
        # The decodes keep their cadence: one token each, every step, listed first.
        assert cached.req_ids[:3] == [0, 1, 2] and cached.num_scheduled_tokens[:3] == [1, 1, 1]
        assert output.total_num_scheduled_tokens <= 16
        chunks.append(output.total_num_scheduled_tokens - 3)
    # The prompt gets what the decodes leave of the budget.
    assert chunks == [13, 13, 13, 1]


def test_prefill_first_steps_are_all_prefill_or_all_decode():
    scheduler, executor = make_scheduler(
        policy="prefill-first", max_num_batched_tokens=64, max_model_len=64
    )
    for i in range(2):
        scheduler.add_request(make_request(i, 6, 8))
    first, _ = run_step(scheduler, executor)
    assert new_ids(first) == [0, 1]
    decode, _ = run_step(scheduler, executor)
    assert decode.scheduled_cached_reqs.req_ids == [0, 1] and new_ids(decode) == []
    scheduler.add_request(make_request(2, 30, 3))
    prefill, _ = run_step(scheduler, executor)
    # The running decodes stall for a step while the new prompt runs whole.
    assert new_ids(prefill) == [2] and prefill.scheduled_cached_reqs.req_ids == []
    assert prefill.total_num_scheduled_tokens == 30
    decode, _ = run_step(scheduler, executor)
    assert decode.scheduled_cached_reqs.req_ids == [0, 1, 2] and new_ids(decode) == []


def test_prefill_first_runs_decodes_when_the_head_prompt_does_not_fit():
    scheduler, executor = make_scheduler(
        policy="prefill-first", num_blocks=6, block_size=4, enable_prefix_caching=False
    )
    scheduler.add_request(make_request(0, 4, 12))
    run_step(scheduler, executor)
    scheduler.add_request(make_request(1, 20, 2))  # needs 5 blocks; 4 free
    output, _ = run_step(scheduler, executor)
    assert new_ids(output) == [] and output.scheduled_cached_reqs.req_ids == [0]


def test_orca_reserves_prompt_plus_max_tokens_and_never_preempts():
    scheduler, executor = make_scheduler(
        policy="orca", num_blocks=12, block_size=4, enable_prefix_caching=False
    )
    scheduler.add_request(make_request(0, 6, 10))
    run_step(scheduler, executor)
    # 6 + 10 tokens in blocks of 4: every block it will ever need, taken at admission.
    assert len(scheduler.kv_cache_manager.get_block_ids(0)) == 4
    for i in range(1, 6):
        scheduler.add_request(make_request(i, 5, 7))
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler, executor)
        assert output.preempted_req_ids == []
        assert sum(len(b) for b in output.scheduled_cached_reqs.new_block_ids) == 0
    assert scheduler.make_stats().num_preemptions == 0
    scheduler.check_all_free()


def test_orca_blocks_head_of_line():
    scheduler, executor = make_scheduler(
        policy="orca", num_blocks=9, block_size=4, enable_prefix_caching=False
    )
    scheduler.add_request(make_request(0, 4, 12))  # holds 4 of the 8 usable blocks
    run_step(scheduler, executor)
    scheduler.add_request(make_request(1, 8, 12))  # needs 5: does not fit
    scheduler.add_request(make_request(2, 2, 2))  # needs 1: would fit, but waits behind 1
    output, _ = run_step(scheduler, executor)
    assert new_ids(output) == [] and [r.req_id for r in scheduler.waiting] == [1, 2]


def test_static_admits_nobody_until_the_whole_batch_has_ended():
    scheduler, executor = make_scheduler(policy="static", max_num_seqs=2)
    scheduler.add_request(make_request(0, 4, 2))
    scheduler.add_request(make_request(1, 4, 6))
    scheduler.add_request(make_request(2, 4, 2))
    first, _ = run_step(scheduler, executor)
    assert new_ids(first) == [0, 1]
    admitted_at = None
    for step in range(2, 12):
        output, _ = run_step(scheduler, executor)
        if 2 in new_ids(output):
            admitted_at = step
            break
        # Request 0 leaves after its second token; its slot stays empty.
        assert [r.req_id for r in scheduler.waiting] == [2]
    # Request 1 samples its 6th token in step 6, so request 2 joins in step 7.
    assert admitted_at == 7
