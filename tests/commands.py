"""How tests run conveyor's commands: the installed ``conveyor`` CLI and the lab's, through this
interpreter.

Runs in the test process. ``python -m conveyor.entrypoints.cli`` is exactly what the ``conveyor``
console script runs, and needs no PATH: tests work from any venv, editable or not. The lab's
commands (``python -m benchmarks ...``) run from the checkout's root, as a developer runs them.
"""

import sys
from pathlib import Path

CONVEYOR = [sys.executable, "-m", "conveyor.entrypoints.cli"]
LAB = [sys.executable, "-m", "benchmarks"]
# The lab runs from here: its package is the checkout's benchmarks/ folder.
CHECKOUT = Path(__file__).resolve().parents[1]
