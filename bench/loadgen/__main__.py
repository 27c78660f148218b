"""``python -m conveyor.bench.loadgen``: the load generator (``conveyor bench serve``)."""

import sys

from conveyor.bench.loadgen.main import main

if __name__ == "__main__":
    sys.exit(main())
