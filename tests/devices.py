"""Which device the test suite runs on, and what the model tests may expect there.

Runs in the pytest process; conftest.py calls ``pin_test_device`` when it is imported, before any
test module touches torch. The suite runs on the CPU unless ``CONVEYOR_TEST_DEVICE=cuda`` asks for
the GPU:

- ``cpu`` (the default): ``CUDA_VISIBLE_DEVICES`` is emptied, so neither this process nor any it
  starts (engines, workers, servers) sees a GPU, and ``TRITON_INTERPRET=1`` runs Triton kernels
  in Triton's interpreter. Every engine's ``device="auto"`` is then the CPU
  and ``dtype="auto"`` float32, which is what the suite's tolerances were set for, on a GPU
  machine too. Tests marked ``cuda`` skip, saying how to run them.
- ``cuda``: the GPU stays visible and ``device="auto"`` engines run there; the model tests pass
  ``MODEL_TEST_DTYPE`` and read their tolerance from ``logprob_tolerance``; the ``cuda`` tests
  run. Such a run must be serial (no ``-n``): every engine claims ``gpu_memory_utilization`` of
  the card, so two at once cannot both start.
"""

from __future__ import annotations

import os
import platform

import pytest

from conveyor.runtime import cpu_isa

DEVICE_VARIABLE = "CONVEYOR_TEST_DEVICE"
DEVICES = ("cpu", "cuda")
TEST_DEVICE = os.environ.get(DEVICE_VARIABLE) or "cpu"
# The model tests compare with transformers in float32 on the CPU; on CUDA they run float32 too
# (TF32 is off by default in torch), so the same tokens and a tolerance near the CPU's hold.
MODEL_TEST_DTYPE = "float32"
# CONVEYOR_CPU_ISA=avx2 is an x86 setting: elsewhere it is refused, so tests that run with it
# run on x86 only.
x86_only = pytest.mark.skipif(
    platform.machine().lower() not in cpu_isa.X86_MACHINES,
    reason="CONVEYOR_CPU_ISA=avx2 holds an x86 CPU",
)
# Largest |ours - reference| of a token's logprob, by the dtype the engine ran in. bfloat16
# keeps 8 bits of mantissa: logits of a few units are off by ~1e-2 after a few layers.
_LOGPROB_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
CUDA_SKIP_REASON = (
    f"needs a CUDA GPU; the suite pins the CPU unless {DEVICE_VARIABLE}=cuda (run serially, "
    "without -n, on a GPU machine)"
)


def pin_test_device() -> None:
    """Hide every GPU from this process and its children unless the run asked for CUDA."""
    if TEST_DEVICE not in DEVICES:
        raise pytest.UsageError(f"{DEVICE_VARIABLE} must be one of {DEVICES}, got {TEST_DEVICE!r}")
    if TEST_DEVICE == "cpu":
        # Before torch initialises CUDA (it reads the variable once, at its first CUDA call).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # Triton kernels run in Triton's interpreter on the CPU (test_triton_attention.py). It
        # is read when triton is imported, which transformers does when it is installed.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # The two test workers share the cores, and each server a test starts adds a model
        # worker: OpenMP threads spinning at every barrier keep the cores from the other
        # processes' threads, whose own barriers then wait on them. Asleep at barriers instead
        # of GNU OpenMP's default spinning, tests/frontend took 190 s, not 395 s.
        # Read when torch first loads libgomp, here and in every process started from here.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def check_cuda_run(config: pytest.Config) -> None:
    """A CUDA run needs a GPU and one engine at a time; say so instead of failing later."""
    if TEST_DEVICE != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(f"{DEVICE_VARIABLE}=cuda, but torch sees no CUDA device")
    workers = getattr(config.option, "numprocesses", None)
    if workers not in (None, 0, 1):
        raise pytest.UsageError(
            f"{DEVICE_VARIABLE}=cuda runs serially: drop -n (each engine claims "
            "gpu_memory_utilization of the card)"
        )


def requires_cuda() -> pytest.MarkDecorator:
    """The skip mark of a CUDA test; call it at import of a test module (conftest has pinned
    the device by then, so on a CPU run torch sees no GPU even where there is one)."""
    import torch

    return pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)


def logprob_tolerance(dtype: str) -> float:
    return _LOGPROB_TOLERANCE[dtype]
