"""LoRA under CUDA graphs, what needs no GPU: the slot buffer a graph reads, the layers' graph
path, the runner's choice of graphs, and a CPU runner whose decode steps replay stand-ins for
whole-forward graphs with adapters in the batch, against transformers + PEFT.

The layers' graph path runs the Triton LoRA kernels: in Triton's interpreter on the CPU, on the
GPU with CONVEYOR_TEST_DEVICE=cuda (tests/devices.py). Capture and replay themselves run on a GPU
(tests/worker/test_cuda.py).
"""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest
import torch

from conveyor.frontend.engine_args import EngineArgs
from conveyor.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from conveyor.protocol.lora import LoRALoad
from conveyor.worker.attention import triton_backend
from conveyor.worker.attention.triton_backend import triton_unusable_reason
from conveyor.worker.cuda_graphs import DecodeGraphs
from conveyor.worker.lora import triton_lora
from conveyor.worker.lora.slots import LoRASlots
from conveyor.worker.lora.step_groups import StepGroups
from conveyor.worker.model_runner import ModelRunner
from tests.devices import TEST_DEVICE
from tests.worker.test_cuda_graphs import ForwardOnFixedBuffers
from tests.worker.test_lora_slots import MAX_RANK, NUM_SLOTS, _adapter, _layer

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")


def _buffer(groups: StepGroups) -> list[int]:
    return groups.slot_buffer.device_tensor.cpu().tolist()


def test_the_slot_buffer_holds_each_steps_slots_and_minus_one_past_them():
    groups = StepGroups(10, DEVICE)
    address = groups.slot_buffer.device_tensor.data_ptr()
    assert _buffer(groups) == [-1] * 10
    steps = [
        [1, -1, 0, 0, 2, 1, 1, -1],
        [0, -1, 2],  # shorter: rows 3 .. 7 of the step before must not stay
        [2] * 10,  # the whole buffer
        [-1, 1],
    ]
    for slots in steps:
        groups.set_tokens(np.array(slots), DEVICE)
        assert _buffer(groups) == slots + [-1] * (10 - len(slots))
        assert groups.token_slots.cpu().tolist() == slots
        assert groups.token_slots.dtype == torch.int32
        assert groups.token_slots.data_ptr() == address  # a view of the buffer, never a copy
    groups.clear()  # a step of the base model alone
    assert _buffer(groups) == [-1] * 10 and groups.token_slots is None
    groups.set_tokens(np.array([0, 0, 1]), DEVICE)
    groups.set_tokens(np.array([-1, -1, -1, -1]), DEVICE)  # no adapter: cleared the same way
    assert _buffer(groups) == [-1] * 10 and not groups.segments
    assert groups.slot_buffer.device_tensor.data_ptr() == address
    with pytest.raises(RuntimeError, match="11 tokens"):
        groups.set_tokens(np.zeros(11, dtype=np.int64), DEVICE)


def test_groups_without_a_slot_buffer_keep_their_cpu_behaviour():
    groups = StepGroups()
    assert groups.slot_buffer is None
    groups.set_tokens(np.array([1, -1, 0]), CPU)
    assert groups.token_slots is None and groups.segments == [(0, 0, 1), (1, 1, 2)]


def _graph_and_loop_slots(kind: str):
    """The same adapters in a graph-path layer (slot buffer, on DEVICE) and a loop layer."""
    layer, parts = _layer(kind)
    in_features = layer.weight.shape[1]
    adapters = {
        0: _adapter(parts, in_features, 4, list(range(len(parts))), 1),
        2: _adapter(parts, in_features, MAX_RANK, [len(parts) - 1], 2),
    }
    graph_groups = StepGroups(16, DEVICE)
    graph_groups.capturing = True
    graph = LoRASlots(layer, len(parts), graph_groups, NUM_SLOTS, MAX_RANK, torch.float32, DEVICE)
    loop = LoRASlots(layer, len(parts), StepGroups(), NUM_SLOTS, MAX_RANK, torch.float32, CPU)
    for slot, adapter in adapters.items():
        graph.load(slot, adapter)
        loop.load(slot, adapter)
    return graph, loop, in_features, sum(parts)


