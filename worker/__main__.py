"""``python -m conveyor.worker``: start one worker process (see ``worker.worker_process``).

Runs in a worker process, started by the multi-process executor in the engine-core process.
"""

import sys

from conveyor.worker.worker_process import main

if __name__ == "__main__":
    sys.exit(main())
