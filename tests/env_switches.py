"""Setting an on/off environment switch that a ``functools.cache``d reader reads once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from conveyor.protocol.config import ConfigError


@contextlib.contextmanager
def switch_set(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, reader: Callable[[], bool]
) -> Iterator[None]:
    """``name`` = ``value`` inside, read afresh by ``reader``; unset and read afresh after."""
    monkeypatch.setenv(name, value)
    reader.cache_clear()
    try:
        yield
    finally:
        monkeypatch.delenv(name, raising=False)
        reader.cache_clear()


def assert_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, reader: Callable[[], bool]
) -> None:
    """A value that is neither on nor off is refused by name, not read as on."""
    refused = pytest.raises(ConfigError, match=f"{name}='{value}': use one of")
    with switch_set(monkeypatch, name, value, reader), refused:
        reader()
