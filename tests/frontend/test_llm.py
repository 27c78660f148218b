"""The offline ``LLM`` API end to end on the tiny model: fan-out, stop strings, seeds, bad input."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.frontend import LLM
from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR
from conveyor.frontend.tokenizer import IncrementalDetokenizer
from conveyor.protocol import SamplingParams

SMALL_KV = 32 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def main():", "Once upon a time, in a land far away"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    with LLM(str(tiny_model_dir), kv_cache_memory=SMALL_KV, max_num_seqs=16) as llm:
        yield llm


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_one_output_per_prompt_in_order_for_text_and_token_prompts(llm):
    tokenizer = llm.get_tokenizer()
    token_prompt = tokenizer(PROMPTS[1]).input_ids
    outputs = llm.generate([PROMPTS[0], token_prompt, PROMPTS[2]], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == [PROMPTS[0], None, PROMPTS[2]]
    assert outputs[1].prompt_token_ids == token_prompt
    assert outputs[0].prompt_token_ids == tokenizer(PROMPTS[0]).input_ids
    assert len({o.request_id for o in outputs}) == 3
    for output in outputs:
        (completion,) = output.outputs
        assert len(completion.token_ids) == 24 and completion.finish_reason == "length"
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    # A prompt gets the same greedy tokens alone as in a batch, as text or as token ids.
    (alone,) = llm.generate(token_prompt, GREEDY, use_tqdm=False)
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids
    (single,) = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_n_fans_out_into_seeded_children(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in output.outputs]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) > 1, "seeded children must differ"
    # Child i is exactly a single request seeded with seed + i.
    for i, sample in enumerate(samples):
        child = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True)
        assert _tokens(llm.generate(PROMPTS[0], child, use_tqdm=False)) == [sample]
    unseeded = SamplingParams(n=4, temperature=1.0, max_tokens=5)
    assert len(llm.generate(PROMPTS[1], unseeded, use_tqdm=False)[0].outputs) == 4


def test_seeded_sampling_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _tokens(llm.generate(PROMPTS[2], seeded, use_tqdm=False))
    others = [
        SamplingParams(temperature=1.0, max_tokens=7),
        GREEDY,
        SamplingParams(temperature=0.5, seed=7, top_k=20, max_tokens=30),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], "x" * 50, PROMPTS[2]]
    batch = llm.generate(prompts, [*others, seeded], use_tqdm=False)
    assert _tokens(batch[3:]) == alone
    again = llm.generate([PROMPTS[2], PROMPTS[0]], [seeded, GREEDY], use_tqdm=False)
    assert _tokens(again[:1]) == alone


def _stop_candidate(text: str) -> str:
    """A 4-character piece of the text starting at its second half, printable ASCII."""
    for start in range(len(text) // 2, len(text) - 4):
        piece = text[start : start + 4]
        if piece.isascii() and piece.isprintable() and piece.strip():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_truncates_text_and_aborts_in_engine(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (full,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    full_text = full.outputs[0].text
    stop = _stop_candidate(full_text)
    expected = full_text[: full_text.find(stop)]
    with_stop = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop, "#@!"])
    (stopped,) = llm.generate(PROMPTS[0], with_stop, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == expected
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < 40
    assert completion.token_ids == full.outputs[0].token_ids[: len(completion.token_ids)]
    llm.check_all_free()  # the engine was told to abort: no blocks held
    keep = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    (kept,) = llm.generate(PROMPTS[0], keep, use_tqdm=False)
    assert kept.outputs[0].text == expected + stop
    never = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=["\x00never"])
    (unstopped,) = llm.generate(PROMPTS[0], never, use_tqdm=False)
    assert unstopped.outputs[0].finish_reason == "length"
    assert unstopped.outputs[0].text == full_text


def test_stop_token_id_ends_with_that_token(llm):
    (full,) = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    stop_token = full.outputs[0].token_ids[5]
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_token]
    )
    (stopped,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.token_ids[-1] == stop_token and len(completion.token_ids) <= 6
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)
    # The stop token counts as generated, but its text is not part of the output.
    tokenizer = llm.get_tokenizer()
    without_stop = tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=True)
    assert completion.text == without_stop


def test_logprobs_per_position(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, logprobs=3, ignore_eos=True)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == 10
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position and 3 <= len(position) <= 4
        assert all(v <= 0.0 for v in position.values())
    total = sum(p[t] for t, p in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(total)
    (greedy,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert greedy.outputs[0].logprobs is None and greedy.outputs[0].cumulative_logprob is None


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "empty"),
        ([], "empty"),
        ([2048], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        ([1] * 4096, "max_model_len"),
        (["a"], "string or a list of token ids"),
    ],
)
def test_bad_input_raises_and_the_llm_still_works(llm, prompt, message):
    (before,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[1], prompt], GREEDY, use_tqdm=False)
    llm.check_all_free()  # nothing of the batch reached the engine
    (after,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_mismatched_sampling_params_and_unknown_engine_args(llm, tiny_model_dir):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([PROMPTS[0]], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_model_dir), max_num_seq=4)


def test_interrupted_generate_leaves_the_engine_clean(llm, monkeypatch):
    (before,) = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    engine = llm._engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.setattr(engine, "step", real_step)
    llm.check_all_free()
    (after,) = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_progress_bar(llm, capsys):
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "tok/s" in err
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_no_model_means_the_embedded_default_model_and_it_writes_python():
    with LLM(kv_cache_memory=SMALL_KV) as llm:
        assert llm.config.model.model == str(DEFAULT_MODEL_DIR.resolve())
        params = SamplingParams(temperature=0.0, max_tokens=48)
        (output,) = llm.generate("def main():\n", params, use_tqdm=False)
    text = output.outputs[0].text
    # Trained on the standard library's source: keywords, calls, indentation.
    assert re.search(r"\b(return|self|if|for|import|None|def)\b", text), text
    assert "\n    " in text or "(" in text, text


def test_incremental_detokenizer_matches_full_decode(llm):
    tokenizer = llm.get_tokenizer()
    text = "naïve café — 你好, wörld ✓ done"
    token_ids = tokenizer(text).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=None)
    for token_id in token_ids:
        assert detokenizer.add_tokens([token_id]) is None
    assert detokenizer.text == tokenizer.decode(token_ids) == text
    # A stop string split across tokens is found, and the text cut before it.
    stopper = IncrementalDetokenizer(tokenizer, [], stop=["你好"])
    found = [stopper.add_tokens([t]) for t in token_ids]
    assert found[-1] == "你好" and stopper.text == "naïve café — "
    assert found.index("你好") < len(token_ids) - 1


# A script that ends without shutting its LLM down (the engine is stopped by the LLM's
# finalizer at exit), then one that uses it as a context manager.
_SCRIPT = """
import logging
import sys
from conveyor.frontend import LLM
from conveyor.protocol import SamplingParams

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
params = SamplingParams(temperature=0, max_tokens=4)
with LLM(sys.argv[1], kv_cache_memory=16 << 20) as llm:
    llm.generate(["def main():"], params, use_tqdm=False)
llm = LLM(sys.argv[1], kv_cache_memory=16 << 20)
print(len(llm.generate(["import os"], params, use_tqdm=False)[0].outputs[0].token_ids))
"""


@pytest.mark.slow
def test_a_finished_offline_run_prints_no_error(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_model_dir)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "engine session closed" in done.stderr  # said, at INFO
