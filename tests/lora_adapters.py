"""PEFT adapters for the tests, made by PEFT itself on the tiny random-weight models.

Runs in the test process. ``make_adapter`` wraps the base model with ``get_peft_model``, gives
every A and B seeded random values (PEFT would start B at zero: an adapter that changes nothing
would prove nothing) and saves it with ``save_pretrained``; ``PeftReference`` is transformers +
PEFT generating greedily with it, the reference our engine must match.
"""

from __future__ import annotations

from pathlib import Path

import torch

# B's scale: large enough that greedy continuations change, small enough to stay O(1).
B_STD = 0.25


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    rank: int,
    targets: list[str],
    seed: int,
    alpha: int | None = None,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter of the model in ``out_dir`` (made once; returned if already there)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out_dir / "adapter_model.safetensors").is_file():
        return out_dir
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=targets,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * B_STD)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """transformers (+ PEFT when ``adapter_dir`` is given) greedy tokens, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    tokens = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=num_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens
