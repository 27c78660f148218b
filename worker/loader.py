"""Build one of our models from a local Hugging Face model directory.

Runs in worker processes. The directory holds config.json and the weights as one
model.safetensors or several shards named in model.safetensors.index.json. Nothing is fetched
from the network. Weights stream one tensor at a time from disk into the parameters already on the
device, so peak host memory is one tensor, not the model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from conveyor.worker.layers import quantization as formats
from conveyor.worker.layers.int8_linear import quantize_model
from conveyor.worker.layers.quantization import loading as quantized_loading
from conveyor.worker.layers.quantization.int4_at_load import quantize_model_int4
from conveyor.worker.models.decoder import DecoderForCausalLM
from conveyor.worker.models.registry import UnsupportedArchitectureError, model_class_for

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
INDEX_FILE = "model.safetensors.index.json"


class ModelLoadError(ValueError):
    """The model directory cannot be loaded; the message says why and names the files or tensors."""


def resolve_dtype(
    name: str, device: torch.device | str, model_dir: str | os.PathLike[str] | None = None
) -> torch.dtype:
    """A dtype name ("auto", "bfloat16", "fp32", ...) -> torch dtype.

    "auto" is float32 on CPU (CPU kernels for half types are slow and less exact); on CUDA it is
    the checkpoint's own dtype from config.json, except that float32 checkpoints run in bfloat16.
    """
    if name != "auto":
        if name not in DTYPES:
            raise ModelLoadError(f"unknown dtype {name!r}; use auto or one of {', '.join(DTYPES)}")
        return DTYPES[name]
    if torch.device(device).type == "cpu":
        return torch.float32
    config_dtype = None
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config_dtype = config.get("dtype") or config.get("torch_dtype")
    resolved = DTYPES.get(str(config_dtype), torch.bfloat16)
    return torch.bfloat16 if resolved == torch.float32 else resolved


def load_model(
    model_dir: str | os.PathLike[str],
    dtype: torch.dtype,
    device: torch.device | str,
    tp_rank: int = 0,
    tp_size: int = 1,
    quantization: str | None = None,
) -> DecoderForCausalLM:
    """Build the model named by config.json on ``device`` in ``dtype`` and load its weights;
    a quantized checkpoint (config.json's quantization_config) loads in its own format, which
    ``quantization`` may name to check it; "int8" / "int4" turn a float checkpoint's linears'
    weights into that (CPU only)."""
    path = Path(model_dir)
    config = read_config_json(path)
    try:
        fmt = formats.checkpoint_format(config, quantization)
    except formats.UnsupportedQuantization as error:
        raise ModelLoadError(f"{path}: {error}") from error
    made_at_load = None if fmt is not None else quantization
    if made_at_load is not None and torch.device(device).type != "cpu":
        raise ModelLoadError(f"--quantization {made_at_load} runs on CPU only, not {device}")
    model_class = _model_class(config)
    hf_config = read_hf_config(path)
    files = safetensors_files(path)
    try:
        with torch.device(device), _default_dtype(dtype):
            model = model_class(hf_config, tp_rank=tp_rank, tp_size=tp_size)
        weights = iterate_tensors(files)
        if fmt is not None:
            quantized = quantized_loading.quantized_modules(fmt, tensor_names(files))
            quantized_loading.prepare_model(model, fmt, quantized)
            weights = quantized_loading.translate_tensors(fmt, quantized, weights)
        loaded = model.load_weights(weights)
    except ValueError as error:  # an unsupported setting, a tensor that does not fit
        raise ModelLoadError(f"{path}: {error}") from error
    _check_complete(model, loaded, files)
    if made_at_load is not None:  # before the packed copies are made: a quantized layer has none
        try:
            if made_at_load == "int4":
                quantize_model_int4(model)
            else:
                quantize_model(model, made_at_load)
        except ValueError as error:
            raise ModelLoadError(f"{path}: {error}") from error
    model.process_weights_after_loading()
    return model.eval().requires_grad_(False)


def read_config_json(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from error


def read_hf_config(path: Path) -> Any:
    """config.json as a transformers config object, read from the directory only."""
    from transformers import AutoConfig  # heavy; only the worker needs it

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as error:
        raise ModelLoadError(f"{path}/config.json cannot be read: {error}") from error


def _model_class(config: dict[str, Any]) -> type[DecoderForCausalLM]:
    architectures = config.get("architectures") or []
    if not architectures:
        raise ModelLoadError("config.json names no architecture")
    try:
        return model_class_for(architectures[0])
    except UnsupportedArchitectureError as error:
        raise ModelLoadError(str(error)) from error


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the index names if there is one, else every *.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names shards that are not there: {', '.join(absent)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)"
        )
    return files


def tensor_names(files: list[Path]) -> list[str]:
    names = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def iterate_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _check_complete(model: DecoderForCausalLM, loaded: set[str], files: list[Path]) -> None:
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if not missing:
        return
    present: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            present.update(f.keys())
    absent = sorted(
        {ckpt for name in missing for ckpt in model.checkpoint_names(name) if ckpt not in present}
    )
    shown = ", ".join(absent[:10]) + (f" and {len(absent) - 10} more" if len(absent) > 10 else "")
    raise ModelLoadError(f"{files[0].parent}: checkpoint is missing tensors: {shown}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created directly in the target dtype: no float32 copy of the model first.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
