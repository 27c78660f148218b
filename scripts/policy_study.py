"""The scheduling-policy study (about 10 minutes on 2 cores); see ``benchmarks.policy_study``.

    python scripts/policy_study.py [--smoke | --long] [--out DIR]

Runs in its own process; what it measures runs in child processes. Results: docs/policy_study/.
"""

import sys

from benchmarks.policy_study.study import main

if __name__ == "__main__":
    sys.exit(main())
