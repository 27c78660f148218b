"""``EngineGroupClient``: an HTTP frontend's client of every data-parallel engine.

Runs in an HTTP frontend process, on its event loop. One ``AsyncEngineClient`` per engine, each
with its own socket thread and heartbeats (so heartbeats, aborts and the engine-wide queue cap
work per engine exactly as with one), and a ``Router`` that picks the engine of each request from
the stats those clients already receive. What happens when an engine dies:

* its requests that have streamed no token yet are sent again to another engine: their client
  saw nothing of them, so only time is lost. Those that have streamed end with
  ``EngineDeadError`` (an error event): a token sent cannot be taken back, and another engine
  would start the sample over.
* the group attaches again once the engine answers at its address: one that the supervisor
  restarted there, one that stalled (stopped, swapped out, a paused VM) past the silence limit
  and woke, one that dropped this frontend for its own stall. Meanwhile it is never routed to;
  /health stays 200 while any engine serves. With one engine its loss is the group's: every
  stream fails and /health and new requests get 503 saying why (how long the engine has not
  been heard from) until it answers again; a dead one is the supervisor's to act on.
* when no engine has answered for ``lost_limit_s`` (an engine stopped for good, say), the
  group gives up (``lost_reason``): the frontend exits for its supervisor to stop everything,
  so that a process manager can restart the server, never leaving it up and refusing all.

A request one engine refuses at once (its queue cap, ``--max-waiting-requests``) is offered to
the others, least loaded first; its client sees the refusal (429) only when every engine up has
refused it.

The addresses given to ``start`` are the one place a frontend learns where its engines are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from conveyor.frontend.engine_client.async_client import AsyncEngineClient
from conveyor.frontend.engine_client.router import DEFAULT_AFFINITY_MARGIN, Router, RouterConfig
from conveyor.frontend.engine_client.session import EngineDeadError, EngineStartError
from conveyor.protocol import EngineConfig, EngineCoreOutput, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)

# One attempt to attach to a restarted engine waits this long for its Ready; a cancelled attempt
# cannot be cut short (the handshake runs in a thread), so shutdown may wait this long for it.
REATTACH_ATTEMPT_S = 1.0
# How often the group looks for engines that went down.
WATCH_INTERVAL_S = 0.25
# No engine answering for this long is a loss for good, not a stall to wait out: longer than a
# swap storm or a paused VM is worth waiting for, shorter than an operator would stare at 503s.
LOST_LIMIT_S = 300.0

Attach = Callable[[str], Awaitable[AsyncEngineClient]]


class EngineGroupClient:
    """Create with ``await EngineGroupClient.start(addresses, ...)``; engine i is addresses[i]."""

    @classmethod
    async def start(
        cls,
        addresses: Sequence[str],
        *,
        policy: str = "prefix-affinity",
        affinity_margin: float = DEFAULT_AFFINITY_MARGIN,
        ready_timeout_s: float = 30.0,
        client_name: str = "",
        silence_limit_s: float | None = None,
        lost_limit_s: float = LOST_LIMIT_S,
    ) -> EngineGroupClient:
        """Attach to every engine (all must serve: the supervisor starts frontends only then).

        ``silence_limit_s``: how long an engine may answer no heartbeat before it counts as down
        (None: the client's default); ``lost_limit_s``: how long no engine may answer before
        the group gives up (``lost_reason``)."""
        if not addresses:
            raise ValueError("no engine address given")
        attached = await asyncio.gather(
            *(
                AsyncEngineClient.start(
                    address=address,
                    ready_timeout_s=ready_timeout_s,
                    client_name=client_name,
                    silence_limit_s=silence_limit_s,
                )
                for address in addresses
            ),
            return_exceptions=True,
        )
        members = [m for m in attached if isinstance(m, AsyncEngineClient)]
        failure = next((m for m in attached if isinstance(m, BaseException)), None)
        if failure is None and len({m.config.model.model for m in members}) > 1:
            failure = EngineStartError("the engines serve different models")
        if failure is not None:
            await asyncio.gather(*(m.shutdown() for m in members))
            raise failure
        block_size = members[0].config.cache.block_size
        router = Router(len(members), RouterConfig(policy, affinity_margin, block_size))
        return cls(
            list(addresses), members, router, client_name,
            silence_limit_s=silence_limit_s, lost_limit_s=lost_limit_s,
        )  # fmt: skip

    def __init__(
        self,
        addresses: list[str],
        members: list[AsyncEngineClient],
        router: Router,
        client_name: str,
        *,
        silence_limit_s: float | None = None,
        lost_limit_s: float = LOST_LIMIT_S,
        attach: Attach | None = None,
    ) -> None:
        """Use ``start``. ``attach`` (tests): one attempt to attach at an address, instead of
        an ``AsyncEngineClient`` handshake bounded by ``REATTACH_ATTEMPT_S``."""
        self.addresses = addresses
        self._members = members
        self.router = router
        self.client_name = client_name
        # The ``engine`` label of each engine's metrics: its own index, from its Ready.
        self.engine_labels = [str(m.engine_index) for m in members]
        # Every engine serves the same model; engine 0's config (with its learned pool size).
        self.config: EngineConfig = members[0].config
        self.closing = False
        self._closed_reason: str | None = None
        # request_id -> the engine serving it now (for aborts and metrics labels).
        self._owners: dict[str, int] = {}
        self._reattaching: dict[int, asyncio.Task[None]] = {}
        self.num_resent = 0
        self.num_refusals_retried = 0
        self._silence_limit_s = silence_limit_s
        self._lost_limit_s = lost_limit_s
        self._attach = attach or self._attach_client
        # Since when no engine has served us (None while one does), and why we gave up on them.
        self._unserved_since: float | None = None
        self.lost_reason: str | None = None
        # One engine or several: an engine that answers again is attached again.
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    # ------------------------------------------------------------------ state

    @property
    def num_engines(self) -> int:
        return len(self._members)

    @property
    def dead_reason(self) -> str | None:
        """None while any engine serves us; else why none does, and what is being done."""
        if self._closed_reason is not None:
            return self._closed_reason
        if any(m.dead_reason is None for m in self._members):
            return None
        reasons = [_down_reason(m) for m in self._members]
        if len(reasons) == 1:
            reason = reasons[0]
        else:
            reason = "every engine is down: " + ", ".join(
                f"engine {label}: {why}" for label, why in zip(self.engine_labels, reasons)
            )
        if self.lost_reason is not None:
            return f"{reason}; gave up: {self.lost_reason}"
        # The watcher attaches again to every engine that went down, within WATCH_INTERVAL_S.
        who = "it answers" if len(reasons) == 1 else "one answers"
        return f"{reason}; attaching again as soon as {who}"

    @property
    def stats(self) -> SchedulerStats | None:
        return self._members[0].stats

    def stats_by_engine(self) -> dict[str, SchedulerStats | None]:
        """Each engine's latest stats, by its metrics label."""
        return {label: m.stats for label, m in zip(self.engine_labels, self._members)}

    def engine_label(self, request_id: str) -> str:
        """The label of the engine serving ``request_id`` now (engine 0's if none)."""
        return self.engine_labels[self._owners.get(request_id, 0)]

    # ------------------------------------------------------------------ requests

    async def add_request(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Send a request to the engine the router picks; iterate the result for its outputs.

        Closing the iterator early aborts the request in whichever engine has it.
        """
        engine, stream = await self._send(request)
        return self._follow(request, engine, stream)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Abort in the engines that hold these requests (finished or unknown ones: nothing)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._owners.get(request_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            self._members[engine].abort_nowait(ids)

    async def abort(self, request_ids: list[str]) -> None:
        self.abort_nowait(request_ids)

    async def ask_all_free(self, timeout_s: float = 5.0) -> str:
        """ "" if every engine is empty, else what is left where (see AsyncEngineClient)."""
        problems = await asyncio.gather(*(m.ask_all_free(timeout_s) for m in self._members))
        return "; ".join(
            f"engine {label}: {problem}"
            for label, problem in zip(self.engine_labels, problems)
            if problem
        )

    def _choose(self, request: EngineCoreRequest) -> int:
        if len(self._members) == 1:
            return 0  # nothing to choose: no hashing for a request that can go nowhere else
        router = self.router
        self._refresh_router()
        if not any(router.is_up(e) for e in range(router.num_engines)):
            raise EngineDeadError(self.dead_reason or "no engine is up")
        return router.choose(request.prompt_token_ids)

    def _refresh_router(self) -> None:
        """Tell the router which engines are up and their latest stats."""
        router = self.router
        for engine, member in enumerate(self._members):
            up = member.dead_reason is None
            if up != router.is_up(engine):
                router.set_up(engine, up)
            router.observe_stats(engine, member.stats)

    async def _send_elsewhere(
        self, request: EngineCoreRequest, refused_by: set[int]
    ) -> tuple[int, AsyncIterator[EngineCoreOutput]] | None:
        """After the engines in ``refused_by`` refused ``request`` (their queue cap), send it to
        the least loaded other engine up; None once there is none left to try."""
        if len(self._members) == 1:
            return None
        self._refresh_router()
        while (engine := self.router.choose_other(refused_by)) is not None:
            refused_by.add(engine)
            try:
                stream = await self._members[engine].add_request(request)
            except EngineDeadError:
                continue
            self.num_refusals_retried += 1
            self._owners[request.request_id] = engine
            return engine, stream
        return None

    async def _send(
        self, request: EngineCoreRequest
    ) -> tuple[int, AsyncIterator[EngineCoreOutput]]:
        """Route and send; an engine found dead on the way is passed over (bounded)."""
        for _ in range(len(self._members)):
            engine = self._choose(request)
            try:
                stream = await self._members[engine].add_request(request)
            except EngineDeadError:
                continue
            self._owners[request.request_id] = engine
            return engine, stream
        raise EngineDeadError(self.dead_reason or "no engine took the request")

    async def _follow(
        self, request: EngineCoreRequest, engine: int, stream: AsyncIterator[EngineCoreOutput]
    ) -> AsyncIterator[EngineCoreOutput]:
        """The request's outputs; sent again elsewhere if its engine dies before any token, or
        refuses it while another engine may take it."""
        streamed = False
        refused_by = {engine}
        try:
            while True:
                try:
                    async for output in stream:
                        if output.finish_reason == "rejected" and not streamed:
                            moved = await self._send_elsewhere(request, refused_by)
                            if moved is not None:
                                await stream.aclose()  # type: ignore[attr-defined]
                                engine, stream = moved
                                break
                        streamed = streamed or bool(output.new_token_ids)
                        yield output
                    else:
                        return
                except EngineDeadError as exc:
                    if streamed or len(self._members) == 1 or self.closing:
                        raise
                    self.num_resent += 1
                    logger.info(
                        "engine %s died before request %s streamed a token (%s): sending it "
                        "to another engine",
                        self.engine_labels[engine],
                        request.request_id,
                        exc,
                    )
                    engine, stream = await self._send(request)
        finally:
            if self._owners.get(request.request_id) == engine:
                del self._owners[request.request_id]
            # Aborts it in its engine unless it finished there.
            await stream.aclose()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ engines coming back

    async def _watch(self) -> None:
        while not self.closing:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if any(m.dead_reason is None for m in self._members):
                self._unserved_since = None
            elif self._unserved_since is None:
                self._unserved_since = time.monotonic()
            for engine, member in enumerate(self._members):
                if member.dead_reason is not None and engine not in self._reattaching:
                    task = asyncio.create_task(self._reattach(engine))
                    self._reattaching[engine] = task

    async def _reattach(self, engine: int) -> None:
        """Attach to the engine at its address again once it answers (bounded attempts)."""
        old = self._members[engine]
        label = self.engine_labels[engine]
        logger.warning(
            "engine %s is down (%s); attaching again once it answers", label, old.dead_reason
        )
        try:
            await old.shutdown()  # its socket thread has ended: this frees the rest
            while not self.closing:
                started = time.monotonic()
                try:
                    client = await self._attach(self.addresses[engine])
                except EngineStartError:
                    self._check_lost(started)
                    continue
                if self.closing:
                    await client.shutdown()
                    return
                self._members[engine] = client
                logger.info("engine %s serves again (pid %d)", label, client.engine_pid)
                return
        finally:
            del self._reattaching[engine]

    async def _attach_client(self, address: str) -> AsyncEngineClient:
        return await AsyncEngineClient.start(
            address=address,
            ready_timeout_s=REATTACH_ATTEMPT_S,
            client_name=self.client_name,
            silence_limit_s=self._silence_limit_s,
        )

    def _check_lost(self, attempt_started: float) -> None:
        """Give up once an attempt begun after ``lost_limit_s`` without any engine failed too.

        Counting from the attempt's start, not its end: a frontend that was itself stopped
        (a paused VM) must try again after waking before it concludes anything."""
        since = self._unserved_since
        if self.lost_reason is not None or since is None:
            return
        if attempt_started - since >= self._lost_limit_s:
            self.lost_reason = f"no engine has answered for {time.monotonic() - since:.0f} s"
            logger.error("%s: giving up on %s", self.lost_reason, ", ".join(self.addresses))

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self, reason: str = "the client was shut down") -> None:
        """Say Goodbye to every engine and stop every socket thread. Idempotent.

        Open streams raise ``EngineDeadError(reason)``; the engines abort their requests.
        """
        if self.closing:
            return
        self.closing = True
        self._closed_reason = reason
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        # An attempt in progress ends within REATTACH_ATTEMPT_S and then sees ``closing``.
        await asyncio.gather(*self._reattaching.values(), return_exceptions=True)
        await asyncio.gather(*(m.shutdown(reason) for m in self._members))


def _down_reason(member: AsyncEngineClient) -> str:
    """Why an engine is down, in words for a 503; a silent one's silence counted up to now."""
    unheard_since = member.unheard_since
    if unheard_since is None:
        return member.dead_reason or "down"
    return f"the engine has not been heard from for {time.monotonic() - unheard_since:.0f} s"
