"""Entry points: the ``conveyor`` command and the processes it starts.

Runs in the processes users start (``conveyor ...``) and in the engine-core process
(``python -m conveyor.entrypoints.engine``). This is the one package that may import every other: it
assembles the engine core, the workers and the frontends into programs, so that they need not
know about each other.

  ``cli``            the ``conveyor`` command: one argparse subcommand per program
  ``serve``          ``conveyor serve``: the supervisor (engine core, workers, N HTTP frontends)
  ``supervisor``     watching, restarting and stopping the supervisor's children
  ``engine``         the engine-core process's main; builds the executor the engine drives
  ``generate``       ``conveyor generate``: one completion from the command line
  ``make_model``     ``python -m benchmarks make-model``: a random-weight test model in Hugging Face format
  ``gpu_check``      ``python -m benchmarks gpu-check``: CUDA tests and a speed table on a GPU machine
"""
