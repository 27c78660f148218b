"""Train the small Qwen3 model that conveyor ships as its default, on the stdlib's own source.

    python scripts/train_default_model.py --out DIR [--steps N] [--seed S]

Why: a random-weight model serves gibberish, so a demo of `conveyor serve` shows nothing. A few
million parameters trained for minutes on Python source write text that looks like Python
(indentation, keywords, identifiers), which is enough to see that serving works.

The training text is the CPython standard library of the running interpreter, so nothing is
downloaded, with docstrings and comments removed and the code re-printed by `ast.unparse`: prose
is the hardest text to learn and takes a third of the tokens, and one consistent layout is learnt
faster than a hundred authors' styles, so in the same minutes the model writes better-formed code.
The output directory looks exactly like the ones benchmarks/fixtures/model_maker.py generates
(same config keys, tokenizer files, special tokens and ChatML template), so conveyor's loader and
transformers' Auto classes load it the same way. The run is deterministic: fixed seeds, file
selection, data order and thread count, so two runs on the same machine with the same library
versions write byte-identical files. The default run takes about 7 minutes on 2 CPU cores
(AMD EPYC, Zen 3), longer on a busy machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import re
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.fixtures.model_maker import MAX_POSITION_EMBEDDINGS, model_config
from benchmarks.fixtures.tokenizer_maker import ENDOFTEXT, IM_END, write_tokenizer

# About 2.4M parameters, trained at about 4,500 tokens/s on 2 Zen 3 cores in float32 (bfloat16
# autocast is over 20 times slower there: no native bfloat16 arithmetic). The MLP is twice the
# hidden size rather than the usual three times because it dominates the step time (4.2M
# parameters with hidden 256 and MLP 768 train at 2,500 tokens/s); a 4,096-token vocabulary keeps
# the tied embedding to a third of the parameters.
MODEL_DIMS: dict[str, int] = dict(
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    intermediate_size=512,
    vocab_size=4096,
)
SEQ_LEN = 256
# The time budget limits tokens, not steps. In pilots of 600k tokens, 4 sequences a step (twice
# the steps of 8) gave a lower validation loss at the same speed; 2 a step is a quarter slower.
BATCH_SIZE = 4
# One pass over Python 3.11's 1.73M training tokens: about 6 minutes at the speed above.
DEFAULT_STEPS = 1680
# Pilots on unstripped source, validation loss after 1.3M tokens at batch 4: peak 3e-3 4.22,
# 1.5e-3 4.07, 1e-3 4.04; after 600k tokens at batch 8: 3e-3 5.25, 1.5e-3 5.08, 7.5e-4 5.16.
PEAK_LR = 1.5e-3
MIN_LR_RATIO = 0.1
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
NUM_THREADS = 2
REPETITION_PENALTY = 1.3
LOG_EVERY = 50
NUM_EVALS = 4  # validation passes over the run, the last one at the end

# Test suites and tool directories are not the Python we want imitated; encodings/ is codec
# tables, pydoc_data/ is prose, and lib2to3 parses Python 2.
EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "encodings",
        "pydoc_data",
        "site-packages",
        "ensurepip",
        "__phello__",
    }
)
# After stripping, Python 3.11's selection is 5.3M characters; the cap keeps a larger stdlib
# from costing tokenization time for text that a default run would never reach.
MAX_CORPUS_CHARS = 8_000_000
HOLDOUT_EVERY = 40  # every 40th file, in sorted order, is validation only
MAX_VAL_WINDOWS = 64
# Where a line's text ends and its line break (or run of blank lines) begins.
LINE_END = re.compile(r"(?<=[^\n])(?=\n)")
SPLIT_LINE_END_PROBABILITY = 0.5
DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_files() -> list[Path]:
    """The standard-library .py files we train on, in a fixed (sorted) order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    relative_paths = sorted(path.relative_to(stdlib).as_posix() for path in stdlib.rglob("*.py"))
    return [stdlib / name for name in relative_paths if _is_training_source(Path(name))]


