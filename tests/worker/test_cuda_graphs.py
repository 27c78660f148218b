"""The CUDA-graph logic that needs no GPU: batch sizes and padding, cutting the forward at every
attention call, and a CPU runner that never captures. Capture and replay themselves are checked
on a GPU by tests/worker/test_cuda.py."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from conveyor.frontend.engine_args import EngineArgs
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.cuda_graphs import (
    AttentionOutputs,
    DecodeGraphs,
    PieceSplitter,
    PiecewiseGraph,
    capture_pieces,
    capture_sizes,
    padded_size,
)
from conveyor.worker.loader import load_model
from conveyor.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


def test_capture_sizes_are_exact_when_small_then_every_eighth_up_to_the_cap():
    sizes = capture_sizes(max_num_seqs=256, max_num_tokens=2048)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_sizes(3, 2048) == [1, 2, 3]
    assert capture_sizes(100, 2048)[-3:] == [88, 96, 100]  # the cap itself gets a graph
    assert capture_sizes(256, 64)[-1] == 64  # a decode step never holds more than the budget
    assert capture_sizes(4096, 1 << 20)[-1] == 512  # bigger batches are GPU-bound anyway


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [
        (1, 1),
        (2, 2),
        (3, 4),
        (5, 8),
        (8, 8),
        (9, 16),
        (99, 100),
        (100, 100),
        (101, None),
        (0, None),
    ],
)
def test_a_batch_pads_up_to_the_smallest_size_that_holds_it(num_tokens, expected):
    assert padded_size(num_tokens, capture_sizes(100, 2048)) == expected


class FakeGraph:
    def __init__(self, log: list[str], index: int) -> None:
        self.log, self.index = log, index

    def replay(self) -> None:
        self.log.append(f"piece {self.index}")


def test_the_forward_is_cut_at_every_attention_call(tiny_model_dir_each):
    """Run the capture path on CPU with stand-in graphs: the forward then simply runs, and the
    cuts, the recorded calls and the shared output buffers are those a GPU capture makes."""
    model = load_model(tiny_model_dir_each, torch.float32, CPU)
    layers = model.attention_layers()
    opened: list[FakeGraph] = []

    def open_capture():
        opened.append(FakeGraph([], len(opened)))
        return opened[-1], contextlib.nullcontext()

    outputs = AttentionOutputs(max_size=8)
    size = 5
    metadata, _ = build_attention_metadata(
        np.ones(size, np.int32), np.zeros(size, np.int32), np.zeros((size, 1), np.int32), 16, CPU
    )
    ids, positions = torch.arange(size), torch.zeros(size, dtype=torch.int64)
    with torch.inference_mode():
        graph = capture_pieces(
            model, ids, positions, metadata, PieceSplitter(outputs, open_capture)
        )
    assert graph.graphs == opened and len(opened) == len(layers) + 1
    assert [call.layer for call in graph.calls] == layers
    assert all(layer.graph_split is None for layer in layers)
    first = graph.calls[0]
    width = first.layer.num_heads * first.layer.head_dim
    assert first.query.shape[0] == size and first.output.shape == (size, width)
    # Every size reads the same per-layer buffer (sizes never run at once).
    assert first.output.data_ptr() == outputs.of(first.layer, first.query).data_ptr()
    assert graph.output.shape == (size, model.config.hidden_size)


def test_replay_runs_pieces_and_attention_calls_in_turn():
    log: list[str] = []

    class Call:
        def __init__(self, index: int) -> None:
            self.index = index

        def run(self, metadata) -> None:
            log.append(f"attention {self.index}")

    output = torch.zeros(1)
    graph = PiecewiseGraph([FakeGraph(log, i) for i in range(3)], [Call(0), Call(1)], output)
    assert graph.replay(metadata=None) is output
    assert log == ["piece 0", "attention 0", "piece 1", "attention 1", "piece 2"]
    with pytest.raises(ValueError, match="pieces"):
        PiecewiseGraph([FakeGraph(log, 0)], [Call(0)], output)


def test_a_cpu_runner_never_captures_graphs(tiny_model_dir):
    config = EngineArgs(
        model=str(tiny_model_dir), max_num_seqs=4, kv_cache_memory=4 << 20, device="cpu"
    ).create_engine_config()
    assert not config.enforce_eager
    runner = ModelRunner(config, CPU)
    assert runner.capture_cuda_graphs() == 0 and runner.decode_graphs is None


class ForwardOnFixedBuffers:
    """Stands in for a whole-forward graph on CPU: its replay reruns the forward on exactly what
    a capture bakes in (the fixed input buffers' first B rows and the capture's metadata over
    the fixed buffers) and ignores the step's metadata, as a replay does."""

    def __init__(self, runner: ModelRunner, size: int, replays: list[int]) -> None:
        self.runner, self.size, self.replays = runner, size, replays
        self.metadata = runner.inputs.graph_metadata(size)
        self.ids = runner.inputs.input_ids.device_tensor[:size]
        self.positions = runner.inputs.positions.device_tensor[:size]

    def replay(self, metadata) -> torch.Tensor:
        self.replays.append(self.size)
        return self.runner.model.forward(self.ids, self.positions, self.metadata)


