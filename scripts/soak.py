"""A soak run: a real server at 70 % of its capacity for M minutes, watched for leaks; see
``benchmarks.soak``.

    python scripts/soak.py --minutes 10 [--model DIR] [--rate R | --fraction 0.7]

Runs in its own process; the server it soaks runs in child processes. Results: docs/reliability.md.
"""

import sys

from benchmarks.soak.soak import main

if __name__ == "__main__":
    sys.exit(main())
