"""Shared fixtures: the generated test models, made once and cached across runs.

The models live under $CONVEYOR_CACHE when it is set, else under pytest's cache directory; the
variable is set here for the whole session so subprocesses (servers, workers) find the same copy.
Generation is safe when both pytest-xdist workers ask at once.

The suite runs on the CPU unless CONVEYOR_TEST_DEVICE=cuda asks for the GPU (tests/devices.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.devices import check_cuda_run, pin_test_device

# On import, before any test module initialises CUDA: every process of a CPU run sees no GPU.
pin_test_device()

ARCHS = ("qwen3", "qwen2", "llama")
MOE_ARCHS = ("qwen3_moe", "mixtral")


def pytest_configure(config: pytest.Config) -> None:
    check_cuda_run(config)
    cache = getattr(config, "cache", None)
    if "CONVEYOR_CACHE" not in os.environ and cache is not None:
        os.environ["CONVEYOR_CACHE"] = str(cache.mkdir("conveyor-models"))


UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (a pytest-xdist worker), check that the grouping took: the
    modules that share one server per module (``xdist_group``) must run on one worker, or each
    worker starts its own copy and the two fight over two cores. xdist marks a grouped test by
    appending ``@group`` to its id; where a pytest ignores that, those tests fail at setup with
    the reason (an error raised here would reach the user as an xdist internal error)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[UNGROUPED] = (
                f"--dist loadgroup did not keep this module's tests on one worker (pytest "
                f"{pytest.__version__} with pytest-xdist: see the pytest pin in pyproject.toml)"
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if UNGROUPED in item.stash:
        pytest.fail(item.stash[UNGROUPED], pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dirs() -> dict[str, Path]:
    """The tiny random-weight model of each family: {"qwen3": dir, "qwen2": dir, "llama": dir}."""
    from benchmarks.fixtures.model_maker import ensure_model

    return {arch: ensure_model("tiny", arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_moe_model_dirs() -> dict[str, Path]:
    """The tiny mixture-of-experts models, {"qwen3_moe": dir, "mixtral": dir}: apart from
    ``tiny_model_dirs`` so the tests that go over every dense family do not build them."""
    from benchmarks.fixtures.model_maker import ensure_model

    return {arch: ensure_model("tiny", arch) for arch in MOE_ARCHS}


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    """The default test model: tiny Qwen3, tied embeddings, float32."""
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_dir_each(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path]) -> Path:
    """Parametrizes a test over the three tiny families."""
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], object]:
    """hf_model(dir) -> the transformers reference model in float32, eval mode, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: dict[Path, object] = {}

    def load(model_dir: Path) -> object:
        if model_dir not in loaded:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            loaded[model_dir] = model.eval()
        return loaded[model_dir]

    return load
