"""The repository's folders: the product's, which install as ``conveyor.<folder>``, and the lab's.

Runs in the test process (the import rules and the install test read it).
"""

# conveyor/ is the package's root; each of these installs as conveyor.<folder>.
PRODUCT = (
    "protocol",
    "runtime",
    "engine_core",
    "executor",
    "worker",
    "frontend",
    "entrypoints",
    "bench",
)
# Run from a checkout, never installed.
LAB = ("benchmarks", "scripts", "tests")
