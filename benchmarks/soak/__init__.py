"""The soak test (``python -m benchmarks soak``): a real server under load for minutes, sampled for
leaks (``samples``) and checked at the end (``soak``).

Runs in the soak's own process; the server runs in child processes.
"""
