"""LoRA in the scheduler: at most max_loras adapters per step, slot loads in the diff, no
starvation, and prefix-cache blocks never shared between adapters.

Every step runs through the fake executor, and a stand-in for the workers' slots applies each
step's ``lora_loads``: every scheduled request's adapter must sit in a slot when its step runs.
"""

from __future__ import annotations

from conveyor.engine_core import Request, Scheduler
from conveyor.protocol import CacheConfig, SamplingParams, SchedulerConfig
from conveyor.protocol.lora import LoRAConfig, LoRARequest
from tests.fake_executor import FakeExecutor, run_step

VOCAB = 50


def make_request(req_id: int, lora_id: int, prompt: list[int] | None = None) -> Request:
    lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    return Request(
        req_id,
        prompt if prompt is not None else [(req_id * 7 + i) % VOCAB for i in range(6)],
        SamplingParams(max_tokens=4, ignore_eos=True),
        max_model_len=512,
        arrival_time=float(req_id),
        lora=lora,
        lora_id=lora_id,
    )


class Slots:
    """The workers' view: which adapter each slot holds, filled only by ``lora_loads``."""

    def __init__(self) -> None:
        self.slot_lora: dict[int, int] = {}
        self.lora_of_req: dict[int, int] = {}
        self.num_loads = 0
        self.first_step: dict[int, int] = {}

    def check(self, output, max_loras: int) -> None:
        for load in output.lora_loads:
            assert 0 <= load.slot < max_loras
            self.slot_lora[load.slot] = load.lora_id
            self.num_loads += 1
        for new in output.scheduled_new_reqs:
            self.lora_of_req[new.req_id] = new.lora_id
            self.first_step.setdefault(new.req_id, output.step_id)
        scheduled = [n.req_id for n in output.scheduled_new_reqs]
        scheduled += output.scheduled_cached_reqs.req_ids
        adapters = {self.lora_of_req[r] for r in scheduled} - {0}
        assert len(adapters) <= max_loras, f"step {output.step_id} runs adapters {adapters}"
        assert adapters <= set(self.slot_lora.values()), "an adapter runs in no slot"


def _run(scheduler: Scheduler, executor: FakeExecutor, slots: Slots, max_loras: int) -> None:
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            return
        output, _ = run_step(scheduler, executor)
        slots.check(output, max_loras)
    raise AssertionError("requests never finished")


def _scheduler(max_loras: int, num_blocks: int = 64, **options) -> tuple[Scheduler, FakeExecutor]:
    cache = CacheConfig(block_size=4, num_blocks=num_blocks)
    config = SchedulerConfig(max_model_len=512, **options)
    scheduler = Scheduler(config, cache, LoRAConfig(max_loras=max_loras))
    return scheduler, FakeExecutor(num_blocks, VOCAB, 4)


def test_a_step_runs_at_most_max_loras_adapters_and_nobody_starves():
    scheduler, executor = _scheduler(max_loras=2)
    slots = Slots()
    # Adapter 3 is one too many while 1 and 2 run; the later requests of 1 and the base model
    # must not overtake it (they would keep 1 pinned forever under a steady stream).
    for req_id, lora_id in enumerate([1, 2, 3, 1, 0]):
        scheduler.add_request(make_request(req_id, lora_id))
    _run(scheduler, executor, slots, max_loras=2)
    assert slots.first_step[2] > slots.first_step[0]
    assert slots.first_step[3] >= slots.first_step[2]
    assert slots.first_step[4] >= slots.first_step[2]
    scheduler.check_all_free()


def test_an_adapter_is_loaded_once_while_it_keeps_its_slot_and_lru_evicts():
    scheduler, executor = _scheduler(max_loras=2)
    slots = Slots()
    for req_id, lora_id in enumerate([1, 1, 2]):
        scheduler.add_request(make_request(req_id, lora_id))
    _run(scheduler, executor, slots, max_loras=2)
    assert slots.num_loads == 2
    # 1 and 2 idle in their slots: 1 again needs no load; 3 takes the least recently used (2).
    scheduler.add_request(make_request(3, 1))
    _run(scheduler, executor, slots, max_loras=2)
    assert slots.num_loads == 2
    scheduler.add_request(make_request(4, 3))
    _run(scheduler, executor, slots, max_loras=2)
    assert slots.num_loads == 3 and sorted(slots.slot_lora.values()) == [1, 3]
    scheduler.check_all_free()


def test_preemption_gives_back_the_adapter():
    # A pool too small for both: one is preempted, and its adapter's pin goes with it.
    scheduler, executor = _scheduler(max_loras=2, num_blocks=6, max_num_batched_tokens=64)
    slots = Slots()
    long = [i % VOCAB for i in range(8)]  # two blocks each, then a third: 6 of 5
    scheduler.add_request(make_request(0, 1, long))
    scheduler.add_request(make_request(1, 2, list(reversed(long))))
    _run(scheduler, executor, slots, max_loras=2)
    assert scheduler.make_stats().num_preemptions > 0
    assert scheduler.lora_slots is not None and scheduler.lora_slots.running_lora_ids == []
    scheduler.check_all_free()


def test_the_same_prompt_under_two_adapters_shares_no_block():
    scheduler, executor = _scheduler(max_loras=2)
    prompt = [(3 * i) % VOCAB for i in range(13)]  # three full blocks
    scheduler.add_request(make_request(0, 1, prompt))
    _run(scheduler, executor, Slots(), max_loras=2)
    kv = scheduler.kv_cache_manager
    assert kv.get_computed_blocks(make_request(1, 1, prompt))[1] == 12
    assert kv.get_computed_blocks(make_request(2, 2, prompt))[1] == 0
    assert kv.get_computed_blocks(make_request(3, 0, prompt))[1] == 0
