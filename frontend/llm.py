"""``LLM``: the offline Python API, shaped like ``vllm.LLM``.

Runs in the caller's process (a frontend); the engine runs in its own process (``engine="mp"``,
the default) or, for debugging, in this one (``engine="inprocess"``). ``generate`` tokenizes and
validates every prompt first (so a bad one raises ``ValueError`` before anything reaches the
engine), fans ``n > 1`` out into n engine requests, steps the engine until every request is done,
and applies stop strings on the detokenized text, aborting a stopped request in the engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import msgspec
from tqdm.auto import tqdm

from frontend.engine_args import engine_args_from_kwargs
from frontend.engine_client import InProcessEngineClient, MPEngineClient
from frontend.outputs import RequestOutput
from frontend.sample_tracker import SampleTracker
from frontend.tokenizer import load_tokenizer
from frontend.validation import context_limit, find_kv_cache_problem, find_prompt_problem
from protocol import FAILED_FINISH_REASONS, EngineCoreRequest, SamplingParams, SchedulerStats

PromptType = Union[str, list[int]]


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    # One entry per sample (n > 1 fans out into n single-sample requests).
    samples: list[SamplingParams]


class LLM:
    """Offline batch generation: ``LLM(model_dir).generate(prompts, SamplingParams(...))``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        engine: str = "mp",
        executor_backend: str | None = None,
        **engine_args: Any,
    ) -> None:
        """``engine``: "mp" (an engine-core process) or "inprocess" (this process, debugging).

        ``executor_backend`` picks the engine process's workers: "mp" (worker processes, the
        default) or "inprocess" (one worker inside the engine process).
        """
        if engine not in ("mp", "inprocess"):
            raise ValueError(f"engine must be 'mp' or 'inprocess', got {engine!r}")
        if model is None:
            model = str(_default_model())
        # The engine is private to this LLM: answering block-accounting queries exposes nothing.
        engine_args.setdefault("enable_debug_queries", True)
        args = engine_args_from_kwargs(model, engine_args)
        self.config = args.create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model.model)
        self._engine: InProcessEngineClient | MPEngineClient
        if engine == "mp":
            self._engine = MPEngineClient(
                self.config, executor_backend=executor_backend, client_name="LLM"
            )
        else:
            self._engine = InProcessEngineClient(self.config)
        self._next_id = itertools.count()
        # The engine's latest scheduler stats (counters are cumulative since start).
        self.stats: SchedulerStats | None = None

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in prompt order, each with n ``CompletionOutput``s."""
        batch = self._prepare(prompts, sampling_params)
        trackers: dict[str, SampleTracker] = {}
        owners: dict[str, int] = {}
        results = [RequestOutput(str(next(self._next_id)), p.text, p.token_ids) for p in batch]
        for i, prompt in enumerate(batch):
            for sample, params in enumerate(prompt.samples):
                request_id = f"{results[i].request_id}-{sample}"
                trackers[request_id] = SampleTracker(
                    self.tokenizer, prompt.token_ids, params, sample
                )
                owners[request_id] = i
        try:
            self._submit(batch, trackers, owners)
            self._run(trackers, owners, results, use_tqdm)
        except BaseException:
            self._engine.abort([rid for rid, t in trackers.items() if not t.finished])
            self._drain()
            raise
        for request_id, tracker in trackers.items():
            result = results[owners[request_id]]
            result.outputs.append(tracker.to_output())
            result.num_cached_tokens = max(result.num_cached_tokens, tracker.num_cached_tokens)
        return results

    def shutdown(self) -> None:
        self._engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def check_all_free(self) -> None:
        """AssertionError unless no request is left and every KV block is free again."""
        self._engine.check_all_free()

    # ------------------------------------------------------------------ steps of generate

    def _prepare(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[_Prompt]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
        # The engine's config: with the KV pool size it learned at start-up.
        config = self._engine.config
        max_model_len = context_limit(config)
        batch = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            text, token_ids = self._tokenize(prompt)
            problem = find_prompt_problem(token_ids, config.model.vocab_size, max_model_len)
            if problem is None:
                # The engine caps max_tokens at the context: the pool need hold no more.
                room = max_model_len - len(token_ids)
                max_tokens = None if params.max_tokens is None else min(params.max_tokens, room)
                problem = find_kv_cache_problem(len(token_ids), max_tokens, config.cache)
            if problem is not None:
                raise ValueError(f"prompt {i}: {problem}")
            batch.append(_Prompt(text, token_ids, _fan_out(params)))
        return batch

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        try:
            return None, [int(t) for t in prompt]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a prompt must be a string or a list of token ids: {exc}") from None

    def _submit(
        self, batch: list[_Prompt], trackers: dict[str, SampleTracker], owners: dict[str, int]
    ) -> None:
        eos = list(self.config.model.eos_token_ids)
        now = time.time()
        requests = [
            EngineCoreRequest(
                request_id,
                batch[owners[request_id]].token_ids,
                tracker.sampling_params,
                now,
                eos_token_ids=eos,
            )
            for request_id, tracker in trackers.items()
        ]
        # One message: the whole batch is in the engine before its first step.
        for output in self._engine.add_requests(requests):
            if output.finish_reason in FAILED_FINISH_REASONS:
                raise ValueError(f"request rejected: {output.stop_reason}")

    def _run(
        self,
        trackers: dict[str, SampleTracker],
        owners: dict[str, int],
        results: list[RequestOutput],
        use_tqdm: bool,
    ) -> None:
        progress = _Progress(owners, len(results), use_tqdm)
        with progress.bar:
            while progress.num_unfinished:
                if not self._engine.has_unfinished_requests():
                    raise RuntimeError("the engine finished without ending every request")
                outputs = self._engine.step()
                if outputs is None:
                    continue
                if outputs.scheduler_stats is not None:
                    self.stats = outputs.scheduler_stats
                to_abort = []
                for output in outputs.outputs:
                    tracker = trackers.get(output.request_id)
                    if tracker is None or tracker.finished:
                        continue
                    if tracker.update(output):
                        to_abort.append(output.request_id)
                    progress.record(output.request_id, len(output.new_token_ids), tracker.finished)
                self._engine.abort(to_abort)

    def _drain(self) -> None:
        """Step until aborted requests have left the engine, so the next call starts clean."""
        while self._engine.has_unfinished_requests():
            self._engine.step()


class _Progress:
    """Counts unfinished samples and drives the progress bar (one tick per finished prompt)."""

    def __init__(self, owners: dict[str, int], num_prompts: int, use_tqdm: bool) -> None:
        self._owners = owners
        self._remaining = [0] * num_prompts
        for owner in owners.values():
            self._remaining[owner] += 1
        self.num_unfinished = len(owners)
        self._num_output_tokens = 0
        self._start = time.perf_counter()
        self.bar = tqdm(total=num_prompts, desc="Processed prompts", disable=not use_tqdm)

    def record(self, request_id: str, num_new_tokens: int, finished: bool) -> None:
        self._num_output_tokens += num_new_tokens
        if finished:
            self.num_unfinished -= 1
            owner = self._owners[request_id]
            self._remaining[owner] -= 1
            if self._remaining[owner] == 0:
                elapsed = max(time.perf_counter() - self._start, 1e-9)
                rate = self._num_output_tokens / elapsed
                self.bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                self.bar.update(1)


def _fan_out(params: SamplingParams) -> list[SamplingParams]:
    """n samples -> n single-sample requests; seeded ones get seed + i so they differ."""
    if params.n == 1:
        return [params]
    return [
        msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


def _default_model() -> Any:
    # The default tiny model is made on first use by the worker package's model maker.
    from worker.model_maker import ensure_default_model

    return ensure_default_model()
