"""msgpack codecs for each channel direction (one encoder, one decoder per union), and for the
launch struct each child reads whole from its stdin."""

from __future__ import annotations

import sys
from typing import Any, BinaryIO, Generic, TypeVar

import msgspec

from mlxd.protocol import exit_codes
from mlxd.protocol.messages import (
    FromEngine,
    FromStorage,
    ToChild,
    ToEngine,
    ToStorage,
    ToSupervisor,
)
from mlxd.protocol.settings import EngineLaunch, Launch, ProxyLaunch, StorageLaunch

T = TypeVar("T")
L = TypeVar("L", EngineLaunch, ProxyLaunch, StorageLaunch)


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


def encode_launch(launch: Launch) -> bytes:
    return msgspec.msgpack.encode(launch)


def decode_launch(data: bytes, kind: type[L]) -> L:
    """Types and bounds are checked again here: a bad launch is a DecodeError/ValidationError."""
    return msgspec.msgpack.decode(data, type=kind)


def read_launch(kind: type[L], stream: BinaryIO | None = None) -> L:
    """A child's launch struct: its parent writes it on the child's stdin and closes it."""
    stream = sys.stdin.buffer if stream is None else stream
    if stream.isatty():
        raise SystemExit(f"this process reads its {kind.__name__} (msgpack) on stdin; "
                         "`mlxd serve` starts it")
    try:
        return decode_launch(stream.read(), kind)
    except msgspec.DecodeError as e:  # a parent of another version: retrying cannot help
        print(f"bad {kind.__name__} on stdin: {e}", file=sys.stderr, flush=True)
        raise SystemExit(exit_codes.CONFIG_ERROR) from None
