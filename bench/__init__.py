"""The benchmarks users run, installed: ``conveyor bench serve`` (the load generator, ``loadgen``,
a client of any OpenAI-compatible server), ``conveyor bench offline`` (throughput through
``LLM.generate``), ``conveyor plot-trace``, and ``machine`` (what every run reports about the
machine it ran on).

Runs in the benchmark's own process. The engine's micro-benchmarks and studies are the lab's,
in the repository's ``benchmarks/`` folder (``python -m benchmarks``), never installed.
"""