@pytest.mark.gpu_kernel
def test_a_whole_graph_reads_every_step_it_replays_from_the_fixed_buffers(tiny_model_dir):
    # The contract whole-forward graphs rest on (the capture itself runs on a GPU,
    # tests/worker/test_cuda.py): with the step padded into the fixed buffers, the forward the
    # graph recorded gives the eager runner's tokens, batch after batch, padding included.
    from conveyor.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
    from conveyor.worker.attention.triton_backend import triton_unusable_reason

    # On CPU the kernel runs under Triton's interpreter, which tests/devices.py turns on for CPU
    # runs only (a CUDA run of the suite checks real captures in tests/worker/test_cuda.py).
    if (reason := triton_unusable_reason(CPU)) is not None:
        pytest.skip(f"the Triton backend cannot run on this CPU: {reason}")
    greedy = SamplingParams(temperature=0.0)
    runners, replays = [], []
    for whole in (False, True):
        config = EngineArgs(
            model=str(tiny_model_dir),
            max_num_seqs=8,
            max_model_len=64,
            kv_cache_memory=4 << 20,
            device="cpu",
            dtype="float32",
            attention_backend="triton",
        ).create_engine_config()
        runner = ModelRunner(config, CPU)
        assert runner.backend.full_decode_graphs
        runner.initialize_cache(runner.determine_num_blocks())
        if whole:
            graphs = {size: ForwardOnFixedBuffers(runner, size, replays) for size in (2, 4, 8)}
            runner.decode_graphs = DecodeGraphs(graphs, whole=True)
        runners.append(runner)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 9, 3, 14, 7)]
    blocks = [[1 + 4 * i + j for j in range(4)] for i in range(len(prompts))]
    new = [NewRequestData(i, p, greedy, blocks[i], 0, len(p)) for i, p in enumerate(prompts)]
    tokens = [[] for _ in runners]
    computed = {i: len(p) for i, p in enumerate(prompts)}
    steps = [SchedulerOutput(1, new)]
    for step, live in enumerate([[0, 1, 2, 3, 4]] * 3 + [[0, 2, 3]] * 3 + [[1]] * 2, start=2):
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
        for runner, got in zip(runners, tokens):
            output = runner.execute_model(step)
            got.append(dict(zip(output.req_ids, output.sampled_token_ids)))
    assert tokens[1] == tokens[0]
    # 5 decodes pad to 8, 3 to 4, 1 to 2: each step replayed the smallest graph that holds it.
    assert replays == [8] * 3 + [4] * 3 + [2] * 2


