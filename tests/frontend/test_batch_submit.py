"""An offline batch reaches the engine process as one message, so its first step sees all of it.

Sent one by one, the first requests woke an idle engine before the rest had arrived; static
batching (which admits a batch only when the running one is done) then ran a batch of one or two
first, and the policy study measured that rather than the policy.
"""

from __future__ import annotations

import time

from conveyor.frontend import LLM
from conveyor.frontend.engine_client.sync_client import MPEngineClient
from conveyor.protocol import SamplingParams

PROMPTS = [f"def f{i}(x):\n    return" for i in range(8)]


def test_the_first_step_of_a_static_batch_holds_every_request(
    tiny_model_dir, tmp_path, monkeypatch
):
    from conveyor.engine_core.step_trace import read_trace

    # A busy client: every frame it sends leaves a gap in which the engine can wake and step.
    send = MPEngineClient._send

    def slow_send(self: MPEngineClient, frame: bytes) -> None:
        send(self, frame)
        time.sleep(0.02)

    monkeypatch.setattr(MPEngineClient, "_send", slow_send)
    trace = tmp_path / "steps.jsonl"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(
        str(tiny_model_dir),
        policy="static",
        max_num_seqs=len(PROMPTS),
        kv_cache_memory=32 << 20,
        trace_steps=str(trace),
    ) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4] * len(PROMPTS)
    records = read_trace(trace)  # complete once the engine has stopped
    assert records[0].num_reqs == len(PROMPTS)
    # Static batching: one batch, prefilled together, then decoded together to the end.
    assert len(records) == 4 and all(r.num_reqs == len(PROMPTS) for r in records)
