"""Helpers for tests that run worker processes: an engine config, a workload, process checks.

Runs in the test process. Every wait here is bounded.
"""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path

from conveyor.engine_core import EngineCore
from conveyor.frontend.engine_args import EngineArgs
from conveyor.protocol import EngineConfig, EngineCoreRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Lengths around the block size (16) and the token budget (48), so prefills are chunked.
PROMPT_LENGTHS = (5, 16, 17, 40, 70)


def make_config(model_dir: Path, tensor_parallel_size: int = 1) -> EngineConfig:
    return EngineArgs(
        model=str(model_dir),
        max_num_seqs=8,
        max_num_batched_tokens=48,
        max_model_len=256,
        kv_cache_memory=2 << 20,
        device="cpu",
        tensor_parallel_size=tensor_parallel_size,
    ).create_engine_config()


def make_requests() -> list[EngineCoreRequest]:
    requests = []
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = [(37 * i + 11 * j + 1) % 2000 for j in range(length)]
        requests.append(EngineCoreRequest(f"greedy-{i}", prompt, GREEDY, 0.0))
    # Random sampling too: seeded per request, and unseeded from the worker's seeded global state.
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)
    requests.append(EngineCoreRequest("seeded", [3, 1, 4, 1, 5, 9, 2, 6], seeded, 0.0))
    requests.append(EngineCoreRequest("unseeded", [2, 7, 1, 8, 2, 8], unseeded, 0.0))
    return requests


def generate(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """request_id -> tokens, stepping until everything finished; then every block is free."""
    for request in requests:
        assert core.add_request(request) is None
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(500):
        if not core.has_unfinished_requests():
            core.check_all_free()
            return tokens
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[output.request_id] += output.new_token_ids
    raise AssertionError("the engine did not finish")


def is_alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that may never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def child_pids() -> set[int]:
    """Live children of this process."""
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                children.add(int(entry.name))
    return children


def wait_until_gone(pids: list[int], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(is_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if is_alive(p)]}"
        time.sleep(0.05)


def listening_tcp_addresses(pid: int) -> list[str]:
    """ "ip:port" of every TCP socket ``pid`` listens on (IPv4 and IPv6, from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = LISTEN
                addresses.append(_decode_proc_address(local))
    return addresses


def _decode_proc_address(text: str) -> str:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # /proc prints each 32-bit word of the address in host (little-endian) byte order.
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    address = b"".join(words)
    if len(address) == 4:
        return f"{'.'.join(str(b) for b in address)}:{int(port, 16)}"
    return f"[{ipaddress.IPv6Address(address)}]:{int(port, 16)}"
