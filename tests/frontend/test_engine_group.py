"""``EngineGroupClient`` without processes: stand-in engine clients whose deaths the test decides.

What a dead engine's requests become (sent again if they streamed nothing, failed otherwise),
where aborts go, when the group itself counts as dead, what its 503 says, how it attaches again
to an engine that answers (one engine or several), and when it gives up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from conveyor.frontend.engine_client.engine_group import EngineGroupClient
from conveyor.frontend.engine_client.router import Router, RouterConfig
from conveyor.frontend.engine_client.session import EngineDeadError, EngineStartError
from conveyor.protocol import EngineCoreOutput, EngineCoreRequest, SamplingParams


class StandInEngine:
    """What the group uses of an ``AsyncEngineClient``; ``die`` fails every open stream."""

    def __init__(self, index: int) -> None:
        self.engine_index = index
        self.config = None
        self.stats = None
        self.dead_reason: str | None = None
        self.session_lost = False
        self.unheard_since: float | None = None
        self.engine_pid = 1000 + index
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

    def go_silent(self, seconds_ago: float) -> None:
        """As a client whose engine answered no heartbeat for the silence limit."""
        self.unheard_since = time.monotonic() - seconds_ago
        self.dead_reason = f"the engine answered no heartbeat for {seconds_ago:.1f} s"
        for queue in self._queues:
            queue.put_nowait(EngineDeadError(self.dead_reason))

    def abort_nowait(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def shutdown(self, reason: str = "") -> None:
        self.dead_reason = self.dead_reason or reason


class Addresses:
    """Attaching at an address, as the group does to an engine that went down: refused (no
    Ready within the attempt) until the test says the engine there answers again."""

    def __init__(self) -> None:
        self.answering: set[str] = set()
        self.num_attempts = 0

    async def attach(self, address: str) -> StandInEngine:
        self.num_attempts += 1
        await asyncio.sleep(0.01)  # an attempt takes time (REATTACH_ATTEMPT_S for real)
        if address not in self.answering:
            raise EngineStartError("the engine was not ready within 0 s")
        return StandInEngine(int(address))


def _group(
    *engines: StandInEngine, addresses: Addresses | None = None, lost_limit_s: float = 300.0
) -> EngineGroupClient:
    router = Router(len(engines), RouterConfig("round-robin", 4.0, 4))
    group = object.__new__(EngineGroupClient)
    EngineGroupClient.__init__(
        group,  # type: ignore[arg-type]
        [str(e.engine_index) for e in engines],
        list(engines),  # type: ignore[arg-type]
        router,
        "test",
        lost_limit_s=lost_limit_s,
        attach=(addresses or Addresses()).attach,  # type: ignore[arg-type]
    )
    return group


async def _wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


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


def test_one_silent_engine_is_the_groups_loss_until_it_answers_again():
    """Row 28 without processes: the only engine goes silent; its stream fails, the group says
    why (how long it has not been heard from) and attaches again once it answers; a new request
    then goes to the new session."""

    async def run() -> None:
        only, addresses = StandInEngine(0), Addresses()
        group = _group(only, addresses=addresses)
        waiting = asyncio.ensure_future(_collect(await group.add_request(_request("r"))))
        await asyncio.sleep(0)
        only.go_silent(seconds_ago=12.0)
        assert (await waiting).startswith("dead: the engine answered no heartbeat")
        await _wait_until(lambda: addresses.num_attempts > 0)
        reason = group.dead_reason or ""
        assert reason.startswith("the engine has not been heard from for 12 s"), reason
        assert reason.endswith("; attaching again as soon as it answers"), reason
        with pytest.raises(EngineDeadError, match="not been heard from"):
            await group.add_request(_request("refused"))
        addresses.answering.add("0")
        await _wait_until(lambda: group.dead_reason is None)
        again = group._members[0]
        assert again is not only
        stream = await group.add_request(_request("after"))
        again.emit([4], "length")  # type: ignore[attr-defined]
        assert await _collect(stream) == [4]
        assert group.lost_reason is None
        await group.shutdown()

    asyncio.run(run())


def test_every_engine_down_is_reported_per_engine_and_each_attached_again():
    async def run() -> None:
        first, second, addresses = StandInEngine(0), StandInEngine(1), Addresses()
        group = _group(first, second, addresses=addresses)
        first.die()
        second.go_silent(seconds_ago=4.0)
        await _wait_until(lambda: addresses.num_attempts >= 2)
        reason = group.dead_reason or ""
        assert reason.startswith(
            "every engine is down: engine 0: engine 0 was killed, engine 1: the engine has not "
            "been heard from for 4 s; attaching again as soon as one answers"
        ), reason
        addresses.answering.add("1")
        await _wait_until(lambda: group.dead_reason is None)
        assert group._members[1] is not second and group._members[0] is first
        addresses.answering.add("0")
        await _wait_until(lambda: group._members[0] is not first)
        await group.shutdown()

    asyncio.run(run())


def test_the_group_gives_up_when_no_engine_answers_for_the_lost_limit():
    """An engine stopped for good must not leave the frontend up and refusing everything: once
    no engine has answered for the limit (and an attempt begun after it failed), the group says
    it is lost, for the frontend to exit."""

    async def run() -> None:
        only, addresses = StandInEngine(0), Addresses()
        group = _group(only, addresses=addresses, lost_limit_s=0.3)
        only.go_silent(seconds_ago=10.0)
        await _wait_until(lambda: addresses.num_attempts > 0)
        assert group.lost_reason is None
        await _wait_until(lambda: group.lost_reason is not None)
        assert group.lost_reason.startswith("no engine has answered for")
        assert "; gave up: no engine has answered for" in (group.dead_reason or "")
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
