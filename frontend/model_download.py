"""The child process that downloads a model's serving files from the Hugging Face Hub.

    python -P -m conveyor.frontend.model_download ORG/NAME [--revision R] --cache-dir DIR

Started by ``model_source.download_model`` in whichever process resolves a model id that is not
cached yet (the supervisor of ``conveyor serve``, an ``LLM`` caller), once, before any engine
starts. A process of its own because huggingface_hub downloads on a pool of threads that Python
waits for at exit: a Ctrl-C or SIGTERM in the caller's process would wait for every file in
flight to finish. This process stops at once instead, and removes its partial files first.

Only what serving reads is fetched (``model_source.SERVING_FILES`` and the safetensors weights:
the shards the index names, when there is one), never the PyTorch ``.bin`` copies, the
repository's subfolders (``original/`` and the like) or its other files. huggingface_hub does
the work: its progress bars on stderr (on a terminal; ``HF_HUB_DISABLE_PROGRESS_BARS=1`` turns
them off), a connection cut mid-file resumed with a Range request, files finished by an earlier
attempt kept, ``HF_ENDPOINT`` and ``HF_TOKEN`` read from the environment (never from the
command line, which every local user can read). The result is one JSON line on stdout:
``{"path": ...}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from conveyor.frontend.model_source import (
    ADAPTER_FILES,
    INDEX_FILE,
    SERVING_FILES,
    TOP_LEVEL_ONLY,
    ModelDownloadError,
    missing_files,
    weight_files,
)
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.logs import configure_logging
from conveyor.runtime.parent import tie_to_parent
from conveyor.runtime.processes import DOWNLOAD_MODULE

# Named, not __name__: this module runs as __main__.
logger = logging.getLogger("conveyor.frontend.model_download")


def fetch_adapter(model: str, revision: str | None, cache_dir: str) -> str:
    """A PEFT LoRA adapter's two files (``ADAPTER_FILES``) into ``cache_dir``; the snapshot."""
    from huggingface_hub import snapshot_download

    path = snapshot_download(
        model, revision=revision, cache_dir=cache_dir, allow_patterns=list(ADAPTER_FILES)
    )
    missing = [name for name in ADAPTER_FILES if not (Path(path) / name).is_file()]
    if missing:
        raise ModelDownloadError(
            f"{model} (revision {revision or 'main'}) has no {' or '.join(missing)}: not a PEFT "
            "LoRA adapter"
        )
    return path


def fetch(model: str, revision: str | None, cache_dir: str, weights: bool = True) -> str:
    """Download ``model``'s serving files into ``cache_dir``; the snapshot folder.

    First the small files at ``revision`` (which also records the branch or tag in the cache's
    refs), then the weights at the commit those came from, so both halves are one commit even if
    the branch moves meanwhile. ``weights=False``: the small files alone (a tokenizer).
    """
    from huggingface_hub import snapshot_download

    first = snapshot_download(
        model,
        revision=revision,
        cache_dir=cache_dir,
        allow_patterns=list(SERVING_FILES),
        ignore_patterns=list(TOP_LEVEL_ONLY),
    )
    snapshot = Path(first)
    if not weights:
        if missing_files(snapshot, weights=False):
            raise ModelDownloadError(f"{model} (revision {revision or 'main'}) has no tokenizer")
        return first
    if not (snapshot / "config.json").is_file():
        raise ModelDownloadError(
            f"{model} (revision {revision or 'main'}) has no config.json: not a Hugging Face "
            "transformers model"
        )
    has_index = (snapshot / INDEX_FILE).is_file()
    patterns = weight_files(snapshot) if has_index else ["*.safetensors"]
    path = snapshot_download(
        model,
        revision=snapshot.name,
        cache_dir=cache_dir,
        allow_patterns=patterns,
        ignore_patterns=list(TOP_LEVEL_ONLY),
    )
    if not weight_files(Path(path)):
        raise ModelDownloadError(
            f"{model} (revision {revision or 'main'}) has no *.safetensors weights at its top "
            "level; conveyor loads safetensors only (PyTorch .bin checkpoints are not supported)"
        )
    return path


def describe_failure(model: str, revision: str | None, error: Exception) -> str:
    """What went wrong, in the words a user acts on."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = constants.ENDPOINT
    if isinstance(error, GatedRepoError):
        return (
            f"{model} is gated on {hub}: accept its terms on its page there and set HF_TOKEN to a "
            "token of that account"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"{model} was not found on {hub} (a private model needs HF_TOKEN; HF_ENDPOINT "
            "names another hub)"
        )
    if isinstance(error, RevisionNotFoundError):
        return f"{model} has no revision {revision!r} on {hub}"
    if isinstance(error, LocalEntryNotFoundError):
        # huggingface_hub's word for "the Hub could not be reached and nothing is cached".
        return (
            f"could not download {model} from {hub} ({_first_line(error.__cause__ or error)}): "
            "check the network (HF_ENDPOINT names a mirror), or run `hf download "
            f"{model}` where the Hub can be reached and copy that cache here"
        )
    return f"downloading {model} from {hub} failed: {type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _size_of(snapshot: Path) -> int:
    return sum(p.stat().st_size for p in snapshot.iterdir() if p.is_file())


def _remove_own_partial_files() -> None:
    """Delete the files this process is writing (huggingface_hub's ``*.incomplete``): each has
    a name of its own that no later download takes up, so a stopped one would stay forever."""
    fd_dir = Path("/proc/self/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.endswith(".incomplete"):
                    os.unlink(target)


def _stop_now(signum: int, frame: object) -> None:
    # Not an exception: the main thread would then wait for the download threads at exit.
    _remove_own_partial_files()
    os._exit(128 + signum)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m " + DOWNLOAD_MODULE, description=__doc__)
    parser.add_argument("model", help="a Hugging Face id, org/name")
    parser.add_argument("--revision", default=None, help="a branch, tag or commit (default main)")
    parser.add_argument("--cache-dir", required=True, help="the Hugging Face cache to fill")
    parser.add_argument("--no-weights", action="store_true", help="a tokenizer: no weights")
    parser.add_argument("--adapter", action="store_true", help="a PEFT LoRA adapter's files")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it dies")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    configure_logging("download")
    for name in ("httpx", "httpx2"):  # a line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _stop_now)
    signal.signal(signal.SIGINT, _stop_now)
    tie_to_parent(args.parent_pid)
    start = time.monotonic()
    try:
        if args.adapter:
            path = fetch_adapter(args.model, args.revision, args.cache_dir)
        else:
            path = fetch(args.model, args.revision, args.cache_dir, weights=not args.no_weights)
    except Exception as error:  # every failure is reported to the caller, as a sentence
        if isinstance(error, ModelDownloadError):
            message = str(error)
        else:
            message = describe_failure(args.model, args.revision, error)
        print(json.dumps({"error": message}), flush=True)
        return ExitCode.BAD_CONFIG
    logger.info(
        "downloaded %s (commit %s): %.1f MB in %.1f s",
        args.model,
        Path(path).name,
        _size_of(Path(path)) / 1e6,
        time.monotonic() - start,
    )
    print(json.dumps({"path": path}), flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
