"""Greedy parity with Hugging Face transformers, on the same weights, for every model family.

The engine runs a whole batch at once (mixed prompt lengths, chunked prefill, prefix-cache hits,
preemption under a tiny KV pool); HF ``generate`` runs one prompt at a time. The tokens must be
identical and the logprobs within 1e-4 of HF's ``log_softmax(logits)``. The one allowed
difference is a near tie: where HF's top-2 logits are closer than float error at the first
differing position, argmax may go either way; the test then says so (a ``NearTieWarning`` naming
the model, prompt and position) instead of failing or skipping silently.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from conveyor.frontend import LLM
from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR
from conveyor.protocol import SamplingParams
from tests.devices import MODEL_TEST_DTYPE, logprob_tolerance

ARCHS = ("qwen3", "qwen2", "llama")
NUM_NEW_TOKENS = 32
LOGPROB_TOLERANCE = logprob_tolerance(MODEL_TEST_DTYPE)
TIE_GAP = 1e-4
BLOCK_SIZE = 16
# Prompts 4, 5 and 6 share their first 40 tokens (two full blocks): prefix-cache candidates.
PROMPT_LENGTHS = (5, 9, 17, 30, 44, 52, 60, 23)
SHARED_PREFIX = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)
SMALL_KV = 32 << 20


class NearTieWarning(UserWarning):
    """Our greedy token differs from HF's where HF's top two logits (nearly) tie."""


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(1234)
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    for i in (5, 6):
        prompts[i][:SHARED_PREFIX] = prompts[4][:SHARED_PREFIX]
    return prompts


class Reference:
    """HF greedy tokens and raw logits per prompt, computed once per model family."""

    def __init__(self, model_dir: Path, model, make_cache=None) -> None:
        """``make_cache``: a fresh transformers cache per prompt, for a reference whose keys and
        values pass through it (None: generate's own)."""
        self.model_dir = model_dir
        self.config = json.loads((model_dir / "config.json").read_text())
        self.prompts = _prompts(self.config["vocab_size"])
        # ignore_eos on our side: HF must not stop at EOS either. That takes eos_token_id=None as
        # an argument to generate: a None in the config means "the model's default" there.
        generation_config = copy.deepcopy(model.generation_config)
        # Plain greedy: a repetition penalty the model's own config recommends is not applied.
        generation_config.repetition_penalty = 1.0
        self.tokens: list[list[int]] = []
        self.logits: list[torch.Tensor] = []
        with torch.inference_mode():
            for prompt in self.prompts:
                out = model.generate(
                    torch.tensor([prompt]),
                    generation_config=generation_config,
                    max_new_tokens=NUM_NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                    **({} if make_cache is None else {"cache": make_cache()}),
                )
                self.tokens.append(out.sequences[0, len(prompt) :].tolist())
                self.logits.append(torch.cat(out.logits).float())

    def kv_bytes_per_block(self) -> int:
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * BLOCK_SIZE * 4


_REFERENCES: dict[Path, Reference] = {}


def _reference(model_dir: Path, hf_model) -> Reference:
    if model_dir not in _REFERENCES:
        _REFERENCES[model_dir] = Reference(model_dir, hf_model(model_dir))
    return _REFERENCES[model_dir]


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tiny_model_dirs, hf_model) -> Reference:
    return _reference(tiny_model_dirs[request.param], hf_model)


@pytest.fixture(scope="module")
def qwen3_reference(tiny_model_dirs, hf_model) -> Reference:
    return _reference(tiny_model_dirs["qwen3"], hf_model)


