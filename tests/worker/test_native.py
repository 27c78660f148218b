"""native.load_optional: the compiled libraries' one way to load or say why not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conveyor.worker import native
from tests.devices import x86_only

LOG = logging.getLogger("tests.native")


def _load(library, path):
    return library.answer()


def _attempt(source: Path, **kwargs):
    return native.load_optional(
        LOG, "test library", "doing without", source, [source], _load, **kwargs
    )


@pytest.mark.skipif(native.find_compiler() is None, reason="no C compiler on this machine")
def test_builds_loads_and_says_why_not(tmp_path, monkeypatch, caplog):
    good = tmp_path / "good.c"
    good.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    assert _attempt(good) == 42
    bad = tmp_path / "bad.c"
    bad.write_text("int answer(void) { return }\n")
    with caplog.at_level(logging.INFO, logger="tests.native"):
        assert _attempt(bad) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "test library unavailable, doing without:" in caplog.text and "bad.c" in caplog.text


def test_no_compiler_is_logged_at_the_callers_level_and_off_is_silent(
    tmp_path, monkeypatch, caplog
):
    source = tmp_path / "unused.c"
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="tests.native"):
        assert _attempt(source, no_compiler_level=logging.INFO) is None
        monkeypatch.setenv("CONVEYOR_CPU_KERNEL", "0")
        assert _attempt(source) is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "test library unavailable (no C compiler; set CC), doing without")
    ]


@x86_only
def test_a_torch_that_runs_wider_kernels_than_the_hold_is_reported(monkeypatch, caplog):
    # This process imported torch without the limits: under CONVEYOR_CPU_ISA=avx2 an AVX-512
    # torch is said once (on an AVX2 host torch already runs AVX2 and nothing is said).
    import torch

    wider = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    native.warn_if_torch_runs_above_the_isa.cache_clear()
    try:
        monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx2")
        with caplog.at_level(logging.WARNING, logger="conveyor.worker.native"):
            assert native.warn_if_torch_runs_above_the_isa() == wider
            native.warn_if_torch_runs_above_the_isa()
        assert caplog.text.count("torch already runs") == (1 if wider else 0)
        monkeypatch.setenv("CONVEYOR_CPU_ISA", "native")
        native.warn_if_torch_runs_above_the_isa.cache_clear()
        assert native.warn_if_torch_runs_above_the_isa() is False
    finally:
        native.warn_if_torch_runs_above_the_isa.cache_clear()


def test_a_cpu_worker_builds_its_kernels_before_it_serves(tiny_model_dir, monkeypatch, caplog):
    # Built (or loaded from the cache) while the worker starts, not in the first step, which a
    # request would wait for: the loaders' caches are full when the Worker exists.
    from conveyor.frontend.engine_args import EngineArgs
    from conveyor.worker.attention.cpu_kernel import load_kernel
    from conveyor.worker.layers.cpu_ops import load_token_ops
    from conveyor.worker.worker import Worker

    if native.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    config = EngineArgs(model=str(tiny_model_dir), device="cpu", kv_cache_memory=16 << 20)
    load_kernel.cache_clear()
    load_token_ops.cache_clear()
    worker = Worker(config.create_engine_config())
    assert load_token_ops.cache_info().currsize == 1
    assert worker.runner.backend.cpu_kernel is not None

    # Without a compiler: one warning at start-up, naming it and what it costs.
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="conveyor.worker"):
        Worker(config.create_engine_config())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "no C compiler found" in warnings[0] and "torch ops" in warnings[0]
    assert "gcc" in warnings[0] and native.TORCH_FALLBACK_COST in warnings[0]
