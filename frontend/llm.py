"""``LLM``: the offline Python API, shaped like ``vllm.LLM``.

Runs in the caller's process (a frontend); the engine runs in its own process (``engine="mp"``,
the default) or, for debugging, in this one (``engine="inprocess"``). ``generate`` goes through the
same pipeline as the HTTP server: the ``InputProcessor`` tokenizes and checks every prompt first
(so a bad one raises ``ValueError`` before anything reaches the engine) and fans ``n > 1`` out
into n engine requests; the ``OutputProcessor`` turns the engine's outputs into text, applying
stop strings (a stopped request is aborted in the engine) and collecting logprobs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from conveyor.frontend.engine_args import engine_args_from_kwargs
from conveyor.frontend.engine_client import InProcessEngineClient, MPEngineClient
from conveyor.frontend.input_processor import Choice, InputProcessor
from conveyor.frontend.model_source import resolve_adapter
from conveyor.frontend.output_processor import OutputProcessor, ProcessedOutputs
from conveyor.frontend.outputs import RequestOutput, prompt_position_logprobs
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import FAILED_FINISH_REASONS, SamplingParams, SchedulerStats
from conveyor.protocol.lora import LoRARequest, read_adapter
from conveyor.runtime.gc_heap import freeze_startup_heap, unfreeze_heap

PromptType = Union[str, list[int]]


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
        """``model``: a Hugging Face model directory, or an id (from the Hugging Face cache, else
        downloaded from the Hub first); None: the embedded default model.

        ``engine``: "mp" (an engine-core process) or "inprocess" (this process, debugging).
        ``executor_backend`` picks the engine process's workers: "mp" (worker processes, the
        default) or "inprocess" (one worker inside the engine process).
        """
        if engine not in ("mp", "inprocess"):
            raise ValueError(f"engine must be 'mp' or 'inprocess', got {engine!r}")
        # The engine is private to this LLM: answering block-accounting queries exposes nothing.
        engine_args.setdefault("enable_debug_queries", True)
        # A script's output is its own: no periodic stats lines unless asked (as vLLM's LLM).
        engine_args.setdefault("stats_interval_s", 0.0)
        args = engine_args_from_kwargs(model, engine_args)
        config = args.create_engine_config()
        if config.parallel.data_parallel_size > 1:
            # One engine behind one client here; several are `conveyor serve`'s (its frontends
            # route between them).
            raise ValueError(
                "LLM drives one engine: data_parallel_size > 1 is served by "
                "`conveyor serve --data-parallel-size N`"
            )
        self.tokenizer = load_tokenizer(config.model.tokenizer_dir)
        self._engine: InProcessEngineClient | MPEngineClient
        if engine == "mp":
            self._engine = MPEngineClient(
                config, executor_backend=executor_backend, client_name="LLM"
            )
        else:
            self._engine = InProcessEngineClient(config)
        # The engine's config, with the KV pool size it learned at start-up.
        self.config = self._engine.config
        self.input_processor = InputProcessor(self.config, self.tokenizer, strict_context=False)
        self._next_id = itertools.count()
        # This process's heap (the model too, with engine="inprocess") out of full collections;
        # shutdown gives it back, since a notebook's process goes on without this engine.
        freeze_startup_heap()

    @property
    def stats(self) -> SchedulerStats | None:
        """The engine's latest scheduler stats (counters are cumulative since start)."""
        return self._engine.stats

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's own defaults (``generation_config``)."""
        return self.input_processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in prompt order, each with n ``CompletionOutput``s.

        ``lora_request``: the LoRA adapter to run under (an ``LLM(..., enable_lora=True)``),
        one for every prompt or one per prompt (None: the base model).
        """
        results, choices, owners = self._prepare(prompts, sampling_params, lora_request)
        processor = OutputProcessor(choice.state for choice in choices)
        try:
            self._submit(choices)
            self._run(processor, _Progress(owners, len(results), use_tqdm))
        except BaseException:
            self._engine.abort(processor.unfinished_request_ids())
            self._drain()
            raise
        for choice in choices:
            result = results[owners[choice.request.request_id]]
            result.outputs.append(choice.state.to_completion_output())
            result.num_cached_tokens = max(result.num_cached_tokens, choice.state.num_cached_tokens)
            if result.prompt_logprobs is None and choice.state.prompt_logprobs is not None:
                result.prompt_logprobs = prompt_position_logprobs(choice.state.prompt_logprobs)
        return results

    def shutdown(self) -> None:
        self._engine.shutdown()
        unfreeze_heap()

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> tuple[list[RequestOutput], list[Choice], dict[str, int]]:
        """Every prompt checked before any is sent: one RequestOutput per prompt, every choice,
        and which prompt (result index) each choice's request id belongs to."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            # The model author's defaults (generation_config.json), as vLLM's LLM uses them.
            sampling_params = self.input_processor.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
        loras = self._lora_requests(lora_request, len(prompts))
        processor = self.input_processor
        token_ids = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            token_ids.append(processor.to_token_ids(prompt))
            processor.check_prompt(token_ids[-1], params.max_tokens, i)
        results, choices, owners = [], [], {}
        arrival_time = time.monotonic()
        for i, (prompt, ids, params) in enumerate(zip(prompts, token_ids, params_list)):
            request_id = str(next(self._next_id))
            text = prompt if isinstance(prompt, str) else None
            results.append(RequestOutput(request_id, text, ids))
            for choice in processor.make_choices(
                [ids], params, request_id, arrival_time, lora_request=loras[i]
            ):
                choices.append(choice)
                owners[choice.request.request_id] = i
        return results, choices, owners

    def _lora_requests(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked: a ValueError before anything runs."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise ValueError(f"got {len(loras)} LoRA requests for {num_prompts} prompts")
        lora_config = self.config.lora
        resolved: dict[LoRARequest, LoRARequest] = {}
        for lora in {lora for lora in loras if lora is not None}:
            if lora_config is None:
                raise ValueError("a LoRA request needs an engine made with enable_lora=True")
            # A Hugging Face id: its cached (or downloaded) snapshot, as vLLM takes them.
            folder = resolve_adapter(lora.lora_path)
            read_adapter(folder, self.config.model.model, lora_config.max_lora_rank)
            resolved[lora] = LoRARequest(lora.lora_name, lora.lora_int_id, folder)
        return [None if lora is None else resolved[lora] for lora in loras]

    def _submit(self, choices: list[Choice]) -> None:
        # One message: the whole batch is in the engine before its first step.
        for output in self._engine.add_requests([choice.request for choice in choices]):
            if output.finish_reason in FAILED_FINISH_REASONS:
                raise ValueError(f"request rejected: {output.stop_reason}")

    def _run(self, processor: OutputProcessor, progress: _Progress) -> None:
        with progress.bar:
            while processor.num_unfinished:
                if not self._engine.has_unfinished_requests():
                    raise RuntimeError("the engine finished without ending every request")
                outputs = self._engine.step()
                if outputs is None:
                    continue
                processed = processor.process_outputs(outputs)
                progress.record(processed)
                self._engine.abort(processed.to_abort)

    def _drain(self) -> None:
        """Step until aborted requests have left the engine, so the next call starts clean."""
        while self._engine.has_unfinished_requests():
            self._engine.step()


class _Progress:
    """Drives the progress bar: one tick per finished prompt, with the output rate."""

    def __init__(self, owners: dict[str, int], num_prompts: int, use_tqdm: bool) -> None:
        self._owners = owners
        self._remaining = [0] * num_prompts
        for owner in owners.values():
            self._remaining[owner] += 1
        self._num_output_tokens = 0
        self._start = time.perf_counter()
        self.bar = tqdm(total=num_prompts, desc="Processed prompts", disable=not use_tqdm)

    def record(self, processed: ProcessedOutputs) -> None:
        self._num_output_tokens += processed.num_new_tokens
        for choice in processed.finished:
            owner = self._owners[choice.request_id]
            self._remaining[owner] -= 1
            if self._remaining[owner] == 0:
                elapsed = max(time.perf_counter() - self._start, 1e-9)
                rate = self._num_output_tokens / elapsed
                self.bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                self.bar.update(1)
