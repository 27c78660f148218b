"""A step with draft tokens: score every request's 1 + k positions in one forward pass, verify
the drafts, append what was accepted, and propose the next drafts.

Runs in worker processes. The model runner hands a step here when its diff carries drafts
(``SchedulerOutput.scheduled_spec_decode_tokens``); every other step takes the runner's own
path, untouched. Rows without drafts (a prompt's first token, no lookup match) are sampled
by the runner's sampler exactly as in a plain step; rows with drafts are verified by
``rejection_sampler.verify``. The drafts are written into the persistent batch after the row's
known tokens, where the step's inputs are gathered from, but not counted in ``num_tokens``: the
accepted ones are counted when appended, and the rejected ones are overwritten later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from conveyor.protocol import Logprobs, ModelRunnerOutput, SchedulerOutput
from conveyor.protocol.messages import STRUCTURED_OUTPUT_FAILURE
from conveyor.protocol.sampling_params import SamplingParams
from conveyor.protocol.speculative import MAX_BACKOFF_STEPS, SpeculativeConfig
from conveyor.worker.device_buffers import to_device
from conveyor.worker.input_batch import InputBatch
from conveyor.worker.prompt_logprobs import plan_prompt_logprobs
from conveyor.worker.sampler import logprobs_to_wire
from conveyor.worker.sampling_metadata import _effective_temperature, make_sampling_metadata
from conveyor.worker.spec_decode.draft_model import DraftModelProposer
from conveyor.worker.spec_decode.proposers import make_proposer
from conveyor.worker.spec_decode.rejection_sampler import verify
from conveyor.worker.step_inputs import StepInputs
from conveyor.worker.structured_output import GrammarRuntime

if TYPE_CHECKING:
    from conveyor.worker.model_runner import ModelRunner

LogprobRow = tuple[list[int], list[float], int]


class SpecDecoder:
    """The worker's half of speculative decoding: drafts in, verified tokens and drafts out."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        load_draft: Callable[[], DraftModelProposer] | None = None,
    ) -> None:
        self.config = config
        self.proposer = make_proposer(config, max_model_len, load_draft)
        # A draft model's proposer: its KV cache is sized and made with the target's.
        self.draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None

    @staticmethod
    def write_drafts(batch: InputBatch, drafts_by_req: dict[int, list[int]]) -> None:
        """Put each request's drafts after its known tokens, where its inputs are read."""
        for req_id, drafts in drafts_by_req.items():
            row = batch.row_of[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start : start + len(drafts)] = drafts

    def propose(self, batch: InputBatch, rows: list[int]) -> list[list[int]]:
        """Drafts for the rows that sampled (after their tokens were appended); none while the
        batch is past the off-switch. A draft model skips the rows whose drafts the engine
        core would drop (its back-off, mirrored here: its k forwards are not free)."""
        if batch.num_reqs > self.config.disable_by_batch_size or not rows:
            return []
        if self.draft is None:
            return self.proposer.propose(batch, rows)
        live = [row for row in rows if not _paused(batch.row_states[row])]
        drafts = dict(zip(live, self.proposer.propose(batch, live))) if live else {}
        return [drafts.get(row, []) for row in rows]

    @staticmethod
    def record_acceptance(batch: InputBatch, rows: list[int], tokens: dict[int, list[int]]) -> None:
        """The engine core's back-off rule (engine_core/spec_decode.py), per request: after two
        draft steps in a row with nothing accepted, no drafts for 2, 4, ... 32 steps."""
        for row in rows:
            state = batch.row_states[row]
            if len(tokens[row]) > 1:
                state.draft_misses = 0
                continue
            state.draft_misses += 1
            if state.draft_misses >= 2:
                state.draft_paused = min(1 << (state.draft_misses - 1), MAX_BACKOFF_STEPS)

    def execute(
        self,
        runner: ModelRunner,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        rows: np.ndarray,
        lora_step: bool = False,
    ) -> ModelRunnerOutput:
        batch = runner.batch
        drafts_by_req = scheduler_output.scheduled_spec_decode_tokens
        row_list = inputs.sampling_rows.tolist()
        plain = [row for row in row_list if batch.req_ids[row] not in drafts_by_req]
        spec = [row for row in row_list if batch.req_ids[row] in drafts_by_req]
        drafts = [drafts_by_req[batch.req_ids[row]] for row in spec]
        # The last flat-stream index of every scheduled row; a row with k drafts samples at its
        # last 1 + k positions.
        last = dict(zip(rows.tolist(), (inputs.metadata.query_start_loc_cpu[1:] - 1).tolist()))
        index = [last[row] for row in plain]
        for row, row_drafts in zip(spec, drafts):
            index += range(last[row] - len(row_drafts), last[row] + 1)
        index_tensor = to_device(torch.tensor(index, dtype=torch.int64), runner.device)
        inputs = dataclasses.replace(inputs, logits_indices=index_tensor)
        prompt_plan = plan_prompt_logprobs(batch, rows, inputs.metadata.query_start_loc_cpu)
        if prompt_plan is None:
            hidden = runner._forward(inputs, lora_step)
        else:
            hidden = runner._forward_with_prompt_rows(inputs, prompt_plan, lora_step)
        tokens: dict[int, list[int]] = {}
        logprob_rows: dict[int, list[LogprobRow]] = {}
        failed: dict[int, str] = {}
        if plain:
            failed = self._sample_plain(runner, plain, hidden[: len(plain)], tokens, logprob_rows)
        failed.update(
            self._verify(runner, spec, drafts, hidden[len(plain) :], tokens, logprob_rows)
        )
        if self.draft is not None:
            self.record_acceptance(batch, spec, tokens)
        for row in row_list:
            _append(batch, row, tokens[row])
        output = ModelRunnerOutput(
            step_id=scheduler_output.step_id,
            req_ids=[batch.req_ids[row] for row in row_list],
            sampled_token_ids=[token for row in row_list for token in tokens[row]],
            num_sampled_tokens=[len(tokens[row]) for row in row_list],
            failed_req_ids=[batch.req_ids[row] for row in failed],
            failure_reasons=[STRUCTURED_OUTPUT_FAILURE + reason for reason in failed.values()],
            grammars_ready=runner._grammars_ready(),
            spec_token_ids=self.propose(batch, row_list),
        )
        if logprob_rows:
            output.logprobs = _merge_logprobs(row_list, tokens, logprob_rows)
        params = [batch.row_states[row].sampling_params for row in row_list]
        if any(p.prompt_logprobs is not None for p in params):
            prompt_logprobs = runner._finished_prompt_logprobs(row_list)
            output.prompt_logprobs_req_ids = list(prompt_logprobs)
            output.prompt_logprobs = list(prompt_logprobs.values())
        return output

    @staticmethod
    def _sample_plain(
        runner: ModelRunner,
        rows: list[int],
        hidden: torch.Tensor,
        tokens: dict[int, list[int]],
        logprob_rows: dict[int, list[LogprobRow]],
    ) -> dict[int, str]:
        """Rows without drafts: the runner's own sampling, grammars included; the rows whose
        grammar failed, with the reason."""
        batch = runner.batch
        params = [batch.row_states[row].sampling_params for row in rows]
        matchers, ended = runner._grammar_matchers(rows, params)
        sampling = runner._sampling_metadata(rows, params, ended)
        output, failed = runner._sample(hidden, sampling, matchers)
        sampled = output.sampled_token_ids.tolist()
        for row, token_id, p in zip(rows, sampled, params):
            tokens[row] = [token_id]
            if p.grammar and batch.row_states[row].matcher is not None:
                GrammarRuntime.accept(batch.row_states[row].matcher, token_id)
        wire = logprobs_to_wire(output, [p.logprobs for p in params])
        if wire is not None:
            for i, row in enumerate(rows):
                logprob_rows[row] = [(wire.token_ids[i], wire.logprobs[i], wire.ranks[i])]
        return {rows[i]: reason for i, reason in failed.items()}

    @staticmethod
    def _verify(
        runner: ModelRunner,
        rows: list[int],
        drafts: list[list[int]],
        hidden: torch.Tensor,
        tokens: dict[int, list[int]],
        logprob_rows: dict[int, list[LogprobRow]],
    ) -> dict[int, str]:
        """Verify the rows' drafts; the rows whose grammar failed, with the reason."""
        if not rows:
            return {}
        batch = runner.batch
        logits = runner.model.compute_logits(hidden)
        grammar = _GrammarChecks(runner, rows, drafts)
        if grammar.truncated:
            # Drafts the grammar refuses can never be accepted: their positions are dropped.
            logits = logits[grammar.kept_positions(logits.device)]
            drafts = grammar.drafts
        params, prompts, outputs, num_outputs = [], [], [], []
        penalties = any(_has_penalty(batch.row_states[row].sampling_params) for row in rows)
        for row, row_drafts in zip(rows, drafts):
            p = batch.row_states[row].sampling_params
            num_output = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
            history = batch.output_token_ids(row).tolist() if penalties else []
            prompt = batch.prompt_token_ids(row).tolist() if penalties else []
            # Position j is scored as if drafts 1 .. j had been emitted.
            for j in range(len(row_drafts) + 1):
                params.append(p)
                num_outputs.append(num_output + j)
                prompts.append(prompt)
                outputs.append(history + row_drafts[:j] if penalties else [])
        metadata = make_sampling_metadata(
            params,
            {},
            prompts,
            outputs,
            runner.vocab_size,
            runner.device,
            num_outputs,
            runner.config.model.eos_token_ids,
            grammar_bitmask=grammar.bitmask,
            grammar_rows=grammar.positions,
        )
        row_params = [batch.row_states[row].sampling_params for row in rows]
        is_random = [_is_random(p) for p in row_params]
        generators = [batch.row_states[row].generator for row in rows]
        verified = verify(
            logits,
            drafts,
            metadata,
            is_random,
            generators,
            [p.logprobs for p in row_params],
            [
                _draft_probs(batch, row, d) if r else None
                for row, d, r in zip(rows, drafts, is_random)
            ],
        )
        for i, row in enumerate(rows):
            tokens[row] = verified.token_ids[i]
            if verified.logprob_rows is not None:
                logprob_rows[row] = verified.logprob_rows[i]
        grammar.accept(tokens)
        return grammar.failed


