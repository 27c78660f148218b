"""The engine core: requests, the paged-KV block accounting and the token-budget scheduler.

Runs in the engine-core process. Plain Python: importing it never imports torch.
"""

from engine_core.engine_core import EngineCore
from engine_core.executor import Executor
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler

__all__ = ["EngineCore", "Executor", "KVCacheManager", "Request", "RequestStatus", "Scheduler"]
