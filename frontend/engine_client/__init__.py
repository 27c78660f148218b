"""How a frontend reaches an engine: three clients with the same requests-in, outputs-out shape.

Runs in the frontend process.
  ``MPEngineClient``        blocking, over ZMQ to an engine-core process (``LLM``'s default);
  ``AsyncEngineClient``     asyncio, over ZMQ, one output stream per request (HTTP servers);
  ``InProcessEngineClient`` the engine core and one worker in this process, stepped by the
                            caller (debugging: one process, one stack trace).
The two ZMQ clients share ``EngineClientBase`` (``core_client``): the handshake, liveness, frame
handling and death are written once. ``EngineProcess`` starts an engine-core process.
"""

from conveyor.frontend.engine_client.async_client import AsyncEngineClient
from conveyor.frontend.engine_client.engine_process import EngineProcess
from conveyor.frontend.engine_client.inprocess_client import InProcessEngineClient
from conveyor.frontend.engine_client.session import EngineDeadError, EngineStartError
from conveyor.frontend.engine_client.sync_client import MPEngineClient

__all__ = [
    "AsyncEngineClient",
    "EngineDeadError",
    "EngineProcess",
    "EngineStartError",
    "InProcessEngineClient",
    "MPEngineClient",
]
