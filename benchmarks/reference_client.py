"""The handle `python -m benchmarks reference` keeps on the reference engine's process.

Runs in the benchmark's own process. Starts `benchmarks/reference_engine.py` under the reference
venv's Python, waits for its ready line, then sends it one batch at a time (token ids in a
temporary JSON file, a line on stdin) and reads back its timing. Its logs go to a file, whose
tail is shown when it dies, so a broken install is an error with a reason, not a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from conveyor.runtime import cpu_isa

SCRIPT = Path(__file__).resolve().parent / "reference_engine.py"
# vLLM's CPU build reserves a core for its frontend and picks its own OpenMP binding unless
# told; on a 2-core machine both cores must compute, and 4 GiB of KV holds every workload here.
CPU_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}


def isa_env(isa: str, env: dict[str, str]) -> dict[str, str]:
    """What holds the reference engine to ``isa`` as conveyor is held (runtime/cpu_isa.py): the
    same torch/oneDNN/MKL limits, and CONVEYOR_CPU_ISA itself, on which reference_engine.py
    answers torch's CPU feature queries as an AVX2-only CPU would before vLLM picks its kernels
    (in each of vLLM's processes: a spawned one imports that script first)."""
    if isa == "native":
        return {}
    limits = {k: v for k, v in cpu_isa.library_env(isa).items() if k not in env}
    return {**limits, cpu_isa.ENV: isa}


class ReferenceEngineError(RuntimeError):
    pass


class ReferenceEngine:
    """One running reference engine; `generate` blocks until its batch is done."""

    def __init__(self, process: subprocess.Popen, workdir: tempfile.TemporaryDirectory) -> None:
        self._process = process
        self._workdir = workdir
        self.version = "?"

    @property
    def pid(self) -> int:
        return self._process.pid

    @classmethod
    def start(cls, python: str, flags: list[str]) -> ReferenceEngine:
        if not Path(python).exists():
            raise ReferenceEngineError(
                f"no reference engine at {python}: run scripts/install_reference_engine.sh"
            )
        workdir = tempfile.TemporaryDirectory(prefix="conveyor-ref-")
        # A copy, run from a folder of its own (see reference_engine.py's docstring).
        script = shutil.copy(SCRIPT, workdir.name)
        log = open(Path(workdir.name) / "engine.log", "w")  # noqa: SIM115 (child's stderr)
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in CPU_ENV.items()}}
        env.update(isa_env(cpu_isa.requested(), env))
        process = subprocess.Popen(
            [python, script, *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            # Its own process group: vLLM's engine-core child goes down with it if it hangs.
            start_new_session=True,
        )
        log.close()
        engine = cls(process, workdir)
        engine.version = str(engine._read_answer().get("version", "?"))
        return engine

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, object]:
        """Run one batch; its seconds (around LLM.generate only) and token counts."""
        path = Path(self._workdir.name) / "prompts.json"
        path.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens}))
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"prompts_file": str(path)}) + "\n")
        self._process.stdin.flush()
        return self._read_answer()

    def _read_answer(self) -> dict[str, object]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.wait(timeout=30)
            raise ReferenceEngineError(
                f"the reference engine exited ({self._process.returncode}):\n{self.log_tail()}"
            )
        return json.loads(line)

    def log_tail(self, num_lines: int = 30) -> str:
        lines = (Path(self._workdir.name) / "engine.log").read_text().splitlines()
        return "\n".join(lines[-num_lines:])

    def close(self) -> None:
        """End of stdin ends its loop and lets vLLM shut its engine down; kill if it hangs."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._workdir.cleanup()
