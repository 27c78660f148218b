"""The scheduler's half of speculative decoding, with a model-free worker that verifies drafts.

``SpecFakeExecutor`` is the fake executor (diff mirroring, slot-by-slot KV simulation: every
position a request attends to must hold its own token) plus speculation: drafts are written into
the KV slots after the known tokens like real ones, checked against the fake model, and the
worker proposes the next drafts, right for the first few positions and then wrong, so every
acceptance length happens. Whatever the drafts, the tokens must be the fake model's, the diff's
``num_computed_tokens`` must agree with the worker's after each rollback, and a rejected
draft's KV must never be read as a real token (by its request or through the prefix cache).
"""

from __future__ import annotations

import pytest

from conveyor.engine_core import Request, Scheduler
from conveyor.engine_core.stats_logger import format_stats_line
from conveyor.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput, SchedulerStats
from conveyor.protocol.speculative import SpeculativeConfig, parse_speculative_config
from tests.fake_executor import FakeExecutor, OverlappedSteps, fake_next_token, make_scheduler

VOCAB = 50
K = 3


class SpecFakeExecutor(FakeExecutor):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._drafts: dict[int, list[int]] = {}
        self.num_proposals = 0

    def run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._drafts = scheduler_output.scheduled_spec_decode_tokens
        for drafts in self._drafts.values():
            assert 1 <= len(drafts) <= K
        return super().run_step(scheduler_output)

    def _with_drafts(self, req_id: int) -> list[int]:
        return self.mirrors[req_id].token_ids + self._drafts.get(req_id, [])

    def _check_and_write(self, req_id: int, num_tokens: int) -> None:
        mirror = self.mirrors[req_id]
        drafts = self._drafts.get(req_id, [])
        if drafts:
            assert mirror.num_computed_tokens + 1 == len(mirror.token_ids), "drafts mid-prompt"
            assert num_tokens == 1 + len(drafts)
        known = mirror.token_ids
        mirror.token_ids = known + drafts  # the worker writes the drafts after the known tokens
        try:
            super()._check_and_write(req_id, num_tokens)
        finally:
            mirror.token_ids = known

    def _check_reads(self, req_id: int, num_tokens: int) -> None:
        mirror = self.mirrors[req_id]
        known = mirror.token_ids
        mirror.token_ids = known + self._drafts.get(req_id, [])
        try:
            super()._check_reads(req_id, num_tokens)
        finally:
            mirror.token_ids = known

    def _sample(self, step_id: int, scheduled: list[tuple[int, int]]) -> ModelRunnerOutput:
        output = ModelRunnerOutput(step_id=step_id, num_sampled_tokens=[], spec_token_ids=[])
        for req_id, num_tokens in scheduled:
            mirror = self.mirrors[req_id]
            drafts = self._drafts.get(req_id, [])
            mirror.num_computed_tokens += num_tokens - len(drafts)
            if mirror.num_computed_tokens < len(mirror.token_ids):
                continue
            tokens = []
            for draft in drafts + [None]:
                token = fake_next_token(mirror.token_ids + tokens, self.vocab_size)
                tokens.append(token)
                if token != draft:
                    break
            # Accepted drafts are computed; the token after them is not yet.
            mirror.num_computed_tokens += len(tokens) - 1
            mirror.token_ids += tokens
            output.req_ids.append(req_id)
            output.sampled_token_ids += tokens
            output.num_sampled_tokens.append(len(tokens))
            output.spec_token_ids.append(self._propose(req_id, step_id))
        return output

    def _propose(self, req_id: int, step_id: int) -> list[int]:
        """Right for the first (req_id + step_id) % (K + 1) positions, then one wrong token."""
        self.num_proposals += 1
        history = list(self.mirrors[req_id].token_ids)
        num_right = (req_id + step_id) % (K + 1)
        drafts = []
        for i in range(K):
            token = fake_next_token(history, self.vocab_size)
            if i >= num_right:
                token = (token + 1) % self.vocab_size
            drafts.append(token)
            history.append(token)
        return drafts[: num_right + 1]


