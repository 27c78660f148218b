"""Where a model's files are: a local directory, or a Hugging Face id found in the local cache.

Runs wherever engine arguments become a config (``conveyor serve``, ``LLM``). Nothing is ever
downloaded: an id such as ``Qwen/Qwen3-0.6B`` is looked up in the Hugging Face cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), at the snapshot its
``refs/main`` (or ``--revision``: a branch, tag or commit) names, by huggingface_hub itself with
``local_files_only``. Every process after this one sees only the resolved directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from conveyor.protocol.config import ConfigError


def hub_cache_dir() -> Path:
    """The cache huggingface_hub reads, from the environment as it is now."""
    named = os.environ.get("HF_HUB_CACHE")
    if named:
        return Path(named).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def looks_like_repo_id(model: str) -> bool:
    """``org/name`` (or ``name``): not a path someone meant as a directory."""
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model:
        return False
    return all(part and part not in (".", "..") for part in model.split("/"))


def resolve_model(model: str, revision: str | None = None) -> str:
    """A local model directory for ``model``: itself if it is one, else its cached snapshot.

    ConfigError, saying where it looked and how to put the model there, when neither exists.
    """
    if Path(model).expanduser().is_dir():
        if revision is not None:
            raise ConfigError(f"--revision {revision} needs a Hugging Face id, not a directory")
        return str(Path(model).expanduser())
    if not looks_like_repo_id(model):
        raise ConfigError(f"model directory not found: {model}")
    cache = hub_cache_dir()
    try:
        return snapshot_download(model, revision=revision, cache_dir=cache, local_files_only=True)  # type: ignore[return-value]
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        folder = cache / f"models--{model.replace('/', '--')}"
        raise ConfigError(
            f"model {model!r} is not a directory and not in the local Hugging Face cache (looked "
            f"for {folder}, revision {revision or 'main'}; the cache is $HF_HUB_CACHE, else "
            "$HF_HOME/hub). conveyor downloads nothing: on a machine with network access run "
            f"`hf download {model}` (huggingface_hub's CLI) and copy that cache here, or pass "
            "the model's local directory"
        ) from None
