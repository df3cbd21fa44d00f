"""msgpack codecs for each channel direction (one encoder, one decoder per union)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from mlxd.protocol.messages import (FromEngine, FromStorage, ToChild, ToEngine, ToStorage,
                                    ToSupervisor)

T = TypeVar("T")


class Codec(Generic[T]):
    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)


def to_engine() -> Codec[ToEngine]:
    return Codec(ToEngine)


def from_engine() -> Codec[FromEngine]:
    return Codec(FromEngine)


def to_supervisor() -> Codec[ToSupervisor]:
    return Codec(ToSupervisor)


def to_child() -> Codec[ToChild]:
    return Codec(ToChild)


def to_storage() -> Codec[ToStorage]:
    return Codec(ToStorage)


def from_storage() -> Codec[FromStorage]:
    return Codec(FromStorage)
