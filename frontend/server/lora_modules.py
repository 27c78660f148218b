"""LoRA adapters in the HTTP API: ``--lora-modules``, the adapters a request's ``model`` may name,
and vLLM's run-time routes ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Runs in frontend processes (and ``conveyor serve``, which hands the flags down). An adapter is
checked here, where it is named (its folder against the base model and ``--max-lora-rank``): a
bad one is a start-up refusal or a 400 naming what is wrong, and never reaches the engine.

Run-time updates are off unless asked for, as in vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``
or ``--allow-runtime-lora-updating``. Each frontend keeps its own list, so they are refused with
more than one frontend (a load on one would be unknown to the others).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from dataclasses import dataclass, field

import msgspec

from conveyor.frontend.model_source import resolve_adapter
from conveyor.frontend.server.errors import ApiError, bad_request
from conveyor.protocol import EngineConfig
from conveyor.protocol.lora import AdapterError, LoRARequest, read_adapter

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
        if not isinstance(value, dict) or not {"name", "path"} <= value.keys():
            raise argparse.ArgumentTypeError('the JSON form needs "name" and "path"')
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown keys {sorted(unknown)}")
        return LoRAModule(str(value["name"]), str(value["path"]), value.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return LoRAModule(name, path)


def add_lora_module_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served from the start (with --enable-lora), each name=path (a folder "
        "or a Hugging Face id) or "
        'vLLM\'s JSON {"name": ..., "path": ..., "base_model_name": ...}; a request\'s model '
        "names one",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=None,
        help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM with "
        f"{RUNTIME_UPDATES_ENV}=true; one frontend only)",
    )


def lora_module_options(args: argparse.Namespace) -> list[str]:
    """The flags ``conveyor serve`` hands its frontends."""
    options: list[str] = []
    if args.lora_modules:
        options.append("--lora-modules")
        for module in args.lora_modules:
            options.append(json.dumps(msgspec.to_builtins(module)))
    if args.allow_runtime_lora_updating:
        options.append("--allow-runtime-lora-updating")
    return options


def runtime_updates_allowed(flag: bool | None) -> bool:
    return bool(flag) or os.environ.get(RUNTIME_UPDATES_ENV, "").lower() in ("1", "true")


@dataclass
class LoRARegistry:
    """The adapters requests may name, by name; ``parent``: the model they adapt."""

    config: EngineConfig
    parent: str
    runtime_updates: bool = False
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    # An adapter's own parent name (vLLM's base_model_name of --lora-modules' JSON form).
    parents: dict[str, str] = field(default_factory=dict)
    _next_id: int = 1
    # The run-time route adds from a thread (a Hugging Face id may download).
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def parent_of(self, name: str) -> str:
        return self.parents.get(name, self.parent)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter and serve it; AdapterError says why it cannot be. ``path``: a
        folder, or a Hugging Face id (from the cache, else downloaded: this call blocks)."""
        lora = self.config.lora
        if lora is None:
            raise AdapterError("this server serves no LoRA adapters (start it with --enable-lora)")
        if not name:
            raise AdapterError("an adapter needs a name")
        folder = resolve_adapter(path)
        read_adapter(folder, self.config.model.model, lora.max_lora_rank)
        with self._lock:
            request = LoRARequest(name, self._next_id, folder)
            self._next_id += 1
            self.adapters[name] = request
            self.parents.pop(name, None)
            if base_model_name:
                self.parents[name] = base_model_name
        return request

    def get(self, model: str | None) -> LoRARequest | None:
        return self.adapters.get(model) if model is not None else None


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    # vLLM's: load it again even if the name is served (the folder may have changed).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


def load_adapter(registry: LoRARegistry, body: LoadLoRAAdapterRequest) -> str:
    _check_runtime(registry)
    if body.lora_name in registry.adapters and not body.load_inplace:
        raise bad_request(
            f"the LoRA adapter {body.lora_name!r} is already loaded (load_inplace: true to "
            "load it again)",
            "lora_name",
        )
    try:
        registry.add(body.lora_name, body.lora_path)
    except AdapterError as error:
        raise bad_request(str(error), "lora_path") from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


def unload_adapter(registry: LoRARegistry, body: UnloadLoRAAdapterRequest) -> str:
    _check_runtime(registry)
    if body.lora_name not in registry.adapters:
        raise ApiError(404, f"the LoRA adapter {body.lora_name!r} is not loaded", "lora_name")
    # Requests already running under it finish under it: they hold their own LoRARequest.
    del registry.adapters[body.lora_name]
    registry.parents.pop(body.lora_name, None)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def _check_runtime(registry: LoRARegistry) -> None:
    if not registry.runtime_updates:
        raise ApiError(
            404,
            f"run-time LoRA updates are off: set {RUNTIME_UPDATES_ENV}=true or start with "
            "--allow-runtime-lora-updating (and --enable-lora)",
        )
