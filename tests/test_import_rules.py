"""The folder is the architecture: check who may import whom."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_top_levels(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_protocol_imports_no_other_package_and_no_torch():
    for path, names in _imported_top_levels("protocol").items():
        assert not names & {"engine_core", "worker", "frontend", "torch", "numpy"}, path


def test_engine_core_never_imports_torch_or_worker_or_frontend():
    for path, names in _imported_top_levels("engine_core").items():
        assert not names & {"worker", "frontend", "torch"}, path


def test_worker_never_imports_frontend_or_engine_core():
    for path, names in _imported_top_levels("worker").items():
        assert not names & {"frontend", "engine_core"}, path


def test_importing_engine_core_and_protocol_leaves_torch_unimported():
    code = "import sys, engine_core, protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


UNPICKLERS = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
PICKLING_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def test_nothing_unpickles_what_arrives():
    """Row 16: messages are msgspec Structs; nothing that crosses a process boundary (or comes
    from a model directory: weights are safetensors) goes through pickle."""
    for package in ("protocol", "engine_core", "frontend", "worker"):
        for path, names in _imported_top_levels(package).items():
            assert not names & UNPICKLERS, path
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute):
                    assert node.attr not in PICKLING_CALLS, f"{path}: {node.attr}"
                    is_torch_load = isinstance(node.value, ast.Name) and node.value.id == "torch"
                    assert not (is_torch_load and node.attr == "load"), f"{path}: torch.load"
