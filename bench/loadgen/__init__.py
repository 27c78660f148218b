"""The load generator (``conveyor bench serve``): open-loop load against any OpenAI-compatible
server, with ``vllm bench serve``'s report keys.

Runs in its own process. A client of the HTTP API only: it imports nothing of the engine.
  ``main``        the command: ready check, warm-ups, one run or a capacity search, the report
  ``args``        its flags (vLLM's names where they exist)
  ``datasets``    random, sharegpt-like, prefix-sharing and JSONL requests, seeded
  ``runner``      arrivals (gamma, concurrency cap, duration, cancellations) and the run itself
  ``client``      one streamed request, timed chunk by chunk
  ``metrics``     TTFT/TPOT/ITL/E2E statistics, goodput, vLLM's throughput buckets
  ``capacity``    the highest rate within a p99 inter-token SLO (bracketing, then bisection)
  ``ready``       waiting for a server that is still starting
  ``plot``        latency CDFs and throughput over time
  ``selftest``    how fast this client itself is, against the fake server
  ``fake_server`` an OpenAI-compatible server that streams with set delays (tests, demos)
"""
