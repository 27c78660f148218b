"""The folder is the architecture: check who may import whom, that installed code never reaches for
the source tree, and that nothing installed imports the lab.

Every product folder installs as ``conveyor.<folder>``:

    protocol, runtime           below everything: standard library (and msgspec) only
    engine_core                 protocol, runtime, the executor interface; never torch or worker
    executor                    protocol, runtime; the worker only where a rank runs in-process
    worker                      protocol, runtime; never engine_core, executor or frontend
    frontend                    its clients, the offline API, the HTTP server
    entrypoints                 may import everything installed: it assembles the programs
    bench.loadgen               a client of the HTTP API: nothing of the engine at all
    the lab (benchmarks/, scripts/, tests/)   imports conveyor; nothing installed imports it
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.layout import LAB, PRODUCT

ROOT = Path(__file__).resolve().parents[1]
# Every folder with Python code that ships or runs: none of it may edit the import path.
CODE_FOLDERS = ("conveyor", *PRODUCT, *LAB)


def _imports(path: Path) -> set[str]:
    """Dotted names of every import in a file, including those inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _module_level_imports(path: Path) -> set[str]:
    """The imports a module runs when it is imported (not those inside its functions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _imported(folder: str) -> dict[str, set[str]]:
    """Per file of ``folder``: what it imports, ``conveyor.X...`` as ``X`` (the subpackage) and
    anything else by its top-level name."""
    return {str(path.relative_to(ROOT)): _names(_imports(path)) for path in _files(folder)}


def _names(imports: set[str]) -> set[str]:
    return {
        name.split(".")[1] if name.startswith("conveyor.") else name.split(".")[0]
        for name in imports
    }


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_protocol_imports_no_other_package_and_no_torch():
    for path, names in _imported("protocol").items():
        assert not names & (set(PRODUCT) - {"protocol"}) and not names & {"torch", "numpy"}, path


def test_the_process_runtime_is_standard_library_only():
    # Every process imports it, the worker included: it must cost nothing and pull in nothing.
    # The one exception is the socket security, on pyzmq, which every process loads anyway.
    for path, names in _imported("runtime").items():
        allowed = {"zmq"} if path.endswith("zmq_security.py") else set()
        assert names - {"runtime", "__future__"} - allowed <= set(sys.stdlib_module_names), path


def test_engine_core_sees_only_the_executor_interface_and_never_torch():
    for path in _files("engine_core"):
        names = _imports(path)
        assert not _names(names) & {"worker", "frontend", "entrypoints", "bench", "torch"}, path
        executor = {n for n in names if n.startswith("conveyor.executor")}
        assert executor <= {"conveyor.executor.abstract"}, path


def test_the_executor_loads_a_worker_only_where_a_rank_runs_in_this_process():
    for path in _files("executor"):
        names = _names(_imports(path))
        assert not names & {"engine_core", "frontend", "entrypoints", "bench"}, path
        if path.name != "ray_workers.py":  # imported only when --executor-backend ray is chosen
            assert not _names(_module_level_imports(path)) & {"worker", "torch"}, path


def test_worker_never_imports_frontend_or_engine_core():
    for path, names in _imported("worker").items():
        assert not names & {"frontend", "engine_core", "executor", "entrypoints", "bench"}, path


def test_only_the_in_process_client_builds_an_engine_inside_the_frontend():
    for path, names in _imported("frontend").items():
        assert not names & {"entrypoints", "bench"}, path
        if not path.endswith("engine_client/inprocess_client.py"):
            assert not names & {"engine_core", "worker", "executor"}, path


def test_the_load_generator_imports_nothing_of_the_engine():
    for path in _files("bench/loadgen"):
        ours = {n for n in _imports(path) if n.split(".")[0] == "conveyor"}
        allowed = ("conveyor.bench.loadgen", "conveyor.bench.machine", "conveyor.runtime.processes")
        assert all(n.startswith(allowed) for n in ours), path
    machine = {name.split(".")[0] for name in _imports(ROOT / "bench" / "machine.py")}
    assert machine <= set(sys.stdlib_module_names) | {"__future__"}


def test_nothing_installed_imports_the_lab_or_a_bare_folder_name():
    """Installed code imports its own modules as ``conveyor.X``, never the lab (which the wheel
    does not hold) and never a bare ``worker`` or ``protocol`` (someone else's, if anything)."""
    for folder in ("conveyor", *PRODUCT):
        for path in _files(folder):
            tops = {name.split(".")[0] for name in _imports(path)}
            assert not tops & {*LAB, *PRODUCT}, f"{path}: {sorted(tops & {*LAB, *PRODUCT})}"


def test_the_lab_imports_the_product_through_the_conveyor_package():
    for folder in LAB:
        for path in _files(folder):
            tops = {name.split(".")[0] for name in _imports(path)}
            assert not tops & set(PRODUCT), f"{path}: {sorted(tops & set(PRODUCT))}"


def test_the_wheel_lists_every_product_package_and_nothing_else():
    """pyproject.toml names each installed package: one missing would be absent from a
    non-editable install (though an editable one finds it), one extra would ship the lab."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {
        "conveyor": "conveyor",
        **{f"conveyor.{name}": name for name in PRODUCT},
    }
    found = {"conveyor"} | {
        "conveyor." + ".".join(init.parent.relative_to(ROOT).parts)
        for name in PRODUCT
        for init in (ROOT / name).rglob("__init__.py")
    }
    assert sorted(setuptools["packages"]) == sorted(found)


def test_importing_engine_core_and_protocol_leaves_torch_unimported():
    code = (
        "import sys, conveyor, conveyor.engine_core, conveyor.protocol, conveyor.runtime, "
        "conveyor.executor.backends; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_conveyor_help_and_the_load_generator_load_no_engine():
    """``conveyor --help`` is instant, and ``conveyor bench serve`` never imports torch."""
    code = (
        "import sys, conveyor.entrypoints.cli, conveyor.bench.loadgen.main\n"
        "print(sorted(m for m in ('torch', 'transformers', 'conveyor.engine_core', "
        "'conveyor.worker', 'conveyor.frontend') if m in sys.modules))"
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
    for folder in ("conveyor", *PRODUCT):
        for path in (ROOT / folder).rglob("*.py"):
            source = path.read_text()
            assert "__file__).resolve().parents" not in source, path
            assert "__file__).parents" not in source, path


UNPICKLERS = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
PICKLING_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def test_nothing_unpickles_what_arrives():
    """Row 16: messages are msgspec Structs; nothing that crosses a process boundary (or comes
    from a model directory: weights are safetensors) goes through pickle."""
    for package in ("conveyor", *PRODUCT):
        for path, names in _imported(package).items():
            assert not names & UNPICKLERS, path
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute):
                    assert node.attr not in PICKLING_CALLS, f"{path}: {node.attr}"
                    is_torch_load = isinstance(node.value, ast.Name) and node.value.id == "torch"
                    assert not (is_torch_load and node.attr == "load"), f"{path}: torch.load"