class _GrammarChecks:
    """Structured requests' drafts against their grammars: the longest prefix of each row's
    drafts the grammar allows, and the mask at every position of that prefix (the matcher is
    advanced over the drafts to compute them, then rolled back); after verification the
    matcher advances over the emitted tokens only."""

    def __init__(self, runner: ModelRunner, rows: list[int], drafts: list[list[int]]) -> None:
        self.rows = rows
        self.drafts = list(drafts)
        self.truncated = False
        self.failed: dict[int, str] = {}
        self.positions: list[int] | None = None
        self.bitmask: torch.Tensor | None = None
        self._matchers: dict[int, Any] = {}
        self._old_lengths = [len(d) for d in drafts]
        batch = runner.batch
        structured = [
            i for i, row in enumerate(rows) if batch.row_states[row].sampling_params.grammar
        ]
        if not structured:
            return
        grammars = runner._grammars
        if grammars is None:
            grammars = runner._grammars = runner._make_grammar_runtime()
        masks, positions, offset = [], [], 0
        offsets = []
        for row_drafts in self.drafts:
            offsets.append(offset)
            offset += len(row_drafts) + 1
        for i in structured:
            state = batch.row_states[self.rows[i]]
            if state.matcher is None:
                state.matcher = grammars.new_matcher(state.sampling_params.grammar)
            matcher = self._matchers[i] = state.matcher
            row_drafts = self.drafts[i]
            num_valid = 0 if matcher.is_stopped() else matcher.validate_tokens(row_drafts)
            if num_valid < len(row_drafts):
                self.drafts[i] = row_drafts = row_drafts[:num_valid]
                self.truncated = True
            for j in range(num_valid + 1):
                mask, failed = grammars.bitmask([(0, matcher)])
                if failed:
                    self.failed[self.rows[i]] = failed[0]
                masks.append(mask[0])
                positions.append((i, j))
                if j < num_valid:
                    matcher.consume_token(row_drafts[j])
            if num_valid:
                matcher.rollback(num_valid)
        # Positions in the (possibly truncated) layout: row i's positions after earlier rows'.
        new_offsets, offset = [], 0
        for row_drafts in self.drafts:
            new_offsets.append(offset)
            offset += len(row_drafts) + 1
        self._offsets = offsets
        self.positions = [new_offsets[i] + j for i, j in positions]
        self.bitmask = torch.stack(masks)

    def kept_positions(self, device: torch.device) -> torch.Tensor:
        """Indices of the positions that stay, in the layout the forward pass scored."""
        index = []
        for offset, row_drafts in zip(self._offsets, self.drafts):
            index += range(offset, offset + len(row_drafts) + 1)
        return torch.tensor(index, dtype=torch.int64, device=device)

    def accept(self, tokens: dict[int, list[int]]) -> None:
        for i, matcher in self._matchers.items():
            for token_id in tokens[self.rows[i]]:
                GrammarRuntime.accept(matcher, token_id)


