"""The draft model of ``--speculative-config '{"method": "draft_model", "model": ...}'``, checked
at start-up against the target it drafts for.

Runs wherever the engine configuration is built (the supervisor, ``LLM``), before any engine
process starts: a draft that cannot work is refused here with both models named, never found
out by a worker mid-load or, worse, by drafts that are all rejected.
"""

from __future__ import annotations

import msgspec

from conveyor.protocol.config import (
    CHECKPOINT_QUANTIZATIONS,
    LOAD_TIME_QUANTIZATIONS,
    QUANTIZATION_METHODS,
    ConfigError,
    ModelConfig,
    load_model_config,
)
from conveyor.protocol.speculative import SpeculativeConfig


def resolve_draft(
    spec: SpeculativeConfig | None, target: ModelConfig, draft_dir: str | None, device: str
) -> SpeculativeConfig | None:
    """``spec`` with its draft's local directory (``draft_dir``, already resolved from a path or
    a Hugging Face id), checked: the same vocabulary as the target, a context at least the
    target's, weights in a format the loader reads on ``device``."""
    if spec is None or spec.method != "draft_model":
        return spec
    assert draft_dir is not None
    draft = load_model_config(draft_dir, target.dtype)
    name = f"the draft model {spec.model} ({draft.model})"
    if draft.vocab_size != target.vocab_size:
        # Draft and target token ids must mean the same tokens: a draft from another
        # vocabulary proposes ids the target reads as other text.
        raise ConfigError(
            f"--speculative-config: {name} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target.model} has {target.vocab_size}; a draft model must share the "
            "target's tokenizer"
        )
    if draft.max_model_len < target.max_model_len:
        raise ConfigError(
            f"--speculative-config: {name} reads at most {draft.max_model_len} tokens, fewer "
            f"than max_model_len {target.max_model_len} of the target {target.model}; lower "
            "--max-model-len"
        )
    _check_draft_quantization(spec.quantization, draft.checkpoint_quantization, name, device)
    return msgspec.structs.replace(spec, model=draft.model)


def _check_draft_quantization(
    quantization: str | None, checkpoint: str | None, name: str, device: str
) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ConfigError(
            f"--speculative-config: quantization must be one of "
            f"{', '.join(QUANTIZATION_METHODS)}, got {quantization!r}"
        )
    if quantization in CHECKPOINT_QUANTIZATIONS and quantization != checkpoint:
        raise ConfigError(
            f"--speculative-config: quantization {quantization!r}, but {name} is "
            f"{f'{checkpoint}-quantized' if checkpoint else 'not quantized'}"
        )
    if quantization in LOAD_TIME_QUANTIZATIONS:
        if checkpoint is not None:
            raise ConfigError(
                f"--speculative-config: quantization {quantization!r} quantizes a float "
                f"checkpoint at load; {name} is already {checkpoint}-quantized"
            )
        if device not in ("cpu", "auto"):
            raise ConfigError(
                f"--speculative-config: quantization {quantization!r} runs on CPU only, not "
                f"{device!r}"
            )