def _is_training_source(relative: Path) -> bool:
    directories = relative.parts[:-1]
    if EXCLUDED_DIRS.intersection(directories):
        return False
    # The build's own files (config-3.11-x86_64-linux-gnu/, _sysconfigdata*.py), and tests that
    # live beside the code they test.
    if directories and directories[0].startswith("config-"):
        return False
    return not relative.name.startswith(("_sysconfigdata", "test_"))


def code_only(source: str) -> str:
    """The module without docstrings and comments, laid out by ``ast.unparse``."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, DOCUMENTED_NODES) and node.body and _is_docstring(node.body[0]):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def split_corpus(files: list[Path]) -> tuple[list[str], list[str]]:
    """(training texts, validation texts), the total capped at MAX_CORPUS_CHARS."""
    train: list[str] = []
    val: list[str] = []
    total = 0
    for index, path in enumerate(files):
        try:
            text = code_only(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:  # not Python this interpreter parses; none in 3.11's selection
            continue
        if total + len(text) > MAX_CORPUS_CHARS:
            break
        total += len(text)
        (val if index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).append(text)
    return train, val


def split_at_line_ends(text: str, rng: random.Random) -> list[str]:
    """The text in pieces, cut before about half of its line breaks.

    The tokenizer merges punctuation with the newline after it ("():\n" is one token), so in
    whole files the tokens of a prompt that ends a line, like "def main():", are never followed
    by a newline token, and a model trained on whole files continues such a prompt with garbage.
    Encoding pieces separately puts "()", ":", "\n" in the training text as that prompt needs
    them; the uncut half keeps the merged form that longer prompts contain.
    """
    pieces = LINE_END.split(text)
    merged = [pieces[0]]
    for piece in pieces[1:]:
        if rng.random() < SPLIT_LINE_END_PROBABILITY:
            merged.append(piece)
        else:
            merged[-1] += piece
    return merged


def token_windows(tokenizer: Tokenizer, texts: list[str], seed: int) -> torch.Tensor:
    """The texts as one token stream, files separated by <|endoftext|>, cut into SEQ_LEN rows."""
    rng = random.Random(seed)
    # One batch call for every piece of every file: the tokenizer parallelises within a call.
    pieces = [split_at_line_ends(text, rng) + [ENDOFTEXT] for text in texts]
    encodings = tokenizer.encode_batch([piece for file in pieces for piece in file])
    stream = [token_id for encoding in encodings for token_id in encoding.ids]
    num_windows = len(stream) // SEQ_LEN
    return torch.tensor(stream[: num_windows * SEQ_LEN]).view(num_windows, SEQ_LEN)


def batches(windows: torch.Tensor, seed: int) -> Iterator[torch.Tensor]:
    """Batches of shuffled windows, forever; each pass over the data is a new permutation."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=generator)
        for start in range(0, len(order) - BATCH_SIZE + 1, BATCH_SIZE):
            yield windows[order[start : start + BATCH_SIZE]]


def build_config() -> dict[str, Any]:
    # The generated "small" model's config.json with our shape, so every other key matches the
    # models the repo makes. The weights are stored in bfloat16 (half the file); conveyor's
    # loader copies them into float32 parameters on CPU.
    return {**model_config("small", "qwen3"), **MODEL_DIMS, "torch_dtype": "bfloat16"}


