"""A worker process (``python -m conveyor.worker``): one tensor-parallel rank under the multi-process executor.

Runs in a worker process. Boring on purpose: read the launch frame from stdin, start watching the
parent, connect to the engine's sockets, build the ``Worker`` (model shard, torch.distributed),
say ``WorkerReady``, then loop receive -> apply -> reply until ``Shutdown``. Every rank runs every
step (the collectives need all of them, and sampling on every rank keeps the request mirrors
identical); only rank 0 replies with the sampled tokens. An exception is reported as
``WorkerError`` and ends the process: after a half-applied step the mirror cannot be trusted.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import msgspec
import zmq

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
    WorkerCommand,
    WorkerError,
    WorkerLaunch,
    WorkerReady,
    WorkerReply,
)
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.gc_heap import freeze_startup_heap
from conveyor.runtime.logs import configure_logging
from conveyor.runtime.parent import exit_when_pipe_closes
from conveyor.runtime.zmq_security import connect, keys_from_env, require_keys
from conveyor.worker.fault_injection import FaultInjector, fault_plan_from_env
from conveyor.worker.worker import Worker

logger = logging.getLogger(__name__)

# How long a closing socket may still try to deliver the last reply (a WorkerError, say).
REPLY_LINGER_MS = 2000


def read_launch(fd: int = 0) -> WorkerLaunch:
    """Read exactly one launch frame from ``fd``, leaving the pipe open for the parent watch."""
    (length,) = LAUNCH_LENGTH_PREFIX.unpack(_read_exactly(fd, LAUNCH_LENGTH_PREFIX.size))
    return WORKER_LAUNCH.decode(_read_exactly(fd, length))


def _read_exactly(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError("stdin closed before the launch frame was complete")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def handle_command(
    worker: Worker, rank: int, command: WorkerCommand, faults: FaultInjector
) -> WorkerReply | None:
    """Apply one command; the reply to send, or None (steps on ranks > 0)."""
    if isinstance(command, ExecuteModel):
        faults.at_step(command.scheduler_output.step_id)
        output = worker.execute_model(command.scheduler_output)
        return StepOutput(output) if rank == 0 else None
    if isinstance(command, DetermineNumBlocks):
        return NumBlocks(rank, worker.determine_num_blocks(), worker.kv_sliding_window())
    if isinstance(command, InitializeCache):
        worker.initialize_cache(command.num_blocks)
        # The last start-up command: the model, its cache and warm-up are in place.
        freeze_startup_heap()
        return CacheReady(rank)
    raise TypeError(f"unexpected command {type(command).__name__}")


def serve(
    worker: Worker, rank: int, commands: zmq.Socket, replies: zmq.Socket, faults: FaultInjector
) -> int:
    """The busy loop: receive -> apply -> reply until Shutdown (OK) or an exception (FAILED)."""
    while True:
        frame = commands.recv(copy=False)
        try:
            command = WORKER_COMMAND.decode(frame.buffer)
        except msgspec.DecodeError as exc:
            # Junk is dropped, never fatal: the engine's next real command still works.
            logger.warning("dropped a malformed %d-byte command frame: %s", len(frame.buffer), exc)
            continue
        if isinstance(command, Shutdown):
            return ExitCode.OK
        try:
            reply = handle_command(worker, rank, command, faults)
        except Exception as exc:
            logger.exception("rank %d failed on %s", rank, type(command).__name__)
            _send(replies, WorkerError(rank, _describe(exc), time.monotonic()))
            return ExitCode.FAILED
        if reply is not None:
            _send(replies, reply)


def _send(replies: zmq.Socket, reply: WorkerReply) -> None:
    replies.send(WORKER_REPLY.encode(reply), copy=False)


def _describe(exc: BaseException) -> str:
    # Bounded: the reason travels to the engine and on to every client as an error message.
    return f"{type(exc).__name__}: {exc}"[:2000]


def run_worker(launch: WorkerLaunch) -> int:
    """Build the rank's Worker and serve it; the process exit status."""
    # TCP channels (ranks on several hosts) are CURVE, loopback included: without the head's
    # key, a worker could be talking to whoever bound the port first.
    tcp = launch.reply_address.startswith("tcp://")
    keys = require_keys(launch.reply_address, keys_from_env()) if tcp else None
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    connect(commands, launch.command_address, keys)
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
    connect(replies, launch.reply_address, keys)
    try:
        return _start_and_serve(launch, commands, replies)
    finally:
        # Closing with linger flushes the last reply (a WorkerError, say) before the exit.
        commands.close(linger=0)
        replies.close()
        context.term()


def _start_and_serve(launch: WorkerLaunch, commands: zmq.Socket, replies: zmq.Socket) -> int:
    rank = launch.rank
    faults = FaultInjector(fault_plan_from_env(), rank)
    try:
        faults.at_load()
        worker = Worker(launch.config, rank, launch.distributed_init_method)
    except Exception as exc:
        logger.exception("rank %d failed to start", rank)
        _send(replies, WorkerError(rank, _describe(exc), time.monotonic()))
        return ExitCode.FAILED
    try:
        _send(replies, WorkerReady(rank, os.getpid()))
        return serve(worker, rank, commands, replies, faults)
    finally:
        worker.shutdown()


def main() -> int:
    # Ctrl-C in a terminal reaches the whole process group; the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launch = read_launch()
    configure_logging(f"worker-{launch.rank}")
    # The engine holds the write end of our stdin and never writes after the launch frame: EOF
    # means it is gone, however it died. Not the parent-death signal: that fires when the parent
    # *thread* that started us exits, and an engine may start workers from a short-lived thread.
    exit_when_pipe_closes(0, launch.runtime_dir)
    return run_worker(launch)
