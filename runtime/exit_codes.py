"""What a conveyor process's exit status means, for its supervisor and for the person reading
``echo $?``.

Runs in every conveyor process. Non-zero means "something is wrong": a process manager restarts the
server on it, so a normal shutdown (a signal, a drained frontend) is always ``OK``.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    # A fatal error at run time: a child died, a step raised.
    FAILED = 1
    # The process could not start as configured: a bad flag or config, an address it may not bind.
    BAD_CONFIG = 2
    # The engine's watchdog saw a step run past --step-timeout-s.
    HUNG = 3
    # A frontend heard no engine answer for minutes (one stopped for good, say): its supervisor
    # stops everything rather than restart a frontend that would find the same.
    ENGINE_LOST = 4
    # The process that started this one is gone.
    PARENT_DIED = 70
