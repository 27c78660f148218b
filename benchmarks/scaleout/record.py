"""A real engine's step trace on the simulation's workload, to fit the simulated step time to.

Runs in the benchmark's own process (the engine in its own processes, as ``LLM`` starts it).
The sessions are sent turn by turn: every session's first turn at once, then every second turn
(each holding the first reply the engine really gave), and so on, so the trace has steps of
every kind the simulation makes: long prompts, prompts whose prefix is cached, chunks beside
decodes, decode-only steps of many sizes.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.scaleout.workload import Workload, WorkloadConfig
from conveyor import LLM, SamplingParams


def record_trace(
    model: str,
    trace: Path,
    num_sessions: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    workload_config: WorkloadConfig,
) -> None:
    vocab_size = workload_config.vocab_size
    with LLM(
        model,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        trace_steps=str(trace),
    ) as llm:
        model_vocab = llm.config.model.vocab_size
        if model_vocab < vocab_size:
            raise ValueError(f"the workload's vocab ({vocab_size}) exceeds the model's")
        workload = Workload(workload_config)
        sessions = workload.sessions(rate=1.0, duration_s=1e9, max_sessions=num_sessions)
        while sessions:
            prompts = [session.next_prompt() for session in sessions]
            params = [
                SamplingParams(
                    max_tokens=session.max_tokens[session.turn], temperature=0.0, ignore_eos=True
                )
                for session in sessions
            ]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            sessions = [
                session
                for session, output in zip(sessions, outputs)
                if session.replied(list(output.outputs[0].token_ids))
            ]
