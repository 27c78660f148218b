"""The process topology below the engine core: who runs a step, and where.

Runs in the engine-core process. The engine core sees only the ``Executor`` interface
(``abstract``); the implementations sit beside it:

  ``abstract``          ``Executor`` (a step split into submit and wait) and ``InlineExecutor``
  ``inprocess``         ``InProcessExecutor``: one worker in this process (TP=1; debugging, LLM)
  ``multiproc``         ``MultiprocExecutor``: one worker per tensor-parallel rank, over ZeroMQ
  ``worker_processes``  the ranks as local processes: their sockets, launches and deaths
  ``node_link``         ranks on other hosts: the port layout and heartbeats with them
  ``ray_workers``       the ranks as Ray actors in a placement group (``--executor-backend ray``)
  ``backends``          ``make_executor``: a backend by name, its modules imported only then

Imports protocol and runtime; the worker package (and torch) only where a rank runs in this
process (inside the function that builds it) or in a Ray actor (``ray_workers``).
"""