class FakeCaptures:
    """Stands in for the two CUDA captures on CPU: each notes how many KV blocks were bound when
    it ran and grows the device's "reserved" bytes by what its graphs keep (whole: 66 MiB,
    pieces: 1,700 MiB, as on Qwen3-0.6B); ``fail_whole`` lists which whole captures raise."""

    WHOLE, PIECES = 66 << 20, 1700 << 20

    def __init__(self, runner: ModelRunner, fail_whole: tuple[int, ...] = ()) -> None:
        self.runner, self.fail_whole = runner, fail_whole
        self.reserved = 1 << 30
        self.calls: list[tuple[str, int | None]] = []

    def whole(self, model, ids, positions, sizes, graph_metadata):
        bound = {layer.kv_cache.shape for layer in self.runner.attention_layers}
        assert len(bound) == 1, "every layer is bound to one cache before a whole capture"
        self.calls.append(("whole", self.runner.num_blocks))
        if len(self.calls) in self.fail_whole:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.reserved += self.WHOLE
        return DecodeGraphs({size: object() for size in sizes}, whole=True)

    def pieces(self, model, ids, positions, sizes, block_size):
        self.calls.append(("pieces", self.runner.num_blocks))
        self.reserved += self.PIECES
        return DecodeGraphs({size: object() for size in sizes})


@pytest.fixture
def faked_capture(tiny_model_dir, monkeypatch):
    """A CPU runner whose backend claims whole-forward graphs, with both captures faked."""
    import conveyor.worker.model_runner as model_runner

    def make(fail_whole: tuple[int, ...] = ()) -> tuple[ModelRunner, FakeCaptures]:
        config = EngineArgs(
            model=str(tiny_model_dir), max_num_seqs=4, kv_cache_memory=4 << 20, device="cpu"
        ).create_engine_config()
        runner = ModelRunner(config, CPU)
        fake = FakeCaptures(runner, fail_whole)
        monkeypatch.setattr(runner.backend, "full_decode_graphs", True)
        monkeypatch.setattr(runner, "_graphs_wanted", lambda: True)
        monkeypatch.setattr(runner, "_settled_reserved_bytes", lambda: fake.reserved)
        monkeypatch.setattr(model_runner, "capture_whole_decode_graphs", fake.whole)
        monkeypatch.setattr(model_runner, "capture_decode_graphs", fake.pieces)
        return runner, fake

    return make


def test_the_memory_profile_budgets_whole_graphs_measured_on_a_one_block_stand_in(faked_capture):
    runner, fake = faked_capture()
    # The profile's capture: on a one-block cache, which it lets go again with the graphs.
    assert runner.capture_cuda_graphs() == FakeCaptures.WHOLE
    assert fake.calls == [("whole", 1)]
    assert runner.decode_graphs is None and runner.num_blocks is None
    assert all(layer.kv_cache is None for layer in runner.attention_layers)
    # The real cache: the whole graphs are captured again on it, and only then.
    runner.initialize_cache(12)
    assert fake.calls == [("whole", 1), ("whole", 12)]
    assert runner.decode_graphs.whole and runner.cuda_graph_bytes == FakeCaptures.WHOLE
    runner.initialize_cache(12)
    assert len(fake.calls) == 2


def test_whole_graphs_failing_on_the_stand_in_leave_the_pieces_budgeted(faked_capture):
    runner, fake = faked_capture(fail_whole=(1,))
    assert runner.capture_cuda_graphs() == FakeCaptures.PIECES
    assert fake.calls == [("whole", 1), ("pieces", None)]
    assert not runner.decode_graphs.whole
    runner.initialize_cache(12)
    assert len(fake.calls) == 2 and not runner.decode_graphs.whole


def test_whole_graphs_failing_on_the_real_cache_run_eagerly_with_a_warning(faked_capture, caplog):
    runner, fake = faked_capture(fail_whole=(2,))
    assert runner.capture_cuda_graphs() == FakeCaptures.WHOLE
    with caplog.at_level("WARNING", logger="conveyor.worker.model_runner"):
        runner.initialize_cache(12)
    # No pieces now: the budget holds the whole graphs' 66 MiB, not the pieces' 1.7 GiB.
    assert fake.calls == [("whole", 1), ("whole", 12)]
    assert runner.decode_graphs is None
    assert "run eagerly" in caplog.text and "stand-in" in caplog.text
