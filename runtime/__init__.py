"""The one process runtime: how every conveyor process is started, tied to its parent, signalled,
stopped and logged.

Runs in every conveyor process: the supervisor, the engine core, the workers and the frontends.
Standard library only (no torch, no other conveyor package), so each of them may import it, the
worker included: like ``protocol/``, it sits below the import fence. ``zmq_security`` alone adds
pyzmq, which every conveyor process loads anyway.

  ``processes``  spawn ``python -m <module>`` children, stop them, scan the process tree
  ``parent``     die with the parent: the kernel's parent-death signal, a pid watch, a pipe watch
  ``signals``    SIGTERM/SIGINT as one ``ShutdownRequested``, held while a child is spawned
  ``dirs``       private (0700) runtime folders for ipc:// sockets and rendezvous files
  ``logs``       one log-line format that names the process
  ``exit_codes`` what a conveyor process's exit status means
  ``gc_heap``    the start-up heap frozen out of full garbage collections
  ``zmq_security`` CURVE keys on TCP sockets between processes; no unauthenticated network address
  ``refused_keys`` the keys a CURVE server refused: counted, remembered and logged within bounds
  ``flags``      the number types of the commands' flags: NaN and infinity never get through
"""
