"""Train the byte-level BPE tokenizer of our generated test models, from text every machine has.

Runs wherever a test model is generated (tests, conveyor make-model). The corpus is the source
of a fixed list of CPython standard-library modules, read from this interpreter's own stdlib, so
no download is needed and the result is the same every time on a machine. Training takes about a
second. Byte-level BPE covers every string, so any text round-trips.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Prose first (the pydoc topics are the language reference), then code. These files change only
# between Python releases.
CORPUS_MODULES = (
    "pydoc_data/topics.py",
    "argparse.py",
    "textwrap.py",
    "difflib.py",
    "functools.py",
    "dataclasses.py",
    "collections/__init__.py",
    "inspect.py",
    "typing.py",
)

# Qwen2's pre-tokenizer split (words, single digits, punctuation runs, newlines). Using Qwen's
# exact pipeline means transformers encodes the same way whichever tokenizer class it picks (for
# model_type "qwen2" it builds its own Qwen2 pipeline rather than reading tokenizer.json's).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen uses it: <|im_start|>role\ncontent<|im_end|>\n per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (stdlib / name).read_text(encoding="utf-8")
        for name in CORPUS_MODULES
        if (stdlib / name).is_file()
    ]
    if sum(map(len, texts)) < 200_000:
        raise RuntimeError(f"too little standard-library source under {stdlib} to train on")
    return texts


def train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids, specials first (0, 1, 2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}: corpus too small"
        )
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int, max_length: int) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return special ids."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    added_tokens = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in special_ids.items()
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map)
    return special_ids


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
