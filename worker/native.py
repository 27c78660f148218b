"""Build the worker's C sources with the system compiler on first use, cached, and load them.

Runs in worker processes. The sources are plain C (no torch headers), so a build takes about a
second. A shared object is cached under ``$CONVEYOR_CACHE/kernels`` (else
``~/.cache/conveyor/kernels``), named by a hash of the sources, the flags, the compiler and the
CPU, and published by an atomic rename, so processes that race to build it (pytest-xdist, tensor
parallel workers) all load a complete file. Callers try ``FLAG_SETS`` in order and fall back to
torch ops where nothing builds; ``CONVEYOR_CPU_KERNEL=0`` turns every compiled path off.

The libraries' OpenMP threads come from the libgomp torch loaded (torch is imported before any
library loads, and its libgomp has the system one's soname), so they are the threads torch's own
ops use, not a second pool competing for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from conveyor.runtime import cpu_isa

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Tried in order: the first set the compiler accepts wins. -march=native vectorises for this CPU
# (the cache key includes the CPU, so a shared cache folder never hands it to another machine);
# CONVEYOR_CPU_ISA=avx2 puts -march=haswell in its place (runtime.cpu_isa).
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3", "-fopenmp-simd"),
    ("-O2",),
)
# What the torch fallback cost where it was measured: `conveyor bench offline` on the bench model
# (float32, workload equal, 64 requests) on a shared 2-core Intel Xeon host: 1.4-1.9x in five of
# six interleaved pairs, even in one.
TORCH_FALLBACK_COST = "about 1.5x slower end to end where measured"
# C headers more than one kernel includes (each kernel lists the ones it reads in its inputs),
# found through -I, so a copy of a kernel's folder elsewhere (the attention benchmark's
# --compare-kernel) still builds.
SHARED_HEADERS = Path(__file__).parent / "csrc"
# ISO C mode turns off contracting a * b + c into one fused multiply-add; the kernels are nearly
# all of those, and without FMA the attention kernel ran at about half the speed.
COMMON_FLAGS = ("-shared", "-fPIC", "-std=c11", "-ffp-contract=fast", f"-I{SHARED_HEADERS}")


def compiled_paths_disabled() -> bool:
    return os.environ.get("CONVEYOR_CPU_KERNEL", "1").strip().lower() in ("0", "false", "no", "off")


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def warn_if_no_compiler(log: logging.Logger) -> bool:
    """Say once, at start-up, that there is no C compiler and what that costs; whether so."""
    if compiled_paths_disabled() or find_compiler() is not None:
        return False
    log.warning(
        "no C compiler found ($CC, gcc, cc or clang): the compiled CPU attention kernel and "
        "token ops cannot be built, so the model runs on torch ops instead, correct but slower "
        "(%s); install gcc (e.g. apt-get install gcc) or point CC at a compiler, then restart",
        TORCH_FALLBACK_COST,
    )
    return True


def cache_dir() -> Path:
    root = os.environ.get("CONVEYOR_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "conveyor"
    return base / "kernels"


def build_and_load(
    source: Path,
    inputs: Sequence[Path],
    load: Callable[[ctypes.CDLL, Path], T],
    compiler: str,
    defines: tuple[str, ...] = (),
) -> tuple[T | None, list[str]]:
    """``load(library, path)`` of the first flag set that builds and loads; else None and why
    each failed. ``inputs``: every file the build reads (the source and its headers);
    ``defines``: flags every attempt adds (``-DNAME``), a build variant of the same source."""
    errors = []
    march = cpu_isa.march_flag()
    for flags in FLAG_SETS:
        flags = (*(march if f == "-march=native" else f for f in flags), *defines)
        try:
            path = build(compiler, flags, source, inputs)
            return load(ctypes.CDLL(str(path)), path), errors
        except Exception as error:  # any failure means "try plainer flags", never a crash
            errors.append(f"{' '.join(flags)}: {error}")
    return None, errors


def load_optional(
    log: logging.Logger,
    what: str,
    instead: str,
    source: Path,
    inputs: Sequence[Path],
    load: Callable[[ctypes.CDLL, Path], T],
    defines: tuple[str, ...] = (),
    no_compiler_level: int = logging.WARNING,
) -> T | None:
    """``load`` of ``source``'s build, or None where compiled paths are off, there is no C
    compiler or nothing builds; the last two are logged on ``log`` as "``what`` unavailable, ...
    ``instead``" (what runs in its place). Callers cache the result, so each says it once."""
    if compiled_paths_disabled():
        return None
    compiler = find_compiler()
    if compiler is None:
        log.log(no_compiler_level, "%s unavailable (no C compiler; set CC), %s", what, instead)
        return None
    library, errors = build_and_load(source, inputs, load, compiler, defines)
    if library is None:
        log.warning("%s unavailable, %s:\n%s", what, instead, "\n".join(errors))
    return library