def spec_scheduler(
    num_blocks: int = 64, disable_by_batch_size: int = 8, **options: object
) -> tuple[Scheduler, SpecFakeExecutor]:
    spec = SpeculativeConfig(num_speculative_tokens=K, disable_by_batch_size=disable_by_batch_size)
    scheduler, plain = make_scheduler(num_blocks=num_blocks, speculative=spec, **options)
    executor = SpecFakeExecutor(num_blocks, VOCAB, plain.block_size)
    return scheduler, executor


def make_request(req_id: int, prompt: list[int], max_tokens: int = 20, **params) -> Request:
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        max_model_len=512,
    )


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(fake_next_token(history, VOCAB))
    return history[len(prompt) :]


def run(scheduler: Scheduler, executor: FakeExecutor, overlapped: bool = False) -> dict:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    driver = OverlappedSteps(scheduler, executor) if overlapped else None
    for _ in range(1000):
        if not (scheduler.has_unfinished_requests() or scheduler.has_pending_outputs()):
            if driver is not None:
                assert not driver.in_flight
            return {"tokens": tokens, "reasons": reasons}
        if driver is not None:
            outputs = driver.step()
        else:
            if executor.initialized_num_blocks is None:
                executor.initialize_cache(executor.num_blocks)
            scheduler_output = scheduler.schedule()
            runner_output = (
                executor.execute_model(scheduler_output)
                if scheduler_output.total_num_scheduled_tokens
                else ModelRunnerOutput(step_id=scheduler_output.step_id)
            )
            outputs = scheduler.update_from_output(scheduler_output, runner_output)
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                assert out.request_id not in reasons, "output after the final one"
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
    raise AssertionError("requests did not finish")


def prompts(num: int, length: int = 10) -> list[list[int]]:
    return [[(3 + i * 11 + j * 5) % VOCAB for j in range(length)] for i in range(num)]


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [64, 14], ids=["roomy", "preempting"])
def test_tokens_are_the_models_whatever_the_drafts(overlapped, num_blocks) -> None:
    scheduler, executor = spec_scheduler(
        num_blocks, async_scheduling=overlapped, max_num_batched_tokens=16
    )
    all_prompts = prompts(5) + [prompts(1)[0]]  # the last repeats the first: prefix hits
    for i, prompt in enumerate(all_prompts):
        scheduler.add_request(make_request(i, prompt, max_tokens=17 + i))
    result = run(scheduler, executor, overlapped)
    for i, prompt in enumerate(all_prompts):
        assert result["tokens"][str(i)] == expected(prompt, 17 + i)
        assert result["reasons"][str(i)] == "length"
    scheduler.check_all_free()
    stats = scheduler.make_stats()
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1] > 0
    if not overlapped and num_blocks == 64:
        # Rejected drafts are not generated tokens: each output but the first (which the
        # prompt's last step makes) counts once.
        assert stats.num_generation_tokens == sum(17 + i - 1 for i in range(6))
    if num_blocks == 14:
        assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


def test_drafts_take_budget_and_slots_and_roll_back() -> None:
    scheduler, executor = spec_scheduler(max_num_batched_tokens=64)
    executor.initialize_cache(executor.num_blocks)
    prompt = prompts(1)[0]
    request = make_request(0, prompt)
    scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, executor.execute_model(first))
    assert request.num_tokens == len(prompt) + 1
    # The worker proposed (step 1: 1 % 4 = 1 right, then a wrong one).
    second = scheduler.schedule()
    drafts = second.scheduled_spec_decode_tokens[0]
    assert len(drafts) == 2
    assert second.scheduled_cached_reqs.num_scheduled_tokens == [3]
    assert second.total_num_scheduled_tokens == 3
    assert request.num_computed_tokens == len(prompt) + 3  # optimistic, drafts included
    scheduler.update_from_output(second, executor.execute_model(second))
    # One draft accepted, one rejected: two new tokens, one position rolled back.
    assert request.num_tokens == len(prompt) + 3
    assert request.num_computed_tokens == len(prompt) + 2
    assert request.output_token_ids == expected(prompt, 3)


def test_drafts_stop_at_max_tokens_and_a_stop_token_inside_the_run_ends_it() -> None:
    prompt = prompts(1)[0]
    want = expected(prompt, 12)
    second = expected(prompt + [1], 30)
    stop_at = next(i for i in range(5, 30) if second.index(second[i]) == i) + 1
    scheduler, executor = spec_scheduler()
    scheduler.add_request(make_request(0, prompt, max_tokens=3))
    stop = [second[stop_at - 1]]
    scheduler.add_request(make_request(1, prompt + [1], max_tokens=30, stop_token_ids=stop))
    result = run(scheduler, executor)
    assert result["tokens"]["0"] == want[:3]
    assert result["reasons"]["0"] == "length"
    assert result["tokens"]["1"] == second[:stop_at]
    assert result["reasons"]["1"] == "stop"
    for scheduler_output in executor.scheduler_outputs:
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if req_id == 0:
                assert len(drafts) <= 1  # 3 tokens: at most 1 + 1 after the first
    scheduler.check_all_free()


def test_rejected_drafts_never_enter_the_prefix_cache() -> None:
    """A request whose rejected drafts filled whole blocks ends; a request with its prompt and
    outputs as its own prompt must hit only the blocks of real tokens (the fake executor checks
    every position read holds the reader's token)."""
    scheduler, executor = spec_scheduler(block_size=4)
    prompt = prompts(1, 9)[0]
    scheduler.add_request(make_request(0, prompt, max_tokens=9))
    first = run(scheduler, executor)["tokens"]["0"]
    scheduler.check_all_free()
    pool = scheduler.kv_cache_manager.block_pool
    num_real_blocks = (len(prompt) + len(first)) // 4
    assert len(pool.cached_blocks) <= num_real_blocks
    scheduler.add_request(make_request(1, prompt + first + [7], max_tokens=5))
    result = run(scheduler, executor)
    assert result["tokens"]["1"] == expected(prompt + first + [7], 5)
    assert scheduler.kv_cache_manager.prefix_cache_hits > 0
    scheduler.check_all_free()


def test_no_drafts_above_the_batch_size_switch_and_none_for_grammars() -> None:
    scheduler, executor = spec_scheduler(disable_by_batch_size=2)
    for i, prompt in enumerate(prompts(3)):
        scheduler.add_request(make_request(i, prompt, max_tokens=6 if i == 2 else 20))
    result = run(scheduler, executor)
    for step in executor.scheduler_outputs:
        num_running = len(step.scheduled_cached_reqs.req_ids) + len(step.scheduled_new_reqs)
        if step.scheduled_spec_decode_tokens:
            assert num_running <= 2
    assert any(s.scheduled_spec_decode_tokens for s in executor.scheduler_outputs)
    assert result["tokens"]["0"] == expected(prompts(3)[0], 20)
    scheduler.check_all_free()


def test_async_never_runs_a_speculating_request_ahead() -> None:
    scheduler, executor = spec_scheduler(async_scheduling=True)
    scheduler.add_request(make_request(0, prompts(1)[0], max_tokens=12))
    driver = OverlappedSteps(scheduler, executor)
    seen = []
    while scheduler.has_unfinished_requests():
        driver.step(seen.append)
    # While speculating, no step is scheduled for the request while its previous one is out.
    for before, after in zip(seen, seen[1:]):
        if before.total_num_scheduled_tokens and before.scheduled_cached_reqs.req_ids:
            assert not after.total_num_scheduled_tokens or after.step_id > before.step_id
    assert sum(bool(s.scheduled_spec_decode_tokens) for s in seen) > 0
    scheduler.check_all_free()


