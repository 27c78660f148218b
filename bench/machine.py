"""What every benchmark script reports about the machine and the CPU it got.

Runs in the benchmark's own process. One key set for every script (``num_cpus`` is the cores this
process may run on, which is what a 2-core CI box or a ``taskset`` run actually has). CPU use is
measured over the whole process tree, because the engine and its workers are child processes
that ``os.times()`` of the benchmark does not see while they run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path


def machine_info(**extra: object) -> dict[str, object]:
    """Platform, CPU model, usable cores, Python, and torch / GPU where torch is loaded."""
    info: dict[str, object] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "num_cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "python": platform.python_version(),
    }
    # runtime.cpu_isa's variable, read here by name: the load generator imports this module, and
    # it stays standard-library only.
    if os.environ.get("CONVEYOR_CPU_ISA"):
        info["cpu_isa"] = os.environ["CONVEYOR_CPU_ISA"]
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        # What torch's kernels run (AVX512, AVX2, ...): CONVEYOR_CPU_ISA can hold it below the CPU's.
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    info.update(extra)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tree_cpu_seconds(root_pid: int | None = None) -> float:
    """User + system CPU seconds of a process and every live descendant (Linux /proc).

    Elsewhere, only this process's own time (children are invisible until they are waited for).
    """
    root_pid = os.getpid() if root_pid is None else root_pid
    proc = Path("/proc")
    if not proc.exists():
        times = os.times()
        return times.user + times.system
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def system_busy_seconds() -> float:
    """CPU seconds all processes spent busy (Linux /proc/stat), 0.0 where unavailable."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Timing:
    """Wall time of a block, and how much of the machine our processes and others used."""

    def __enter__(self) -> Timing:
        self._start = time.perf_counter(), tree_cpu_seconds(), system_busy_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        wall, cpu, busy = self._start
        self.seconds = time.perf_counter() - wall
        self.cpu_seconds = tree_cpu_seconds() - cpu
        self.busy_seconds = system_busy_seconds() - busy

    def summary(self) -> dict[str, float]:
        num_cpus = machine_info()["num_cpus"]
        assert isinstance(num_cpus, int)
        others = max(0.0, self.busy_seconds - self.cpu_seconds)
        return {
            "seconds": round(self.seconds, 3),
            # CPU seconds of our process tree (frontend, engine, workers) per wall second per
            # core: how much of the machine this run kept busy.
            "cpu_utilization": round(self.cpu_seconds / self.seconds / num_cpus, 3),
            # Share of the cores busy with OTHER processes meanwhile (Linux): runs on a shared
            # machine are only comparable when this is near 0.
            "other_load": round(others / self.seconds / num_cpus, 3),
        }


def print_report_start(report: dict[str, object], as_json: bool) -> bool:
    """A benchmark report's start: the whole report as JSON (True: nothing more to print), or
    its machine and configuration lines before the caller's table."""
    if as_json:
        print(json.dumps(report, indent=2))
        return True
    print(f"machine: {report['machine']}")
    print(f"config: {report['config']}")
    return False