@functools.cache
def warn_if_torch_runs_above_the_isa() -> bool:
    """Under CONVEYOR_CPU_ISA=avx2, whether torch runs wider kernels all the same (it read its
    limits before they were set: an in-process engine in a program that set only
    CONVEYOR_CPU_ISA); says so once, since then only conveyor's own kernels are held."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if cpu_isa.requested() != "avx2" or not capability.startswith("AVX512"):
        return False
    logger.warning(
        "%s=avx2 holds conveyor's kernels, but torch already runs %s kernels in this process: "
        "set %s before torch is imported (runtime.cpu_isa.library_env) to hold it too",
        cpu_isa.ENV,
        capability,
        ", ".join(f"{k}={v}" for k, v in cpu_isa.library_env().items()),
    )
    return True


def status_function(library: ctypes.CDLL, name: str, argtypes: list) -> Callable[..., int]:
    """``library``'s C function ``name`` with its argument types, returning an int status."""
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def check_abi(library: ctypes.CDLL, path: Path, function: str, want: int) -> None:
    """Refuse a cached build whose ABI (what ``function`` returns) is not the caller's."""
    version = getattr(library, function)()
    if version != want:
        raise RuntimeError(f"{path} has ABI {version}, want {want}")


def amx_switch(library: ctypes.CDLL, function: str) -> Callable[[bool], bool]:
    """``library``'s AMX switch (its C ``function``: wanted -> whether the AMX path runs, 0
    where not built or not granted) as a Python callable."""
    enable = getattr(library, function)
    enable.argtypes, enable.restype = [ctypes.c_int], ctypes.c_int
    return lambda on: bool(enable(int(on)))


def float32_rows(x, width: int):
    """x [..., width] as float32 rows [M, width] with unit column stride, what the compiled
    linears read (a view of x where it already is one; the row stride goes with it)."""
    import torch

    rows = x.reshape(-1, width)
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.to(torch.float32).contiguous()
    return rows


def build(compiler: str, flags: tuple[str, ...], source: Path, inputs: Sequence[Path]) -> Path:
    """The shared object of ``source`` built with ``flags``, from the cache when it is there."""
    # Every file the build reads: a change to any of them is a new build.
    content = b"".join(p.read_bytes() for p in sorted(set(inputs)))
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{source.stem}-{_build_key(compiler, content, flags)}.so"
    if not path.exists():
        _compile(compiler, flags, source, folder, path)
        logger.info("built %s (%s)", path, " ".join(flags))
    return path


def _compile(compiler: str, flags: tuple[str, ...], source: Path, folder: Path, path: Path) -> None:
    """Build into a private temporary file, then rename it into place (atomic on POSIX)."""
    fd, temp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        command = [compiler, *flags, *COMMON_FLAGS, str(source), "-o", temp_name, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip()[-500:] or f"exit status {result.returncode}")
        os.chmod(temp_name, 0o755)  # mkstemp made it private; any user of the cache may load it
        os.replace(temp_name, path)
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)


def _build_key(compiler: str, content: bytes, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(content)
    for part in (compiler, _compiler_version(compiler), *flags, *COMMON_FLAGS, _cpu_identity()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


@functools.cache
def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return result.stdout.splitlines()[0] if result.stdout else ""


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    identity = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    identity.append(line.strip())
                if len(identity) >= 3:
                    break
    except OSError:
        pass
    return "\n".join(identity)