def _append(batch: InputBatch, row: int, token_ids: list[int]) -> None:
    start = int(batch.num_tokens[row])
    if start + len(token_ids) > batch.max_model_len:
        raise RuntimeError("a request grew past max_model_len")
    batch.token_ids[row, start : start + len(token_ids)] = token_ids
    batch.num_tokens[row] = start + len(token_ids)


def _merge_logprobs(
    row_list: list[int], tokens: dict[int, list[int]], rows: dict[int, list[LogprobRow]]
) -> Logprobs:
    """One logprobs row per emitted token, in the output's order (empty for rows that did not
    ask, as ``logprobs_to_wire`` leaves them)."""
    merged = Logprobs(token_ids=[], logprobs=[], ranks=[])
    for row in row_list:
        row_rows = rows.get(row) or [([], [], 0)] * len(tokens[row])
        for token_ids, logprobs, rank in row_rows:
            merged.token_ids.append(token_ids)
            merged.logprobs.append(logprobs)
            merged.ranks.append(rank)
    return merged


def _draft_probs(batch: InputBatch, row: int, drafts: list[int]) -> torch.Tensor | None:
    """A draft model's distributions at the row's drafts ([len(drafts), V]); None for a
    proposer whose drafts are point masses (ngram)."""
    state = batch.row_states[row]
    if state.draft_probs is None:
        return None
    if state.draft_token_ids[: len(drafts)] != drafts:
        # The engine schedules only drafts made at the row's current length: anything else is
        # a bug, and q of other tokens would bias every sampled token.
        raise RuntimeError(
            f"request {state.req_id}: drafts scheduled that its draft model did not make"
        )
    return state.draft_probs[: len(drafts)]


def _paused(state: Any) -> bool:
    """Whether a request's drafts are paused for this step (counting the step)."""
    if state.draft_paused:
        state.draft_paused -= 1
        return True
    return False


def _is_random(params: SamplingParams) -> bool:
    return _effective_temperature(params) > 0.0


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )
