"""The client keys a CURVE server refused: counted, a bounded number remembered, logged at a
bounded rate.

Runs in every process that binds a CURVE server socket (``zmq_security.SecureBinder``), in its ZAP
authenticator's thread. Standard library only.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

logger = logging.getLogger(__name__)


class RefusedKeys:
    """The client keys ZAP refused, for one ZMQ context's server sockets.

    A refused client retries every 100 ms, and anyone who reaches a CURVE port can present a new
    random key on every try: a line and a remembered key per distinct key would let them fill
    the log and the memory. So the first ``named_per_interval`` new keys of each ``interval_s``
    are logged by name (a public key, not a secret: it tells the operator which host to
    authorize); the others are counted, and the count logged once the interval is over (at the
    next refusal) or when the socket closes. The last ``capacity`` keys are remembered (LRU), so
    a known client's retries are counted without a line.
    """

    def __init__(
        self,
        capacity: int = 256,
        named_per_interval: int = 8,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.named_per_interval = named_per_interval
        self.interval_s = interval_s
        self._clock = clock
        self.num_refused = 0  # connections refused, retries included
        self.num_new_keys = 0  # keys refused that were not remembered at the time
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._interval_start = -math.inf
        self._names_left = 0
        self._unnamed = 0  # new keys of this interval not logged by name

    @property
    def num_remembered(self) -> int:
        return len(self._recent)

    def add(self, client_key: bytes) -> None:
        self.num_refused += 1
        now = self._clock()
        if now - self._interval_start >= self.interval_s:
            self.flush()
            self._interval_start = now
            self._names_left = self.named_per_interval
        if not self._remember(client_key):
            return  # a retry of a key already refused
        self.num_new_keys += 1
        if self._names_left:
            self._names_left -= 1
            logger.warning("refused connections from unauthorized key %s", client_key.decode())
        else:
            self._unnamed += 1

    def _remember(self, client_key: bytes) -> bool:
        """Note ``client_key`` as the most recent; True if it was not remembered."""
        if client_key in self._recent:
            self._recent.move_to_end(client_key)
            return False
        self._recent[client_key] = None
        if len(self._recent) > self.capacity:
            self._recent.popitem(last=False)
        return True

    def flush(self) -> None:
        """Log the count of keys refused without a line of their own, if there are any."""
        if self._unnamed:
            logger.warning(
                "refused connections from %d more unauthorized keys, not named (at most %d are "
                "named per %g s); %d connections refused in all",
                self._unnamed,
                self.named_per_interval,
                self.interval_s,
                self.num_refused,
            )
            self._unnamed = 0
