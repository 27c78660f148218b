"""Where each data-parallel engine listens (``entrypoints/engines.py``)."""

from __future__ import annotations

import pytest

from conveyor.entrypoints.engines import engine_address, engine_name


@pytest.mark.parametrize(
    ("base", "rank", "size", "expected"),
    [
        (None, 1, 2, None),
        ("ipc:///run/x/engine.sock", 0, 1, "ipc:///run/x/engine.sock"),
        ("ipc:///run/x/engine.sock", 1, 2, "ipc:///run/x/engine-1.sock"),
        ("tcp://127.0.0.1:5555", 0, 2, "tcp://127.0.0.1:5555"),
        ("tcp://127.0.0.1:5555", 3, 4, "tcp://127.0.0.1:5558"),
    ],
)
def test_each_data_parallel_engine_gets_its_own_address(base, rank, size, expected):
    assert engine_address(base, rank, size) == expected


def test_one_engine_keeps_its_old_name():
    assert engine_name(0, 1) == "engine_core"
    assert [engine_name(r, 2) for r in range(2)] == ["engine_core-0", "engine_core-1"]