def test_the_stats_line_gives_acceptance() -> None:
    before = SchedulerStats(
        spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=9
    )
    after = SchedulerStats(
        spec_num_drafts=30, spec_num_draft_tokens=90, spec_num_accepted_tokens=54
    )
    line = format_stats_line(0, before, after, 1.0, 0)
    assert line.endswith(", draft acceptance 75.0 %, mean accepted length 3.25")
    assert "draft" not in format_stats_line(0, before, before, 1.0, 0)


def test_speculative_config_parsing_refuses_what_it_does_not_do() -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}'
    )
    assert config == SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_max=3, prompt_lookup_min=1
    )
    assert parse_speculative_config(None) is None
    # vLLM's lookup lengths: 5 and 5 when neither is given, one given stands for both (the
    # documented example '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max":
    # 4}' looks up 4-grams only, in both engines).
    for given, lengths in [
        ({}, (5, 5)),
        ({"prompt_lookup_max": 4}, (4, 4)),
        ({"prompt_lookup_min": 3}, (3, 3)),
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 6}, (2, 6)),
    ]:
        parsed = parse_speculative_config({"method": "ngram", **given})
        assert (parsed.prompt_lookup_min, parsed.prompt_lookup_max) == lengths, given
    # vLLM's inference: a model without a method is a draft model.
    draft = parse_speculative_config('{"model": "/m", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.num_lookahead_tokens) == ("draft_model", "/m", 3)
    assert config.num_lookahead_tokens == 0
    for bad, word in [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
        ('{"method": "ngram", "model": "x"}', "model"),
        ('{"method": "ngram", "quantization": "int8"}', "quantization"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"model": "/m", "prompt_lookup_max": 3}', "prompt_lookup_max"),
        ('{"model": "/m", "draft_tensor_parallel_size": 1}', "draft_tensor_parallel_size"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup"),
        ("[1]", "object"),
    ]:
        with pytest.raises(ValueError, match=word):
            parse_speculative_config(bad)


class WrongDraftsExecutor(SpecFakeExecutor):
    def _propose(self, req_id: int, step_id: int) -> list[int]:
        history = self.mirrors[req_id].token_ids
        return [(fake_next_token(history, self.vocab_size) + 1) % self.vocab_size] * K


def test_a_request_whose_drafts_keep_failing_backs_off() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=K)
    scheduler, plain = make_scheduler(num_blocks=64, speculative=spec)
    executor = WrongDraftsExecutor(64, VOCAB, plain.block_size)
    prompt = prompts(1)[0]
    scheduler.add_request(make_request(0, prompt, max_tokens=80))
    result = run(scheduler, executor)
    assert result["tokens"]["0"] == expected(prompt, 80)
    with_drafts = [bool(s.scheduled_spec_decode_tokens) for s in executor.scheduler_outputs]
    # Every draft fails: after two misses, 2, 4, 8, 16, 32 steps without; a handful in all.
    assert 3 <= sum(with_drafts) <= 8
    assert scheduler.make_stats().spec_num_accepted_tokens == 0
    scheduler.check_all_free()


def test_under_a_tbt_slo_drafts_count_as_decode_tokens_and_attention_pairs() -> None:
    scheduler, executor = spec_scheduler(max_num_batched_tokens=64, tbt_slo_ms=1000.0)
    executor.initialize_cache(executor.num_blocks)
    prompt = prompts(1, 40)[0]
    scheduler.add_request(make_request(0, prompt))
    first = scheduler.schedule()
    scheduler.update_from_output(first, executor.execute_model(first))
    second = scheduler.schedule()
    drafts = second.scheduled_spec_decode_tokens[0]
    plan = scheduler._plan
    assert plan.num_generated_tokens == 1 + len(drafts)
    start, n = len(prompt), 1 + len(drafts)
    assert scheduler.step_budget._pairs(plan) == n * start + n * (n + 1) // 2
    scheduler.update_from_output(second, executor.execute_model(second))
