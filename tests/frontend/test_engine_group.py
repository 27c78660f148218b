"""``EngineGroupClient`` without processes: stand-in engine clients whose deaths the test decides.

What a dead engine's requests become (sent again if they streamed nothing, failed otherwise),
where aborts go, and when the group itself counts as dead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from conveyor.frontend.engine_client.engine_group import EngineGroupClient
from conveyor.frontend.engine_client.router import Router, RouterConfig
from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.protocol import EngineCoreOutput, EngineCoreRequest, SamplingParams


class StandInEngine:
    """What the group uses of an ``AsyncEngineClient``; ``die`` fails every open stream."""

    def __init__(self, index: int) -> None:
        self.engine_index = index
        self.config = None
        self.stats = None
        self.dead_reason: str | None = None
        self.session_lost = False
        self.received: list[str] = []
        self.aborted: list[str] = []
        self.full = False  # refuses every request at once, as a full queue cap does
        self._queues: list[asyncio.Queue] = []

    async def add_request(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.received.append(request.request_id)
        queue: asyncio.Queue = asyncio.Queue()
        if self.full:
            queue.put_nowait(([], "rejected"))
        self._queues.append(queue)
        return self._iterate(request.request_id, queue)

    async def _iterate(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator:
        while True:
            item = await queue.get()
            if isinstance(item, EngineDeadError):
                raise item
            yield EngineCoreOutput(request_id, item[0], item[1])
            if item[1] is not None:
                return

    def emit(self, token_ids: list[int], finish_reason: str | None = None) -> None:
        for queue in self._queues:
            queue.put_nowait((token_ids, finish_reason))

    def die(self) -> None:
        self.dead_reason = f"engine {self.engine_index} was killed"
        for queue in self._queues:
            queue.put_nowait(EngineDeadError(self.dead_reason))

    def abort_nowait(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def shutdown(self, reason: str = "") -> None:
        self.dead_reason = self.dead_reason or reason


def _group(*engines: StandInEngine) -> EngineGroupClient:
    router = Router(len(engines), RouterConfig("round-robin", 4.0, 4))
    group = object.__new__(EngineGroupClient)
    EngineGroupClient.__init__(group, ["a"] * len(engines), list(engines), router, "test")  # type: ignore[arg-type]
    return group


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3, 4, 5], SamplingParams(), 0.0)


async def _collect(stream: AsyncIterator[EngineCoreOutput]) -> list[int] | str:
    tokens: list[int] = []
    try:
        async for output in stream:
            tokens += output.new_token_ids
    except EngineDeadError as exc:
        return f"dead: {exc}"
    return tokens


def test_an_unstarted_request_moves_to_another_engine_and_a_started_one_fails():
    async def run() -> None:
        first, second = StandInEngine(0), StandInEngine(1)
        group = _group(first, second)
        started = asyncio.ensure_future(_collect(await group.add_request(_request("started"))))
        waiting = asyncio.ensure_future(_collect(await group.add_request(_request("waiting"))))
        assert (first.received, second.received) == (["started"], ["waiting"])
        first.emit([7])  # "started" streamed a token on engine 0
        await asyncio.sleep(0)
        second.die()  # "waiting" had streamed nothing: it goes to engine 0
        await asyncio.sleep(0.01)
        assert first.received == ["started", "waiting"]
        assert group.dead_reason is None and group.num_resent == 1
        first.emit([8], "length")
        assert await started == [7, 8]
        assert await waiting == [8]
        # Now engine 0 dies with a request that streamed: it fails, as there is no taking a
        # token back; and with both engines down the group is dead.
        third = asyncio.ensure_future(_collect(await group.add_request(_request("third"))))
        first.emit([9])
        await asyncio.sleep(0)
        first.die()
        assert (await third).startswith("dead")
        assert "every engine is down" in (group.dead_reason or "")
        with pytest.raises(EngineDeadError):
            await group.add_request(_request("late"))
        await group.shutdown()

    asyncio.run(run())


def test_a_request_one_engine_refuses_goes_to_another_before_its_client_sees_429():
    async def run() -> None:
        engines = [StandInEngine(i) for i in range(3)]
        group = _group(*engines)
        engines[0].full = True  # its queue cap refuses at once: engine 1 or 2 takes the request
        moved = asyncio.ensure_future(_collect_reasons(await group.add_request(_request("r1"))))
        await asyncio.sleep(0.01)
        taker = next(e for e in engines[1:] if e.received == ["r1"])
        assert group.engine_label("r1") == str(taker.engine_index)  # its metrics label
        taker.emit([5], "length")
        assert await moved == ["length"]
        assert group.num_refusals_retried == 1
        # Refused everywhere: the client gets the refusal, once each engine was asked.
        for engine in engines:
            engine.full = True
        assert await _collect_reasons(await group.add_request(_request("r2"))) == ["rejected"]
        assert [e.received.count("r2") for e in engines] == [1, 1, 1]
        await group.shutdown()

    asyncio.run(run())


async def _collect_reasons(stream: AsyncIterator[EngineCoreOutput]) -> list[str]:
    return [output.finish_reason async for output in stream if output.finish_reason]


def test_with_one_engine_its_death_is_the_groups():
    async def run() -> None:
        only = StandInEngine(0)
        group = _group(only)
        waiting = asyncio.ensure_future(_collect(await group.add_request(_request("r"))))
        await asyncio.sleep(0)
        only.die()
        assert await waiting == "dead: engine 0 was killed"
        assert group.dead_reason == "engine 0 was killed"
        assert group._watcher is None  # nothing to attach to again: the server stops
        await group.shutdown()

    asyncio.run(run())


def test_aborts_go_to_the_engine_that_holds_the_request():
    async def run() -> None:
        first, second = StandInEngine(0), StandInEngine(1)
        group = _group(first, second)
        streams = [await group.add_request(_request(name)) for name in ("a", "b")]
        assert group.engine_label("b") == "1"
        group.abort_nowait(["b", "unknown"])
        assert (first.aborted, second.aborted) == ([], ["b"])
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
        await group.shutdown()

    asyncio.run(run())
