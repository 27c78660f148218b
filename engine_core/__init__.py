"""The engine core: requests, the paged-KV block accounting and the token-budget scheduler.

Runs in the engine-core process. Plain Python: importing it never imports torch.
"""

from conveyor.engine_core.engine_core import EngineCore
from conveyor.engine_core.kv_cache_manager import KVCacheManager
from conveyor.engine_core.request import Request, RequestStatus
from conveyor.engine_core.scheduler import Scheduler
from conveyor.executor.abstract import Executor

__all__ = ["EngineCore", "Executor", "KVCacheManager", "Request", "RequestStatus", "Scheduler"]