@pytest.mark.gpu_kernel
@pytest.mark.parametrize("kind", ["qkv", "down"])
def test_the_graph_path_adds_the_real_rows_corrections_and_nothing_to_padding(kind):
    _skip_without_triton()
    graph, loop, in_features, out_features = _graph_and_loop_slots(kind)
    generator = torch.Generator().manual_seed(5)
    # (the step's slots, the graph size it replays): padding rows have inputs of their own
    # (whatever the fixed buffers held), and a step after a longer one finds no stale slot.
    steps = [([2, -1, 0, 0, 2], 8), ([0, 0, 0, 0, 2, 2, -1, 2], 8), ([2, 0], 8), ([0], 2)]
    for slots, size in steps:
        n = len(slots)
        x = torch.randn(size, in_features, generator=generator)
        out = torch.randn(size, out_features, generator=generator)
        graph.groups.set_tokens(np.array(slots), DEVICE)
        got = graph.add_to(x.to(DEVICE), out.clone().to(DEVICE)).cpu()
        loop.groups.set_tokens(np.array(slots), CPU)
        expected = loop.add_with_torch(x[:n], out[:n].clone())
        torch.testing.assert_close(got[:n], expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[n:], out[n:]), f"padding rows of {slots} changed"


@pytest.mark.gpu_kernel
def test_a_step_without_adapters_through_the_graph_path_launches_and_adds_nothing(monkeypatch):
    _skip_without_triton()
    graph, _, in_features, out_features = _graph_and_loop_slots("qkv")
    launches = []
    add = triton_lora.add

    def counted(x, out, slots, a_t, b):
        launches.append(x.shape[0])
        return add(x, out, slots, a_t, b)

    monkeypatch.setattr(triton_lora, "add", counted)
    x = torch.randn(4, in_features).to(DEVICE)
    graph.groups.set_tokens(np.array([0, 2, 2, 0]), DEVICE)  # an adapter step first
    graph.groups.clear()
    out = torch.randn(4, out_features).to(DEVICE)
    assert torch.equal(graph.add_to(x, out.clone()), out)
    # Launched all the same: a graph captured on such a step must hold the launches.
    assert launches == [4]


def test_the_graph_path_refuses_where_the_triton_kernels_cannot_run(monkeypatch):
    graph, _, in_features, out_features = _graph_and_loop_slots("down")
    monkeypatch.setattr(triton_lora, "failure", "RuntimeError: no kernel image")
    x, out = torch.randn(2, in_features).to(DEVICE), torch.randn(2, out_features).to(DEVICE)
    with pytest.raises(RuntimeError, match="Triton LoRA kernels.*no kernel image"):
        graph.add_to(x, out)
    monkeypatch.setattr(triton_lora, "failure", None)
    no_buffer = StepGroups()
    no_buffer.capturing = True
    graph.groups = no_buffer
    with pytest.raises(RuntimeError, match="slot buffer"):
        graph.add_to(x, out)


def _skip_without_triton() -> None:
    if (reason := triton_unusable_reason(DEVICE)) is not None:
        pytest.skip(f"the Triton LoRA kernels cannot run here: {reason}")


# ------------------------------------------------------------------ the runner


def _lora_config(model_dir, **args):
    base = dict(
        model=str(model_dir),
        max_num_seqs=8,
        max_model_len=64,
        kv_cache_memory=4 << 20,
        device="cpu",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    return EngineArgs(**{**base, **args}).create_engine_config()


@pytest.fixture(scope="module")
def lora_runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(_lora_config(tiny_model_dir), CPU)


def test_graphs_with_lora_where_the_triton_lora_kernels_run(lora_runner, monkeypatch, caplog):
    # The CPU never captures; the decision is the CUDA runner's.
    assert not lora_runner._graphs_wanted()
    monkeypatch.setattr(lora_runner, "device", torch.device("cuda"))
    monkeypatch.setattr(triton_lora, "failure", None)
    monkeypatch.setattr(triton_backend, "triton_import_error", lambda: None)
    # Made with the runner, before any capture, for the largest step.
    size = lora_runner.config.scheduler.max_num_batched_tokens
    assert len(lora_runner.lora.groups.slot_buffer.device_tensor) == size
    assert lora_runner._graphs_wanted()
    causes = {
        "failure": "a launch failed (RuntimeError: no kernel image)",
        "import": "triton does not import (ModuleNotFoundError: triton)",
    }
    for cause, reason in causes.items():
        with monkeypatch.context() as patch:
            if cause == "failure":
                patch.setattr(triton_lora, "failure", "RuntimeError: no kernel image")
            else:
                patch.setattr(
                    triton_backend, "triton_import_error", lambda: "ModuleNotFoundError: triton"
                )
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="conveyor.worker.model_runner"):
                assert not lora_runner._graphs_wanted()
            assert "run eagerly" in caplog.text and reason in caplog.text
    # --enforce-eager still wins where the kernels run.
    monkeypatch.setattr(
        lora_runner, "config", msgspec.structs.replace(lora_runner.config, enforce_eager=True)
    )
    assert not lora_runner._graphs_wanted()


