"""One msgpack encoder/decoder pair per message direction, made once and reused.

Shared by every process. Decoders are typed, so a frame of the wrong shape raises
``msgspec.DecodeError``/``ValidationError`` instead of producing a half-valid object; receivers
log and drop such frames.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from conveyor.protocol.messages import (
    EngineCoreClientMessage,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreServerMessage,
    ModelRunnerOutput,
    SchedulerOutput,
)

T = TypeVar("T")


class WireCodec(Generic[T]):
    def __init__(self, message_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        return self._decoder.decode(frame)


ENGINE_INPUT: WireCodec[EngineCoreInput] = WireCodec(EngineCoreInput)
ENGINE_OUTPUT: WireCodec[EngineCoreOutputs] = WireCodec(EngineCoreOutputs)
SCHEDULER_OUTPUT: WireCodec[SchedulerOutput] = WireCodec(SchedulerOutput)
RUNNER_OUTPUT: WireCodec[ModelRunnerOutput] = WireCodec(ModelRunnerOutput)

# ZMQ sessions between frontends (DEALER) and the engine core (ROUTER).
CLIENT_TO_ENGINE: WireCodec[EngineCoreClientMessage] = WireCodec(EngineCoreClientMessage)
ENGINE_TO_CLIENT: WireCodec[EngineCoreServerMessage] = WireCodec(EngineCoreServerMessage)
