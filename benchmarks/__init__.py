"""Benchmarks and studies: ``conveyor bench serve|offline|scheduler|wire|attention|layers``.

Runs in the benchmark's own process. ``loadgen`` is a client of the HTTP API alone (it imports
nothing of the engine, so it measures any OpenAI-compatible server); ``offline``, ``scheduler``,
``wire``, ``attention`` and ``layers`` time the engine's own parts; ``policy_study`` and ``soak``
are the longer studies the scripts in ``scripts/`` run; ``machine`` says what a run ran on.
"""
