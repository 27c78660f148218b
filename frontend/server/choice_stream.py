"""Run the engine requests of one HTTP request and merge their outputs into one delta stream.

Runs in an HTTP frontend process, on its event loop. Each choice (one of n samples of one of the
prompts) is one engine request with its own output stream from ``EngineGroupClient``; every output
goes through the request's ``OutputProcessor``, as ``LLM.generate``'s do. A choice whose stop
string appears is closed at once, which aborts it in the engine. Closing the merged
stream (the client went away, the handler was cancelled) aborts every choice still running, so
no engine work outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from conveyor.frontend.engine_client.engine_group import EngineGroupClient
from conveyor.frontend.input_processor import Choice
from conveyor.frontend.output_processor import ChoiceDelta, OutputProcessor
from conveyor.frontend.server.metrics import FrontendMetrics
from conveyor.frontend.server.request_log import RequestLogger
from conveyor.protocol import EngineCoreOutput, RequestTimings

_Item = ChoiceDelta | BaseException | None
RunCpu = Callable[..., Awaitable[Any]]


async def stream_choices(
    client: EngineGroupClient,
    choices: Sequence[Choice],
    run_cpu: RunCpu,
    metrics: FrontendMetrics | None = None,
    request_log: RequestLogger | None = None,
    request_id: str = "",
    n: int = 1,
) -> AsyncIterator[ChoiceDelta]:
    """Deltas of every choice (``n`` per prompt) as they come; raises ``EngineDeadError`` if the
    engine dies. Large decodes run in ``run_cpu``, off the event loop. Each output is recorded
    in ``metrics`` as it comes; ``request_log`` logs the request's start and end.

    Iterate it inside ``contextlib.aclosing``, so leaving early aborts what still runs.
    """
    processor = OutputProcessor(choice.state for choice in choices)
    streams: list[AsyncIterator[EngineCoreOutput]] = []
    if request_log is not None:
        await request_log.arrived(request_id, choices, n, run_cpu)
    try:
        for choice in choices:
            streams.append(await client.add_request(choice.request))
        sources = [
            _choice_deltas(stream, processor, choice, metrics, run_cpu, client)
            for stream, choice in zip(streams, choices)
        ]
        # The common case (one choice) needs no task and no queue.
        deltas = sources[0] if len(sources) == 1 else _merge(sources)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta
    finally:
        # Also covers streams nobody started iterating (closing those sends no abort).
        sent = choices[: len(streams)]
        client.abort_nowait([c.request.request_id for c in sent if not c.state.finished])
        if metrics is not None:
            metrics.observe_request([c.state for c in choices], n)
        if request_log is not None:
            request_log.finished(request_id, choices)


async def _merge(sources: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave several delta streams in arrival order, one pump task each."""
    merged: asyncio.Queue[_Item] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(source, merged)) for source in sources]
    try:
        num_running = len(tasks)
        while num_running:
            item = await merged.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # The cancelled pumps finish on their own; waiting here could itself be cancelled.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(source: AsyncIterator[ChoiceDelta], merged: asyncio.Queue[_Item]) -> None:
    try:
        async with contextlib.aclosing(source):  # type: ignore[type-var]
            async for delta in source:
                merged.put_nowait(delta)
    except Exception as exc:  # EngineDeadError, or a bug: it must reach the consumer
        merged.put_nowait(exc)
        return
    merged.put_nowait(None)


async def _choice_deltas(
    stream: AsyncIterator[EngineCoreOutput],
    processor: OutputProcessor,
    choice: Choice,
    metrics: FrontendMetrics | None,
    run_cpu: RunCpu,
    client: EngineGroupClient,
) -> AsyncIterator[ChoiceDelta]:
    """One choice's deltas until it finishes; leaving early closes (and aborts) its stream.

    Its metrics carry the label of the engine that served it (the last one, if it was sent
    again after an engine died)."""
    state = choice.state
    ending = "abort"  # unless the choice finishes, or fails below
    timings: RequestTimings | None = None
    engine = client.engine_label(choice.request.request_id) if metrics is not None else ""
    try:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for output in stream:
                previous = state.last_token_time
                delta = await processor.process_output_off_loop(output, run_cpu)
                if metrics is not None:
                    engine = client.engine_label(output.request_id)
                    if output.new_token_ids:
                        metrics.observe_tokens(state, len(output.new_token_ids), previous, engine)
                    if output.timings is not None:
                        timings = output.timings
                if delta is None:
                    continue
                yield delta
                if state.finished:
                    # After a stop string the engine still runs it: closing the stream aborts it.
                    return
    except Exception:
        ending = "error"
        raise
    finally:
        if metrics is not None:
            metrics.observe_finished(state, state.finish_reason or ending, timings, engine)