def lr_factor(step: int, num_steps: int) -> float:
    """Linear warmup, then cosine decay to MIN_LR_RATIO of the peak."""
    warmup = max(1, round(WARMUP_FRACTION * num_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    # No weight decay on norms: pulling their gains toward 0 only fights the training signal.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8, fused=True)


@torch.no_grad()
def validation_loss(model: Qwen3ForCausalLM, windows: torch.Tensor) -> float:
    model.eval()
    losses = [
        model(input_ids=batch, labels=batch).loss.item() for batch in windows.split(BATCH_SIZE)
    ]
    model.train()
    return sum(losses) / len(losses)


def train(
    model: Qwen3ForCausalLM,
    train_windows: torch.Tensor,
    val_windows: torch.Tensor,
    num_steps: int,
    seed: int,
) -> None:
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, num_steps))
    eval_steps = {round(num_steps * (i + 1) / NUM_EVALS) for i in range(NUM_EVALS)}
    model.train()
    start = time.perf_counter()
    recent_losses: list[float] = []
    for step, batch in enumerate(batches(train_windows, seed), start=1):
        loss = model(input_ids=batch, labels=batch).loss
        recent_losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        elapsed = time.perf_counter() - start
        if step % LOG_EVERY == 0 or step == num_steps:
            tokens_per_s = step * BATCH_SIZE * SEQ_LEN / elapsed
            print(
                f"step {step:5d}/{num_steps}  loss {sum(recent_losses) / len(recent_losses):.3f}  "
                f"lr {scheduler.get_last_lr()[0]:.2e}  {tokens_per_s:,.0f} tok/s  {elapsed:.0f}s",
                flush=True,
            )
            recent_losses.clear()
        if step in eval_steps:
            val_loss = validation_loss(model, val_windows)
            print(f"step {step:5d}/{num_steps}  validation loss {val_loss:.3f}", flush=True)
        if step == num_steps:
            return


def round_to_bfloat16(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """The weights as stored, under Hugging Face names; the model keeps the rounded values."""
    tensors = {}
    # named_parameters() lists the tied head once, as the embedding, as the generated models do.
    for name, param in model.named_parameters():
        tensors[name] = param.detach().to(torch.bfloat16).contiguous()
        param.data.copy_(tensors[name])
    return tensors


def write_model_files(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"], config["bos_token_id"]],
        "pad_token_id": config["bos_token_id"],
        # The model's own advice: this small, greedy decoding loops on one name ("import os" ten
        # times, "name, name, name"); 1.3 breaks the loops and keeps the code well formed.
        "repetition_penalty": REPETITION_PENALTY,
    }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_tokenizer_files(out: Path, config: dict[str, Any]) -> Tokenizer:
    special_ids = write_tokenizer(out, config["vocab_size"], MAX_POSITION_EMBEDDINGS)
    expected = (config["bos_token_id"], config["eos_token_id"])
    if (special_ids[ENDOFTEXT], special_ids[IM_END]) != expected:
        raise RuntimeError(f"unexpected special token ids {special_ids}")
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def make_deterministic(seed: int) -> None:
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def build(out: Path, num_steps: int, seed: int) -> None:
    make_deterministic(seed)
    config = build_config()
    tokenizer = write_tokenizer_files(out, config)
    train_texts, val_texts = split_corpus(stdlib_files())
    train_windows = token_windows(tokenizer, train_texts, seed)
    val_windows = token_windows(tokenizer, val_texts, seed)[:MAX_VAL_WINDOWS]
    print(
        f"corpus: {len(train_texts)} training files ({train_windows.numel():,} tokens), "
        f"{len(val_texts)} validation files ({val_windows.numel():,} tokens evaluated)"
    )
    model = Qwen3ForCausalLM(Qwen3Config(**config, attn_implementation="sdpa"))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters; {num_steps} steps of {BATCH_SIZE} x {SEQ_LEN}")
    train(model, train_windows, val_windows, num_steps, seed)
    tensors = round_to_bfloat16(model)
    print(f"validation loss with bfloat16 weights {validation_loss(model, val_windows):.3f}")
    write_model_files(out, config, tensors)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python scripts/train_default_model.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to create")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"{args.out} exists and is not an empty directory")
    start = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so a failed run leaves no half model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        build(tmp, args.steps, args.seed)
        # mkdtemp made it private; the package data must be readable by whoever installs it.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if args.out.exists():
            args.out.rmdir()
        os.rename(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB) in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
