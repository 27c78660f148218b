"""Where a model's files are: a local directory, or a Hugging Face id, cached or downloaded.

Runs wherever engine arguments become a config (``conveyor serve``'s supervisor, ``LLM``), once,
before any engine starts; every process after this one sees only the resolved directory. An id
such as ``Qwen/Qwen3-0.6B`` is looked up first in the Hugging Face cache (``--download-dir``, else
``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) at the snapshot its
``refs/main`` (or ``--revision``: a branch, tag or commit) names, by huggingface_hub itself with
``local_files_only``: a complete snapshot there is used without touching the network. Otherwise
its serving files (``SERVING_FILES`` and the weights) are downloaded from the Hub by a child
process (``download_model`` starts ``model_download``), unless ``HF_HUB_OFFLINE`` is set, which
keeps to the cache.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from conveyor.protocol.config import ConfigError
from conveyor.protocol.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError
from conveyor.runtime.processes import DOWNLOAD_MODULE, describe_exit, python_command, terminate
from conveyor.runtime.signals import signals_held

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# What the model config, the tokenizer (transformers' AutoTokenizer: fast, sentencepiece or BPE
# files, a chat template kept apart from its config) and the sampling defaults are read from.
SERVING_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    INDEX_FILE,
)
# A PEFT LoRA adapter's files (``--lora-modules``, the run-time route, ``LLM``'s lora_request).
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
# Any of these makes a folder a tokenizer's (``--tokenizer``, which needs no weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Files in subfolders are never the checkpoint conveyor loads (gpt-oss's original/, say).
TOP_LEVEL_ONLY = ("*/*",)
# How long a stopped download may take to delete its partial files.
_STOP_TIMEOUT_S = 5.0
# huggingface_hub's spellings of "on" for its switches.
_TRUE = ("1", "ON", "YES", "TRUE")


class ModelDownloadError(ConfigError):
    """The model cannot be fetched: not on the Hub, gated, no safetensors, no connection."""


def weight_files(snapshot: Path) -> list[str]:
    """The weight files a snapshot needs: those its index names, else every top-level
    ``*.safetensors`` (the loader reads exactly these)."""
    index = snapshot / INDEX_FILE
    if not index.is_file():
        return [p.name for p in snapshot.glob("*.safetensors")]
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    return sorted(set(weight_map.values()))


def missing_files(snapshot: Path, weights: bool = True) -> list[str]:
    """What a cached snapshot still lacks for serving: its config or any of its weights (with
    ``weights=False``, for a tokenizer alone: any tokenizer file)."""
    if not weights:
        has_tokenizer = any((snapshot / name).is_file() for name in TOKENIZER_FILES)
        return [] if has_tokenizer else ["tokenizer files"]
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    try:
        weights = weight_files(snapshot)
    except (OSError, ValueError):
        return [*missing, INDEX_FILE]
    if not weights:
        return [*missing, "*.safetensors"]
    return missing + [name for name in weights if not (snapshot / name).is_file()]


def hub_cache_dir() -> Path:
    """The cache huggingface_hub reads, from the environment as it is now."""
    named = os.environ.get("HF_HUB_CACHE")
    if named:
        return Path(named).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as it is now: the cache only."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def looks_like_repo_id(model: str) -> bool:
    """``org/name`` (or ``name``): not a path someone meant as a directory."""
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model:
        return False
    return all(part and part not in (".", "..") for part in model.split("/"))


def resolve_model(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    *,
    weights: bool = True,
) -> str:
    """A local model directory for ``model``: itself if it is one, else its snapshot in the
    Hugging Face cache (``download_dir`` in place of the default one), downloaded if need be.
    ``weights=False``: a tokenizer's files are enough (``--tokenizer``).

    ConfigError, saying where it looked and what to do, when there is none.
    """
    if Path(model).expanduser().is_dir():
        if revision is not None:
            raise ConfigError(f"--revision {revision} needs a Hugging Face id, not a directory")
        return str(Path(model).expanduser())
    if not looks_like_repo_id(model):
        raise ConfigError(f"model directory not found: {model}")
    cache = Path(download_dir).expanduser() if download_dir else hub_cache_dir()
    cached, missing = _cached_snapshot(model, revision, cache, weights)
    if cached is not None and not missing:
        return cached
    if hub_offline():
        raise ConfigError(_offline_message(model, revision, cache, missing))
    return download_model(model, revision, cache, weights)


def resolve_adapter(path: str, download_dir: str | None = None) -> str:
    """A LoRA adapter's local folder, as vLLM takes them: ``path`` itself if it is a directory
    (made absolute), else a Hugging Face id's snapshot in the cache holding its
    ``ADAPTER_FILES``, downloaded (those two files alone) unless ``HF_HUB_OFFLINE`` is set. A
    path that is neither is returned as it is, for ``read_adapter`` to say what is missing.

    AdapterError when an id is neither cached nor downloadable, saying why. Blocks while it
    downloads: an event loop calls it from a thread.
    """
    folder = Path(path).expanduser()
    if folder.is_dir() or not looks_like_repo_id(path):
        return os.path.abspath(folder)
    cache = Path(download_dir).expanduser() if download_dir else hub_cache_dir()
    try:
        cached: str | None = snapshot_download(
            path, cache_dir=cache, local_files_only=True, allow_patterns=list(ADAPTER_FILES)
        )
    except HFValidationError:
        return os.path.abspath(folder)
    except (LocalEntryNotFoundError, OSError):
        cached = None
    if cached is not None and all((Path(cached) / name).is_file() for name in ADAPTER_FILES):
        return str(cached)
    if hub_offline():
        raise AdapterError(
            f"LoRA adapter {path!r} is not a folder and not in the Hugging Face cache (looked "
            f"for {cache / ('models--' + path.replace('/', '--'))}); HF_HUB_OFFLINE is set, so "
            f"nothing is downloaded: unset it, or run `hf download {path}` where the Hub can be "
            "reached and copy that cache here, or pass the adapter's folder"
        )
    try:
        return download_model(path, None, cache, weights=False, adapter=True)
    except ModelDownloadError as error:
        raise AdapterError(f"LoRA adapter {path!r}: {error}") from None


def _cached_snapshot(
    model: str, revision: str | None, cache: Path, weights: bool
) -> tuple[str | None, list[str]]:
    """The cached snapshot (None if there is none) and what it lacks for serving."""
    try:
        path = snapshot_download(
            model,
            revision=revision,
            cache_dir=cache,
            local_files_only=True,
            allow_patterns=list(SERVING_FILES),
            ignore_patterns=list(TOP_LEVEL_ONLY),
        )
    except HFValidationError as error:
        raise ConfigError(
            f"model {model!r} is neither a directory nor a Hugging Face id: {error}"
        ) from None
    except (LocalEntryNotFoundError, OSError):
        # Not cached, or an interrupted download's snapshot: its tree listing names files that
        # are not there (huggingface_hub checks).
        return None, ["the snapshot"]
    return str(path), missing_files(Path(path), weights)


def _offline_message(model: str, revision: str | None, cache: Path, missing: list[str]) -> str:
    folder = cache / f"models--{model.replace('/', '--')}"
    found = "not in" if missing == ["the snapshot"] else f"incomplete ({', '.join(missing)}) in"
    return (
        f"model {model!r} is not a directory and is {found} the Hugging Face cache (looked for "
        f"{folder}, revision {revision or 'main'}; the cache is --download-dir, else "
        "$HF_HUB_CACHE, else $HF_HOME/hub). HF_HUB_OFFLINE is set, so nothing is downloaded: "
        f"unset it to download the model, or on a machine with network access run `hf download "
        f"{model}` (huggingface_hub's CLI) and copy that cache here, or pass the model's local "
        "directory"
    )


def download_model(
    model: str,
    revision: str | None,
    cache_dir: Path,
    weights: bool = True,
    adapter: bool = False,
) -> str:
    """``model``'s snapshot folder in ``cache_dir``, downloaded by a child process
    (``model_download``, in its own session: a terminal's Ctrl-C reaches this process alone);
    ModelDownloadError saying why where it cannot be. A signal or an exception here (Ctrl-C,
    SIGTERM) stops the child at once, and is raised again."""
    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    logger.info(
        "%s is not in the Hugging Face cache: downloading its %s (revision %s) from %s into %s",
        model,
        "LoRA adapter"
        if adapter
        else "config, tokenizer and safetensors"
        if weights
        else "tokenizer",
        revision or "main",
        endpoint,
        cache_dir,
    )
    args = [model, "--cache-dir", str(cache_dir), "--parent-pid", str(os.getpid())]
    if revision is not None:
        args += ["--revision", revision]
    if adapter:
        args.append("--adapter")
    elif not weights:
        args.append("--no-weights")
    command = python_command(DOWNLOAD_MODULE, args)
    child: subprocess.Popen[bytes] | None = None
    try:
        with signals_held():  # a signal in Popen would lose the handle, and the child with it
            child = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True)
        output, _ = child.communicate()
    except BaseException:
        if child is not None:
            terminate(child, _STOP_TIMEOUT_S)
        raise
    return _read_result(model, output, child.returncode)


def _read_result(model: str, output: bytes, returncode: int) -> str:
    lines = output.decode(errors="replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    if returncode == 0 and "path" in result:
        return str(result["path"])
    if "error" in result:
        raise ModelDownloadError(str(result["error"]))
    raise ModelDownloadError(
        f"downloading {model} failed: the download process {describe_exit(returncode)} "
        "(its log above says why)"
    )
