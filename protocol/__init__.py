"""Messages, sampling parameters and configuration shared by every conveyor process.

This is the only package the frontend, the engine core and the workers all import. It never
imports torch.
"""

from conveyor.protocol.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    check_engine_config,
    load_model_config,
)
from conveyor.protocol.messages import (
    FAILED_FINISH_REASONS,
    ITERATION_TOKENS_BUCKETS,
    Abort,
    CachedRequestData,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    RequestTimings,
    SchedulerOutput,
    SchedulerStats,
)
from conveyor.protocol.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "FAILED_FINISH_REASONS",
    "ITERATION_TOKENS_BUCKETS",
    "Abort",
    "CacheConfig",
    "CachedRequestData",
    "ConfigError",
    "EngineConfig",
    "EngineCoreInput",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "FinishReason",
    "Logprobs",
    "ModelConfig",
    "ModelRunnerOutput",
    "NewRequestData",
    "ObservabilityConfig",
    "ParallelConfig",
    "RequestTimings",
    "SamplingParams",
    "StructuredOutputsParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "check_engine_config",
    "load_model_config",
]
