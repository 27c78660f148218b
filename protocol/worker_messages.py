"""Control messages between the multi-process executor and its worker processes.

Shared by the engine-core process (``conveyor.executor.multiproc``) and the worker processes
(``worker.worker_process``). Structs only, tagged so one typed decoder per direction tells the
kinds apart; a frame of any other shape fails to decode and is logged and dropped by the receiver.

A step is ``ExecuteModel`` wrapping the ``SchedulerOutput`` diff: the engine encodes it once and
sends the same bytes to every rank. Only rank 0 answers a step (``StepOutput``); every rank answers
the start-up calls (``WorkerReady``, ``NumBlocks``, ``CacheReady``) and reports any exception as a
``WorkerError`` instead of going silent.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

from conveyor.protocol.codec import WireCodec
from conveyor.protocol.config import EngineConfig
from conveyor.protocol.messages import ModelRunnerOutput, SchedulerOutput

# A worker's stdin starts with one launch frame: this 4-byte big-endian length, then the encoded
# WorkerLaunch. The engine then keeps the pipe open and silent; EOF tells the worker it is gone.
LAUNCH_LENGTH_PREFIX = struct.Struct(">I")


class WorkerLaunch(msgspec.Struct, array_like=True, frozen=True):
    """What a worker process needs to start; arrives on its stdin as one length-prefixed frame.

    The engine binds every socket (in its private runtime folder, or on the master address when
    the ranks span hosts) and the workers connect, so a worker needs only the addresses.
    """

    rank: int
    config: EngineConfig
    # The engine's PUSH socket for this rank: commands arrive here.
    command_address: str
    # The engine's PULL socket shared by all ranks: replies go here.
    reply_address: str
    # torch.distributed rendezvous for tensor_parallel_size > 1 (file:// in the runtime folder;
    # tcp://MASTER_ADDR:MASTER_PORT when the ranks span hosts).
    distributed_init_method: str | None = None
    # The engine's private folder of sockets; removed by the workers if the engine dies first.
    runtime_dir: str | None = None


# ---------------------------------------------------------------- engine core -> worker


class DetermineNumBlocks(msgspec.Struct, tag=1, array_like=True, gc=False):
    """How many KV blocks can this rank hold? Answered by ``NumBlocks``."""


class InitializeCache(msgspec.Struct, tag=2, array_like=True, gc=False):
    """Allocate the KV cache; answered by ``CacheReady``."""

    num_blocks: int


class ExecuteModel(msgspec.Struct, tag=3, array_like=True, gc=False):
    """Run one step; rank 0 answers with ``StepOutput``, the other ranks stay quiet."""

    scheduler_output: SchedulerOutput


class Shutdown(msgspec.Struct, tag=4, array_like=True, gc=False):
    """Release the model and exit 0."""


WorkerCommand = Union[DetermineNumBlocks, InitializeCache, ExecuteModel, Shutdown]


# ---------------------------------------------------------------- worker -> engine core


class WorkerReady(msgspec.Struct, tag=10, array_like=True, gc=False):
    """The model is loaded and the rank is listening for commands."""

    rank: int
    pid: int


class NumBlocks(msgspec.Struct, tag=11, array_like=True, gc=False):
    rank: int
    num_blocks: int
    # How far back the model attends (its widest sliding window), None if any layer is global:
    # blocks further behind a request are freed while it runs.
    sliding_window: int | None = None


class CacheReady(msgspec.Struct, tag=12, array_like=True, gc=False):
    rank: int


class StepOutput(msgspec.Struct, tag=13, array_like=True, gc=False):
    """Rank 0's sampled tokens for one step."""

    output: ModelRunnerOutput


class WorkerError(msgspec.Struct, tag=14, array_like=True, gc=False):
    """An exception inside the worker; the worker exits after sending it."""

    rank: int
    reason: str
    # time.monotonic() when it happened (one clock for every process on the machine): when one
    # fault makes several ranks fail, the earliest error is the cause.
    monotonic_time: float = 0.0


WorkerReply = Union[WorkerReady, NumBlocks, CacheReady, StepOutput, WorkerError]


WORKER_LAUNCH: WireCodec[WorkerLaunch] = WireCodec(WorkerLaunch)
WORKER_COMMAND: WireCodec[WorkerCommand] = WireCodec(WorkerCommand)
WORKER_REPLY: WireCodec[WorkerReply] = WireCodec(WorkerReply)
