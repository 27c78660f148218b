"""``python -m benchmarks.loadgen``: the load generator (``conveyor bench serve``)."""

import sys

from benchmarks.loadgen.main import main

if __name__ == "__main__":
    sys.exit(main())
