"""The model runner: one worker's model, KV cache and persistent batch; runs one step at a time.

Runs in worker processes. Each step: fold the scheduler's diff into the persistent batch, gather
the flat token stream, build the sampling inputs, run the model (a decode-only step on CUDA
replays captured graphs), compute logits only for requests that sample, sample, and append the
sampled tokens to the worker's own mirror (they never come back from the engine).

On CUDA a step never waits on the device but once: every input goes up asynchronously before the
forward is launched, and the sampled tokens come down through an event (worker/device_buffers.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Any

import torch

from conveyor.protocol import (
    EngineConfig,
    Logprobs,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from conveyor.protocol.messages import STRUCTURED_OUTPUT_FAILURE
from conveyor.protocol.speculative import SpeculativeConfig
from conveyor.worker.attention.selector import select_backend
from conveyor.worker.cuda_graphs import (
    DecodeGraphs,
    capture_decode_graphs,
    capture_sizes,
    capture_whole_decode_graphs,
)
from conveyor.worker.device_buffers import HostCopier
from conveyor.worker.host_memory import place_weights_on_huge_pages
from conveyor.worker.input_batch import InputBatch
from conveyor.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    CudaMemory,
    attach_kv_caches,
    claim_cuda_memory,
    gpu_memory_utilization,
    layers_bytes_per_block,
    num_blocks_for_memory,
    resolve_kv_cache_dtype,
    weight_huge_pages_enabled,
)
from conveyor.worker.layers.cpu_ops import small_linear_enabled
from conveyor.worker.loader import load_model, resolve_dtype
from conveyor.worker.lora import LoRAManager, triton_lora
from conveyor.worker.memory_profile import profile_num_blocks
from conveyor.worker.native import warn_if_torch_runs_above_the_isa
from conveyor.worker.prompt_logprobs import (
    PromptLogprobsPlan,
    plan_prompt_logprobs,
    record_prompt_logprobs,
    take_prompt_logprobs,
)
from conveyor.worker.sampler import Sampler, SamplerOutput, logprobs_to_wire
from conveyor.worker.sampling_metadata import (
    SamplingMetadata,
    make_sampling_metadata,
    with_grammar_bitmask,
)
from conveyor.worker.spec_decode.draft_model import DraftModelProposer
from conveyor.worker.spec_decode.spec_step import SpecDecoder
from conveyor.worker.step_inputs import StepInputBuffers, StepInputs
from conveyor.worker.structured_output import GrammarRuntime

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, device: torch.device, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache.block_size
        self.dtype = resolve_dtype(config.model.dtype, device, config.model.model)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.cache_dtype, self.dtype, device)
        if device.type == "cpu":
            warn_if_torch_runs_above_the_isa()
            small_linear_enabled()  # a bad CONVEYOR_SMALL_LINEAR fails the start, not a step
        # CUDA: where this engine's memory accounting starts (before its weights), and a clear
        # error now if its share of the device is not free.
        self.memory_baseline: CudaMemory | None = None
        self.gpu_memory_utilization = gpu_memory_utilization(
            config.cache.gpu_memory_utilization, device
        )
        if self.gpu_memory_utilization is not None:
            self.memory_baseline = claim_cuda_memory(device, self.gpu_memory_utilization)
        self.model = load_model(
            config.model.model, self.dtype, device, tp_rank, tp_size, config.model.quantization
        )
        if device.type == "cpu" and weight_huge_pages_enabled():
            # A decode step streams every weight: whole 2 MiB pages for it to stream through.
            place_weights_on_huge_pages(self.model)
        # LoRA slots in every adaptable layer (--enable-lora); None: the base model only.
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            # Made before the memory profile captures graphs: the slots and the slot buffer
            # (a graph input) keep the addresses the graphs bake in.
            self.lora = LoRAManager(
                self.model,
                config.lora,
                config.model.model,
                self.dtype,
                device,
                max_num_tokens=config.scheduler.max_num_batched_tokens,
            )
        self.vocab_size = config.model.vocab_size
        self.attention_layers = self.model.attention_layers()
        needs_sinks = any(layer.sinks is not None for layer in self.attention_layers)
        self.backend = select_backend(
            device,
            self.block_size,
            config.attention_backend,
            dtype=self.dtype,
            needs_sinks=needs_sinks,
            kv_dtype=self.kv_dtype,
        )
        self.sampler = Sampler()
        max_model_len = config.scheduler.max_model_len
        self.batch = InputBatch(
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=max_model_len,
            max_blocks_per_req=-(-max_model_len // self.block_size),
            make_generator=self._make_generator,
        )
        self.inputs = StepInputBuffers(self.batch, config.scheduler.max_num_batched_tokens, device)
        self._host_copier = HostCopier(device)
        # Captured while profiling memory on CUDA (capture_cuda_graphs); None: every step eager.
        self.decode_graphs: DecodeGraphs | None = None
        self.cuda_graph_bytes = 0
        # What the memory profile set aside for graphs (whole graphs: measured on its stand-in).
        self.profiled_graph_bytes = 0
        # Set once the memory profile has measured whole-forward graphs on its stand-in cache:
        # the cache the next initialize_cache makes is the one they are captured on.
        self._whole_graphs_due = False
        self.num_blocks: int | None = None
        # Structured outputs, made when the first structured request arrives: its tokenizer
        # then loads on a thread while that request's prompt is computed (and never, for a
        # server that gets none).
        self._grammars: GrammarRuntime | None = None
        # Speculative decoding (worker/spec_decode/): proposes drafts, verifies scheduled ones.
        spec = config.scheduler.speculative
        self.spec_decoder = None
        if spec is not None:
            self.spec_decoder = SpecDecoder(
                spec, max_model_len, lambda: self._load_draft(spec, tp_rank, tp_size)
            )

    def _load_draft(self, spec: SpeculativeConfig, tp_rank: int, tp_size: int) -> Any:
        """The draft model of ``draft_model`` speculation, loaded like the target (same dtype,
        same sharding) with an attention backend of its own."""
        return DraftModelProposer(
            spec,
            max_model_len=self.config.scheduler.max_model_len,
            max_num_tokens=self.config.scheduler.max_num_batched_tokens,
            block_size=self.block_size,
            vocab_size=self.vocab_size,
            device=self.device,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            make_backend=lambda needs_sinks: select_backend(
                self.device,
                self.block_size,
                self.config.attention_backend,
                dtype=self.dtype,
                needs_sinks=needs_sinks,
                kv_dtype=self.kv_dtype,
            ),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def _make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ KV cache

    def bytes_per_block(self) -> int:
        """A block's bytes on this rank: the target's K/V and, with a draft model, the draft's
        (it shares the target's block ids: worker/spec_decode/draft_model.py)."""
        draft = self._draft()
        own = layers_bytes_per_block(self.attention_layers, self.block_size, self.kv_dtype)
        return own + (draft.bytes_per_block() if draft is not None else 0)

    def _draft(self) -> DraftModelProposer | None:
        return self.spec_decoder.draft if self.spec_decoder is not None else None

    def determine_num_blocks(self) -> int:
        """Blocks this rank can hold: a byte budget on CPU, measured free memory on CUDA (or the
        byte budget where one is set, checked against it)."""
        if self.device.type == "cuda":
            return profile_num_blocks(self, self.gpu_memory_utilization)
        memory = self.config.cache.kv_cache_memory
        if memory is None:
            memory = DEFAULT_CPU_KV_CACHE_MEMORY
        return num_blocks_for_memory(memory, self.bytes_per_block())

    def capture_cuda_graphs(self) -> int:
        """Capture the decode graphs (CUDA, unless enforce_eager); the device bytes they keep.

        Called by the memory profiler after its worst-case step and before the KV cache exists,
        so the bytes returned are left out of the cache's budget. Piecewise graphs never read
        the cache and stay. Whole-forward graphs (a backend with ``full_decode_graphs``) bake in
        the cache's address: they are captured here on a one-block stand-in cache to measure
        what they keep, let go, and captured again on the real cache by ``initialize_cache``
        (they keep ~66 MiB where the pieces keep ~1.7 GiB on Qwen3-0.6B, so budgeting the
        pieces would leave that much of the share unused). Where the whole capture fails, the
        pieces are captured and budgeted instead. A model whose forward cannot be captured at
        all (an op that reads a device value on the host) runs eagerly, with a warning saying
        why.
        """
        if not self._graphs_wanted():
            return 0
        sched = self.config.scheduler
        sizes = capture_sizes(sched.max_num_seqs, sched.max_num_batched_tokens)
        if self.backend.full_decode_graphs:
            kept = self._measure_whole_decode_graphs(sizes)
            if kept is not None:
                self._whole_graphs_due = True
                self.cuda_graph_bytes = self.profiled_graph_bytes = kept
                return kept
        reserved = self._settled_reserved_bytes()
        start = time.perf_counter()
        try:
            with self._lora_capture():
                self.decode_graphs = capture_decode_graphs(
                    self.model,
                    self.inputs.input_ids.device_tensor,
                    self.inputs.positions.device_tensor,
                    sizes,
                    self.block_size,
                )
        except Exception as error:  # capture refuses ops that sync; eager still works
            logger.warning(
                "CUDA graphs off, decode steps run eagerly: capturing the model failed (%s: %s)",
                type(error).__name__,
                error,
            )
            self.decode_graphs = None
        kept = max(0, self._settled_reserved_bytes() - reserved)
        self.cuda_graph_bytes = self.profiled_graph_bytes = kept
        if self.decode_graphs is not None:
            logger.info(
                "captured decode CUDA graphs for %d batch sizes (1 .. %d) in %.1f s, %.0f MiB",
                len(sizes),
                sizes[-1],
                time.perf_counter() - start,
                kept / (1 << 20),
            )
        return kept

    def _graphs_wanted(self) -> bool:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        if self.lora is not None:
            # A graph holds the LoRA layers' Triton launches, reading each token's slot from
            # the slot buffer; the torch loop groups tokens on the host each step instead.
            reason = triton_lora.unavailable_reason()
            if reason is not None:
                logger.warning(
                    "CUDA graphs off, decode steps run eagerly: LoRA under graphs needs the "
                    "Triton LoRA kernels, and %s",
                    reason,
                )
                return False
        return True

    def _lora_capture(self) -> contextlib.AbstractContextManager:
        """Around a graph capture: LoRA layers launch their kernels on every row."""
        return self.lora.capturing() if self.lora is not None else contextlib.nullcontext()

    def _measure_whole_decode_graphs(self, sizes: list[int]) -> int | None:
        """Capture the whole-forward graphs on a one-block stand-in cache (a padded step reads
        no block and writes none), note the bytes they keep, and let both go: what the real
        capture will keep, or None where the capture failed (the pieces are measured then)."""
        self.initialize_cache(1)
        reserved = self._settled_reserved_bytes()
        try:
            self.decode_graphs = self._whole_graphs_on_bound_cache(sizes)
        except Exception as error:  # noqa: BLE001 - any capture failure leaves the pieces
            logger.warning(
                "whole-forward decode graphs failed (%s: %s): attention runs between graph "
                "pieces instead",
                type(error).__name__,
                error,
            )
            self.decode_graphs = None
        kept = max(0, self._settled_reserved_bytes() - reserved)
        captured = self.decode_graphs is not None
        self.decode_graphs = None
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.num_blocks = None
        gc.collect()  # a graph's output tensors and pool go with their last reference
        self._settled_reserved_bytes()
        return kept if captured else None

    def _whole_graphs_on_bound_cache(self, sizes: list[int]) -> DecodeGraphs:
        with self._lora_capture():
            return capture_whole_decode_graphs(
                self.model,
                self.inputs.input_ids.device_tensor,
                self.inputs.positions.device_tensor,
                sizes,
                self.inputs.graph_metadata,
            )

    def _settled_reserved_bytes(self) -> int:
        """The device bytes torch's allocator holds once queued work is done and its cache is
        given back: before and after a capture, their difference is what the graphs keep."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def kv_sliding_window(self) -> int | None:
        """How far back every layer attends (None: some layer sees the whole context)."""
        return self.model.kv_sliding_window()

    def initialize_cache(self, num_blocks: int) -> None:
        attach_kv_caches(
            self.attention_layers, num_blocks, self.block_size, self.kv_dtype, self.device,
            self.backend,
        )  # fmt: skip
        if self._draft() is not None:
            self._draft().initialize_cache(num_blocks)  # type: ignore[union-attr]
        self.num_blocks = num_blocks
        if self._whole_graphs_due:
            self._whole_graphs_due = False
            self._capture_whole_decode_graphs()

    def _capture_whole_decode_graphs(self) -> None:
        """Capture the whole-forward graphs on the KV cache just made (they bake in its
        address), the sizes the profile measured on its stand-in cache. If this capture fails
        where that one did not, decode steps run eagerly: the budget left no room for pieces.
        """
        sizes = capture_sizes(
            self.config.scheduler.max_num_seqs, self.config.scheduler.max_num_batched_tokens
        )
        reserved = self._settled_reserved_bytes()
        start = time.perf_counter()
        try:
            self.decode_graphs = self._whole_graphs_on_bound_cache(sizes)
        except Exception as error:  # noqa: BLE001 - eager still works
            logger.warning(
                "CUDA graphs off, decode steps run eagerly: the whole-forward graphs failed on "
                "the KV cache (%s: %s) after passing on the memory profile's stand-in",
                type(error).__name__,
                error,
            )
            self.decode_graphs = None
            return
        self.cuda_graph_bytes = max(0, self._settled_reserved_bytes() - reserved)
        logger.info(
            "captured whole-forward decode CUDA graphs (attention inside) for %d batch sizes "
            "(1 .. %d) in %.1f s, %.0f MiB (the memory profile measured %.0f MiB)",
            len(sizes),
            sizes[-1],
            time.perf_counter() - start,
            self.cuda_graph_bytes / (1 << 20),
            self.profiled_graph_bytes / (1 << 20),
        )

    def release(self) -> None:
        """Let go of every device tensor: the KV cache, the graphs and their pool, the weights.

        An in-process engine's close (``LLM`` in a notebook, a test) leaves its process running;
        without this its cache stays allocated and the next engine on the device finds its share
        taken. A worker process exits right after and loses nothing by it.
        """
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.attention_layers = []
        if self._draft() is not None:
            self._draft().release()  # type: ignore[union-attr]
        self.decode_graphs = None
        self.model = None
        self.num_blocks = None
        if self.device.type == "cuda":
            gc.collect()  # the model's modules hold reference cycles
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.batch
        batch.apply(scheduler_output)
        if scheduler_output.lora_loads and self.lora is not None:
            self.lora.apply_loads(scheduler_output.lora_loads)
        self._prepare_grammars(scheduler_output)
        rows = batch.scheduled_rows()
        if len(rows) == 0:
            # Grammars to build, or the engine polling for them: nothing else to do meanwhile.
            return ModelRunnerOutput(
                step_id=scheduler_output.step_id,
                grammars_ready=self._grammars_ready(scheduler_output.grammar_wait_s),
            )
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if drafts:
            SpecDecoder.write_drafts(batch, drafts)
        lora_step = False
        if self.lora is not None:
            rows, lora_step = self._begin_lora_step(rows)
        graphs = self.decode_graphs
        inputs = self.inputs.prepare(
            batch, rows, self.block_size, graphs.padded_size if graphs and graphs.whole else None
        )
        if drafts:
            return self.spec_decoder.execute(  # type: ignore[union-attr]
                self, scheduler_output, inputs, rows, lora_step
            )
        row_list = inputs.sampling_rows.tolist()
        params = [batch.row_states[row].sampling_params for row in row_list]
        # The sampling inputs are built before the forward is launched: their uploads queue
        # ahead of the model's kernels, and no host work stands between forward and sampler.
        matchers, ended = self._grammar_matchers(row_list, params)
        sampling = self._sampling_metadata(row_list, params, ended) if row_list else None
        prompt_plan = plan_prompt_logprobs(batch, rows, inputs.metadata.query_start_loc_cpu)
        if prompt_plan is None:
            hidden = self._forward(inputs, lora_step)
        else:
            hidden = self._forward_with_prompt_rows(inputs, prompt_plan, lora_step)
        if sampling is None:
            return ModelRunnerOutput(
                step_id=scheduler_output.step_id, grammars_ready=self._grammars_ready()
            )
        output, failed = self._sample(hidden, sampling, matchers)
        sampled = output.sampled_token_ids.numpy()
        batch.append_sampled(inputs.sampling_rows, sampled)
        if any(p.grammar for p in params):
            for row, token_id in zip(row_list, sampled.tolist()):
                matcher = batch.row_states[row].matcher
                if matcher is not None:
                    GrammarRuntime.accept(matcher, token_id)
        prompt_logprobs = {}
        if any(p.prompt_logprobs is not None for p in params):
            prompt_logprobs = self._finished_prompt_logprobs(row_list)
        return ModelRunnerOutput(
            step_id=scheduler_output.step_id,
            spec_token_ids=(
                self.spec_decoder.propose(batch, row_list) if self.spec_decoder is not None else []
            ),
            req_ids=[batch.req_ids[row] for row in row_list],
            sampled_token_ids=sampled.tolist(),
            logprobs=logprobs_to_wire(output, [p.logprobs for p in params]),
            failed_req_ids=[batch.req_ids[row_list[i]] for i in failed],
            failure_reasons=[STRUCTURED_OUTPUT_FAILURE + reason for reason in failed.values()],
            grammars_ready=self._grammars_ready(),
            prompt_logprobs_req_ids=list(prompt_logprobs),
            prompt_logprobs=list(prompt_logprobs.values()),
        )

    def _begin_lora_step(self, rows: Any) -> tuple[Any, bool]:
        """The step's rows ordered by LoRA slot (each adapter's tokens one run of the flat
        stream), and whether any runs an adapter."""
        lora, batch = self.lora, self.batch
        assert lora is not None
        lora_ids = [batch.row_states[row].lora_id for row in rows.tolist()]
        return lora.begin_step(rows, lora_ids, batch.num_scheduled_tokens)

    def _forward_all_rows(self, inputs: StepInputs, index: torch.Tensor) -> torch.Tensor:
        """The model over every row, then ``index``'s rows: a LoRA step's layers read the whole
        stream's grouping, so the last layer may not drop rows part-way."""
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.metadata, None)
        return hidden.index_select(0, index)

    def _forward_with_prompt_rows(
        self, inputs: StepInputs, plan: PromptLogprobsPlan, lora_step: bool = False
    ) -> torch.Tensor:
        """The sampling rows' hidden states, as ``_forward``; on the way, the prompt positions'
        rows go through the LM head into their requests' prompt logprobs (eagerly: a step with a
        prompt chunk is no decode graph's)."""
        prompt_index = torch.tensor(plan.indices, dtype=torch.int64, device=self.device)
        index = torch.cat([prompt_index, inputs.logits_indices.to(self.device)])
        if lora_step:
            hidden = self._forward_all_rows(inputs, index)
        else:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.metadata, index)
        num_prompt = len(plan.indices)
        record_prompt_logprobs(
            plan, hidden[:num_prompt], self.model.compute_logits, self.vocab_size
        )
        return hidden[num_prompt:]

    def _finished_prompt_logprobs(self, row_list: list[int]) -> dict[int, Logprobs]:
        """The prompt logprobs of requests that sample their first token now, by req_id."""
        finished = {}
        for row in row_list:
            state = self.batch.row_states[row]
            if state.sampling_params.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                finished[state.req_id] = take_prompt_logprobs(state)
        return finished

    def _grammars_ready(self, wait_s: float = 0.0) -> list[int]:
        return self._grammars.take_ready(wait_s) if self._grammars is not None else []

    def _prepare_grammars(self, scheduler_output: SchedulerOutput) -> None:
        """Start building the matchers of structured requests off the step: those the engine
        holds back until their grammar is built (reported in ``grammars_ready``), and any
        arriving request whose template is gone (built again before it first samples)."""
        arriving = [
            new.sampling_params.grammar
            for new in scheduler_output.scheduled_new_reqs
            if new.sampling_params.grammar
        ]
        if not (arriving or scheduler_output.grammar_req_ids):
            return
        if self._grammars is None:
            self._grammars = self._make_grammar_runtime()
        for req_id, grammar in zip(scheduler_output.grammar_req_ids, scheduler_output.grammars):
            self._grammars.prepare_for(req_id, grammar)
        for grammar in arriving:
            self._grammars.prepare(grammar)

    def _forward(self, inputs: StepInputs, lora_step: bool = False) -> torch.Tensor:
        """Hidden states of the tokens that sample: a graph replay when one fits, else eager.

        A replay computes every row, as a LoRA step needs (its layers' slots were filled for
        the whole stream by ``LoRAManager.begin_step``, padding rows -1)."""
        graphs = self.decode_graphs
        num_tokens = inputs.num_tokens
        if graphs is not None and inputs.decode_only and graphs.padded_size(num_tokens):
            hidden = graphs.run(num_tokens, inputs.metadata)
            if inputs.every_token_samples:
                return hidden
            return hidden.index_select(0, inputs.logits_indices)
        if lora_step:
            return self._forward_all_rows(inputs, inputs.logits_indices)
        # Only the sampled rows leave the last layer: the rest only had to fill the KV cache.
        return self.model.forward(
            inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices
        )

    def _sample(
        self, hidden: torch.Tensor, sampling: SamplingMetadata, matchers: list[tuple[int, Any]]
    ) -> tuple[SamplerOutput, dict[int, str]]:
        """Logits, then the sampler; its output on the host, and the sampling rows whose grammar
        failed (with the reason)."""
        failed: dict[int, str] = {}
        if matchers:
            # The one sampling input filled after the forward was launched: the grammar masks
            # are host work (Rust threads, GIL released) that overlaps the GPU's forward.
            bitmask, failed_rows = self._grammars.bitmask(matchers)
            grammar_rows = [i for i, _ in matchers]
            failed = {grammar_rows[row]: reason for row, reason in failed_rows.items()}
            sampling = with_grammar_bitmask(sampling, bitmask, grammar_rows, self.device)
        logits = self.model.compute_logits(hidden)
        return self._host_copier.to_host(self.sampler(logits, sampling)), failed

    def _sampling_metadata(
        self, rows: list[int], params: list[SamplingParams], grammar_ended: set[int]
    ) -> SamplingMetadata:
        batch = self.batch
        generators = {}
        for i, row in enumerate(rows):
            generator = batch.row_states[row].generator
            if generator is not None:
                generators[i] = generator
        # Only penalties read token histories; skip copying them out otherwise.
        if any(_has_penalty(p) for p in params):
            prompts = [batch.prompt_token_ids(row).tolist() for row in rows]
            outputs = [batch.output_token_ids(row).tolist() for row in rows]
        else:
            prompts = outputs = [[] for _ in rows]
        num_output_tokens = None
        if any(p.min_tokens for p in params):
            num_output_tokens = (batch.num_tokens[rows] - batch.num_prompt_tokens[rows]).tolist()
        return make_sampling_metadata(
            params,
            generators,
            prompts,
            outputs,
            self.vocab_size,
            self.device,
            num_output_tokens,
            self.config.model.eos_token_ids,
            grammar_ended_rows=grammar_ended,
        )

    def _grammar_matchers(
        self, rows: list[int], params: list[SamplingParams]
    ) -> tuple[list[tuple[int, Any]], set[int]]:
        """(sampling row, matcher) of each structured row, and the rows whose grammar is
        complete (min_tokens gives way to EOS there)."""
        if not any(p.grammar for p in params):
            return [], set()
        if self._grammars is None:  # a request resumed into a worker that never saw it arrive
            self._grammars = self._make_grammar_runtime()
        matchers = []
        for i, (row, p) in enumerate(zip(rows, params)):
            if p.grammar:
                state = self.batch.row_states[row]
                if state.matcher is None:
                    state.matcher = self._grammars.new_matcher(p.grammar)
                matchers.append((i, state.matcher))
        return matchers, {i for i, matcher in matchers if matcher.is_stopped()}

    def _make_grammar_runtime(self) -> GrammarRuntime:
        model = self.config.model
        return GrammarRuntime(model.tokenizer_dir, self.vocab_size, model.eos_token_ids)


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )
