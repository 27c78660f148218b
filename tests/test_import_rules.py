"""The folder is the architecture: check who may import whom, and that installed code never
reaches for the source tree.

    protocol, runtime           below everything: standard library (and msgspec) only
    engine_core                 protocol, runtime; never torch, worker or frontend
    worker                      protocol, runtime; never engine_core or frontend
    frontend                    its clients, the offline API, the HTTP server
    entrypoints                 may import everything: it assembles the programs
    benchmarks.loadgen          a client of the HTTP API: nothing of the engine at all
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"protocol", "runtime", "engine_core", "worker", "frontend", "entrypoints", "benchmarks"}
# Every folder with Python code that ships or runs: none of it may edit the import path.
CODE_FOLDERS = (*sorted(OURS), "scripts", "tests")


def _imports(path: Path) -> set[str]:
    """Dotted names of every import in a file, including those inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _imported_top_levels(folder: str) -> dict[str, set[str]]:
    return {
        str(path.relative_to(ROOT)): {name.split(".")[0] for name in _imports(path)}
        for path in (ROOT / folder).rglob("*.py")
    }


def test_protocol_imports_no_other_package_and_no_torch():
    for path, names in _imported_top_levels("protocol").items():
        assert not names & (OURS - {"protocol"}) and not names & {"torch", "numpy"}, path


def test_the_process_runtime_is_standard_library_only():
    # Every process imports it, the worker included: it must cost nothing and pull in nothing.
    # The one exception is the socket security, on pyzmq, which every process loads anyway.
    for path, names in _imported_top_levels("runtime").items():
        allowed = {"zmq"} if path.endswith("zmq_security.py") else set()
        assert names - {"runtime", "__future__"} - allowed <= set(sys.stdlib_module_names), path


def test_engine_core_never_imports_torch_or_worker_or_frontend():
    for path, names in _imported_top_levels("engine_core").items():
        assert not names & {"worker", "frontend", "entrypoints", "benchmarks", "torch"}, path


def test_worker_never_imports_frontend_or_engine_core():
    for path, names in _imported_top_levels("worker").items():
        assert not names & {"frontend", "engine_core", "entrypoints", "benchmarks"}, path


def test_only_the_in_process_client_builds_an_engine_inside_the_frontend():
    for path, names in _imported_top_levels("frontend").items():
        assert not names & {"entrypoints", "benchmarks"}, path
        if not path.endswith("engine_client/inprocess_client.py"):
            assert not names & {"engine_core", "worker"}, path


def test_the_load_generator_imports_nothing_of_the_engine():
    for path, names in _imported_top_levels("benchmarks/loadgen").items():
        assert not names & (OURS - {"benchmarks"}), path
    for path in (ROOT / "benchmarks" / "loadgen").rglob("*.py"):
        ours = {n for n in _imports(path) if n.split(".")[0] == "benchmarks"}
        assert all(n.startswith(("benchmarks.loadgen", "benchmarks.machine")) for n in ours), path
    machine = {name.split(".")[0] for name in _imports(ROOT / "benchmarks" / "machine.py")}
    assert machine <= set(sys.stdlib_module_names) | {"__future__"}


def test_importing_engine_core_and_protocol_leaves_torch_unimported():
    code = "import sys, engine_core, protocol, runtime; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_conveyor_help_and_the_load_generator_load_no_engine():
    """``conveyor --help`` is instant, and ``conveyor bench serve`` never imports torch."""
    code = (
        "import sys, entrypoints.cli, benchmarks.loadgen.main\n"
        "print(sorted(m for m in ('torch', 'transformers', 'engine_core', 'worker', 'frontend')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _edits_the_import_path(node: ast.AST) -> bool:
    """``sys.path.insert/append/extend(...)``, ``sys.path[...] = ``, ``sys.path = ``."""

    def is_sys_path(target: ast.AST) -> bool:
        return (
            isinstance(target, ast.Attribute)
            and target.attr == "path"
            and isinstance(target.value, ast.Name)
            and target.value.id == "sys"
        )

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return is_sys_path(node.func.value) and node.func.attr in ("insert", "append", "extend")
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(
            is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value))
            for t in targets
        )
    return False


def test_no_code_puts_the_source_tree_on_the_import_path():
    """Installed code runs from any directory (``pip install .``, not editable): nothing may
    edit sys.path or PYTHONPATH, and children start as ``python -m <installed module>``."""
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            source = path.read_text()
            assert "PYTHONPATH" not in source or path == Path(__file__), path
            for node in ast.walk(ast.parse(source, str(path))):
                assert not _edits_the_import_path(node), f"{path}:{getattr(node, 'lineno', '')}"


def test_packaged_code_never_looks_above_its_own_package():
    """``Path(__file__).parents[N]`` from a package climbs into the source tree, which an
    installed package does not have."""
    for folder in sorted(OURS):
        for path in (ROOT / folder).rglob("*.py"):
            source = path.read_text()
            assert "__file__).resolve().parents" not in source, path
            assert "__file__).parents" not in source, path


UNPICKLERS = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
PICKLING_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def test_nothing_unpickles_what_arrives():
    """Row 16: messages are msgspec Structs; nothing that crosses a process boundary (or comes
    from a model directory: weights are safetensors) goes through pickle."""
    for package in sorted(OURS):
        for path, names in _imported_top_levels(package).items():
            assert not names & UNPICKLERS, path
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute):
                    assert node.attr not in PICKLING_CALLS, f"{path}: {node.attr}"
                    is_torch_load = isinstance(node.value, ast.Name) and node.value.id == "torch"
                    assert not (is_torch_load and node.attr == "load"), f"{path}: torch.load"