def _check(
    reference: Reference,
    outputs,
    indices: list[int],
    tolerance: float = LOGPROB_TOLERANCE,
    tie_gap: float = TIE_GAP,
) -> None:
    """Every output equals HF's tokens, or differs first at a reported near tie (HF's top-2
    logits within ``tie_gap``); logprobs within ``tolerance`` of HF's up to there."""
    assert [len(o.outputs) for o in outputs] == [1] * len(indices)
    failures = []
    for i, output in zip(indices, outputs):
        completion = output.outputs[0]
        ours, theirs = completion.token_ids, reference.tokens[i]
        logprobs = torch.log_softmax(reference.logits[i], dim=-1)
        assert len(ours) == NUM_NEW_TOKENS
        diverge = next((p for p, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        for p in range(NUM_NEW_TOKENS if diverge is None else diverge + 1):
            expected = logprobs[p, ours[p]].item()
            got = completion.logprobs[p][ours[p]]
            assert abs(got - expected) < tolerance, (i, p, got, expected)
        if diverge is None:
            continue
        top2 = reference.logits[i][diverge].topk(2).values
        gap = (top2[0] - top2[1]).item()
        where = f"{reference.model_dir.name} prompt {i} position {diverge}"
        if gap < tie_gap:
            warnings.warn(NearTieWarning(f"{where}: HF top-2 gap {gap:.2e}"), stacklevel=2)
        else:
            failures.append(f"{where}: ours {ours[diverge]} vs HF {theirs[diverge]}, gap {gap:.3g}")
    assert not failures, "\n".join(failures)


def _llm(reference: Reference, **engine_args) -> LLM:
    engine_args.setdefault("kv_cache_memory", SMALL_KV)
    # Explicit, so a CONVEYOR_TEST_DEVICE=cuda run compares float32 with float32 (dtype "auto"
    # would be bfloat16 there).
    engine_args.setdefault("dtype", MODEL_TEST_DTYPE)
    # In-process: these tests are about the model, scheduler and sampler, which are the same code
    # in both modes; the process path's parity with this one is tested in test_engine_client and
    # test_multiproc_executor, and an engine start per test would double this file's time.
    return LLM(
        str(reference.model_dir), engine="inprocess", block_size=BLOCK_SIZE, seed=0, **engine_args
    )


def test_batch_of_mixed_lengths_matches_hf(reference):
    with _llm(reference, max_num_seqs=8) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        llm.check_all_free()


def test_chunked_prefill_matches_hf(reference):
    with _llm(reference, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        assert llm.stats is not None and llm.stats.num_preemptions == 0


def test_prefix_cache_hits_match_hf(reference):
    with _llm(reference, enable_prefix_caching=True) as llm:
        first = llm.generate(reference.prompts[4], GREEDY, use_tqdm=False)
        _check(reference, first, [4])
        rest = [5, 6, 0, 7]
        outputs = llm.generate([reference.prompts[i] for i in rest], GREEDY, use_tqdm=False)
        _check(reference, outputs, rest)
        # Both sharers reuse the two full blocks of the common prefix.
        assert [o.num_cached_tokens for o in outputs[:2]] == [32, 32]
        assert llm.stats.prefix_cache_hits > 0
        llm.check_all_free()


def test_preemption_under_a_tiny_kv_pool_matches_hf(reference):
    # 10 blocks (one the null block): the longest request needs 6, so the batch cannot all fit.
    memory = 10 * reference.kv_bytes_per_block()
    with _llm(reference, kv_cache_memory=memory, max_num_seqs=8) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        assert llm.stats.num_preemptions > 0
        llm.check_all_free()


@pytest.mark.parametrize("tiny_pool", [False, True], ids=["roomy", "tiny-pool"])
def test_async_scheduling_matches_hf(qwen3_reference, tiny_pool):
    # The worker runs each step on the token it sampled the step before, which the engine has
    # not seen yet; chunked prompts and (with the tiny pool) preemption of requests whose token
    # is in flight must not change a single token.
    reference = qwen3_reference
    memory = 10 * reference.kv_bytes_per_block() if tiny_pool else SMALL_KV
    with _llm(
        reference,
        async_scheduling=True,
        kv_cache_memory=memory,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    ) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        assert (llm.stats.num_preemptions > 0) == tiny_pool
        llm.check_all_free()


@pytest.mark.parametrize("policy", ["prefill-first", "orca", "static"])
def test_every_policy_matches_hf(qwen3_reference, policy):
    # Policies are family-independent: one family keeps the suite fast. These policies run
    # whole prompts, so the budget must hold max_model_len.
    reference = qwen3_reference
    with _llm(reference, policy=policy, max_model_len=128, max_num_batched_tokens=128) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        llm.check_all_free()


def test_the_checker_reports_near_ties_and_fails_on_real_differences():
    """The parity check itself: a near tie is reported by a warning, anything else fails."""
    from types import SimpleNamespace

    logits = torch.zeros(NUM_NEW_TOKENS, 8)
    logits[:, 3] = 5.0
    logits[7, 4] = 5.0 - 1e-6  # position 7: tokens 3 and 4 tie within float error
    reference = SimpleNamespace(
        tokens=[[3] * NUM_NEW_TOKENS], logits=[logits], model_dir=Path("fake-model")
    )
    logprobs = torch.log_softmax(logits, dim=-1)

    def output(tokens):
        rows = [{t: logprobs[p, t].item()} for p, t in enumerate(tokens)]
        completion = SimpleNamespace(token_ids=tokens, logprobs=rows)
        return SimpleNamespace(outputs=[completion])

    _check(reference, [output([3] * NUM_NEW_TOKENS)], [0])
    tie = [3] * 7 + [4] * (NUM_NEW_TOKENS - 7)
    with pytest.warns(NearTieWarning, match="prompt 0 position 7"):
        _check(reference, [output(tie)], [0])
    wrong = [3] * 6 + [5] * (NUM_NEW_TOKENS - 6)
    with pytest.raises(AssertionError, match="position 6"):
        _check(reference, [output(wrong)], [0])


def test_the_embedded_default_model_matches_hf(hf_model):
    """The model ``conveyor serve`` ships with (trained, bfloat16 on disk) is an ordinary Qwen3
    checkpoint: the same parity as the random test models."""
    reference = _reference(DEFAULT_MODEL_DIR, hf_model)
    with _llm(reference, max_num_seqs=8) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))


def test_the_default_models_recommended_repetition_penalty_decodes_as_hf_does(hf_model):
    """What ``conveyor serve --demo-prompt`` shows: greedy with the repetition penalty of the
    model's generation_config.json, which HF ``generate`` applies by itself."""
    model = hf_model(DEFAULT_MODEL_DIR)
    penalty = model.generation_config.repetition_penalty
    assert penalty is not None and penalty > 1.0
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    prompts = ["def main():", "import os\n", "class Config:"]
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, repetition_penalty=penalty
    )
    with LLM(
        str(DEFAULT_MODEL_DIR), engine="inprocess", kv_cache_memory=SMALL_KV, dtype=MODEL_TEST_DTYPE
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    failures = []
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt).input_ids
        with torch.inference_mode():
            hf = model.generate(
                torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                eos_token_id=None, output_scores=True, return_dict_in_generate=True,
                pad_token_id=0,
            )  # fmt: skip
        ours, theirs = output.outputs[0].token_ids, hf.sequences[0, len(ids) :].tolist()
        diverge = next((p for p, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if diverge is None:
            continue
        top2 = hf.scores[diverge][0].topk(2).values  # after the penalty, as HF chose
        gap = (top2[0] - top2[1]).item()
        where = f"default model, prompt {prompt!r} position {diverge}"
        if gap < TIE_GAP:
            warnings.warn(NearTieWarning(f"{where}: HF top-2 gap {gap:.2e}"), stacklevel=2)
        else:
            failures.append(f"{where}: ours {ours[diverge]} vs HF {theirs[diverge]}, gap {gap:.3g}")
    assert not failures, "\n".join(failures)