def test_a_capture_the_lora_kernels_cannot_join_leaves_decode_steps_eager(
    lora_runner, monkeypatch, caplog
):
    import conveyor.worker.model_runner as model_runner

    groups = lora_runner.lora.groups
    slots = next(iter(lora_runner.lora.layers.values()))
    seen = []

    def capture(model, input_ids, positions, sizes, block_size):
        # As the capture's first LoRA layer does, on a GPU whose Triton cannot build the kernels.
        seen.append(groups.capturing)
        slots.add_to(torch.zeros(2, slots.a_t.shape[1]), torch.zeros(2, slots.b.shape[2]))

    monkeypatch.setattr(lora_runner, "_graphs_wanted", lambda: True)
    monkeypatch.setattr(lora_runner, "_settled_reserved_bytes", lambda: 0)
    monkeypatch.setattr(model_runner, "capture_decode_graphs", capture)
    monkeypatch.setattr(triton_lora, "failure", "RuntimeError: no kernel image")
    with caplog.at_level(logging.WARNING, logger="conveyor.worker.model_runner"):
        assert lora_runner.capture_cuda_graphs() == 0
    assert lora_runner.decode_graphs is None
    assert seen == [True] and not groups.capturing  # the layers' eager paths are back
    assert "run eagerly" in caplog.text and "no kernel image" in caplog.text


class LoRAForwardOnFixedBuffers(ForwardOnFixedBuffers):
    """A whole-forward graph's stand-in on CPU with LoRA: the forward a capture records (every
    adapted layer on its graph path over the padded rows, the slot buffer read as it is)."""

    def replay(self, metadata) -> torch.Tensor:
        groups = self.runner.lora.groups
        groups.capturing = True
        try:
            return super().replay(metadata)
        finally:
            groups.capturing = False


@pytest.mark.gpu_kernel
def test_lora_decode_steps_replaying_whole_graphs_match_peft(tiny_model_dir, tmp_path):
    # What a LoRA runner's replays compute (the stand-in reruns the captured forward on the
    # fixed buffers, padding included): two adapters and the base model in every batch, the
    # batch shrinking and growing, one step of the base model alone right after adapter rows
    # sat where it reads. Each request's tokens are transformers + PEFT's.
    from benchmarks.fixtures.lora_maker import make_adapter, peft_greedy

    if (reason := triton_unusable_reason(CPU)) is not None:
        pytest.skip(f"the Triton backend cannot run on this CPU: {reason}")
    pytest.importorskip("peft")
    paths = [
        make_adapter(tiny_model_dir, tmp_path / "a", 8, ["q_proj", "v_proj", "down_proj"], 1),
        make_adapter(tiny_model_dir, tmp_path / "b", 16, ["k_proj", "o_proj", "up_proj"], 2),
    ]
    runner = ModelRunner(_lora_config(tiny_model_dir, attention_backend="triton"), CPU)
    assert runner.backend.full_decode_graphs
    runner.initialize_cache(runner.determine_num_blocks())
    replays: list[int] = []
    graphs = {size: LoRAForwardOnFixedBuffers(runner, size, replays) for size in (2, 4, 8)}
    runner.decode_graphs = DecodeGraphs(graphs, whole=True)
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 9, 3, 14, 7)]
    lora_ids = [0, 1, 2, 1, 0]  # request 0 and 4: the base model
    new = [
        NewRequestData(i, p, greedy, [1 + 4 * i + j for j in range(4)], 0, len(p), lora_ids[i])
        for i, p in enumerate(prompts)
    ]
    loads = [LoRALoad(slot, slot + 1, str(path)) for slot, path in enumerate(paths)]
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    computed = {i: len(p) for i, p in enumerate(prompts)}
    steps = [SchedulerOutput(1, new, lora_loads=loads)]
    lives = [[0, 1, 2, 3, 4]] * 2 + [[1, 2]] * 2 + [[0, 4]] * 2 + [[2, 3, 4]] * 2
    for step, live in enumerate(lives, start=2):
        cached = CachedRequestData(
            req_ids=live,
            new_block_ids=[[] for _ in live],
            num_computed_tokens=[computed[r] for r in live],
            num_scheduled_tokens=[1] * len(live),
            resumed_token_ids={},
        )
        steps.append(SchedulerOutput(step, scheduled_cached_reqs=cached))
        for r in live:
            computed[r] += 1
    for step in steps:
        output = runner.execute_model(step)
        for req_id, token in zip(output.req_ids, output.sampled_token_ids):
            tokens[req_id].append(token)
    # 5 decodes pad to 8, 2 replay 2, 3 pad to 4: every decode step was a replay.
    assert replays == [8] * 2 + [2] * 4 + [4] * 2
    for i, prompt in enumerate(prompts):
        adapter = paths[lora_ids[i] - 1] if lora_ids[i] else None
        [expected] = peft_greedy(tiny_model_dir, adapter, [prompt], len(tokens[i]))
        assert tokens[i] == expected, f"request {i} under {adapter or 'the base model'}"
