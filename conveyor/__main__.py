"""``python -m conveyor``: the ``conveyor`` command (see ``conveyor.entrypoints.cli``).

Runs in the process the user starts.
"""

import sys

from conveyor.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
