"""One stand-in frontend process for the metrics tests: ``python -m tests.frontend.metrics_process
JSON`` records what JSON says into ``FrontendMetrics`` and prints the merged scrape if asked.

Runs in a process of its own (prometheus_client's multiprocess mode is per process and chosen
when the library loads), with ``PROMETHEUS_MULTIPROC_DIR`` set by the test. JSON keys:
``finished``: [[reason, num_prompt, num_generated], ...] choices to record, each with its tokens
one output at a time; ``stats``: SchedulerStats fields to publish; ``in_flight``: requests in
flight to publish; ``render``: print the scrape. The first line printed is the process's pid.
"""

from __future__ import annotations

import json
import os
import sys
import time

from conveyor.frontend.output_processor import ChoiceState
from conveyor.frontend.server.metrics import FrontendMetrics
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RequestTimings,
    SamplingParams,
    SchedulerConfig,
    SchedulerStats,
)
from conveyor.protocol.speculative import SpeculativeConfig

CONFIG = EngineConfig(
    model=ModelConfig("m", "Qwen3ForCausalLM", vocab_size=100, max_model_len=512),
    cache=CacheConfig(block_size=16, num_blocks=64),
    scheduler=SchedulerConfig(max_model_len=512, speculative=SpeculativeConfig()),
)


def record_choice(
    metrics: FrontendMetrics, reason: str, num_prompt: int, num_generated: int
) -> None:
    """A choice that arrived a second ago and got a token every 0.1 s from 0.1 s on."""
    params = SamplingParams(max_tokens=num_generated)
    arrival = time.monotonic() - 1.0
    choice = ChoiceState(0, "r", None, list(range(num_prompt)), params, arrival, False)
    for i in range(num_generated):
        previous = choice.last_token_time
        choice.token_ids.append(1)
        choice.last_token_time = arrival + 0.1 * (i + 1)
        metrics.observe_tokens(choice, 1, previous)
    metrics.observe_finished(choice, reason, RequestTimings(0.25, 0.5, 1.0))
    metrics.observe_request([choice], 1)


def main(spec: dict) -> None:
    print(os.getpid(), flush=True)  # the first line: who this frontend was
    metrics = FrontendMetrics(CONFIG, "m")
    for reason, num_prompt, num_generated in spec.get("finished", []):
        record_choice(metrics, reason, num_prompt, num_generated)
    stats = SchedulerStats(**spec["stats"]) if "stats" in spec else None
    metrics.publish(stats, spec.get("in_flight", 0))
    if spec.get("render"):
        sys.stdout.write(metrics.render().decode())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
