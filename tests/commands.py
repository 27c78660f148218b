"""How tests run conveyor's commands: the installed ``conveyor`` CLI, through this interpreter.

Runs in the test process. ``python -m entrypoints.cli`` is exactly what the ``conveyor`` console
script runs, and needs no PATH: tests work from any venv, editable or not.
"""

import sys

CONVEYOR = [sys.executable, "-m", "entrypoints.cli"]
