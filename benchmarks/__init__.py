"""The lab: micro-benchmarks, studies, simulators, soak runs, the comparison against other engines,
the GPU check and the test-model generators. Run from a checkout (``python -m benchmarks``), never
installed; it imports the installed ``conveyor`` package, and nothing installed imports it.

Runs in the benchmark's own process. The product's own benchmarks (``conveyor bench serve``, the
load generator, and ``conveyor bench offline``) live in ``conveyor.bench``.
"""
