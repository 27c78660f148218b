"""The waiting queue, in first-come-first-served or priority order, behind one small interface.

Runs in the engine-core process. The scheduler only looks at the head (``peek``), takes it
(``pop``), puts a preempted request back (``add_preempted``) and drops aborted ones in bulk
(``remove_requests``); which request is the head is the queue's whole job.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Collection, Iterator

from conveyor.engine_core.request import Request


class RequestQueue(ABC):
    """Requests waiting for their (first or next) admission, head first."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Put back a request that was preempted: it is served before later arrivals."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the head."""

    @abstractmethod
    def remove_requests(self, requests: Collection[Request]) -> None:
        """Drop the given requests; O(queue) once, however many there are."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be admitted."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        # The victim is the newest running request, admitted after every other running one but
        # before everything still waiting: the front keeps arrival order among admissions.
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Collection[Request]) -> None:
        gone = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


def priority_key(request: Request) -> tuple[int, float, int]:
    """Lower priority value first, then earlier arrival; req_id makes the order total."""
    return (request.priority, request.arrival_time, request.req_id)


class PriorityRequestQueue(RequestQueue):
    """A heap on ``priority_key``; a preempted request goes back by its key like any other."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove_requests(self, requests: Collection[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[1]) not in gone]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._heap, key=lambda entry: entry[0]))

    def __len__(self) -> int:
        return len(self._heap)


def make_request_queue(order: str) -> RequestQueue:
    if order == "fcfs":
        return FCFSRequestQueue()
    if order == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"queue order must be 'fcfs' or 'priority', got {order!r}")
