"""One log-line format for every conveyor process: several share one terminal, so each line
names the process that wrote it (``serve[12]``, ``engine_core[13]``, ``worker-0[14]``,
``frontend[15]``).

Runs in every conveyor process, once, at start-up.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_FORMAT = "%(asctime)s {process_name}[%(process)d] %(levelname)s %(name)s: %(message)s"
# Children inherit the supervisor's level through the environment.
LOG_LEVEL_ENV = "CONVEYOR_LOG_LEVEL"


def log_level(name: str | None = None) -> int:
    """``name`` (or $CONVEYOR_LOG_LEVEL, else INFO) as a logging level; unknown names mean INFO."""
    name = name or os.environ.get(LOG_LEVEL_ENV) or "INFO"
    level = logging.getLevelName(name.upper())
    return level if isinstance(level, int) else logging.INFO


def configure_logging(process_name: str, level: str | int | None = None) -> None:
    """Log to stderr in the shared format; replaces any earlier configuration."""
    logging.basicConfig(
        level=level if isinstance(level, int) else log_level(level),
        format=LOG_FORMAT.format(process_name=process_name),
        stream=sys.stderr,
        force=True,
    )
