"""The worker process's pieces without a model: launch frame, command loop, parent watch, faults.

The loop runs in this process against a stand-in Worker over inproc:// sockets, so every reply
(and every dropped junk frame) is checked in milliseconds.
"""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from conveyor.protocol import ModelRunnerOutput, SchedulerOutput
from conveyor.protocol.worker_messages import (
    LAUNCH_LENGTH_PREFIX,
    WORKER_COMMAND,
    WORKER_LAUNCH,
    WORKER_REPLY,
    CacheReady,
    DetermineNumBlocks,
    ExecuteModel,
    InitializeCache,
    NumBlocks,
    Shutdown,
    StepOutput,
    WorkerError,
    WorkerLaunch,
)
from conveyor.worker.fault_injection import (
    FaultInjector,
    FaultPlan,
    InjectedFault,
    parse_fault_plan,
)
from conveyor.worker.worker_process import read_launch, serve
from tests.multiproc_helpers import make_config


class StandInWorker:
    """Answers like a Worker; step 13 raises."""

    def __init__(self) -> None:
        self.cache_blocks: int | None = None
        self.steps: list[int] = []

    def determine_num_blocks(self) -> int:
        return 99

    def kv_sliding_window(self) -> int | None:
        return 40

    def initialize_cache(self, num_blocks: int) -> None:
        self.cache_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.step_id == 13:
            raise ValueError("bad step")
        self.steps.append(scheduler_output.step_id)
        return ModelRunnerOutput(scheduler_output.step_id, [7], [42])


def _run_loop(rank: int, frames: list[bytes], faults: FaultInjector | None = None):
    """Feed ``frames`` to ``serve``; returns (exit status, decoded replies, the worker)."""
    context = zmq.Context()
    commands_in, commands_out = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    replies_in, replies_out = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    commands_in.bind("inproc://commands")
    commands_out.connect("inproc://commands")
    replies_out.bind("inproc://replies")
    replies_in.connect("inproc://replies")
    worker = StandInWorker()
    for frame in frames:
        commands_in.send(frame)
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(
            serve(worker, rank, commands_out, replies_in, faults or FaultInjector(None, rank))  # type: ignore[arg-type]
        )
    )
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the loop did not stop"
    replies = []
    while replies_out.poll(0):
        replies.append(WORKER_REPLY.decode(replies_out.recv()))
    for socket in (commands_in, commands_out, replies_in, replies_out):
        socket.close(linger=0)
    context.term()
    return result[0], replies, worker


def _command(message) -> bytes:
    return WORKER_COMMAND.encode(message)


def test_the_loop_answers_each_command_and_drops_junk():
    frames = [
        b"\xc1",  # not msgpack
        _command(DetermineNumBlocks()),
        WORKER_REPLY.encode(CacheReady(0)),  # a reply where a command belongs
        _command(InitializeCache(12)),
        b"",
        _command(ExecuteModel(SchedulerOutput(step_id=5))),
        _command(Shutdown()),
        _command(ExecuteModel(SchedulerOutput(step_id=6))),  # after Shutdown: never read
    ]
    status, replies, worker = _run_loop(0, frames)
    assert status == 0
    assert replies == [
        NumBlocks(0, 99, 40),
        CacheReady(0),
        StepOutput(ModelRunnerOutput(5, [7], [42])),
    ]
    assert worker.cache_blocks == 12
    assert worker.steps == [5]


def test_ranks_above_0_run_steps_but_do_not_reply():
    frames = [_command(ExecuteModel(SchedulerOutput(step_id=s))) for s in (1, 2)]
    status, replies, worker = _run_loop(1, [*frames, _command(Shutdown())])
    assert (status, replies, worker.steps) == (0, [], [1, 2])


def test_an_exception_is_reported_with_the_rank_and_ends_the_loop():
    frames = [_command(ExecuteModel(SchedulerOutput(step_id=s))) for s in (12, 13, 14)]
    status, replies, worker = _run_loop(1, frames)
    assert status == 1
    assert worker.steps == [12]
    [error] = replies
    assert isinstance(error, WorkerError)
    assert (error.rank, error.reason) == (1, "ValueError: bad step")
    assert error.monotonic_time > 0


def test_an_injected_fault_fires_once_at_the_first_step_at_or_after_its_id():
    faults = FaultInjector(FaultPlan("raise", step_id=3), rank=0)
    frames = [_command(ExecuteModel(SchedulerOutput(step_id=s))) for s in (2, 4, 5)]
    status, replies, worker = _run_loop(0, frames, faults)
    assert status == 1
    assert worker.steps == [2]
    assert "InjectedFault" in replies[-1].reason


@pytest.mark.parametrize(
    ("text", "plan"),
    [
        ("", None),
        ("raise@step=3", FaultPlan("raise", 3)),
        ("exit@step=2,rank=1", FaultPlan("exit", 2, 1)),
        ("hang@load", FaultPlan("hang", None)),
    ],
)
def test_fault_plans_parse(text, plan):
    assert parse_fault_plan(text) == plan


@pytest.mark.parametrize(
    "text", ["boom@step=1", "raise", "raise@later", "raise@step=x", "raise@load,r=1"]
)
def test_bad_fault_plans_are_rejected(text):
    with pytest.raises(ValueError):
        parse_fault_plan(text)


def test_a_fault_for_another_rank_never_fires():
    faults = FaultInjector(FaultPlan("raise", None, rank=1), rank=0)
    faults.at_load()
    faults.at_step(100)
    with pytest.raises(InjectedFault):
        FaultInjector(FaultPlan("raise", None, rank=1), rank=1).at_load()


def test_the_launch_frame_round_trips_through_a_pipe(tiny_model_dir):
    launch = WorkerLaunch(
        1, make_config(tiny_model_dir, 2), "ipc:///x/rank1", "ipc:///x/r", "file:///x/d"
    )
    frame = WORKER_LAUNCH.encode(launch)
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, LAUNCH_LENGTH_PREFIX.pack(len(frame)) + frame)
        assert read_launch(read_fd) == launch
    finally:
        os.close(read_fd)
        os.close(write_fd)
