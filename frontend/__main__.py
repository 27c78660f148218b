"""``python -m conveyor.frontend``: one HTTP frontend process (see ``frontend.server.main``).

Runs as an HTTP frontend process, started by the supervisor; people type ``conveyor frontend``.
"""

import sys

from conveyor.frontend.server.main import main

if __name__ == "__main__":
    sys.exit(main())
